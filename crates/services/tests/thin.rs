//! Thin pools: volumes that allocate on write, snapshots and clones, space given back,
//! the pool reopened from its metadata.

use std::sync::Arc;

use cairn_core::blocking::BlockingQueue;
use cairn_core::{Device, Extent, IoFlags, Op, Switches};
use cairn_leaves::LeafSpec;
use cairn_services::thin::pool::{Admin, LowWater, PoolOptions, ThinPool};
use cairn_services::thin::ThinDevice;
use cairn_services::thin::{ThinError, ThinPoolAdmin};
use cairn_stacks::wrap::{Decision, Policy, WrapDevice};
use cairn_testkit::pattern;

fn mem(size: &str, volatile: bool) -> Arc<dyn Device> {
    let s = LeafSpec::parse(&format!("mem:{size},volatile={}", u8::from(volatile))).unwrap();
    cairn_leaves::open(&s, "data").unwrap()
}

fn opts() -> PoolOptions {
    PoolOptions {
        block_bytes: Some(64 << 10),
        low_water: LowWater::Percent(10),
        repair: false,
    }
}

struct Pool(Arc<dyn Device>);

impl Pool {
    fn pool(&self) -> Arc<dyn ThinPoolAdmin> {
        self.0.capability::<dyn ThinPoolAdmin>().unwrap()
    }

    fn clone(&self) -> Arc<dyn Device> {
        self.0.clone()
    }
}

fn pool(data: &Arc<dyn Device>) -> Pool {
    Pool(Arc::new(
        ThinPool::open(
            "pool",
            data.clone(),
            None,
            opts(),
            Switches::default(),
            false,
        )
        .unwrap(),
    ))
}

fn volume(p: &Pool, name: &str, size: Option<u64>) -> (Arc<dyn Device>, BlockingQueue) {
    let d: Arc<dyn Device> = Arc::new(ThinDevice::open(name, p.clone(), name, size, true).unwrap());
    let q = BlockingQueue::open(&d, Switches::default()).unwrap();
    (d, q)
}

/// `thin snapshot` (read-only) or `thin clone` of `src` as `name`.
fn snapshot(p: &Pool, src: &str, name: &str, read_only: bool) -> String {
    p.pool()
        .admin(Admin::Snapshot {
            src: src.into(),
            name: name.into(),
            read_only,
        })
        .unwrap()
}

fn read(q: &BlockingQueue, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    q.read(offset, &mut b).unwrap();
    b
}

#[test]
fn writes_read_back_holes_read_zero_and_a_reopen_keeps_everything() {
    let data = mem("64M", false);
    let p = pool(&data);
    let (d, q) = volume(&p, "vm", Some(1 << 30));
    assert_eq!(d.geometry().size_bytes, 1 << 30);
    assert!(read(&q, 0, 8192).iter().all(|&b| b == 0));
    let a = pattern(1, 4096);
    let b = pattern(2, 200 << 10); // spans four blocks, none whole at the ends
    q.write(8192, &a, IoFlags::NONE).unwrap();
    q.write((300 << 20) + 512 * 3, &b, IoFlags::FUA).unwrap();
    assert_eq!(read(&q, 8192, 4096), a);
    assert_eq!(read(&q, (300 << 20) + 1536, b.len()), b);
    let around = read(&q, 0, 64 << 10);
    assert!(around[..8192].iter().all(|&x| x == 0) && around[12288..].iter().all(|&x| x == 0));
    q.flush().unwrap();
    let mut ext = Vec::new();
    d.extents(0, 1 << 30, &mut ext).unwrap();
    assert_eq!(ext[0], Extent::data(64 << 10));
    assert!(ext[1].hole);
    let used = p.pool().report();
    assert_eq!(
        used.volumes[0].2,
        5 * (64 << 10),
        "five blocks mapped: {used:?}"
    );
    drop((q, d));
    drop(p);
    let p = pool(&data);
    let (_d, q) = volume(&p, "vm", None);
    assert_eq!(read(&q, 8192, 4096), a);
    assert_eq!(read(&q, (300 << 20) + 1536, b.len()), b);
}

/// The extents of `d` over `[offset, offset + len)`, checked to cover it exactly, as
/// (hole, length) runs.
fn runs(d: &Arc<dyn Device>, offset: u64, len: u64) -> Vec<(bool, u64)> {
    let mut out = Vec::new();
    let mut at = offset;
    while at < offset + len {
        let mut ext = Vec::new();
        d.extents(at, offset + len - at, &mut ext).unwrap();
        assert!(!ext.is_empty(), "no extents at {at}");
        for e in ext {
            match out.last_mut() {
                Some((hole, n)) if *hole == e.hole => *n += e.len,
                _ => out.push((e.hole, e.len)),
            }
            at += e.len;
        }
    }
    assert_eq!(at, offset + len, "extents past the range asked");
    out
}

#[test]
fn extents_answer_holes_whole_leaves_at_a_time_and_match_the_mappings() {
    let data = mem("64M", false);
    let p = pool(&data);
    // 4 GiB of 64 KiB blocks: 64 leaves of 1024 entries, most never made.
    let (d, q) = volume(&p, "vm", Some(4 << 30));
    let bs: u64 = 64 << 10;
    // Blocks at the edges of leaves, in one leaf twice, and the volume's last block.
    let written = [0u64, 1023, 1024, 1025, 5000, 40_000, 65_535];
    for &vb in &written {
        q.write(vb * bs + 4096, &pattern(vb, 4096), IoFlags::NONE)
            .unwrap();
    }
    // The model: block by block.
    let model = |offset: u64, len: u64| {
        let mut out: Vec<(bool, u64)> = Vec::new();
        let mut at = offset;
        while at < offset + len {
            let vb = at / bs;
            let n = ((vb + 1) * bs).min(offset + len) - at;
            let hole = !written.contains(&vb);
            match out.last_mut() {
                Some((h, m)) if *h == hole => *m += n,
                _ => out.push((hole, n)),
            }
            at += n;
        }
        out
    };
    let size = 4u64 << 30;
    for (offset, len) in [
        (0, size),
        (bs / 2, size - bs),
        (1023 * bs + 512, 3 * bs),
        (2000 * bs, 30_000 * bs + 4096),
        (65_000 * bs + 4096, size - 65_000 * bs - 4096),
        (6000 * bs, 1000 * bs),
    ] {
        assert_eq!(
            runs(&d, offset, len),
            model(offset, len),
            "extents at {offset} for {len}"
        );
    }
}

#[test]
fn snapshots_keep_what_was_and_clones_write_apart() {
    let data = mem("64M", false);
    let p = pool(&data);
    let (_d, q) = volume(&p, "vm", Some(256 << 20));
    let a = pattern(10, 128 << 10);
    q.write(0, &a, IoFlags::NONE).unwrap();
    let said = snapshot(&p, "vm", "s1", true);
    assert!(said.contains("snapshot 's1'"), "{said}");
    let b = pattern(20, 4096);
    q.write(4096, &b, IoFlags::NONE).unwrap(); // partial copy on write
    let c = pattern(30, 64 << 10);
    q.write(64 << 10, &c, IoFlags::NONE).unwrap(); // whole-block copy on write
    let (sd, sq) = volume(&p, "s1", None);
    assert!(sd.read_only());
    assert_eq!(read(&sq, 0, a.len()), a, "the snapshot reads as when taken");
    assert!(
        sq.write(0, &b, IoFlags::NONE).is_err(),
        "a snapshot is read-only"
    );
    let mut now = a.clone();
    now[4096..8192].copy_from_slice(&b);
    now[64 << 10..].copy_from_slice(&c);
    assert_eq!(read(&q, 0, a.len()), now);
    // A clone of the snapshot, written apart from both.
    // A clone is made of a snapshot, which no one writes: its reply holds nothing.
    let made = snapshot(&p, "s1", "c1", false);
    assert_eq!(made, "clone 'c1' of snapshot 's1' made (writable)");
    let (_cd, cq) = volume(&p, "c1", None);
    let e = pattern(40, 8192);
    cq.write(16384, &e, IoFlags::NONE).unwrap();
    let mut cl = a.clone();
    cl[16384..16384 + 8192].copy_from_slice(&e);
    assert_eq!(read(&cq, 0, a.len()), cl);
    assert_eq!(read(&sq, 0, a.len()), a);
    assert_eq!(read(&q, 0, a.len()), now);
    // The snapshot cannot go while open; once closed it can, in any order.
    assert!(p.pool().admin(Admin::Delete { name: "s1".into() }).is_err());
    drop((sq, sd));
    p.pool().admin(Admin::Delete { name: "s1".into() }).unwrap();
    assert_eq!(read(&cq, 0, a.len()), cl);
    assert_eq!(read(&q, 0, a.len()), now);
    q.flush().unwrap();
    drop((cq, _cd, q, _d));
    drop(p);
    let p = pool(&data);
    let (_d, q) = volume(&p, "vm", None);
    let (_cd, cq) = volume(&p, "c1", None);
    assert_eq!(read(&q, 0, a.len()), now);
    assert_eq!(read(&cq, 0, a.len()), cl);
}

#[test]
fn a_full_pool_says_enospc_and_space_freed_lets_writes_go_on() {
    let data = mem("16M", false);
    let p = pool(&data);
    let blocks = p.pool().report().data_blocks;
    let (_d, q) = volume(&p, "vm", Some(1 << 30));
    let block = 64 << 10;
    let full = pattern(5, block);
    for i in 0..blocks {
        q.write(i * block as u64, &full, IoFlags::NONE).unwrap();
    }
    let err = q
        .write(blocks * block as u64, &full, IoFlags::NONE)
        .unwrap_err();
    assert!(err.to_string().contains("space"), "{err}");
    // Overwrites of owned blocks and reads go on.
    q.write(0, &pattern(6, 4096), IoFlags::NONE).unwrap();
    assert_eq!(read(&q, 4096, 4096), full[4096..8192].to_vec());
    // A discard of whole blocks gives them back (after the next commit).
    q.zero(Op::Discard, 0, 4 * block as u64, IoFlags::NONE)
        .unwrap();
    q.flush().unwrap();
    let mut ok = false;
    for _ in 0..200 {
        match q.write(blocks * block as u64, &full, IoFlags::NONE) {
            Ok(()) => {
                ok = true;
                break;
            }
            Err(e) => eprintln!("DBG {e} {:?}", p.pool().report()),
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(ok, "space freed is used again");
    assert!(
        read(&q, 0, 8192).iter().all(|&x| x == 0),
        "discarded reads as zeros"
    );
    assert_eq!(read(&q, blocks * block as u64, block), full);
}

#[test]
fn bad_stack_files_are_refused_in_one_line() {
    use cairn_config::StackFile;
    let base = "[device.m]\ntype = \"mem\"\nsize = \"64M\"\n";
    let cases = [
        ("[device.p]\ntype = \"thin-pool\"\ndata = \"m\"\nblock = \"96K\"\n", "power of two"),
        ("[device.p]\ntype = \"thin-pool\"\ndata = \"m\"\nblock = \"4K\"\n", "out of range"),
        ("[device.p]\ntype = \"thin-pool\"\n", "'data' is missing"),
        ("[device.p]\ntype = \"thin-pool\"\ndata = \"m\"\nlow_water = \"150%\"\n", "percentage"),
        ("[device.v]\ntype = \"thin\"\npool = \"m\"\nsize = \"1G\"\n", "not a thin-pool"),
        ("[device.v]\ntype = \"thin\"\npool = \"nope\"\nsize = \"1G\"\n", "not defined"),
        (
            "[device.p]\ntype = \"thin-pool\"\ndata = \"m\"\n[device.v]\ntype = \"thin\"\npool = \"p\"\nvolume = \"a/b\"\n",
            "not a volume name",
        ),
        (
            "[device.p]\ntype = \"thin-pool\"\ndata = \"m\"\n[export.e]\ndevice = \"p\"\n",
            "thin pool",
        ),
    ];
    for (text, want) in cases {
        let e = StackFile::parse(&format!("{base}{text}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(want) && !e.contains('\n'), "{text}: {e}");
    }
}

#[test]
fn a_metadata_device_too_small_or_a_volume_too_large_is_refused_and_nothing_is_written() {
    let data = mem("64M", false);
    let meta = mem("64K", false);
    let e = ThinPool::open(
        "pool",
        data.clone(),
        Some(meta.clone()),
        opts(),
        Switches::default(),
        false,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("needs at least"), "{e}");
    let q = BlockingQueue::open(&meta, Switches::default()).unwrap();
    assert!(
        read(&q, 0, 64 << 10).iter().all(|&b| b == 0),
        "nothing written"
    );
    let p = pool(&data);
    let e = p
        .pool()
        .admin(Admin::Create {
            name: "huge".into(),
            size: 1 << 60,
        })
        .unwrap_err();
    assert!(matches!(e, ThinError::Invalid(_)), "{e:?}");
    assert!(e.to_string().contains("larger than"), "{e}");
    // A snapshot of a volume that does not exist: the pool and the name, for a caller
    // to act on, and the message the admin replies with.
    let e = p
        .pool()
        .admin(Admin::Snapshot {
            src: "nope".into(),
            name: "s".into(),
            read_only: true,
        })
        .unwrap_err();
    assert!(
        matches!(&e, ThinError::NoVolume { pool, name } if pool == "pool" && name == "nope"),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "thin pool 'pool' has no volume 'nope'");
    p.pool()
        .admin(Admin::Create {
            name: "a".into(),
            size: 1 << 20,
        })
        .unwrap();
    let e = p
        .pool()
        .admin(Admin::Create {
            name: "a".into(),
            size: 1 << 20,
        })
        .unwrap_err();
    assert!(
        matches!(&e, ThinError::VolumeExists { name, .. } if name == "a"),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "thin pool 'pool' has a volume 'a' already");
    assert_eq!(p.pool().report().volumes.len(), 1);
}

/// A page of writer data: `(page << 32) | seq` in every 8 bytes.
fn stamp(page: u64, seq: u64) -> Vec<u8> {
    ((page << 32) | seq).to_le_bytes().repeat(512)
}

fn seq_of(page: u64, b: &[u8]) -> u64 {
    if b.iter().all(|&x| x == 0) {
        return 0;
    }
    let v = u64::from_le_bytes(b[..8].try_into().unwrap());
    assert_eq!(
        b,
        stamp(page, v & 0xffff_ffff).as_slice(),
        "page {page}: torn or foreign"
    );
    assert_eq!(v >> 32, page, "page {page} holds another page's data");
    v & 0xffff_ffff
}

#[test]
fn snapshots_under_load_hold_what_was_acknowledged_before_and_nothing_started_after() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;
    // Pages per writer, one per 64 KiB block: after its first copy on write following a
    // snapshot, a writer's writes go in place (the case holding writes is for).
    const PAGES: u64 = 2;
    const SNAPS: usize = 8;
    // Data writes take 20 ms to land (metadata writes none), so that a snapshot taken
    // without holding writes would see one land in a block it shares after it was taken.
    let text = "[device.m]\ntype = \"mem\"\nsize = \"256M\"\n\
        [device.slow]\ntype = \"delay\"\nbase = \"m\"\nwrite = \"20ms\"\n\
        [device.meta]\ntype = \"mem\"\nsize = \"64M\"\n\
        [device.pool]\ntype = \"thin-pool\"\ndata = \"slow\"\nmetadata = \"meta\"\n\
        [device.vm]\ntype = \"thin\"\npool = \"pool\"\nsize = \"64M\"\n";
    let stack = cairn_config::StackFile::parse(text).unwrap();
    let vm = stack
        .open_all(&["vm".to_string()], Switches::default())
        .unwrap()
        .remove(0);
    let p = Pool(vm.children()[0].clone());
    let stop = Arc::new(AtomicBool::new(false));
    let page_of = |w: u64, j: u64| (w * PAGES + j) * 16;
    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let (vm, stop) = (vm.clone(), stop.clone());
            std::thread::spawn(move || {
                let q = BlockingQueue::open(&vm, Switches::default()).unwrap();
                // (page, seq, submitted, acknowledged)
                let mut log = Vec::new();
                let mut seq = 1;
                while !stop.load(Ordering::Relaxed) {
                    let page = page_of(w, seq % PAGES);
                    let t = Instant::now();
                    q.write(page * 4096, &stamp(page, seq), IoFlags::NONE)
                        .unwrap();
                    log.push((page, seq, t, Instant::now()));
                    seq += 1;
                }
                log
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let mut snaps = Vec::new();
    let mut first = Vec::new();
    for k in 0..SNAPS {
        let name = format!("s{k}");
        let t0 = Instant::now();
        p.pool()
            .admin(Admin::Snapshot {
                src: "vm".into(),
                name: name.clone(),
                read_only: true,
            })
            .unwrap();
        snaps.push((name.clone(), t0, Instant::now()));
        // What it holds at once; it must hold the same at the end.
        let (_d, sq) = volume(&p, &name, None);
        first.push(read(&sq, 0, (2 * PAGES * 16 * 4096) as usize));
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    let logs: Vec<_> = writers
        .into_iter()
        .flat_map(|w| w.join().unwrap())
        .collect();
    assert!(logs.len() > 20, "the writers wrote ({} writes)", logs.len());
    for ((name, t0, t1), first) in snaps.iter().zip(&first) {
        let (_d, sq) = volume(&p, name, None);
        assert!(
            read(&sq, 0, first.len()) == *first,
            "{name} changed after it was taken"
        );
        for w in 0..2 {
            for j in 0..PAGES {
                let page = page_of(w, j);
                let got = seq_of(page, &read(&sq, page * 4096, 4096));
                let writes = logs.iter().filter(|l| l.0 == page);
                let before = writes
                    .clone()
                    .filter(|l| l.3 < *t0)
                    .map(|l| l.1)
                    .max()
                    .unwrap_or(0);
                let started: Vec<u64> = writes.filter(|l| l.2 < *t1).map(|l| l.1).collect();
                assert!(got >= before, "{name} page {page}: seq {got}, but {before} was acknowledged before the snapshot began");
                assert!(
                    got == 0 || started.contains(&got),
                    "{name} page {page}: seq {got} started after the snapshot returned"
                );
            }
        }
    }
    // The volume holds every page's last write: none was lost to a copy on write.
    let (_d, q) = volume(&p, "vm", None);
    for w in 0..2 {
        for j in 0..PAGES {
            let page = page_of(w, j);
            let last = logs
                .iter()
                .filter(|l| l.0 == page)
                .map(|l| l.1)
                .max()
                .unwrap_or(0);
            assert_eq!(
                seq_of(page, &read(&q, page * 4096, 4096)),
                last,
                "vm page {page}"
            );
        }
    }
}

#[test]
fn a_full_pool_with_a_snapshot_says_enospc_until_the_snapshot_is_deleted() {
    let data = mem("16M", false);
    let p = pool(&data);
    let blocks = p.pool().report().data_blocks;
    let block = 64usize << 10;
    let (_d, q) = volume(&p, "vm", Some(1 << 30));
    let half = blocks * 3 / 4; // filled; copies of a quarter fill the rest
    for i in 0..half {
        q.write(i * block as u64, &pattern(1, block), IoFlags::NONE)
            .unwrap();
    }
    snapshot(&p, "vm", "s", true);
    // Copies on write take the rest of the pool, then the next one fails alone.
    let mut i = 0;
    let err = loop {
        match q.write(i * block as u64, &pattern(2, 4096), IoFlags::NONE) {
            Ok(()) => i += 1,
            Err(e) => break e,
        }
        assert!(i < half, "copied more blocks than the pool has");
    };
    assert!(err.to_string().contains("space"), "{err}");
    assert!(
        i >= blocks - half - 16,
        "stopped early at {i} of {}",
        blocks - half
    );
    assert!(
        read(&q, i * block as u64 + 4096, 4096) == pattern(1, block)[4096..8192],
        "the failed write changed block {i}"
    );
    // The snapshot goes: the volume owns its blocks alone again, so overwrites go in
    // place at once (no copy, no space needed).
    p.pool().admin(Admin::Delete { name: "s".into() }).unwrap();
    for j in 0..half {
        q.write(j * block as u64 + 8192, &pattern(3, 4096), IoFlags::NONE)
            .unwrap_or_else(|e| panic!("block {j}: {e} after the snapshot went"));
    }
    q.flush().unwrap();
    for j in 0..half {
        let got = read(&q, j * block as u64, 12288);
        let first = if j < i {
            pattern(2, 4096)
        } else {
            pattern(1, block)[..4096].to_vec()
        };
        assert_eq!(got[..4096], first[..], "block {j}");
        assert_eq!(got[8192..], pattern(3, 4096)[..], "block {j}");
    }
}

/// Many partial writes at once into blocks a snapshot shares: more than the queue has
/// copy-on-write buffers, several per block, so that pieces wait for a buffer and some
/// find their block copied by the time one is free. Every write completes (it once
/// hung: a piece that went in place left its buffer unused and the others waiting) and
/// reads back.
#[test]
fn many_copies_on_write_at_once_all_complete() {
    use cairn_core::blocking::Request;
    let data = mem("64M", false);
    let p = pool(&data);
    let (_d, q) = volume(&p, "vm", Some(64 << 20));
    let block = 64u64 << 10;
    for b in 0..8 {
        q.write(b * block, &pattern(1, block as usize), IoFlags::NONE)
            .unwrap();
    }
    snapshot(&p, "vm", "s", true);
    let (tx, rx) = std::sync::mpsc::channel();
    let d = _d.clone();
    std::thread::spawn(move || {
        let q = BlockingQueue::open(&d, Switches::default()).unwrap();
        // 8 blocks x 8 pages, all in flight together.
        let mut bufs: Vec<Vec<u8>> = (0..64).map(|i| pattern(10 + i as u8, 4096)).collect();
        let mut reqs: Vec<Request> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| Request {
                op: Op::Write,
                flags: IoFlags::NONE,
                offset: (i as u64 % 8) * block + (i as u64 / 8) * 4096,
                len: 0,
                buf: Some(b.as_mut_slice()),
            })
            .collect();
        let out = q.run(&mut reqs);
        let _ = tx.send(out.iter().all(Result::is_ok));
    });
    let done = rx.recv_timeout(std::time::Duration::from_secs(20));
    assert_eq!(
        done,
        Ok(true),
        "64 writes in flight together did not all complete"
    );
    for i in 0..64u64 {
        let at = (i % 8) * block + (i / 8) * 4096;
        assert!(
            read(&q, at, 4096) == pattern(10 + i as u8, 4096),
            "write {i}"
        );
    }
    let (_s, sq) = volume(&p, "s", None);
    assert!(read(&sq, 0, 8 * block as usize) == pattern(1, block as usize).repeat(8));
}

/// A FUA write in place into blocks whose mappings are durable goes down with FUA and
/// waits for no commit; one that maps a block waits for the commit that makes the mapping
/// durable (counted in the pool's `commit_waits`).
#[test]
fn a_fua_write_to_committed_owned_blocks_starts_no_commit() {
    let data = mem("64M", true);
    let p = pool(&data);
    let (_d, q) = volume(&p, "vm", Some(16 << 20));
    let waits = || p.pool().report().commit_waits;
    q.write(0, &pattern(0, 64 << 10), IoFlags::NONE).unwrap();
    q.flush().unwrap();
    assert_eq!(waits(), 1, "the flush");
    // One block, then two at once (the request cut into pieces), both in place.
    q.write(4096, &pattern(1, 4096), IoFlags::FUA).unwrap();
    assert_eq!(
        waits(),
        1,
        "a FUA write into a committed owned block waited for a commit"
    );
    q.write(64 << 10, &pattern(2, 4096), IoFlags::FUA).unwrap();
    assert_eq!(
        waits(),
        2,
        "a FUA write that maps a block waits for its commit"
    );
    q.write(60 << 10, &pattern(3, 8192), IoFlags::FUA).unwrap();
    assert_eq!(
        waits(),
        2,
        "a FUA write over two committed owned blocks waited"
    );
    assert_eq!(read(&q, 60 << 10, 8192), pattern(3, 8192));
    assert_eq!(read(&q, 4096, 4096), pattern(1, 4096));
}

/// Holds every discard and write-zeroes sent while `held` (the zeroing of freed blocks,
/// here) in `decide`, on the thread that sends it, until released.
#[derive(Default)]
struct HoldZeroing {
    held: std::sync::Mutex<bool>,
    released: std::sync::Condvar,
    seen: std::sync::atomic::AtomicU64,
}

impl Policy for HoldZeroing {
    fn kind(&self) -> &'static str {
        "delay"
    }

    fn describe(&self) -> String {
        "holds zeroing".into()
    }

    fn decide(&self, io: &cairn_core::Io, _now_ns: u64, _random: u64) -> Decision {
        if matches!(io.op, Op::Discard | Op::WriteZeroes) {
            let mut held = self.held.lock().unwrap();
            if *held {
                self.seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            while *held {
                held = self.released.wait(held).unwrap();
            }
        }
        Decision::Forward
    }
}

impl HoldZeroing {
    fn set(&self, hold: bool) {
        *self.held.lock().unwrap() = hold;
        self.released.notify_all();
    }
}

/// Freed blocks are zeroed off the commit thread: a flush goes through while their
/// zeroing is held, and the block comes back (reading as zeros) once it is done.
#[test]
fn a_flush_does_not_wait_for_freed_blocks_to_be_zeroed() {
    let hold = Arc::new(HoldZeroing::default());
    let data: Arc<dyn Device> = Arc::new(WrapDevice::new("data", mem("64M", false), hold.clone()));
    let p = pool(&data);
    let (d, q) = volume(&p, "vm", Some(16 << 20));
    q.write(0, &pattern(0, 64 << 10), IoFlags::NONE).unwrap();
    q.flush().unwrap();
    hold.set(true);
    q.zero(Op::Discard, 0, 64 << 10, IoFlags::NONE).unwrap();
    // The commit frees the block; its zeroing starts and is held.
    q.flush().unwrap();
    let began = std::time::Instant::now();
    while hold.seen.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(
            began.elapsed().as_secs() < 60,
            "the freed block's zeroing never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let d2 = d.clone();
    let writer = std::thread::spawn(move || {
        let q = BlockingQueue::open(&d2, Switches::default()).unwrap();
        q.write(128 << 10, &pattern(1, 4096), IoFlags::NONE)
            .unwrap();
        tx.send(q.flush().is_ok()).unwrap();
    });
    // A generous bound for a deadlock, not a timing: the old code answered no flush
    // until the zeroing ended, which only this test ends.
    let flushed = rx.recv_timeout(std::time::Duration::from_secs(30));
    hold.set(false);
    writer.join().unwrap();
    assert_eq!(
        flushed,
        Ok(true),
        "a flush waited for freed blocks to be zeroed"
    );
    assert_eq!(read(&q, 0, 64 << 10), vec![0u8; 64 << 10]);
    assert_eq!(read(&q, 128 << 10, 4096), pattern(1, 4096));
}

/// A volume grows to any size (past the room its table was made with, four times the
/// size it was opened with) while a device on it is open and written, never shrinks, and
/// keeps every write; a device open on it sees the new size.
#[test]
fn grow_takes_a_volume_past_its_tables_room_while_it_is_written_and_never_shrinks_it() {
    let data = mem("64M", false);
    let p = pool(&data);
    let (d, q) = volume(&p, "vm", Some(1 << 20));
    q.write(0, &pattern(1, 4096), IoFlags::NONE).unwrap();
    let grow = |size: u64| {
        p.pool().admin(Admin::Grow {
            name: "vm".into(),
            size,
        })
    };
    let shrink = grow(512 << 10).unwrap_err();
    assert!(
        matches!(&shrink, ThinError::Shrink { name, size, asked } if name == "vm" && *size == 1 << 20 && *asked == 512 << 10),
        "{shrink:?}"
    );
    assert!(shrink.to_string().contains("cannot shrink"), "{shrink}");
    // A writer goes on through every grow: each of its pages is written once, with its
    // number, inside the first megabyte.
    let writer = {
        let d = d.clone();
        std::thread::spawn(move || {
            let q = BlockingQueue::open(&d, Switches::default()).unwrap();
            for page in 1..256u64 {
                q.write(page * 4096, &pattern(page, 4096), IoFlags::NONE)
                    .unwrap();
            }
            q.flush().unwrap();
        })
    };
    for size in [3 << 20, 5 << 20, 24 << 20, 200 << 20] {
        grow(size).unwrap();
        assert_eq!(d.geometry().size_bytes, size, "seen by the open device");
        // A queue opened now takes the new size (one open before keeps its own).
        let q = BlockingQueue::open(&d, Switches::default()).unwrap();
        q.write(size - 4096, &pattern(size, 4096), IoFlags::NONE)
            .unwrap();
        q.flush().unwrap();
    }
    writer.join().unwrap();
    q.flush().unwrap();
    let q = BlockingQueue::open(&d, Switches::default()).unwrap();
    let check = |q: &BlockingQueue| {
        assert_eq!(read(q, 0, 4096), pattern(1, 4096));
        for page in 1..256u64 {
            assert_eq!(
                read(q, page * 4096, 4096),
                pattern(page, 4096),
                "page {page}"
            );
        }
        for size in [3u64 << 20, 5 << 20, 24 << 20, 200 << 20] {
            assert_eq!(read(q, size - 4096, 4096), pattern(size, 4096), "at {size}");
        }
    };
    check(&q);
    drop((q, d));
    drop(p);
    // The size and every write are durable.
    let p = pool(&data);
    let (d, q) = volume(&p, "vm", None);
    assert_eq!(d.geometry().size_bytes, 200 << 20);
    check(&q);
}

#[test]
fn a_sequential_fill_lands_in_order_on_the_data_device() {
    let data = mem("64M", false);
    let p = pool(&data);
    let (d, q) = volume(&p, "vm", Some(16 << 20));
    for b in 0..40u64 {
        q.write(b << 16, &stamp(b, 7)[..], IoFlags::NONE).unwrap();
    }
    q.flush().unwrap();
    let r = p.pool().report();
    drop((q, d));
    // Block b's stamp is at the data area's block b: one run, in order.
    let dq = BlockingQueue::open(&data, Switches::default()).unwrap();
    let first = (data.geometry().size_bytes - (r.data_blocks << 16)) & !0xffff;
    let base = (0..64u64)
        .map(|i| first + (i << 16))
        .find(|&at| read(&dq, at, 4096) == stamp(0, 7))
        .expect("block 0's data on the data device");
    for b in 0..40u64 {
        assert!(
            read(&dq, base + (b << 16), 4096) == stamp(b, 7),
            "block {b} out of place"
        );
    }
}

#[test]
fn a_recorded_pool_opened_with_other_settings_or_devices_is_refused_in_one_line() {
    let open = |data: &Arc<dyn Device>, meta: Option<&Arc<dyn Device>>, opts: PoolOptions| {
        ThinPool::open(
            "pool",
            data.clone(),
            meta.cloned(),
            opts,
            Switches::default(),
            false,
        )
        .err()
        .map(|e| e.to_string())
    };
    let (data, meta) = (mem("64M", false), mem("64M", false));
    assert_eq!(open(&data, Some(&meta), opts()), None, "a new pool");
    let other_block = PoolOptions {
        block_bytes: Some(128 << 10),
        ..opts()
    };
    let smaller = mem("32M", false);
    for (e, want) in [
        (
            open(&data, Some(&meta), other_block),
            "the pool was made with block = 64KiB; the stack file says 128KiB (a pool's block size never changes)",
        ),
        (
            open(&smaller, Some(&meta), opts()),
            "data device 'data' is 32MiB, smaller than the pool's 64MiB (wrong device?)",
        ),
        (
            // The metadata device given as the data device, metadata on it.
            open(&meta, None, opts()),
            "the pool's metadata is recorded as being elsewhere: check the 'metadata' key",
        ),
    ] {
        assert_eq!(e.as_deref(), Some(want));
    }
    assert_eq!(
        open(&data, Some(&meta), opts()),
        None,
        "nothing was changed"
    );
}
