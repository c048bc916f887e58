//! The fuzz targets of cairn's on-disk formats (`cairn_config::fuzz`, the bodies the
//! cargo-fuzz targets in `fuzz/` call) on stable, so that every test run exercises them:
//! each target's committed seeds (`fuzz/seeds/TARGET/`), the seeds its encoders make
//! now, and a bounded number of mutations of both (bits flipped, bytes cut, inserted or
//! appended, fields overwritten with edge values, checksums made again), drawn from a
//! fixed seed so that a failure repeats.
//!
//! A panic fails the test, naming the input and the file it was saved to (replay it with
//! `cargo +nightly fuzz run TARGET FILE` in `crates/config`); so does an input that
//! allocates more than [`ALLOC_MAX`] at once, or a target that has not finished after
//! [`HANG`] (far longer than it takes: a hang). Seeds named `valid-*` must decode: a
//! format change that leaves the committed seeds behind is noticed. Write them again
//! with `SEEDS=TARGET cargo test -p cairn-config --test decoders_fuzz -- --ignored
//! write_seeds` (without `SEEDS`, every target's).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use cairn_config::fuzz::{Target, RESEAL, TARGETS};

/// Mutations of each seed.
const MUTATIONS: usize = 1000;
/// Longer than any target's run takes here by far: one that has not finished hangs.
const HANG: Duration = Duration::from_secs(300);
/// The most one input may have allocated at once beyond what was live before it.
const ALLOC_MAX: usize = 64 << 20;

/// Counts this thread's live heap bytes and their peak, for [`ALLOC_MAX`].
struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call goes to the system allocator unchanged; the counting only reads
// and writes thread-local cells, which neither allocate nor unwind.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size() as isize);
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size() as isize);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        grew(-(layout.size() as isize));
        // SAFETY: `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        grew(new_size as isize - layout.size() as isize);
        // SAFETY: as for dealloc; `new_size` is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn grew(by: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get().wrapping_add_signed(by);
        live.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

/// Runs `run` on `input`; the bytes it had allocated at most at once beyond what was
/// live before.
fn measured(run: fn(&[u8]) -> bool, input: &[u8]) -> (bool, usize) {
    let before = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(before));
    let decoded = run(input);
    (decoded, PEAK.with(Cell::get).saturating_sub(before))
}

/// splitmix64: a fixed sequence from a fixed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// An offset into `len` bytes, half the time in the first 4 KiB (where headers are).
    fn offset(&mut self, len: usize) -> usize {
        if self.below(2) == 0 {
            self.below(len.min(4096))
        } else {
            self.below(len)
        }
    }
}

/// Values at the edges of what fields hold.
const EDGES: [u64; 12] = [
    0,
    1,
    2,
    0x7f,
    0xff,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 52,
    u64::MAX,
];

/// One mutation of `v`.
fn mutate_once(rng: &mut Rng, v: &mut Vec<u8>) {
    let len = v.len();
    match rng.below(7) {
        0 if len > 0 => {
            for _ in 0..1 + rng.below(8) {
                let at = rng.offset(len);
                v[at] ^= 1 << rng.below(8);
            }
        }
        1 if len > 0 => {
            let width = [1, 2, 4, 8][rng.below(4)];
            let at = rng.offset(len);
            let value = EDGES[rng.below(EDGES.len())].wrapping_add(rng.below(3) as u64);
            let bytes = if rng.below(2) == 0 {
                value.to_le_bytes()
            } else {
                (value << (64 - 8 * width as u32)).to_be_bytes()
            };
            let end = (at + width).min(len);
            v[at..end].copy_from_slice(&bytes[..end - at]);
        }
        2 => v.truncate(rng.below(len + 1)),
        3 => {
            let n = 1 + rng.below(64);
            let zeros = rng.below(2) == 0;
            for _ in 0..n {
                v.push(if zeros { 0 } else { rng.next() as u8 });
            }
        }
        4 if len > 1 => {
            let (from, to) = (rng.offset(len), rng.offset(len));
            let n = rng.below(64).min(len - from).min(len - to);
            let chunk = v[from..from + n].to_vec();
            v[to..to + n].copy_from_slice(&chunk);
        }
        5 if len > 1 => {
            let at = rng.offset(len);
            if rng.below(2) == 0 {
                let n = (1 + rng.below(8)).min(len - at);
                v.drain(at..at + n);
            } else {
                let n = 1 + rng.below(8);
                v.splice(at..at, (0..n).map(|_| rng.next() as u8));
            }
        }
        _ if len > 0 => v[0] ^= 1 << rng.below(3),
        _ => v.push(rng.next() as u8),
    }
}

/// A mutation of `seed`: a few changes, then half the time the checksums made again,
/// so that changed fields reach the checks behind them.
fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        mutate_once(rng, &mut v);
    }
    if rng.below(2) == 0 {
        if let Some(flags) = v.first_mut() {
            *flags |= RESEAL;
        }
    }
    v
}

fn seed_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target)
}

/// The committed seeds of `target`, by file name.
fn committed(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = seed_dir(target);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let path = e.expect("a directory entry").path();
            let name = path
                .file_name()
                .expect("a name")
                .to_string_lossy()
                .into_owned();
            (name, std::fs::read(&path).expect("a seed"))
        })
        .collect();
    out.sort();
    out
}

/// Runs `input` through `target`, failing with the input saved when the body panics or
/// allocates too much; returns whether it decoded.
fn one(target: &Target, what: &str, input: &[u8]) -> bool {
    let outcome = std::panic::catch_unwind(|| measured(target.run, input));
    let why = match outcome {
        Ok((decoded, peak)) if peak <= ALLOC_MAX => return decoded,
        Ok((_, peak)) => format!("allocated {peak} bytes at once"),
        Err(_) => "panicked (the message is above)".to_string(),
    };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("decoders_fuzz");
    std::fs::create_dir_all(&dir).expect("a directory for the failing input");
    let file = dir.join(format!("{}-{}", target.name, what.replace('/', "-")));
    std::fs::write(&file, input).expect("the failing input saved");
    panic!(
        "{}: {what} {why}; saved to {} (cd crates/config && cargo +nightly fuzz run {} {})",
        target.name,
        file.display(),
        target.name,
        file.display()
    );
}

/// Every seed, then their mutations, through `target`, on a thread of its own.
fn run_target(name: &'static str) {
    let target = TARGETS
        .iter()
        .find(|t| t.name == name)
        .expect("a target of that name");
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let fresh = (target.seeds)();
        let kept = committed(name);
        assert!(!kept.is_empty(), "no committed seeds for {name}");
        let mut decoded = 0;
        for (origin, seeds) in [("made", &fresh), ("committed", &kept)] {
            for (seed_name, seed) in seeds {
                let ok = one(target, &format!("{origin}/{seed_name}"), seed);
                assert!(
                    ok || !seed_name.starts_with("valid"),
                    "{name}: the {origin} seed {seed_name} does not decode (a format change? \
                     write the seeds again: SEEDS={name} cargo test -p cairn-config --test decoders_fuzz -- --ignored write_seeds)"
                );
            }
        }
        let mut rng = Rng(0x00c0_ffee ^ name.len() as u64);
        for (seed_name, seed) in fresh.iter().chain(&kept) {
            for i in 0..MUTATIONS {
                let input = mutate(&mut rng, seed);
                decoded += usize::from(one(target, &format!("{seed_name}/mutation-{i}"), &input));
            }
        }
        let _ = tx.send(decoded);
    });
    match rx.recv_timeout(HANG) {
        Ok(decoded) => {
            // Mutations that still decode show the target reaches past the first checks.
            assert!(decoded > 0, "{name}: no mutation decoded");
            eprintln!("{name}: {decoded} mutations decoded");
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{name}: no answer within {HANG:?}: a hang"),
        // The worker panicked: join says why.
        Err(mpsc::RecvTimeoutError::Disconnected) => {}
    }
    if let Err(e) = worker.join() {
        std::panic::resume_unwind(e);
    }
}

#[test]
fn array_superblock() {
    run_target("array_superblock");
}

#[test]
fn thin_superblock() {
    run_target("thin_superblock");
}

#[test]
fn thin_log() {
    run_target("thin_log");
}

#[test]
fn thin_checkpoint() {
    run_target("thin_checkpoint");
}

#[test]
fn dirty_directory() {
    run_target("dirty_directory");
}

#[test]
fn luks1_header() {
    run_target("luks1_header");
}

#[test]
fn luks2_header() {
    run_target("luks2_header");
}

/// Every target has a test above (a target added without one would not run).
#[test]
fn every_target_runs_here() {
    let source = include_str!("decoders_fuzz.rs");
    for t in TARGETS {
        assert!(
            source.contains(&format!("run_target(\"{}\")", t.name)),
            "{} has no test",
            t.name
        );
    }
}

/// Writes every target's seeds to `fuzz/seeds/TARGET/`, replacing what is there; with
/// `SEEDS=TARGET,...` in the environment, only those targets' (the LUKS seeds hold
/// random salts and UUIDs: written again, they change for nothing).
#[test]
#[ignore = "writes the committed seeds: run by hand after a format change"]
fn write_seeds() {
    let only = std::env::var("SEEDS").ok();
    let wanted = |name: &str| {
        only.as_ref()
            .is_none_or(|o| o.split(',').any(|t| t == name))
    };
    for t in TARGETS.iter().filter(|t| wanted(t.name)) {
        let dir = seed_dir(t.name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("the seed directory");
        for (name, bytes) in (t.seeds)() {
            std::fs::write(dir.join(name), bytes).expect("a seed");
        }
    }
}
