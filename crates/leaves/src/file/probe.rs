//! What the kernel does with a file without blocking, found when it is opened, and the
//! engine that serves such a file fastest.
//!
//! io_uring first issues a read or write with `IOCB_NOWAIT`; where the file system cannot
//! do it without blocking it hands the request to an io-wq kernel worker, which costs two
//! context switches and a wake-up per request. tmpfs has no non-blocking reads or writes
//! at all, ext4 and block devices have no non-blocking buffered writes, and O_DIRECT on a
//! device that cannot take `REQ_NOWAIT` (a loop device) fails every attempt with EAGAIN.
//! The probe asks the same question with `preadv2`/`pwritev2(RWF_NOWAIT)` on the first
//! block (changing nothing), and [`plan`] picks from what was measured (bench/files.py,
//! BENCHMARKS.md).

use std::fmt;
use std::fs::File;

use cairn_core::AlignedBuf;
use rustix::io::{Errno, ReadWriteFlags};

use super::uring::Submit;
use crate::spec::Engine;

/// [`Probe::kind`] of a block device.
pub const BLOCK_DEVICE: &str = "block device";

/// How the file system answered a request that must not block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nowait {
    /// Done without blocking.
    Completes,
    /// Supported, but this one would have blocked (EAGAIN): a buffered read of a page not
    /// in the cache, or O_DIRECT on a device that never takes non-blocking requests.
    WouldBlock,
    /// The file system has no non-blocking path for it (EOPNOTSUPP).
    Unsupported,
    /// The probe itself failed (the answer was neither of the above).
    Unknown,
}

impl Nowait {
    fn of(result: Result<usize, Errno>) -> Nowait {
        match result {
            Ok(_) => Nowait::Completes,
            Err(Errno::AGAIN) => Nowait::WouldBlock,
            Err(Errno::OPNOTSUPP) => Nowait::Unsupported,
            Err(_) => Nowait::Unknown,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Nowait::Completes => "completes",
            Nowait::WouldBlock => "would block",
            Nowait::Unsupported => "unsupported",
            Nowait::Unknown => "not probed",
        }
    }
}

/// What the probe found about one open file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// The file system's name (`tmpfs`, `ext4`, `xfs`, ...), or `block device`.
    pub kind: String,
    /// Opened with O_DIRECT.
    pub direct: bool,
    /// A read of the first block with `RWF_NOWAIT`.
    pub read: Nowait,
    /// A write of the first block with `RWF_NOWAIT` (from a buffer the kernel may not
    /// read, so nothing is written).
    pub write: Nowait,
}

impl fmt::Display for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}, non-blocking reads {}, writes {}",
            self.kind,
            if self.direct { "O_DIRECT" } else { "buffered" },
            self.read.name(),
            self.write.name()
        )
    }
}

/// The engine for a file, and how it submits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The engine.
    pub engine: Engine,
    /// io_uring only: what is done with system calls on the reactor instead, and how the
    /// rest is submitted.
    pub submit: Submit,
    /// Why: what the probe found and what it means, or that the engine was given.
    pub why: String,
}

impl Plan {
    /// The engine as `describe` and the log show it.
    pub fn label(&self) -> String {
        let how = self.submit.describe();
        if how.is_empty() {
            self.engine.to_string()
        } else {
            format!("{} ({how})", self.engine)
        }
    }
}

/// Probes `file` (open for reading and writing, at least `block_bytes` long, its I/O
/// unit). Nothing is written: the write probe hands the kernel a buffer it may not read
/// (a `PROT_NONE` page), so a write that gets past every check that could refuse or
/// block it fails with EFAULT before a byte moves, which counts as `Completes`.
pub fn probe(file: &File, block_device: bool, direct: bool, block_bytes: u32) -> Probe {
    let kind = if block_device {
        BLOCK_DEVICE.to_string()
    } else {
        fs_name(file)
    };
    let mut buf = AlignedBuf::new(block_bytes as usize);
    let read = Nowait::of(rustix::io::preadv2(
        file,
        &mut [std::io::IoSliceMut::new(buf.as_mut_slice())],
        0,
        ReadWriteFlags::NOWAIT,
    ));
    Probe {
        kind,
        direct,
        read,
        write: probe_write(file, block_bytes as usize),
    }
}

fn probe_write(file: &File, len: usize) -> Nowait {
    use rustix::mm::{MapFlags, ProtFlags};
    // SAFETY: a fresh anonymous mapping, touched by no one; unmapped below.
    let Ok(page) = (unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            len,
            ProtFlags::empty(),
            MapFlags::PRIVATE,
        )
    }) else {
        return Nowait::Unknown;
    };
    // SAFETY: iov describes the mapping; the kernel reads it (and faults), nothing else.
    let iov = libc::iovec {
        iov_base: page,
        iov_len: len,
    };
    // SAFETY: as above; the descriptor is open for as long as `file` lives.
    let rc = unsafe {
        libc::pwritev2(
            std::os::fd::AsRawFd::as_raw_fd(file),
            &iov,
            1,
            0,
            libc::RWF_NOWAIT,
        )
    };
    let errno = std::io::Error::last_os_error().raw_os_error();
    // SAFETY: mapped above with this length, not used after.
    let _ = unsafe { rustix::mm::munmap(page, len) };
    match errno {
        _ if rc >= 0 => Nowait::Completes, // not expected: nothing was readable
        Some(libc::EFAULT) => Nowait::Completes,
        Some(libc::EAGAIN) => Nowait::WouldBlock,
        Some(libc::EOPNOTSUPP) => Nowait::Unsupported,
        _ => Nowait::Unknown,
    }
}

/// Requests up to this size are system calls on the reactor where io_uring would hand
/// them to a kernel worker; larger ones still go to the worker, which copies the data in
/// parallel with the reactor (bench/files.py: 1 MiB writes on tmpfs 1.2x to 1.5x faster
/// there, 4 KiB writes 1.4x slower).
pub const INLINE_MAX_BYTES: u64 = 64 << 10;

/// The engine and submission that served files like `probe`'s fastest (bench/files.py,
/// BENCHMARKS.md "Serving a file"); given an engine, that one as it is.
pub fn plan(probe: &Probe, given: Option<Engine>) -> Plan {
    if let Some(engine) = given {
        return Plan {
            engine,
            submit: Submit::default(),
            why: format!("engine={engine} given ({probe})"),
        };
    }
    let inline = |reads: bool| Submit {
        inline_reads: if reads { INLINE_MAX_BYTES } else { 0 },
        inline_writes: INLINE_MAX_BYTES,
    };
    let in_memory = matches!(probe.kind.as_str(), "tmpfs" | "ramfs");
    // A buffered write there lands in the page cache; none of these waits on a server.
    let on_local_disk = matches!(probe.kind.as_str(), "ext4" | "xfs" | "btrfs" | "f2fs");
    let (submit, reason) = if probe.read == Nowait::Unsupported && in_memory {
        (
            inline(true),
            "io_uring would hand every request to a kernel worker, so requests up to 64 KiB \
             are system calls on the reactor and larger ones go to the workers",
        )
    } else if probe.write == Nowait::Unsupported
        && !probe.direct
        && (probe.kind == BLOCK_DEVICE || on_local_disk)
    {
        (
            inline(false),
            "io_uring would hand every buffered write to a kernel worker, so writes up to \
             64 KiB are system calls on the reactor",
        )
    } else {
        (
            Submit::default(),
            "io_uring completes what does not block at once and hands the rest to its workers",
        )
    };
    Plan {
        engine: Engine::IoUring,
        submit,
        why: format!("{probe}: {reason}"),
    }
}

/// The file system's name from `fstatfs`'s magic number.
fn fs_name(file: &File) -> String {
    let Ok(st) = rustix::fs::fstatfs(file) else {
        return "unknown file system".into();
    };
    // From <linux/magic.h>.
    #[allow(clippy::unreadable_literal)]
    let name = match st.f_type as u64 {
        0x01021994 => "tmpfs",
        0x858458f6 => "ramfs",
        0xEF53 => "ext4",
        0x58465342 => "xfs",
        0x9123683E => "btrfs",
        0x2FC12FC1 => "zfs",
        0x6969 => "nfs",
        0xFF534D42 => "cifs",
        0x65735546 => "fuse",
        0xF2F52010 => "f2fs",
        0x794c7630 => "overlayfs",
        0x00c36400 => "ceph",
        other => return format!("file system 0x{other:x}"),
    };
    name.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(read: Nowait, write: Nowait, direct: bool) -> Probe {
        Probe {
            kind: "test".into(),
            direct,
            read,
            write,
        }
    }

    #[test]
    fn a_given_engine_wins() {
        for engine in [Engine::IoUring, Engine::Aio, Engine::Sync] {
            let p = plan(
                &probe(Nowait::Completes, Nowait::Completes, false),
                Some(engine),
            );
            assert_eq!(p.engine, engine);
            assert_eq!(p.submit, Submit::default());
            assert!(p.why.contains("given"), "{}", p.why);
        }
    }

    #[test]
    fn the_plan_follows_the_probe() {
        use Nowait::*;
        let probe = |kind: &str, read, write, direct| Probe {
            kind: kind.into(),
            direct,
            read,
            write,
        };
        let none = (0, 0);
        let all = (INLINE_MAX_BYTES, INLINE_MAX_BYTES);
        let writes = (0, INLINE_MAX_BYTES);
        let cases = [
            // tmpfs, buffered and O_DIRECT: small requests inline.
            (probe("tmpfs", Unsupported, Unsupported, false), all),
            (probe("tmpfs", Unsupported, Unsupported, true), all),
            (probe("ramfs", Unsupported, Unsupported, false), all),
            // Not in memory: a request on the reactor could wait for a disk or a network.
            (probe("nfs", Unsupported, Unsupported, false), none),
            (probe("fuse", Unsupported, Unsupported, false), none),
            // A block device's buffered writes: inline.
            (probe(BLOCK_DEVICE, WouldBlock, Unsupported, false), writes),
            (probe(BLOCK_DEVICE, Completes, Completes, true), none),
            // ext4 buffered (no non-blocking writes): writes inline, reads through io_uring.
            (probe("ext4", Completes, Unsupported, false), writes),
            (probe("btrfs", WouldBlock, Unsupported, false), writes),
            // A file system not known to be local keeps its writes off the reactor.
            (
                probe("file system 0x1234", Completes, Unsupported, false),
                none,
            ),
            // xfs buffered, anything O_DIRECT.
            (probe("xfs", Completes, WouldBlock, false), none),
            (probe("xfs", WouldBlock, WouldBlock, true), none),
            (probe("ext4", WouldBlock, WouldBlock, true), none),
            (probe("nfs", Completes, Unknown, false), none),
        ];
        for (p, (reads, writes)) in cases {
            let plan = plan(&p, None);
            assert_eq!(plan.engine, Engine::IoUring, "{p}");
            assert_eq!(
                (plan.submit.inline_reads, plan.submit.inline_writes),
                (reads, writes),
                "{p}"
            );
            assert!(plan.why.starts_with(&p.to_string()), "{}", plan.why);
        }
    }
}
