//! Thin pools against damage to their metadata: every region (both superblock slots, the
//! log blocks in use, the checkpoints) flipped, zeroed, put back from an older copy, and
//! the metadata device cut short, after clean stops and after crashes, two and three
//! opens in a row. The outcome is always one of: the pool opens with the data a model
//! says it holds, or the open is refused naming the damage with nothing written (the
//! metadata and data bytes are compared before and after). Never data lost in silence.
//!
//! One outcome is allowed because it cannot be told apart from a tear: damage to the
//! blocks of the last commit before a crash. The pool then opens saying that it dropped
//! an incomplete commit (each page reads a value it held at some time), or, when every
//! block of that commit was zeroed or put back as it was before the commit (a commit the
//! crash never wrote looks the same), in silence: the README says so.

use std::collections::BTreeSet;
use std::sync::Arc;

use cairn_core::blocking::BlockingQueue;
use cairn_core::{Device, IoFlags, Op, Switches};
use cairn_leaves::LeafSpec;
use cairn_services::thin::format;
use cairn_services::thin::pool::{Admin, LowWater, PoolOptions, ThinPool};
use cairn_services::thin::superblock::{self as sbk, PoolSuperblock};
use cairn_services::thin::ThinDevice;
use cairn_services::thin::ThinPoolAdmin;

const PAGE: usize = 4096;
/// Pages of the volume (1 MiB: 16 blocks of 64 KiB).
const PAGES: u64 = 256;
const META_BYTES: u64 = 4 << 20;

fn mem(name: &str, bytes: u64) -> Arc<dyn Device> {
    let s = LeafSpec::parse(&format!("mem:{bytes}")).unwrap();
    cairn_leaves::open(&s, name).unwrap()
}

fn q(d: &Arc<dyn Device>) -> BlockingQueue {
    BlockingQueue::open(d, Switches::default()).unwrap()
}

fn opts() -> PoolOptions {
    PoolOptions {
        block_bytes: Some(64 << 10),
        low_water: LowWater::Percent(10),
        repair: false,
    }
}

/// A page's content: its number and the value written, repeated.
fn content(p: u64, v: u32) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    for c in b.chunks_mut(16) {
        c[..8].copy_from_slice(&p.to_le_bytes());
        c[8..12].copy_from_slice(&v.to_le_bytes());
        c[12..16].copy_from_slice(&(!v).to_le_bytes());
    }
    b
}

/// The value a page holds (0: zeros), or `None` for anything else.
fn value_of(p: u64, b: &[u8]) -> Option<u32> {
    if b.iter().all(|&x| x == 0) {
        return Some(0);
    }
    let v = u32::from_le_bytes(b[8..12].try_into().unwrap());
    (b == content(p, v).as_slice()).then_some(v)
}

/// Where the metadata lives: the start of the data device, or a device of its own.
struct Disks {
    data: Arc<dyn Device>,
    meta: Option<Arc<dyn Device>>,
}

impl Disks {
    fn new(separate: bool) -> Disks {
        Disks {
            data: mem("data", 16 << 20),
            meta: separate.then(|| mem("meta", META_BYTES)),
        }
    }

    fn meta_dev(&self) -> &Arc<dyn Device> {
        self.meta.as_ref().unwrap_or(&self.data)
    }

    fn open(&self, dry: bool) -> Result<ThinPool, cairn_core::Error> {
        ThinPool::open(
            "pool",
            self.data.clone(),
            self.meta.clone(),
            opts(),
            Switches::default(),
            dry,
        )
    }

    /// Every byte of the metadata area and of the data device.
    fn image(&self) -> (Vec<u8>, Vec<u8>) {
        let read = |d: &Arc<dyn Device>| {
            let mut b = vec![0u8; d.geometry().size_bytes as usize];
            q(d).read(0, &mut b).unwrap();
            b
        };
        let data = read(&self.data);
        let meta = match &self.meta {
            Some(m) => read(m),
            None => data[..META_BYTES as usize].to_vec(),
        };
        (meta, data)
    }

    fn put_meta(&self, at: u64, bytes: &[u8]) {
        q(self.meta_dev()).write(at, bytes, IoFlags::NONE).unwrap();
    }

    fn superblock(&self) -> PoolSuperblock {
        let mut area = vec![0u8; 2 * sbk::SLOT_BYTES];
        q(self.meta_dev()).read(0, &mut area).unwrap();
        sbk::pick(&area).newest().unwrap()
    }
}

/// What each page of the volume (and of its snapshot) may read.
#[derive(Clone)]
struct Model {
    /// Per page: the values it may hold now (one after a flush).
    allowed: Vec<BTreeSet<u32>>,
    /// Per page: every value it ever held.
    ever: Vec<BTreeSet<u32>>,
    /// The snapshot, once taken: what it holds.
    snap: Option<Vec<u32>>,
    next: u32,
}

impl Model {
    fn new() -> Model {
        Model {
            allowed: vec![BTreeSet::from([0]); PAGES as usize],
            ever: vec![BTreeSet::from([0]); PAGES as usize],
            snap: None,
            next: 1,
        }
    }
}

/// One session: open the pool, write (flushing every `flush_every` writes, a snapshot
/// in the middle of the first session), then stop cleanly or as a crash stops.
fn session(disks: &Disks, m: &mut Model, seed: u64, writes: u64, crash: bool) {
    let pool = Arc::new(disks.open(false).unwrap());
    let vol: Arc<dyn Device> = Arc::new(
        ThinDevice::open("v", pool.clone(), "v", Some(PAGES * PAGE as u64), true).unwrap(),
    );
    let vq = q(&vol);
    let mut flushed_now: Vec<u32> = m
        .allowed
        .iter()
        .map(|a| *a.iter().next_back().unwrap())
        .collect();
    let mut x = seed;
    for i in 0..writes {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let p = (x >> 33) % PAGES;
        let v = m.next;
        m.next += 1;
        vq.write(p * PAGE as u64, &content(p, v), IoFlags::NONE)
            .unwrap();
        m.allowed[p as usize].insert(v);
        m.ever[p as usize].insert(v);
        flushed_now[p as usize] = v;
        if i % 7 == 5 {
            // A whole block unmapped: the next writes there map a new one, so every
            // session's commits hold records (overwrites in place need none).
            let b = (x >> 40) % (PAGES / 16);
            vq.zero(
                Op::Discard,
                b * 16 * PAGE as u64,
                16 * PAGE as u64,
                IoFlags::NONE,
            )
            .unwrap();
            for p in b * 16..(b + 1) * 16 {
                m.allowed[p as usize].insert(0);
                flushed_now[p as usize] = 0;
            }
        }
        if i % 7 == 6 {
            vq.flush().unwrap();
            for (a, &v) in m.allowed.iter_mut().zip(&flushed_now) {
                *a = BTreeSet::from([v]);
            }
        }
        if m.snap.is_none() && i == writes / 2 {
            pool.admin(Admin::Snapshot {
                src: "v".into(),
                name: "s".into(),
                read_only: true,
            })
            .unwrap();
            // The snapshot holds every acknowledged write: the newest value of each page.
            m.snap = Some(flushed_now.clone());
            for (a, &v) in m.allowed.iter_mut().zip(&flushed_now) {
                *a = BTreeSet::from([v]);
            }
        }
    }
    if crash {
        pool.crash_on_close();
    } else {
        vq.flush().unwrap();
        for (a, &v) in m.allowed.iter_mut().zip(&flushed_now) {
            *a = BTreeSet::from([v]);
        }
    }
}

/// Reads volume `name` of an open pool: each page's value.
fn read_volume(pool: &Arc<dyn Device>, name: &str) -> Vec<Option<u32>> {
    let d: Arc<dyn Device> =
        Arc::new(ThinDevice::open(name, pool.clone(), name, None, false).unwrap());
    let mut b = vec![0u8; PAGES as usize * PAGE];
    q(&d).read(0, &mut b).unwrap();
    (0..PAGES)
        .map(|p| value_of(p, &b[p as usize * PAGE..][..PAGE]))
        .collect()
}

/// Opens the damaged pool and judges the outcome (see the module's documentation);
/// `unseen`: the damage wiped the whole last commit, which cannot be seen. Returns the
/// outcome in a word, for the tally.
fn judge(disks: &Disks, m: &Model, what: &str, unseen: bool) -> &'static str {
    let before = disks.image();
    let check = disks.open(true);
    let opened = disks.open(false);
    match opened {
        Err(e) => {
            let after = disks.image();
            assert!(
                before == after,
                "{what}: the refused open changed the disks ({e})"
            );
            let text = e.to_string();
            assert!(
                check.is_err(),
                "{what}: serve refused ({text}) but check found nothing"
            );
            assert!(
                [
                    "damaged",
                    "not blank",
                    "superblock",
                    "checkpoint",
                    "smaller",
                    "reading"
                ]
                .iter()
                .any(|w| text.contains(w)),
                "{what}: the refusal does not name the damage: {text}"
            );
            assert!(!text.contains('\n'), "{what}: more than one line: {text}");
            "refused"
        }
        Ok(pool) => {
            let words = check.map(|c| c.describe()).unwrap_or_default();
            let torn = words.contains("dropped as torn");
            let pool: Arc<dyn Device> = Arc::new(pool);
            let got = read_volume(&pool, "v");
            for (p, g) in got.iter().enumerate() {
                let ok = match g {
                    Some(v) if torn || unseen => m.ever[p].contains(v),
                    Some(v) => m.allowed[p].contains(v),
                    None => false,
                };
                assert!(
                    ok,
                    "{what}: page {p} reads {g:?}, allowed {:?} (check said: {words})",
                    m.allowed[p]
                );
            }
            if let Some(snap) = &m.snap {
                let got = read_volume(&pool, "s");
                for (p, g) in got.iter().enumerate() {
                    assert_eq!(*g, Some(snap[p]), "{what}: snapshot page {p}");
                }
            }
            if torn {
                "opened, a torn commit dropped"
            } else {
                "opened, same data"
            }
        }
    }
}

/// Each damage to the metadata of a pool stopped as `stops` says (true: a crash).
fn damage_each_region(separate: bool, stops: &[bool]) {
    let disks = Disks::new(separate);
    let mut m = Model::new();
    let mut older = None;
    for (i, &crash) in stops.iter().enumerate() {
        older = Some(disks.image().0);
        session(&disks, &mut m, 17 + i as u64, 60, crash);
    }
    let older = older.unwrap();
    let (meta0, data0) = disks.image();
    let sb = disks.superblock();
    let log_pages = sb.log_bytes / PAGE as u64;
    let last = last_commit(&meta0, &sb);
    // The regions: both superblock slots, the log pages from the start (in use or not),
    // the pages of the checkpoint in use and the first of the other area.
    let mut regions: Vec<(String, u64, u64)> = vec![
        ("superblock slot 0".into(), 0, sbk::SLOT_BYTES as u64),
        (
            "superblock slot 1".into(),
            sbk::SLOT_BYTES as u64,
            sbk::SLOT_BYTES as u64,
        ),
    ];
    for k in 0..12 {
        let seq = sb.log_start_seq + k;
        let at = sb.log_offset + (seq % log_pages) * PAGE as u64;
        regions.push((format!("log block {seq}"), at, PAGE as u64));
    }
    // The last commit whole.
    if let (Some(&first), Some(&end)) = (last.first(), last.last()) {
        let at = sb.log_offset + (first % log_pages) * PAGE as u64;
        if end % log_pages >= first % log_pages {
            regions.push((
                "the last commit".into(),
                at,
                (end - first + 1) * PAGE as u64,
            ));
        }
    }
    let in_use = sb.checkpoint_in_use as usize - 1;
    for k in 0..sb.checkpoint_pages.min(4) {
        let at = sb.checkpoints[in_use] + k * PAGE as u64;
        regions.push((format!("checkpoint page {k}"), at, PAGE as u64));
    }
    regions.push((
        "the other checkpoint area".into(),
        sb.checkpoints[1 - in_use],
        PAGE as u64,
    ));
    regions.push(("the whole log".into(), sb.log_offset, sb.log_bytes));
    let restore = || {
        disks.put_meta(0, &meta0);
        q(&disks.data).write(0, &data0, IoFlags::NONE).unwrap();
    };
    let mut tally = std::collections::BTreeMap::new();
    for (name, at, len) in &regions {
        let (a, n) = (*at as usize, *len as usize);
        for how in ["flip", "zero", "roll back"] {
            restore();
            let mut bytes = meta0[a..a + n].to_vec();
            match how {
                "flip" => bytes[n / 2 + 37] ^= 0x10,
                "zero" => bytes.fill(0),
                _ => bytes.copy_from_slice(&older[a..a + n]),
            }
            if bytes == meta0[a..a + n] {
                continue;
            }
            disks.put_meta(*at, &bytes);
            let what = format!("{how} {name} (stops {stops:?}, separate {separate})");
            // Every block of the last commit wiped, after a crash: not seen (a clean
            // stop's checkpoint holds that commit, so there it is seen or not needed).
            let wiped = how != "flip"
                && !last.is_empty()
                && last.iter().all(|s| {
                    let p = sb.log_offset + (s % log_pages) * PAGE as u64;
                    p >= *at && p < at + len
                });
            let unseen = wiped && *stops.last().unwrap();
            *tally
                .entry((how, judge(&disks, &m, &what, unseen)))
                .or_insert(0) += 1;
        }
    }
    // Both superblock slots put back from the older copy.
    restore();
    disks.put_meta(0, &older[..2 * sbk::SLOT_BYTES]);
    let what = format!("roll back both superblock slots (stops {stops:?})");
    *tally
        .entry(("roll back", judge(&disks, &m, &what, false)))
        .or_insert(0) += 1;
    eprintln!("stops {stops:?}, separate {separate}: {tally:?}");
}

/// The sequence numbers of the last whole commit in the log of `meta` (none when the log
/// is empty).
fn last_commit(meta: &[u8], sb: &PoolSuperblock) -> Vec<u64> {
    let pages = sb.log_bytes / PAGE as u64;
    let ring: Vec<&[u8]> = (0..pages)
        .map(|i| {
            let at = (sb.log_offset + ((sb.log_start_seq + i) % pages) * PAGE as u64) as usize;
            &meta[at..at + PAGE]
        })
        .collect();
    let log = format::replay(
        &ring,
        &sb.pool_uuid,
        sb.log_start_seq,
        sb.generation,
        sb.version,
    )
    .unwrap();
    if log.commits == 0 {
        return Vec::new();
    }
    let tail = ring[(log.end - 1 - sb.log_start_seq) as usize];
    let first = format::LogBlock::decode(tail, &sb.pool_uuid)
        .unwrap()
        .commit;
    (first..log.end).collect()
}

#[test]
fn damage_after_clean_stops() {
    damage_each_region(false, &[false, false]);
    damage_each_region(true, &[false, false, false]);
}

#[test]
fn damage_after_crashes() {
    damage_each_region(false, &[true, true]);
    damage_each_region(true, &[false, true, true]);
}

#[test]
fn damage_after_a_crash_then_a_clean_stop() {
    damage_each_region(false, &[true, false]);
}

/// A metadata device cut short (a truncated image): refused, nothing written.
#[test]
fn a_metadata_device_cut_short_is_refused() {
    let disks = Disks::new(true);
    let mut m = Model::new();
    session(&disks, &mut m, 5, 60, true);
    let (meta, _) = disks.image();
    let sb = disks.superblock();
    let end = sb.checkpoints[sb.checkpoint_in_use as usize - 1] + sb.checkpoint_pages * PAGE as u64;
    for keep in [
        2 * sbk::SLOT_BYTES as u64,
        sb.log_offset + PAGE as u64,
        end - PAGE as u64,
    ] {
        let short = Disks {
            data: disks.data.clone(),
            meta: Some(mem("meta", keep)),
        };
        short.put_meta(0, &meta[..keep as usize]);
        let what = format!("metadata cut to {keep} bytes");
        assert_eq!(judge(&short, &m, &what, false), "refused", "{what}");
    }
}

/// Zeroed superblocks over a pool's log and checkpoints: the pool is not made again
/// over them (its data would be lost), and check says the same.
#[test]
fn a_pool_is_not_made_again_over_zeroed_superblocks() {
    let disks = Disks::new(false);
    let mut m = Model::new();
    session(&disks, &mut m, 9, 40, false);
    disks.put_meta(0, &vec![0u8; 2 * sbk::SLOT_BYTES]);
    let what = "both superblock slots zeroed";
    assert_eq!(judge(&disks, &m, what, false), "refused");
    let e = disks.open(true).err().unwrap().to_string();
    assert!(e.contains("not blank"), "{e}");
}
