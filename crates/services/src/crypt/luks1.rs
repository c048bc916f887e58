//! LUKS version 1: the header cryptsetup and qemu write, the anti-forensic splitter and
//! opening a key slot with a passphrase. Read from the LUKS1 on-disk format
//! specification (1.2.3) and checked against images cryptsetup and qemu made.
//!
//! Integers are big-endian. The header holds the cipher (only `aes` with `xts-plain64` is
//! taken), the hash of the key derivation (sha1, sha256, sha512), where the payload
//! starts (in 512-byte sectors), the master key's length, a digest of the master key
//! (PBKDF2 of it, 20 bytes) and eight key slots. A slot holds the master key split into
//! `stripes` pieces (AF), ciphered with a key PBKDF2 derives from the passphrase, in
//! 512-byte sectors whose IVs count from 0.

use super::error::CryptError;
use super::xts::{Secret, Xts};
use super::{Kdf, Segment, SlotInfo, SlotKey, WriteAt};

/// The magic of a LUKS header: `LUKS` 0xBA 0xBE.
pub const MAGIC: [u8; 6] = *b"LUKS\xba\xbe";
/// A slot in use.
pub const SLOT_ACTIVE: u32 = 0x00AC_71F3;
/// A slot not in use.
pub const SLOT_DISABLED: u32 = 0x0000_DEAD;
/// Bytes of the master key's digest.
pub const DIGEST_BYTES: usize = 20;

/// A hash the key derivation and the splitter use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hash {
    /// SHA-1 (old cryptsetup's default).
    Sha1,
    /// SHA-256 (cryptsetup's and qemu's default).
    Sha256,
    /// SHA-512.
    Sha512,
}

impl Hash {
    /// From the header's hash spec.
    pub fn parse(spec: &str) -> Option<Hash> {
        match spec {
            "sha1" => Some(Hash::Sha1),
            "sha256" => Some(Hash::Sha256),
            "sha512" => Some(Hash::Sha512),
            _ => None,
        }
    }

    /// Its name in headers.
    pub fn name(self) -> &'static str {
        match self {
            Hash::Sha1 => "sha1",
            Hash::Sha256 => "sha256",
            Hash::Sha512 => "sha512",
        }
    }

    /// Bytes of its digest.
    #[allow(clippy::len_without_is_empty)] // a digest is never empty
    pub fn len(self) -> usize {
        match self {
            Hash::Sha1 => 20,
            Hash::Sha256 => 32,
            Hash::Sha512 => 64,
        }
    }

    /// The digest of `parts` one after another, cut to `out`'s length.
    pub fn digest(self, parts: &[&[u8]], out: &mut [u8]) {
        use sha2::Digest;
        fn run<D: Digest>(parts: &[&[u8]], out: &mut [u8]) {
            let mut h = D::new();
            for p in parts {
                h.update(p);
            }
            let d = h.finalize();
            let n = out.len().min(d.len());
            out[..n].copy_from_slice(&d[..n]);
        }
        match self {
            Hash::Sha1 => run::<sha1::Sha1>(parts, out),
            Hash::Sha256 => run::<sha2::Sha256>(parts, out),
            Hash::Sha512 => run::<sha2::Sha512>(parts, out),
        }
    }

    /// PBKDF2 with HMAC of this hash.
    pub fn pbkdf2(self, password: &[u8], salt: &[u8], rounds: u32, out: &mut [u8]) {
        match self {
            Hash::Sha1 => pbkdf2::pbkdf2_hmac::<sha1::Sha1>(password, salt, rounds, out),
            Hash::Sha256 => pbkdf2::pbkdf2_hmac::<sha2::Sha256>(password, salt, rounds, out),
            Hash::Sha512 => pbkdf2::pbkdf2_hmac::<sha2::Sha512>(password, salt, rounds, out),
        }
    }
}

pub use super::ReadAt;

/// One key slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// In use.
    pub active: bool,
    /// PBKDF2 iterations of the passphrase.
    pub iterations: u32,
    /// PBKDF2 salt.
    pub salt: [u8; 32],
    /// Where its key material starts, in 512-byte sectors from the start of the device.
    pub material_sector: u32,
    /// AF stripes (4000).
    pub stripes: u32,
}

/// A LUKS1 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// e.g. `aes`.
    pub cipher_name: String,
    /// e.g. `xts-plain64`.
    pub cipher_mode: String,
    /// The hash spec.
    pub hash: Hash,
    /// Where the payload starts, in 512-byte sectors.
    pub payload_sector: u32,
    /// Bytes of the master key.
    pub key_bytes: u32,
    /// PBKDF2 of the master key.
    pub digest: [u8; DIGEST_BYTES],
    /// Its salt.
    pub digest_salt: [u8; 32],
    /// Its iterations.
    pub digest_iterations: u32,
    /// The UUID, as text.
    pub uuid: String,
    /// The eight slots.
    pub slots: [Slot; 8],
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// A NUL-terminated string field. Its last byte is always the terminator, as cryptsetup
/// reads it (and as [`Header::encode`] writes it), so what is read is what is written
/// back.
fn text(field: &[u8]) -> Result<String, CryptError> {
    let b = &field[..field.len() - 1];
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    std::str::from_utf8(&b[..end])
        .map(str::to_string)
        .map_err(|_| CryptError::Damaged("a header string is not text".to_string()))
}

/// Bytes a LUKS1 header takes.
pub const HEADER_BYTES: usize = 592;

impl Header {
    /// The header at the start of `b` (at least [`HEADER_BYTES`]), or why it is not one
    /// cairn can open (in one line, whatever the header's strings hold).
    pub fn decode(b: &[u8]) -> Result<Header, CryptError> {
        Header::decode_fields(b).map_err(CryptError::one_line)
    }

    fn decode_fields(b: &[u8]) -> Result<Header, CryptError> {
        if b.len() < HEADER_BYTES || b[..6] != MAGIC {
            return Err(CryptError::NoHeader);
        }
        let version = u16::from_be_bytes([b[6], b[7]]);
        if version != 1 {
            return Err(CryptError::Unsupported(format!(
                "LUKS version {version}, not 1"
            )));
        }
        let spec = text(&b[72..104])?;
        let hash = Hash::parse(&spec).ok_or_else(|| {
            CryptError::Unsupported(format!(
                "hash '{spec}' is not supported (sha1, sha256, sha512 are)"
            ))
        })?;
        let mut slots = Vec::with_capacity(8);
        for i in 0..8 {
            let s = &b[208 + 48 * i..208 + 48 * (i + 1)];
            let state = be32(s, 0);
            if state != SLOT_ACTIVE && state != SLOT_DISABLED {
                return Err(CryptError::Damaged(format!(
                    "key slot {i}: state {state:#x} is neither active nor disabled"
                )));
            }
            slots.push(Slot {
                active: state == SLOT_ACTIVE,
                iterations: be32(s, 4),
                salt: s[8..40].try_into().expect("32 bytes"),
                material_sector: be32(s, 40),
                stripes: be32(s, 44),
            });
        }
        let h = Header {
            cipher_name: text(&b[8..40])?,
            cipher_mode: text(&b[40..72])?,
            hash,
            payload_sector: be32(b, 104),
            key_bytes: be32(b, 108),
            digest: b[112..132].try_into().expect("20 bytes"),
            digest_salt: b[132..164].try_into().expect("32 bytes"),
            digest_iterations: be32(b, 164),
            uuid: text(&b[168..208])?,
            slots: slots.try_into().expect("8 slots"),
        };
        if h.cipher_name != "aes" || h.cipher_mode != "xts-plain64" {
            return Err(CryptError::Unsupported(format!(
                "cipher {}-{} is not supported (aes-xts-plain64 is)",
                h.cipher_name, h.cipher_mode
            )));
        }
        if !super::xts::KEY_BYTES.contains(&(h.key_bytes as usize)) {
            return Err(CryptError::Unsupported(format!(
                "a master key of {} bytes (32 or 64 are)",
                h.key_bytes
            )));
        }
        h.check_slots()?;
        Ok(h)
    }

    /// Every slot's key material, in use or not (adding a key writes to a free slot's),
    /// between the header and the payload and apart from the others, as cryptsetup
    /// checks them; its stripes bounded, so that its size is.
    fn check_slots(&self) -> Result<(), CryptError> {
        let header_sectors = (HEADER_BYTES as u64).div_ceil(512);
        let mut areas = Vec::with_capacity(self.slots.len());
        for (i, s) in self.slots.iter().enumerate() {
            if s.stripes == 0 || s.stripes > STRIPES_MAX || (s.active && s.iterations == 0) {
                return Err(CryptError::Damaged(format!(
                    "key slot {i}: stripes or iterations out of range"
                )));
            }
            let start = u64::from(s.material_sector);
            let end = start + material_sectors(self.key_bytes, s.stripes);
            if start < header_sectors || end > u64::from(self.payload_sector) {
                return Err(CryptError::Damaged(format!(
                    "key slot {i}: its key material (sectors {start} to {end}) is not between the header and the payload"
                )));
            }
            areas.push((start, end, i));
        }
        areas.sort_unstable();
        for w in areas.windows(2) {
            if w[0].1 > w[1].0 {
                return Err(CryptError::Damaged(format!(
                    "the key material of slots {} and {} overlaps",
                    w[0].2, w[1].2
                )));
            }
        }
        Ok(())
    }

    /// Opens the header's first active slot `passphrase` unlocks, reading key material
    /// with `read(offset, buf)`; returns the slot and the master key.
    pub fn unlock(
        &self,
        passphrase: &[u8],
        read: &mut ReadAt<'_>,
    ) -> Result<(usize, Secret), CryptError> {
        for (i, s) in self.slots.iter().enumerate().filter(|(_, s)| s.active) {
            let mut key = Secret(vec![0u8; self.key_bytes as usize]);
            self.hash
                .pbkdf2(passphrase, &s.salt, s.iterations, &mut key.0);
            let bytes = material_sectors(self.key_bytes, s.stripes) as usize * 512;
            let mut material = Secret(vec![0u8; bytes]);
            read(u64::from(s.material_sector) * 512, &mut material.0)?;
            Xts::new(&key.0)?.run(&mut material.0, 512, 0, false);
            let used = self.key_bytes as usize * s.stripes as usize;
            let mk = af_merge(&material.0[..used], self.key_bytes as usize, self.hash);
            if self.check(&mk.0) {
                return Ok((i, mk));
            }
        }
        Err(CryptError::WrongPassphrase)
    }

    /// Whether `mk` is the master key the digest describes.
    pub fn check(&self, mk: &[u8]) -> bool {
        let mut d = [0u8; DIGEST_BYTES];
        self.hash
            .pbkdf2(mk, &self.digest_salt, self.digest_iterations, &mut d);
        d == self.digest
    }
}

/// AF stripes of every slot cairn makes (what the specification and cryptsetup use).
pub const STRIPES: u32 = 4000;
/// The most AF stripes a slot read may have (as LUKS2's limit).
const STRIPES_MAX: u32 = 65536;
/// PBKDF2 iterations of the master key's digest in headers cairn makes.
pub const DIGEST_ITERATIONS: u32 = 100_000;
/// Where cairn puts the payload when the key material ends before it: 2 MiB, as
/// cryptsetup does (1 MiB alignment).
const PAYLOAD_ALIGN_SECTORS: u32 = 2048;

impl Header {
    /// The encoded header: [`HEADER_BYTES`] bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; HEADER_BYTES];
        b[..6].copy_from_slice(&MAGIC);
        b[6..8].copy_from_slice(&1u16.to_be_bytes());
        let put = |b: &mut [u8], at: usize, len: usize, s: &str| {
            let n = s.len().min(len - 1);
            b[at..at + n].copy_from_slice(&s.as_bytes()[..n]);
        };
        put(&mut b, 8, 32, &self.cipher_name);
        put(&mut b, 40, 32, &self.cipher_mode);
        put(&mut b, 72, 32, self.hash.name());
        b[104..108].copy_from_slice(&self.payload_sector.to_be_bytes());
        b[108..112].copy_from_slice(&self.key_bytes.to_be_bytes());
        b[112..132].copy_from_slice(&self.digest);
        b[132..164].copy_from_slice(&self.digest_salt);
        b[164..168].copy_from_slice(&self.digest_iterations.to_be_bytes());
        put(&mut b, 168, 40, &self.uuid);
        for (i, s) in self.slots.iter().enumerate() {
            let at = 208 + 48 * i;
            let state = if s.active { SLOT_ACTIVE } else { SLOT_DISABLED };
            b[at..at + 4].copy_from_slice(&state.to_be_bytes());
            b[at + 4..at + 8].copy_from_slice(&s.iterations.to_be_bytes());
            b[at + 8..at + 40].copy_from_slice(&s.salt);
            b[at + 40..at + 44].copy_from_slice(&s.material_sector.to_be_bytes());
            b[at + 44..at + 48].copy_from_slice(&s.stripes.to_be_bytes());
        }
        b
    }

    /// Formats: a new header for master key `key` with slot 0 opened by `passphrase`
    /// (PBKDF2 `kdf`), laid out as cryptsetup does (slots from sector 8, each on a 4 KiB
    /// boundary; the payload at 2 MiB). The header area is zeroed first and the header
    /// written last; the payload is not touched.
    pub fn create(
        write: &mut WriteAt<'_>,
        key: &Secret,
        passphrase: &[u8],
        kdf: Kdf,
    ) -> Result<Header, CryptError> {
        let Kdf::Pbkdf2 { hash, .. } = kdf else {
            return Err(CryptError::Invalid(
                "LUKS1 key slots use pbkdf2 only (argon2id needs LUKS2)".into(),
            ));
        };
        let key_bytes = key.0.len() as u32;
        if !super::xts::KEY_BYTES.contains(&(key_bytes as usize)) {
            return Err(CryptError::Invalid(format!(
                "a master key of {key_bytes} bytes (32 or 64 are)"
            )));
        }
        let stride = (material_sectors(key_bytes, STRIPES) as u32).next_multiple_of(8);
        let mut slots = Vec::with_capacity(8);
        for i in 0..8 {
            slots.push(Slot {
                active: false,
                iterations: 0,
                salt: [0; 32],
                material_sector: 8 + stride * i,
                stripes: STRIPES,
            });
        }
        let end = 8 + stride * 8;
        let mut h = Header {
            cipher_name: "aes".into(),
            cipher_mode: "xts-plain64".into(),
            hash,
            payload_sector: end.next_multiple_of(PAYLOAD_ALIGN_SECTORS),
            key_bytes,
            digest: [0; DIGEST_BYTES],
            digest_salt: [0; 32],
            digest_iterations: DIGEST_ITERATIONS,
            uuid: super::uuid()?,
            slots: slots.try_into().expect("8 slots"),
        };
        super::random(&mut h.digest_salt)?;
        hash.pbkdf2(&key.0, &h.digest_salt, DIGEST_ITERATIONS, &mut h.digest);
        let slot_key = SlotKey::derive(h.slot_kdf(kdf)?, passphrase, key_bytes as usize)?;
        write(0, &vec![0u8; h.payload_sector as usize * 512])?;
        h.fill_slot(write, 0, key, &slot_key)?;
        write(0, &h.encode())?;
        Ok(h)
    }

    /// Writes key material for slot `i`, ciphered with `slot_key`, and marks it active
    /// in memory (not the header).
    fn fill_slot(
        &mut self,
        write: &mut WriteAt<'_>,
        i: usize,
        key: &Secret,
        slot_key: &SlotKey,
    ) -> Result<(), CryptError> {
        let iterations = match slot_key.kdf {
            Kdf::Pbkdf2 { hash, iterations } if hash == self.hash && iterations > 0 => iterations,
            other => {
                return Err(CryptError::Invalid(format!(
                    "a LUKS1 slot of this header cannot use {other}"
                )))
            }
        };
        if slot_key.key.0.len() != self.key_bytes as usize {
            return Err(CryptError::Invalid(
                "the slot key is not as long as the master key".into(),
            ));
        }
        let s = &mut self.slots[i];
        s.salt = slot_key.salt;
        s.iterations = iterations;
        let mut fail = None;
        let mut split = af_split(&key.0, s.stripes as usize, self.hash, &mut |b| {
            if let Err(e) = super::random(b) {
                fail = Some(e);
            }
        });
        if let Some(e) = fail {
            return Err(e);
        }
        let bytes = material_sectors(self.key_bytes, s.stripes) as usize * 512;
        split.0.resize(bytes, 0);
        Xts::new(&slot_key.key.0)?.run(&mut split.0, 512, 0, true);
        write(u64::from(s.material_sector) * 512, &split.0)?;
        s.active = true;
        Ok(())
    }

    /// Adds a key slot (the lowest free one) holding `key`, which must be the master key,
    /// opened by `passphrase` (PBKDF2 with the header's hash, whatever `kdf` names): its
    /// key material first, then the header.
    pub fn add_slot(
        &mut self,
        write: &mut WriteAt<'_>,
        key: &Secret,
        passphrase: &[u8],
        kdf: Kdf,
    ) -> Result<usize, CryptError> {
        let kdf = self.slot_kdf(kdf)?;
        let slot_key = SlotKey::derive(kdf, passphrase, self.key_bytes as usize)?;
        self.add_derived_slot(write, key, &slot_key)
    }

    /// The key derivation a new slot with `kdf` gets (a LUKS1 header has one hash, for
    /// its digest and every slot), checked, once a slot is free: what to derive its key
    /// with before [`Header::add_derived_slot`].
    pub fn slot_kdf(&self, kdf: Kdf) -> Result<Kdf, CryptError> {
        let iterations = match kdf {
            Kdf::Pbkdf2 { iterations: 0, .. } => {
                return Err(CryptError::Invalid(
                    "pbkdf2 needs at least one iteration".into(),
                ))
            }
            Kdf::Pbkdf2 { iterations, .. } => iterations,
            Kdf::Argon2id { .. } | Kdf::Argon2i { .. } => {
                return Err(CryptError::Invalid(
                    "LUKS1 key slots use pbkdf2 only (argon2 needs LUKS2)".into(),
                ))
            }
        };
        self.free_slot()?;
        Ok(Kdf::Pbkdf2 {
            hash: self.hash,
            iterations,
        })
    }

    fn free_slot(&self) -> Result<usize, CryptError> {
        self.slots.iter().position(|s| !s.active).ok_or_else(|| {
            CryptError::NoFreeSlot("all 8 key slots are in use: remove one first".into())
        })
    }

    /// [`Header::add_slot`] with the slot's key derived already.
    pub fn add_derived_slot(
        &mut self,
        write: &mut WriteAt<'_>,
        key: &Secret,
        slot_key: &SlotKey,
    ) -> Result<usize, CryptError> {
        if !self.check(&key.0) {
            return Err(CryptError::WrongKey { what: "master" });
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
        let i = self.free_slot()?;
        let mut next = self.clone();
        next.fill_slot(write, i, key, slot_key)?;
        write(0, &next.encode())?;
        *self = next;
        Ok(i)
    }

    /// Removes key slot `slot`: the header first, then its key material overwritten with
    /// random bytes.
    pub fn remove_slot(&mut self, write: &mut WriteAt<'_>, slot: usize) -> Result<(), CryptError> {
        if !self.slots.get(slot).is_some_and(|s| s.active) {
            return Err(CryptError::SlotNotInUse(slot));
        }
        if self.slots.iter().filter(|s| s.active).count() == 1 {
            return Err(CryptError::LastSlot(slot));
        }
        let mut next = self.clone();
        let s = &mut next.slots[slot];
        s.active = false;
        s.iterations = 0;
        s.salt = [0; 32];
        let (at, stripes) = (s.material_sector, s.stripes);
        write(0, &next.encode())?;
        let mut noise = vec![0u8; material_sectors(self.key_bytes, stripes) as usize * 512];
        super::random(&mut noise)?;
        write(u64::from(at) * 512, &noise)?;
        *self = next;
        Ok(())
    }

    /// Where the payload lies: 512-byte sectors from the payload offset, IVs from 0.
    pub fn segment(&self) -> Segment {
        Segment {
            offset: u64::from(self.payload_sector) * 512,
            size: None,
            sector_bytes: 512,
            iv_tweak: 0,
        }
    }

    /// The slots in use.
    pub fn slot_list(&self) -> Vec<SlotInfo> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.active)
            .map(|(index, s)| SlotInfo {
                index,
                kdf: Kdf::Pbkdf2 {
                    hash: self.hash,
                    iterations: s.iterations,
                },
            })
            .collect()
    }
}

/// 512-byte sectors of a slot's key material.
fn material_sectors(key_bytes: u32, stripes: u32) -> u64 {
    (u64::from(key_bytes) * u64::from(stripes)).div_ceil(512)
}

/// The splitter's diffusion: each hash-sized piece of `d` hashed after its index (a
/// big-endian u32); the last, shorter piece cut to its length.
fn diffuse(d: &mut [u8], hash: Hash) {
    let n = hash.len();
    let mut out = vec![0u8; d.len()];
    for (i, (piece, o)) in d.chunks(n).zip(out.chunks_mut(n)).enumerate() {
        hash.digest(&[&(i as u32).to_be_bytes(), piece], o);
    }
    d.copy_from_slice(&out);
}

/// The master key from its `stripes` split pieces (`material`, `len` bytes each).
pub fn af_merge(material: &[u8], len: usize, hash: Hash) -> Secret {
    let stripes = material.len() / len;
    let mut d = Secret(vec![0u8; len]);
    for s in material.chunks(len).take(stripes - 1) {
        for (x, y) in d.0.iter_mut().zip(s) {
            *x ^= y;
        }
        diffuse(&mut d.0, hash);
    }
    for (x, y) in d.0.iter_mut().zip(&material[(stripes - 1) * len..]) {
        *x ^= y;
    }
    d
}

/// `key` split into `stripes` pieces, all but the last from `random` (which fills a
/// buffer): [`af_merge`] gives `key` back.
pub fn af_split(
    key: &[u8],
    stripes: usize,
    hash: Hash,
    random: &mut dyn FnMut(&mut [u8]),
) -> Secret {
    let len = key.len();
    let mut out = Secret(vec![0u8; len * stripes]);
    random(&mut out.0[..len * (stripes - 1)]);
    let mut d = vec![0u8; len];
    for s in out.0[..len * (stripes - 1)].chunks(len) {
        for (x, y) in d.iter_mut().zip(s) {
            *x ^= y;
        }
        diffuse(&mut d, hash);
    }
    for ((o, x), k) in out.0[len * (stripes - 1)..].iter_mut().zip(&d).zip(key) {
        *o = x ^ k;
    }
    d.fill(0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn af_merge_undoes_af_split() {
        for hash in [Hash::Sha1, Hash::Sha256, Hash::Sha512] {
            for len in [32, 64, 33] {
                let key: Vec<u8> = (0..len as u8).collect();
                let mut seed = 7u8;
                let mut random = |b: &mut [u8]| {
                    for x in b {
                        seed = seed.wrapping_mul(31).wrapping_add(17);
                        *x = seed;
                    }
                };
                let split = af_split(&key, 40, hash, &mut random);
                assert_eq!(af_merge(&split.0, len, hash).0, key);
                let mut broken = split.0.clone();
                broken[5] ^= 1;
                assert_ne!(af_merge(&broken, len, hash).0, key);
            }
        }
    }

    #[test]
    fn a_made_header_opens_and_its_slots_change() {
        let mut image = vec![0u8; 3 << 20];
        let mut write = |at: u64, b: &[u8]| {
            image[at as usize..at as usize + b.len()].copy_from_slice(b);
            Ok(())
        };
        let key = Secret((0..64).collect());
        let kdf = Kdf::Pbkdf2 {
            hash: Hash::Sha256,
            iterations: 1000,
        };
        let mut h = Header::create(&mut write, &key, b"one", kdf).unwrap();
        assert_eq!(h.payload_sector, 4096);
        assert_eq!(h.add_slot(&mut write, &key, b"two", kdf).unwrap(), 1);
        let wrong = Secret(vec![1u8; 64]);
        assert!(h.add_slot(&mut write, &wrong, b"x", kdf).is_err());
        h.remove_slot(&mut write, 0).unwrap();
        assert!(h
            .remove_slot(&mut write, 1)
            .unwrap_err()
            .to_string()
            .contains("only"));
        let decoded = Header::decode(&image).unwrap();
        assert_eq!(decoded, h);
        let mut read = |at: u64, b: &mut [u8]| {
            b.copy_from_slice(&image[at as usize..at as usize + b.len()]);
            Ok(())
        };
        assert!(decoded.unlock(b"one", &mut read).is_err());
        let (slot, mk) = decoded.unlock(b"two", &mut read).unwrap();
        assert_eq!((slot, mk.0.clone()), (1, key.0.clone()));
    }

    /// A header cairn made (slot 0 in use), as bytes.
    fn made() -> Vec<u8> {
        let mut image = vec![0u8; 3 << 20];
        let mut write = |at: u64, b: &[u8]| {
            image[at as usize..at as usize + b.len()].copy_from_slice(b);
            Ok(())
        };
        let kdf = Kdf::Pbkdf2 {
            hash: Hash::Sha256,
            iterations: 1,
        };
        Header::create(&mut write, &Secret(vec![7; 32]), b"one", kdf).unwrap();
        image.truncate(HEADER_BYTES);
        image
    }

    /// String fields filled to their last byte read as cryptsetup reads them (the last
    /// byte is the terminator), so that what is read is written back the same: a full
    /// UUID field used to read as 40 bytes and be written back as 39.
    #[test]
    fn a_decoded_header_encodes_to_one_that_decodes_the_same() {
        let m = made();
        assert_eq!(Header::decode(&m).unwrap().encode(), m);
        let mut b = m;
        b[168..208].fill(b'u');
        let h = Header::decode(&b).unwrap();
        assert_eq!(h.uuid, "u".repeat(39));
        assert_eq!(Header::decode(&h.encode()).ok(), Some(h.clone()));
    }

    /// Every slot's key material is checked, in use or not: adding a key writes a free
    /// slot's material where its fields say, as long as its stripes say.
    #[test]
    fn every_slots_key_material_is_checked_in_use_or_not() {
        type Damage = fn(&mut Header);
        let damages: [(&str, Damage); 6] = [
            ("stripes", |h| h.slots[7].stripes = u32::MAX),
            ("stripes", |h| h.slots[7].stripes = 0),
            ("overlaps", |h| {
                h.slots[3].material_sector = h.slots[2].material_sector + 1
            }),
            ("between the header", |h| h.slots[0].material_sector = 1),
            ("between the header", |h| h.slots[5].material_sector = 0),
            ("between the header", |h| {
                h.slots[7].material_sector = h.payload_sector - 1
            }),
        ];
        let good = Header::decode(&made()).unwrap();
        for (want, damage) in damages {
            let mut h = good.clone();
            damage(&mut h);
            let e = Header::decode(&h.encode()).unwrap_err();
            assert!(e.to_string().contains(want), "{want}: {e}");
        }
    }

    /// A refusal quoting a header's string is one line whatever the string holds.
    #[test]
    fn a_refusal_quoting_a_header_string_is_one_line() {
        let mut b = made();
        b[72..72 + 9].copy_from_slice(b"sha256\nx\0");
        let e = Header::decode(&b).unwrap_err().to_string();
        assert!(e.contains("sha256\\nx") && !e.contains('\n'), "{e}");
    }

    #[test]
    fn bad_headers_are_refused() {
        assert!(Header::decode(&[0u8; 600])
            .unwrap_err()
            .to_string()
            .contains("magic"));
        let mut b = vec![0u8; 600];
        b[..6].copy_from_slice(&MAGIC);
        b[7] = 2;
        assert!(Header::decode(&b)
            .unwrap_err()
            .to_string()
            .contains("version 2"));
    }
}
