//! Data buffers of the connections, and the server-wide memory budget they are charged to.
//!
//! Every byte of buffer memory that may be resident is charged to one [`Budget`] shared by
//! all connections (`--memory-budget`): the buffers of requests in flight, of replies not
//! yet sent, and the buffers kept for reuse. A buffer is charged as it is touched, from
//! its start (a high-water mark): a read's buffer before the device fills it, a write's
//! a megabyte at a time as its payload arrives, never at once from the header. Fresh
//! buffers of 128 KiB and more are mapped, so their pages are not resident until touched.
//! When the budget is spent, a connection that needs more waits, without reading from its
//! socket (backpressure), until memory is returned.
//!
//! Deadlock: connections holding half-received payloads could spend the whole budget
//! and wait for each other. The last `reserve` bytes (one maximal request's worth) go to
//! one connection at a time, for the buffer it is filling, so some request always finishes.
//! Connections that hold no memory come first: a client with a small request is served
//! beside many that hold half-sent payloads (whose clients may never send the rest).
//!
//! Hot path: charges come from a per-reactor credit, taken from the shared counter a
//! megabyte or more at a time; the shared counter is not touched per request.

use std::cell::{Cell, RefCell};
use std::os::fd::OwnedFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use cairn_core::AlignedBuf;

use crate::server::gate::Wake;

/// Smallest buffer handed out (one page: O_DIRECT devices need page alignment anyway).
const MIN_SHIFT: u32 = 12;
/// Size classes: 4 KiB, 8 KiB, ..., 2 GiB.
const CLASSES: usize = 20;
/// Credit a reactor takes from the shared budget at a time (at least).
const CHUNK: usize = 1 << 20;
const PAGE: usize = 4096;

fn class(len: usize) -> usize {
    let len = len.max(1 << MIN_SHIFT).next_power_of_two();
    (len.trailing_zeros() - MIN_SHIFT) as usize
}

fn pages(n: usize) -> usize {
    n.next_multiple_of(PAGE)
}

/// The memory budget of a server: bytes charged across all reactors.
pub struct Budget {
    limit: usize,
    reserve: usize,
    used: AtomicUsize,
    /// The connection (its observer id) that may use the reserve; 0: none.
    owner: AtomicU64,
    /// A charge failed since the budget was last below half full: buffers are not kept.
    short: AtomicBool,
    /// Wakes reactors with connections waiting for memory.
    wake: Wake,
    /// Charges that failed (connections that had to wait), for operators.
    waits: AtomicU64,
    /// Connections waiting for memory that hold none: the reserve is theirs first.
    needy: AtomicUsize,
}

impl Budget {
    /// A budget of `limit` bytes, of which the last `reserve` go to one connection at a
    /// time; reactors are woken through `fds`.
    pub(crate) fn new(limit: usize, reserve: usize, fds: Vec<Arc<OwnedFd>>) -> Budget {
        Budget {
            limit,
            reserve: reserve.min(limit),
            used: AtomicUsize::new(0),
            owner: AtomicU64::new(0),
            short: AtomicBool::new(false),
            wake: Wake::new(fds),
            waits: AtomicU64::new(0),
            needy: AtomicUsize::new(0),
        }
    }

    /// Takes `n` bytes if that leaves `used` at most `cap`.
    fn take(&self, n: usize, cap: usize) -> bool {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            if used + n > cap {
                return false;
            }
            match self.used.compare_exchange_weak(
                used,
                used + n,
                Ordering::SeqCst,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(u) => used = u,
            }
        }
    }

    /// Gives `n` bytes back and wakes whoever waits for them.
    fn give(&self, n: usize) {
        let before = self.used.fetch_sub(n, Ordering::SeqCst);
        if self.short.load(Ordering::Relaxed) {
            if before - n < self.limit / 2 {
                self.short.store(false, Ordering::Relaxed);
            }
            self.wake.notify();
        }
    }

    /// Bytes charged now (reactors' unused credit included).
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// The budget.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Times a connection had to wait for memory.
    pub fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    /// Whether connections wait for memory (or did since the budget was last half full).
    pub(crate) fn short(&self) -> bool {
        self.short.load(Ordering::Relaxed)
    }

    /// The generation of releases, read before a charge that may fail.
    pub(crate) fn generation(&self) -> u64 {
        self.wake.generation()
    }

    /// Reactor `me` has connections waiting for memory since generation `seen`.
    pub(crate) fn waiting(&self, me: usize, seen: u64) {
        self.wake.waiting(me, seen);
    }

    /// Reactor `me` retries its waiting connections.
    pub(crate) fn retrying(&self, me: usize) {
        self.wake.retrying(me);
    }
}

/// A data buffer, with how much of it is charged to the budget (from its start). Dropped,
/// it goes back to its reactor's kept buffers, or is freed and uncharged.
pub struct Buf {
    buf: std::mem::ManuallyDrop<AlignedBuf>,
    charged: usize,
    mem: Rc<Mem>,
}

impl std::ops::Deref for Buf {
    type Target = AlignedBuf;
    fn deref(&self) -> &AlignedBuf {
        &self.buf
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut AlignedBuf {
        &mut self.buf
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: `buf` is taken once, here, and never used again.
        let buf = unsafe { std::mem::ManuallyDrop::take(&mut self.buf) };
        self.mem.keep(buf, self.charged);
    }
}

impl Buf {
    /// Bytes from the start that are charged (and may be touched).
    pub fn charged(&self) -> usize {
        self.charged
    }
}

/// The memory of one reactor: its credit from the budget and the buffers kept for reuse.
pub struct Mem {
    budget: Arc<Budget>,
    /// Charged to the budget, not yet used.
    credit: Cell<usize>,
    /// Kept buffers by size class, with the bytes charged to each.
    free: RefCell<[Vec<(AlignedBuf, usize)>; CLASSES]>,
    /// Bytes charged by the buffers kept.
    cached: Cell<usize>,
    cache_limit: usize,
    /// Memory came back on this reactor since its waiting connections last retried.
    freed: Cell<bool>,
    /// The budget's generation before the last charge that went to it.
    seen: Cell<u64>,
}

impl Mem {
    /// A reactor's memory, charged to `budget`, keeping up to `cache_limit` bytes of
    /// buffers for reuse.
    pub fn new(budget: Arc<Budget>, cache_limit: usize) -> Rc<Mem> {
        Rc::new(Mem {
            budget,
            credit: Cell::new(0),
            free: RefCell::new(std::array::from_fn(|_| Vec::new())),
            cached: Cell::new(0),
            cache_limit,
            freed: Cell::new(false),
            seen: Cell::new(0),
        })
    }

    /// The server-wide budget.
    pub fn budget(&self) -> &Arc<Budget> {
        &self.budget
    }

    /// Charges `n` bytes from this reactor's credit, topped up from the budget (short of
    /// its reserve); false when the budget is spent.
    #[inline]
    fn charge(&self, n: usize) -> bool {
        let c = self.credit.get();
        if c >= n {
            self.credit.set(c - n);
            return true;
        }
        self.charge_slow(n)
    }

    #[cold]
    fn charge_slow(&self, n: usize) -> bool {
        // Read first: a release after this read wakes a reactor that waits from it.
        self.seen.set(self.budget.generation());
        // The reactor's kept buffers are charged too: let them go before giving up.
        self.grow(n) || (self.drop_cache() > 0 && self.grow(n))
    }

    fn grow(&self, n: usize) -> bool {
        let c = self.credit.get();
        if c >= n {
            self.credit.set(c - n);
            return true;
        }
        let b = &self.budget;
        let want = n - c;
        for take in [want.max(CHUNK), want] {
            if b.take(take, b.limit - b.reserve) {
                self.credit.set(c + take - n);
                return true;
            }
        }
        false
    }

    /// Returns `n` charged bytes; credit beyond two chunks goes back to the budget (all of
    /// it while connections wait).
    #[inline]
    fn uncharge(&self, n: usize) {
        if n == 0 {
            return;
        }
        let c = self.credit.get() + n;
        self.freed.set(true);
        let short = self.budget.short();
        if c > 2 * CHUNK || short {
            let keep = if short { 0 } else { CHUNK };
            self.credit.set(keep);
            self.budget.give(c - keep);
        } else {
            self.credit.set(c);
        }
    }

    /// A buffer of the size class of `len`: a kept one, or a new one charged nothing yet.
    fn buffer(self: &Rc<Mem>, len: usize) -> Buf {
        let c = class(len).min(CLASSES - 1);
        let (buf, charged) = match self.free.borrow_mut()[c].pop() {
            Some((b, charged)) => {
                self.cached.set(self.cached.get() - charged);
                (b, charged)
            }
            None => (AlignedBuf::new(1 << (c as u32 + MIN_SHIFT)), 0),
        };
        Buf {
            buf: std::mem::ManuallyDrop::new(buf),
            charged,
            mem: self.clone(),
        }
    }

    /// Keeps a returned buffer for reuse, or frees it and returns its charge.
    #[inline]
    fn keep(&self, buf: AlignedBuf, charged: usize) {
        if self.cached.get() + charged <= self.cache_limit && !self.budget.short() {
            self.cached.set(self.cached.get() + charged);
            self.free.borrow_mut()[class(buf.len()).min(CLASSES - 1)].push((buf, charged));
        } else {
            drop(buf);
            self.uncharge(charged);
        }
    }

    /// Frees the buffers kept for reuse; returns the bytes that were charged to them.
    pub fn drop_cache(&self) -> usize {
        let n = self.cached.replace(0);
        for list in self.free.borrow_mut().iter_mut() {
            list.clear();
        }
        self.uncharge(n);
        n
    }

    /// The budget's generation before the last charge that failed.
    pub(crate) fn seen(&self) -> u64 {
        self.seen.get()
    }

    /// Whether buffers are kept for reuse.
    pub(crate) fn keeps(&self) -> bool {
        self.cached.get() > 0
    }

    /// Whether memory came back on this reactor since the last call.
    pub(crate) fn take_freed(&self) -> bool {
        self.freed.replace(false)
    }
}

/// The buffers of one connection: at most `limit` bytes of them at a time (its requests
/// in flight and its replies not yet sent), charged to the budget as they are touched.
pub struct BufPool {
    mem: Rc<Mem>,
    /// Bytes handed out and not yet returned.
    out: usize,
    limit: usize,
    /// The connection's id, to hold the budget's reserve.
    id: u64,
    /// The buffer this connection fills from the reserve (its address; 0: none).
    reserved: usize,
    /// Counted in the budget's `needy`: waits for memory, holding none.
    needy: bool,
}

impl BufPool {
    /// A connection's pool on a reactor's memory, handing out at most `limit` bytes at a
    /// time; `id` names the connection (nonzero).
    pub fn new(mem: Rc<Mem>, limit: usize, id: u64) -> BufPool {
        BufPool {
            mem,
            out: 0,
            limit,
            id,
            reserved: 0,
            needy: false,
        }
    }

    /// A buffer of at least `len` bytes, or `None` while the connection holds its limit
    /// (or for more than the largest size class). The first request is always served, so
    /// one maximal request can make progress. Charged only as far as it was before: see
    /// [`BufPool::ensure`].
    pub fn get(&mut self, len: usize) -> Option<Buf> {
        let c = class(len);
        if c >= CLASSES {
            return None;
        }
        let size = 1usize << (c as u32 + MIN_SHIFT);
        if self.out > 0 && self.out + size > self.limit {
            return None;
        }
        self.out += size;
        Some(self.mem.buffer(len))
    }

    /// A buffer of at least `len` bytes even over the limit (for bounded replies).
    pub fn get_always(&mut self, len: usize) -> Buf {
        let b = self.mem.buffer(len);
        self.out += b.len();
        b
    }

    /// Charges `buf` up to byte `end` (rounded up to pages) before it is touched there.
    /// False when the budget is spent: the caller waits for memory and tries again.
    #[inline]
    pub fn ensure(&mut self, buf: &mut Buf, end: usize) -> bool {
        let end = pages(end).min(buf.len());
        if buf.charged >= end {
            return true;
        }
        let n = end - buf.charged;
        // While connections that hold nothing wait, memory that comes back is theirs.
        let queued = !self.needy && self.mem.budget.needy.load(Ordering::Relaxed) > 0;
        if (!queued && self.mem.charge(n)) || self.take_reserve(buf, n) {
            buf.charged = end;
            if self.needy {
                self.needy = false;
                self.mem.budget.needy.fetch_sub(1, Ordering::SeqCst);
            }
            return true;
        }
        let b = &self.mem.budget;
        b.waits.fetch_add(1, Ordering::Relaxed);
        b.short.store(true, Ordering::Relaxed);
        // Holding nothing but this buffer, barely started: first in line for the reserve.
        if !self.needy && self.out == buf.len() && buf.charged < PAGE {
            self.needy = true;
            b.needy.fetch_add(1, Ordering::SeqCst);
        }
        false
    }

    /// Charges `n` bytes of `buf` to the reserve, if this connection holds it for `buf`
    /// or can take it.
    #[cold]
    fn take_reserve(&mut self, buf: &Buf, n: usize) -> bool {
        let b = &self.mem.budget;
        let at = buf.as_slice().as_ptr() as usize;
        if self.reserved == 0 {
            if !self.needy && b.needy.load(Ordering::SeqCst) > 0 {
                return false;
            }
            if b.owner
                .compare_exchange(0, self.id, Ordering::SeqCst, Ordering::Relaxed)
                .is_err()
            {
                return false;
            }
            self.reserved = at;
        } else if self.reserved != at {
            return false;
        }
        b.take(n, b.limit)
    }

    /// Returns a buffer from [`BufPool::get`].
    #[inline]
    pub fn put(&mut self, buf: Buf) {
        self.out = self.out.saturating_sub(buf.len());
        if self.reserved != 0 && self.reserved == buf.as_slice().as_ptr() as usize {
            self.release_reserve();
        }
        drop(buf);
    }

    #[cold]
    fn release_reserve(&mut self) {
        self.reserved = 0;
        let b = &self.mem.budget;
        b.owner.store(0, Ordering::SeqCst);
        b.wake.notify();
    }

    /// Bytes handed out.
    pub fn outstanding(&self) -> usize {
        self.out
    }
}

impl Drop for BufPool {
    fn drop(&mut self) {
        if self.reserved != 0 {
            self.release_reserve();
        }
        if self.needy {
            self.mem.budget.needy.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem(limit: usize, reserve: usize, cache: usize) -> Rc<Mem> {
        let fd = cairn_core::event::eventfd("test").unwrap();
        Mem::new(Arc::new(Budget::new(limit, reserve, vec![fd])), cache)
    }

    #[test]
    fn classes_round_up_and_the_limit_holds() {
        let m = mem(1 << 30, 0, 1 << 20);
        let mut p = BufPool::new(m.clone(), 64 << 10, 1);
        let a = p.get(1).unwrap();
        assert_eq!(a.len(), 4096);
        let b = p.get(5000).unwrap();
        assert_eq!(b.len(), 8192);
        let c = p.get(32 << 10).unwrap();
        assert_eq!(p.outstanding(), 44 << 10);
        assert!(p.get(32 << 10).is_none());
        p.put(c);
        assert!(p.get(32 << 10).is_some());
        // Alone, even an oversized request is served.
        let mut q = BufPool::new(m, 4096, 2);
        assert_eq!(q.get(1 << 20).unwrap().len(), 1 << 20);
        assert!(q.get(4096).is_none());
        p.put(a);
        p.put(b);
    }

    #[test]
    fn charges_follow_the_touched_bytes_and_come_back() {
        let m = mem(64 << 20, 0, 0);
        let budget = m.budget().clone();
        let mut p = BufPool::new(m.clone(), 64 << 20, 1);
        let mut b = p.get(32 << 20).unwrap();
        assert_eq!(b.charged(), 0);
        assert!(p.ensure(&mut b, 5000));
        assert_eq!(b.charged(), 8192);
        assert!(p.ensure(&mut b, 3 << 20));
        assert_eq!(b.charged(), 3 << 20);
        // The reactor took a chunk ahead, no more.
        assert!(budget.used() >= 3 << 20 && budget.used() <= 4 << 20);
        p.put(b);
        // Not kept (no cache): all of it is back, but for the credit the reactor keeps.
        assert!(budget.used() <= 2 * CHUNK, "{}", budget.used());
    }

    #[test]
    fn a_spent_budget_refuses_then_the_reserve_lets_one_connection_finish() {
        let m = mem(8 << 20, 2 << 20, 0);
        let budget = m.budget().clone();
        let mut a = BufPool::new(m.clone(), 64 << 20, 1);
        let mut b = BufPool::new(m.clone(), 64 << 20, 2);
        let mut x = a.get(8 << 20).unwrap();
        let mut y = b.get(8 << 20).unwrap();
        assert!(a.ensure(&mut x, 3 << 20));
        assert!(b.ensure(&mut y, 3 << 20));
        // 6 MiB of 8 are used; the last 2 are the reserve. A takes it for x.
        assert!(a.ensure(&mut x, 5 << 20));
        assert!(budget.used() <= 8 << 20);
        // B may not: the reserve is A's (and only for x).
        assert!(!b.ensure(&mut y, 4 << 20));
        let mut z = a.get(4096).unwrap();
        assert!(!a.ensure(&mut z, 4096));
        assert!(budget.waits() >= 2 && budget.short());
        // x is done: the reserve and its memory come back; now B can go on.
        a.put(x);
        assert!(b.ensure(&mut y, 6 << 20));
        b.put(y);
        a.put(z);
        drop(a);
        drop(b);
        assert_eq!(m.drop_cache(), 0);
        assert!(budget.used() <= 2 * CHUNK, "{}", budget.used());
    }

    #[test]
    fn kept_buffers_keep_their_charge_and_go_under_pressure() {
        let m = mem(64 << 20, 0, 16 << 20);
        let budget = m.budget().clone();
        let mut p = BufPool::new(m.clone(), 64 << 20, 1);
        let mut b = p.get(4 << 20).unwrap();
        assert!(p.ensure(&mut b, 4 << 20));
        p.put(b);
        let used = budget.used();
        assert!(used >= 4 << 20);
        // Taken again, it is charged already.
        let mut b = p.get(4 << 20).unwrap();
        assert_eq!(b.charged(), 4 << 20);
        assert!(p.ensure(&mut b, 4 << 20));
        assert_eq!(budget.used(), used);
        p.put(b);
        assert_eq!(m.drop_cache(), 4 << 20);
        assert!(budget.used() <= 2 * CHUNK);
    }
}
