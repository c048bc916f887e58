//! `cairn backup SOURCE DEST [--since NAME]`: the client side of a backup (the server
//! side, checkpoints and their exports, is `backup`). It copies an NBD export into a raw
//! file: in full, reading only what `base:allocation` does not report as zeroes into a
//! new sparse file, or only the extents the dirty bitmap NAME reports changed, into an
//! earlier backup of the same export. The reads are cairn_nbd's `client::pull` (many in
//! flight on one connection); this module checks DEST, writes each reply at its offset
//! with pwrite, syncs DEST and prints the summary. It is not a restore tool and keeps no
//! format of its own: DEST is the export's bytes.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use cairn_core::size::{format_bytes, plural};
use cairn_nbd::client::pull::{Pulled, Select, Sink, Source};

use crate::settings::BackupSettings;

/// Zeroes written where a hole cannot be punched.
static ZEROES: [u8; 64 << 10] = [0; 64 << 10];

/// Runs a backup: `Err` for a refusal before DEST changed (exit status 2), exit status 1
/// when the copy failed part way.
pub(crate) fn run(s: &BackupSettings) -> Result<ExitCode, String> {
    let started = Instant::now();
    let select = match &s.since {
        Some(name) => Select::Dirty(name.clone()),
        None => Select::Allocated,
    };
    let mut source = Source::open(&s.source, select, s.pull.timeout)
        .map_err(|e| format!("backup: {}: {e}", s.source_text))?;
    let connected = started.elapsed();
    let size = source.negotiated().size;
    if s.since.is_none() && !source.has_status() {
        log::warn!(
            "cairn: backup: {} has no base:allocation: every byte is read",
            s.source_text
        );
    }
    let file = open_dest(&s.dest, size, s.since.is_some())?;
    let mut sink = FileSink {
        file: &file,
        fresh: s.since.is_none(),
    };
    let pulled = match source.pull(s.pull, &mut sink) {
        Ok(p) => p,
        Err(e) => {
            eprintln!(
                "cairn: backup: {}: {e}; {} is incomplete{}",
                s.source_text,
                s.dest.display(),
                if s.since.is_some() {
                    " (the same backup run again completes it)"
                } else {
                    ""
                }
            );
            return Ok(ExitCode::from(1));
        }
    };
    let pulled_at = started.elapsed();
    if let Err(e) = file.sync_all() {
        eprintln!("cairn: backup: cannot sync {}: {e}", s.dest.display());
        return Ok(ExitCode::from(1));
    }
    let times = Times {
        connect: connected.as_secs_f64(),
        pull: (pulled_at - connected).as_secs_f64(),
        seconds: started.elapsed().as_secs_f64(),
    };
    crate::out(&summary(s, size, &pulled, &times));
    Ok(ExitCode::SUCCESS)
}

/// Opens DEST: for a full backup made or truncated to `size` (nothing but a regular
/// file is truncated); for an incremental one, an existing regular file of exactly
/// `size` bytes, left as it is.
fn open_dest(dest: &Path, size: u64, incremental: bool) -> Result<File, String> {
    let shown = dest.display();
    let meta = match std::fs::metadata(dest) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !incremental => None,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!(
                "backup: {shown} does not exist: --since updates an earlier backup of the export (make a full one first, without --since)"
            ))
        }
        Err(e) => return Err(format!("backup: {shown}: {e}")),
    };
    if let Some(m) = &meta {
        if !m.is_file() {
            return Err(format!("backup: {shown} is not a regular file"));
        }
        if incremental && m.len() != size {
            return Err(format!(
                "backup: {shown} is {} bytes and the export {size}: not a backup of this export",
                m.len()
            ));
        }
    }
    let file = OpenOptions::new()
        .write(true)
        .create(!incremental)
        .truncate(!incremental)
        .open(dest)
        .map_err(|e| format!("backup: cannot open {shown}: {e}"))?;
    if !incremental {
        file.set_len(size)
            .map_err(|e| format!("backup: cannot size {shown} to {size} bytes: {e}"))?;
    }
    Ok(file)
}

/// Where a backup's time went, in seconds from its start.
struct Times {
    /// Connected and negotiated.
    connect: f64,
    /// The reads, from then on (DEST opened first).
    pull: f64,
    /// Everything, DEST synced.
    seconds: f64,
}

/// The summary: one line, or one JSON object.
fn summary(s: &BackupSettings, size: u64, p: &Pulled, t: &Times) -> String {
    let seconds = t.seconds;
    if s.json {
        let j = serde_json::json!({
            "source": s.source_text,
            "dest": s.dest.display().to_string(),
            "since": s.since,
            "export_bytes": size,
            "bytes_read": p.bytes_read,
            "extents": p.extents,
            "reads": p.reads,
            "status_requests": p.status_requests,
            "seconds": seconds,
            "connect_seconds": t.connect,
            "pull_seconds": t.pull,
        });
        return format!("{j}\n");
    }
    let what = match &s.since {
        Some(name) => format!("changes since {name}"),
        None => "full copy".to_string(),
    };
    let share = if size == 0 {
        0.0
    } else {
        100.0 * p.bytes_read as f64 / size as f64
    };
    format!(
        "backup: {what} of {} into {}: {} read ({share:.2}% of {}) in {}, {}, {}, {seconds:.3} s\n",
        s.source_text,
        s.dest.display(),
        format_bytes(p.bytes_read),
        format_bytes(size),
        plural(p.extents, "extent", "extents"),
        plural(p.reads, "read", "reads"),
        plural(
            p.status_requests,
            "block status request",
            "block status requests"
        ),
    )
}

/// DEST as the pull's sink: data written where it was read, zeroes punched as a hole
/// (or written, where the file system cannot punch one); a fresh DEST is all holes
/// already.
struct FileSink<'f> {
    file: &'f File,
    fresh: bool,
}

impl Sink for FileSink<'_> {
    fn data(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.file.write_all_at(data, offset)
    }

    fn zeroes(&mut self, offset: u64, len: u64) -> std::io::Result<()> {
        if self.fresh {
            return Ok(());
        }
        use rustix::fs::{fallocate, FallocateFlags};
        let punch = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        match fallocate(self.file, punch, offset, len) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::OPNOTSUPP) => {}
            Err(e) => return Err(e.into()),
        }
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let n = (end - at).min(ZEROES.len() as u64) as usize;
            self.file.write_all_at(&ZEROES[..n], at)?;
            at += n as u64;
        }
        Ok(())
    }
}
