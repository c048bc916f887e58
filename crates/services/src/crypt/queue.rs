//! A crypt device's queue: reads decrypted in the reader's buffer when they complete,
//! writes encrypted into bounce buffers of the queue's own, write-zeroes and discard as
//! encrypted zeros a chunk at a time.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use cairn_core::buf::AlignedBuf;
use cairn_core::slab::Slab;
use cairn_core::{Core, Io, IoStatus, Op, Queue, QueueStats, Sink, SinkId};

use super::counters::Tally;
use super::evp::Cipher;
use super::Segment;

/// Bounce buffers of a queue, by size class (powers of two from 4 KiB), reused: after
/// the first requests of each size a write allocates nothing.
#[derive(Default)]
struct Pool {
    free: Vec<Vec<AlignedBuf>>,
    kept: usize,
}

/// Bytes of bounce buffers a queue keeps for reuse; more are freed when done.
const POOL_KEEP_BYTES: usize = 32 << 20;
/// Largest piece of a write-zeroes or discard encrypted and written at once.
const ZERO_CHUNK: u64 = 1 << 20;

impl Pool {
    fn class(len: usize) -> usize {
        len.max(4096).next_power_of_two().trailing_zeros() as usize - 12
    }

    fn take(&mut self, len: usize) -> AlignedBuf {
        let c = Self::class(len);
        match self.free.get_mut(c).and_then(Vec::pop) {
            Some(b) => {
                self.kept -= b.len();
                b
            }
            None => AlignedBuf::new(1 << (c + 12)),
        }
    }

    fn give(&mut self, b: AlignedBuf) {
        if self.kept + b.len() > POOL_KEEP_BYTES {
            return;
        }
        let c = Self::class(b.len());
        if self.free.len() <= c {
            self.free.resize_with(c + 1, Vec::new);
        }
        self.kept += b.len();
        self.free[c].push(b);
    }
}

/// A request in flight (its bounce buffer, if any, in `CryptQueue::bounces` at the same
/// index).
#[derive(Clone, Copy)]
struct Req {
    io: Io,
    start: u64,
    /// For write-zeroes and discard: bytes sent so far.
    done: u64,
}

pub(super) struct CryptQueue {
    core: Rc<Core>,
    stats: QueueStats,
    base: Rc<dyn Queue>,
    cipher: Cipher,
    /// What it enciphered and deciphered, for the device's counters.
    tally: Tally,
    segment: Segment,
    sink: Cell<SinkId>,
    requests: RefCell<Slab<Req>>,
    /// The bounce buffer of each request in flight, by its index in `requests`.
    bounces: RefCell<Vec<Option<AlignedBuf>>>,
    pool: RefCell<Pool>,
}

impl CryptQueue {
    /// A queue on `core` over the base's queue `base`, registered as a sink.
    pub(super) fn open(
        core: &Rc<Core>,
        name: &str,
        base: Rc<dyn Queue>,
        cipher: Cipher,
        tally: Tally,
        segment: Segment,
    ) -> Rc<CryptQueue> {
        let queue = Rc::new(CryptQueue {
            core: core.clone(),
            stats: QueueStats::named(core.switches().stats, name),
            base,
            cipher,
            tally,
            segment,
            sink: Cell::new(SinkId(u32::MAX)),
            requests: RefCell::new(Slab::with_capacity(256)),
            bounces: RefCell::new(Vec::with_capacity(256)),
            pool: RefCell::new(Pool::default()),
        });
        queue.sink.set(core.register_sink(queue.clone()));
        queue
    }
}

impl CryptQueue {
    /// Records request `r` with bounce buffer `b`; returns its index.
    fn insert(&self, r: Req, b: Option<AlignedBuf>) -> u32 {
        let index = self.requests.borrow_mut().insert(r);
        let mut bounces = self.bounces.borrow_mut();
        if bounces.len() <= index as usize {
            bounces.resize_with(index as usize + 1, || None);
        }
        bounces[index as usize] = b;
        index
    }

    /// The IV of the sector at byte `offset` of the device.
    fn iv(&self, offset: u64) -> u64 {
        // Modulo 2^64, as dm-crypt's plain64: iv_tweak comes from the header.
        self.segment.iv_tweak.wrapping_add(offset / 512)
    }

    /// Encrypts the next chunk of zeros of request `index` and writes it.
    fn send_zeros(&self, index: u32) {
        let mut requests = self.requests.borrow_mut();
        let r = requests.get_mut(index);
        let len = (r.io.len - r.done).min(ZERO_CHUNK);
        let offset = r.io.offset + r.done;
        let mut bounces = self.bounces.borrow_mut();
        let b = bounces[index as usize]
            .as_mut()
            .expect("a zero request has its bounce buffer");
        let data = &mut b.as_mut_slice()[..len as usize];
        data.fill(0);
        let first = u64::from(r.done == 0);
        self.tally.cipher(true, first, len, || {
            self.cipher.run(
                data,
                self.segment.sector_bytes as usize,
                self.iv(offset),
                true,
            )
        });
        let io = Io {
            op: Op::Write,
            flags: r.io.flags,
            offset: self.segment.offset + offset,
            len,
            buf: data.as_mut_ptr(),
            sink: self.sink.get(),
            token: u64::from(index),
        };
        r.done += len;
        drop((requests, bounces));
        self.base.submit(io);
    }
}

impl Queue for CryptQueue {
    fn submit(&self, io: Io) {
        let now = self.core.now_ns();
        self.stats.start(io.flags, now);
        let sector = self.segment.sector_bytes as usize;
        let (bounce, buf) = match io.op {
            Op::Write => {
                let mut b = self.pool.borrow_mut().take(io.len as usize);
                let data = &mut b.as_mut_slice()[..io.len as usize];
                // SAFETY: the submitter keeps `io.buf` valid for `io.len` bytes until the
                // request completes; it is only read here.
                let plain = unsafe { std::slice::from_raw_parts(io.buf, data.len()) };
                self.tally.cipher(true, 1, io.len, || {
                    self.cipher
                        .encrypt_from(plain, data, sector, self.iv(io.offset))
                });
                let p = data.as_mut_ptr();
                (Some(b), p)
            }
            Op::Discard | Op::WriteZeroes => {
                let b = self.pool.borrow_mut().take(io.len.min(ZERO_CHUNK) as usize);
                let index = self.insert(
                    Req {
                        io,
                        start: now,
                        done: 0,
                    },
                    Some(b),
                );
                self.send_zeros(index);
                return;
            }
            Op::Read | Op::Flush => (None, io.buf),
        };
        let index = self.insert(
            Req {
                io,
                start: now,
                done: 0,
            },
            bounce,
        );
        let offset = if io.op == Op::Flush {
            0
        } else {
            self.segment.offset + io.offset
        };
        self.base.submit(Io {
            offset,
            buf,
            sink: self.sink.get(),
            token: u64::from(index),
            ..io
        });
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }

    fn children(&self) -> Vec<Rc<dyn Queue>> {
        vec![self.base.clone()]
    }
}

impl Sink for CryptQueue {
    fn io_done(&self, token: u64, status: IoStatus) {
        let index = token as u32;
        {
            let requests = self.requests.borrow();
            let r = requests.get(index);
            if status.is_ok()
                && matches!(r.io.op, Op::Discard | Op::WriteZeroes)
                && r.done < r.io.len
            {
                drop(requests);
                self.send_zeros(index);
                return;
            }
        }
        let r = self.requests.borrow_mut().remove(index);
        if let Some(b) = self.bounces.borrow_mut()[index as usize].take() {
            self.pool.borrow_mut().give(b);
        }
        if r.io.op == Op::Read && status.is_ok() {
            // SAFETY: the submitter's buffer, valid for `len` bytes until this completion,
            // now holds what the base read.
            let data = unsafe { std::slice::from_raw_parts_mut(r.io.buf, r.io.len as usize) };
            self.tally.cipher(false, 1, r.io.len, || {
                self.cipher.run(
                    data,
                    self.segment.sector_bytes as usize,
                    self.iv(r.io.offset),
                    false,
                )
            });
        }
        self.stats
            .finish(&r.io, r.start, || self.core.now_ns(), status.is_ok());
        self.core.deliver(r.io.sink, r.io.token, status);
    }
}
