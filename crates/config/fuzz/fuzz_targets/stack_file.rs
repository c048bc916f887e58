//! Fuzzes stack files through `cairn check`'s code path: parse, then open every
//! top-level device (file devices confined to a scratch directory) and print the trees.
//!
//! The first byte picks the input's form: even, the rest is the stack file's text (when
//! it is UTF-8, as `cairn` requires); odd, the rest seeds the structured generator that
//! the property test uses, so the fuzzer also explores files that get past the TOML
//! parser. The driver (`tests/stackfile/mod.rs`, shared with `tests/stack_fuzz.rs`)
//! panics on a broken rule: a refusal that is not one line, or that names nothing.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/stackfile/mod.rs"]
mod stackfile;

/// One scratch directory for the whole run; each input's files are removed after it.
fn scratch() -> &'static std::path::Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a scratch directory"))
        .path()
}

fuzz_target!(|data: &[u8]| {
    let Some((&form, rest)) = data.split_first() else {
        return;
    };
    let text = if form % 2 == 0 {
        match std::str::from_utf8(rest) {
            Ok(t) => t.to_string(),
            Err(_) => return,
        }
    } else {
        let mut seed = [0u8; 8];
        for (i, b) in rest.iter().enumerate() {
            seed[i % 8] ^= b;
        }
        stackfile::generate(u64::from_le_bytes(seed))
    };
    let dir = scratch();
    stackfile::drive(&text, dir);
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let _ = std::fs::remove_file(e.path());
        }
    }
});
