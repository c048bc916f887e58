//! Helpers shared by the integration tests of the `cairn` binary.

#![allow(dead_code)] // each test binary uses some of them

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use tempfile::TempDir;

pub use cairn_core::testing::skip;

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

/// Bytes as text, lossily.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A fresh temporary directory, in /dev/shm when possible (the root disk is slow).
pub fn tmpdir() -> TempDir {
    tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("create a temporary directory")
}
