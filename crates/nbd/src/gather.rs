//! Output queues sent with `sendmsg`: a queue of segments (a header and maybe a data
//! buffer each), of which the front may be partly sent. The server's replies and the
//! client's requests both go out this way.

use std::collections::VecDeque;

/// A segment of an output queue: its header bytes and its data bytes (maybe none).
pub(crate) trait Segment {
    /// The header.
    fn head(&self) -> &[u8];
    /// The data after the header.
    fn data(&self) -> &[u8];
}

/// Fills `iov` (cleared first) with the unsent bytes of `out`, skipping the first `sent`,
/// up to `max` iovecs.
pub(crate) fn gather<S: Segment>(
    iov: &mut Vec<libc::iovec>,
    out: &VecDeque<S>,
    sent: usize,
    max: usize,
) {
    iov.clear();
    let mut skip = sent;
    for seg in out {
        if iov.len() + 2 > max {
            break;
        }
        for part in [seg.head(), seg.data()] {
            if skip < part.len() {
                iov.push(libc::iovec {
                    iov_base: part[skip..].as_ptr() as *mut libc::c_void,
                    iov_len: part.len() - skip,
                });
            }
            skip = skip.saturating_sub(part.len());
        }
    }
}

/// `n` more bytes of `out` went out (of which the front had `*sent` already): drops every
/// segment now sent whole, handing each to `done`, and leaves in `*sent` how much of the
/// new front is.
pub(crate) fn consume<S: Segment>(
    out: &mut VecDeque<S>,
    sent: &mut usize,
    n: usize,
    mut done: impl FnMut(S),
) {
    let mut n = n + *sent;
    *sent = 0;
    while let Some(front) = out.front() {
        let l = front.head().len() + front.data().len();
        if n < l {
            *sent = n;
            break;
        }
        n -= l;
        if let Some(seg) = out.pop_front() {
            done(seg);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Seg(Vec<u8>, Vec<u8>);

    impl Segment for Seg {
        fn head(&self) -> &[u8] {
            &self.0
        }
        fn data(&self) -> &[u8] {
            &self.1
        }
    }

    #[test]
    fn partial_sends_resume_where_they_stopped() {
        let mut out: VecDeque<Seg> = [
            Seg(vec![1; 16], vec![]),
            Seg(vec![2; 20], vec![3; 100]),
            Seg(vec![4; 16], vec![]),
        ]
        .into_iter()
        .collect();
        let mut iov = Vec::new();
        gather(&mut iov, &out, 0, 64);
        assert_eq!(
            iov.iter().map(|v| v.iov_len).collect::<Vec<_>>(),
            [16, 20, 100, 16]
        );
        let (mut sent, mut dropped) = (0, 0);
        consume(&mut out, &mut sent, 30, |_| dropped += 1);
        assert_eq!((dropped, sent, out.len()), (1, 14, 2));
        gather(&mut iov, &out, sent, 64);
        assert_eq!(
            iov.iter().map(|v| v.iov_len).collect::<Vec<_>>(),
            [6, 100, 16]
        );
        consume(&mut out, &mut sent, 6 + 50, |_| dropped += 1);
        gather(&mut iov, &out, sent, 64);
        assert_eq!(iov.iter().map(|v| v.iov_len).collect::<Vec<_>>(), [50, 16]);
        consume(&mut out, &mut sent, 66, |_| dropped += 1);
        assert_eq!((dropped, sent, out.len()), (3, 0, 0));
        // The iovec budget: a segment goes only if both its parts fit.
        let out: VecDeque<Seg> = (0..10).map(|_| Seg(vec![0; 4], vec![0; 4])).collect();
        gather(&mut iov, &out, 0, 5);
        assert_eq!(iov.len(), 4);
    }
}
