//! A damage model for the dirty-bitmap store: every region of a store file (directory
//! copy A, copy B, each page of bits) has a byte flipped, is zeroed, is cut off, or is
//! put back from an older copy, after a clean stop and in a copy taken mid-run (what a
//! crash leaves), and so are whole files and the directory and page writes a crash
//! tears. Each time the store is opened to examine (`dry`) and then for writing, and
//! the outcome must be one of:
//!
//! - the same bitmaps with the same dirty bits as before the damage;
//! - a refusal naming the store, with the file's bytes unchanged;
//! - the damaged bitmap flagged inconsistent (in `list()`), its bits still a superset of
//!   those it had.
//!
//! Never a bitmap that lost a dirty bit, or lost its inconsistency, in silence. What no
//! store can detect (a whole store put back from an older copy, one page of bits put
//! back from an older copy) is the README's list, and is not modelled as damage here: a
//! whole older file is checked to read back as the state it had when it was copied.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;

use cairn_core::DirtyMap;
use cairn_services::dirty::format::{Directory, PAGE, SLOT};
use cairn_services::dirty::store::Store;

const DEVICE: &str = "d";
/// Not a whole number of 64 granules of any bitmap below: the last word of each is
/// partial, and 4 KiB granules take two pages of bits.
const DEVICE_BYTES: u64 = (200 << 20) + 5 * 4096 + 1000;

/// A bitmap as a backup tool sees it: its dirty ranges (offset, length) and its flag.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    dirty: Vec<(u64, u64)>,
    inconsistent: bool,
}

type State = BTreeMap<String, Seen>;

fn state(s: &Store) -> State {
    s.list()
        .into_iter()
        .map(|b| {
            let owner = b.snapshot.clone().unwrap_or_default();
            let mut runs = Vec::new();
            s.reader(&owner, &b.name)
                .expect("listed")
                .runs(0, DEVICE_BYTES, usize::MAX, &mut runs);
            let (mut at, mut dirty) = (0, Vec::new());
            for (n, d) in runs {
                if d {
                    dirty.push((at, n));
                }
                at += n;
            }
            let seen = Seen {
                dirty,
                inconsistent: b.inconsistent,
            };
            (b.name, seen)
        })
        .collect()
}

/// Whether every byte `small` marks dirty is dirty in `big`.
fn covered(small: &[(u64, u64)], big: &[(u64, u64)]) -> bool {
    small
        .iter()
        .all(|&(o, n)| big.iter().any(|&(bo, bn)| bo <= o && o + n <= bo + bn))
}

/// How an open of a damaged store ended.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// The state of one of the acceptable states, bit for bit.
    Same,
    /// These bitmaps are flagged inconsistent (and cover what they had).
    Flagged(Vec<String>),
    /// Refused with this line, nothing written.
    Refused(String),
}

thread_local! {
    static LOGGED: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Keeps the warnings and errors logged on each test's own thread.
struct Capture;

impl log::Log for Capture {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Warn
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            LOGGED.with(|l| l.borrow_mut().push(r.args().to_string()));
        }
    }
    fn flush(&self) {}
}

static CAPTURE: Capture = Capture;

/// The warnings logged on this thread since the last call.
fn logged() -> Vec<String> {
    let _ = log::set_logger(&CAPTURE);
    log::set_max_level(log::LevelFilter::Warn);
    LOGGED.with(|l| std::mem::take(&mut *l.borrow_mut()))
}

fn open(path: &Path, dry: bool) -> Result<Store, String> {
    Store::open(path, DEVICE, DEVICE_BYTES, dry).map_err(|e| e.to_string())
}

/// Opens `bytes` as a store (dry, then for writing, then once more) and checks the
/// outcome against the states it may rightly show.
fn judge(dir: &Path, what: &str, bytes: &[u8], accept: &[&State]) -> Outcome {
    let path = dir.join("damaged");
    std::fs::write(&path, bytes).unwrap();
    logged();
    let dry = open(&path, true);
    assert!(
        std::fs::read(&path).unwrap() == bytes,
        "{what}: a dry open wrote to the store"
    );
    let dry_outcome = dry.as_ref().map(state).map_err(Clone::clone);
    drop(dry);
    let outcome = match open(&path, false) {
        Err(e) => {
            assert!(
                std::fs::read(&path).unwrap() == bytes,
                "{what}: refused ({e}) but the store was written"
            );
            assert!(
                e.contains(path.to_str().unwrap()) && !e.contains('\n'),
                "{what}: the refusal does not name the store in one line: {e}"
            );
            assert!(
                dry_outcome.is_err(),
                "{what}: refused for writing ({e}) but not to examine"
            );
            Outcome::Refused(e)
        }
        Ok(s) => {
            let got = state(&s);
            assert_eq!(
                dry_outcome.as_ref().ok(),
                Some(&got),
                "{what}: a dry open saw another state"
            );
            let outcome = compare(what, &got, accept);
            drop(s);
            // What the open found stays found, and what it repaired stays repaired.
            let again = open(&path, false).unwrap_or_else(|e| panic!("{what}: reopen: {e}"));
            assert_eq!(state(&again), got, "{what}: the reopen differs");
            drop(again);
            let b = std::fs::read(&path).unwrap();
            let a = Directory::decode(&b[..SLOT as usize]);
            let c = Directory::decode(&b[SLOT as usize..2 * SLOT as usize]);
            assert!(
                a.is_ok() && a == c,
                "{what}: the copies differ after an open for writing: {a:?} / {c:?}"
            );
            outcome
        }
    };
    std::fs::remove_file(&path).unwrap();
    outcome
}

/// The state `got` shows, against the acceptable ones: panics on a silent loss. Each
/// bitmap may show any acceptable state of its own (a crash between the page writes of
/// one mark leaves some bitmaps as before it and others as after).
fn compare(what: &str, got: &State, accept: &[&State]) -> Outcome {
    if accept.contains(&got) {
        return Outcome::Same;
    }
    let names: Vec<&String> = got.keys().collect();
    assert!(
        accept.iter().any(|w| w.keys().collect::<Vec<_>>() == names),
        "{what}: changes lost in silence: bitmaps {names:?}, not {:?}",
        accept
            .iter()
            .map(|w| w.keys().collect())
            .collect::<Vec<Vec<_>>>()
    );
    let mut flagged = Vec::new();
    for (name, g) in got {
        let wants: Vec<&Seen> = accept.iter().filter_map(|w| w.get(name)).collect();
        if wants.contains(&g) {
            continue;
        }
        let w = wants.iter().find(|w| covered(&w.dirty, &g.dirty));
        assert!(
            g.inconsistent && w.is_some(),
            "{what}: changes lost in silence: bitmap '{name}': {} dirty ranges, inconsistent {}; it had {:?}",
            g.dirty.len(),
            g.inconsistent,
            wants.iter().map(|w| (w.dirty.len(), w.inconsistent)).collect::<Vec<_>>()
        );
        flagged.push(name.clone());
    }
    Outcome::Flagged(flagged)
}

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A store's life: its file at some points (a copy mid-run is what a crash leaves) with
/// the state it showed then.
struct Life {
    _tmp: tempfile::TempDir,
    /// Fresh bitmaps, no marks.
    empty: (Vec<u8>, State),
    /// Mid-run: marks made, a bitmap being added.
    before_add: (Vec<u8>, State),
    after_add: (Vec<u8>, State),
    /// Around one mark that sets a new granule of `fine`: its page's offset.
    before_mark: (Vec<u8>, State),
    after_mark: (Vec<u8>, State),
    mark_page: u64,
    /// After a clean stop.
    stopped: (Vec<u8>, State),
}

fn snap(path: &Path, s: &Store) -> (Vec<u8>, State) {
    (std::fs::read(path).unwrap(), state(s))
}

fn life() -> Life {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("store");
    let s = open(&path, false).unwrap();
    s.add("fine", 4096).unwrap();
    s.add("coarse", 64 << 10).unwrap();
    let empty = snap(&path, &s);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut marks = |s: &Store, n: usize| {
        for _ in 0..n {
            let off = rng.below(DEVICE_BYTES);
            let len = 1 + rng.below(20_000).min(DEVICE_BYTES - off - 1);
            s.mark(off, len).unwrap();
        }
        // The device's last bytes: the partial last word of every bitmap.
        s.mark(DEVICE_BYTES - 700, 700).unwrap();
    };
    marks(&s, 150);
    let before_add = snap(&path, &s);
    s.add("late", 1 << 20).unwrap();
    let after_add = snap(&path, &s);
    marks(&s, 150);
    // A granule of `fine` not set yet, in its second page of bits.
    let granule = (40_000..DEVICE_BYTES / 4096)
        .find(|g| {
            let mut r = Vec::new();
            s.reader("", "fine")
                .unwrap()
                .runs(g * 4096, 4096, 1, &mut r);
            !r[0].1
        })
        .expect("a clean granule");
    let before_mark = snap(&path, &s);
    s.mark(granule * 4096, 4096).unwrap();
    let after_mark = snap(&path, &s);
    let fine = areas(&after_mark.0)["fine"];
    let mark_page = (0..pages(&after_mark.0, "fine"))
        .map(|p| fine + p * PAGE)
        .find(|&p| {
            after_mark.0[p as usize..(p + PAGE) as usize]
                != before_mark.0[p as usize..(p + PAGE) as usize]
        })
        .expect("the mark changed a page");
    drop(s);
    let stopped = (std::fs::read(&path).unwrap(), after_mark.1.clone());
    Life {
        _tmp: tmp,
        empty,
        before_add,
        after_add,
        before_mark,
        after_mark,
        mark_page,
        stopped,
    }
}

/// The newest directory in a store's bytes.
fn directory(bytes: &[u8]) -> Directory {
    let a = Directory::decode(&bytes[..SLOT as usize]);
    let b = Directory::decode(&bytes[SLOT as usize..(2 * SLOT) as usize]);
    match (a, b) {
        (Ok(a), Ok(b)) if b.seq > a.seq => b,
        (Ok(a), _) => a,
        (_, Ok(b)) => b,
        (Err(a), Err(b)) => panic!("no directory: {a}; {b}"),
    }
}

/// Where each bitmap's bits start.
fn areas(bytes: &[u8]) -> BTreeMap<String, u64> {
    directory(bytes)
        .entries
        .iter()
        .map(|e| (e.name.clone(), e.area))
        .collect()
}

/// Pages of bits bitmap `name` has.
fn pages(bytes: &[u8], name: &str) -> u64 {
    let e = directory(bytes)
        .entries
        .into_iter()
        .find(|e| e.name == name)
        .unwrap();
    e.area_bytes() / PAGE
}

/// A region of a store: what to call it, what a warning about it names, where it is,
/// and its bytes that matter.
struct Region {
    label: String,
    named: String,
    at: u64,
    n: u64,
}

fn regions(bytes: &[u8]) -> Vec<Region> {
    let copy = |c: &str, at| Region {
        label: format!("copy {c}"),
        named: format!("copy {c}"),
        at,
        n: PAGE,
    };
    let mut out = vec![copy("A", 0), copy("B", SLOT)];
    for (name, area) in areas(bytes) {
        for p in 0..pages(bytes, &name) {
            out.push(Region {
                label: format!("bitmap '{name}' page {p}"),
                named: format!("bitmap '{name}': page {p} of its bits"),
                at: area + p * PAGE,
                n: PAGE,
            });
        }
    }
    out
}

/// Flips, zeroes and older copies of every region of `now`, judged against `want`.
fn damage_every_region(dir: &Path, when: &str, now: &[u8], want: &State, older: &[u8]) {
    for Region {
        label,
        named,
        at,
        n,
    } in regions(now)
    {
        let copy = label.starts_with("copy");
        for i in [0, 13, 100, n - 9, n - 5, n - 1] {
            let mut b = now.to_vec();
            b[(at + i) as usize] ^= 0x20;
            let what = format!("{when}: {label}: byte {i} flipped");
            let out = judge(dir, &what, &b, &[want]);
            let warned = logged().join("\n");
            if copy && i < 100 {
                // Inside the directory: the other copy holds the same state.
                assert_eq!(out, Outcome::Same, "{what}");
            }
            if !copy || i < 100 {
                assert!(warned.contains(&named), "{what}: no warning: {warned}");
            }
            if !copy {
                assert!(matches!(out, Outcome::Flagged(_)), "{what}: {out:?}");
            }
        }
        let mut b = now.to_vec();
        b[at as usize..(at + n) as usize].fill(0);
        let what = format!("{when}: {label}: zeroed");
        let out = judge(dir, &what, &b, &[want]);
        let warned = logged().join("\n");
        assert!(warned.contains(&named), "{what}: no warning: {warned}");
        if copy {
            assert_eq!(out, Outcome::Same, "{what}");
        } else {
            assert!(matches!(out, Outcome::Flagged(_)), "{what}: {out:?}");
        }
        if copy && older.len() >= (at + n) as usize {
            // An older directory put back in one copy: the other is newer.
            let mut b = now.to_vec();
            b[at as usize..(at + n) as usize]
                .copy_from_slice(&older[at as usize..(at + n) as usize]);
            let what = format!("{when}: {label}: an older copy put back");
            assert_eq!(judge(dir, &what, &b, &[want]), Outcome::Same, "{what}");
        }
    }
}

/// The file cut at many points.
fn truncate_everywhere(dir: &Path, when: &str, now: &[u8], want: &State) {
    let mut cuts = vec![
        0,
        1,
        100,
        PAGE,
        SLOT - 1,
        SLOT,
        SLOT + 100,
        SLOT + PAGE,
        2 * SLOT,
    ];
    for Region { at, n, .. } in regions(now).into_iter().skip(2) {
        cuts.extend([at + 1, at + n / 2, at + n - 1]);
    }
    cuts.push(now.len() as u64 - 1);
    for cut in cuts {
        let what = format!("{when}: cut at {cut}");
        let out = judge(dir, &what, &now[..cut as usize], &[want]);
        if cut < PAGE {
            assert!(matches!(out, Outcome::Refused(_)), "{what}: {out:?}");
        }
    }
}

#[test]
fn damage_after_a_clean_stop_is_found_or_repaired() {
    let l = life();
    let dir = l._tmp.path();
    damage_every_region(dir, "stopped", &l.stopped.0, &l.stopped.1, &l.before_add.0);
    truncate_everywhere(dir, "stopped", &l.stopped.0, &l.stopped.1);
}

#[test]
fn damage_to_a_copy_taken_mid_run_is_found_or_repaired() {
    let l = life();
    let dir = l._tmp.path();
    // A copy taken mid-run is a crash's image: it reads back as it was, bits and all.
    for (when, (bytes, want)) in [
        ("empty", &l.empty),
        ("before add", &l.before_add),
        ("after add", &l.after_add),
        ("before mark", &l.before_mark),
    ] {
        assert_eq!(judge(dir, when, bytes, &[want]), Outcome::Same, "{when}");
    }
    let (now, want) = &l.after_add;
    damage_every_region(dir, "mid-run", now, want, &l.empty.0);
    truncate_everywhere(dir, "mid-run", now, want);
}

#[test]
fn torn_directory_and_page_writes_leave_the_state_before_or_after() {
    let l = life();
    let dir = l._tmp.path();
    let (pre, pre_state) = &l.before_add;
    let (post, post_state) = &l.after_add;
    let accept = [pre_state, post_state];
    // The directory write of an add torn at every 512 bytes of either copy's first page,
    // with the other copy as before or as after.
    for (copy, other) in [(0, SLOT), (SLOT, 0)] {
        for other_done in [false, true] {
            for cut in (0..=PAGE).step_by(512) {
                let mut b = post.clone();
                let c = copy as usize;
                b[c + cut as usize..c + PAGE as usize]
                    .copy_from_slice(&pre[c + cut as usize..c + PAGE as usize]);
                if !other_done {
                    let o = other as usize;
                    b[o..o + PAGE as usize].copy_from_slice(&pre[o..o + PAGE as usize]);
                }
                let what =
                    format!("add torn at {cut} of the copy at {copy}, the other done {other_done}");
                let out = judge(dir, &what, &b, &accept);
                assert_eq!(out, Outcome::Same, "{what}");
            }
        }
    }
    // The page write of a mark torn at every 512 bytes.
    let (pre, pre_state) = &l.before_mark;
    let (post, post_state) = &l.after_mark;
    let p = l.mark_page as usize;
    for cut in (0..=PAGE as usize).step_by(512) {
        let mut b = post.clone();
        b[p + cut..p + PAGE as usize].copy_from_slice(&pre[p + cut..p + PAGE as usize]);
        let what = format!("mark torn at {cut}");
        judge(dir, &what, &b, &[pre_state, post_state]);
    }
}

#[test]
fn a_whole_older_copy_reads_back_as_it_was_when_copied() {
    let l = life();
    let dir = l._tmp.path();
    for (when, (bytes, want)) in [
        ("empty", &l.empty),
        ("before mark", &l.before_mark),
        ("after mark", &l.after_mark),
        ("stopped", &l.stopped),
    ] {
        assert_eq!(judge(dir, when, bytes, &[want]), Outcome::Same, "{when}");
    }
}
