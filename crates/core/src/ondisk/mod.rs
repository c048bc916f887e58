//! Pieces every on-disk format of cairn's own shares (the array superblock, the thin
//! pool's metadata, the bitmap store): little-endian fields, identities, the lock that
//! keeps a file to one device of one cairn, and ([`record`]) the framing of a record kept
//! in two checksummed slots.

pub mod record;

pub use record::{pick, Frame, Invalid, Picked};

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::Error;

/// Writes `v` little-endian at `b[at..at + 4]`.
pub fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// Writes `v` little-endian at `b[at..at + 8]`.
pub fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Reads the little-endian `u32` at `b[at..at + 4]`.
pub fn get32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Reads the little-endian `u64` at `b[at..at + 8]`.
pub fn get64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A random (version 4) UUID from the kernel's generator.
pub fn new_uuid() -> [u8; 16] {
    let mut u = [0u8; 16];
    let n = rustix::rand::getrandom(&mut u, rustix::rand::GetRandomFlags::empty());
    if !matches!(n, Ok(16)) {
        // Not expected on Linux; fall back on the clock and the process so that two
        // arrays still differ.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        u[..16].copy_from_slice(&(t ^ (u128::from(std::process::id()) << 64)).to_le_bytes());
    }
    u[6] = (u[6] & 0x0f) | 0x40;
    u[8] = (u[8] & 0x3f) | 0x80;
    u
}

/// Takes an exclusive `flock` on `file` without waiting; when another open file holds it,
/// the error names the file and, where `/proc/locks` tells, the holder.
pub fn lock_exclusive(file: &File, path: &Path) -> Result<(), Error> {
    // A process that was killed can hold its locks a little longer than it lives: the
    // kernel closes the files of its io_uring rings after it is gone. So a lock whose
    // holder is dead (or unknown) is tried again for a while, one held by a live process
    // is refused at once.
    const DEAD_HOLDER_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
    let deadline = std::time::Instant::now() + DEAD_HOLDER_WAIT;
    let holder = loop {
        match rustix::fs::flock(file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::WOULDBLOCK) => {}
            Err(e) => {
                return Err(Error::os(
                    format!("file {}: lock", path.display()),
                    e.into(),
                ))
            }
        }
        let holder = std::fs::metadata(path)
            .ok()
            .and_then(|m| lock_holder(m.dev(), m.ino()));
        // Signal 0 sends nothing: it asks whether the process exists.
        let alive = holder
            .as_ref()
            .is_some_and(|(pid, _)| match i32::try_from(*pid) {
                // kill(0, 0) asks about our own process group, which is always there.
                Ok(0) => true,
                Ok(pid) => rustix::process::Pid::from_raw(pid)
                    .is_some_and(|pid| rustix::process::test_kill_process(pid).is_ok()),
                Err(_) => false,
            });
        if alive || std::time::Instant::now() >= deadline {
            break holder;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let holder = holder
        .map(|(pid, comm)| {
            if pid == std::process::id() {
                format!(" by this cairn (pid {pid}; another device of the stack uses it)")
            } else {
                format!(" by pid {pid} ({comm})")
            }
        })
        .unwrap_or_default();
    Err(Error::Invalid(format!(
        "file {}: in use{holder}; a file backs one device of one cairn at a time",
        path.display()
    )))
}

/// The process holding a `flock` on the file `(dev, ino)`, from `/proc/locks`:
/// `1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF`.
fn lock_holder(dev: u64, ino: u64) -> Option<(u32, String)> {
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let want = format!("{major:02x}:{minor:02x}:{ino}");
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    let pid: u32 = locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // Blocked waiters are listed with "->"; only holders count.
        (f.len() >= 6 && f[1] == "FLOCK" && f[5] == want)
            .then(|| f[4].parse().ok())
            .flatten()
    })?;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| "?".into());
    Some((pid, comm))
}
