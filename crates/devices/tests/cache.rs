//! The write-back cache: durability at flush, write-back in the background, and no lost
//! update when writes race the flusher. (Data against a model, sequentially: `model.rs`.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_core::blocking::BlockingQueue;
use cairn_core::{Device, IoFlags, Switches};
use cairn_devices::config::StackFile;

const PAGE: usize = 4096;

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
    use cairn_devices::cache::CacheDevice;
    use cairn_devices::writeback::{Budget, Writeback};
    // Nothing is written back on its own: the budget moves only with writes and flushes.
    let w = Writeback {
        expire: Duration::from_secs(600),
        interval: Duration::from_secs(600),
        ..Writeback::default()
    };
    let budget = Arc::new(Budget::new(&w, 2 << 20).unwrap());
    let mem = |n: &str| {
        let s = cairn_devices::LeafSpec::parse("mem:1M,block=4k").unwrap();
        cairn_devices::open(&s, n).unwrap()
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
/// for a minute; once the devices are gone, the files hold every write.
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
                "[device.f{i}]\ntype = \"file\"\npath = \"{}\"\nsize = \"1M\"\n\
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
                s.writeback_counters().0 > 0,
                "{mode:?}: the writes are cached"
            );
        }
        // Page k of the stripe is page k / 3 of file k % 3.
        let files: Vec<Vec<u8>> = (0..3)
            .map(|i| std::fs::read(dir.path().join(format!("f{i}.img"))).unwrap())
            .collect();
        for (k, page) in data.chunks(PAGE).enumerate() {
            let at = k / 3 * PAGE;
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
