//! Array superblocks against damage: each slot of each member flipped, zeroed and put
//! back from an older copy, and each member cut short, after a clean stop and after a
//! crash (the superblocks left unclean), for a mirror and a raid10. The outcome is
//! always one of: the array opens and reads exactly what was written (degraded if it
//! must be: a member it cannot trust is not read), or it is refused in one line naming
//! the member, with nothing written to any member. Never a stale or foreign copy read.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cairn_config::StackFile;
use cairn_core::blocking::BlockingQueue;
use cairn_core::ondisk::Picked;
use cairn_core::{Device, IoFlags, Switches};
use cairn_stacks::array::superblock::{pick, SLOT_BYTES};
use cairn_testkit::pattern;

const MEMBER_BYTES: usize = 8 << 20;

fn open(text: &str, name: &str) -> Result<Arc<dyn Device>, String> {
    StackFile::parse(text)
        .map_err(|e| e.to_string())?
        .open(name)
        .map_err(|e| e.to_string())
}

fn queue(d: &Arc<dyn Device>) -> BlockingQueue {
    BlockingQueue::open(d, Switches::default()).expect("a queue")
}

fn read_all(d: &Arc<dyn Device>) -> Vec<u8> {
    let q = queue(d);
    let mut out = vec![0u8; d.geometry().size_bytes as usize];
    for (i, chunk) in out.chunks_mut(64 << 10).enumerate() {
        q.read((i * (64 << 10)) as u64, chunk).expect("read");
    }
    out
}

/// The stack file: members named m0.. as files, created with `size` when `create`.
fn stack(paths: &[PathBuf], level: &str, create: bool) -> String {
    let mut t = String::new();
    let mut names = Vec::new();
    for (i, p) in paths.iter().enumerate() {
        t += &format!(
            "[device.m{i}]\ntype = \"file\"\npath = \"{}\"\n",
            p.display()
        );
        if create {
            t += &format!("size = \"{MEMBER_BYTES}\"\n");
        }
        names.push(format!("\"m{i}\""));
    }
    t += &format!(
        "[device.a]\ntype = \"{level}\"\nmembers = [{}]\nmetadata = \"1\"\n",
        names.join(", ")
    );
    if level == "raid10" {
        t += "chunk = \"64K\"\n";
    }
    t
}

/// Writes `data` from offset 0 and flushes.
fn write(a: &Arc<dyn Device>, data: &[u8]) {
    let q = queue(a);
    q.write(0, data, IoFlags::NONE).expect("write");
    q.flush().expect("flush");
}

/// Makes every member's newest superblock say the array did not stop cleanly.
fn mark_unclean(paths: &[PathBuf]) {
    for p in paths {
        let mut img = std::fs::read(p).unwrap();
        let Picked::Valid { record: mut sb, .. } = pick(&img[..2 * SLOT_BYTES]) else {
            panic!("no superblock on {}", p.display())
        };
        sb.flags = 0;
        sb.generation += 1;
        let s = sb.slot() * SLOT_BYTES;
        img[s..s + SLOT_BYTES].copy_from_slice(&sb.encode());
        std::fs::write(p, &img).unwrap();
    }
}

fn images(paths: &[PathBuf]) -> Vec<Vec<u8>> {
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

fn put(paths: &[PathBuf], imgs: &[Vec<u8>]) {
    for (p, i) in paths.iter().zip(imgs) {
        std::fs::write(p, i).unwrap();
    }
}

/// Opens the damaged array and judges the outcome; returns it in a word.
fn judge(text: &str, paths: &[PathBuf], model: &[u8], what: &str) -> &'static str {
    let before = images(paths);
    match open(text, "a") {
        Err(e) => {
            assert!(
                images(paths) == before,
                "{what}: the refused open wrote ({e})"
            );
            assert!(!e.contains('\n'), "{what}: one line: {e}");
            assert!(
                (0..paths.len()).any(|i| e.contains(&format!("'m{i}'"))),
                "{what}: the refusal names no member: {e}"
            );
            "refused"
        }
        Ok(a) => {
            let got = read_all(&a);
            let same = got == model;
            let status = a.describe();
            drop(a);
            assert!(
                same,
                "{what}: read something else than was written ({status})"
            );
            "opened, same data"
        }
    }
}

fn damage_model(level: &str, members: usize, crash: bool) {
    let dir = tempfile::tempdir_in(Path::new("/dev/shm")).expect("a directory");
    let paths: Vec<PathBuf> = (0..members)
        .map(|i| dir.path().join(format!("m{i}.img")))
        .collect();
    let a = open(&stack(&paths, level, true), "a").expect("create");
    let size = a.geometry().size_bytes as usize;
    write(&a, &pattern(1, size));
    drop(a);
    let older = images(&paths);
    let text = stack(&paths, level, false);
    let a = open(&text, "a").expect("reopen");
    let mut model = pattern(1, size);
    model[..size / 2].copy_from_slice(&pattern(2, size / 2));
    write(&a, &model[..size / 2]);
    drop(a);
    if crash {
        mark_unclean(&paths);
    }
    let good = images(&paths);
    let mut tally = std::collections::BTreeMap::new();
    for m in 0..members {
        for slot in 0..2 {
            let at = slot * SLOT_BYTES;
            for how in ["flip", "zero", "roll back"] {
                put(&paths, &good);
                let mut img = good[m].clone();
                match how {
                    "flip" => img[at + SLOT_BYTES / 2 + 37] ^= 0x10,
                    "zero" => img[at..at + SLOT_BYTES].fill(0),
                    _ => img[at..at + SLOT_BYTES].copy_from_slice(&older[m][at..at + SLOT_BYTES]),
                }
                if img == good[m] {
                    continue;
                }
                std::fs::write(&paths[m], &img).unwrap();
                let what = format!("{level}, crash {crash}: {how} member {m} slot {slot}");
                *tally
                    .entry((how, judge(&text, &paths, &model, &what)))
                    .or_insert(0) += 1;
            }
        }
        // Both slots of one member put back from the older copy (a member restored
        // from an old image): stale, never read.
        put(&paths, &good);
        let mut img = good[m].clone();
        img[..2 * SLOT_BYTES].copy_from_slice(&older[m][..2 * SLOT_BYTES]);
        std::fs::write(&paths[m], &img).unwrap();
        let what = format!("{level}, crash {crash}: member {m}'s superblocks rolled back");
        *tally
            .entry(("roll back both", judge(&text, &paths, &model, &what)))
            .or_insert(0) += 1;
        // The member cut short.
        for keep in [3 * SLOT_BYTES / 2, MEMBER_BYTES / 2] {
            put(&paths, &good);
            std::fs::write(&paths[m], &good[m][..keep]).unwrap();
            let what = format!("{level}, crash {crash}: member {m} cut to {keep} bytes");
            let got = judge(&text, &paths, &model, &what);
            assert_eq!(got, "refused", "{what}");
            *tally.entry(("truncate", got)).or_insert(0) += 1;
        }
    }
    eprintln!("{level}, crash {crash}: {tally:?}");
}

#[test]
fn mirror_superblocks_damaged_after_clean_stops_and_crashes() {
    damage_model("mirror", 2, false);
    damage_model("mirror", 2, true);
}

#[test]
fn raid10_superblocks_damaged_after_clean_stops_and_crashes() {
    damage_model("raid10", 4, false);
    damage_model("raid10", 4, true);
}
