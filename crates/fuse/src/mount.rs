//! Mounting and unmounting the export's file, and cleaning up after a previous run.
//!
//! The export is a FUSE file system whose root is a regular file (`rootmode=0100000`), mounted
//! over a regular file, the way qemu-storage-daemon's FUSE export does it: the path then
//! behaves as a file of the device's size for `losetup`, `mkfs`, `qemu-img` and `dd`.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use cairn_core::Error;
use rustix::io::Errno;
use rustix::mount::{MountFlags, UnmountFlags};

/// The file system type (`fuse.cairn` in `/proc/mounts`).
pub const FS_TYPE: &str = "fuse.cairn";

/// Owner and permissions the export's file shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    /// Permission bits (no file type).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
}

/// A mounted export: the `/dev/fuse` session and the mount point.
pub struct Mount {
    /// The session's `/dev/fuse` descriptor.
    pub fd: OwnedFd,
    /// The absolute mount point.
    pub path: PathBuf,
    /// Whether cairn created the (empty) file it mounted over.
    pub created: bool,
    /// The owner and mode shown (those of the file mounted over).
    pub owner: Owner,
    mounted: bool,
}

/// How an unmount went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unmounted {
    /// Unmounted.
    Clean,
    /// The file was still in use (a loop device, an open file): detached from the tree;
    /// its users get errors once cairn exits.
    Detached,
}

/// Where `path` is mounted, if it is a mount point: the file system type.
fn mounted_type(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut found = None;
    for line in text.lines() {
        // ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(dash) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if fields.len() < 5 || dash + 1 >= fields.len() {
            continue;
        }
        if Path::new(&unescape(fields[4])) == path {
            // The last entry for a path is the one on top.
            found = Some(fields[dash + 1].to_string());
        }
    }
    found
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(field: &str) -> std::ffi::OsString {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    std::ffi::OsString::from(std::ffi::OsStr::from_bytes(&out))
}

/// This process's effective user and group ids.
fn effective_ids() -> (u32, u32) {
    (
        rustix::process::geteuid().as_raw(),
        rustix::process::getegid().as_raw(),
    )
}

fn c_path(path: &Path) -> Result<CString, Error> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::Invalid(format!("{}: a path with a NUL byte", path.display())))
}

/// Makes `path` ready to be mounted on: a stale cairn mount of a process that died is
/// detached, a missing file is created (empty, mode 0600). Returns the absolute path,
/// whether the file was created, and the owner and mode to show.
fn prepare(path: &Path) -> Result<(PathBuf, bool, Owner), Error> {
    let path = std::path::absolute(path)
        .map_err(|e| Error::os(format!("fuse {}: absolute path", path.display()), e))?;
    let shown = path.display().to_string();
    if let Some(kind) = mounted_type(&path) {
        if kind != FS_TYPE {
            return Err(Error::Invalid(format!(
                "fuse {shown}: already a mount point ({kind}); cairn mounts its export over a plain file"
            )));
        }
        match std::fs::metadata(&path) {
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOTCONN) | Some(libc::ECONNABORTED)
                ) =>
            {
                let c = c_path(&path)?;
                rustix::mount::unmount(c.as_c_str(), UnmountFlags::DETACH).map_err(|e| {
                    Error::os(
                        format!("fuse {shown}: detach the stale mount of a previous run"),
                        e.into(),
                    )
                })?;
                log::warn!(
                    "cairn: fuse {shown}: detached the stale mount of a previous cairn that is no longer running"
                );
            }
            _ => {
                return Err(Error::Invalid(format!(
                    "fuse {shown}: already mounted by a cairn that still runs; stop it first"
                )))
            }
        }
    }
    match std::fs::symlink_metadata(&path) {
        Ok(m) if m.file_type().is_file() => Ok((
            path,
            false,
            Owner {
                mode: m.mode() & 0o7777,
                uid: m.uid(),
                gid: m.gid(),
            },
        )),
        Ok(m) => {
            Err(Error::Invalid(format!(
            "fuse {shown}: is a {}; the export is mounted over a regular file (created if missing)",
            if m.is_dir() { "directory" } else { "special file or symlink" }
        )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(|e| Error::os(format!("fuse {shown}: create the mount point"), e))?;
            let (uid, gid) = effective_ids();
            Ok((
                path,
                true,
                Owner {
                    mode: 0o600,
                    uid,
                    gid,
                },
            ))
        }
        Err(e) => Err(Error::os(format!("fuse {shown}"), e)),
    }
}

impl Mount {
    /// Mounts a new FUSE session over `path` (see [`prepare`]'s rules for what is there).
    pub fn new(path: &Path, source: &str, read_only: bool) -> Result<Mount, Error> {
        let (path, created, owner) = prepare(path)?;
        let shown = path.display().to_string();
        let undo = |e: Error| {
            if created {
                let _ = std::fs::remove_file(&path);
            }
            e
        };
        let dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/fuse")
            .map_err(|e| undo(Error::os(format!("fuse {shown}: open /dev/fuse"), e)))?;
        let fd = OwnedFd::from(dev);
        let (uid, gid) = effective_ids();
        let options = format!(
            "fd={},rootmode=100000,user_id={uid},group_id={gid},allow_other,default_permissions",
            fd.as_raw_fd()
        );
        let mut flags = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOATIME;
        if read_only {
            flags |= MountFlags::RDONLY;
        }
        let c = c_path(&path).map_err(undo)?;
        let (src, ty, opts) = (
            CString::new(source.replace('\0', "")).unwrap_or_default(),
            CString::new(FS_TYPE).unwrap_or_default(),
            CString::new(options).unwrap_or_default(),
        );
        let mounted = rustix::mount::mount(
            src.as_c_str(),
            c.as_c_str(),
            ty.as_c_str(),
            flags,
            Some(opts.as_c_str()),
        );
        if let Err(errno) = mounted {
            let hint = if errno == Errno::PERM {
                " (mounting FUSE needs root or CAP_SYS_ADMIN)"
            } else {
                ""
            };
            let e = std::io::Error::from(errno);
            return Err(undo(Error::Invalid(format!(
                "fuse {shown}: mount: {e}{hint}"
            ))));
        }
        Ok(Mount {
            fd,
            path,
            created,
            owner,
            mounted: true,
        })
    }

    /// Unmounts: cleanly if nothing uses the file, else detached (lazy). A file cairn
    /// created is removed again if it is still empty.
    pub fn unmount(&mut self) -> Result<Unmounted, Error> {
        if !self.mounted {
            return Ok(Unmounted::Clean);
        }
        let c = c_path(&self.path)?;
        let how = match rustix::mount::unmount(c.as_c_str(), UnmountFlags::empty()) {
            Ok(()) => Unmounted::Clean,
            Err(Errno::BUSY) => {
                rustix::mount::unmount(c.as_c_str(), UnmountFlags::DETACH).map_err(|e| {
                    Error::os(format!("fuse {}: detach", self.path.display()), e.into())
                })?;
                Unmounted::Detached
            }
            Err(e) => {
                return Err(Error::os(
                    format!("fuse {}: unmount", self.path.display()),
                    e.into(),
                ))
            }
        };
        self.mounted = false;
        if self.created && how == Unmounted::Clean {
            if let Ok(m) = std::fs::metadata(&self.path) {
                if m.is_file() && m.len() == 0 {
                    let _ = std::fs::remove_file(&self.path);
                }
            }
        }
        Ok(how)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.mounted {
            if let Err(e) = self.unmount() {
                log::warn!("cairn: {e}");
            }
        }
    }
}

/// Opens a clone of the session `fd` (`FUSE_DEV_IOC_CLONE`): requests read from it are
/// answered on it, so each reactor has its own.
pub fn clone_session(fd: &OwnedFd) -> Result<OwnedFd, Error> {
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open("/dev/fuse")
        .map_err(|e| Error::os("fuse: open /dev/fuse for a clone", e))?;
    let clone = OwnedFd::from(dev);
    let mut session = fd.as_raw_fd() as u32;
    // _IOR(229, 0, uint32_t)
    const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;
    // SAFETY: the ioctl reads one u32 (the session's descriptor) through the pointer,
    // which points at `session`; `clone` keeps its descriptor open across the call.
    // (rustix has no wrapper for this ioctl.)
    if unsafe { libc::ioctl(clone.as_raw_fd(), FUSE_DEV_IOC_CLONE, &mut session) } != 0 {
        return Err(Error::last_os(
            "fuse: clone the session (FUSE_DEV_IOC_CLONE)",
        ));
    }
    Ok(clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(
            unescape(r"/mnt/a\040b"),
            std::ffi::OsString::from("/mnt/a b")
        );
        assert_eq!(unescape(r"/x\134y"), std::ffi::OsString::from(r"/x\y"));
        assert_eq!(unescape(r"/tail\04"), std::ffi::OsString::from(r"/tail\04"));
    }

    #[test]
    fn a_directory_is_refused_and_a_missing_file_created() {
        let dir = std::env::temp_dir().join(format!("cairn-fuse-prep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = prepare(&dir).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let f = dir.join("disk");
        let (p, created, owner) = prepare(&f).unwrap();
        assert!(created && p.is_file() && owner.mode == 0o600);
        let (_, created, _) = prepare(&f).unwrap();
        assert!(!created);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
