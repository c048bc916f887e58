//! Snapshots and checkpoints taken while copies on write are in flight: they do not wait
//! for the copies, and hold exactly what came before them (the copies' writes come after
//! them: in the volume, and among a checkpoint's changes), through a reopen and a crash.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use cairn_core::blocking::{BlockingQueue, Request};
use cairn_core::{Device, DirtyBitmaps, Io, IoFlags, Op, Switches};
use cairn_leaves::LeafSpec;
use cairn_services::thin::pool::{Admin, LowWater, PoolOptions, ThinPool};
use cairn_services::thin::{ThinDevice, ThinPoolAdmin};
use cairn_stacks::wrap::{Decision, Policy, WrapDevice};
use cairn_testkit::pattern;

const BLOCK: u64 = 64 << 10;
const PAGE: usize = 4096;
const SIZE: u64 = 16 * BLOCK;
/// Long enough for any snapshot on any machine (a bound for a deadlock, not a timing):
/// one that waits for a held copy waits until the test lets the copy go.
const LIVENESS: Duration = Duration::from_secs(30);
/// A held read waits this long unless let go sooner (never, in these tests).
const FOREVER_NS: u64 = 600_000_000_000;

/// Holds the data device's reads (a copy on write's read of the block it copies) while
/// `held`, and lets them go when told, or, when `on_log_write` is armed, at the next
/// write to the metadata device (the commit of a snapshot, made while writes are held):
/// that write is delayed a little so that the copies can end meanwhile.
#[derive(Default)]
struct HoldReads {
    held: AtomicBool,
    /// Reads held so far.
    seen: AtomicU64,
    epoch: AtomicU64,
    watchers: Mutex<Vec<Weak<OwnedFd>>>,
    on_log_write: AtomicBool,
}

impl HoldReads {
    fn hold(&self) {
        self.held.store(true, SeqCst);
    }

    fn release(&self) {
        self.held.store(false, SeqCst);
        self.epoch.fetch_add(1, SeqCst);
        for w in self
            .watchers
            .lock()
            .unwrap()
            .iter()
            .filter_map(Weak::upgrade)
        {
            cairn_core::event::wake(&*w);
        }
    }

    /// Waits until `n` reads were held in all.
    fn wait_seen(&self, n: u64) {
        let began = std::time::Instant::now();
        while self.seen.load(SeqCst) < n {
            assert!(began.elapsed() < LIVENESS, "the copy's read never came");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Policy for HoldReads {
    fn kind(&self) -> &'static str {
        "delay"
    }

    fn describe(&self) -> String {
        "holds reads".into()
    }

    fn decide(&self, io: &Io, _now_ns: u64, _random: u64) -> Decision {
        if io.op == Op::Read && self.held.load(SeqCst) {
            self.seen.fetch_add(1, SeqCst);
            return Decision::Delay(FOREVER_NS);
        }
        Decision::Forward
    }

    fn epoch(&self) -> u64 {
        self.epoch.load(SeqCst)
    }

    fn changes_live(&self) -> bool {
        true
    }

    fn watch(&self, wake: &Arc<OwnedFd>) {
        self.watchers.lock().unwrap().push(Arc::downgrade(wake));
    }

    fn redecide(&self, _io: &Io, _now_ns: u64) -> Decision {
        if self.held.load(SeqCst) {
            Decision::Delay(FOREVER_NS)
        } else {
            Decision::Forward
        }
    }
}

/// The metadata device's side of [`HoldReads::on_log_write`].
struct LogWriteReleases(Arc<HoldReads>);

impl Policy for LogWriteReleases {
    fn kind(&self) -> &'static str {
        "delay"
    }

    fn describe(&self) -> String {
        "lets held reads go at a log write".into()
    }

    fn decide(&self, io: &Io, _now_ns: u64, _random: u64) -> Decision {
        if io.op == Op::Write && self.0.on_log_write.swap(false, SeqCst) {
            self.0.release();
            // The copies' reads, writes and swaps come while writes are held.
            return Decision::Delay(100_000_000);
        }
        Decision::Forward
    }
}

/// A pool over memory that power cuts can empty of what was not flushed, its data
/// device's reads held at will.
struct World {
    data: Arc<dyn Device>,
    meta: Arc<dyn Device>,
    hold: Arc<HoldReads>,
    pool: Option<Arc<ThinPool>>,
}

impl World {
    fn new() -> World {
        let mem = |size: &str| {
            let s = LeafSpec::parse(&format!("mem:{size},volatile=1")).unwrap();
            cairn_leaves::open(&s, "m").unwrap()
        };
        let hold = Arc::new(HoldReads::default());
        let data: Arc<dyn Device> = Arc::new(WrapDevice::new("data", mem("64M"), hold.clone()));
        let meta: Arc<dyn Device> = Arc::new(WrapDevice::new(
            "meta",
            mem("16M"),
            Arc::new(LogWriteReleases(hold.clone())),
        ));
        let mut w = World {
            data,
            meta,
            hold,
            pool: None,
        };
        w.open();
        w
    }

    fn open_pool(&self, dry: bool) -> Result<ThinPool, cairn_core::Error> {
        let opts = PoolOptions {
            block_bytes: Some(BLOCK),
            low_water: LowWater::Percent(10),
            repair: false,
        };
        ThinPool::open(
            "pool",
            self.data.clone(),
            Some(self.meta.clone()),
            opts,
            Switches::default(),
            dry,
        )
    }

    /// Opens the pool, after checking its metadata as `cairn check` does (every block's
    /// count against the mappings that name it).
    fn open(&mut self) {
        if let Err(e) = self.open_pool(true) {
            panic!("the pool's metadata does not check: {e}");
        }
        self.pool = Some(Arc::new(self.open_pool(false).unwrap()));
    }

    fn admin(&self) -> Arc<dyn ThinPoolAdmin> {
        let d: Arc<dyn Device> = self.pool.clone().unwrap();
        d.capability::<dyn ThinPoolAdmin>().unwrap()
    }

    fn device(&self, name: &str) -> Arc<dyn Device> {
        let pool = self.pool.clone().unwrap();
        Arc::new(ThinDevice::open(name, pool, name, Some(SIZE), true).unwrap())
    }

    fn read(&self, name: &str) -> Vec<u8> {
        let q = BlockingQueue::open(&self.device(name), Switches::default()).unwrap();
        let mut b = vec![0u8; SIZE as usize];
        q.read(0, &mut b).unwrap();
        b
    }

    /// Runs `op` on the pool from another thread: its answer, unless it takes longer
    /// than [`LIVENESS`] (then the held reads go, and the test fails).
    fn admin_live(&self, op: Admin) -> String {
        let (tx, rx) = mpsc::channel();
        let admin = self.admin();
        let t = std::thread::spawn(move || tx.send(admin.admin(op)).unwrap());
        let got = rx.recv_timeout(LIVENESS);
        self.hold.release();
        t.join().unwrap();
        match got {
            Ok(answer) => answer.unwrap(),
            Err(_) => panic!("it waited for a copy on write in flight"),
        }
    }

    /// The pool stops as a crash stops it, the devices lose what was not flushed, and it
    /// opens again.
    fn crash(&mut self) {
        if let Some(p) = self.pool.take() {
            p.crash_on_close();
        }
        self.data.power_cut();
        self.meta.power_cut();
        self.open();
    }

    /// A clean stop and an open.
    fn reopen(&mut self) {
        self.pool = None;
        self.open();
    }
}

/// Writes `pages` (volume offset, seed) of 4 KiB, all in flight together, on a thread of
/// its own; [`written`] waits for them.
fn write_async(vm: &Arc<dyn Device>, pages: Vec<(u64, u8)>) -> mpsc::Receiver<bool> {
    let vm = vm.clone();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let q = BlockingQueue::open(&vm, Switches::default()).unwrap();
        let mut bufs: Vec<Vec<u8>> = pages.iter().map(|&(_, s)| pattern(s, PAGE)).collect();
        let mut reqs: Vec<Request> = bufs
            .iter_mut()
            .zip(&pages)
            .map(|(b, &(at, _))| Request {
                op: Op::Write,
                flags: IoFlags::NONE,
                offset: at,
                len: 0,
                buf: Some(b.as_mut_slice()),
            })
            .collect();
        let _ = tx.send(q.run(&mut reqs).iter().all(Result::is_ok));
    });
    rx
}

/// Waits for the writes of [`write_async`]: they all succeed (a copy whose swap waited
/// for a snapshot swaps once it is taken).
fn written(rx: mpsc::Receiver<bool>) {
    match rx.recv_timeout(LIVENESS) {
        Ok(ok) => assert!(ok, "the copies' writes failed"),
        Err(_) => panic!("the copies' writes never ended"),
    }
}

/// `whole` with the 4 KiB pages `pages` (volume offset, seed) written over it.
fn overwritten(mut whole: Vec<u8>, pages: &[(u64, u8)]) -> Vec<u8> {
    for &(at, s) in pages {
        whole[at as usize..][..PAGE].copy_from_slice(&pattern(s, PAGE));
    }
    whole
}

/// A snapshot taken while a copy on write's read is held completes (it used to wait for
/// the copy), and so does one whose commit the copies end during (their swaps wait for
/// it): each snapshot holds the data from before the copies, the volume the copies'
/// writes, and the pool's counts check after a crash and after a clean reopen.
#[test]
fn a_snapshot_does_not_wait_for_copies_on_write_in_flight() {
    let mut w = World::new();
    let vm = w.device("vm");
    let q = BlockingQueue::open(&vm, Switches::default()).unwrap();
    let old = pattern(1, SIZE as usize);
    q.write(0, &old, IoFlags::NONE).unwrap();
    w.admin_live(Admin::Snapshot {
        src: "vm".into(),
        name: "s0".into(),
        read_only: true,
    });
    // A copy stuck in flight for the whole snapshot.
    let first = [(4096, 2), (2 * BLOCK + 8192, 3)];
    w.hold.hold();
    let writer = write_async(&vm, first.to_vec());
    w.hold.wait_seen(2);
    let said = w.admin_live(Admin::Snapshot {
        src: "vm".into(),
        name: "s1".into(),
        read_only: true,
    });
    assert!(said.contains("held for"), "{said}");
    written(writer);
    q.flush().unwrap();
    // Copies that end (and swap) while the next snapshot commits.
    let second = [(5 * BLOCK, 4), (7 * BLOCK + 4096, 5)];
    w.hold.hold();
    let writer = write_async(&vm, second.to_vec());
    w.hold.wait_seen(4);
    w.hold.on_log_write.store(true, SeqCst);
    w.admin_live(Admin::Snapshot {
        src: "vm".into(),
        name: "s2".into(),
        read_only: true,
    });
    written(writer);
    q.flush().unwrap();
    drop((q, vm));
    let after_first = overwritten(old.clone(), &first);
    let now = overwritten(after_first.clone(), &second);
    let check = |w: &World, when: &str| {
        assert!(w.read("s0") == old, "s0 {when}");
        assert!(
            w.read("s1") == old,
            "s1 holds a write that came after it ({when})"
        );
        assert!(
            w.read("s2") == after_first,
            "s2 holds a write that came after it, or misses one before it ({when})"
        );
        assert!(w.read("vm") == now, "vm lost a copy's write ({when})");
    };
    check(&w, "at once");
    w.crash();
    check(&w, "after a crash");
    w.reopen();
    check(&w, "after a reopen");
}

/// The changes checkpoint `name` reports on `dev`: the blocks changed.
fn changed(dev: &Arc<dyn Device>, name: &str) -> Vec<u64> {
    let map = dev
        .capability::<dyn DirtyBitmaps>()
        .unwrap()
        .reader(name)
        .unwrap_or_else(|| panic!("no changes since '{name}'"));
    let mut runs = Vec::new();
    map.runs(0, SIZE, usize::MAX, &mut runs);
    let mut out = Vec::new();
    let mut at = 0;
    for (len, dirty) in runs {
        if dirty {
            out.extend((at / BLOCK)..((at + len) / BLOCK));
        }
        at += len;
    }
    out
}

/// A checkpoint taken while copies on write are stuck in flight completes, and reports
/// exactly the blocks those copies wrote as changed since it (its snapshot holds the
/// data from before them), also after a crash and a reopen.
#[test]
fn a_checkpoint_taken_while_copies_are_in_flight_reports_them_as_after_it() {
    let mut w = World::new();
    let vm = w.device("vm");
    let q = BlockingQueue::open(&vm, Switches::default()).unwrap();
    let old = pattern(1, SIZE as usize);
    q.write(0, &old, IoFlags::NONE).unwrap();
    let checkpoint = |w: &World, name: &str| {
        w.admin_live(Admin::Checkpoint {
            src: "vm".into(),
            name: name.into(),
            granularity: None,
        })
    };
    checkpoint(&w, "c1");
    // Block 2 copied before c2 (and owned by the volume then).
    let before = [(2 * BLOCK + 4096, 2)];
    q.write(before[0].0, &pattern(2, PAGE), IoFlags::NONE)
        .unwrap();
    q.flush().unwrap();
    let stuck = [(4 * BLOCK, 3), (9 * BLOCK + 8192, 4)];
    w.hold.hold();
    let writer = write_async(&vm, stuck.to_vec());
    w.hold.wait_seen(2);
    checkpoint(&w, "c2");
    written(writer);
    q.flush().unwrap();
    drop((q, vm));
    let at_c2 = overwritten(old.clone(), &before);
    let now = overwritten(at_c2.clone(), &stuck);
    let check = |w: &World, when: &str| {
        let vm = w.device("vm");
        assert_eq!(changed(&vm, "c2"), [4, 9], "changes since c2 ({when})");
        assert_eq!(changed(&vm, "c1"), [2, 4, 9], "changes since c1 ({when})");
        assert_eq!(
            changed(&w.device("c2"), "c1"),
            [2],
            "changes from c1 to c2 ({when})"
        );
        assert!(w.read("c2") == at_c2, "c2's snapshot ({when})");
        assert!(w.read("vm") == now, "vm ({when})");
    };
    check(&w, "at once");
    w.crash();
    check(&w, "after a crash");
    w.reopen();
    check(&w, "after a reopen");
}
