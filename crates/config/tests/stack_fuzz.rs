//! Thousands of generated stack files, valid and broken, through `cairn check`'s code
//! path: none may panic or hang, and every refusal is one line that names a device or
//! the part of the file at fault.
//!
//! The generator and the driver live in `stackfile/mod.rs`, shared with the cargo-fuzz
//! target `fuzz/fuzz_targets/stack_file.rs`, which runs the same driver for as long as
//! one likes (see `fuzz/README.md`).

mod stackfile;

use std::sync::mpsc;
use std::time::Duration;

use proptest::prelude::*;

use stackfile::Outcome;

/// Longer than any check takes here by far: a check that has not answered by then hangs.
const HANG: Duration = Duration::from_secs(60);

/// Drives `text` on a thread of its own and fails on a panic or a hang.
fn drive_bounded(text: String) -> Outcome {
    // In memory where it can be: arrays with metadata flush their superblocks.
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("a scratch directory");
    let path = dir.path().to_path_buf();
    let (tx, rx) = mpsc::channel();
    let shown = text.clone();
    let worker = std::thread::spawn(move || {
        let outcome = stackfile::drive(&text, &path);
        let _ = tx.send(());
        outcome
    });
    match rx.recv_timeout(HANG) {
        Ok(()) => {}
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("no answer within {HANG:?}: a hang on this stack file:\n{shown}")
        }
        // The worker panicked (its sender dropped): join says why below.
        Err(mpsc::RecvTimeoutError::Disconnected) => {}
    }
    match worker.join() {
        Ok(outcome) => outcome,
        Err(_) => panic!("a panic on this stack file:\n{shown}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

    /// Generated stack files: devices of every type, good and bad values, cycles, deep
    /// chains, unicode names, files named twice, corrupted texts.
    #[test]
    fn generated_stack_files(seed in any::<u64>()) {
        let text = stackfile::generate(seed);
        drive_bounded(text);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, failure_persistence: None, ..ProptestConfig::default() })]

    /// Arbitrary text, and arbitrary text after a valid start.
    #[test]
    fn arbitrary_text(garbage in "\\PC{0,200}", seed in any::<u64>()) {
        drive_bounded(garbage.clone());
        let mut text = stackfile::generate(seed);
        text.push_str(&garbage);
        drive_bounded(text);
    }
}

/// The generator makes what it is meant to: a good share of the files pass, refusals
/// come from every stage, and deep chains reach the depth check. A generator that only
/// ever made TOML errors would test nothing.
#[test]
fn the_generator_reaches_every_check() {
    let (mut checked, mut toml, mut keys, mut graph, mut deep, mut opened) = (0, 0, 0, 0, 0, 0);
    let mut arrays = 0;
    for seed in 0..1000 {
        match drive_bounded(stackfile::generate(seed)) {
            Outcome::Checked(report) => {
                checked += 1;
                // An array with superblocks was created or assembled and opened.
                arrays += usize::from(report.contains("metadata"));
            }
            Outcome::Refused(m) if m.contains("not valid TOML") => toml += 1,
            Outcome::Refused(m) if m.contains("levels down") => deep += 1,
            Outcome::Refused(m)
                if m.contains("cycle")
                    || m.contains("used twice")
                    || m.contains("not defined")
                    || m.contains("itself") =>
            {
                graph += 1
            }
            Outcome::Refused(m) if m.contains("key '") || m.contains("name '") => keys += 1,
            Outcome::Refused(_) => opened += 1,
        }
    }
    let counts = format!(
        "checked {checked} (arrays with metadata {arrays}), TOML {toml}, keys {keys}, graph {graph}, too deep {deep}, other {opened}"
    );
    assert!(arrays >= 1, "{counts}");
    assert!(checked >= 50, "{counts}");
    assert!(toml >= 20, "{counts}");
    assert!(keys >= 100, "{counts}");
    assert!(graph >= 20, "{counts}");
    assert!(deep >= 5, "{counts}");
    eprintln!("{counts}");
    // And an array with metadata, missing member and all, goes through the driver.
    let text = "[device.a]\ntype = \"mem\"\nsize = \"4M\"\n\
                [device.b]\ntype = \"file\"\npath = \"b\"\nsize = \"4M\"\n\
                [device.m]\ntype = \"raid10\"\nmembers = [\"a\", \"missing\", \"b\"]\nmetadata = \"1\"\n";
    match drive_bounded(text.to_string()) {
        Outcome::Checked(report) => assert!(report.contains("metadata 1"), "{report}"),
        Outcome::Refused(m) => panic!("refused: {m}"),
    }
}
