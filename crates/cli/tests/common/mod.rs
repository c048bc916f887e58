//! Helpers shared by the integration tests of the `cairn` binary.

#![allow(dead_code)] // each test binary uses some of them

use tempfile::TempDir;

pub use cairn_core::testing::skip;
#[allow(unused_imports)] // each test binary uses some of them
pub use cairn_testkit::{tool, tools};

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
