//! A LUKS header of either version, behind one interface: what the crypt device opens,
//! makes and changes.

use super::error::CryptError;
use super::{luks1, luks2, Kdf, ReadAt, Secret, Segment, SlotInfo, SlotKey, WriteAt};

/// Which LUKS version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// LUKS1: what qemu's luks driver reads; PBKDF2 slots, 512-byte sectors.
    Luks1,
    /// LUKS2: two header copies, argon2id slots, 512- or 4096-byte sectors.
    Luks2,
}

impl Format {
    /// `luks1` or `luks2`.
    pub fn name(self) -> &'static str {
        match self {
            Format::Luks1 => "luks1",
            Format::Luks2 => "luks2",
        }
    }

    /// From a stack file's `format`.
    pub fn parse(s: &str) -> Option<Format> {
        match s {
            "luks1" => Some(Format::Luks1),
            "luks2" => Some(Format::Luks2),
            _ => None,
        }
    }
}

/// An open header.
#[derive(Clone)]
pub enum Luks {
    /// LUKS1.
    V1(Box<luks1::Header>),
    /// LUKS2.
    V2(Box<luks2::Header>),
}

/// How far into a device a LUKS header says anything: the first 4 KiB hold its magic
/// and version.
pub const PROBE_BYTES: usize = 4096;

/// How far `create` looks for what a LUKS volume leaves behind before it formats: the
/// header and key slot area of LUKS2's default layout (16 MiB; LUKS1's, up to its
/// payload at 2 MiB, lies within it) and the first MiB of the data that follows it.
pub const BLANK_BYTES: u64 = 17 << 20;

/// What the start of a device holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// A LUKS header of this version (for LUKS2, perhaps only its secondary copy).
    Luks(Format),
    /// Zeros only, as far as asked: a blank device `create` may format.
    Blank,
    /// Something that is not a LUKS header in the first [`PROBE_BYTES`].
    Other,
    /// Zeros where a header starts but not at this offset (below [`BLANK_BYTES`]): the
    /// key slots or data of a volume whose header was wiped, say.
    NotBlank(u64),
}

/// What a device of `size` bytes holds at its start: a LUKS header (the primary copy, or
/// when the first 4 KiB are zeros a LUKS2 secondary copy at one of the standard
/// offsets), or, with `whole`, whether everything up to [`BLANK_BYTES`] is zeros.
pub fn probe(read: &mut ReadAt<'_>, size: u64, whole: bool) -> Result<Probe, CryptError> {
    let mut first = vec![0u8; PROBE_BYTES];
    read(0, &mut first)?;
    if first[..6] == luks1::MAGIC {
        return Ok(match u16::from_be_bytes([first[6], first[7]]) {
            1 => Probe::Luks(Format::Luks1),
            2 => Probe::Luks(Format::Luks2),
            _ => Probe::Other,
        });
    }
    if first.iter().any(|&b| b != 0) {
        return Ok(Probe::Other);
    }
    // The primary copy wiped: the secondary one still opens the volume, as cryptsetup
    // finds it.
    for at in luks2::HEADER_BYTES {
        let mut magic = [0u8; 6];
        if at
            .checked_add(PROBE_BYTES as u64)
            .is_some_and(|end| end <= size)
        {
            read(at, &mut magic)?;
            if magic == luks2::MAGIC_SECONDARY {
                return Ok(Probe::Luks(Format::Luks2));
            }
        }
    }
    if !whole {
        return Ok(Probe::Blank);
    }
    let end = size.min(BLANK_BYTES);
    let mut chunk = vec![0u8; 1 << 20];
    let mut at = PROBE_BYTES as u64;
    while at < end {
        let n = (end - at).min(chunk.len() as u64) as usize;
        read(at, &mut chunk[..n])?;
        if let Some(i) = chunk[..n].iter().position(|&b| b != 0) {
            return Ok(Probe::NotBlank(at + i as u64));
        }
        at += n as u64;
    }
    Ok(Probe::Blank)
}

impl Luks {
    /// Reads the header of `format`.
    pub fn read(format: Format, read: &mut ReadAt<'_>) -> Result<Luks, CryptError> {
        Ok(match format {
            Format::Luks1 => {
                let mut b = vec![0u8; luks1::HEADER_BYTES];
                read(0, &mut b)?;
                Luks::V1(Box::new(luks1::Header::decode(&b)?))
            }
            Format::Luks2 => Luks::V2(Box::new(luks2::Header::read(read)?)),
        })
    }

    /// Makes a header of `format` for volume key `key`, slot 0 opened by `passphrase`.
    pub fn create(
        format: Format,
        write: &mut WriteAt<'_>,
        key: &Secret,
        passphrase: &[u8],
        kdf: Kdf,
        sector_bytes: u32,
    ) -> Result<Luks, CryptError> {
        Ok(match format {
            Format::Luks1 => {
                if sector_bytes != 512 {
                    return Err(CryptError::Invalid(format!(
                        "LUKS1 has 512-byte sectors, not {sector_bytes} (LUKS2 has 4096)"
                    )));
                }
                Luks::V1(Box::new(luks1::Header::create(
                    write, key, passphrase, kdf,
                )?))
            }
            Format::Luks2 => Luks::V2(Box::new(luks2::Header::create(
                write,
                key,
                passphrase,
                kdf,
                sector_bytes,
            )?)),
        })
    }

    /// Its version.
    pub fn format(&self) -> Format {
        match self {
            Luks::V1(_) => Format::Luks1,
            Luks::V2(_) => Format::Luks2,
        }
    }

    /// Where the data lies.
    pub fn segment(&self) -> Segment {
        match self {
            Luks::V1(h) => h.segment(),
            Luks::V2(h) => h.segment(),
        }
    }

    /// Bytes of the volume key.
    pub fn key_bytes(&self) -> usize {
        match self {
            Luks::V1(h) => h.key_bytes as usize,
            Luks::V2(h) => h.key_bytes(),
        }
    }

    /// Its UUID.
    pub fn uuid(&self) -> &str {
        match self {
            Luks::V1(h) => &h.uuid,
            Luks::V2(h) => h.uuid(),
        }
    }

    /// The key slots in use.
    pub fn slots(&self) -> Vec<SlotInfo> {
        match self {
            Luks::V1(h) => h.slot_list(),
            Luks::V2(h) => h.slots(),
        }
    }

    /// The slot `passphrase` opens and the volume key.
    pub fn unlock(
        &self,
        passphrase: &[u8],
        read: &mut ReadAt<'_>,
    ) -> Result<(usize, Secret), CryptError> {
        match self {
            Luks::V1(h) => h.unlock(passphrase, read),
            Luks::V2(h) => h.unlock(passphrase, read),
        }
    }

    /// Whether `key` is the volume key.
    pub fn check(&self, key: &[u8]) -> bool {
        match self {
            Luks::V1(h) => h.check(key),
            Luks::V2(h) => h.check(key),
        }
    }

    /// Adds a slot holding `key` opened by `passphrase`.
    pub fn add_slot(
        &mut self,
        write: &mut WriteAt<'_>,
        key: &Secret,
        passphrase: &[u8],
        kdf: Kdf,
    ) -> Result<usize, CryptError> {
        match self {
            Luks::V1(h) => h.add_slot(write, key, passphrase, kdf),
            Luks::V2(h) => h.add_slot(write, key, passphrase, kdf),
        }
    }

    /// The key derivation a new slot asking for `kdf` gets (LUKS1: PBKDF2 with the
    /// header's hash), checked, once a slot is free.
    pub fn slot_kdf(&self, kdf: Kdf) -> Result<Kdf, CryptError> {
        match self {
            Luks::V1(h) => h.slot_kdf(kdf),
            Luks::V2(h) => h.slot_kdf(kdf),
        }
    }

    /// Adds a slot holding `key`, its material ciphered with `slot_key` (derived with
    /// what [`Luks::slot_kdf`] said).
    pub fn add_derived_slot(
        &mut self,
        write: &mut WriteAt<'_>,
        key: &Secret,
        slot_key: &SlotKey,
    ) -> Result<usize, CryptError> {
        match self {
            Luks::V1(h) => h.add_derived_slot(write, key, slot_key),
            Luks::V2(h) => h.add_derived_slot(write, key, slot_key),
        }
    }

    /// [`Luks::add_derived_slot`] for a `key` the caller checked against this header's
    /// digest already ([`Luks::check`]: a PBKDF2 of its own, which the caller may run
    /// without holding what the header is kept in). A slot for a key that is not the
    /// volume key would open to noise: only a checked key may come here.
    pub fn add_checked_slot(
        &mut self,
        write: &mut WriteAt<'_>,
        key: &Secret,
        slot_key: &SlotKey,
    ) -> Result<usize, CryptError> {
        match self {
            Luks::V1(h) => h.add_checked_slot(write, key, slot_key),
            Luks::V2(h) => h.add_checked_slot(write, key, slot_key),
        }
    }

    /// Removes slot `slot` (never the last).
    pub fn remove_slot(&mut self, write: &mut WriteAt<'_>, slot: usize) -> Result<(), CryptError> {
        match self {
            Luks::V1(h) => h.remove_slot(write, slot),
            Luks::V2(h) => h.remove_slot(write, slot),
        }
    }
}
