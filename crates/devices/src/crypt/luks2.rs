//! LUKS version 2 (being written: this skeleton holds the agreed API so the rest of the
//! crate builds; every body is to be replaced).

use super::{Kdf, ReadAt, Secret, Segment, SlotInfo, WriteAt};

/// A LUKS2 header (skeleton).
pub struct Header {
    _private: (),
}

impl Header {
    /// Reads the best header copy.
    pub fn read(_read: &mut ReadAt<'_>) -> Result<Header, String> {
        Err("LUKS2 is not supported yet".into())
    }
    /// The data segment.
    pub fn segment(&self) -> Segment {
        unimplemented!()
    }
    /// Bytes of the volume key.
    pub fn key_bytes(&self) -> usize {
        unimplemented!()
    }
    /// The UUID.
    pub fn uuid(&self) -> &str {
        unimplemented!()
    }
    /// Active keyslots.
    pub fn slots(&self) -> Vec<SlotInfo> {
        unimplemented!()
    }
    /// Opens a keyslot with the passphrase.
    pub fn unlock(&self, _p: &[u8], _read: &mut ReadAt<'_>) -> Result<(usize, Secret), String> {
        unimplemented!()
    }
    /// Whether `key` is the volume key.
    pub fn check(&self, _key: &[u8]) -> bool {
        unimplemented!()
    }
    /// Formats.
    pub fn create(
        _write: &mut WriteAt<'_>,
        _key: &Secret,
        _p: &[u8],
        _kdf: Kdf,
        _sector_bytes: u32,
    ) -> Result<Header, String> {
        Err("LUKS2 is not supported yet".into())
    }
    /// Adds a keyslot.
    pub fn add_slot(
        &mut self,
        _write: &mut WriteAt<'_>,
        _key: &Secret,
        _p: &[u8],
        _kdf: Kdf,
    ) -> Result<usize, String> {
        unimplemented!()
    }
    /// Removes a keyslot.
    pub fn remove_slot(&mut self, _write: &mut WriteAt<'_>, _slot: usize) -> Result<(), String> {
        unimplemented!()
    }
}
