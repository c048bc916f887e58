//! What cairn's tests share: one operation of a random sequence, the bytes a write
//! carries, a full read-back against the model, tools found on `PATH`, ([`ceph`]) a
//! Ceph cluster for the RBD tests, and ([`probe`]) a device for the tests of wrappers.

#![forbid(unsafe_code)]

pub mod ceph;
pub mod probe;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;

use cairn_core::blocking::BlockingQueue;
pub use cairn_core::testing::skip;
use cairn_core::{IoFlags, Op};
use proptest::test_runner::TestCaseError;

/// One operation of a sequence.
#[derive(Debug, Clone)]
pub enum Step {
    Read {
        offset: u64,
        len: u64,
    },
    Write {
        offset: u64,
        len: u64,
        seed: u64,
        fua: bool,
    },
    Flush,
    Discard {
        offset: u64,
        len: u64,
    },
    WriteZeroes {
        offset: u64,
        len: u64,
        no_hole: bool,
    },
}

impl Step {
    pub fn op(&self) -> Op {
        match self {
            Step::Read { .. } => Op::Read,
            Step::Write { .. } => Op::Write,
            Step::Flush => Op::Flush,
            Step::Discard { .. } => Op::Discard,
            Step::WriteZeroes { .. } => Op::WriteZeroes,
        }
    }

    pub fn range(&self) -> (u64, u64) {
        match *self {
            Step::Read { offset, len }
            | Step::Write { offset, len, .. }
            | Step::Discard { offset, len }
            | Step::WriteZeroes { offset, len, .. } => (offset, len),
            Step::Flush => (0, 0),
        }
    }

    pub fn flags(&self) -> IoFlags {
        match *self {
            Step::Write { fua: true, .. } => IoFlags::FUA,
            Step::WriteZeroes { no_hole: true, .. } => IoFlags::NO_HOLE,
            _ => IoFlags::NONE,
        }
    }
}

/// What [`pattern`] takes as a seed or a length: whichever integer a test has at hand
/// (a literal is an `i32`).
pub trait Int: Copy {
    /// The value as a `u64` (a negative one wraps).
    fn u64(self) -> u64;
}

macro_rules! int {
    ($($t:ty),*) => {$(
        impl Int for $t {
            fn u64(self) -> u64 {
                self as u64
            }
        }
    )*};
}
int!(u8, u16, u32, u64, usize, i32);

/// The bytes a test writes: `len` of them, derived from `seed` (each seed its own
/// sequence, and a shorter call the start of a longer one), none zero, so that a read of
/// zeros, or of another write's bytes, never passes for this one.
pub fn pattern(seed: impl Int, len: impl Int) -> Vec<u8> {
    // splitmix64 spreads neighbouring seeds apart; xorshift64 makes the bytes.
    let mut z = seed.u64().wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    let mut state = (z ^ (z >> 31)) | 1;
    (0..len.u64())
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8 | 1
        })
        .collect()
}

/// Reads the whole device and compares it with the model.
pub fn check_all(q: &BlockingQueue, model: &[u8]) -> Result<(), TestCaseError> {
    let mut buf = vec![0xa5u8; model.len()];
    q.read(0, &mut buf)
        .map_err(|e| TestCaseError::fail(format!("full read: {e}")))?;
    if let Some(at) = buf.iter().zip(model).position(|(a, b)| a != b) {
        return Err(TestCaseError::fail(format!(
            "byte {at} is {:#04x}, the model says {:#04x}",
            buf[at], model[at]
        )));
    }
    Ok(())
}

/// The executable `name` on PATH (or in the sbin directories, which a non-root PATH may
/// lack).
pub fn tool(name: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from));
    dirs.into_iter().map(|d| d.join(name)).find(|p| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// Every tool's path, or `None` after recording a skip for `test`.
pub fn tools<const N: usize>(test: &str, names: [&str; N]) -> Option<[PathBuf; N]> {
    let mut found = Vec::with_capacity(N);
    for name in names {
        match tool(name) {
            Some(p) => found.push(p),
            None => {
                skip(test, &format!("{name} is not installed"));
                return None;
            }
        }
    }
    found.try_into().ok()
}

/// Runs `cmd`, which must succeed, and returns its output.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
