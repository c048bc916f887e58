//! Backup checkpoints of thin volumes, kept in the pool's metadata: the changes each one
//! reports (on the volume and on later checkpoints' snapshots) against a model of every
//! write and discard, through snapshot deletes, checkpoint removals, clean stops and
//! crashes.

use std::sync::Arc;

use cairn_core::blocking::BlockingQueue;
use cairn_core::{Device, DirtyBitmaps, IoFlags, Op, Switches};
use cairn_leaves::LeafSpec;
use cairn_services::thin::pool::{Admin, LowWater, PoolOptions, ThinPool};
use cairn_services::thin::{ThinDevice, ThinError, ThinPoolAdmin};

const BLOCK: u64 = 64 << 10;
const PAGE: u64 = 4096;
/// The volume: 96 blocks (a leaf of the mapping table is 1024, so also a hole-skipping
/// answer over the tail of the one leaf).
const SIZE: u64 = 96 * BLOCK;

fn opts() -> PoolOptions {
    PoolOptions {
        block_bytes: Some(BLOCK),
        low_water: LowWater::Percent(10),
        repair: false,
    }
}

fn open_pool(data: &Arc<dyn Device>) -> Arc<ThinPool> {
    Arc::new(
        ThinPool::open(
            "pool",
            data.clone(),
            None,
            opts(),
            Switches::default(),
            false,
        )
        .unwrap(),
    )
}

fn admin(pool: &Arc<ThinPool>) -> Arc<dyn ThinPoolAdmin> {
    let d: Arc<dyn Device> = pool.clone();
    d.capability::<dyn ThinPoolAdmin>().unwrap()
}

fn device(pool: &Arc<ThinPool>, name: &str) -> Arc<dyn Device> {
    Arc::new(ThinDevice::open(name, pool.clone(), name, Some(SIZE), true).unwrap())
}

/// The changes checkpoint `name` reports on `dev`: changed or not, per block.
fn changed(dev: &Arc<dyn Device>, name: &str) -> Vec<bool> {
    let bitmaps = dev.capability::<dyn DirtyBitmaps>().unwrap();
    let map = bitmaps
        .reader(name)
        .unwrap_or_else(|| panic!("{}: no changes since '{name}'", dev.name()));
    assert_eq!(map.granularity(), BLOCK);
    let mut runs = Vec::new();
    map.runs(0, SIZE, usize::MAX, &mut runs);
    assert!(!map.inconsistent());
    let mut out = Vec::new();
    for (len, dirty) in runs {
        assert_eq!(len % BLOCK, 0, "{runs:?}", runs = len);
        out.extend(std::iter::repeat_n(dirty, (len / BLOCK) as usize));
    }
    assert_eq!(out.len() as u64, SIZE / BLOCK);
    out
}

/// A small deterministic generator (the cases repeat from their seed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One checkpoint as the model knows it.
struct Point {
    name: String,
    /// The volume's pages at the checkpoint (stamp per page; 0 reads zeros).
    pages: Vec<u32>,
    /// The model's clock at the checkpoint.
    at: u64,
    /// Its snapshot is still in the pool.
    snapshot: bool,
}

/// What the volume went through: its pages now, when each block was last touched, the
/// checkpoints.
struct Model {
    pages: Vec<u32>,
    /// Per block: the clock of every write or discard to it.
    touched: Vec<Vec<u64>>,
    points: Vec<Point>,
    clock: u64,
}

impl Model {
    fn touched_between(&self, block: usize, from: u64, to: u64) -> bool {
        self.touched[block].iter().any(|&t| t > from && t < to)
    }

    /// Checks every checkpoint's changes on the volume and on each later snapshot: a
    /// block reported unchanged holds what it held at the checkpoint, and a block
    /// reported changed was written or discarded between the two.
    fn check(&self, pool: &Arc<ThinPool>, vm: &Arc<dyn Device>) {
        let per_page = (BLOCK / PAGE) as usize;
        let names: Vec<String> = self.points.iter().map(|p| p.name.clone()).collect();
        assert_eq!(vm.capability::<dyn DirtyBitmaps>().unwrap().names(), names);
        // Each export to check: the device, its pages, its clock, the checkpoints before it.
        type Target = (Arc<dyn Device>, Vec<u32>, u64, usize);
        let mut targets: Vec<Target> =
            vec![(vm.clone(), self.pages.clone(), u64::MAX, self.points.len())];
        for (i, p) in self.points.iter().enumerate() {
            if p.snapshot {
                let d: Arc<dyn Device> = Arc::new(
                    ThinDevice::open(&p.name, pool.clone(), &p.name, None, false).unwrap(),
                );
                assert_eq!(
                    d.capability::<dyn DirtyBitmaps>().unwrap().names(),
                    names[..i],
                    "the checkpoints before snapshot '{}'",
                    p.name
                );
                targets.push((d, p.pages.clone(), p.at, i));
            }
        }
        for (dev, pages, at, before) in &targets {
            for c in &self.points[..*before] {
                let got = changed(dev, &c.name);
                for (b, &dirty) in got.iter().enumerate() {
                    let range = b * per_page..(b + 1) * per_page;
                    if dirty {
                        assert!(
                            self.touched_between(b, c.at, *at),
                            "'{}' on {}: block {b} reported changed, never touched",
                            c.name,
                            dev.name()
                        );
                    } else {
                        assert_eq!(
                            pages[range.clone()],
                            c.pages[range],
                            "'{}' on {}: block {b} reported unchanged, and it changed",
                            c.name,
                            dev.name()
                        );
                    }
                }
            }
        }
    }
}

/// Random writes, discards, checkpoints, snapshot deletes, checkpoint removals, clean
/// stops and crashes (after a flush) of one volume; the model checked after each step.
#[test]
fn checkpoints_report_every_change_and_only_changes_through_deletes_removals_and_restarts() {
    for seed in 1..=6u64 {
        run_case(seed);
    }
}

fn run_case(seed: u64) {
    let mut rng = Rng(seed);
    let data = cairn_leaves::open(&LeafSpec::parse("mem:64M").unwrap(), "data").unwrap();
    let mut pool = open_pool(&data);
    let mut vm = device(&pool, "vm");
    let mut q = BlockingQueue::open(&vm, Switches::default()).unwrap();
    let pages = (SIZE / PAGE) as usize;
    let mut m = Model {
        pages: vec![0; pages],
        touched: vec![Vec::new(); (SIZE / BLOCK) as usize],
        points: Vec::new(),
        clock: 0,
    };
    let mut made = 0;
    for step in 0..160 {
        m.clock += 1;
        let roll = rng.below(100);
        if roll < 60 {
            let page = rng.below(pages as u64) as usize;
            let stamp = (seed as u32) << 16 | step as u32 | 1;
            q.write(
                page as u64 * PAGE,
                &cairn_testkit::pattern(stamp as u64, PAGE as usize),
                IoFlags::NONE,
            )
            .unwrap();
            m.pages[page] = stamp;
            m.touched[page / (BLOCK / PAGE) as usize].push(m.clock);
        } else if roll < 68 {
            let block = rng.below(SIZE / BLOCK);
            q.zero(Op::Discard, block * BLOCK, BLOCK, IoFlags::NONE)
                .unwrap();
            let per = (BLOCK / PAGE) as usize;
            m.pages[block as usize * per..(block as usize + 1) * per].fill(0);
            m.touched[block as usize].push(m.clock);
        } else if roll < 80 {
            made += 1;
            let name = format!("c{made}");
            admin(&pool)
                .admin(Admin::Checkpoint {
                    src: "vm".into(),
                    name: name.clone(),
                    granularity: None,
                })
                .unwrap();
            m.points.push(Point {
                name,
                pages: m.pages.clone(),
                at: m.clock,
                snapshot: true,
            });
        } else if roll < 87 && m.points.len() > 1 {
            // `thin delete` of a snapshot that is not the newest checkpoint's: its
            // changes are kept.
            let i = rng.below(m.points.len() as u64 - 1) as usize;
            if m.points[i].snapshot {
                let name = m.points[i].name.clone();
                admin(&pool).admin(Admin::Delete { name }).unwrap();
                m.points[i].snapshot = false;
            }
        } else if roll < 93 && !m.points.is_empty() {
            let i = rng.below(m.points.len() as u64) as usize;
            let name = m.points[i].name.clone();
            admin(&pool)
                .admin(Admin::Uncheckpoint {
                    volume: "vm".into(),
                    name,
                })
                .unwrap();
            let newest = i + 1 == m.points.len();
            m.points.remove(i);
            if newest {
                // Those whose changes reached the volume only through it go too.
                while m.points.last().is_some_and(|p| !p.snapshot) {
                    m.points.pop();
                }
            }
        } else if roll < 97 {
            // A stop, clean or as a crash after a flush, and the pool opened again.
            q.flush().unwrap();
            drop(q);
            drop(vm);
            if rng.below(2) == 0 {
                // No last commit, no checkpoint of the metadata: the log is replayed.
                pool.crash_on_close();
            }
            drop(pool);
            pool = open_pool(&data);
            vm = device(&pool, "vm");
            q = BlockingQueue::open(&vm, Switches::default()).unwrap();
        }
        m.check(&pool, &vm);
    }
    // The newest checkpoint's snapshot is refused, saying what to do instead.
    if let Some(last) = m.points.last() {
        let e = admin(&pool)
            .admin(Admin::Delete {
                name: last.name.clone(),
            })
            .unwrap_err();
        assert!(matches!(e, ThinError::NewestCheckpoint { .. }), "{e}");
        assert!(e.to_string().contains("checkpoint remove pool vm"), "{e}");
    }
}

/// A volume grown after a checkpoint: the blocks written in its new space are changes
/// since it, the new space never written is not (it reads as zeros), and the volume's
/// old blocks are as before.
#[test]
fn a_grown_volume_reports_its_new_blocks_written_as_changed() {
    let data = cairn_leaves::open(&LeafSpec::parse("mem:64M").unwrap(), "data").unwrap();
    let pool = open_pool(&data);
    let vm = device(&pool, "vm");
    let q = BlockingQueue::open(&vm, Switches::default()).unwrap();
    q.write(0, &cairn_testkit::pattern(1, 4096), IoFlags::NONE)
        .unwrap();
    admin(&pool)
        .admin(Admin::Checkpoint {
            src: "vm".into(),
            name: "c1".into(),
            granularity: None,
        })
        .unwrap();
    admin(&pool)
        .admin(Admin::Grow {
            name: "vm".into(),
            size: 2 * SIZE,
        })
        .unwrap();
    let q = BlockingQueue::open(&vm, Switches::default()).unwrap();
    q.write(
        SIZE + 3 * BLOCK,
        &cairn_testkit::pattern(2, 4096),
        IoFlags::NONE,
    )
    .unwrap();
    let map = vm
        .capability::<dyn DirtyBitmaps>()
        .unwrap()
        .reader("c1")
        .unwrap();
    let mut runs = Vec::new();
    map.runs(0, 2 * SIZE, usize::MAX, &mut runs);
    assert_eq!(
        runs,
        vec![
            (SIZE + 3 * BLOCK, false),
            (BLOCK, true),
            (SIZE - 4 * BLOCK, false)
        ]
    );
    // Past the volume's end, nothing says a range did not change.
    let mut past = Vec::new();
    map.runs(2 * SIZE, BLOCK, usize::MAX, &mut past);
    assert_eq!(past, vec![(BLOCK, true)]);
}
