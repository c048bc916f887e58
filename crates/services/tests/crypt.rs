//! The crypt device against a byte-vector model: random reads, writes, flushes, discards
//! and write-zeroes through it read back what the model says, for LUKS1 (512-byte
//! sectors) and LUKS2 (4096-byte sectors); the base never holds the plaintext of any
//! sector, the same data at two offsets encrypts differently, a writer's buffer is never
//! changed, and the device reopens from its header with the passphrase (a wrong one, a
//! key file of the wrong size, a foreign header are refused, and nothing is written).

use std::path::Path;
use std::sync::Arc;

use cairn_core::blocking::{BlockingQueue, Request};
use cairn_core::{Device, IoFlags, Op, Switches};
use cairn_leaves::LeafSpec;
use cairn_services::crypt::device::{CryptDevice, CryptOptions};
use cairn_services::crypt::volume::Format;
use cairn_services::crypt::{Hash, Kdf};
use proptest::prelude::*;
use proptest::test_runner::Config;

use cairn_testkit as common;
use common::{pattern, Step};

/// PBKDF2 at cryptsetup's floor: the tests open many devices.
const QUICK: Kdf = Kdf::Pbkdf2 {
    hash: Hash::Sha256,
    iterations: 1000,
};

fn mem(bytes: u64) -> Arc<dyn Device> {
    let s = LeafSpec::parse(&format!("mem:{bytes}")).unwrap();
    cairn_leaves::open(&s, "base").unwrap()
}

fn options(dir: &Path, format: Format, passphrase: &[u8]) -> CryptOptions {
    let file = dir.join(format!("pass-{}", passphrase.len()));
    std::fs::write(&file, passphrase).unwrap();
    CryptOptions {
        passphrase_file: Some(file),
        create: true,
        format: Some(format),
        kdf: Some(QUICK),
        ..CryptOptions::default()
    }
}

fn open(base: &Arc<dyn Device>, opts: &CryptOptions) -> Result<Arc<dyn Device>, String> {
    open_dev(base, opts)
}

/// Why opening fails (it must).
#[track_caller]
fn refused(base: &Arc<dyn Device>, opts: &CryptOptions) -> String {
    match open_dev(base, opts) {
        Ok(_) => panic!("opened"),
        Err(e) => e,
    }
}

fn open_dev(base: &Arc<dyn Device>, opts: &CryptOptions) -> Result<Arc<dyn Device>, String> {
    CryptDevice::open("c", base.clone(), opts, true)
        .map(|d| Arc::new(d) as Arc<dyn Device>)
        .map_err(|e| e.to_string())
}

/// Where the data starts on the base for each format (cairn's layouts).
fn data_offset(format: Format) -> u64 {
    match format {
        Format::Luks1 => 2 << 20,
        Format::Luks2 => 16 << 20,
    }
}

fn sector(format: Format) -> u64 {
    match format {
        Format::Luks1 => 512,
        Format::Luks2 => 4096,
    }
}

/// Sectors of the device, kept small: requests of up to 24 sectors.
const SECTORS: u64 = 40;

fn step(block: u64) -> impl Strategy<Value = Step> {
    let offset = move || (0..SECTORS).prop_map(move |s| s * block);
    let len = move || (1..=24u64).prop_map(move |n| n * block);
    prop_oneof![
        3 => (offset(), len()).prop_map(|(offset, len)| Step::Read { offset, len }),
        6 => (offset(), len(), any::<u64>(), any::<bool>())
            .prop_map(|(offset, len, seed, fua)| Step::Write { offset, len, seed, fua }),
        1 => Just(Step::Flush),
        2 => (offset(), len()).prop_map(|(offset, len)| Step::Discard { offset, len }),
        2 => (offset(), len(), any::<bool>())
            .prop_map(|(offset, len, no_hole)| Step::WriteZeroes { offset, len, no_hole }),
    ]
}

/// Runs `steps` on a new crypt device of `format`, checking each read and the end state,
/// then that no sector of ciphertext equals its plaintext, and that the device reopens
/// with the same contents.
fn run(format: Format, steps: &[Step]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let block = sector(format);
    let size = SECTORS * block;
    let base = mem(data_offset(format) + size);
    let opts = options(dir.path(), format, b"model passphrase");
    let dev = open(&base, &opts).map_err(TestCaseError::fail)?;
    prop_assert_eq!(dev.geometry().size_bytes, size);
    let q = BlockingQueue::open(&dev, Switches::default()).unwrap();
    // A new LUKS device reads noise where nothing was written (as dm-crypt and qemu's
    // do: formatting does not touch the data): zeroed first.
    q.zero(Op::WriteZeroes, 0, size, IoFlags::NONE).unwrap();
    let mut model = vec![0u8; size as usize];
    for s in steps {
        let (offset, len) = s.range();
        let end = offset.saturating_add(len);
        let fits = end <= size;
        match *s {
            Step::Read { .. } if fits => {
                let mut buf = vec![0xa5u8; len as usize];
                q.read(offset, &mut buf).unwrap();
                prop_assert!(
                    buf == model[offset as usize..end as usize],
                    "{:?} read the wrong bytes",
                    s
                );
            }
            Step::Write { seed, .. } if fits => {
                let bytes = pattern(seed, len);
                q.write(offset, &bytes, s.flags()).unwrap();
                model[offset as usize..end as usize].copy_from_slice(&bytes);
            }
            Step::Flush => q.flush().unwrap(),
            Step::Discard { .. } | Step::WriteZeroes { .. } if fits => {
                q.zero(s.op(), offset, len, s.flags()).unwrap();
                model[offset as usize..end as usize].fill(0);
            }
            // Past the end: refused at the edge, nothing changes.
            _ => prop_assert!(q.read(offset, &mut vec![0u8; len as usize]).is_err()),
        }
    }
    common::check_all(&q, &model)?;
    drop(q);
    // The ciphertext: no sector equals its plaintext (zeros included).
    let bq = BlockingQueue::open(&base, Switches::default()).unwrap();
    let mut cipher = vec![0u8; size as usize];
    bq.read(data_offset(format), &mut cipher).unwrap();
    for (i, (c, p)) in cipher
        .chunks(block as usize)
        .zip(model.chunks(block as usize))
        .enumerate()
    {
        prop_assert!(c != p, "sector {} is stored in the clear", i);
    }
    drop(bq);
    // Reopened from its header (create is a no-op once a header is there).
    let again = open(&base, &opts).map_err(TestCaseError::fail)?;
    let q = BlockingQueue::open(&again, Switches::default()).unwrap();
    common::check_all(&q, &model)
}

proptest! {
    #![proptest_config(Config { cases: 24, ..Config::default() })]

    #[test]
    fn luks1_matches_the_model(steps in prop::collection::vec(step(512), 1..=30)) {
        run(Format::Luks1, &steps)?;
    }

    #[test]
    fn luks2_matches_the_model(steps in prop::collection::vec(step(4096), 1..=30)) {
        run(Format::Luks2, &steps)?;
    }
}

#[test]
fn the_same_data_encrypts_differently_at_two_offsets_and_the_writer_keeps_its_buffer() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    for format in [Format::Luks1, Format::Luks2] {
        let base = mem(data_offset(format) + (1 << 20));
        let dev = open(&base, &options(dir.path(), format, b"pass")).unwrap();
        let q = BlockingQueue::open(&dev, Switches::default()).unwrap();
        let plain = pattern(7, 4096);
        let mut buf = plain.clone();
        for offset in [0, 8192] {
            let r = q.run(&mut [Request {
                op: Op::Write,
                flags: IoFlags::NONE,
                offset,
                len: 0,
                buf: Some(&mut buf),
            }]);
            assert!(r[0].is_ok(), "{r:?}");
            assert_eq!(buf, plain, "{format:?}: the writer's buffer changed");
        }
        let bq = BlockingQueue::open(&base, Switches::default()).unwrap();
        let mut a = vec![0u8; 4096];
        let mut b = vec![0u8; 4096];
        bq.read(data_offset(format), &mut a).unwrap();
        bq.read(data_offset(format) + 8192, &mut b).unwrap();
        assert_ne!(a, b, "{format:?}: the same data at two offsets");
        assert_ne!(a, plain);
    }
}

#[test]
fn large_zeroing_goes_in_chunks_and_stops_where_asked() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let format = Format::Luks1;
    let size = 4u64 << 20;
    let base = mem(data_offset(format) + size);
    let dev = open(&base, &options(dir.path(), format, b"pass")).unwrap();
    let q = BlockingQueue::open(&dev, Switches::default()).unwrap();
    let all = pattern(9, size);
    q.write(0, &all, IoFlags::NONE).unwrap();
    // 3 MiB and a sector, from 512 bytes in: four chunks, the last one short.
    let (at, len) = (512u64, (3 << 20) + 512);
    q.zero(Op::WriteZeroes, at, len, IoFlags::NONE).unwrap();
    let mut model = all.clone();
    model[at as usize..(at + len) as usize].fill(0);
    let mut back = vec![0u8; size as usize];
    q.read(0, &mut back).unwrap();
    assert!(back == model, "write-zeroes of 3 MiB");
    q.zero(Op::Discard, 0, size, IoFlags::NONE).unwrap();
    q.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0), "discard of the whole device");
}

#[test]
fn bad_keys_and_foreign_headers_are_refused_and_nothing_is_written() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let format = Format::Luks1;
    let base = mem(data_offset(format) + (1 << 20));
    let opts = options(dir.path(), format, b"right");
    drop(open(&base, &opts).unwrap());
    let image = |base: &Arc<dyn Device>| {
        let q = BlockingQueue::open(base, Switches::default()).unwrap();
        let mut b = vec![0u8; (data_offset(format) + (1 << 20)) as usize];
        q.read(0, &mut b).unwrap();
        b
    };
    let before = image(&base);
    let wrong = options(dir.path(), format, b"wrong");
    let e = refused(&base, &wrong);
    assert!(e.contains("no key slot opens with this passphrase"), "{e}");
    // A raw key of the wrong size, and one of the right size that is not the key.
    let key = dir.path().join("key");
    std::fs::write(&key, [1u8; 48]).unwrap();
    let raw = CryptOptions {
        key_file: Some(key.clone()),
        ..CryptOptions::default()
    };
    let e = refused(&base, &raw);
    assert!(e.contains("48 bytes") && e.contains("32 or 64"), "{e}");
    std::fs::write(&key, [1u8; 64]).unwrap();
    let e = refused(&base, &raw);
    assert!(e.contains("not the volume key"), "{e}");
    // The other version expected.
    let e = refused(&base, &options(dir.path(), Format::Luks2, b"right"));
    assert!(e.contains("luks1 header, not luks2"), "{e}");
    assert!(image(&base) == before, "a refused open wrote to the base");
    // Something that is not LUKS: create does not format over it.
    let other = mem(data_offset(format) + (1 << 20));
    let q = BlockingQueue::open(&other, Switches::default()).unwrap();
    q.write(0, &[0xeeu8; 512], IoFlags::NONE).unwrap();
    drop(q);
    let e = refused(&other, &opts);
    assert!(
        e.contains("not a LUKS header") && e.contains("blank"),
        "{e}"
    );
    // A blank base without create.
    let blank = mem(data_offset(format) + (1 << 20));
    let no_create = CryptOptions {
        create: false,
        ..opts.clone()
    };
    let e = refused(&blank, &no_create);
    assert!(e.contains("no LUKS header"), "{e}");
    assert!(image(&blank).iter().all(|&b| b == 0));
    // A base too small for the data.
    let tiny = mem(1 << 20);
    let e = refused(&tiny, &opts);
    assert!(e.contains("too small") || e.contains("past the end"), "{e}");
}

/// A LUKS2 header may start the IV anywhere (`iv_tweak`): near 2^64 the IV wraps, as
/// dm-crypt's plain64 does, instead of overflowing (a panic in a debug build) on the
/// sectors past the wrap. Written, read back, and reopened.
#[test]
fn an_iv_tweak_near_the_largest_iv_wraps() {
    use sha2::Digest;
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let format = Format::Luks2;
    let size = 64u64 << 10;
    let base = mem(data_offset(format) + size);
    let opts = options(dir.path(), format, b"pass");
    drop(open(&base, &opts).unwrap());
    // Both header copies (16 KiB each) get the tweak, and their checksum again.
    let bq = BlockingQueue::open(&base, Switches::default()).unwrap();
    let mut copies = vec![0u8; 32 << 10];
    bq.read(0, &mut copies).unwrap();
    let tweak = (u64::MAX - 7).to_string();
    for copy in copies.chunks_mut(16 << 10) {
        let text = String::from_utf8_lossy(&copy[4096..]).into_owned();
        let json = text.trim_end_matches('\0');
        let changed = json.replace("\"iv_tweak\":\"0\"", &format!("\"iv_tweak\":\"{tweak}\""));
        assert_ne!(changed, json, "no iv_tweak in the header");
        copy[4096..].fill(0);
        copy[4096..4096 + changed.len()].copy_from_slice(changed.as_bytes());
        copy[448..448 + 64].fill(0);
        let csum = sha2::Sha256::digest(&copy[..]);
        copy[448..448 + 32].copy_from_slice(&csum);
    }
    bq.write(0, &copies, IoFlags::NONE).unwrap();
    drop(bq);
    let reopen = CryptOptions {
        create: false,
        ..opts.clone()
    };
    let plain = pattern(5, size);
    let dev = open(&base, &reopen).unwrap();
    let q = BlockingQueue::open(&dev, Switches::default()).unwrap();
    q.write(0, &plain, IoFlags::NONE).unwrap();
    // Sector by sector as well: each request's first IV is past the wrap.
    let mut back = vec![0u8; size as usize];
    for (i, chunk) in back.chunks_mut(4096).enumerate() {
        q.read(i as u64 * 4096, chunk).unwrap();
    }
    assert!(back == plain, "read back across the wrap");
    drop(q);
    drop(dev);
    let dev = open(&base, &reopen).unwrap();
    let q = BlockingQueue::open(&dev, Switches::default()).unwrap();
    back.fill(0);
    q.read(0, &mut back).unwrap();
    assert!(back == plain, "read back after reopening");
}

/// The whole of `base`.
fn image(base: &Arc<dyn Device>) -> Vec<u8> {
    let q = BlockingQueue::open(base, Switches::default()).unwrap();
    let mut b = vec![0u8; base.geometry().size_bytes as usize];
    q.read(0, &mut b).unwrap();
    b
}

/// Zeros over `len` bytes of `base` from its start, as `dd if=/dev/zero` would.
fn wipe(base: &Arc<dyn Device>, len: usize) {
    let q = BlockingQueue::open(base, Switches::default()).unwrap();
    q.write(0, &vec![0u8; len], IoFlags::NONE).unwrap();
}

/// A new crypt device of `format` over a fresh base, with 1 MiB of data written: the
/// base, the options that opened it and the data.
fn written(dir: &Path, format: Format) -> (Arc<dyn Device>, CryptOptions, Vec<u8>) {
    let base = mem(data_offset(format) + (1 << 20));
    let opts = options(dir, format, b"wiped");
    let dev = open(&base, &opts).unwrap();
    let q = BlockingQueue::open(&dev, Switches::default()).unwrap();
    let bytes = pattern(41, 1 << 20);
    q.write(0, &bytes, IoFlags::NONE).unwrap();
    q.flush().unwrap();
    (base, opts, bytes)
}

/// `create` never formats over a volume whose header was wiped. A LUKS2 volume whose
/// first 4 KiB were zeroed opens from its secondary header copy, with its data and its
/// UUID, with `create` as without it, and `cairn check`'s open (nothing written) says
/// the same; with both header copies zeroed (the key slots left) and a LUKS1 volume with
/// its header zeroed, the open is refused, saying what was found and what to do, and
/// the base is unchanged. A blank base (a sparse file) is still formatted.
#[test]
fn create_never_formats_over_a_volume_whose_header_was_wiped() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let (base, opts, bytes) = written(dir.path(), Format::Luks2);
    let uuid = open(&base, &opts).unwrap().describe();
    wipe(&base, 4096);
    for (create, write) in [(true, false), (true, true), (false, true)] {
        let o = CryptOptions {
            create,
            ..opts.clone()
        };
        let dev = CryptDevice::open("c", base.clone(), &o, write).unwrap();
        assert_eq!(dev.describe(), uuid, "create {create}, write {write}");
        let dev: Arc<dyn Device> = Arc::new(dev);
        let q = BlockingQueue::open(&dev, Switches::default()).unwrap();
        let mut back = vec![0u8; bytes.len()];
        q.read(0, &mut back).unwrap();
        assert!(back == bytes, "create {create}: other data");
    }
    // Both copies gone: 16 MiB of key slots and the data are still there.
    wipe(&base, 32 << 10);
    let before = image(&base);
    for write in [false, true] {
        let e = CryptDevice::open("c", base.clone(), &opts, write)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("holds no LUKS header but is not blank: byte 32768 is not zero")
                && e.contains("zero them first"),
            "{e}"
        );
    }
    assert!(image(&base) == before, "a refused create wrote to the base");
    // LUKS1: its header (592 bytes, and zeros up to the key material) zeroed.
    let (base, opts, _) = written(dir.path(), Format::Luks1);
    wipe(&base, 4096);
    let before = image(&base);
    let e = refused(&base, &opts);
    assert!(e.contains("not blank: byte 4096 is not zero"), "{e}");
    assert!(image(&base) == before, "a refused create wrote to the base");
    // A sparse file that holds nothing is formatted.
    let path = dir.path().join("blank.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len((16 << 20) + (1 << 20))
        .unwrap();
    let spec = LeafSpec::parse(&format!("file:{}", path.display())).unwrap();
    let blank = cairn_leaves::open(&spec, "blank").unwrap();
    let dev = open(&blank, &options(dir.path(), Format::Luks2, b"blank")).unwrap();
    assert!(dev.describe().contains("luks2"), "{}", dev.describe());
}

/// A crypt device counts what it ciphered: each write, read, write-zeroes and discard
/// once, their bytes (write-zeroes and discard: the zeros encrypted in their place),
/// some time in the cipher, and its key slots opened, added and removed; a closed
/// queue's counts stay, and a device opened again counts from zero.
#[test]
fn the_counters_show_what_was_ciphered_and_the_key_slots_events() {
    use cairn_services::crypt::counters::CryptStats;
    use cairn_services::crypt::device::KeySlots;
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let format = Format::Luks1;
    let base = mem(data_offset(format) + (4 << 20));
    let opts = options(dir.path(), format, b"pass");
    let dev = open(&base, &opts).unwrap();
    let stats = dev.capability::<dyn CryptStats>().expect("crypt counters");
    let before = stats.counts();
    assert_eq!(before.key_slot_opens, 1, "{before:?}");
    assert_eq!(before.encrypted_requests + before.decrypted_requests, 0);
    let q = BlockingQueue::open(&dev, Switches::default()).unwrap();
    for i in 0..3u64 {
        q.write(i * 4096, &pattern(i, 4096), IoFlags::NONE).unwrap();
    }
    let mut back = vec![0u8; 8192];
    q.read(0, &mut back).unwrap();
    q.read(8192, &mut back).unwrap();
    // Four chunks of zeros, one request.
    q.zero(Op::WriteZeroes, 512, (3 << 20) + 512, IoFlags::NONE)
        .unwrap();
    q.zero(Op::Discard, 0, 4096, IoFlags::NONE).unwrap();
    q.flush().unwrap();
    let c = stats.counts();
    assert_eq!(c.encrypted_requests, 3 + 1 + 1, "{c:?}");
    assert_eq!(
        c.encrypted_bytes,
        3 * 4096 + (3 << 20) + 512 + 4096,
        "{c:?}"
    );
    assert_eq!(
        (c.decrypted_requests, c.decrypted_bytes),
        (2, 2 * 8192),
        "{c:?}"
    );
    assert!(c.cipher_ns > 0, "{c:?}");
    let slots = dev.capability::<dyn KeySlots>().unwrap();
    let pass2 = dir.path().join("pass2");
    std::fs::write(&pass2, b"second").unwrap();
    let kdf = Some(QUICK);
    let (kdf, len) = slots.new_slot_kdf(kdf).unwrap();
    let key = cairn_services::crypt::SlotKey::derive(kdf, b"second", len).unwrap();
    let added = slots.add_derived_slot(&key).unwrap();
    slots.remove_slot(added).unwrap();
    let c = stats.counts();
    assert_eq!(
        (c.key_slot_opens, c.key_slots_added, c.key_slots_removed),
        (1, 1, 1),
        "{c:?}"
    );
    // The counts of a queue closed stay.
    drop(q);
    let q = BlockingQueue::open(&dev, Switches::default()).unwrap();
    q.read(0, &mut back).unwrap();
    let after = stats.counts();
    assert_eq!(after.decrypted_requests, 3, "{after:?}");
    assert_eq!(after.encrypted_bytes, c.encrypted_bytes);
    drop((q, dev));
    // Opened again by a passphrase: one slot opened; the counters start again.
    let opts = CryptOptions {
        create: false,
        ..opts
    };
    let dev = open(&base, &opts).unwrap();
    let c = dev.capability::<dyn CryptStats>().unwrap().counts();
    assert_eq!((c.key_slot_opens, c.encrypted_requests), (1, 0), "{c:?}");
}

/// Adding a key slot checks the volume key against the header's digest, a PBKDF2 of its
/// own, before it locks the device's keys: meanwhile the key slots can be listed (they
/// used to wait for the whole add). The digest here asks for about two seconds.
#[test]
fn the_key_slots_can_be_listed_while_an_add_checks_the_volume_key() {
    use cairn_services::crypt::device::KeySlots;
    use cairn_services::crypt::luks1;
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let format = Format::Luks1;
    let base = mem(data_offset(format) + (1 << 20));
    let key: Vec<u8> = (0..64u8).collect();
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, &key).unwrap();
    let opts = CryptOptions {
        key_file: Some(key_file),
        ..options(dir.path(), format, b"pass")
    };
    drop(open(&base, &opts).unwrap());
    // The digest made again with as many iterations as take about two seconds here.
    let bq = BlockingQueue::open(&base, Switches::default()).unwrap();
    let mut b = vec![0u8; 4096];
    bq.read(0, &mut b).unwrap();
    let mut h = luks1::Header::decode(&b).unwrap();
    let start = std::time::Instant::now();
    let mut d = [0u8; luks1::DIGEST_BYTES];
    h.hash.pbkdf2(&key, &h.digest_salt, 100_000, &mut d);
    let per_s = 100_000.0 / start.elapsed().as_secs_f64();
    h.digest_iterations = (per_s * 2.0).min(f64::from(u32::MAX)) as u32;
    h.hash
        .pbkdf2(&key, &h.digest_salt, h.digest_iterations, &mut h.digest);
    let e = h.encode();
    b[..e.len()].copy_from_slice(&e);
    bq.write(0, &b, IoFlags::NONE).unwrap();
    drop(bq);
    let opts = CryptOptions {
        create: false,
        passphrase_file: None,
        ..opts
    };
    let dev = open(&base, &opts).unwrap();
    let slots = dev.capability::<dyn KeySlots>().unwrap();
    let (kdf, len) = slots.new_slot_kdf(Some(QUICK)).unwrap();
    let slot_key = cairn_services::crypt::SlotKey::derive(kdf, b"second", len).unwrap();
    std::thread::scope(|s| {
        let adder = s.spawn(|| slots.add_derived_slot(&slot_key));
        // Well into the check (the slot's key is derived already).
        std::thread::sleep(std::time::Duration::from_millis(300));
        let listed = slots.slots();
        let running = !adder.is_finished();
        assert!(
            running && listed.len() == 1,
            "listed {} slots, the add running: {running}",
            listed.len()
        );
        assert_eq!(adder.join().unwrap().unwrap(), 1);
    });
    assert_eq!(slots.slots().len(), 2);
}
