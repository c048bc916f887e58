//! LUKS version 2: the header cryptsetup writes by default, read, made and changed. Read
//! from the LUKS2 on-disk format specification and cryptsetup 2.6's sources, and checked
//! against headers cryptsetup made and against its `luksDump` of headers cairn made.
//!
//! A header is two copies of a 4 KiB binary header (magic, size, sequence number, UUID,
//! a SHA-256 checksum) each followed by a JSON text: the key slots (a volume key split
//! by the anti-forensic splitter, ciphered with a key argon2 or PBKDF2 derives from a
//! passphrase), the data segment, and a PBKDF2 digest of the volume key. The copy with
//! the higher sequence number among the valid ones wins, so an update torn by a crash
//! leaves the other copy to open. Integers in the binary header are big-endian; in the
//! JSON, offsets and sizes are decimal strings and binary values base64.
//!
//! Not here: integrity (dm-integrity) segments, online reencryption, tokens (kept as
//! they are but not used), detached headers (the data must follow the key slots on the
//! same device), ciphers other than `aes-xts-plain64`.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::luks1::{af_merge, af_split};
use super::xts::{Xts, KEY_BYTES};
use super::{Hash, Kdf, ReadAt, Secret, Segment, SlotInfo, WriteAt};

/// The magic of the primary header copy: `LUKS` 0xBA 0xBE (as LUKS1's).
pub const MAGIC: [u8; 6] = *b"LUKS\xba\xbe";
/// The magic of the secondary header copy: `SKUL` 0xBA 0xBE.
pub const MAGIC_SECONDARY: [u8; 6] = *b"SKUL\xba\xbe";
/// The sizes a header copy (binary header and JSON area) may have; they are also the
/// offsets where the secondary copy may start.
pub const HEADER_BYTES: [u64; 9] = [
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];
/// The most key slots a header holds (cryptsetup's limit).
pub const MAX_SLOTS: usize = 32;
/// AF stripes of every slot cairn makes (what cryptsetup uses).
pub const STRIPES: u32 = 4000;
/// PBKDF2-SHA256 iterations of the volume key's digest in headers cairn makes.
pub const DIGEST_ITERATIONS: u32 = 100_000;

/// Bytes of the binary part of a header copy; the JSON area follows it.
const BINARY_BYTES: u64 = 4096;
/// The header copy size cairn writes (cryptsetup's default): 4 KiB binary, 12 KiB JSON.
const DEFAULT_HEADER_BYTES: u64 = 16 << 10;
/// Where the data segment of a header cairn makes starts (cryptsetup's default); the
/// key slot area runs from after the two header copies up to it.
const DATA_OFFSET: u64 = 16 << 20;
/// The largest key slot area cryptsetup accepts.
const MAX_KEYSLOTS_AREA: u64 = 128 << 20;
/// The most argon2 memory a key slot may ask for, in KiB (cryptsetup's limit, 4 GiB).
const MAX_ARGON2_KIB: u64 = 4 << 20;
/// The most argon2 lanes a key slot may ask for.
const MAX_ARGON2_LANES: u64 = 64;
/// The most AF stripes a key slot may have.
const MAX_STRIPES: u64 = 65536;
/// The only cipher cairn opens, for data and key material.
const CIPHER: &str = "aes-xts-plain64";

// Fields of the binary header: (offset, bytes).
const VERSION_AT: usize = 6;
const SIZE_AT: usize = 8;
const SEQID_AT: usize = 16;
const LABEL_AT: usize = 24;
const CSUM_ALG_AT: usize = 72;
const SALT_AT: usize = 104;
const UUID_AT: usize = 168;
const SUBSYSTEM_AT: usize = 208;
const OFFSET_AT: usize = 256;
const CSUM_AT: usize = 448;
const LABEL_BYTES: usize = 48;

/// A LUKS2 header: the copy that won, its JSON as read (rewritten with only the changed
/// keys, so fields cairn does not use survive), and what cairn parsed out of it.
#[derive(Debug, Clone)]
pub struct Header {
    seqid: u64,
    header_bytes: u64,
    label: [u8; LABEL_BYTES],
    subsystem: [u8; LABEL_BYTES],
    uuid: String,
    json: Value,
    meta: Meta,
}

impl Header {
    /// Reads both header copies (the primary at 0, the secondary where the primary's
    /// size says, or, when the primary is unreadable, at the first of the standard
    /// offsets that holds one) and keeps the valid one with the higher sequence number.
    pub fn read(read: &mut ReadAt<'_>) -> Result<Header, String> {
        let mut first = [0u8; 8];
        read(0, &mut first)?;
        if first[..6] == MAGIC {
            let version = u16::from_be_bytes([first[6], first[7]]);
            if version != 2 {
                return Err(format!("LUKS version {version}, not 2"));
            }
        }
        let primary = read_copy(read, 0);
        let secondary = match &primary {
            Ok(p) => read_copy(read, p.header_bytes),
            Err(_) => scan_secondary(read),
        };
        choose(primary, secondary)
    }

    /// The data segment.
    pub fn segment(&self) -> Segment {
        self.meta.segment
    }

    /// Bytes of the volume key.
    pub fn key_bytes(&self) -> usize {
        self.meta.key_bytes
    }

    /// The UUID, as text.
    pub fn uuid(&self) -> &str {
        &self.uuid
    }

    /// The key slots, in number order, with their KDF. (An argon2i slot is listed as
    /// argon2id with the same costs: [`Kdf`] has no argon2i.)
    pub fn slots(&self) -> Vec<SlotInfo> {
        self.meta
            .keyslots
            .iter()
            .map(|(&index, k)| SlotInfo {
                index,
                kdf: k.kdf.public(),
            })
            .collect()
    }

    /// Opens the first key slot `passphrase` unlocks, trying the slots bound to the data
    /// segment by priority (high, normal, then ignore) and number; returns the slot and
    /// the volume key. Key material is read with `read(offset, buf)`.
    pub fn unlock(
        &self,
        passphrase: &[u8],
        read: &mut ReadAt<'_>,
    ) -> Result<(usize, Secret), String> {
        let mut order: Vec<(&usize, &Keyslot)> =
            self.meta.keyslots.iter().filter(|(_, k)| k.bound).collect();
        order.sort_by_key(|(&n, k)| (std::cmp::Reverse(k.priority), n));
        for (&n, k) in order {
            if let Some(key) = self.open_slot(k, passphrase, read)? {
                return Ok((n, key));
            }
        }
        Err("no key slot opens with this passphrase".into())
    }

    /// Whether `key` is the volume key (the digest bound to the data segment).
    pub fn check(&self, key: &[u8]) -> bool {
        let d = &self.meta.digest;
        let mut out = vec![0u8; d.digest.len()];
        d.hash.pbkdf2(key, &d.salt, d.iterations, &mut out);
        // Compared without an early exit, so the time taken says nothing of the key.
        out.iter()
            .zip(&d.digest)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }

    /// Formats: a new header pair in cryptsetup's default layout (16 KiB copies, key
    /// slots from 32 KiB, data from 16 MiB to the end of the device, `aes-xts-plain64`
    /// in `sector_bytes` sectors) for volume key `key`, slot 0 opened by `passphrase`.
    /// The header copies are zeroed and the key slot area filled with random bytes
    /// first (as cryptsetup does), then slot 0's material, then the primary copy, then
    /// the secondary. The data is not touched.
    pub fn create(
        write: &mut WriteAt<'_>,
        key: &Secret,
        passphrase: &[u8],
        kdf: Kdf,
        sector_bytes: u32,
    ) -> Result<Header, String> {
        let key_bytes = key.0.len();
        if !KEY_BYTES.contains(&key_bytes) {
            return Err(format!("a volume key of {key_bytes} bytes (32 or 64 are)"));
        }
        if sector_bytes != 512 && sector_bytes != 4096 {
            return Err(format!("a sector size of {sector_bytes} (512 or 4096 are)"));
        }
        check_kdf(kdf)?;
        let keyslots_start = 2 * DEFAULT_HEADER_BYTES;
        fill(write, 0, keyslots_start, false)?;
        fill(write, keyslots_start, DATA_OFFSET, true)?;
        let slot = new_keyslot(write, key, passphrase, kdf, keyslots_start)?;
        let mut salt = [0u8; 32];
        super::random(&mut salt)?;
        let mut digest = [0u8; 32];
        Hash::Sha256.pbkdf2(&key.0, &salt, DIGEST_ITERATIONS, &mut digest);
        let json = json!({
            "keyslots": { "0": slot },
            "tokens": {},
            "segments": { "0": {
                "type": "crypt",
                "offset": DATA_OFFSET.to_string(),
                "size": "dynamic",
                "iv_tweak": "0",
                "encryption": CIPHER,
                "sector_size": sector_bytes,
            }},
            "digests": { "0": {
                "type": "pbkdf2",
                "keyslots": ["0"],
                "segments": ["0"],
                "hash": "sha256",
                "iterations": DIGEST_ITERATIONS,
                "salt": base64_encode(&salt),
                "digest": base64_encode(&digest),
            }},
            "config": {
                "json_size": (DEFAULT_HEADER_BYTES - BINARY_BYTES).to_string(),
                "keyslots_size": (DATA_OFFSET - keyslots_start).to_string(),
            },
        });
        let meta = Meta::parse(&json, DEFAULT_HEADER_BYTES).map_err(Fault::message)?;
        let h = Header {
            seqid: 1,
            header_bytes: DEFAULT_HEADER_BYTES,
            label: [0; LABEL_BYTES],
            subsystem: [0; LABEL_BYTES],
            uuid: super::uuid()?,
            json,
            meta,
        };
        h.write_copies(write)?;
        Ok(h)
    }

    /// Adds a key slot (the lowest free number; its area the first gap in the key slot
    /// area that holds it, as cryptsetup picks) holding `key`, which must be the volume
    /// key, opened by `passphrase`: its material first, then both header copies.
    pub fn add_slot(
        &mut self,
        write: &mut WriteAt<'_>,
        key: &Secret,
        passphrase: &[u8],
        kdf: Kdf,
    ) -> Result<usize, String> {
        if key.0.len() != self.meta.key_bytes || !self.check(&key.0) {
            return Err("the key is not this header's volume key".into());
        }
        check_kdf(kdf)?;
        let n = (0..MAX_SLOTS)
            .find(|n| !self.meta.keyslots.contains_key(n))
            .ok_or(format!(
                "all {MAX_SLOTS} key slots are in use: remove one first"
            ))?;
        let offset = self
            .free_area(area_bytes(key.0.len()))
            .ok_or("no room left in the key slot area: remove a key slot first")?;
        let slot = new_keyslot(write, key, passphrase, kdf, offset)?;
        let name = n.to_string();
        let mut json = self.json.clone();
        section(&mut json, "keyslots")?.insert(name.clone(), slot);
        let digest = section(&mut json, "digests")?
            .get_mut(&self.meta.digest_id)
            .and_then(|d| d.get_mut("keyslots"))
            .and_then(Value::as_array_mut)
            .ok_or("the digest has no keyslots list")?;
        digest.push(Value::String(name));
        self.commit(write, json)?;
        Ok(n)
    }

    /// Removes key slot `slot`: both header copies first (the slot gone from the key
    /// slots and from every digest's and token's list), then its area overwritten with
    /// random bytes. Refuses the last slot that opens the data.
    pub fn remove_slot(&mut self, write: &mut WriteAt<'_>, slot: usize) -> Result<(), String> {
        let k = self
            .meta
            .keyslots
            .get(&slot)
            .ok_or(format!("key slot {slot} is not in use"))?;
        let bound = self.meta.keyslots.values().filter(|k| k.bound).count();
        if k.bound && bound == 1 {
            return Err(format!(
                "key slot {slot} is the only key slot: add another first"
            ));
        }
        let (offset, bytes) = (k.area_offset, k.area_bytes);
        let name = slot.to_string();
        let mut json = self.json.clone();
        section(&mut json, "keyslots")?.remove(&name);
        for list in ["digests", "tokens"] {
            for entry in section(&mut json, list)?.values_mut() {
                if let Some(Value::Array(slots)) = entry.get_mut("keyslots") {
                    slots.retain(|s| s.as_str() != Some(name.as_str()));
                }
            }
        }
        self.commit(write, json)?;
        fill(write, offset, offset + bytes, true)
    }

    /// Makes `json` the header's metadata: checks it, then writes both copies with the
    /// next sequence number, the primary first.
    fn commit(&mut self, write: &mut WriteAt<'_>, json: Value) -> Result<(), String> {
        let meta = Meta::parse(&json, self.header_bytes).map_err(Fault::message)?;
        let next = Header {
            seqid: self.seqid + 1,
            json,
            meta,
            ..self.clone()
        };
        next.write_copies(write)?;
        *self = next;
        Ok(())
    }

    /// Writes the primary copy, then the secondary, each checked by decoding it first.
    fn write_copies(&self, write: &mut WriteAt<'_>) -> Result<(), String> {
        let primary = self.encode(0)?;
        let secondary = self.encode(self.header_bytes)?;
        for (at, b) in [(0, &primary), (self.header_bytes, &secondary)] {
            if let Err(CopyFault::Damaged(e) | CopyFault::Missing(e)) = decode_copy(b, at) {
                return Err(format!("the header copy cairn made does not decode: {e}"));
            }
        }
        write(0, &primary)?;
        write(self.header_bytes, &secondary)
    }

    /// The header copy at `at` (0: primary; else secondary): binary header, JSON text,
    /// zeros to the end of the JSON area, SHA-256 checksum.
    fn encode(&self, at: u64) -> Result<Vec<u8>, String> {
        let text = serde_json::to_vec(&self.json).map_err(|e| e.to_string())?;
        let size = self.header_bytes as usize;
        let json_bytes = size - BINARY_BYTES as usize;
        if text.len() >= json_bytes {
            return Err(format!(
                "the JSON metadata ({} bytes) does not fit its {json_bytes}-byte area",
                text.len()
            ));
        }
        let mut b = vec![0u8; size];
        b[..6].copy_from_slice(if at == 0 { &MAGIC } else { &MAGIC_SECONDARY });
        b[VERSION_AT..VERSION_AT + 2].copy_from_slice(&2u16.to_be_bytes());
        b[SIZE_AT..SIZE_AT + 8].copy_from_slice(&self.header_bytes.to_be_bytes());
        b[SEQID_AT..SEQID_AT + 8].copy_from_slice(&self.seqid.to_be_bytes());
        b[LABEL_AT..LABEL_AT + LABEL_BYTES - 1].copy_from_slice(&self.label[..LABEL_BYTES - 1]);
        b[CSUM_ALG_AT..CSUM_ALG_AT + 6].copy_from_slice(b"sha256");
        super::random(&mut b[SALT_AT..SALT_AT + 64])?;
        let uuid = self.uuid.as_bytes();
        let n = uuid.len().min(39);
        b[UUID_AT..UUID_AT + n].copy_from_slice(&uuid[..n]);
        b[SUBSYSTEM_AT..SUBSYSTEM_AT + LABEL_BYTES - 1]
            .copy_from_slice(&self.subsystem[..LABEL_BYTES - 1]);
        b[OFFSET_AT..OFFSET_AT + 8].copy_from_slice(&at.to_be_bytes());
        let json_at = BINARY_BYTES as usize;
        b[json_at..json_at + text.len()].copy_from_slice(&text);
        let mut csum = [0u8; 32];
        Hash::Sha256.digest(&[&b[..]], &mut csum);
        b[CSUM_AT..CSUM_AT + 32].copy_from_slice(&csum);
        Ok(b)
    }

    /// The key slot `k` opened with `passphrase`: the volume key, or `None` when the
    /// passphrase is not this slot's.
    fn open_slot(
        &self,
        k: &Keyslot,
        passphrase: &[u8],
        read: &mut ReadAt<'_>,
    ) -> Result<Option<Secret>, String> {
        let area_key = k.kdf.derive(passphrase, k.area_key_bytes)?;
        let mut material = Secret(vec![0u8; material_bytes(k.key_bytes, k.stripes)]);
        read(k.area_offset, &mut material.0)?;
        Xts::new(&area_key.0)?.run(&mut material.0, 512, 0, false);
        let used = k.key_bytes * k.stripes as usize;
        let key = af_merge(&material.0[..used], k.key_bytes, k.af_hash);
        Ok(self.check(&key.0).then_some(key))
    }

    /// The first gap of `bytes` in the key slot area, as cryptsetup finds it: after each
    /// used area in offset order, the first place where the new one ends before the next.
    fn free_area(&self, bytes: u64) -> Option<u64> {
        let mut used: Vec<(u64, u64)> = self
            .meta
            .keyslots
            .values()
            .map(|k| (k.area_offset, k.area_bytes))
            .collect();
        used.sort_unstable();
        let mut offset = self.meta.keyslots_start;
        for (at, len) in used {
            if offset + bytes <= at {
                break;
            }
            offset = offset.max(at + len);
        }
        (offset + bytes <= self.meta.keyslots_end).then_some(offset)
    }
}

/// Why a header copy's metadata is refused.
#[derive(Debug)]
enum Fault {
    /// Malformed, as cryptsetup too would reject it: the other copy may serve.
    Damaged(String),
    /// Well-formed, but something cairn does not support (integrity, reencryption, a
    /// cipher): the header is refused, whatever the other copy says.
    Refused(String),
}

impl Fault {
    fn message(self) -> String {
        match self {
            Fault::Damaged(e) | Fault::Refused(e) => e,
        }
    }
}

type Parsed<T> = Result<T, Fault>;

fn damaged<T>(msg: String) -> Parsed<T> {
    Err(Fault::Damaged(msg))
}

fn refused<T>(msg: String) -> Parsed<T> {
    Err(Fault::Refused(msg))
}

/// What cairn takes from a header's JSON.
#[derive(Debug, Clone)]
struct Meta {
    segment: Segment,
    key_bytes: usize,
    keyslots: BTreeMap<usize, Keyslot>,
    digest_id: String,
    digest: Digest,
    keyslots_start: u64,
    keyslots_end: u64,
}

/// One key slot.
#[derive(Debug, Clone)]
struct Keyslot {
    key_bytes: usize,
    priority: u64,
    /// Its digest is the data segment's: it holds the volume key.
    bound: bool,
    stripes: u32,
    af_hash: Hash,
    area_offset: u64,
    area_bytes: u64,
    area_key_bytes: usize,
    kdf: SlotKdf,
}

/// How a key slot derives the key of its area.
#[derive(Debug, Clone)]
enum SlotKdf {
    Pbkdf2 {
        hash: Hash,
        iterations: u32,
        salt: Vec<u8>,
    },
    Argon2 {
        algorithm: argon2::Algorithm,
        time: u32,
        memory_kib: u32,
        lanes: u32,
        salt: Vec<u8>,
    },
}

/// The volume key's digest.
#[derive(Debug, Clone)]
struct Digest {
    hash: Hash,
    iterations: u32,
    salt: Vec<u8>,
    digest: Vec<u8>,
}

impl Meta {
    /// Parses and bounds-checks the JSON of a header copy of `header_bytes`.
    fn parse(json: &Value, header_bytes: u64) -> Parsed<Meta> {
        let Some(top) = json.as_object() else {
            return damaged("the metadata is not a JSON object".into());
        };
        let config = object(top, "config", "the metadata")?;
        let keyslots_json = object(top, "keyslots", "the metadata")?;
        object(top, "tokens", "the metadata")?;
        let segments = object(top, "segments", "the metadata")?;
        let digests = object(top, "digests", "the metadata")?;
        let json_size = decimal(config, "json_size", "config")?;
        if json_size != header_bytes - BINARY_BYTES {
            return damaged(format!(
                "config json_size {json_size} does not match the header size {header_bytes}"
            ));
        }
        let keyslots_size = decimal(config, "keyslots_size", "config")?;
        if !keyslots_size.is_multiple_of(4096) || keyslots_size > MAX_KEYSLOTS_AREA {
            return damaged(format!(
                "config keyslots_size {keyslots_size} is out of range"
            ));
        }
        requirements(config)?;
        let keyslots_start = 2 * header_bytes;
        let keyslots_end = keyslots_start + keyslots_size;
        let (segment_id, segment) = parse_segment(segments, keyslots_end)?;
        let (digest_id, digest, bound) =
            parse_digests(digests, &segment_id, keyslots_json, segments)?;
        let mut keyslots = BTreeMap::new();
        for (name, v) in keyslots_json {
            let n = slot_number(name)?;
            let mut k = parse_keyslot(n, v, keyslots_start, keyslots_end)?;
            k.bound = bound.contains(&n);
            keyslots.insert(n, k);
        }
        check_overlaps(&keyslots)?;
        let mut sizes = keyslots.values().filter(|k| k.bound).map(|k| k.key_bytes);
        let Some(key_bytes) = sizes.next() else {
            return refused("no key slot holds the volume key".into());
        };
        if sizes.any(|b| b != key_bytes) {
            return damaged("the data segment's key slots disagree on the key size".into());
        }
        if !KEY_BYTES.contains(&key_bytes) {
            return refused(format!("a volume key of {key_bytes} bytes (32 or 64 are)"));
        }
        Ok(Meta {
            segment,
            key_bytes,
            keyslots,
            digest_id,
            digest,
            keyslots_start,
            keyslots_end,
        })
    }
}

/// Refuses a header with mandatory requirements: cairn knows none of them (cryptsetup
/// sets `online-reencrypt-v2` while reencrypting).
fn requirements(config: &Map<String, Value>) -> Parsed<()> {
    let Some(r) = config.get("requirements") else {
        return Ok(());
    };
    let Some(r) = r.as_object() else {
        return damaged("config requirements is not an object".into());
    };
    if r.contains_key("mandatory") {
        let names = names(r, "mandatory", "config requirements")?;
        if !names.is_empty() {
            return refused(format!(
                "mandatory requirements cairn does not support: {} (online reencryption in progress?)",
                names.join(", ")
            ));
        }
    }
    Ok(())
}

/// The one crypt segment, which must start after the key slot area (which ends at
/// `keyslots_end`).
fn parse_segment(segments: &Map<String, Value>, keyslots_end: u64) -> Parsed<(String, Segment)> {
    if segments.len() != 1 {
        return refused(format!(
            "{} data segments: cairn opens exactly one (online reencryption in progress?)",
            segments.len()
        ));
    }
    // The map has one entry: checked just above.
    let (id, s) = segments.iter().next().expect("one segment");
    let at = format!("segment {id}");
    let Some(s) = s.as_object() else {
        return damaged(format!("{at} is not an object"));
    };
    let kind = text(s, "type", &at)?;
    if kind != "crypt" {
        return refused(format!(
            "a data segment of type {kind} (crypt is supported)"
        ));
    }
    if s.contains_key("integrity") {
        return refused("an integrity segment (dm-integrity) is not supported".into());
    }
    let cipher = text(s, "encryption", &at)?;
    if cipher != CIPHER {
        return refused(format!("cipher {cipher} is not supported ({CIPHER} is)"));
    }
    let offset = decimal(s, "offset", &at)?;
    let size = match text(s, "size", &at)? {
        "dynamic" => None,
        _ => Some(decimal(s, "size", &at)?),
    };
    let iv_tweak = decimal(s, "iv_tweak", &at)?;
    let sector_bytes = number(s, "sector_size", &at)?;
    if sector_bytes != 512 && sector_bytes != 4096 {
        return refused(format!("a sector size of {sector_bytes} (512 or 4096 are)"));
    }
    if offset == 0 {
        return refused(
            "the data starts at 0: a detached header, which cairn does not open".into(),
        );
    }
    if !offset.is_multiple_of(512) || offset < keyslots_end {
        return damaged(format!(
            "the data offset {offset} is unaligned or inside the header (which ends at {keyslots_end})"
        ));
    }
    if let Some(size) = size {
        if size == 0 || !size.is_multiple_of(sector_bytes) || offset.checked_add(size).is_none() {
            return damaged(format!("the data size {size} is out of range"));
        }
    }
    let segment = Segment {
        offset,
        size,
        sector_bytes: sector_bytes as u32,
        iv_tweak,
    };
    Ok((id.clone(), segment))
}

/// The digest bound to segment `segment_id`: its name, itself, and the key slots it
/// lists. Every digest's lists must name existing key slots and segments.
fn parse_digests(
    digests: &Map<String, Value>,
    segment_id: &str,
    keyslots: &Map<String, Value>,
    segments: &Map<String, Value>,
) -> Parsed<(String, Digest, Vec<usize>)> {
    let mut found = None;
    for (id, d) in digests {
        let at = format!("digest {id}");
        let Some(d) = d.as_object() else {
            return damaged(format!("{at} is not an object"));
        };
        let slots = names(d, "keyslots", &at)?;
        let segs = names(d, "segments", &at)?;
        if let Some(s) = slots.iter().find(|s| !keyslots.contains_key(*s)) {
            return damaged(format!("{at} lists key slot {s}, which does not exist"));
        }
        if let Some(s) = segs.iter().find(|s| !segments.contains_key(*s)) {
            return damaged(format!("{at} lists segment {s}, which does not exist"));
        }
        if !segs.iter().any(|s| s == segment_id) {
            continue;
        }
        if found.is_some() {
            return refused("two digests for the data segment".into());
        }
        found = Some((id, d, slots));
    }
    let Some((id, d, slots)) = found else {
        return damaged("no digest for the data segment".into());
    };
    let at = format!("digest {id}");
    let kind = text(d, "type", &at)?;
    if kind != "pbkdf2" {
        return refused(format!("digest type {kind} is not supported (pbkdf2 is)"));
    }
    let digest = Digest {
        hash: hash(d, "hash", &at)?,
        iterations: count(d, "iterations", &at)?,
        salt: bytes(d, "salt", &at)?,
        digest: bytes(d, "digest", &at)?,
    };
    if digest.salt.is_empty()
        || (digest.digest.len() != 20 && digest.digest.len() != digest.hash.len())
    {
        return damaged(format!("{at}: salt or digest of the wrong size"));
    }
    let slots = slots
        .iter()
        .map(|s| slot_number(s))
        .collect::<Parsed<_>>()?;
    Ok((id.clone(), digest, slots))
}

/// Key slot `n`, its area inside `start..end`.
fn parse_keyslot(n: usize, v: &Value, start: u64, end: u64) -> Parsed<Keyslot> {
    let at = format!("key slot {n}");
    let Some(k) = v.as_object() else {
        return damaged(format!("{at} is not an object"));
    };
    let kind = text(k, "type", &at)?;
    if kind != "luks2" {
        return refused(format!("{at}: type {kind} is not supported (luks2 is)"));
    }
    let key_bytes = number(k, "key_size", &at)?;
    if key_bytes == 0 || key_bytes > 512 {
        return damaged(format!("{at}: a key of {key_bytes} bytes"));
    }
    let priority = match k.get("priority") {
        None => 1,
        Some(_) => number(k, "priority", &at)?,
    };
    if priority > 2 {
        return damaged(format!("{at}: priority {priority}"));
    }
    let af = object(k, "af", &at)?;
    let af_at = format!("{at} af");
    let af_kind = text(af, "type", &af_at)?;
    if af_kind != "luks1" {
        return refused(format!(
            "{af_at}: type {af_kind} is not supported (luks1 is)"
        ));
    }
    let stripes = number(af, "stripes", &af_at)?;
    if stripes == 0 || stripes > MAX_STRIPES {
        return damaged(format!("{af_at}: {stripes} stripes"));
    }
    let af_hash = hash(af, "hash", &af_at)?;
    let area = object(k, "area", &at)?;
    let area_at = format!("{at} area");
    let area_kind = text(area, "type", &area_at)?;
    if area_kind != "raw" {
        return refused(format!(
            "{area_at}: type {area_kind} is not supported (raw is)"
        ));
    }
    let cipher = text(area, "encryption", &area_at)?;
    if cipher != CIPHER {
        return refused(format!(
            "{area_at}: cipher {cipher} is not supported ({CIPHER} is)"
        ));
    }
    let area_key_bytes = number(area, "key_size", &area_at)? as usize;
    if !KEY_BYTES.contains(&area_key_bytes) {
        return refused(format!(
            "{area_at}: a key of {area_key_bytes} bytes (32 or 64 are)"
        ));
    }
    let area_offset = decimal(area, "offset", &area_at)?;
    let area_bytes = decimal(area, "size", &area_at)?;
    let material = material_bytes(key_bytes as usize, stripes as u32) as u64;
    let inside = area_offset >= start
        && area_offset.is_multiple_of(512)
        && area_offset
            .checked_add(area_bytes)
            .is_some_and(|e| e <= end)
        && area_bytes >= material;
    if !inside {
        return damaged(format!(
            "{area_at}: {area_bytes} bytes at {area_offset} do not fit the key slot area \
             ({start}..{end}) or hold {material} bytes of key material"
        ));
    }
    Ok(Keyslot {
        key_bytes: key_bytes as usize,
        priority,
        bound: false,
        stripes: stripes as u32,
        af_hash,
        area_offset,
        area_bytes,
        area_key_bytes,
        kdf: parse_kdf(object(k, "kdf", &at)?, &format!("{at} kdf"))?,
    })
}

fn parse_kdf(kdf: &Map<String, Value>, at: &str) -> Parsed<SlotKdf> {
    let kind = text(kdf, "type", at)?;
    let salt = bytes(kdf, "salt", at)?;
    if salt.len() < argon2::MIN_SALT_LEN {
        return damaged(format!("{at}: a salt of {} bytes", salt.len()));
    }
    let algorithm = match kind {
        "pbkdf2" => {
            return Ok(SlotKdf::Pbkdf2 {
                hash: hash(kdf, "hash", at)?,
                iterations: count(kdf, "iterations", at)?,
                salt,
            })
        }
        "argon2id" => argon2::Algorithm::Argon2id,
        "argon2i" => argon2::Algorithm::Argon2i,
        _ => return refused(format!("{at}: type {kind} is not supported")),
    };
    let time = count(kdf, "time", at)?;
    let memory_kib = number(kdf, "memory", at)?;
    let lanes = number(kdf, "cpus", at)?;
    if lanes == 0 || lanes > MAX_ARGON2_LANES || memory_kib < 8 * lanes {
        return damaged(format!("{at}: {memory_kib} KiB over {lanes} lanes"));
    }
    if memory_kib > MAX_ARGON2_KIB {
        return refused(format!("{at}: {memory_kib} KiB of memory (at most 4 GiB)"));
    }
    Ok(SlotKdf::Argon2 {
        algorithm,
        time,
        memory_kib: memory_kib as u32,
        lanes: lanes as u32,
        salt,
    })
}

/// Refuses key slot areas that overlap.
fn check_overlaps(keyslots: &BTreeMap<usize, Keyslot>) -> Parsed<()> {
    let mut areas: Vec<(u64, u64, usize)> = keyslots
        .iter()
        .map(|(&n, k)| (k.area_offset, k.area_bytes, n))
        .collect();
    areas.sort_unstable();
    for w in areas.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            return damaged(format!(
                "the areas of key slots {} and {} overlap",
                w[0].2, w[1].2
            ));
        }
    }
    Ok(())
}

impl SlotKdf {
    /// The key of `len` bytes it derives from `passphrase`.
    fn derive(&self, passphrase: &[u8], len: usize) -> Result<Secret, String> {
        let mut key = Secret(vec![0u8; len]);
        match self {
            SlotKdf::Pbkdf2 {
                hash,
                iterations,
                salt,
            } => hash.pbkdf2(passphrase, salt, *iterations, &mut key.0),
            SlotKdf::Argon2 {
                algorithm,
                time,
                memory_kib,
                lanes,
                salt,
            } => {
                let params = argon2::Params::new(*memory_kib, *time, *lanes, Some(len))
                    .map_err(|e| format!("argon2 parameters: {e}"))?;
                argon2::Argon2::new(*algorithm, argon2::Version::V0x13, params)
                    .hash_password_into(passphrase, salt, &mut key.0)
                    .map_err(|e| format!("argon2: {e}"))?;
            }
        }
        Ok(key)
    }

    /// As the admin sees it.
    fn public(&self) -> Kdf {
        match self {
            SlotKdf::Pbkdf2 {
                hash, iterations, ..
            } => Kdf::Pbkdf2 {
                hash: *hash,
                iterations: *iterations,
            },
            SlotKdf::Argon2 {
                algorithm: argon2::Algorithm::Argon2i,
                time,
                memory_kib,
                lanes,
                ..
            } => Kdf::Argon2i {
                time: *time,
                memory_kib: *memory_kib,
                parallel: *lanes,
            },
            SlotKdf::Argon2 {
                time,
                memory_kib,
                lanes,
                ..
            } => Kdf::Argon2id {
                time: *time,
                memory_kib: *memory_kib,
                parallel: *lanes,
            },
        }
    }

    /// Its JSON, as cryptsetup writes it.
    fn to_json(&self) -> Value {
        match self {
            SlotKdf::Pbkdf2 {
                hash,
                iterations,
                salt,
            } => json!({
                "type": "pbkdf2",
                "hash": hash.name(),
                "iterations": iterations,
                "salt": base64_encode(salt),
            }),
            SlotKdf::Argon2 {
                algorithm,
                time,
                memory_kib,
                lanes,
                salt,
            } => json!({
                "type": if *algorithm == argon2::Algorithm::Argon2i { "argon2i" } else { "argon2id" },
                "time": time,
                "memory": memory_kib,
                "cpus": lanes,
                "salt": base64_encode(salt),
            }),
        }
    }
}

/// Refuses KDF settings a new key slot cannot use.
fn check_kdf(kdf: Kdf) -> Result<(), String> {
    match kdf {
        Kdf::Pbkdf2 { iterations: 0, .. } => Err("pbkdf2 needs at least one iteration".into()),
        Kdf::Pbkdf2 { .. } => Ok(()),
        Kdf::Argon2id {
            time,
            memory_kib,
            parallel,
        }
        | Kdf::Argon2i {
            time,
            memory_kib,
            parallel,
        } => {
            if u64::from(memory_kib) > MAX_ARGON2_KIB || u64::from(parallel) > MAX_ARGON2_LANES {
                return Err(format!(
                    "argon2id over {memory_kib} KiB and {parallel} lanes (at most 4 GiB and {MAX_ARGON2_LANES})"
                ));
            }
            argon2::Params::new(memory_kib, time, parallel, Some(64))
                .map(|_| ())
                .map_err(|e| format!("argon2id parameters: {e}"))
        }
    }
}

/// Writes the key material of a new key slot for `key` opened by `passphrase` at
/// `area_offset`, and returns the slot's JSON.
fn new_keyslot(
    write: &mut WriteAt<'_>,
    key: &Secret,
    passphrase: &[u8],
    kdf: Kdf,
    area_offset: u64,
) -> Result<Value, String> {
    let key_bytes = key.0.len();
    let mut salt = vec![0u8; 32];
    super::random(&mut salt)?;
    let (slot_kdf, af_hash) = match kdf {
        Kdf::Pbkdf2 { hash, iterations } => (
            SlotKdf::Pbkdf2 {
                hash,
                iterations,
                salt,
            },
            hash,
        ),
        Kdf::Argon2id {
            time,
            memory_kib,
            parallel,
        }
        | Kdf::Argon2i {
            time,
            memory_kib,
            parallel,
        } => (
            SlotKdf::Argon2 {
                algorithm: if matches!(kdf, Kdf::Argon2i { .. }) {
                    argon2::Algorithm::Argon2i
                } else {
                    argon2::Algorithm::Argon2id
                },
                time,
                memory_kib,
                lanes: parallel,
                salt,
            },
            Hash::Sha256,
        ),
    };
    let area_key = slot_kdf.derive(passphrase, key_bytes)?;
    let mut fail = None;
    let split = af_split(&key.0, STRIPES as usize, af_hash, &mut |b| {
        if let Err(e) = super::random(b) {
            fail = Some(e);
        }
    });
    if let Some(e) = fail {
        return Err(e);
    }
    // A fresh buffer of whole sectors rather than a resize, which could leave a copy of
    // the split key in freed memory.
    let mut material = Secret(vec![0u8; material_bytes(key_bytes, STRIPES)]);
    material.0[..split.0.len()].copy_from_slice(&split.0);
    Xts::new(&area_key.0)?.run(&mut material.0, 512, 0, true);
    write(area_offset, &material.0)?;
    Ok(json!({
        "type": "luks2",
        "key_size": key_bytes,
        "af": { "type": "luks1", "stripes": STRIPES, "hash": af_hash.name() },
        "area": {
            "type": "raw",
            "offset": area_offset.to_string(),
            "size": area_bytes(key_bytes).to_string(),
            "encryption": CIPHER,
            "key_size": key_bytes,
        },
        "kdf": slot_kdf.to_json(),
    }))
}

/// Bytes of a key slot's material, whole 512-byte sectors.
fn material_bytes(key_bytes: usize, stripes: u32) -> usize {
    (key_bytes * stripes as usize).next_multiple_of(512)
}

/// Bytes of the area of a key slot cairn makes: its material rounded up to 4 KiB, as
/// cryptsetup sizes it (258048 for a 64-byte key).
fn area_bytes(key_bytes: usize) -> u64 {
    (key_bytes as u64 * u64::from(STRIPES)).next_multiple_of(4096)
}

/// Writes zeros (or random bytes) over `from..to`, a MiB at a time.
fn fill(write: &mut WriteAt<'_>, from: u64, to: u64, random: bool) -> Result<(), String> {
    const CHUNK: u64 = 1 << 20;
    let mut buf = vec![0u8; CHUNK.min(to - from) as usize];
    let mut at = from;
    while at < to {
        let n = CHUNK.min(to - at) as usize;
        if random {
            super::random(&mut buf[..n])?;
        }
        write(at, &buf[..n])?;
        at += n as u64;
    }
    Ok(())
}

/// The object `key` of `json`'s top level, to change.
fn section<'a>(json: &'a mut Value, key: &str) -> Result<&'a mut Map<String, Value>, String> {
    json.get_mut(key)
        .and_then(Value::as_object_mut)
        .ok_or(format!("the metadata has no {key} object"))
}

// Reading header copies.

/// One header copy, checked as cryptsetup checks it.
struct Copy {
    seqid: u64,
    header_bytes: u64,
    label: [u8; LABEL_BYTES],
    subsystem: [u8; LABEL_BYTES],
    uuid: String,
    json: Value,
}

/// Why a header copy was not taken.
enum CopyFault {
    /// No magic where the copy should be.
    Missing(String),
    /// A copy, but not a valid one.
    Damaged(String),
}

/// The copy at `at` (0: the primary). Its size is checked before the JSON area is read.
fn read_copy(read: &mut ReadAt<'_>, at: u64) -> Result<Copy, CopyFault> {
    let mut binary = vec![0u8; BINARY_BYTES as usize];
    read(at, &mut binary).map_err(|e| CopyFault::Missing(format!("unreadable: {e}")))?;
    let size = be64(&binary, SIZE_AT);
    if !HEADER_BYTES.contains(&size) {
        // decode_copy says what is wrong: the magic, version or size.
        return decode_copy(&binary, at);
    }
    let mut b = vec![0u8; size as usize];
    read(at, &mut b).map_err(|e| CopyFault::Damaged(format!("unreadable: {e}")))?;
    decode_copy(&b, at)
}

/// The secondary copy at the first standard offset that holds a valid one.
fn scan_secondary(read: &mut ReadAt<'_>) -> Result<Copy, CopyFault> {
    let mut first_fault = None;
    for at in HEADER_BYTES {
        match read_copy(read, at) {
            Ok(c) => return Ok(c),
            Err(CopyFault::Missing(_)) => {}
            Err(e) => {
                first_fault.get_or_insert(e);
            }
        }
    }
    Err(first_fault.unwrap_or(CopyFault::Missing(
        "no header at any of the standard offsets".into(),
    )))
}

/// The header copy `b` (its whole size) found at `at`.
fn decode_copy(b: &[u8], at: u64) -> Result<Copy, CopyFault> {
    let magic = if at == 0 { MAGIC } else { MAGIC_SECONDARY };
    if b.len() < BINARY_BYTES as usize || b[..6] != magic {
        return Err(CopyFault::Missing(format!("no header at {at} (bad magic)")));
    }
    let bad = |e: String| Err(CopyFault::Damaged(format!("the copy at {at}: {e}")));
    let version = u16::from_be_bytes([b[VERSION_AT], b[VERSION_AT + 1]]);
    if version != 2 {
        return bad(format!("version {version}"));
    }
    let size = be64(b, SIZE_AT);
    if !HEADER_BYTES.contains(&size) || b.len() as u64 != size {
        return bad(format!("a header size of {size}"));
    }
    let offset = be64(b, OFFSET_AT);
    if offset != at || (at != 0 && at != size) {
        return bad(format!("it says it is at {offset}"));
    }
    let alg = cstr(&b[CSUM_ALG_AT..SALT_AT]);
    let Some(hash) = Hash::parse(&alg) else {
        return bad(format!("checksum algorithm '{alg}' is not supported"));
    };
    let mut binary = b[..BINARY_BYTES as usize].to_vec();
    binary[CSUM_AT..CSUM_AT + 64].fill(0);
    let mut csum = vec![0u8; hash.len()];
    hash.digest(&[&binary[..], &b[BINARY_BYTES as usize..]], &mut csum);
    if csum[..] != b[CSUM_AT..CSUM_AT + csum.len()] {
        return bad("checksum mismatch".into());
    }
    let area = &b[BINARY_BYTES as usize..];
    let Some(end) = area.iter().position(|&c| c == 0) else {
        return bad("the JSON text has no end".into());
    };
    if area.first() != Some(&b'{') || area[end..].iter().any(|&c| c != 0) {
        return bad("bytes outside the JSON text".into());
    }
    let json: Value = match serde_json::from_slice(&area[..end]) {
        Ok(v) => v,
        Err(e) => return bad(format!("JSON: {e}")),
    };
    Ok(Copy {
        seqid: be64(b, SEQID_AT),
        header_bytes: size,
        label: b[LABEL_AT..LABEL_AT + LABEL_BYTES]
            .try_into()
            .expect("48 bytes"),
        subsystem: b[SUBSYSTEM_AT..SUBSYSTEM_AT + LABEL_BYTES]
            .try_into()
            .expect("48 bytes"),
        uuid: cstr(&b[UUID_AT..SUBSYSTEM_AT]),
        json,
    })
}

/// The header from the two copies: the valid one with the higher sequence number (the
/// primary on a tie).
fn choose(
    primary: Result<Copy, CopyFault>,
    secondary: Result<Copy, CopyFault>,
) -> Result<Header, String> {
    let mut good = Vec::new();
    let mut faults = Vec::new();
    let mut missing = 0;
    for (which, copy) in [("primary", primary), ("secondary", secondary)] {
        let copy = match copy {
            Ok(c) => c,
            Err(CopyFault::Missing(e)) => {
                missing += 1;
                faults.push(format!("{which}: {e}"));
                continue;
            }
            Err(CopyFault::Damaged(e)) => {
                faults.push(format!("{which}: {e}"));
                continue;
            }
        };
        match Meta::parse(&copy.json, copy.header_bytes) {
            Ok(meta) => good.push((copy, Ok(meta))),
            Err(Fault::Refused(e)) => good.push((copy, Err(e))),
            Err(Fault::Damaged(e)) => faults.push(format!("{which}: {e}")),
        }
    }
    if missing == 2 {
        return Err("no LUKS header (bad magic)".into());
    }
    let mut best: Option<(Copy, Result<Meta, String>)> = None;
    for (copy, meta) in good {
        if best.as_ref().is_none_or(|(b, _)| copy.seqid > b.seqid) {
            best = Some((copy, meta));
        }
    }
    let Some((copy, meta)) = best else {
        return Err(format!(
            "both LUKS2 header copies are damaged ({})",
            faults.join("; ")
        ));
    };
    Ok(Header {
        seqid: copy.seqid,
        header_bytes: copy.header_bytes,
        label: copy.label,
        subsystem: copy.subsystem,
        uuid: copy.uuid,
        json: copy.json,
        meta: meta?,
    })
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A NUL-terminated string field (bytes that are not UTF-8 replaced).
fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

// JSON fields, each read with the place it belongs to (`at`) for the error.

fn member<'a>(o: &'a Map<String, Value>, key: &str, at: &str) -> Parsed<&'a Value> {
    match o.get(key) {
        Some(v) => Ok(v),
        None => damaged(format!("{at} has no \"{key}\"")),
    }
}

fn object<'a>(o: &'a Map<String, Value>, key: &str, at: &str) -> Parsed<&'a Map<String, Value>> {
    match member(o, key, at)?.as_object() {
        Some(v) => Ok(v),
        None => damaged(format!("{at}: \"{key}\" is not an object")),
    }
}

fn text<'a>(o: &'a Map<String, Value>, key: &str, at: &str) -> Parsed<&'a str> {
    match member(o, key, at)?.as_str() {
        Some(v) => Ok(v),
        None => damaged(format!("{at}: \"{key}\" is not a string")),
    }
}

/// A JSON number that is an unsigned integer.
fn number(o: &Map<String, Value>, key: &str, at: &str) -> Parsed<u64> {
    match member(o, key, at)?.as_u64() {
        Some(v) => Ok(v),
        None => damaged(format!("{at}: \"{key}\" is not an unsigned integer")),
    }
}

/// A JSON number from 1 to `u32::MAX` (iterations, argon2's time).
fn count(o: &Map<String, Value>, key: &str, at: &str) -> Parsed<u32> {
    match u32::try_from(number(o, key, at)?) {
        Ok(v) if v > 0 => Ok(v),
        _ => damaged(format!("{at}: \"{key}\" is out of range")),
    }
}

/// A u64 written as a string of decimal digits (LUKS2's offsets and sizes).
fn decimal(o: &Map<String, Value>, key: &str, at: &str) -> Parsed<u64> {
    let s = text(o, key, at)?;
    match s.parse::<u64>() {
        Ok(v) if s.bytes().all(|c| c.is_ascii_digit()) => Ok(v),
        _ => damaged(format!("{at}: \"{key}\" is not a decimal string")),
    }
}

/// Base64 bytes.
fn bytes(o: &Map<String, Value>, key: &str, at: &str) -> Parsed<Vec<u8>> {
    match base64_decode(text(o, key, at)?) {
        Some(v) => Ok(v),
        None => damaged(format!("{at}: \"{key}\" is not base64")),
    }
}

/// An array of strings (key slot and segment names).
fn names(o: &Map<String, Value>, key: &str, at: &str) -> Parsed<Vec<String>> {
    let Some(list) = member(o, key, at)?.as_array() else {
        return damaged(format!("{at}: \"{key}\" is not an array"));
    };
    list.iter()
        .map(|v| match v.as_str() {
            Some(s) => Ok(s.to_string()),
            None => damaged(format!("{at}: \"{key}\" holds a non-string")),
        })
        .collect()
}

fn hash(o: &Map<String, Value>, key: &str, at: &str) -> Parsed<Hash> {
    let name = text(o, key, at)?;
    match Hash::parse(name) {
        Some(h) => Ok(h),
        None => refused(format!(
            "{at}: hash {name} is not supported (sha1, sha256, sha512 are)"
        )),
    }
}

/// A key slot's number from its name: decimal digits, below [`MAX_SLOTS`].
fn slot_number(name: &str) -> Parsed<usize> {
    match name.parse::<usize>() {
        Ok(n) if n < MAX_SLOTS && name.bytes().all(|c| c.is_ascii_digit()) => Ok(n),
        _ => damaged(format!("a key slot named '{name}'")),
    }
}

// Base64, standard alphabet with padding, as LUKS2 stores salts and digests.

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64_encode(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len().div_ceil(3) * 4);
    for c in b.chunks(3) {
        let n = c
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &x)| n | u32::from(x) << (16 - 8 * i));
        for i in 0..4 {
            if i <= c.len() {
                s.push(BASE64[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    if !b.len().is_multiple_of(4) {
        return None;
    }
    let quads = b.len() / 4;
    let mut out = Vec::with_capacity(quads * 3);
    for (i, q) in b.chunks(4).enumerate() {
        let pad = q.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && i + 1 != quads) {
            return None;
        }
        let mut n = 0u32;
        for &c in &q[..4 - pad] {
            n = n << 6 | base64_value(c)?;
        }
        n <<= 6 * pad;
        out.extend_from_slice(&n.to_be_bytes()[1..4 - pad]);
    }
    Some(out)
}

fn base64_value(c: u8) -> Option<u32> {
    let v = match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => return None,
    };
    Some(u32::from(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PBKDF2: Kdf = Kdf::Pbkdf2 {
        hash: Hash::Sha256,
        iterations: 1000,
    };
    const ARGON2ID: Kdf = Kdf::Argon2id {
        time: 1,
        memory_kib: 8 << 10,
        parallel: 1,
    };

    /// A change to a header's JSON.
    type Change = fn(&mut Value);

    /// An in-memory device of 17 MiB: the header and 1 MiB of data.
    struct Image(Vec<u8>);

    impl Image {
        fn new() -> Image {
            Image(vec![0u8; 17 << 20])
        }

        fn write(&mut self) -> impl FnMut(u64, &[u8]) -> Result<(), String> + '_ {
            |at, b| {
                let at = at as usize;
                self.0
                    .get_mut(at..at + b.len())
                    .ok_or("past the end")?
                    .copy_from_slice(b);
                Ok(())
            }
        }

        fn read(&self) -> impl FnMut(u64, &mut [u8]) -> Result<(), String> + '_ {
            |at, b| {
                let at = at as usize;
                b.copy_from_slice(self.0.get(at..at + b.len()).ok_or("past the end")?);
                Ok(())
            }
        }

        fn header(&self) -> Result<Header, String> {
            Header::read(&mut self.read())
        }

        fn unlock(&self, pass: &[u8]) -> Result<(usize, Vec<u8>), String> {
            let h = self.header()?;
            let (slot, key) = h.unlock(pass, &mut self.read())?;
            Ok((slot, key.0.clone()))
        }
    }

    fn key() -> Secret {
        Secret((0..64).map(|i| i * 3 + 1).collect())
    }

    #[test]
    fn a_made_header_reads_back_and_opens() {
        for (kdf, sector) in [(PBKDF2, 4096), (ARGON2ID, 512)] {
            let mut img = Image::new();
            let made = Header::create(&mut img.write(), &key(), b"one", kdf, sector).unwrap();
            let h = img.header().unwrap();
            assert_eq!(h.uuid(), made.uuid());
            assert_eq!(h.seqid, 1);
            assert_eq!(h.key_bytes(), 64);
            assert_eq!(
                h.segment(),
                Segment {
                    offset: 16 << 20,
                    size: None,
                    sector_bytes: sector,
                    iv_tweak: 0,
                }
            );
            assert_eq!(h.slots(), vec![SlotInfo { index: 0, kdf }]);
            assert_eq!(img.unlock(b"one").unwrap(), (0, key().0.clone()));
            assert!(h.check(&key().0));
            assert!(!h.check(&[0u8; 64]));
            let e = img.unlock(b"two").unwrap_err();
            assert!(e.contains("no key slot opens"), "{e}");
            // The data area is left alone.
            assert!(img.0[16 << 20..].iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn a_damaged_copy_leaves_the_other_and_two_refuse() {
        let mut img = Image::new();
        Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
        // A byte of the primary's JSON.
        img.0[4200] ^= 1;
        assert_eq!(img.unlock(b"one").unwrap().0, 0);
        // And the secondary's binary header.
        img.0[(16 << 10) + 20] ^= 1;
        let e = img.header().unwrap_err();
        assert!(
            e.contains("both") && e.contains("primary") && e.contains("secondary"),
            "{e}"
        );
        // The secondary alone, found by scanning when the primary's magic is gone.
        let mut img = Image::new();
        Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
        img.0[..4096].fill(0);
        assert_eq!(img.unlock(b"one").unwrap().0, 0);
    }

    #[test]
    fn a_torn_update_leaves_the_older_copy() {
        let mut img = Image::new();
        let mut h = Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
        let before = img.0[..32 << 10].to_vec();
        h.add_slot(&mut img.write(), &key(), b"two", PBKDF2)
            .unwrap();
        assert_eq!(img.header().unwrap().seqid, 2);
        // The update got as far as the new primary's binary header (seqid 2) over the
        // old JSON area; the secondary is still the old one.
        img.0[16 << 10..32 << 10].copy_from_slice(&before[16 << 10..]);
        img.0[4 << 10..16 << 10].copy_from_slice(&before[4 << 10..16 << 10]);
        assert_eq!(be64(&img.0, SEQID_AT), 2);
        let h = img.header().unwrap();
        assert_eq!(h.seqid, 1);
        assert_eq!(h.slots().len(), 1);
        // With the new primary whole, it wins over the older secondary.
        let mut img2 = Image::new();
        let mut h = Header::create(&mut img2.write(), &key(), b"one", PBKDF2, 4096).unwrap();
        let old_secondary = img2.0[16 << 10..32 << 10].to_vec();
        h.add_slot(&mut img2.write(), &key(), b"two", PBKDF2)
            .unwrap();
        img2.0[16 << 10..32 << 10].copy_from_slice(&old_secondary);
        assert_eq!(img2.header().unwrap().seqid, 2);
        assert_eq!(img2.unlock(b"two").unwrap().0, 1);
    }

    #[test]
    fn slots_are_added_and_removed() {
        let mut img = Image::new();
        let mut h = Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
        let wrong = Secret(vec![9u8; 64]);
        let e = h
            .add_slot(&mut img.write(), &wrong, b"x", PBKDF2)
            .unwrap_err();
        assert!(e.contains("not this header's volume key"), "{e}");
        assert_eq!(
            h.add_slot(&mut img.write(), &key(), b"two", ARGON2ID)
                .unwrap(),
            1
        );
        assert_eq!(img.unlock(b"two").unwrap(), (1, key().0.clone()));
        let read = img.header().unwrap();
        assert_eq!(read.seqid, 2);
        assert_eq!(read.meta.keyslots[&1].area_offset, (32 << 10) + 258048);
        h.remove_slot(&mut img.write(), 0).unwrap();
        assert!(img.unlock(b"one").is_err());
        assert_eq!(img.unlock(b"two").unwrap().0, 1);
        let e = h.remove_slot(&mut img.write(), 1).unwrap_err();
        assert!(e.contains("only key slot"), "{e}");
        assert!(h
            .remove_slot(&mut img.write(), 0)
            .unwrap_err()
            .contains("not in use"));
        // The freed number and area are used again.
        assert_eq!(
            h.add_slot(&mut img.write(), &key(), b"three", PBKDF2)
                .unwrap(),
            0
        );
        assert_eq!(
            img.header().unwrap().meta.keyslots[&0].area_offset,
            32 << 10
        );
        assert_eq!(img.unlock(b"three").unwrap().0, 0);
        let read = img.header().unwrap();
        assert_eq!(read.seqid, 4);
        let d = &read.json["digests"]["0"]["keyslots"];
        assert_eq!(d, &json!(["1", "0"]));
    }

    #[test]
    fn unknown_fields_survive_a_rewrite() {
        let mut img = Image::new();
        let mut h = Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
        let mut json = h.json.clone();
        json["config"]["flags"] = json!(["allow-discards"]);
        json["tokens"]["0"] = json!({"type": "x", "keyslots": ["0"]});
        h.commit(&mut img.write(), json).unwrap();
        h.add_slot(&mut img.write(), &key(), b"two", PBKDF2)
            .unwrap();
        h.remove_slot(&mut img.write(), 0).unwrap();
        let read = img.header().unwrap();
        assert_eq!(read.json["config"]["flags"], json!(["allow-discards"]));
        assert_eq!(
            read.json["tokens"]["0"],
            json!({"type": "x", "keyslots": []})
        );
    }

    #[test]
    fn unsupported_and_out_of_bounds_metadata_is_refused() {
        let mut img = Image::new();
        let h = Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
        let cases: [(&str, Change); 8] = [
            ("integrity", |j| j["segments"]["0"]["integrity"] = json!({})),
            ("cipher", |j| {
                j["segments"]["0"]["encryption"] = json!("serpent-xts-plain64")
            }),
            ("mandatory", |j| {
                j["config"]["requirements"] = json!({"mandatory": ["online-reencrypt-v2"]})
            }),
            ("2 data segments", |j| {
                j["segments"]["1"] = j["segments"]["0"].clone()
            }),
            ("kdf", |j| {
                j["keyslots"]["0"]["kdf"]["type"] = json!("scrypt")
            }),
            ("do not fit", |j| {
                j["keyslots"]["0"]["area"]["offset"] = json!("16777216")
            }),
            ("inside the header", |j| {
                j["segments"]["0"]["offset"] = json!("1048576")
            }),
            ("json_size", |j| j["config"]["json_size"] = json!("4190208")),
        ];
        for (want, change) in cases {
            let mut json = h.json.clone();
            change(&mut json);
            let e = Meta::parse(&json, h.header_bytes).unwrap_err().message();
            assert!(e.contains(want), "{want}: {e}");
        }
        // A refusal is not taken for damage: the error names it, not both copies.
        let mut h = h;
        let mut json = h.json.clone();
        json["segments"]["0"]["integrity"] = json!({});
        h.json = json;
        h.write_copies(&mut img.write()).unwrap();
        let e = img.header().unwrap_err();
        assert!(e.contains("integrity") && !e.contains("both"), "{e}");
    }

    #[test]
    fn not_luks2_is_refused() {
        let img = Image::new();
        assert!(img.header().unwrap_err().contains("no LUKS header"));
        let mut img = Image::new();
        img.0[..6].copy_from_slice(&MAGIC);
        img.0[7] = 1;
        assert!(img.header().unwrap_err().contains("version 1"));
    }

    #[test]
    fn base64_round_trips() {
        for n in 0..40usize {
            let b: Vec<u8> = (0..n).map(|i| (i * 37 + 5) as u8).collect();
            let s = base64_encode(&b);
            assert_eq!(s.len(), n.div_ceil(3) * 4);
            assert_eq!(base64_decode(&s).unwrap(), b);
        }
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        assert_eq!(base64_decode("Zg==").unwrap(), b"f");
        for bad in ["Zg=", "Z===", "Zg==Zg==", "Z!==", "Zm9v\n"] {
            assert!(base64_decode(bad).is_none(), "{bad}");
        }
    }
}
