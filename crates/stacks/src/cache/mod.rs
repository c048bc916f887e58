//! `cache`: a write-back cache in memory over a `base` device, with its own flusher.
//!
//! The cache works in 4 KiB pages (its block size is at least that). Reads hit the cache
//! or go to the base and fill it; writes complete once cached (paced by the dirty
//! throttle as the dirty level nears the limit); a FUA write also goes through to the
//! base with FUA before it completes (its own pages only: other dirty pages stay dirty,
//! and the base is not flushed); discard and write-zeroes turn cached pages into zero
//! pages and go to the base; a flush completes once every page dirty when it arrived has
//! been written back and the base flushed. Clean pages are evicted oldest first when the
//! cache memory is full; when every page is dirty, writes go through to the base.
//!
//! A FUA request never races a write-back of its pages to the base (the older copy could
//! land last, over data that must stay durable): it waits while one is in flight
//! (`Entry::flushing`), and a page is marked clean only when no FUA write of it is on its
//! way (`Entry::through`).
//!
//! Technique 3: each cache device has its own flusher thread, which writes its dirty
//! pages back in offset order, merging neighbours into writes of up to 1 MiB.
//!
//! The caches of a stack file share one dirty budget ([`Budget`]): its throttle paces
//! each queue's writes ([`Pacer`]) as the shared dirty level nears the limit. With
//! `--writeback shared` (the "before") one pool of as many threads as caches writes pages
//! back from every cache in the order they were dirtied, one page per write.
//!
//! One mutex guards a cache's state (shared by every queue of the device): fine for the
//! rotational disks a cache fronts, a limit for many reactors over fast media.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use cairn_core::blocking::{BlockingError, BlockingQueue, Request};
use cairn_core::slab::Slab;
use cairn_core::{
    AlignedBuf, Caps, Core, Device, Error, Geometry, Io, IoFlags, IoStatus, Offer, Op, Poller,
    Queue, QueueStats, Sink, SinkId, Switches, Want, WriteBackCache, Writeback,
};

pub mod writeback;

use writeback::{Budget, Paced, Pacer};

/// Cache page size.
pub const PAGE: u64 = 4096;
/// Longest write a flusher sends to the base.
const MAX_RUN: u64 = 1 << 20;
/// A flusher writes back at most this much at a time before it marks the pages clean
/// (so that the dirty level falls steadily, not in steps the size of a whole round).
const BATCH_BYTES: usize = 4 << 20;
/// ... and at most this many writes.
const BATCH_WRITES: usize = 32;
/// The token of a queue's pacing timer.
const PACE: u64 = u64::MAX;
/// The token of a queue's timer for FUA requests waiting for a write-back of their pages.
const PARKED: u64 = u64::MAX - 1;
/// How often a FUA request waiting for a write-back of its pages looks again.
const PARKED_RETRY_NS: u64 = 100_000;

/// One cached page.
struct Entry {
    /// `None`: reads as zeros (discarded or zeroed).
    data: Option<Box<[u8]>>,
    dirty: bool,
    /// Bumped by every change, so a flusher knows whether what it wrote is still current.
    gen: u64,
    /// When the page became dirty (for `expire`): CLOCK_MONOTONIC ns, from the
    /// reactor's cached clock (no clock read per write).
    dirtied: u64,
    /// FUA writes of this page on their way through to the base. While one is, a
    /// write-back of the page does not mark it clean: the base may complete the two in
    /// either order.
    through: u32,
    /// A write-back has sent a copy of this page to the base and it has not completed. A
    /// FUA request for the page then waits until it has (the older copy could land last).
    flushing: bool,
    /// A write-back round has copied this page and not finished writing that copy. The
    /// page is not evicted meanwhile: the copy is brought up to date as it is sent, from
    /// the page (a FUA write may have made it newer, and clean).
    queued: bool,
}

/// A flush waiting for write-back: it covers every change up to `gen`.
struct Waiter {
    gen: u64,
    reply: Sender<(u64, IoStatus)>,
    token: u64,
    wake: Arc<OwnedFd>,
}

struct State {
    pages: HashMap<u64, Entry>,
    dirty: BTreeSet<u64>,
    /// Pages in the order they became clean (stale entries are skipped).
    clean: VecDeque<u64>,
    /// Page ranges of the reads in flight to the base. Their pages are not evicted: a
    /// page that was dirty when such a read was sent may be older in what the base
    /// returns (the read may reach the base before the page's write-back does), so the
    /// cached copy must still be there to lay over it when the read completes.
    reading: Vec<(u64, u64)>,
    gen: u64,
    waiters: Vec<Waiter>,
    /// Power cuts so far: a FUA write sent before one finds other pages under its page
    /// numbers when it completes, and leaves them alone.
    cuts: u64,
}

pub(crate) struct Shared {
    name: String,
    capacity: usize,
    state: Mutex<State>,
    wake: Condvar,
    stop: AtomicBool,
    /// Shared with every other cache of the stack file.
    budget: Arc<Budget>,
    /// With `--writeback shared`: the pool and this cache's index in it.
    pool: std::sync::OnceLock<(Arc<Pool>, usize)>,
    /// Bytes written back so far.
    written: std::sync::atomic::AtomicU64,
    /// The write-back rate: the window being measured (start, bytes written back then)
    /// and the last whole window's bytes a second.
    rate: Mutex<(std::time::Instant, u64, u64)>,
    /// Held for a whole write-back (copy, write, mark clean): writes of one cache reach
    /// its base in the order their data was copied, so an older copy never lands after
    /// a newer one (several pool threads may serve one cache).
    writing: Mutex<()>,
}

impl Shared {
    /// Closes the rate's window once it is a second long (called as write-backs end, off
    /// the clients' path).
    fn note_written(&self) {
        let mut r = self.rate.lock().unwrap_or_else(|p| p.into_inner());
        let elapsed = r.0.elapsed().as_secs_f64();
        if elapsed >= 1.0 {
            let now = self.written.load(Ordering::Relaxed);
            *r = (
                std::time::Instant::now(),
                now,
                (now.saturating_sub(r.1) as f64 / elapsed) as u64,
            );
        }
    }

    /// Bytes written back a second, over the last second or two: the open window once it
    /// is a second long (so an idle cache falls to 0), else the last whole one.
    fn writeback_rate(&self) -> u64 {
        let r = self.rate.lock().unwrap_or_else(|p| p.into_inner());
        let elapsed = r.0.elapsed().as_secs_f64();
        if elapsed >= 1.0 {
            (self.written.load(Ordering::Relaxed).saturating_sub(r.1) as f64 / elapsed) as u64
        } else {
            r.2
        }
    }

    /// Wakes whoever writes this cache back.
    pub(crate) fn kick(&self) {
        match self.pool.get() {
            Some((pool, _)) => pool.kick(),
            None => {
                // Under the lock the flusher checks for work with, so that the wake-up
                // cannot fall between its check and its wait.
                let _st = self.lock();
                self.wake.notify_one();
            }
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn dirty_bytes(st: &State) -> u64 {
        st.dirty.len() as u64 * PAGE
    }
}

impl State {
    /// A free page slot: below capacity, or by evicting the oldest clean page that no
    /// read in flight to the base covers.
    fn make_room(&mut self, capacity: usize) -> bool {
        let mut tries = self.clean.len();
        while self.pages.len() >= capacity {
            if tries == 0 {
                return false;
            }
            tries -= 1;
            let Some(p) = self.clean.pop_front() else {
                return false;
            };
            if self.reading.iter().any(|&(a, b)| a <= p && p < b)
                || self.pages.get(&p).is_some_and(|e| e.queued)
            {
                // Kept for that read, or for a write-back's copy of it; the next oldest goes
                // instead.
                self.clean.push_back(p);
                continue;
            }
            if self.pages.get(&p).is_some_and(|e| !e.dirty) {
                self.pages.remove(&p);
            }
        }
        true
    }

    /// Marks page `p` changed; whether it was clean before.
    fn mark_dirty(&mut self, p: u64, now: u64, budget: &Budget) -> bool {
        self.gen += 1;
        let gen = self.gen;
        let e = self.pages.get_mut(&p).expect("page present");
        e.gen = gen;
        if e.dirty {
            return false;
        }
        e.dirty = true;
        e.dirtied = now;
        self.dirty.insert(p);
        budget.add(PAGE);
        true
    }
}

/// A write-back cache device.
pub struct CacheDevice {
    name: String,
    base: Arc<dyn Device>,
    geometry: Geometry,
    shared: Arc<Shared>,
    flusher: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl CacheDevice {
    /// A cache of `memory` bytes over `base`, sharing the dirty `budget`.
    pub fn new(
        name: &str,
        base: Arc<dyn Device>,
        memory: u64,
        budget: Arc<Budget>,
        switches: Switches,
    ) -> Result<CacheDevice, Error> {
        let g = base.geometry();
        let block = g.block_bytes.max(PAGE as u32);
        if u64::from(block) != PAGE {
            return Err(Error::Invalid(format!(
                "{name}: the base's {block}-byte blocks are larger than a cache page"
            )));
        }
        let capacity = (memory / PAGE) as usize;
        if capacity < 16 {
            return Err(Error::Invalid(format!(
                "{name}: key 'memory' must be at least 64K"
            )));
        }
        let shared: Arc<Shared> = Arc::new(Shared {
            name: name.into(),
            capacity,
            state: Mutex::new(State {
                pages: HashMap::new(),
                dirty: BTreeSet::new(),
                clean: VecDeque::new(),
                reading: Vec::new(),
                gen: 0,
                waiters: Vec::new(),
                cuts: 0,
            }),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            budget,
            pool: std::sync::OnceLock::new(),
            written: std::sync::atomic::AtomicU64::new(0),
            rate: Mutex::new((std::time::Instant::now(), 0, 0)),
            writing: Mutex::new(()),
        });
        shared
            .budget
            .members
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(&shared));
        let flusher = if switches.writeback == cairn_core::WritebackMode::Shared {
            let pool = shared
                .budget
                .pool
                .get_or_init(|| Arc::new(Pool::new(switches)))
                .clone();
            let over_cache = holds_cache(&base, &shared.budget);
            let index = pool.register(shared.clone(), base.clone(), over_cache)?;
            let _ = shared.pool.set((pool, index));
            None
        } else {
            let (tx, rx) = mpsc::channel::<Result<(), Error>>();
            let (s, b) = (shared.clone(), base.clone());
            let flusher = std::thread::Builder::new()
                .name(format!("cairn-flush-{name}"))
                .spawn(move || flusher(s, b, switches, tx))
                .map_err(|e| Error::os(format!("{name}: start the flusher"), e))?;
            rx.recv()
                .map_err(|_| Error::Invalid(format!("{name}: the flusher did not start")))??;
            Some(flusher)
        };
        Ok(CacheDevice {
            name: name.into(),
            base,
            geometry: Geometry {
                size_bytes: g.size_bytes / PAGE * PAGE,
                block_bytes: PAGE as u32,
                caps: Caps {
                    flush: true,
                    fua: true,
                    discard: g.caps.discard || g.caps.write_zeroes,
                    write_zeroes: g.caps.write_zeroes || g.caps.discard,
                },
            },
            shared,
            flusher: Mutex::new(flusher),
        })
    }

    /// Dirty bytes now.
    pub fn dirty_bytes(&self) -> u64 {
        Shared::dirty_bytes(&self.shared.lock())
    }

    /// A power cut: cache memory is volatile, so everything in it is gone; then `below`
    /// cuts the base (plainly or torn). A cut is one instant for the whole stack: no
    /// write-back may be half way to the base across it (its copy, older than the cut,
    /// would land after it, over what a read after the cut saw or is reading), so the
    /// cut waits for the round in flight.
    fn cut(&self, below: impl FnOnce()) {
        let _writing = self
            .shared
            .writing
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut st = self.shared.lock();
        let lost = st.dirty.len();
        // Reads in flight saw data the cut may have taken away: they must not fill.
        st.gen += 1;
        st.cuts += 1;
        self.shared.budget.sub(lost as u64 * PAGE);
        st.pages.clear();
        st.dirty.clear();
        st.clean.clear();
        drop(st);
        log::warn!(
            "cairn: {}: power cut: {lost} dirty cache pages are lost",
            self.name
        );
        below();
    }
}

impl Drop for CacheDevice {
    fn drop(&mut self) {
        // Every cache sharing the budget starts writing everything back now, in
        // parallel, not one after another as each is dropped.
        let b = &self.shared.budget;
        if !b.closing.swap(true, Ordering::SeqCst) {
            b.kick_all();
        }
        if let Some((pool, index)) = self.shared.pool.get() {
            // Shared write-back: the pool writes the cache back (in the order pages were
            // dirtied, as always); should it stop making progress (failing writes), this
            // thread tries once more and reports.
            let mut seen = (self.shared.written.load(Ordering::Relaxed), Instant::now());
            while !self.shared.lock().dirty.is_empty() {
                pool.kick();
                std::thread::sleep(std::time::Duration::from_millis(10));
                let written = self.shared.written.load(Ordering::Relaxed);
                if written != seen.0 {
                    seen = (written, Instant::now());
                } else if seen.1.elapsed() > std::time::Duration::from_secs(5) {
                    match BlockingQueue::open(&self.base, pool.switches) {
                        Ok(q) => drain(&self.shared, &q),
                        Err(e) => {
                            let lost = self.shared.lock().dirty.len() as u64;
                            UNWRITTEN.fetch_add(lost, Ordering::SeqCst);
                            log::warn!("cairn: {}: cannot write back at exit: {e}", self.name)
                        }
                    }
                    break;
                }
            }
            pool.deregister(*index);
            return;
        }
        // The flusher writes everything back before it exits.
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _st = self.shared.lock();
            self.shared.wake.notify_all();
        }
        if let Some(t) = self.flusher.lock().ok().and_then(|mut f| f.take()) {
            let _ = t.join();
        }
    }
}

impl Device for CacheDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn describe(&self) -> String {
        format!(
            "write-back cache of {} bytes over {}, {} bytes dirty",
            self.shared.capacity as u64 * PAGE,
            self.base.name(),
            self.dirty_bytes()
        )
    }
    fn geometry(&self) -> Geometry {
        self.geometry
    }
    fn base(&self) -> Option<&Arc<dyn Device>> {
        Some(&self.base)
    }
    fn offer(self: Arc<Self>, want: Want) -> Option<Offer> {
        want.offer::<dyn WriteBackCache>(|| self)
    }
    fn extents(
        &self,
        offset: u64,
        len: u64,
        out: &mut Vec<cairn_core::Extent>,
    ) -> Result<(), Error> {
        use cairn_core::Extent;
        // Dirty pages may hold data the base's map does not show yet: they are data.
        // Taken before the base is asked, so a page written back meanwhile is counted
        // (clean pages hold what the base holds, and its map stands for them).
        let (first, end) = (offset / PAGE, (offset + len).div_ceil(PAGE));
        let dirty: Vec<u64> = {
            let st = self.shared.lock();
            st.dirty.range(first..end).copied().collect()
        };
        if dirty.is_empty() {
            return self.base.extents(offset, len, out);
        }
        let mut below = Vec::new();
        self.base.extents(offset, len, &mut below)?;
        let mut at = offset;
        let mut next = dirty.iter().peekable();
        for e in below {
            let end = at + e.len;
            if !e.hole && !e.zero {
                Extent::push(out, e);
                at = end;
                continue;
            }
            // A hole or zeros below: the dirty pages in it are data.
            while at < end {
                while next.next_if(|&&p| (p + 1) * PAGE <= at).is_some() {}
                match next.peek() {
                    Some(&&p) if p * PAGE < end => {
                        let (lo, hi) = ((p * PAGE).max(at), ((p + 1) * PAGE).min(end));
                        Extent::push(out, Extent { len: lo - at, ..e });
                        Extent::push(out, Extent::data(hi - lo));
                        at = hi;
                    }
                    _ => {
                        Extent::push(out, Extent { len: end - at, ..e });
                        at = end;
                    }
                }
            }
        }
        Ok(())
    }
    fn power_cut(&self) {
        self.cut(|| self.base.power_cut());
    }
    fn power_cut_torn(&self, seed: u64) {
        self.cut(|| self.base.power_cut_torn(seed));
    }
    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        let base = cairn_core::handoff::open_member(core, &self.base)?;
        let wake = cairn_core::event::eventfd("cache")?;
        let (tx, rx) = mpsc::channel();
        let q = Rc::new(CacheQueue {
            core: core.clone(),
            stats: QueueStats::named(core.switches().stats, self.name()),
            base,
            base_caps: self.base.geometry().caps,
            shared: self.shared.clone(),
            sink: Cell::new(SinkId(u32::MAX)),
            requests: RefCell::new(Slab::with_capacity(256)),
            flushes_out: Cell::new(0),
            pacer: RefCell::new(Pacer::default()),
            released: RefCell::new(Vec::with_capacity(64)),
            parked: RefCell::new(Vec::new()),
            reply_tx: tx,
            reply_rx: rx,
            wake,
        });
        q.sink.set(core.register_sink(q.clone()));
        core.register_poller(q.clone());
        Ok(q)
    }
}

impl WriteBackCache for CacheDevice {
    fn counters(&self) -> Writeback {
        Writeback {
            dirty_bytes: self.dirty_bytes(),
            written_bytes: self.shared.written.load(Ordering::Relaxed),
        }
    }
    fn rate_bytes_per_s(&self) -> u64 {
        self.shared.writeback_rate()
    }
}

/// What a request waiting for the base is.
#[derive(Clone, Copy)]
enum Pending {
    /// A read that missed: fill the cache when it completes. `gen` is the cache's
    /// generation when it was sent (pages changed since are not filled from it).
    Read { gen: u64 },
    /// A write or zeroing sent through to the base.
    Through,
    /// A FUA write sent through to the base with FUA. Its pages are marked clean when it
    /// completes unless changed since (`gen`, the cache's generation once it was cached)
    /// or cut away (`cuts`).
    Fua { gen: u64, cuts: u64 },
}

/// What [`CacheQueue::cache_write`] did.
struct Cached {
    /// The cache had room for every page (else the write goes through to the base).
    fits: bool,
    /// The shared dirty level afterwards.
    dirty: u64,
    /// A write-back of one of its pages is in flight (see [`Entry::flushing`]).
    busy: bool,
    /// A FUA write that goes through to the base now: its pages count it in
    /// [`Entry::through`] (it fits, none of its pages is busy, the base honours FUA).
    through: bool,
    /// The cache's generation and power cuts once it was cached (see [`Pending::Fua`]).
    gen: u64,
    cuts: u64,
}

struct CacheQueue {
    core: Rc<Core>,
    stats: QueueStats,
    base: Rc<dyn Queue>,
    base_caps: Caps,
    shared: Arc<Shared>,
    sink: Cell<SinkId>,
    requests: RefCell<Slab<(Io, u64, Pending)>>,
    flushes_out: Cell<u64>,
    /// Throttled writes, completed one after another by the pacing timer.
    pacer: RefCell<Pacer<(Io, u64)>>,
    /// Writes the pacer released, completed once it is no longer borrowed.
    released: RefCell<Vec<(Io, u64)>>,
    /// FUA requests waiting for a write-back of their pages to complete: the request, its
    /// start, the cache's generation once it was cached. At most the requests in flight.
    parked: RefCell<Vec<(Io, u64, u64)>>,
    reply_tx: Sender<(u64, IoStatus)>,
    reply_rx: Receiver<(u64, IoStatus)>,
    wake: Arc<OwnedFd>,
}

impl CacheQueue {
    fn pages(io: &Io) -> std::ops::Range<u64> {
        io.offset / PAGE..io.end().div_ceil(PAGE)
    }

    /// Copies cached page `p` (data or zeros) into its place in `io`'s buffer.
    fn copy_out(e: &Entry, io: &Io, p: u64) {
        let at = (p * PAGE - io.offset) as usize;
        // SAFETY: requests are page aligned (the cache's block size), `buf` holds `len`
        // bytes, and page `p` lies inside the request.
        unsafe {
            match &e.data {
                Some(d) => std::ptr::copy_nonoverlapping(d.as_ptr(), io.buf.add(at), PAGE as usize),
                None => std::ptr::write_bytes(io.buf.add(at), 0, PAGE as usize),
            }
        }
    }

    fn finish(&self, io: &Io, start: u64, status: IoStatus) {
        self.stats
            .finish(io, start, || self.core.now_ns(), status.is_ok());
    }

    /// Completes from submit context (through the FIFO).
    fn complete_now(&self, io: &Io, start: u64, status: IoStatus) {
        self.finish(io, start, status);
        self.core.complete(io.sink, io.token, status);
    }

    fn to_base(&self, io: Io, start: u64, pending: Pending) {
        let index = self.requests.borrow_mut().insert((io, start, pending));
        // Either zeroing op does: both leave zeros on every cairn device.
        let op = match io.op {
            Op::Discard if !self.base_caps.discard => Op::WriteZeroes,
            Op::WriteZeroes if !self.base_caps.write_zeroes => Op::Discard,
            op => op,
        };
        self.base.submit(Io {
            op,
            sink: self.sink.get(),
            token: u64::from(index),
            ..io
        });
    }

    fn read(&self, io: Io, start: u64) {
        let mut st = self.shared.lock();
        let all = Self::pages(&io).all(|p| st.pages.contains_key(&p));
        if !all {
            let gen = st.gen;
            let pages = Self::pages(&io);
            st.reading.push((pages.start, pages.end));
            drop(st);
            self.to_base(io, start, Pending::Read { gen });
            return;
        }
        for p in Self::pages(&io) {
            Self::copy_out(&st.pages[&p], &io, p);
        }
        drop(st);
        self.complete_now(&io, start, IoStatus::OK);
    }

    /// Caches `io`'s data (or zeros). See [`Cached`].
    fn cache_write(&self, io: &Io, zeros: bool) -> Cached {
        let now = self.core.now_ns();
        let mut st = self.shared.lock();
        let missing = Self::pages(io)
            .filter(|p| !st.pages.contains_key(p))
            .count();
        let fits = st.pages.len() + missing <= self.shared.capacity || {
            // Evict clean pages to make room.
            let want = self.shared.capacity.saturating_sub(missing);
            st.make_room(want.max(1)) && st.pages.len() + missing <= self.shared.capacity
        };
        let busy = Self::pages(io).any(|p| st.pages.get(&p).is_some_and(|e| e.flushing));
        let through =
            fits && !zeros && !busy && io.flags.contains(IoFlags::FUA) && self.base_caps.fua;
        for p in Self::pages(io) {
            if !fits && !st.pages.contains_key(&p) {
                continue;
            }
            let at = (p * PAGE - io.offset) as usize;
            let old = st.pages.remove(&p);
            let (dirty, gen, dirtied, in_flight, flushing, queued) =
                old.as_ref().map_or((false, 0, now, 0, false, false), |e| {
                    (e.dirty, e.gen, e.dirtied, e.through, e.flushing, e.queued)
                });
            let data = if zeros {
                None
            } else {
                let mut d = match old.and_then(|e| e.data) {
                    Some(d) => d,
                    None => vec![0u8; PAGE as usize].into_boxed_slice(),
                };
                // SAFETY: as in `read`.
                unsafe {
                    std::ptr::copy_nonoverlapping(io.buf.add(at), d.as_mut_ptr(), PAGE as usize)
                };
                Some(d)
            };
            st.pages.insert(
                p,
                Entry {
                    data,
                    dirty,
                    gen,
                    dirtied,
                    through: in_flight + u32::from(through),
                    flushing,
                    queued,
                },
            );
            if st.mark_dirty(p, now, &self.shared.budget) {
                if let Some((pool, index)) = self.shared.pool.get() {
                    // Lock order: cache state, then the pool's order.
                    pool.order
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push_back((*index, p));
                }
            }
        }
        Cached {
            fits,
            dirty: self.shared.budget.dirty_bytes(),
            busy,
            through,
            gen: st.gen,
            cuts: st.cuts,
        }
    }

    fn write(&self, io: Io, start: u64) {
        let zeros = io.op != Op::Write;
        let c = self.cache_write(&io, zeros);
        let fua = io.flags.contains(IoFlags::FUA);
        if fua && c.fits && c.busy && (zeros || self.base_caps.fua) {
            // A write-back of older contents of one of its pages is on its way to the
            // base: sent beside it, this could land first and the older data last (over
            // data that must stay durable). It goes once that write-back is done.
            self.park(io, start, c.gen);
            return;
        }
        if !c.fits || zeros {
            // Through to the base as well: no room (the base then holds the data, and
            // the pages that are cached hold the same), or a zeroing (so that the base
            // never keeps older data under a cached zero page once it is evicted).
            self.to_base(io, start, Pending::Through);
            return;
        }
        if fua {
            if c.through {
                // Durable before it completes: its own pages go through to the base with
                // FUA. Other dirty pages stay dirty, and the base is not flushed.
                let (gen, cuts) = (c.gen, c.cuts);
                self.to_base(io, start, Pending::Fua { gen, cuts });
            } else {
                // The base has no FUA: it completes as a flush does, once the flusher has
                // written it back and flushed the base.
                self.flush(io, start);
            }
            return;
        }
        let b = &self.shared.budget;
        if c.dirty > b.throttle.background {
            // Over the shared level: every cache's flusher writes back its own pages.
            b.over_background();
        }
        let paced = self
            .pacer
            .borrow_mut()
            .write(b, (io, start), io.len, self.core.now_ns());
        match paced {
            Paced::Done((io, start)) => self.complete_now(&io, start, IoStatus::OK),
            Paced::Wait(Some(at)) => self.core.add_timer(at, self.sink.get(), PACE),
            Paced::Wait(None) => {}
        }
    }

    /// The pacing timer fired: completes the writes whose turn it is.
    fn pace(&self) {
        // Taken out while completions run (they may submit and pace another write).
        let mut released = std::mem::take(&mut *self.released.borrow_mut());
        let next = self
            .pacer
            .borrow_mut()
            .timer(&self.shared.budget, self.core.now_ns(), |w| {
                released.push(w)
            });
        if let Some(at) = next {
            self.core.add_timer(at, self.sink.get(), PACE);
        }
        for &(io, start) in &released {
            self.finish(&io, start, IoStatus::OK);
            self.core.deliver(io.sink, io.token, IoStatus::OK);
        }
        released.clear();
        *self.released.borrow_mut() = released;
    }

    fn flush(&self, io: Io, start: u64) {
        let index = self
            .requests
            .borrow_mut()
            .insert((io, start, Pending::Through));
        let mut st = self.shared.lock();
        let gen = st.gen;
        st.waiters.push(Waiter {
            gen,
            reply: self.reply_tx.clone(),
            token: u64::from(index),
            wake: self.wake.clone(),
        });
        drop(st);
        self.flushes_out.set(self.flushes_out.get() + 1);
        self.shared.kick();
    }

    /// Holds a FUA request (cached as generation `gen`) until no write-back of its pages is
    /// in flight; [`CacheQueue::unpark`] looks again every `PARKED_RETRY_NS`.
    fn park(&self, io: Io, start: u64, gen: u64) {
        let mut parked = self.parked.borrow_mut();
        if parked.is_empty() {
            self.core.add_timer(
                self.core.now_ns() + PARKED_RETRY_NS,
                self.sink.get(),
                PARKED,
            );
        }
        parked.push((io, start, gen));
    }

    /// The parking timer fired: sends the FUA requests none of whose pages is being
    /// written back now, as they would have gone at first; the others wait on.
    fn unpark(&self) {
        let mut parked = std::mem::take(&mut *self.parked.borrow_mut());
        let mut go = Vec::new();
        {
            let mut st = self.shared.lock();
            let cuts = st.cuts;
            parked.retain(|&(io, start, gen)| {
                let busy = Self::pages(&io).any(|p| st.pages.get(&p).is_some_and(|e| e.flushing));
                if busy {
                    return true;
                }
                if io.op == Op::Write {
                    for p in Self::pages(&io) {
                        if let Some(e) = st.pages.get_mut(&p) {
                            e.through += 1;
                        }
                    }
                    go.push((io, start, Pending::Fua { gen, cuts }));
                } else {
                    go.push((io, start, Pending::Through));
                }
                false
            });
        }
        if !parked.is_empty() {
            self.core.add_timer(
                self.core.now_ns() + PARKED_RETRY_NS,
                self.sink.get(),
                PARKED,
            );
        }
        *self.parked.borrow_mut() = parked;
        for (io, start, pending) in go {
            self.to_base(io, start, pending);
        }
    }

    /// A FUA write sent through came back: its pages are clean now (the base holds what
    /// the cache does, durably), unless written since it was cached, or a write-back or
    /// another FUA write of them is in flight, whose data the base may still complete last.
    fn fua_done(&self, io: &Io, gen: u64, cuts: u64, status: IoStatus) {
        let mut guard = self.shared.lock();
        let st = &mut *guard;
        if st.cuts != cuts {
            return;
        }
        let mut cleaned = 0;
        for p in Self::pages(io) {
            let Some(e) = st.pages.get_mut(&p) else {
                continue;
            };
            debug_assert!(e.through > 0, "page {p}: a FUA write in flight is counted");
            e.through -= 1;
            if status.is_ok() && e.dirty && e.gen <= gen && e.through == 0 && !e.flushing {
                e.dirty = false;
                st.dirty.remove(&p);
                st.clean.push_back(p);
                cleaned += PAGE;
            }
        }
        drop(guard);
        if cleaned > 0 {
            self.shared.budget.written_back(cleaned);
        }
    }
}

impl Queue for CacheQueue {
    fn submit(&self, io: Io) {
        let start = self.core.now_ns();
        self.stats.start(io.flags, start);
        match io.op {
            Op::Read => self.read(io, start),
            Op::Write | Op::Discard | Op::WriteZeroes => self.write(io, start),
            Op::Flush => self.flush(io, start),
        }
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }

    fn children(&self) -> Vec<Rc<dyn Queue>> {
        vec![self.base.clone()]
    }
}

impl Sink for CacheQueue {
    fn io_done(&self, token: u64, status: IoStatus) {
        if token == PACE {
            self.pace();
            return;
        }
        if token == PARKED {
            self.unpark();
            return;
        }
        let (io, start, pending) = self.requests.borrow_mut().remove(token as u32);
        if let Pending::Fua { gen, cuts } = pending {
            self.fua_done(&io, gen, cuts, status);
        }
        if let Pending::Read { gen } = pending {
            let mut st = self.shared.lock();
            let pages = Self::pages(&io);
            if let Some(i) = st
                .reading
                .iter()
                .position(|&r| r == (pages.start, pages.end))
            {
                st.reading.swap_remove(i);
            }
            if status.is_ok() {
                // Newer cached pages win over what the base returned: every one first,
                // before filling evicts any. Pages cached when the read was sent are
                // still here (not evicted while it was in flight).
                for p in Self::pages(&io) {
                    if let Some(e) = st.pages.get(&p) {
                        Self::copy_out(e, &io, p);
                    }
                }
                // Pages unchanged since the read was sent are cached clean.
                let unchanged = st.gen == gen;
                for p in Self::pages(&io) {
                    let at = (p * PAGE - io.offset) as usize;
                    if st.pages.contains_key(&p) {
                        continue;
                    }
                    if unchanged && st.make_room(self.shared.capacity) {
                        let mut d = vec![0u8; PAGE as usize].into_boxed_slice();
                        // SAFETY: as in `read`.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                io.buf.add(at),
                                d.as_mut_ptr(),
                                PAGE as usize,
                            )
                        };
                        st.pages.insert(
                            p,
                            Entry {
                                data: Some(d),
                                dirty: false,
                                gen: 0,
                                dirtied: 0,
                                through: 0,
                                flushing: false,
                                queued: false,
                            },
                        );
                        st.clean.push_back(p);
                    }
                }
            }
        }
        self.finish(&io, start, status);
        self.core.deliver(io.sink, io.token, status);
    }
}

impl Poller for CacheQueue {
    fn unplug(&self) {}

    fn reap(&self) -> usize {
        let mut n = 0;
        while let Ok((token, status)) = self.reply_rx.try_recv() {
            let (io, start, _) = self.requests.borrow_mut().remove(token as u32);
            self.flushes_out.set(self.flushes_out.get() - 1);
            self.finish(&io, start, status);
            self.core.complete(io.sink, io.token, status);
            n += 1;
        }
        n
    }

    fn busy(&self) -> bool {
        self.flushes_out.get() > 0
    }

    fn event_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    fn clear_event(&self) {
        cairn_core::event::reset(&self.wake);
    }
}

/// Pages written back together: the first page, their data, and each page's generation
/// when copied.
type Run = (u64, AlignedBuf, Vec<(u64, u64)>);
/// A run being gathered.
type Gathering = (u64, Vec<u8>, Vec<(u64, u64)>);

/// Which dirty pages a write-back round takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Take {
    /// Every dirty page (a flush is waiting, or the cache is going away).
    All,
    /// Pages over the shared background level, and expired ones.
    Due,
}

/// One write-back round of `shared` through `q`: copies the pages out in offset order,
/// merged into runs, writes them (all in flight together), flushes the base when a flush
/// is waiting, marks the pages clean unless they changed meanwhile, and answers the
/// flushes it covered. Returns whether any write failed.
fn round(shared: &Shared, q: &BlockingQueue, take: Take) -> bool {
    let _writing = shared.writing.lock().unwrap_or_else(|p| p.into_inner());
    round_locked(shared, q, take)
}

/// A pool thread's turn at writing back a cache: for a cache with no cache of its budget
/// below it, waits while another pool thread writes it back (the head-of-line blocking
/// of a shared flusher pool, which is what the "before" models: the other thread is
/// only writing to a device and will finish). For a cache over another cache, takes the
/// lock only if it is free: the other thread may be waiting for the lower cache, which
/// needs a free pool thread to write back (waiting there deadlocked the pool).
fn writing_turn(shared: &Shared, over_cache: bool) -> Option<std::sync::MutexGuard<'_, ()>> {
    if !over_cache {
        return Some(shared.writing.lock().unwrap_or_else(|p| p.into_inner()));
    }
    match shared.writing.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Whether a cache sharing `budget` lies anywhere below `base` (by name: the names of a
/// stack file's devices are unique).
fn holds_cache(base: &Arc<dyn Device>, budget: &Budget) -> bool {
    let names: Vec<String> = budget
        .members
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(|m| m.upgrade().map(|s| s.name.clone()))
        .collect();
    let mut todo = vec![base.clone()];
    while let Some(d) = todo.pop() {
        if names.iter().any(|n| n == d.name()) {
            return true;
        }
        todo.extend(d.children());
    }
    false
}

/// [`round`], with the cache's write-back lock held by the caller.
fn round_locked(shared: &Shared, q: &BlockingQueue, take: Take) -> bool {
    let b = &shared.budget;
    let mut runs: Vec<Run> = Vec::new();
    let (waiters_gen, serve_waiters) = {
        let mut guard = shared.lock();
        let st = &mut *guard;
        let now = cairn_core::clock::monotonic_ns();
        let expire = b.expire.as_nanos() as u64;
        let all = take == Take::All || !st.waiters.is_empty();
        // Over the shared background level, each cache writes back its own pages.
        let over = b.dirty_bytes().saturating_sub(b.throttle.background);
        let waiters_gen = st.waiters.iter().map(|w| w.gen).max();
        let mut budget = if all { u64::MAX } else { over };
        let mut cur: Option<Gathering> = None;
        for &p in st.dirty.iter() {
            let e = st.pages.get_mut(&p).expect("a dirty page is cached");
            let expired = now.saturating_sub(e.dirtied) >= expire;
            if !(all || expired || budget > 0) {
                continue;
            }
            budget = budget.saturating_sub(PAGE);
            let extend = matches!(&cur, Some((first, d, _)) if first + (d.len() as u64 / PAGE) == p && (d.len() as u64) < MAX_RUN);
            if !extend {
                if let Some(run) = cur.take() {
                    runs.push(seal(run));
                }
                cur = Some((p, Vec::with_capacity(PAGE as usize), Vec::new()));
            }
            let (_, d, gens) = cur.as_mut().expect("a run");
            match &e.data {
                Some(data) => d.extend_from_slice(data),
                None => d.resize(d.len() + PAGE as usize, 0),
            }
            gens.push((p, e.gen));
            e.queued = true;
        }
        if let Some(run) = cur.take() {
            runs.push(seal(run));
        }
        (waiters_gen, !st.waiters.is_empty())
    };
    write_runs(
        shared,
        q,
        runs,
        serve_waiters.then_some(waiters_gen.unwrap_or(0)),
    )
}

fn seal((first, d, gens): Gathering) -> Run {
    let mut b = AlignedBuf::new(d.len());
    b.as_mut_slice().copy_from_slice(&d);
    (first, b, gens)
}

/// Makes `batch`, about to be sent, hold its pages as they are now (a page changed since it
/// was copied, e.g. by a FUA write sent meanwhile, is copied again; [`Entry::queued`]
/// kept it cached), and marks them [`Entry::flushing`] until it completes: only the copy
/// in flight can be older than a FUA request for the page, and only while it is in
/// flight. (A page gone is gone by a power cut: its copy goes as it is.)
fn refresh(shared: &Shared, batch: &mut [Run]) {
    let mut guard = shared.lock();
    let st = &mut *guard;
    for (first, b, gens) in batch.iter_mut() {
        for (p, gen) in gens.iter_mut() {
            let Some(e) = st.pages.get_mut(p) else {
                continue;
            };
            if e.gen != *gen {
                let at = ((*p - *first) * PAGE) as usize;
                let dst = &mut b.as_mut_slice()[at..at + PAGE as usize];
                match &e.data {
                    Some(d) => dst.copy_from_slice(d),
                    None => dst.fill(0),
                }
                *gen = e.gen;
            }
            e.flushing = true;
        }
    }
}

/// Writes `runs`, flushes the base and answers the flushes covering changes up to `gen`
/// when given, and marks written pages clean. The runs go in batches (all of a batch in
/// flight together), each marked clean as soon as it is written. Returns whether
/// anything failed.
fn write_runs(
    shared: &Shared,
    q: &BlockingQueue,
    mut runs: Vec<Run>,
    waiters: Option<u64>,
) -> bool {
    let mut failed = false;
    let mut rest: &mut [Run] = &mut runs;
    while !rest.is_empty() {
        let n = batch_len(rest);
        let (batch, tail) = std::mem::take(&mut rest).split_at_mut(n);
        rest = tail;
        failed |= write_batch(shared, q, batch);
        shared.budget.tick();
    }
    if failed {
        log::warn!(
            "cairn: {}: write-back to the base failed; pages stay dirty",
            shared.name
        );
    }
    if waiters.is_some() && !failed && q.flush().is_err() {
        log::warn!("cairn: {}: flushing the base failed", shared.name);
        failed = true;
    }
    if let Some(upto) = waiters {
        answer_waiters(shared, upto, failed);
    }
    failed
}

/// How many of the runs `rest` go in the next batch: at least one, at most
/// [`BATCH_WRITES`], and no more than [`BATCH_BYTES`] unless the first alone is.
fn batch_len(rest: &[Run]) -> usize {
    let (mut n, mut bytes) = (0, 0);
    while n < rest.len() && n < BATCH_WRITES && (n == 0 || bytes + rest[n].1.len() <= BATCH_BYTES) {
        bytes += rest[n].1.len();
        n += 1;
    }
    n
}

/// Writes `batch` to the base, all of it in flight together, and marks what was
/// written clean. Returns whether any write failed.
fn write_batch(shared: &Shared, q: &BlockingQueue, batch: &mut [Run]) -> bool {
    refresh(shared, batch);
    let mut reqs: Vec<Request<'_>> = batch
        .iter_mut()
        .map(|(first, b, _)| Request {
            op: Op::Write,
            flags: IoFlags::NONE,
            offset: *first * PAGE,
            len: 0,
            buf: Some(b.as_mut_slice()),
        })
        .collect();
    let results = q.run(&mut reqs);
    drop(reqs);
    let failed = results.iter().any(|r| r.is_err());
    batch_written(shared, batch, &results);
    failed
}

/// Ends the flight of `batch`'s pages, and marks clean those written that have not
/// changed since.
fn batch_written(shared: &Shared, batch: &[Run], results: &[Result<(), BlockingError>]) {
    let mut guard = shared.lock();
    let st = &mut *guard;
    for ((_, b, gens), r) in batch.iter().zip(results) {
        for &(p, _) in gens {
            if let Some(e) = st.pages.get_mut(&p) {
                e.flushing = false;
                e.queued = false;
            }
        }
        if r.is_err() {
            continue;
        }
        shared.written.fetch_add(b.len() as u64, Ordering::Relaxed);
        shared.note_written();
        for &(p, gen) in gens {
            if let Some(e) = st.pages.get_mut(&p) {
                // Not while a FUA write of the page is on its way to the base too: the
                // base may complete that one last.
                if e.dirty && e.gen == gen && e.through == 0 {
                    e.dirty = false;
                    st.dirty.remove(&p);
                    st.clean.push_back(p);
                    shared.budget.written_back(PAGE);
                }
            }
        }
    }
}

/// Answers the flushes waiting for changes up to `upto`: EIO if anything failed.
fn answer_waiters(shared: &Shared, upto: u64, failed: bool) {
    let status = if failed {
        IoStatus::errno(libc::EIO)
    } else {
        IoStatus::OK
    };
    let mut st = shared.lock();
    let (done, keep): (Vec<Waiter>, Vec<Waiter>) =
        st.waiters.drain(..).partition(|w| w.gen <= upto);
    st.waiters = keep;
    drop(st);
    for w in done {
        let _ = w.reply.send((w.token, status));
        cairn_core::event::wake(&w.wake);
    }
}

/// Writes everything back (at exit); gives up after a failure.
fn drain(shared: &Shared, q: &BlockingQueue) {
    while !shared.lock().dirty.is_empty() {
        if round(shared, q, Take::All) {
            let lost = shared.lock().dirty.len() as u64;
            UNWRITTEN.fetch_add(lost, Ordering::SeqCst);
            log::error!(
                "cairn: {}: {lost} dirty pages could not be written back at exit",
                shared.name
            );
            return;
        }
    }
}

/// Dirty pages that caches closed so far could not write back (their data is lost).
static UNWRITTEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many dirty pages the caches closed so far in this process could not write back
/// (4 KiB each): acknowledged data that is lost. The binary turns it into exit status 1.
pub fn unwritten_at_close() -> u64 {
    UNWRITTEN.load(Ordering::SeqCst)
}

/// The per-device flusher (technique 3): its own thread, its own cache.
fn flusher(
    shared: Arc<Shared>,
    base: Arc<dyn Device>,
    switches: Switches,
    ready: Sender<Result<(), Error>>,
) {
    cairn_core::reactor::block_signals_in_this_thread();
    let q = match BlockingQueue::open(&base, switches) {
        Ok(q) => q,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let b = &shared.budget;
    loop {
        {
            // Every reason to work is checked under the lock that wakers take.
            let st = shared.lock();
            if shared.stop.load(Ordering::SeqCst) {
                drop(st);
                drain(&shared, &q);
                return;
            }
            let closing = b.closing.load(Ordering::SeqCst);
            let urgent = !st.waiters.is_empty()
                || (!st.dirty.is_empty() && (closing || b.dirty_bytes() > b.throttle.background));
            if !urgent {
                b.woken.store(false, Ordering::Relaxed);
                drop(
                    shared
                        .wake
                        .wait_timeout(st, b.interval)
                        .unwrap_or_else(|p| p.into_inner()),
                );
            }
        }
        if shared.stop.load(Ordering::SeqCst) {
            continue;
        }
        // Going away: everything, as every other cache of the budget does too.
        let take = if b.closing.load(Ordering::SeqCst) {
            Take::All
        } else {
            Take::Due
        };
        // (`write_runs` updates the rate estimate as it goes.)
        if round(&shared, &q, take) {
            // A failing base: try again after an interval (or a kick, a flush or the
            // exit), not in a loop that burns a CPU and floods the log.
            let st = shared.lock();
            if !shared.stop.load(Ordering::SeqCst) {
                drop(
                    shared
                        .wake
                        .wait_timeout(st, b.interval)
                        .unwrap_or_else(|p| p.into_inner()),
                );
            }
        }
    }
}

/// A cache in the pool: its state, its base, and whether a cache of the pool lies below
/// it (see [`writing_turn`]).
type Member = (Arc<Shared>, Arc<dyn Device>, bool);

/// A pool thread's reference to a cache for one iteration: its index and [`Member`].
type Held = (usize, Arc<Shared>, Arc<dyn Device>, bool);

/// `--writeback shared`, the "before" of technique 3: one pool with as many threads as
/// there are caches, taking dirty pages from every cache in the order they were dirtied
/// (one page per write, wherever it lies), as a single shared flusher pool did before
/// Linux gave each device its own.
pub struct Pool {
    caches: Mutex<Vec<Option<Member>>>,
    /// (cache, page) in the order the pages became dirty.
    order: Mutex<VecDeque<(usize, u64)>>,
    wake: Condvar,
    /// Set by `kick` (under `order`'s lock), so a wake-up between a thread's look for
    /// work and its wait is never lost.
    kicked: AtomicBool,
    stop: AtomicBool,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    switches: Switches,
    /// Bumped when a cache leaves; each thread acknowledges the value once it has let go
    /// of every reference to the caches gone (so that the last reference to a cache's
    /// base is never dropped on a pool thread).
    epoch: std::sync::atomic::AtomicU64,
    acks: Mutex<Vec<(std::thread::ThreadId, u64)>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pool")
    }
}

impl Pool {
    fn new(switches: Switches) -> Pool {
        Pool {
            caches: Mutex::new(Vec::new()),
            order: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            kicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            switches,
            epoch: std::sync::atomic::AtomicU64::new(0),
            acks: Mutex::new(Vec::new()),
        }
    }

    /// Adds a cache and one thread; returns the cache's index.
    fn register(
        self: &Arc<Pool>,
        shared: Arc<Shared>,
        base: Arc<dyn Device>,
        over_cache: bool,
    ) -> Result<usize, Error> {
        let index = {
            let mut caches = self.caches.lock().unwrap_or_else(|p| p.into_inner());
            caches.push(Some((shared.clone(), base, over_cache)));
            caches.len() - 1
        };
        let (pool, budget) = (self.clone(), Arc::downgrade(&shared.budget));
        let t = std::thread::Builder::new()
            .name(format!("cairn-pool{index}"))
            .spawn(move || pool_thread(pool, budget))
            .map_err(|e| Error::os("cache: start a write-back pool thread", e))?;
        self.acks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((t.thread().id(), u64::MAX));
        self.threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(t);
        Ok(index)
    }

    /// A thread's acknowledgement of `epoch` (see `epoch`).
    fn ack(&self, epoch: u64) {
        let me = std::thread::current().id();
        let mut acks = self.acks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = acks.iter_mut().find(|a| a.0 == me) {
            a.1 = epoch;
        }
    }

    fn kick(&self) {
        let _order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        self.kicked.store(true, Ordering::SeqCst);
        self.wake.notify_all();
    }

    /// Removes a cache (its pages were written back) and waits until no thread holds a
    /// reference to it; the last one stops the threads.
    fn deregister(&self, index: usize) {
        let (member, none_left) = {
            let mut caches = self.caches.lock().unwrap_or_else(|p| p.into_inner());
            let member = caches[index].take();
            (member, caches.iter().all(Option::is_none))
        };
        // Dropped outside the lock (it may hold the last reference to another cache).
        drop(member);
        let me = std::thread::current().id();
        if none_left {
            self.stop.store(true, Ordering::SeqCst);
            self.kick();
            let threads =
                std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
            for t in threads {
                if t.thread().id() != me {
                    let _ = t.join();
                }
            }
            return;
        }
        let epoch = self.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        loop {
            let done = self
                .acks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .all(|&(id, acked)| id == me || acked == u64::MAX || acked >= epoch);
            if done {
                return;
            }
            self.kick();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// A thread of a shared write-back pool: serves the flushes waiting, then writes pages
/// back one at a time in the order they were dirtied, while the oldest is due; else
/// sleeps until kicked or the interval passes.
fn pool_thread(pool: Arc<Pool>, budget: std::sync::Weak<Budget>) {
    cairn_core::reactor::block_signals_in_this_thread();
    let mut queues: HashMap<usize, BlockingQueue> = HashMap::new();
    pool.ack(pool.epoch.load(Ordering::SeqCst));
    loop {
        if pool.stop.load(Ordering::SeqCst) {
            return;
        }
        let Some(b) = budget.upgrade() else { return };
        // This iteration's references; the caches gone lose theirs, then it says so.
        let epoch = pool.epoch.load(Ordering::SeqCst);
        let caches = held_caches(&pool);
        queues.retain(|i, _| caches.iter().any(|c| c.0 == *i));
        pool.ack(epoch);
        let worked = serve_flushes(&pool, &caches, &mut queues);
        if !oldest_due(&pool, &b, &caches) {
            drop(caches);
            if !worked {
                idle(&pool, &b);
            }
            continue;
        }
        write_oldest(&pool, &caches, &mut queues);
    }
}

/// References to the pool's caches now.
fn held_caches(pool: &Pool) -> Vec<Held> {
    pool.caches
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.as_ref().map(|(s, d, o)| (i, s.clone(), d.clone(), *o)))
        .collect()
}

/// Flushes first: a waiting flush gets its whole cache written back. Returns whether
/// any was.
fn serve_flushes(pool: &Pool, caches: &[Held], queues: &mut HashMap<usize, BlockingQueue>) -> bool {
    let mut worked = false;
    for (i, s, d, over_cache) in caches {
        if !s.lock().waiters.is_empty() && open_queue(queues, *i, d, pool.switches) {
            // Another pool thread writing this cache back serves its flushes too.
            if let Some(_writing) = writing_turn(s, *over_cache) {
                round_locked(s, &queues[i], Take::All);
                worked = true;
            }
        }
    }
    worked
}

/// Whether the page first in the order is to be written back now: while over the
/// background level or closing, once it expired, or if its cache is gone. (Never hold
/// the order's lock while taking a cache's: writers take them the other way round.)
fn oldest_due(pool: &Pool, b: &Budget, caches: &[Held]) -> bool {
    let front = pool
        .order
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .front()
        .copied();
    let closing = b.closing.load(Ordering::SeqCst);
    front.is_some_and(|(i, p)| {
        closing
            || b.dirty_bytes() > b.throttle.background
            || caches.iter().find(|c| c.0 == i).is_some_and(|c| {
                c.1.lock().pages.get(&p).is_some_and(|e| {
                    e.dirty
                        && cairn_core::clock::monotonic_ns().saturating_sub(e.dirtied)
                            >= b.expire.as_nanos() as u64
                })
            })
            || caches.iter().all(|c| c.0 != i)
    })
}

/// Nothing to do: sleeps until kicked or the interval passes.
fn idle(pool: &Pool, b: &Budget) {
    b.woken.store(false, Ordering::Relaxed);
    let order = pool.order.lock().unwrap_or_else(|p| p.into_inner());
    if !pool.kicked.swap(false, Ordering::SeqCst) {
        drop(
            pool.wake
                .wait_timeout(order, b.interval)
                .unwrap_or_else(|p| p.into_inner()),
        );
    }
}

/// Takes the page first in the order and writes it back, unless another pool thread
/// writes its cache back now (then it waits its turn again).
fn write_oldest(pool: &Pool, caches: &[Held], queues: &mut HashMap<usize, BlockingQueue>) {
    let next = pool
        .order
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .pop_front();
    let Some((i, p)) = next else { return };
    let Some((_, s, d, over_cache)) = caches.iter().find(|c| c.0 == i) else {
        return;
    };
    let Some(_writing) = writing_turn(s, *over_cache) else {
        // Being written back by another pool thread: the page waits its turn again.
        pool.order
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back((i, p));
        return;
    };
    let Some(run) = page_run(s, p) else { return };
    if !open_queue(queues, i, d, pool.switches) {
        // Not written: no longer held for it.
        if let Some(e) = s.lock().pages.get_mut(&p) {
            e.queued = false;
        }
    } else if !write_runs(s, &queues[&i], vec![run], None)
        && s.lock().pages.get(&p).is_some_and(|e| e.dirty)
    {
        // Rewritten while it was being written: it is still dirty and has left the
        // order, so it goes back in at the end (after the cache's lock; see
        // `oldest_due`).
        pool.order
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back((i, p));
    }
}

/// Page `p` of the cache as a run of its own, held for write-back, if it is dirty.
fn page_run(s: &Shared, p: u64) -> Option<Run> {
    let mut st = s.lock();
    st.pages.get_mut(&p).filter(|e| e.dirty).map(|e| {
        let mut d = Vec::with_capacity(PAGE as usize);
        match &e.data {
            Some(data) => d.extend_from_slice(data),
            None => d.resize(PAGE as usize, 0),
        }
        e.queued = true;
        seal((p, d, vec![(p, e.gen)]))
    })
}

/// Makes sure `queues` has a queue for cache `i` (on `base`); whether it has.
fn open_queue(
    queues: &mut HashMap<usize, BlockingQueue>,
    i: usize,
    base: &Arc<dyn Device>,
    switches: Switches,
) -> bool {
    if let std::collections::hash_map::Entry::Vacant(slot) = queues.entry(i) {
        match BlockingQueue::open(base, switches) {
            Ok(q) => {
                slot.insert(q);
            }
            Err(e) => {
                log::warn!("cairn: write-back pool: cannot open the base: {e}");
                return false;
            }
        }
    }
    true
}
