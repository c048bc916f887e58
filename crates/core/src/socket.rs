//! Unix socket files: one rule for every socket cairn listens on at a path (the admin
//! socket, NBD's `unix:` addresses, the metrics endpoint's `unix:` form).
//!
//! A path is taken over only from a process that is gone. A socket that nobody listens on
//! (connecting is refused: what `kill -9` leaves behind) is replaced; a socket a process
//! listens on is refused, so that a second cairn never steals a running one's address;
//! anything else at the path (a regular file, a directory, a symbolic link, ...) is
//! refused for what it is. A refusal removes nothing. At exit a listener removes its file
//! only if the path still holds the very socket it bound, not one another process put
//! there since.
//!
//! Not for sockets passed by a service manager (`LISTEN_FDS`): they are bound already.

use std::io::ErrorKind;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use crate::error::Error;

/// Binds a listening Unix socket at `path` by the rule above. `label` starts every error
/// line and names the flag and path (`--admin /run/cairn/admin.sock`).
pub fn bind(path: &Path, label: &str) -> Result<(UnixListener, SocketFile), Error> {
    match probe(path).map_err(|e| Error::os(label, e))? {
        Found::Nothing => {}
        Found::Stale(probed) => {
            // Only the socket that was probed goes: the path must still hold it.
            let same = std::fs::symlink_metadata(path).is_ok_and(|m| is_it(&m, probed));
            if same {
                match std::fs::remove_file(path) {
                    Ok(()) => log::info!(
                        "cairn: {label}: replacing a stale socket (nobody listened on it)"
                    ),
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => {
                        return Err(Error::os(format!("{label}: remove the stale socket"), e))
                    }
                }
            }
        }
        Found::Live => {
            return Err(Error::Invalid(format!(
                "{label}: another process is listening there (a running cairn?)"
            )))
        }
        Found::Unprobed(e) => {
            return Err(Error::Invalid(format!(
                "{label}: a socket is there that cannot be probed ({e}); it is left as it is"
            )))
        }
        Found::Other(what) => {
            return Err(Error::Invalid(format!(
            "{label}: {what} is there, not a socket (only a socket nobody listens on is replaced)"
        )))
        }
    }
    let listener = UnixListener::bind(path).map_err(|e| {
        if e.kind() == ErrorKind::AddrInUse {
            Error::Invalid(format!(
                "{label}: another process took the path while it was being bound"
            ))
        } else {
            Error::os(format!("{label}: bind"), e)
        }
    })?;
    let meta =
        std::fs::symlink_metadata(path).map_err(|e| Error::os(format!("{label}: stat"), e))?;
    let file = SocketFile(Identity {
        path: path.to_path_buf(),
        stamp: stamp(&meta),
    });
    Ok((listener, file))
}

/// The file of a socket [`bind`] made, removed when this is dropped: only while the path
/// still holds that socket (by device, inode and change time), so a listener closing late never takes
/// away the socket of a server started after it.
#[derive(Debug)]
pub struct SocketFile(Identity);

impl SocketFile {
    /// The path bound.
    pub fn path(&self) -> &Path {
        &self.0.path
    }

    /// Sets the file's permission bits (`chmod`); it stays recognised as this socket's.
    pub fn set_mode(&mut self, mode: u32) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&self.0.path, std::fs::Permissions::from_mode(mode))?;
        self.0.stamp = stamp(&std::fs::symlink_metadata(&self.0.path)?);
        Ok(())
    }

    /// What removes the file as dropping this would, for an exit that skips drops (a
    /// shutdown abandoned by `std::process::exit`).
    pub fn remover(&self) -> Remover {
        Remover(self.0.clone())
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        self.0.remove();
    }
}

/// Removes a [`SocketFile`] (see [`SocketFile::remover`]).
#[derive(Debug, Clone)]
pub struct Remover(Identity);

impl Remover {
    /// Removes the socket file if the path still holds it; idempotent.
    pub fn remove(&self) {
        self.0.remove();
    }
}

/// A socket file by path and [`Stamp`].
#[derive(Debug, Clone)]
struct Identity {
    path: PathBuf,
    stamp: Stamp,
}

impl Identity {
    /// Removes the path if it still holds this socket; idempotent.
    fn remove(&self) {
        let ours = std::fs::symlink_metadata(&self.path).is_ok_and(|m| is_it(&m, self.stamp));
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Tells one socket file from another at the same path: device, inode and change time
/// (in nanoseconds). The inode alone is not enough: a file system gives a freed inode
/// number to the next file, so a stale socket replaced in the same directory often gets
/// its predecessor's. A socket whose change time moves (`chmod` by someone else) is no
/// longer taken for ours and stays at exit, which costs nothing: a stale socket is
/// replaced at the next start.
type Stamp = (u64, u64, i64, i64);

fn stamp(m: &std::fs::Metadata) -> Stamp {
    (m.dev(), m.ino(), m.ctime(), m.ctime_nsec())
}

/// Whether `m` is the socket stamped `s`.
fn is_it(m: &std::fs::Metadata, s: Stamp) -> bool {
    m.file_type().is_socket() && stamp(m) == s
}

/// What is at a path a socket is to be bound at.
#[derive(Debug)]
enum Found {
    /// Nothing: the path is free.
    Nothing,
    /// A socket nobody listens on (connecting is refused): left by a process that is
    /// gone. Its stamp, to remove that socket and no other.
    Stale(Stamp),
    /// A socket a process listens on (connecting succeeds, or its backlog is full).
    Live,
    /// A socket whose probe failed otherwise (no permission to connect, a datagram
    /// socket): it may be in use, so it stays.
    Unprobed(std::io::Error),
    /// Not a socket: what it is, with its article ("a directory").
    Other(&'static str),
}

/// Looks at `path` without changing it: `lstat`, and for a socket a non-blocking connect,
/// which never waits for a listener that does not accept.
fn probe(path: &Path) -> std::io::Result<Found> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Found::Nothing),
        Err(e) => return Err(e),
    };
    let t = meta.file_type();
    if !t.is_socket() {
        return Ok(Found::Other(if t.is_file() {
            "a regular file"
        } else if t.is_dir() {
            "a directory"
        } else if t.is_symlink() {
            "a symbolic link"
        } else if t.is_fifo() {
            "a FIFO"
        } else if t.is_char_device() {
            "a character device"
        } else if t.is_block_device() {
            "a block device"
        } else {
            "something"
        }));
    }
    Ok(match connect_nonblocking(path) {
        Ok(_) => Found::Live,
        // The backlog is full: someone listens, and is busy.
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Found::Live,
        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => Found::Stale(stamp(&meta)),
        // Gone since the lstat: free.
        Err(e) if e.kind() == ErrorKind::NotFound => Found::Nothing,
        Err(e) => Found::Unprobed(e),
    })
}

/// Connects a non-blocking stream socket to `path`: `Ok` if a process listens there. A
/// Unix stream connect completes or fails at once (never `EINPROGRESS`); a listener
/// whose backlog is full gives `EAGAIN`.
fn connect_nonblocking(path: &Path) -> std::io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let bytes = path.as_os_str().as_bytes();
    // The room in a `sockaddr_un`'s `sun_path`; one byte is kept for the terminating NUL.
    const SUN_PATH: usize = std::mem::size_of::<libc::sockaddr_un>()
        - std::mem::offset_of!(libc::sockaddr_un, sun_path);
    if bytes.is_empty() || bytes.len() >= SUN_PATH {
        return Err(std::io::Error::new(
            ErrorKind::InvalidInput,
            "the path is empty or too long for a Unix socket",
        ));
    }
    let addr = SocketAddrUnix::new(path)?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::connect(&fd, &addr)?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(r: Result<(UnixListener, SocketFile), Error>) -> String {
        match r {
            Ok(_) => panic!("bound where it should have been refused"),
            Err(e) => e.to_string(),
        }
    }

    /// A socket left by a listener that is gone (closed without removing its file).
    fn stale(path: &Path) {
        drop(UnixListener::bind(path).expect("bind"));
        assert!(path.exists(), "the closed listener's file stays");
    }

    #[test]
    fn a_missing_path_is_bound_and_removed_at_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let (listener, file) = bind(&path, "--admin s").expect("bind a free path");
        assert!(matches!(probe(&path).unwrap(), Found::Live));
        drop(listener);
        drop(file);
        assert!(!path.exists());
    }

    #[test]
    fn a_stale_socket_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        stale(&path);
        assert!(matches!(probe(&path).unwrap(), Found::Stale(_)));
        let (listener, _file) = bind(&path, "--admin s").expect("replace a stale socket");
        std::os::unix::net::UnixStream::connect(&path).expect("the new listener answers");
        drop(listener);
    }

    #[test]
    fn a_live_socket_is_refused_by_name_and_keeps_working() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let live = UnixListener::bind(&path).unwrap();
        let label = format!("--admin {}", path.display());
        let m = message(bind(&path, &label));
        assert_eq!(
            m,
            format!("{label}: another process is listening there (a running cairn?)")
        );
        // Still the first listener's socket: a connect reaches it.
        let _c = std::os::unix::net::UnixStream::connect(&path).expect("still listening");
        live.accept()
            .expect("the first listener gets the connection");
    }

    #[test]
    fn a_live_socket_with_a_full_backlog_is_refused_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let _live = UnixListener::bind(&path).unwrap();
        // Fill the backlog (nobody accepts): a blocking connect would now wait.
        let mut held = Vec::new();
        while let Ok(fd) = connect_nonblocking(&path) {
            held.push(fd);
            assert!(held.len() < 100_000, "the backlog never filled");
        }
        assert!(matches!(probe(&path).unwrap(), Found::Live));
        assert!(message(bind(&path, "x")).contains("another process is listening there"));
    }

    #[test]
    fn a_regular_file_is_refused_and_left_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        std::fs::write(&path, b"someone's data").unwrap();
        let m = message(bind(&path, "--listen unix:s"));
        assert_eq!(
            m,
            "--listen unix:s: a regular file is there, not a socket (only a socket nobody listens on is replaced)"
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"someone's data");
    }

    #[test]
    fn a_directory_is_refused_and_left_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("inside"), b"x").unwrap();
        assert!(message(bind(&path, "--metrics unix:s")).contains(": a directory is there"));
        assert!(path.join("inside").exists());
    }

    #[test]
    fn a_symlink_to_a_stale_socket_is_refused_and_both_stay() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("real.sock");
        stale(&target);
        let path = dir.path().join("s.sock");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        assert!(message(bind(&path, "x")).contains("a symbolic link is there"));
        assert!(std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_symlink());
        assert!(std::fs::symlink_metadata(&target)
            .unwrap()
            .file_type()
            .is_socket());
    }

    #[test]
    fn a_missing_directory_is_an_os_error_naming_the_label() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("none/s.sock");
        let m = message(bind(&path, "--admin x"));
        assert!(m.starts_with("--admin x: bind: "), "{m}");
    }

    #[test]
    fn removal_spares_a_socket_bound_at_the_path_since() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let (first, file) = bind(&path, "x").unwrap();
        let first_file = file.remover();
        drop(first);
        // Killed: its file stays, and another server replaces the stale socket.
        std::mem::forget(file);
        let (_second, file2) = bind(&path, "x").unwrap();
        first_file.remove();
        assert!(
            path.exists(),
            "the first listener removed its successor's socket"
        );
        drop(file2);
        assert!(!path.exists());
    }

    #[test]
    fn a_socket_whose_mode_cairn_set_is_still_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let (_listener, mut file) = bind(&path, "x").unwrap();
        // The change time moves on: a coarse clock could leave it where it was.
        std::thread::sleep(std::time::Duration::from_millis(20));
        file.set_mode(0o600).unwrap();
        drop(file);
        assert!(!path.exists());
    }
}
