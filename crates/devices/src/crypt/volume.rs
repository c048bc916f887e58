//! A LUKS header of either version, behind one interface: what the crypt device opens,
//! makes and changes.

use super::{luks1, luks2, Kdf, ReadAt, Secret, Segment, SlotInfo, WriteAt};

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
pub enum Luks {
    /// LUKS1.
    V1(Box<luks1::Header>),
    /// LUKS2.
    V2(Box<luks2::Header>),
}

/// How far into a device a LUKS header says anything: the first 4 KiB hold its magic
/// and version.
pub const PROBE_BYTES: usize = 4096;

/// What the first bytes of a device hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// A LUKS header of this version.
    Luks(Format),
    /// Zeros only: a blank device `create` may format.
    Blank,
    /// Something else.
    Other,
}

/// What `first` (the device's first [`PROBE_BYTES`]) holds.
pub fn probe(first: &[u8]) -> Probe {
    if first.len() >= 8 && first[..6] == luks1::MAGIC {
        match u16::from_be_bytes([first[6], first[7]]) {
            1 => return Probe::Luks(Format::Luks1),
            2 => return Probe::Luks(Format::Luks2),
            _ => return Probe::Other,
        }
    }
    if first.iter().all(|&b| b == 0) {
        Probe::Blank
    } else {
        Probe::Other
    }
}

impl Luks {
    /// Reads the header of `format`.
    pub fn read(format: Format, read: &mut ReadAt<'_>) -> Result<Luks, String> {
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
    ) -> Result<Luks, String> {
        Ok(match format {
            Format::Luks1 => {
                if sector_bytes != 512 {
                    return Err(format!(
                        "LUKS1 has 512-byte sectors, not {sector_bytes} (LUKS2 has 4096)"
                    ));
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
    ) -> Result<(usize, Secret), String> {
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
    ) -> Result<usize, String> {
        match self {
            Luks::V1(h) => h.add_slot(write, key, passphrase, kdf),
            Luks::V2(h) => h.add_slot(write, key, passphrase, kdf),
        }
    }

    /// Removes slot `slot` (never the last).
    pub fn remove_slot(&mut self, write: &mut WriteAt<'_>, slot: usize) -> Result<(), String> {
        match self {
            Luks::V1(h) => h.remove_slot(write, slot),
            Luks::V2(h) => h.remove_slot(write, slot),
        }
    }
}
