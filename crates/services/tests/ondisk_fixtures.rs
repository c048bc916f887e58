//! The thin pool's superblock and the bitmap store as cairn wrote them, kept as bytes:
//! whatever the code that reads and writes them becomes, what was written before must
//! read as it did, and what it reads must write back to the same bytes.
//!
//! Made by cairn at commit 5a79663, before the record formats shared their framing:
//!
//! - `fixtures/thin-pool-superblocks.bin`: the first 16 KiB (both superblock slots) of
//!   the metadata device (4 MiB) of a pool of 64 KiB blocks on a 16 MiB data device,
//!   opened twice, each time a 1 MiB volume `v` written and flushed, then stopped
//!   cleanly.
//! - `fixtures/bitmap-store-two-bitmaps.bin`: a bitmap store of device `vm1` (64 MiB)
//!   with bitmaps `b0` (64 KiB granules) and `fine` (4 KiB), after marks at 0 (4 KiB),
//!   at 5 MiB (300,000 bytes) and over the device's last 700 bytes, then closed. The
//!   file is 520 KiB, mostly zeros: kept here are the first page of directory copy A,
//!   the first page of copy B (each copy's directory fits one page; the rest of its
//!   slot is zeros) and everything from the bit areas on; [`store_image`] puts the
//!   zeros back.

use cairn_core::DirtyMap;
use cairn_services::dirty::format::{self, Directory, Entry, AREAS, PAGE, SLOT};
use cairn_services::dirty::store::Store;
use cairn_services::thin::superblock::{PoolSuperblock, FLAG_CLEAN, FRAME, SLOT_BYTES, VERSION};

const THIN: &[u8] = include_bytes!("fixtures/thin-pool-superblocks.bin");
const STORE: &[u8] = include_bytes!("fixtures/bitmap-store-two-bitmaps.bin");

/// 16 bytes from 32 hex digits.
fn uuid(hex: &str) -> [u8; 16] {
    let mut u = [0u8; 16];
    for (i, b) in u.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex");
    }
    u
}

#[test]
fn a_thin_pool_written_before_reads_the_same_and_writes_back_byte_for_byte() {
    assert_eq!(THIN.len(), 2 * SLOT_BYTES);
    // Written by cairn with format version 2; this cairn writes version 3 (the same
    // superblock fields, and records in the log for backup checkpoints).
    let want = PoolSuperblock {
        version: 2,
        generation: 5,
        pool_uuid: uuid("959d7a233fd94ea288adf11ef1e4338f"),
        flags: FLAG_CLEAN,
        block_bytes: 64 << 10,
        data_offset: 1 << 20,
        data_blocks: 240,
        log_offset: 16 << 10,
        log_bytes: 1 << 20,
        checkpoints: [1_064_960, 2_146_304],
        checkpoint_capacity: 1_081_344,
        checkpoint_in_use: 2,
        checkpoint_generation: 4,
        checkpoint_pages: 1,
        checkpoint_crc: 1_807_234_989,
        log_start_seq: 4,
        log_start_offset: 16 << 10,
        low_water_blocks: 24,
        created_secs: 1_795_933_236,
        updated_secs: 1_795_933_236,
        next_volume: 2,
    };
    // Every update writes both slots alike.
    for (i, slot) in THIN.chunks(SLOT_BYTES).enumerate() {
        let sb = PoolSuperblock::decode(slot).unwrap_or_else(|e| panic!("slot {i}: {e:?}"));
        assert_eq!(sb, want, "slot {i}");
        let mut b = sb.encode();
        assert_eq!(PoolSuperblock::decode(&b).map(|s| s.version), Ok(VERSION));
        FRAME.seal(&mut b, 2);
        assert!(b == slot, "slot {i} encodes to other bytes");
    }
}

/// The store's file as it was written: the fixture with the zeros it leaves out.
fn store_image() -> Vec<u8> {
    let (slot, page) = (SLOT as usize, PAGE as usize);
    let mut image = vec![0u8; AREAS as usize];
    image[..page].copy_from_slice(&STORE[..page]);
    image[slot..slot + page].copy_from_slice(&STORE[page..2 * page]);
    image.extend_from_slice(&STORE[2 * page..]);
    image
}

fn entry(name: &str, shift: u32, bits: u64, area: u64) -> Entry {
    Entry {
        name: name.into(),
        owner: String::new(),
        shift,
        bits,
        flags: 0,
        area,
    }
}

#[test]
fn a_bitmap_store_written_before_reads_the_same_and_writes_back_byte_for_byte() {
    let image = store_image();
    assert_eq!(image.len(), 532_480);
    let want = Directory {
        version: 2,
        seq: 3,
        identity: 848_386_875_257_994_096,
        device: "vm1".into(),
        device_bytes: 64 << 20,
        entries: vec![
            entry("b0", 16, 1024, AREAS),
            entry("fine", 12, 16384, AREAS + PAGE),
        ],
    };
    // Both copies hold the same directory, and it encodes to the bytes of its slot (the
    // rest of which is zeros).
    for (name, at) in [("A", 0), ("B", SLOT as usize)] {
        let slot = &image[at..at + SLOT as usize];
        let dir = Directory::decode(slot).unwrap_or_else(|e| panic!("copy {name}: {e}"));
        assert_eq!(dir, want, "copy {name}");
        let bytes = dir.encode();
        assert!(
            slot[..bytes.len()] == bytes[..] && slot[bytes.len()..].iter().all(|&b| b == 0),
            "copy {name} encodes to other bytes"
        );
    }
    // Every page of bits checks, and sealed again gives the same bytes.
    for e in &want.entries {
        for p in 0..e.area_bytes() / PAGE {
            let at = (e.area + p * PAGE) as usize;
            let page = &image[at..at + PAGE as usize];
            assert_eq!(
                format::check_page(page, want.identity, e.area, p),
                Ok(()),
                "bitmap '{}' page {p}",
                e.name
            );
            let mut again = page.to_vec();
            again[(PAGE - format::TRAILER) as usize..].fill(0);
            format::seal_page(&mut again, want.identity, e.area, p);
            assert!(again == page, "bitmap '{}' page {p} seals again", e.name);
        }
    }
    // Opened (only examined), the store shows the marks that were made.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("store");
    std::fs::write(&path, &image).unwrap();
    let store = Store::open(&path, "vm1", 64 << 20, true).unwrap();
    let dirty = |name: &str| {
        let mut runs = Vec::new();
        store
            .reader("", name)
            .expect("a bitmap")
            .runs(0, 64 << 20, usize::MAX, &mut runs);
        let mut at = 0;
        let mut out = Vec::new();
        for (n, d) in runs {
            if d {
                out.push((at, n));
            }
            at += n;
        }
        out
    };
    let k64 = 64 << 10;
    assert_eq!(
        dirty("b0"),
        [(0, k64), (80 * k64, 5 * k64), (1023 * k64, k64)]
    );
    assert_eq!(
        dirty("fine"),
        [(0, 4096), (1280 * 4096, 74 * 4096), (16383 * 4096, 4096)]
    );
    assert!(store.list().iter().all(|b| !b.inconsistent));
    drop(store);
    assert!(
        std::fs::read(&path).unwrap() == image,
        "an examining open wrote"
    );
}
