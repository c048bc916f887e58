//! Output queues sent over TLS on io_uring, for both sides (the server's replies, the
//! client's requests): the plaintext of the queued segments (see `gather`) is encrypted
//! into a ciphertext buffer, a bounded batch at a time, and one `send` at a time takes
//! that ciphertext to the socket. Nothing more is encrypted until the last batch is all
//! sent, so the buffer a send reads does not change under it.
//!
//! Not for receiving: each side decrypts into buffers of its own.

use std::collections::VecDeque;
use std::io::Write;
use std::os::fd::RawFd;

use io_uring::{opcode, squeue, types};

use crate::gather::Segment;

/// What encrypts: a rustls connection of either side.
pub(crate) trait Encrypt {
    /// Takes plaintext to encrypt.
    fn encrypt(&mut self, plain: &[u8]) -> std::io::Result<()>;
    /// Whether TLS records wait to be written out.
    fn has_records(&self) -> bool;
    /// Writes waiting TLS records into `out`.
    fn records_into(&mut self, out: &mut Vec<u8>) -> std::io::Result<usize>;
}

impl Encrypt for rustls::ServerConnection {
    fn encrypt(&mut self, plain: &[u8]) -> std::io::Result<()> {
        self.writer().write_all(plain)
    }

    fn has_records(&self) -> bool {
        self.wants_write()
    }

    fn records_into(&mut self, out: &mut Vec<u8>) -> std::io::Result<usize> {
        self.write_tls(out)
    }
}

impl Encrypt for rustls::ClientConnection {
    fn encrypt(&mut self, plain: &[u8]) -> std::io::Result<()> {
        self.writer().write_all(plain)
    }

    fn has_records(&self) -> bool {
        self.wants_write()
    }

    fn records_into(&mut self, out: &mut Vec<u8>) -> std::io::Result<usize> {
        self.write_tls(out)
    }
}

/// A TLS connection's ciphertext on its way to the socket.
pub(crate) struct TlsOut {
    raw: Vec<u8>,
    /// Bytes of `raw` sent.
    sent: usize,
}

impl TlsOut {
    /// An empty buffer with room for `capacity` bytes of ciphertext (it grows to a batch
    /// and the records around it).
    pub(crate) fn with_capacity(capacity: usize) -> TlsOut {
        TlsOut {
            raw: Vec::with_capacity(capacity),
            sent: 0,
        }
    }

    /// Whether ciphertext waits to be sent.
    pub(crate) fn pending(&self) -> bool {
        self.sent < self.raw.len()
    }

    /// Once the last batch is all sent, encrypts the next: at most `batch` bytes of the
    /// plaintext of `out`, starting `*out_sent` bytes into its front segment (encrypted
    /// already) and leaving there how far the new front is encrypted. Each segment
    /// encrypted whole leaves the queue, to `done`. Records rustls has of its own (an
    /// alert, a key update) go out too, with or without a segment.
    pub(crate) fn fill<E: Encrypt, S: Segment>(
        &mut self,
        tls: &mut E,
        out: &mut VecDeque<S>,
        out_sent: &mut usize,
        batch: usize,
        mut done: impl FnMut(S),
    ) -> std::io::Result<()> {
        if self.pending() {
            return Ok(());
        }
        self.raw.clear();
        self.sent = 0;
        let mut room = batch;
        while room > 0 {
            let Some(seg) = out.front() else { break };
            let (head, data) = (seg.head(), seg.data());
            let total = head.len() + data.len();
            let (from, to) = (*out_sent, (*out_sent + room).min(total));
            debug_assert!(from < total || total == 0, "the front was encrypted whole");
            if from < head.len() {
                tls.encrypt(&head[from..to.min(head.len())])?;
            }
            if to > head.len() {
                let d = from.max(head.len()) - head.len();
                tls.encrypt(&data[d..to - head.len()])?;
            }
            room -= to - from;
            if to == total {
                *out_sent = 0;
                if let Some(seg) = out.pop_front() {
                    done(seg);
                }
            } else {
                *out_sent = to;
            }
        }
        while tls.has_records() {
            tls.records_into(&mut self.raw)?;
        }
        Ok(())
    }

    /// The send of the ciphertext not sent yet, if any. Whoever pushes it keeps this
    /// buffer (and the socket) alive until it completes, and calls [`TlsOut::sent`] then;
    /// `fill` leaves the buffer alone meanwhile.
    pub(crate) fn send_entry(&self, fd: RawFd) -> Option<squeue::Entry> {
        if !self.pending() {
            return None;
        }
        let rest = &self.raw[self.sent..];
        // A send may take less than asked (as the socket may): `sent` counts what it took.
        let len = rest.len().min(u32::MAX as usize) as u32;
        Some(
            opcode::Send::new(types::Fd(fd), rest.as_ptr(), len)
                .flags(libc::MSG_NOSIGNAL)
                .build(),
        )
    }

    /// `n` more bytes of the ciphertext went out.
    pub(crate) fn sent(&mut self, n: usize) {
        debug_assert!(self.sent + n <= self.raw.len(), "sent more than was there");
        self.sent += n;
        if self.sent >= self.raw.len() {
            self.raw.clear();
            self.sent = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// "Encryption" that copies plaintext into records as it is, and can be told to fail
    /// or to hold a record of its own.
    #[derive(Default)]
    struct Plain {
        records: Vec<u8>,
        fail: bool,
    }

    impl Encrypt for Plain {
        fn encrypt(&mut self, plain: &[u8]) -> std::io::Result<()> {
            if self.fail {
                return Err(std::io::Error::other("refused"));
            }
            self.records.extend_from_slice(plain);
            Ok(())
        }

        fn has_records(&self) -> bool {
            !self.records.is_empty()
        }

        fn records_into(&mut self, out: &mut Vec<u8>) -> std::io::Result<usize> {
            // A few bytes at a time, as rustls writes one record per call.
            let n = self.records.len().min(7);
            out.extend(self.records.drain(..n));
            Ok(n)
        }
    }

    struct Seg(Vec<u8>, Vec<u8>);

    impl Segment for Seg {
        fn head(&self) -> &[u8] {
            &self.0
        }
        fn data(&self) -> &[u8] {
            &self.1
        }
    }

    fn queue() -> VecDeque<Seg> {
        [
            Seg(vec![1; 16], vec![]),
            Seg(vec![2; 20], vec![3; 100]),
            Seg(vec![4; 16], vec![5; 10]),
        ]
        .into_iter()
        .collect()
    }

    fn plaintext(q: &VecDeque<Seg>) -> Vec<u8> {
        q.iter()
            .flat_map(|s| [s.0.clone(), s.1.clone()].concat())
            .collect()
    }

    #[test]
    fn batches_are_bounded_and_resume_inside_a_segment() {
        let mut out = queue();
        let want = plaintext(&out);
        let (mut tls, mut t, mut out_sent) = (Plain::default(), TlsOut::with_capacity(0), 0);
        let mut done = 0;
        let mut wire = Vec::new();
        while !out.is_empty() {
            t.fill(&mut tls, &mut out, &mut out_sent, 50, |_| done += 1)
                .unwrap();
            assert!(t.raw.len() <= 50, "a batch of {} bytes", t.raw.len());
            // Nothing more is encrypted while ciphertext waits, however little is sent.
            t.sent(3);
            let before = t.raw.clone();
            t.fill(&mut tls, &mut out, &mut out_sent, 50, |_| done += 1)
                .unwrap();
            assert_eq!(t.raw, before);
            wire.extend_from_slice(&t.raw);
            t.sent(t.raw.len() - 3);
            assert!(!t.pending());
        }
        assert_eq!(wire, want);
        assert_eq!((done, out_sent), (3, 0));
    }

    #[test]
    fn segments_leave_the_queue_once_encrypted_whole() {
        let mut out = queue();
        let (mut tls, mut t, mut out_sent) = (Plain::default(), TlsOut::with_capacity(0), 0);
        let mut heads = Vec::new();
        // The first segment and 30 bytes of the second.
        t.fill(&mut tls, &mut out, &mut out_sent, 46, |s| {
            heads.push(s.0[0])
        })
        .unwrap();
        assert_eq!((heads.as_slice(), out_sent, out.len()), (&[1u8][..], 30, 2));
        t.sent(46);
        t.fill(&mut tls, &mut out, &mut out_sent, 1000, |s| {
            heads.push(s.0[0])
        })
        .unwrap();
        assert_eq!(
            (heads.as_slice(), out_sent, out.len()),
            (&[1u8, 2, 4][..], 0, 0)
        );
        assert_eq!(t.raw.len(), 120 - 30 + 26);
    }

    #[test]
    fn records_of_its_own_go_out_without_a_segment() {
        let mut out: VecDeque<Seg> = VecDeque::new();
        let mut tls = Plain {
            records: vec![9; 31],
            fail: false,
        };
        let (mut t, mut out_sent) = (TlsOut::with_capacity(0), 0);
        t.fill(&mut tls, &mut out, &mut out_sent, 50, drop).unwrap();
        assert_eq!(t.raw, vec![9; 31]);
        assert!(t.send_entry(0).is_some());
        t.sent(31);
        assert!(t.send_entry(0).is_none());
    }

    #[test]
    fn an_encryption_failure_is_an_error() {
        let mut out = queue();
        let mut tls = Plain {
            records: Vec::new(),
            fail: true,
        };
        let (mut t, mut out_sent) = (TlsOut::with_capacity(0), 0);
        let r = t.fill(&mut tls, &mut out, &mut out_sent, 50, drop);
        assert!(r.is_err());
        assert!(!t.pending());
    }
}
