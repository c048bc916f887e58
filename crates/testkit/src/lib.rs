//! What cairn's tests share: one operation of a random sequence, the bytes a write
//! carries, a full read-back against the model, tools found on `PATH`, ([`ceph`]) a
//! Ceph cluster for the RBD tests, and ([`probe`]) a device for the tests of wrappers.

#![forbid(unsafe_code)]

pub mod ceph;
pub mod probe;

use std::path::{Path, PathBuf};
use std::process::Command;

use cairn_core::blocking::BlockingQueue;
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

/// Bytes a write carries: derived from its seed, never all zeros.
pub fn data(seed: u64, len: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
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

/// Another project's tool (cryptsetup, qemu-img) where Debian installs it.
pub fn tool(name: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
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
