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

mod copies;
mod fields;
#[doc(hidden)]
pub mod fuzz;
mod json;

use serde_json::{json, Map, Value};

use super::error::CryptError;
use super::luks1::af_merge;
use super::xts::{Xts, KEY_BYTES};
use super::{Hash, Kdf, ReadAt, Secret, Segment, SlotInfo, SlotKey, WriteAt};
use copies::{choose, decode_copy, read_copy, scan_secondary, CopyFault, LABEL_BYTES};
use fields::base64_encode;
use json::{check_kdf, new_keyslot, Fault, Keyslot, Meta};

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
/// The only cipher cairn opens, for data and key material.
const CIPHER: &str = "aes-xts-plain64";

/// A LUKS2 header: the copy that won, its JSON as read (rewritten with only the changed
/// keys, so fields cairn does not use survive), and what cairn parsed out of it.
#[derive(Debug, Clone, PartialEq)]
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
    pub fn read(read: &mut ReadAt<'_>) -> Result<Header, CryptError> {
        let mut first = [0u8; 8];
        read(0, &mut first)?;
        if first[..6] == MAGIC {
            let version = u16::from_be_bytes([first[6], first[7]]);
            if version != 2 {
                return Err(CryptError::Unsupported(format!(
                    "LUKS version {version}, not 2"
                )));
            }
        }
        let primary = read_copy(read, 0);
        let secondary = match &primary {
            Ok(p) => read_copy(read, p.header_bytes),
            Err(_) => scan_secondary(read),
        };
        choose(primary, secondary).map_err(CryptError::one_line)
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
    ) -> Result<(usize, Secret), CryptError> {
        let mut order: Vec<(&usize, &Keyslot)> =
            self.meta.keyslots.iter().filter(|(_, k)| k.bound).collect();
        order.sort_by_key(|(&n, k)| (std::cmp::Reverse(k.priority), n));
        for (&n, k) in order {
            if let Some(key) = self.open_slot(k, passphrase, read)? {
                return Ok((n, key));
            }
        }
        Err(CryptError::WrongPassphrase)
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
    ) -> Result<Header, CryptError> {
        let key_bytes = key.0.len();
        if !KEY_BYTES.contains(&key_bytes) {
            return Err(CryptError::Invalid(format!(
                "a volume key of {key_bytes} bytes (32 or 64 are)"
            )));
        }
        if sector_bytes != 512 && sector_bytes != 4096 {
            return Err(CryptError::Invalid(format!(
                "a sector size of {sector_bytes} (512 or 4096 are)"
            )));
        }
        check_kdf(kdf)?;
        let slot_key = SlotKey::derive(kdf, passphrase, key_bytes)?;
        let keyslots_start = 2 * DEFAULT_HEADER_BYTES;
        fill(write, 0, keyslots_start, false)?;
        fill(write, keyslots_start, DATA_OFFSET, true)?;
        let slot = new_keyslot(write, key, &slot_key, keyslots_start)?;
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
        let meta = Meta::parse(&json, DEFAULT_HEADER_BYTES).map_err(Fault::into_error)?;
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
    ) -> Result<usize, CryptError> {
        let kdf = self.slot_kdf(kdf)?;
        let slot_key = SlotKey::derive(kdf, passphrase, self.meta.key_bytes)?;
        self.add_derived_slot(write, key, &slot_key)
    }

    /// The key derivation a new slot with `kdf` gets, checked, once a slot number and
    /// room for its area are free: what to derive its key with before
    /// [`Header::add_derived_slot`].
    pub fn slot_kdf(&self, kdf: Kdf) -> Result<Kdf, CryptError> {
        check_kdf(kdf)?;
        self.free_slot()?;
        Ok(kdf)
    }

    /// The lowest free slot number, and where its area goes.
    fn free_slot(&self) -> Result<(usize, u64), CryptError> {
        let n = (0..MAX_SLOTS)
            .find(|n| !self.meta.keyslots.contains_key(n))
            .ok_or_else(|| {
                CryptError::NoFreeSlot(format!(
                    "all {MAX_SLOTS} key slots are in use: remove one first"
                ))
            })?;
        let offset = self
            .free_area(area_bytes(self.meta.key_bytes))
            .ok_or_else(|| {
                CryptError::NoFreeSlot(
                    "no room left in the key slot area: remove a key slot first".into(),
                )
            })?;
        Ok((n, offset))
    }

    /// [`Header::add_slot`] with the slot's key derived already.
    pub fn add_derived_slot(
        &mut self,
        write: &mut WriteAt<'_>,
        key: &Secret,
        slot_key: &SlotKey,
    ) -> Result<usize, CryptError> {
        if key.0.len() != self.meta.key_bytes || !self.check(&key.0) {
            return Err(CryptError::WrongKey { what: "volume" });
        }
        self.add_checked_slot(write, key, slot_key)
    }

    /// [`Header::add_derived_slot`] for a key [`Header::check`] passed already.
    pub fn add_checked_slot(
        &mut self,
        write: &mut WriteAt<'_>,
        key: &Secret,
        slot_key: &SlotKey,
    ) -> Result<usize, CryptError> {
        if key.0.len() != self.meta.key_bytes {
            return Err(CryptError::WrongKey { what: "volume" });
        }
        check_kdf(slot_key.kdf)?;
        let (n, offset) = self.free_slot()?;
        let slot = new_keyslot(write, key, slot_key, offset)?;
        let name = n.to_string();
        let mut json = self.json.clone();
        section(&mut json, "keyslots")?.insert(name.clone(), slot);
        let digest = section(&mut json, "digests")?
            .get_mut(&self.meta.digest_id)
            .and_then(|d| d.get_mut("keyslots"))
            .and_then(Value::as_array_mut)
            .ok_or_else(|| CryptError::Damaged("the digest has no keyslots list".into()))?;
        digest.push(Value::String(name));
        self.commit(write, json)?;
        Ok(n)
    }

    /// Removes key slot `slot`: both header copies first (the slot gone from the key
    /// slots and from every digest's and token's list), then its area overwritten with
    /// random bytes. Refuses the last slot that opens the data.
    pub fn remove_slot(&mut self, write: &mut WriteAt<'_>, slot: usize) -> Result<(), CryptError> {
        let k = self
            .meta
            .keyslots
            .get(&slot)
            .ok_or(CryptError::SlotNotInUse(slot))?;
        let bound = self.meta.keyslots.values().filter(|k| k.bound).count();
        if k.bound && bound == 1 {
            return Err(CryptError::LastSlot(slot));
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
    fn commit(&mut self, write: &mut WriteAt<'_>, json: Value) -> Result<(), CryptError> {
        let meta = Meta::parse(&json, self.header_bytes).map_err(Fault::into_error)?;
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
    fn write_copies(&self, write: &mut WriteAt<'_>) -> Result<(), CryptError> {
        let primary = self.encode(0)?;
        let secondary = self.encode(self.header_bytes)?;
        for (at, b) in [(0, &primary), (self.header_bytes, &secondary)] {
            if let Err(CopyFault::Damaged(e) | CopyFault::Missing(e)) = decode_copy(b, at) {
                return Err(CryptError::Invalid(format!(
                    "the header copy cairn made does not decode: {e}"
                )));
            }
        }
        write(0, &primary)?;
        write(self.header_bytes, &secondary)
    }

    /// The key slot `k` opened with `passphrase`: the volume key, or `None` when the
    /// passphrase is not this slot's.
    fn open_slot(
        &self,
        k: &Keyslot,
        passphrase: &[u8],
        read: &mut ReadAt<'_>,
    ) -> Result<Option<Secret>, CryptError> {
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
fn fill(write: &mut WriteAt<'_>, from: u64, to: u64, random: bool) -> Result<(), CryptError> {
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
fn section<'a>(json: &'a mut Value, key: &str) -> Result<&'a mut Map<String, Value>, CryptError> {
    json.get_mut(key)
        .and_then(Value::as_object_mut)
        .ok_or_else(|| CryptError::Damaged(format!("the metadata has no {key} object")))
}

#[cfg(test)]
mod tests;
