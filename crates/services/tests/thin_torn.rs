//! Thin pools through power cuts that tear: the power goes at a random request, and of
//! the pages written since the last flush, data and metadata alike, some reach the disk
//! and some do not (a commit of several log blocks may land in part, any part). Then the
//! pool opens, takes more commits, and the power goes again: two and three cuts in a
//! row. After each, every block reads a value it may hold (the one its last successful
//! flush covered, or one written since), and the metadata checks clean.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

use cairn_core::blocking::BlockingQueue;
use cairn_core::{Device, Io, IoFlags, Op, Switches};
use cairn_leaves::LeafSpec;
use cairn_services::thin::pool::{LowWater, PoolOptions, ThinPool};
use cairn_services::thin::ThinDevice;
use cairn_stacks::wrap::{Decision, Policy, WrapDevice};

const PAGE: usize = 4096;
/// Blocks of the volume (64 KiB each: 48 MiB). A write of one page to each of a few
/// hundred new blocks makes a commit of several log blocks.
const BLOCKS: u64 = 768;
const BLOCK: u64 = 64 << 10;

fn content(b: u64, v: u32) -> Vec<u8> {
    let mut out = vec![0u8; PAGE];
    for c in out.chunks_mut(16) {
        c[..8].copy_from_slice(&b.to_le_bytes());
        c[8..12].copy_from_slice(&v.to_le_bytes());
        c[12..16].copy_from_slice(&(!v).to_le_bytes());
    }
    out
}

fn value_of(b: u64, page: &[u8]) -> Option<u32> {
    if page.iter().all(|&x| x == 0) {
        return Some(0);
    }
    let v = u32::from_le_bytes(page[8..12].try_into().unwrap());
    (page == content(b, v).as_slice()).then_some(v)
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn opts() -> PoolOptions {
    PoolOptions {
        block_bytes: Some(BLOCK),
        low_water: LowWater::Percent(1),
        repair: false,
    }
}

/// Cuts the power, tearing, at the `at`-th flush (counted from 0), and fails every
/// request after it: the machine stays off. A flush is where a commit's log blocks wait
/// in the disk's cache, so the cut tears them.
struct CutAtFlush {
    at: u64,
    seed: u64,
    flushes: AtomicU64,
    off: AtomicBool,
}

impl Policy for CutAtFlush {
    fn kind(&self) -> &'static str {
        "fault"
    }

    fn describe(&self) -> String {
        format!("cuts the power at flush {}", self.at)
    }

    fn decide(&self, io: &Io, _now_ns: u64, _random: u64) -> Decision {
        if self.off.load(SeqCst) {
            return Decision::Fail(libc::EIO);
        }
        if io.op == Op::Flush && self.flushes.fetch_add(1, SeqCst) == self.at {
            self.off.store(true, SeqCst);
            return Decision::PowerCut(libc::EIO, Some(self.seed));
        }
        Decision::Forward
    }
}

/// `raw` behind [`CutAtFlush`].
fn dying(raw: &Arc<dyn Device>, at: u64, seed: u64) -> Arc<dyn Device> {
    let policy = CutAtFlush {
        at,
        seed,
        flushes: AtomicU64::new(0),
        off: AtomicBool::new(false),
    };
    Arc::new(WrapDevice::new("cut", raw.clone(), Arc::new(policy)))
}

/// One life of the machine: the pool opens on `disk`, batches of writes to the first
/// page of random blocks each end with a flush, until the power goes (or `batches`
/// are done). Returns whether the pool opened.
fn live(
    disk: &Arc<dyn Device>,
    allowed: &mut [BTreeSet<u32>],
    rng: &mut Rng,
    next: &mut u32,
) -> bool {
    let Ok(pool) = ThinPool::open(
        "pool",
        disk.clone(),
        None,
        opts(),
        Switches::default(),
        false,
    ) else {
        return false;
    };
    let pool = Arc::new(pool);
    let Ok(vol) = ThinDevice::open("v", pool.clone(), "v", Some(BLOCKS * BLOCK), true) else {
        return true;
    };
    let vol: Arc<dyn Device> = Arc::new(vol);
    let q = BlockingQueue::open(&vol, Switches::default()).unwrap();
    let mut newest: Vec<u32> = allowed.iter().map(|a| *a.last().unwrap()).collect();
    let batches = 1 + rng.below(3);
    'batches: for _ in 0..batches {
        let n = 1 + rng.below(500);
        for _ in 0..n {
            let b = rng.below(BLOCKS);
            let v = *next;
            *next += 1;
            // Allowed before it is sent: a write that fails may have landed all the same.
            allowed[b as usize].insert(v);
            if q.write(b * BLOCK, &content(b, v), IoFlags::NONE).is_err() {
                break 'batches;
            }
            newest[b as usize] = v;
        }
        if q.flush().is_err() {
            break;
        }
        for (a, &v) in allowed.iter_mut().zip(&newest) {
            *a = BTreeSet::from([v]);
        }
    }
    pool.crash_on_close();
    true
}

/// After a cut: the metadata checks clean, the pool opens, and every block reads a value
/// it may hold (which becomes the only one it may hold).
fn after_the_cut(raw: &Arc<dyn Device>, allowed: &mut [BTreeSet<u32>], what: &str) {
    ThinPool::open("pool", raw.clone(), None, opts(), Switches::default(), true)
        .unwrap_or_else(|e| panic!("{what}: check after the cut: {e}"));
    let pool: Arc<dyn Device> = Arc::new(
        ThinPool::open(
            "pool",
            raw.clone(),
            None,
            opts(),
            Switches::default(),
            false,
        )
        .unwrap_or_else(|e| panic!("{what}: open after the cut: {e}")),
    );
    let Ok(vol) = ThinDevice::open("v", pool.clone(), "v", Some(BLOCKS * BLOCK), true) else {
        panic!("{what}: the volume does not open");
    };
    let vol: Arc<dyn Device> = Arc::new(vol);
    let q = BlockingQueue::open(&vol, Switches::default()).unwrap();
    let mut page = vec![0u8; PAGE];
    for b in 0..BLOCKS {
        q.read(b * BLOCK, &mut page).unwrap();
        let got = value_of(b, &page);
        let ok = got.is_some_and(|v| allowed[b as usize].contains(&v));
        assert!(
            ok,
            "{what}: block {b} reads {got:?}, allowed {:?}",
            allowed[b as usize]
        );
        allowed[b as usize] = BTreeSet::from([got.unwrap()]);
    }
}

#[test]
fn torn_commits_then_more_commits_and_cuts() {
    for case in 0..80u64 {
        let spec = LeafSpec::parse("mem:64M,volatile=1").unwrap();
        let raw = cairn_leaves::open(&spec, "disk").unwrap();
        let mut rng = Rng(case * 7919 + 1);
        let mut allowed = vec![BTreeSet::from([0u32]); BLOCKS as usize];
        let mut next = 1;
        let cuts = 2 + case % 2;
        for cut in 0..cuts {
            // The open's own flushes come first (a checkpoint, both superblock slots),
            // then two a commit (data, then metadata).
            let n = rng.below(12);
            let disk = dying(&raw, n, rng.next());
            live(&disk, &mut allowed, &mut rng, &mut next);
            drop(disk);
            // Whatever the cut left unflushed (or all of it, when no cut came) goes the
            // torn way too.
            raw.power_cut_torn(rng.next());
            after_the_cut(
                &raw,
                &mut allowed,
                &format!("case {case}, cut {cut} at flush {n}"),
            );
        }
    }
}
