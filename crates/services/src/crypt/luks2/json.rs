//! The JSON metadata of a LUKS2 header: what cairn parses out of it (and the checks it
//! makes), and the JSON of the key slots it makes.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::fields::{
    base64_encode, bytes, count, decimal, hash, names, number, object, slot_number, text,
};
use super::{area_bytes, material_bytes, BINARY_BYTES, CIPHER, STRIPES};
use crate::crypt::luks1::af_split;
use crate::crypt::xts::{Xts, KEY_BYTES};
use crate::crypt::CryptError;
use crate::crypt::{Hash, Kdf, Secret, Segment, SlotKey, WriteAt};

/// The largest key slot area cryptsetup accepts.
const MAX_KEYSLOTS_AREA: u64 = 128 << 20;
/// The most argon2 memory a key slot may ask for, in KiB (cryptsetup's limit, 4 GiB).
const MAX_ARGON2_KIB: u64 = 4 << 20;
/// The most argon2 lanes a key slot may ask for.
const MAX_ARGON2_LANES: u64 = 64;
/// The most AF stripes a key slot may have.
const MAX_STRIPES: u64 = 65536;

/// Why a header copy's metadata is refused.
#[derive(Debug)]
pub(super) enum Fault {
    /// Malformed, as cryptsetup too would reject it: the other copy may serve.
    Damaged(String),
    /// Well-formed, but something cairn does not support (integrity, reencryption, a
    /// cipher): the header is refused, whatever the other copy says.
    Refused(String),
}

impl Fault {
    /// As the crate's error: damage, or a header cairn does not support.
    pub(super) fn into_error(self) -> CryptError {
        match self {
            Fault::Damaged(e) => CryptError::Damaged(e),
            Fault::Refused(e) => CryptError::Unsupported(e),
        }
    }
}

pub(super) type Parsed<T> = Result<T, Fault>;

pub(super) fn damaged<T>(msg: String) -> Parsed<T> {
    Err(Fault::Damaged(msg))
}

pub(super) fn refused<T>(msg: String) -> Parsed<T> {
    Err(Fault::Refused(msg))
}

/// What cairn takes from a header's JSON.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Meta {
    pub(super) segment: Segment,
    pub(super) key_bytes: usize,
    pub(super) keyslots: BTreeMap<usize, Keyslot>,
    pub(super) digest_id: String,
    pub(super) digest: Digest,
    pub(super) keyslots_start: u64,
    pub(super) keyslots_end: u64,
}

/// One key slot.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Keyslot {
    pub(super) key_bytes: usize,
    pub(super) priority: u64,
    /// Its digest is the data segment's: it holds the volume key.
    pub(super) bound: bool,
    pub(super) stripes: u32,
    pub(super) af_hash: Hash,
    pub(super) area_offset: u64,
    pub(super) area_bytes: u64,
    pub(super) area_key_bytes: usize,
    pub(super) kdf: SlotKdf,
}

/// How a key slot derives the key of its area.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum SlotKdf {
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
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Digest {
    pub(super) hash: Hash,
    pub(super) iterations: u32,
    pub(super) salt: Vec<u8>,
    pub(super) digest: Vec<u8>,
}

impl Meta {
    /// Parses and bounds-checks the JSON of a header copy of `header_bytes`.
    pub(super) fn parse(json: &Value, header_bytes: u64) -> Parsed<Meta> {
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
    pub(super) fn derive(&self, passphrase: &[u8], len: usize) -> Result<Secret, CryptError> {
        let salt = match self {
            SlotKdf::Pbkdf2 { salt, .. } | SlotKdf::Argon2 { salt, .. } => salt,
        };
        crate::crypt::kdf::derive(self.public(), passphrase, salt, len)
    }

    /// As the admin sees it.
    pub(super) fn public(&self) -> Kdf {
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
pub(super) fn check_kdf(kdf: Kdf) -> Result<(), CryptError> {
    match kdf {
        Kdf::Pbkdf2 { iterations: 0, .. } => Err(CryptError::Invalid(
            "pbkdf2 needs at least one iteration".into(),
        )),
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
                return Err(CryptError::Invalid(format!(
                    "argon2id over {memory_kib} KiB and {parallel} lanes (at most 4 GiB and {MAX_ARGON2_LANES})"
                )));
            }
            argon2::Params::new(memory_kib, time, parallel, Some(64))
                .map(|_| ())
                .map_err(|error| CryptError::Argon2 {
                    doing: "argon2id parameters",
                    error,
                })
        }
    }
}

/// Writes the key material of a new key slot for `key` ciphered with `slot_key` (derived
/// from its passphrase) at `area_offset`, and returns the slot's JSON.
pub(super) fn new_keyslot(
    write: &mut WriteAt<'_>,
    key: &Secret,
    slot_key: &SlotKey,
    area_offset: u64,
) -> Result<Value, CryptError> {
    let key_bytes = key.0.len();
    if slot_key.key.0.len() != key_bytes {
        return Err(CryptError::Invalid(format!(
            "a slot key of {} bytes for a {key_bytes}-byte volume key",
            slot_key.key.0.len()
        )));
    }
    let salt = slot_key.salt.to_vec();
    let (slot_kdf, af_hash) = match slot_key.kdf {
        Kdf::Pbkdf2 { hash, iterations } => (
            SlotKdf::Pbkdf2 {
                hash,
                iterations,
                salt,
            },
            hash,
        ),
        kdf @ (Kdf::Argon2id {
            time,
            memory_kib,
            parallel,
        }
        | Kdf::Argon2i {
            time,
            memory_kib,
            parallel,
        }) => (
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
    let area_key = &slot_key.key;
    let mut fail = None;
    let split = af_split(&key.0, STRIPES as usize, af_hash, &mut |b| {
        if let Err(e) = crate::crypt::random(b) {
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
