//! Thin pools against a model of every volume and snapshot: random writes (FUA or not),
//! zeroes, discards, flushes, snapshots, clones, deletes and power cuts over a volatile
//! mem, in a pool small enough to fill. Every read is compared with the model; after a
//! cut (the pool stopped as a crash stops it, then the unflushed writes of the mem lost)
//! every page reads a value written since its last flush (or the value it had then),
//! every snapshot reads as when it was taken, and the pool's metadata checks clean.

use std::collections::BTreeSet;
use std::sync::Arc;

use cairn_core::blocking::BlockingQueue;
use cairn_core::{Device, IoFlags, Op, Switches};
use cairn_leaves::LeafSpec;
use cairn_services::thin::pool::{Admin, LowWater, PoolOptions, ThinPool};
use cairn_services::thin::ThinDevice;
use cairn_services::thin::ThinPoolAdmin;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError};

const PAGE: usize = 4096;
/// Pages of every volume (1 MiB: 16 blocks of 64 KiB).
const PAGES: u64 = 256;

#[derive(Debug, Clone)]
enum Step {
    Write {
        v: usize,
        page: u64,
        n: u64,
        fua: bool,
    },
    Zero {
        v: usize,
        page: u64,
        n: u64,
        discard: bool,
        no_hole: bool,
    },
    Flush {
        v: usize,
    },
    Read {
        v: usize,
        page: u64,
        n: u64,
    },
    Snapshot {
        v: usize,
    },
    Clone {
        v: usize,
    },
    Delete {
        v: usize,
    },
    /// A power cut that tears: each page written since the last flush, data or
    /// metadata, reaches the disk or not, as the seed picks.
    Cut {
        seed: u64,
    },
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let v = 0..8usize;
    let page = 0..PAGES;
    let step = prop_oneof![
        12 => (v.clone(), page.clone(), 1..40u64, prop::bool::weighted(0.1))
            .prop_map(|(v, page, n, fua)| Step::Write { v, page, n, fua }),
        3 => (v.clone(), page.clone(), 1..48u64, any::<bool>(), prop::bool::weighted(0.2))
            .prop_map(|(v, page, n, discard, no_hole)| Step::Zero { v, page, n, discard, no_hole }),
        2 => v.clone().prop_map(|v| Step::Flush { v }),
        4 => (v.clone(), page, 1..64u64).prop_map(|(v, page, n)| Step::Read { v, page, n }),
        2 => v.clone().prop_map(|v| Step::Snapshot { v }),
        1 => v.clone().prop_map(|v| Step::Clone { v }),
        1 => v.prop_map(|v| Step::Delete { v }),
        1 => any::<u64>().prop_map(|seed| Step::Cut { seed }),
    ];
    prop::collection::vec(step, 1..60)
}

/// Page `p` holding value `v` (0: zeros). The value is in its first 4 bytes.
fn content(p: u64, v: u32) -> Vec<u8> {
    if v == 0 {
        return vec![0u8; PAGE];
    }
    let mut b = vec![0u8; PAGE];
    let mut x = (p << 32) ^ u64::from(v) ^ 0x9e37_79b9_7f4a_7c15;
    for chunk in b.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    b[..4].copy_from_slice(&v.to_le_bytes());
    b
}

/// The value page `p` holds, or `None` for bytes no write made.
fn value_of(p: u64, b: &[u8]) -> Option<u32> {
    let v = u32::from_le_bytes(b[..4].try_into().unwrap());
    (content(p, v) == b).then_some(v)
}

struct Vol {
    name: String,
    read_only: bool,
    /// What a read returns now.
    now: Vec<u32>,
    /// What a power cut may leave.
    allowed: Vec<BTreeSet<u32>>,
    open: Option<(Arc<dyn Device>, BlockingQueue)>,
    /// Made or deleted by an operation the power cut interrupted: it may or may not be
    /// there after the cut (if it is, it reads as `allowed` says).
    maybe: bool,
}

impl Vol {
    fn new(name: String, read_only: bool, now: Vec<u32>) -> Vol {
        let allowed = now.iter().map(|&v| BTreeSet::from([v])).collect();
        Vol {
            name,
            read_only,
            now,
            allowed,
            open: None,
            maybe: false,
        }
    }
}

struct World {
    data: Arc<dyn Device>,
    /// A metadata device of its own, or the metadata at the start of `data`.
    meta: Option<Arc<dyn Device>>,
    pool: Option<Arc<ThinPool>>,
    vols: Vec<Vol>,
    next_value: u32,
    next_name: u32,
    /// With a cut at a random request: the mem under it (the pool opens there after).
    raw: Option<Arc<dyn Device>>,
    /// The cut happened (an operation failed): the machine is off until `cut`.
    dead: bool,
}

fn opts() -> PoolOptions {
    PoolOptions {
        block_bytes: Some(64 << 10),
        low_water: LowWater::Percent(10),
        repair: false,
    }
}

impl World {
    fn pool(&self) -> &ThinPool {
        self.pool.as_deref().unwrap()
    }

    fn open_pool(&mut self) {
        self.try_open_pool().unwrap();
    }

    fn try_open_pool(&mut self) -> Result<(), cairn_core::Error> {
        let p = ThinPool::open(
            "pool",
            self.data.clone(),
            self.meta.clone(),
            opts(),
            Switches::default(),
            false,
        )?;
        self.pool = Some(Arc::new(p));
        Ok(())
    }

    /// Opens volume `i` (creating it), or says why not.
    fn try_open(&mut self, i: usize) -> Result<(), cairn_core::Error> {
        let pool = self.pool.clone().unwrap();
        let name = self.vols[i].name.clone();
        let d: Arc<dyn Device> = Arc::new(ThinDevice::open(
            &name,
            pool,
            &name,
            Some(PAGES * PAGE as u64),
            true,
        )?);
        let q = BlockingQueue::open(&d, Switches::default())?;
        self.vols[i].open = Some((d, q));
        Ok(())
    }

    fn q(&mut self, i: usize) -> &BlockingQueue {
        if self.vols[i].open.is_none() {
            let pool = self.pool.clone().unwrap();
            let name = self.vols[i].name.clone();
            let d: Arc<dyn Device> = Arc::new(
                ThinDevice::open(&name, pool, &name, Some(PAGES * PAGE as u64), true).unwrap(),
            );
            let q = BlockingQueue::open(&d, Switches::default()).unwrap();
            self.vols[i].open = Some((d, q));
        }
        &self.vols[i].open.as_ref().unwrap().1
    }

    /// A commit made everything durable.
    fn all_durable(&mut self) {
        for v in &mut self.vols {
            for (a, &n) in v.allowed.iter_mut().zip(&v.now) {
                *a = BTreeSet::from([n]);
            }
        }
    }

    fn check(&mut self, i: usize, page: u64, n: u64, when: &str) -> Result<(), TestCaseError> {
        let n = n.min(PAGES - page);
        let mut b = vec![0u8; (n as usize) * PAGE];
        self.q(i).read(page * PAGE as u64, &mut b).unwrap();
        for k in 0..n {
            let p = page + k;
            let got = value_of(p, &b[k as usize * PAGE..][..PAGE]);
            let want = self.vols[i].now[p as usize];
            prop_assert_eq!(
                got,
                Some(want),
                "{} {}: page {} {}",
                self.vols[i].name,
                when,
                p,
                ""
            );
        }
        Ok(())
    }

    /// The pool stops as a crash stops it, the mem loses what was not flushed, and the
    /// pool opens again: every page holds a value it was allowed to.
    fn cut(&mut self, seed: u64) -> Result<(), TestCaseError> {
        if self.pool.is_some() {
            self.pool().crash_on_close();
        }
        for v in &mut self.vols {
            v.open = None;
        }
        self.pool = None;
        self.data.power_cut_torn(seed);
        if let Some(m) = &self.meta {
            m.power_cut_torn(seed.rotate_left(17));
        }
        if let Some(raw) = self.raw.take() {
            // The machine comes back without the dying device.
            self.data = raw;
        }
        self.dead = false;
        // The metadata checks clean (what `cairn check` does), then the pool runs again.
        ThinPool::open(
            "pool",
            self.data.clone(),
            self.meta.clone(),
            opts(),
            Switches::default(),
            true,
        )
        .map_err(|e| TestCaseError::fail(format!("check after the cut: {e}")))?;
        self.open_pool();
        let there: Vec<String> = self
            .pool()
            .report()
            .volumes
            .into_iter()
            .map(|v| v.0)
            .collect();
        for v in &self.vols {
            prop_assert!(
                v.maybe || there.contains(&v.name),
                "{} is gone after the cut",
                v.name
            );
        }
        prop_assert!(
            there.iter().all(|n| self.vols.iter().any(|v| &v.name == n)),
            "after the cut the pool has {:?}, the model {:?}",
            there,
            self.vols.iter().map(|v| &v.name).collect::<Vec<_>>()
        );
        self.vols.retain(|v| there.contains(&v.name));
        for v in &mut self.vols {
            v.maybe = false;
        }
        for i in 0..self.vols.len() {
            let mut b = vec![0u8; PAGES as usize * PAGE];
            self.q(i).read(0, &mut b).unwrap();
            for p in 0..PAGES {
                let got = value_of(p, &b[p as usize * PAGE..][..PAGE]);
                let v = &mut self.vols[i];
                let ok = got.is_some_and(|g| v.allowed[p as usize].contains(&g));
                prop_assert!(
                    ok,
                    "{} after the cut: page {} reads {:?}, allowed {:?}",
                    v.name,
                    p,
                    got,
                    v.allowed[p as usize]
                );
                let g = got.unwrap();
                v.now[p as usize] = g;
                v.allowed[p as usize] = BTreeSet::from([g]);
            }
        }
        Ok(())
    }
}

/// Runs `steps`; with `cut_at`, the power goes at that request to the data device (and
/// the machine stays off: every later request fails), the operation under way fails,
/// and the run ends with the check after the cut.
fn run(steps: &[Step], separate: bool, cut_at: Option<u64>) -> Result<(), TestCaseError> {
    let mem = |s: &str, name| cairn_leaves::open(&LeafSpec::parse(s).unwrap(), name).unwrap();
    let mut raw = None;
    let (data, meta) = if let Some(n) = cut_at {
        let text = format!(
            "[device.m]\ntype = \"mem\"\nsize = \"8M\"\nvolatile = true\n\
             [device.cut]\ntype = \"fault\"\nbase = \"m\"\npower_cut = true\nafter_ios = {n}\n\
             [device.off]\ntype = \"fault\"\nbase = \"cut\"\nfail = [\"read\", \"write\", \"flush\"]\nafter_ios = {}\n",
            n + 1
        );
        let stack = cairn_config::StackFile::parse(&text).unwrap();
        let off = stack
            .open_all(&["off".to_string()], Switches::default())
            .unwrap()
            .remove(0);
        raw = Some(off.children()[0].children()[0].clone());
        (off, None)
    } else if separate {
        (
            mem("mem:6M,volatile=1", "data"),
            Some(mem("mem:4M,volatile=1", "meta")),
        )
    } else {
        (mem("mem:8M,volatile=1", "data"), None)
    };
    let mut w = World {
        data,
        meta,
        pool: None,
        vols: vec![Vol::new("v0".into(), false, vec![0; PAGES as usize])],
        next_value: 1,
        next_name: 1,
        raw,
        dead: false,
    };
    if cut_at.is_some() {
        // The cut may come while the pool or the volume is made.
        if w.try_open_pool().is_err() || w.try_open(0).is_err() {
            w.vols[0].maybe = true;
            w.dead = true;
        }
    } else {
        w.open_pool();
        w.q(0);
    }
    w.all_durable();
    for step in steps {
        if w.dead {
            break;
        }
        let pick = |v: usize, n: usize| v % n;
        match *step {
            Step::Write { v, page, n, fua } => {
                let i = pick(v, w.vols.len());
                let n = n.min(PAGES - page);
                let val = w.next_value;
                w.next_value += 1;
                let mut b = Vec::with_capacity(n as usize * PAGE);
                for k in 0..n {
                    b.extend(content(page + k, val));
                }
                let flags = if fua { IoFlags::FUA } else { IoFlags::NONE };
                let r = w.q(i).write(page * PAGE as u64, &b, flags);
                let vol = &mut w.vols[i];
                match r {
                    Ok(()) => {
                        for k in 0..n {
                            let p = (page + k) as usize;
                            vol.now[p] = val;
                            if fua {
                                vol.allowed[p] = BTreeSet::from([val]);
                            } else {
                                vol.allowed[p].insert(val);
                            }
                        }
                        prop_assert!(!vol.read_only, "a write to snapshot {} succeeded", vol.name);
                    }
                    Err(e) if cut_at.is_some() && e.to_string().contains("Input/output") => {
                        // The cut: it may have landed.
                        for k in 0..n {
                            vol.allowed[(page + k) as usize].insert(val);
                        }
                        w.dead = true;
                    }
                    Err(e) => {
                        let s = e.to_string();
                        prop_assert!(
                            (vol.read_only && s.contains("Read-only")) || s.contains("No space"),
                            "write to {}: {}",
                            vol.name,
                            s
                        );
                    }
                }
                // A FUA write makes its own pages durable (above), nothing more: one into
                // blocks whose mappings are durable goes down with FUA and no commit.
            }
            Step::Zero {
                v,
                page,
                n,
                discard,
                no_hole,
            } => {
                let i = pick(v, w.vols.len());
                let n = n.min(PAGES - page);
                let op = if discard {
                    Op::Discard
                } else {
                    Op::WriteZeroes
                };
                let flags = if no_hole && !discard {
                    IoFlags::NO_HOLE
                } else {
                    IoFlags::NONE
                };
                let r = w.q(i).zero(op, page * PAGE as u64, n * PAGE as u64, flags);
                let vol = &mut w.vols[i];
                match r {
                    Ok(()) => {
                        prop_assert!(!vol.read_only);
                        for k in 0..n {
                            let p = (page + k) as usize;
                            vol.now[p] = 0;
                            vol.allowed[p].insert(0);
                        }
                    }
                    Err(e) if cut_at.is_some() && e.to_string().contains("Input/output") => {
                        for k in 0..n {
                            vol.allowed[(page + k) as usize].insert(0);
                        }
                        w.dead = true;
                    }
                    Err(e) => {
                        let s = e.to_string();
                        prop_assert!(
                            vol.read_only || s.contains("No space"),
                            "zero {}: {}",
                            vol.name,
                            s
                        );
                    }
                }
            }
            Step::Flush { v } => {
                let i = pick(v, w.vols.len());
                match w.q(i).flush() {
                    Ok(()) => w.all_durable(),
                    Err(_) if cut_at.is_some() => w.dead = true,
                    Err(e) => prop_assert!(false, "flush: {}", e),
                }
            }
            Step::Read { v, page, n } => {
                let i = pick(v, w.vols.len());
                if cut_at.is_none() {
                    w.check(i, page, n, "now")?;
                }
            }
            Step::Snapshot { v } | Step::Clone { v } => {
                let clone = matches!(step, Step::Clone { .. });
                let i = pick(v, w.vols.len());
                let name = format!("s{}", w.next_name);
                w.next_name += 1;
                let src = w.vols[i].name.clone();
                let r = w.pool().admin(Admin::Snapshot {
                    src: src.clone(),
                    name: name.clone(),
                    read_only: !clone,
                });
                let may = !clone || w.vols[i].read_only;
                match r {
                    Ok(_) => {
                        prop_assert!(may, "clone of writable {} was taken", src);
                        w.all_durable();
                        let now = w.vols[i].now.clone();
                        w.vols.push(Vol::new(name, !clone, now));
                    }
                    Err(_) if cut_at.is_some() && may && w.pool().report().failed => {
                        // Cut during the snapshot: it may be there, as it was taken.
                        let mut s = Vol::new(name, !clone, w.vols[i].now.clone());
                        s.maybe = true;
                        w.vols.push(s);
                        w.dead = true;
                    }
                    Err(e) => prop_assert!(
                        !may || e.to_string().contains("metadata"),
                        "{}: {}",
                        name,
                        e
                    ),
                }
            }
            Step::Delete { v } => {
                if w.vols.len() < 2 {
                    continue;
                }
                let i = pick(v, w.vols.len());
                let name = w.vols[i].name.clone();
                // Open: refused and nothing changes.
                w.q(i);
                let r = w.pool().admin(Admin::Delete { name: name.clone() });
                prop_assert!(r.is_err(), "{} deleted while open", name);
                w.vols[i].open = None;
                match w.pool().admin(Admin::Delete { name }) {
                    Ok(_) => {
                        w.vols.remove(i);
                        w.all_durable();
                    }
                    Err(_) if cut_at.is_some() => {
                        w.vols[i].maybe = true;
                        w.dead = true;
                    }
                    Err(e) => prop_assert!(false, "delete: {}", e),
                }
            }
            Step::Cut { seed } if cut_at.is_none() => w.cut(seed)?,
            Step::Cut { .. } => {}
        }
        if w.dead {
            break;
        }
    }
    // The end: every volume reads as the model says, then once more after a cut.
    if cut_at.is_none() {
        for i in 0..w.vols.len() {
            w.check(i, 0, PAGES, "at the end")?;
        }
    }
    w.cut(steps.len() as u64 ^ cut_at.unwrap_or(0).rotate_left(32))?;
    Ok(())
}

fn config() -> Config {
    Config {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(48),
        failure_persistence: None,
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn metadata_on_the_data_device(s in steps()) { run(&s, false, None)?; }

    #[test]
    fn metadata_on_a_device_of_its_own(s in steps()) { run(&s, true, None)?; }

    #[test]
    fn the_power_goes_at_a_random_request(s in steps(), n in 0..600u64) { run(&s, false, Some(n))?; }
}
