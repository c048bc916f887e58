//! Crash safety: random writes and flushes, power cuts at random points, and after each
//! cut every page must read back what a completed flush made durable, or something
//! written after it (never older data, never a mix), through a write-back cache over
//! volatile mems, caches over mirrors and raid10s, and mirrors and raid10s of caches.
//!
//! A mirror has no resync: after a cut its copies of a page written since the last flush
//! may differ, and reads may return either. The model therefore keeps, per page, the set
//! of values a read may return, and the set a power cut may leave.

use std::collections::BTreeSet;
use std::sync::Arc;

use cairn_config::StackFile;
use cairn_core::blocking::BlockingQueue;
use cairn_core::{Device, IoFlags, Switches, WritebackMode};
use proptest::prelude::*;
use proptest::test_runner::Config;

const PAGE: usize = 4096;
const PAGES: u64 = 48;

#[derive(Debug, Clone)]
enum Step {
    Write { page: u64, fua: bool },
    Flush,
    Read { page: u64 },
    PowerCut,
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        10 => (0..PAGES, prop::bool::weighted(0.1)).prop_map(|(page, fua)| Step::Write { page, fua }),
        2 => Just(Step::Flush),
        4 => (0..PAGES).prop_map(|page| Step::Read { page }),
        1 => Just(Step::PowerCut),
    ];
    prop::collection::vec(step, 1..80)
}

/// Page `p` holding value `v` (0: never written, all zeros).
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
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    b
}

/// The stacks under test, each with the cache's flusher waking often, so that some
/// unflushed writes reach the volatile bases before a cut and some do not. The arrays
/// keep superblocks (the default), so each member has a 1 MiB metadata area before the
/// pages under test.
fn stack(shape: &str, writeback: WritebackMode) -> Arc<dyn Device> {
    let wb = "[writeback]\nbackground = \"25%\"\nlimit = \"75%\"\nexpire = \"2ms\"\ninterval = \"1ms\"\n";
    let mem = |n: &str| {
        format!("[device.{n}]\ntype = \"mem\"\nsize = \"2M\"\nblock = 4096\nvolatile = true\n")
    };
    let cache = |n: &str, base: &str| {
        format!("[device.{n}]\ntype = \"cache\"\nbase = \"{base}\"\nmemory = \"128K\"\n")
    };
    let text = match shape {
        "cache" => format!("{wb}{}{}", mem("m0"), cache("top", "m0")),
        "cache-over-mirror" => format!(
            "{wb}{}{}[device.r]\ntype = \"mirror\"\nmembers = [\"m0\", \"m1\"]\n{}",
            mem("m0"),
            mem("m1"),
            cache("top", "r")
        ),
        "cache-over-raid10" => format!(
            "{wb}{}{}{}{}[device.r]\ntype = \"raid10\"\nmembers = [\"m0\", \"m1\", \"m2\", \"m3\"]\nchunk = \"16K\"\n{}",
            mem("m0"),
            mem("m1"),
            mem("m2"),
            mem("m3"),
            cache("top", "r")
        ),
        "mirror-of-caches" => format!(
            "{wb}{}{}{}{}[device.top]\ntype = \"mirror\"\nmembers = [\"c0\", \"c1\"]\n",
            mem("m0"),
            mem("m1"),
            cache("c0", "m0"),
            cache("c1", "m1")
        ),
        "raid10-of-caches" => format!(
            "{wb}{}{}{}{}{}{}{}{}[device.top]\ntype = \"raid10\"\nmembers = [\"c0\", \"c1\", \"c2\", \"c3\"]\nchunk = \"16K\"\n",
            mem("m0"),
            mem("m1"),
            mem("m2"),
            mem("m3"),
            cache("c0", "m0"),
            cache("c1", "m1"),
            cache("c2", "m2"),
            cache("c3", "m3")
        ),
        _ => unreachable!(),
    };
    let switches = Switches {
        writeback,
        ..Switches::default()
    };
    StackFile::parse(&text)
        .unwrap()
        .open_with("top", switches)
        .unwrap()
}

fn run(shape: &str, steps: &[Step]) -> Result<(), TestCaseError> {
    run_with(shape, WritebackMode::PerDevice, steps)
}

fn run_with(shape: &str, mode: WritebackMode, steps: &[Step]) -> Result<(), TestCaseError> {
    let dev = stack(shape, mode);
    let q = BlockingQueue::open(&dev, Switches::default()).unwrap();
    let n = PAGES as usize;
    // What a read may return now; what a cut may leave; values written since the last
    // completed flush.
    let mut now: Vec<BTreeSet<u32>> = vec![BTreeSet::from([0]); n];
    let mut stable: Vec<BTreeSet<u32>> = vec![BTreeSet::from([0]); n];
    let mut pending: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut next = 1u32;
    let check = |p: u64, allowed: &BTreeSet<u32>, when: &str| -> Result<(), TestCaseError> {
        let mut got = vec![0u8; PAGE];
        q.read(p * PAGE as u64, &mut got).unwrap();
        let ok = allowed.iter().any(|&v| content(p, v) == got);
        prop_assert!(
            ok,
            "{shape}: page {p} {when}: none of the allowed values {allowed:?}"
        );
        Ok(())
    };
    for (i, step) in steps.iter().enumerate() {
        match *step {
            Step::Write { page, fua } => {
                let v = next;
                next += 1;
                let flags = if fua { IoFlags::FUA } else { IoFlags::NONE };
                q.write(page * PAGE as u64, &content(page, v), flags)
                    .unwrap();
                let p = page as usize;
                now[p] = BTreeSet::from([v]);
                if fua {
                    // Durable on completion: a cut leaves it (or a later write).
                    stable[p] = BTreeSet::from([v]);
                    pending[p].clear();
                } else {
                    pending[p].push(v);
                }
            }
            Step::Flush => {
                q.flush().unwrap();
                for p in 0..n {
                    if !pending[p].is_empty() {
                        stable[p] = now[p].clone();
                        pending[p].clear();
                    }
                }
            }
            Step::Read { page } => check(page, &now[page as usize], &format!("at step {i}"))?,
            Step::PowerCut => {
                dev.power_cut();
                for p in 0..n {
                    let mut allowed = stable[p].clone();
                    allowed.extend(pending[p].drain(..));
                    now[p] = allowed.clone();
                    stable[p] = allowed;
                }
                for p in 0..PAGES {
                    check(p, &now[p as usize], &format!("after the cut at step {i}"))?;
                }
            }
        }
    }
    // A final cut: nothing flushed may be missing.
    dev.power_cut();
    for p in 0..n {
        let mut allowed = stable[p].clone();
        allowed.extend(pending[p].iter().copied());
        check(p as u64, &allowed, "after the final cut")?;
    }
    Ok(())
}

fn config() -> Config {
    Config {
        cases: 24,
        failure_persistence: None,
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn cache_over_a_volatile_mem(s in steps()) { run("cache", &s)?; }

    #[test]
    fn cache_over_a_mirror(s in steps()) { run("cache-over-mirror", &s)?; }

    #[test]
    fn cache_over_a_raid10(s in steps()) { run("cache-over-raid10", &s)?; }

    #[test]
    fn mirror_of_caches(s in steps()) { run("mirror-of-caches", &s)?; }

    #[test]
    fn raid10_of_caches(s in steps()) { run("raid10-of-caches", &s)?; }

    #[test]
    fn cache_written_back_by_the_shared_pool(s in steps()) {
        run_with("cache", WritebackMode::Shared, &s)?;
    }

    #[test]
    fn raid10_of_caches_sharing_a_pool(s in steps()) {
        run_with("raid10-of-caches", WritebackMode::Shared, &s)?;
    }
}

/// A cut racing the cache's write-back (found by `cache_over_a_volatile_mem` in CI): a
/// write-back copied before the cut and landing in the mem after it left a page half
/// old, half new, as did the mem's copy back racing that write. The cut is now one
/// instant: it waits for the write-back round in flight, and a write to a volatile mem
/// lands wholly before or after the copy back. The sequence is CI's; the race needs
/// many runs to show (31 of 400 runs failed before).
#[test]
fn a_cut_racing_a_write_back_leaves_whole_pages() {
    use Step::*;
    let w = |page, fua| Write { page, fua };
    let s = vec![
        w(46, false),
        w(18, false),
        w(3, false),
        w(45, false),
        PowerCut,
        Read { page: 5 },
        w(36, true),
        PowerCut,
        w(31, false),
        Flush,
        w(3, false),
        Read { page: 12 },
        w(2, false),
        w(34, false),
        w(1, false),
        w(44, false),
        w(43, false),
        w(35, false),
        w(29, false),
        w(33, false),
        w(0, false),
        w(18, false),
        Read { page: 47 },
        w(23, false),
        w(21, false),
        w(33, false),
        w(5, true),
        w(20, false),
        w(8, false),
        Read { page: 10 },
        PowerCut,
    ];
    for round in 0..400 {
        if let Err(e) = run("cache", &s) {
            panic!("round {round}: {e}");
        }
    }
}
