//! The write-back cache: durability at flush, write-back in the background, and no lost
//! update when writes race the flusher. (Data against a model, sequentially: `model.rs`.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_config::StackFile;
use cairn_core::blocking::BlockingQueue;
use cairn_core::capability::writeback_totals;
use cairn_core::{Device, IoFlags, Switches};

const PAGE: usize = 4096;
/// Where data starts on each member of an array with superblocks.
const DATA_OFFSET: usize = 1 << 20;

fn cache(writeback: &str, base_size: &str, memory: &str, volatile: bool) -> Arc<dyn Device> {
    let text = format!(
        "[writeback]\n{writeback}\n[device.m]\ntype = \"mem\"\nsize = \"{base_size}\"\nblock = 4096\nvolatile = {volatile}\n\
         [device.c]\ntype = \"cache\"\nbase = \"m\"\nmemory = \"{memory}\"\n"
    );
    StackFile::parse(&text).unwrap().open("c").unwrap()
}

fn queue(d: &Arc<dyn Device>) -> BlockingQueue {
    BlockingQueue::open(d, Switches::default()).unwrap()
}

fn page_of(v: u32) -> Vec<u8> {
    let mut p = vec![0u8; PAGE];
    for (i, b) in p.iter_mut().enumerate() {
        *b = (v as usize * 31 + i) as u8;
    }
    p[..4].copy_from_slice(&v.to_le_bytes());
    p
}

fn read(q: &BlockingQueue, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    q.read(offset, &mut b).unwrap();
    b
}

#[test]
fn a_flush_makes_cached_writes_durable() {
    // Nothing is written back on its own for a minute: only the flush does it.
    let c = cache(
        "background = \"50%\"\nlimit = \"90%\"\nexpire = \"60s\"\ninterval = \"60s\"",
        "1M",
        "256K",
        true,
    );
    let q = queue(&c);
    let a = page_of(1);
    let b = page_of(2);
    q.write(0, &a, IoFlags::NONE).unwrap();
    q.flush().unwrap();
    q.write(PAGE as u64, &b, IoFlags::NONE).unwrap();
    assert_eq!(read(&q, PAGE as u64, PAGE), b, "cached data is read back");
    // The cache and the volatile base lose everything not flushed.
    c.power_cut();
    assert_eq!(read(&q, 0, PAGE), a, "flushed data survives the cut");
    assert!(
        read(&q, PAGE as u64, PAGE).iter().all(|&x| x == 0),
        "unflushed data is gone"
    );
    // FUA goes through to the base before it completes.
    q.write(2 * PAGE as u64, &b, IoFlags::FUA).unwrap();
    c.power_cut();
    assert_eq!(read(&q, 2 * PAGE as u64, PAGE), b);
}

#[test]
fn the_flusher_writes_back_expired_pages_by_itself() {
    let c = cache(
        "background = \"50%\"\nlimit = \"90%\"\nexpire = \"10ms\"\ninterval = \"5ms\"",
        "1M",
        "256K",
        false,
    );
    let q = queue(&c);
    for i in 0..8u32 {
        q.write(u64::from(i) * 3 * PAGE as u64, &page_of(i), IoFlags::NONE)
            .unwrap();
    }
    // Without a flush, the base gets the data once the pages expire.
    let base = c.children()[0].clone();
    let bq = queue(&base);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let done = (0..8u32).all(|i| read(&bq, u64::from(i) * 3 * PAGE as u64, PAGE) == page_of(i));
        if done {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the flusher never wrote the pages back"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(c.describe().contains(" 0 bytes dirty"), "{}", c.describe());
}

#[test]
fn rewrites_racing_the_flusher_are_never_lost() {
    // 16 cache pages over 64, constant write-back (background 0) to a base whose writes
    // take 300 us, so pages are often rewritten while the flusher holds a copy of their
    // older contents; and constant eviction. A flusher that marked such a page clean
    // would leave the base with the older data.
    let text =
        "[writeback]\nbackground = 0\nlimit = \"100%\"\nexpire = \"1ms\"\ninterval = \"1ms\"\n\
                [device.m]\ntype = \"mem\"\nsize = \"256K\"\nblock = 4096\n\
                [device.slow]\ntype = \"delay\"\nbase = \"m\"\nwrite = \"300us\"\n\
                [device.c]\ntype = \"cache\"\nbase = \"slow\"\nmemory = \"64K\"\n";
    let c = StackFile::parse(text).unwrap().open("c").unwrap();
    let q = queue(&c);
    let pages = 64u64;
    let mut last = vec![u32::MAX; pages as usize];
    for i in 0..3000u32 {
        // Mostly a hot set of 8 pages, sometimes the rest (which forces eviction).
        let p = if i % 4 == 0 {
            u64::from(i.wrapping_mul(2654435761)) % pages
        } else {
            u64::from(i % 8)
        };
        q.write(p * PAGE as u64, &page_of(i), IoFlags::NONE)
            .unwrap();
        last[p as usize] = i;
    }
    q.flush().unwrap();
    for p in 0..pages {
        let want = match last[p as usize] {
            u32::MAX => vec![0u8; PAGE],
            v => page_of(v),
        };
        assert_eq!(
            read(&q, p * PAGE as u64, PAGE),
            want,
            "page {p} through the cache"
        );
    }
    // And the base holds the same once everything is written back.
    let bq = queue(&c.children()[0]);
    for p in 0..pages {
        let want = match last[p as usize] {
            u32::MAX => vec![0u8; PAGE],
            v => page_of(v),
        };
        assert_eq!(
            read(&bq, p * PAGE as u64, PAGE),
            want,
            "page {p} in the base"
        );
    }
}

#[test]
fn bad_cache_settings_name_the_key() {
    for (text, key) in [
        ("[device.m]\ntype = \"mem\"\nsize = \"1M\"\n[device.c]\ntype = \"cache\"\nbase = \"m\"\n", "memory"),
        ("[device.m]\ntype = \"mem\"\nsize = \"1M\"\n[device.c]\ntype = \"cache\"\nbase = \"m\"\nmemory = \"1M\"\nsize = 3\n", "size"),
    ] {
        let e = StackFile::parse(text).unwrap_err().to_string();
        assert!(e.contains("'c'") && e.contains(key), "{e}");
    }
    let tiny = "[device.m]\ntype = \"mem\"\nsize = \"1M\"\n[device.c]\ntype = \"cache\"\nbase = \"m\"\nmemory = \"8K\"\n";
    let e = StackFile::parse(tiny).expect_err("an 8K cache is refused");
    assert!(e.to_string().contains("memory"), "{e}");
}

#[test]
fn caches_of_one_file_share_one_dirty_budget() {
    use cairn_stacks::cache::writeback::{Budget, Writeback};
    use cairn_stacks::cache::CacheDevice;
    // Nothing is written back on its own: the budget moves only with writes and flushes.
    let w = Writeback {
        expire: Duration::from_secs(600),
        interval: Duration::from_secs(600),
        ..Writeback::default()
    };
    let budget = Arc::new(Budget::new(&w, 2 << 20).unwrap());
    let mem = |n: &str| {
        let s = cairn_leaves::LeafSpec::parse("mem:1M,block=4k").unwrap();
        cairn_leaves::open(&s, n).unwrap()
    };
    let c0: Arc<dyn Device> = Arc::new(
        CacheDevice::new(
            "c0",
            mem("m0"),
            1 << 20,
            budget.clone(),
            Switches::default(),
        )
        .unwrap(),
    );
    let c1: Arc<dyn Device> = Arc::new(
        CacheDevice::new(
            "c1",
            mem("m1"),
            1 << 20,
            budget.clone(),
            Switches::default(),
        )
        .unwrap(),
    );
    let (q0, q1) = (queue(&c0), queue(&c1));
    for i in 0..3u32 {
        q0.write(u64::from(i) * PAGE as u64, &page_of(i), IoFlags::NONE)
            .unwrap();
    }
    for i in 0..5u32 {
        q1.write(u64::from(i) * PAGE as u64, &page_of(i), IoFlags::NONE)
            .unwrap();
    }
    // Rewriting a dirty page dirties nothing new.
    q1.write(0, &page_of(9), IoFlags::NONE).unwrap();
    assert_eq!(budget.dirty_bytes(), 8 * PAGE as u64);
    q0.flush().unwrap();
    assert_eq!(budget.dirty_bytes(), 5 * PAGE as u64);
    c1.power_cut();
    assert_eq!(budget.dirty_bytes(), 0);
}

/// Closing a stack file's caches writes every one of them back, in both write-back
/// modes: three caches over files, striped, written through the stripe with nothing due
/// for a minute; once the devices are gone, the files hold every write. The stripe keeps
/// superblocks (the default): its data starts 1 MiB into each file.
#[test]
fn every_cache_is_written_back_when_the_stack_closes_in_both_modes() {
    for mode in [
        cairn_core::WritebackMode::PerDevice,
        cairn_core::WritebackMode::Shared,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut text = String::from(
            "[writeback]\nbackground = \"90%\"\nlimit = \"95%\"\nexpire = \"60s\"\ninterval = \"60s\"\n",
        );
        for i in 0..3 {
            text += &format!(
                "[device.f{i}]\ntype = \"file\"\npath = \"{}\"\nsize = \"2M\"\n\
                 [device.c{i}]\ntype = \"cache\"\nbase = \"f{i}\"\nmemory = \"1M\"\n",
                dir.path().join(format!("f{i}.img")).display()
            );
        }
        text +=
            "[device.s]\ntype = \"stripe\"\nmembers = [\"c0\", \"c1\", \"c2\"]\nchunk = \"4K\"\n";
        let switches = Switches {
            writeback: mode,
            ..Switches::default()
        };
        let data: Vec<u8> = (0..3 * 256 * PAGE as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        {
            let s = StackFile::parse(&text)
                .unwrap()
                .open_with("s", switches)
                .unwrap();
            let q = BlockingQueue::open(&s, switches).unwrap();
            for (i, chunk) in data.chunks(64 * PAGE).enumerate() {
                q.write((i * 64 * PAGE) as u64, chunk, IoFlags::NONE)
                    .unwrap();
            }
            assert!(
                writeback_totals(&s).dirty_bytes > 0,
                "{mode:?}: the writes are cached"
            );
        }
        // Page k of the stripe is page k / 3 of file k % 3's data area.
        let files: Vec<Vec<u8>> = (0..3)
            .map(|i| std::fs::read(dir.path().join(format!("f{i}.img"))).unwrap())
            .collect();
        // The stripe's last superblock, written through the cache as it stopped, reached
        // every file and says it stopped clean.
        for (i, f) in files.iter().enumerate() {
            let newest = [0, 8192]
                .into_iter()
                .map(|at| &f[at..at + 8192])
                .filter(|slot| slot.starts_with(b"CAIRNSB\0"))
                .max_by_key(|slot| u64::from_le_bytes(slot[16..24].try_into().unwrap()));
            let Some(sb) = newest else {
                panic!("{mode:?}: file {i} has no superblock after closing");
            };
            let flags = u32::from_le_bytes(sb[112..116].try_into().unwrap());
            assert!(flags & 1 == 1, "{mode:?}: file {i}'s superblock says dirty");
        }
        for (k, page) in data.chunks(PAGE).enumerate() {
            let at = DATA_OFFSET + k / 3 * PAGE;
            assert!(
                files[k % 3][at..at + PAGE] == *page,
                "{mode:?}: stripe page {k} is not in file {} after closing",
                k % 3
            );
        }
    }
}

fn shared_switches() -> Switches {
    Switches {
        writeback: cairn_core::WritebackMode::Shared,
        ..Switches::default()
    }
}

/// `--writeback shared`: a page rewritten while a pool thread writes its older copy stays
/// dirty; it must still be written back when it expires (it used to lose its place in the
/// pool's order and wait for a flush, or for the exit, forever).
#[test]
fn shared_pool_writes_back_a_page_rewritten_during_its_write() {
    let text = "[writeback]\nbackground = \"90%\"\nlimit = \"95%\"\nexpire = \"1ms\"\ninterval = \"1ms\"\n\
                [device.m]\ntype = \"mem\"\nsize = \"256K\"\nblock = 4096\n\
                [device.slow]\ntype = \"delay\"\nbase = \"m\"\nwrite = \"100ms\"\n\
                [device.c]\ntype = \"cache\"\nbase = \"slow\"\nmemory = \"64K\"\n";
    let c = StackFile::parse(text)
        .unwrap()
        .open_with("c", shared_switches())
        .unwrap();
    let q = BlockingQueue::open(&c, shared_switches()).unwrap();
    // A copy goes to the pool (due at once), and a newer one is written while the pool
    // writes it (a write takes 100 ms). Several times, so that at least once the newer
    // copy lands during a write.
    for k in 0..5 {
        q.write(0, &page_of(2 * k + 1), IoFlags::NONE).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        q.write(0, &page_of(2 * k + 2), IoFlags::NONE).unwrap();
        std::thread::sleep(Duration::from_millis(120));
    }
    // Whatever copy is written now, the newest must reach the base without a flush.
    let m = c.children()[0].children()[0].clone();
    let mq = queue(&m);
    let deadline = Instant::now() + Duration::from_secs(20);
    while read(&mq, 0, PAGE) != page_of(10) {
        assert!(
            Instant::now() < deadline,
            "the rewritten page never reached the base: {}",
            c.describe()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `--writeback shared` with a cache over a cache: dropping the top writes everything
/// down to the bottom device before the drop returns (the lower cache's last reference
/// used to be dropped on a pool thread, which then tried to join itself).
#[test]
fn shared_pool_closes_a_cache_over_a_cache_completely() {
    let text = "[writeback]\nbackground = \"90%\"\nlimit = \"95%\"\nexpire = \"60s\"\ninterval = \"60s\"\n\
                [device.m]\ntype = \"mem\"\nsize = \"4M\"\nblock = 4096\n\
                [device.slow]\ntype = \"delay\"\nbase = \"m\"\nwrite = \"2ms\"\n\
                [device.l]\ntype = \"cache\"\nbase = \"slow\"\nmemory = \"4M\"\n\
                [device.u]\ntype = \"cache\"\nbase = \"l\"\nmemory = \"4M\"\n";
    let u = StackFile::parse(text)
        .unwrap()
        .open_with("u", shared_switches())
        .unwrap();
    let m = u.children()[0].children()[0].children()[0].clone();
    assert_eq!(m.name(), "m");
    {
        let q = BlockingQueue::open(&u, shared_switches()).unwrap();
        for i in 0..256u32 {
            q.write(u64::from(i) * PAGE as u64, &page_of(i + 1), IoFlags::NONE)
                .unwrap();
        }
    }
    drop(u);
    let bq = queue(&m);
    let missing: Vec<u32> = (0..256u32)
        .filter(|&i| read(&bq, u64::from(i) * PAGE as u64, PAGE) != page_of(i + 1))
        .collect();
    assert!(
        missing.is_empty(),
        "pages not on the bottom device after the drop: {missing:?}"
    );
}

/// Caches over caches in shared mode: a flush of the top one needs pool threads for the
/// ones below. Pool threads used to wait for a cache another pool thread was writing back,
/// so with every thread waiting, the flush never completed (found by the stack-file
/// property test). Bounded by a watchdog: a hang fails the test instead of stalling it.
#[test]
fn shared_pool_flushes_through_caches_over_caches() {
    let text = "[writeback]\nexpire = \"1h\"\ninterval = \"1h\"\n\
                [device.m]\ntype = \"mem\"\nsize = \"4M\"\nblock = 4096\nvolatile = true\n\
                [device.c3]\ntype = \"cache\"\nbase = \"m\"\nmemory = \"64K\"\n\
                [device.c2]\ntype = \"cache\"\nbase = \"c3\"\nmemory = \"64K\"\n\
                [device.c1]\ntype = \"cache\"\nbase = \"c2\"\nmemory = \"64K\"\n";
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let top = StackFile::parse(text)
            .unwrap()
            .open_with("c1", shared_switches())
            .unwrap();
        let q = BlockingQueue::open(&top, shared_switches()).unwrap();
        for round in 0..5u32 {
            for p in 0..8u64 {
                q.write(
                    p * PAGE as u64,
                    &page_of(round * 8 + p as u32),
                    IoFlags::NONE,
                )
                .unwrap();
            }
            q.flush().unwrap();
        }
        drop(q);
        drop(top);
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("every flush completes (a hang in the shared pool otherwise)");
}

/// What a [`HoldDevice`] shares with the test: whether read completions are held back,
/// and how many are held now.
struct Hold {
    state: std::sync::Mutex<(bool, usize)>,
    changed: std::sync::Condvar,
    /// Wakes the reactors of the device's queues once the hold is lifted.
    wake: Arc<std::os::fd::OwnedFd>,
}

impl Hold {
    fn new() -> Arc<Hold> {
        Arc::new(Hold {
            state: std::sync::Mutex::new((false, 0)),
            changed: std::sync::Condvar::new(),
            wake: cairn_core::event::eventfd("hold").unwrap(),
        })
    }

    fn set(&self, on: bool) {
        self.state.lock().unwrap().0 = on;
        if !on {
            cairn_core::event::wake(&*self.wake);
        }
    }

    /// Waits (20 s at most) until `n` read completions are held.
    fn wait_held(&self, n: usize) {
        let (st, _) = self
            .changed
            .wait_timeout_while(self.state.lock().unwrap(), Duration::from_secs(20), |s| {
                s.1 < n
            })
            .unwrap();
        assert!(st.1 >= n, "{} of {n} reads reached the base", st.1);
    }
}

/// A device over another whose reads are done at once (their data is what the inner
/// device held when they were sent) but whose completions are held back while the
/// [`Hold`] is on, and delivered once it is lifted. Everything else passes straight
/// through.
struct HoldDevice {
    inner: Arc<dyn Device>,
    hold: Arc<Hold>,
}

struct HoldQueue {
    core: std::rc::Rc<cairn_core::Core>,
    inner: std::rc::Rc<dyn cairn_core::Queue>,
    hold: Arc<Hold>,
    sink: std::cell::Cell<cairn_core::SinkId>,
    requests: std::cell::RefCell<cairn_core::slab::Slab<cairn_core::Io>>,
    held: std::cell::RefCell<Vec<(cairn_core::Io, cairn_core::IoStatus)>>,
}

impl Device for HoldDevice {
    fn name(&self) -> &str {
        "hold"
    }
    fn describe(&self) -> String {
        format!("hold over {}", self.inner.name())
    }
    fn geometry(&self) -> cairn_core::Geometry {
        self.inner.geometry()
    }
    fn children(&self) -> Vec<Arc<dyn Device>> {
        vec![self.inner.clone()]
    }
    fn open_queue(
        &self,
        core: &std::rc::Rc<cairn_core::Core>,
    ) -> Result<std::rc::Rc<dyn cairn_core::Queue>, cairn_core::Error> {
        let q = std::rc::Rc::new(HoldQueue {
            core: core.clone(),
            inner: self.inner.open_queue(core)?,
            hold: self.hold.clone(),
            sink: std::cell::Cell::new(cairn_core::SinkId(u32::MAX)),
            requests: std::cell::RefCell::new(cairn_core::slab::Slab::with_capacity(64)),
            held: std::cell::RefCell::new(Vec::new()),
        });
        q.sink.set(core.register_sink(q.clone()));
        core.register_poller(q.clone());
        Ok(q)
    }
}

impl cairn_core::Queue for HoldQueue {
    fn submit(&self, io: cairn_core::Io) {
        let token = u64::from(self.requests.borrow_mut().insert(io));
        self.inner.submit(cairn_core::Io {
            sink: self.sink.get(),
            token,
            ..io
        });
    }
    fn stats(&self) -> &cairn_core::QueueStats {
        self.inner.stats()
    }
}

impl cairn_core::Sink for HoldQueue {
    fn io_done(&self, token: u64, status: cairn_core::IoStatus) {
        let io = self.requests.borrow_mut().remove(token as u32);
        if io.op == cairn_core::Op::Read {
            let mut st = self.hold.state.lock().unwrap();
            if st.0 {
                st.1 += 1;
                self.held.borrow_mut().push((io, status));
                self.hold.changed.notify_all();
                return;
            }
        }
        self.core.deliver(io.sink, io.token, status);
    }
}

impl cairn_core::Poller for HoldQueue {
    fn unplug(&self) {}
    fn reap(&self) -> usize {
        let mut st = self.hold.state.lock().unwrap();
        if st.0 || self.held.borrow().is_empty() {
            return 0;
        }
        let held = std::mem::take(&mut *self.held.borrow_mut());
        st.1 -= held.len();
        drop(st);
        for &(io, status) in &held {
            self.core.complete(io.sink, io.token, status);
        }
        held.len()
    }
    fn busy(&self) -> bool {
        !self.held.borrow().is_empty()
    }
    fn event_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&*self.hold.wake)
    }
    fn clear_event(&self) {
        cairn_core::event::reset(&*self.hold.wake);
    }
}

/// A read that misses is sent to the base for its whole range while one of its pages, P,
/// is dirty in the cache, so the base returns P's old contents; before the read completes
/// a flush writes P back and marks it clean. Filling the cache from the read must not
/// evict P before its cached copy is laid over the read's buffer: the read returns P's
/// new contents, and so does reading P again. (The cache used to fill page by page,
/// evicting the oldest clean page, P, for the first uncached one, and returned and cached
/// the old contents.) Deterministic: the base holds the read's completion until the
/// write-back is done.
#[test]
fn a_read_that_misses_returns_a_page_written_back_while_it_was_in_flight() {
    use cairn_stacks::cache::writeback::{Budget, Writeback};
    use cairn_stacks::cache::CacheDevice;
    // Nothing is written back on its own: only the flushes do it.
    let w = Writeback {
        expire: Duration::from_secs(600),
        interval: Duration::from_secs(600),
        ..Writeback::default()
    };
    let budget = Arc::new(Budget::new(&w, 1 << 20).unwrap());
    let hold = Hold::new();
    let mem = cairn_leaves::open(
        &cairn_leaves::LeafSpec::parse("mem:1M,block=4k").unwrap(),
        "m",
    )
    .unwrap();
    let base: Arc<dyn Device> = Arc::new(HoldDevice {
        inner: mem,
        hold: hold.clone(),
    });
    // 16 pages of cache memory (the smallest cache).
    let c: Arc<dyn Device> =
        Arc::new(CacheDevice::new("c", base, 64 << 10, budget, Switches::default()).unwrap());
    let q = queue(&c);
    let p = 16u64;
    let (old, new) = (page_of(1), page_of(2));
    // P's old contents in the base, P cached clean; then 15 more clean pages fill the
    // cache; then P is rewritten (dirty again, the base still holds the old contents).
    q.write(p * PAGE as u64, &old, IoFlags::NONE).unwrap();
    q.flush().unwrap();
    read(&q, 100 * PAGE as u64, 15 * PAGE);
    q.write(p * PAGE as u64, &new, IoFlags::NONE).unwrap();
    hold.set(true);
    // Lifted however the scope ends, so that a failure below cannot leave the reader
    // waiting forever.
    struct Lift<'a>(&'a Hold);
    impl Drop for Lift<'_> {
        fn drop(&mut self) {
            self.0.set(false);
        }
    }
    std::thread::scope(|s| {
        let lift = Lift(&hold);
        // Pages 0 to 16: 0 to 15 are not cached, so the read goes to the base, which
        // returns P's old contents and holds the completion.
        let reader = s.spawn(|| read(&queue(&c), 0, 17 * PAGE));
        hold.wait_held(1);
        // P is written back (the base's writes are not held) and marked clean.
        q.flush().unwrap();
        assert!(c.describe().contains(" 0 bytes dirty"), "{}", c.describe());
        drop(lift);
        let got = reader.join().unwrap();
        assert!(
            got[16 * PAGE..] == new[..],
            "the read returned page {p} as written {} (its contents before the last write)",
            u32::from_le_bytes(got[16 * PAGE..16 * PAGE + 4].try_into().unwrap())
        );
        assert!(
            got[..16 * PAGE].iter().all(|&x| x == 0),
            "pages never written read as zeros"
        );
    });
    assert_eq!(read(&q, p * PAGE as u64, PAGE), new, "page {p} read again");
}

/// A FUA write through a cache makes its own pages durable (written through to the base
/// with FUA), and only them: other dirty pages are not written back by it, and the base is
/// not flushed, so after a power cut of the cache and its volatile base they are lost. (The
/// cache used to turn every FUA write into a flush of everything dirty.)
#[test]
fn a_fua_write_makes_only_its_own_pages_durable() {
    // Nothing is written back on its own for a minute: only flushes and FUA.
    let c = cache(
        "background = \"50%\"\nlimit = \"90%\"\nexpire = \"60s\"\ninterval = \"60s\"",
        "1M",
        "256K",
        true,
    );
    let q = queue(&c);
    let (a, b, f) = (page_of(1), page_of(2), page_of(3));
    q.write(0, &a, IoFlags::NONE).unwrap();
    q.write(2 * PAGE as u64, &b, IoFlags::NONE).unwrap();
    // Page 2 was dirty and is rewritten with FUA: the FUA data is what becomes durable.
    q.write(PAGE as u64, &f, IoFlags::FUA).unwrap();
    q.write(2 * PAGE as u64, &f, IoFlags::FUA).unwrap();
    assert_eq!(
        writeback_totals(&c).dirty_bytes,
        PAGE as u64,
        "page 0 is still dirty (not written back by the FUA writes); pages 1 and 2 are clean"
    );
    assert_eq!(read(&q, 0, PAGE), a, "the cache still serves page 0");
    c.power_cut();
    assert_eq!(read(&q, PAGE as u64, PAGE), f, "a FUA write is durable");
    assert_eq!(
        read(&q, 2 * PAGE as u64, PAGE),
        f,
        "a FUA rewrite is durable"
    );
    assert!(
        read(&q, 0, PAGE).iter().all(|&x| x == 0),
        "a dirty page written before the FUA write was not made durable by it"
    );
}

/// What a [`GateDevice`] shares with the test: while closed, writes without FUA are held
/// before they reach the inner device (a base may complete concurrent writes in any
/// order, and a FUA write before an older plain one).
struct Gate {
    state: std::sync::Mutex<(bool, usize)>,
    changed: std::sync::Condvar,
    /// Each queue's wake-up: every reactor holding writes must see the gate open.
    wakes: std::sync::Mutex<Vec<Arc<std::os::fd::OwnedFd>>>,
}

impl Gate {
    fn new() -> Arc<Gate> {
        Arc::new(Gate {
            state: std::sync::Mutex::new((false, 0)),
            changed: std::sync::Condvar::new(),
            wakes: std::sync::Mutex::new(Vec::new()),
        })
    }

    fn close(&self) {
        self.state.lock().unwrap().0 = true;
    }

    fn open(&self) {
        self.state.lock().unwrap().0 = false;
        for w in self.wakes.lock().unwrap().iter() {
            cairn_core::event::wake(&**w);
        }
    }

    /// Waits (20 s at most) until `n` writes are held.
    fn wait_held(&self, n: usize) {
        let (st, _) = self
            .changed
            .wait_timeout_while(self.state.lock().unwrap(), Duration::from_secs(20), |s| {
                s.1 < n
            })
            .unwrap();
        assert!(st.1 >= n, "{} of {n} writes reached the gate", st.1);
    }
}

/// A device over another whose writes without FUA wait while the [`Gate`] is closed and
/// are sent on once it opens. Everything else passes straight through.
struct GateDevice {
    inner: Arc<dyn Device>,
    gate: Arc<Gate>,
}

struct GateQueue {
    inner: std::rc::Rc<dyn cairn_core::Queue>,
    gate: Arc<Gate>,
    held: std::cell::RefCell<Vec<cairn_core::Io>>,
    wake: Arc<std::os::fd::OwnedFd>,
}

impl Device for GateDevice {
    fn name(&self) -> &str {
        "gate"
    }
    fn describe(&self) -> String {
        format!("gate over {}", self.inner.name())
    }
    fn geometry(&self) -> cairn_core::Geometry {
        self.inner.geometry()
    }
    fn children(&self) -> Vec<Arc<dyn Device>> {
        vec![self.inner.clone()]
    }
    fn power_cut(&self) {
        self.inner.power_cut();
    }
    fn open_queue(
        &self,
        core: &std::rc::Rc<cairn_core::Core>,
    ) -> Result<std::rc::Rc<dyn cairn_core::Queue>, cairn_core::Error> {
        let wake = cairn_core::event::eventfd("gate")?;
        self.gate.wakes.lock().unwrap().push(wake.clone());
        let q = std::rc::Rc::new(GateQueue {
            inner: self.inner.open_queue(core)?,
            gate: self.gate.clone(),
            held: std::cell::RefCell::new(Vec::new()),
            wake,
        });
        core.register_poller(q.clone());
        Ok(q)
    }
}

impl cairn_core::Queue for GateQueue {
    fn submit(&self, io: cairn_core::Io) {
        if io.op == cairn_core::Op::Write && !io.flags.contains(IoFlags::FUA) {
            let mut st = self.gate.state.lock().unwrap();
            if st.0 {
                st.1 += 1;
                self.held.borrow_mut().push(io);
                self.gate.changed.notify_all();
                return;
            }
        }
        self.inner.submit(io);
    }
    fn stats(&self) -> &cairn_core::QueueStats {
        self.inner.stats()
    }
    fn children(&self) -> Vec<std::rc::Rc<dyn cairn_core::Queue>> {
        vec![self.inner.clone()]
    }
}

impl cairn_core::Poller for GateQueue {
    fn unplug(&self) {}
    fn reap(&self) -> usize {
        let mut st = self.gate.state.lock().unwrap();
        if st.0 || self.held.borrow().is_empty() {
            return 0;
        }
        let held = std::mem::take(&mut *self.held.borrow_mut());
        st.1 -= held.len();
        drop(st);
        for &io in &held {
            self.inner.submit(io);
        }
        held.len()
    }
    fn busy(&self) -> bool {
        !self.held.borrow().is_empty()
    }
    fn event_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&*self.wake)
    }
    fn clear_event(&self) {
        cairn_core::event::reset(&*self.wake);
    }
}

/// A FUA write to a page whose older contents the flusher is writing back at that moment
/// must not reach the base beside that older write: the base may complete the FUA write
/// first, and the older write then lands over it, and may be persisted (a disk's cache
/// destaging it, the kernel writing back a file's page) while the cache still holds the
/// FUA data only in memory: a power cut then loses data a FUA write made durable. The
/// base here is a mem without a volatile layer (everything that lands is durable, as if
/// persisted at once), under a gate that holds the write-back until the FUA write has
/// had time to go wherever it goes. Deterministic; the cut comes before any flush. The
/// same for a FUA write-zeroes, which goes through to the base as every zeroing does.
#[test]
fn a_fua_write_is_ordered_after_a_write_back_of_its_page_in_flight() {
    fua_after_a_write_back_in_flight(false);
    fua_after_a_write_back_in_flight(true);
}

fn fua_after_a_write_back_in_flight(zeroing: bool) {
    use cairn_stacks::cache::writeback::{Budget, Writeback};
    use cairn_stacks::cache::CacheDevice;
    let w = Writeback {
        expire: Duration::from_secs(600),
        interval: Duration::from_secs(600),
        ..Writeback::default()
    };
    let budget = Arc::new(Budget::new(&w, 1 << 20).unwrap());
    let gate = Gate::new();
    let mem = cairn_leaves::open(
        &cairn_leaves::LeafSpec::parse("mem:1M,block=4k").unwrap(),
        "m",
    )
    .unwrap();
    let base: Arc<dyn Device> = Arc::new(GateDevice {
        inner: mem.clone(),
        gate: gate.clone(),
    });
    let c: Arc<dyn Device> =
        Arc::new(CacheDevice::new("c", base, 256 << 10, budget, Switches::default()).unwrap());
    let q = queue(&c);
    let p = 5u64;
    let old = page_of(1);
    let new = if zeroing { vec![0u8; PAGE] } else { page_of(2) };
    q.write(p * PAGE as u64, &old, IoFlags::NONE).unwrap();
    gate.close();
    struct Open<'a>(&'a Gate);
    impl Drop for Open<'_> {
        fn drop(&mut self) {
            self.0.open();
        }
    }
    std::thread::scope(|s| {
        let open = Open(&gate);
        // A flush: the flusher copies the old contents and sends them, and the gate
        // holds them.
        let flusher = s.spawn(|| queue(&c).flush().unwrap());
        gate.wait_held(1);
        let fua = s.spawn(|| {
            let q = queue(&c);
            if zeroing {
                q.zero(
                    cairn_core::Op::WriteZeroes,
                    p * PAGE as u64,
                    PAGE as u64,
                    IoFlags::FUA,
                )
            } else {
                q.write(p * PAGE as u64, &new, IoFlags::FUA)
            }
            .unwrap()
        });
        std::thread::sleep(Duration::from_millis(100));
        drop(open);
        flusher.join().unwrap();
        fua.join().unwrap();
    });
    let what = if zeroing { "write-zeroes" } else { "write" };
    assert_eq!(
        read(&q, p * PAGE as u64, PAGE),
        new,
        "{what}: through the cache"
    );
    assert_eq!(
        read(&queue(&mem), p * PAGE as u64, PAGE),
        new,
        "{what}: the base, with every write landed"
    );
    c.power_cut();
    assert_eq!(
        read(&q, p * PAGE as u64, PAGE),
        new,
        "{what}: after a power cut"
    );
}

/// A write-back copies a round's pages first and sends them in batches; a FUA write of a
/// page whose copy is not sent yet goes through at once (nothing of that page is in
/// flight), and completes. The copy, older, must not be sent as it was: it would land
/// after the FUA data and stay, with the page clean in the cache (or evicted from it).
/// Deterministic: 40 separate dirty pages make 40 writes, the first batch (32) is held at
/// the gate while a FUA write of the 36th page's goes through and completes, and reads
/// fill the cache past its size.
#[test]
fn a_write_back_copy_older_than_a_fua_write_is_not_sent() {
    use cairn_stacks::cache::writeback::{Budget, Writeback};
    use cairn_stacks::cache::CacheDevice;
    let w = Writeback {
        expire: Duration::from_secs(600),
        interval: Duration::from_secs(600),
        ..Writeback::default()
    };
    // Background write-back starts at 10% of 64 MiB: never here.
    let budget = Arc::new(Budget::new(&w, 64 << 20).unwrap());
    let gate = Gate::new();
    let mem = cairn_leaves::open(
        &cairn_leaves::LeafSpec::parse("mem:1M,block=4k").unwrap(),
        "m",
    )
    .unwrap();
    let base: Arc<dyn Device> = Arc::new(GateDevice {
        inner: mem.clone(),
        gate: gate.clone(),
    });
    let c: Arc<dyn Device> =
        Arc::new(CacheDevice::new("c", base, 256 << 10, budget, Switches::default()).unwrap());
    let q = queue(&c);
    for i in 0..40u64 {
        q.write(2 * i * PAGE as u64, &page_of(1), IoFlags::NONE)
            .unwrap();
    }
    let p = 2 * 35u64;
    let new = page_of(2);
    gate.close();
    struct Open<'a>(&'a Gate);
    impl Drop for Open<'_> {
        fn drop(&mut self) {
            self.0.open();
        }
    }
    std::thread::scope(|s| {
        let open = Open(&gate);
        let flusher = s.spawn(|| queue(&c).flush().unwrap());
        gate.wait_held(32);
        // (On another thread, so that a cache that made it wait for the held batch fails
        // the test instead of hanging it.)
        let (tx, rx) = std::sync::mpsc::channel();
        let (c, new) = (&c, &new);
        s.spawn(move || {
            let q = queue(c);
            q.write(p * PAGE as u64, new, IoFlags::FUA).unwrap();
            // The page is clean now; reads that miss fill the cache and evict clean
            // pages, oldest first (it would go first): the copy must still be brought up
            // to date.
            read(&q, 100 * PAGE as u64, 30 * PAGE);
            tx.send(()).unwrap();
        });
        let done = rx.recv_timeout(Duration::from_secs(20));
        drop(open);
        flusher.join().unwrap();
        assert!(
            done.is_ok(),
            "the FUA write waited for a write-back batch its page is not in"
        );
    });
    assert_eq!(read(&q, p * PAGE as u64, PAGE), new, "through the cache");
    assert_eq!(
        read(&queue(&mem), p * PAGE as u64, PAGE),
        new,
        "the base, with every write landed"
    );
    c.power_cut();
    assert_eq!(read(&q, p * PAGE as u64, PAGE), new, "after a power cut");
}

/// FUA writes mixed into a hot set of pages that the flusher writes back all the time
/// through a slow base: no page is lost or reordered, through the cache and in the base,
/// and after a power cut every page holds its last FUA data or something written after it.
#[test]
fn fua_writes_racing_the_flusher_are_never_lost() {
    let text =
        "[writeback]\nbackground = 0\nlimit = \"100%\"\nexpire = \"1ms\"\ninterval = \"1ms\"\n\
                [device.m]\ntype = \"mem\"\nsize = \"256K\"\nblock = 4096\nvolatile = true\n\
                [device.slow]\ntype = \"delay\"\nbase = \"m\"\nwrite = \"300us\"\n\
                [device.c]\ntype = \"cache\"\nbase = \"slow\"\nmemory = \"64K\"\n";
    let c = StackFile::parse(text).unwrap().open("c").unwrap();
    let q = queue(&c);
    let pages = 64u64;
    let mut last = vec![u32::MAX; pages as usize];
    // Per page, every value written since (and including) its last FUA write.
    let mut since_fua: Vec<Option<Vec<u32>>> = vec![None; pages as usize];
    for i in 0..2000u32 {
        let p = if i % 4 == 0 {
            u64::from(i.wrapping_mul(2654435761)) % pages
        } else {
            u64::from(i % 8)
        };
        let fua = i % 3 == 0;
        let flags = if fua { IoFlags::FUA } else { IoFlags::NONE };
        q.write(p * PAGE as u64, &page_of(i), flags).unwrap();
        last[p as usize] = i;
        match (&mut since_fua[p as usize], fua) {
            (slot, true) => *slot = Some(vec![i]),
            (Some(v), false) => v.push(i),
            (None, false) => {}
        }
    }
    for p in 0..pages {
        if let Some(v) = last.get(p as usize).filter(|&&v| v != u32::MAX) {
            assert_eq!(read(&q, p * PAGE as u64, PAGE), page_of(*v), "page {p}");
        }
    }
    c.power_cut();
    for p in 0..pages {
        if let Some(allowed) = &since_fua[p as usize] {
            let got = read(&q, p * PAGE as u64, PAGE);
            assert!(
                allowed.iter().any(|&v| page_of(v) == got),
                "page {p}: none of the values since its last FUA write ({allowed:?})"
            );
        }
    }
}
