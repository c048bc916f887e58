//! `--verify crc32c`: every written block says what it is, and reads check it.
//!
//! A block written with verification on starts with a 32-byte header (magic, the block's
//! own offset, a write generation, a CRC-32C, the block length) followed by pseudo-random
//! bytes derived from offset and generation. The CRC covers everything but itself. A read
//! of a block this run has written must find exactly the last generation written there:
//! zeros, another block's data, stale data or a flipped bit are all caught, and named.

use std::fmt;

/// Header magic ("CAIRNVFY" as little-endian bytes).
pub const MAGIC: u64 = u64::from_le_bytes(*b"CAIRNVFY");
/// Header length in bytes; blocks must be at least this long.
pub const HEADER_BYTES: usize = 32;

/// What a verified read found wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// No cairn header (the first bytes are shown).
    NoHeader {
        /// The first 8 bytes found.
        found: [u8; 8],
    },
    /// The block was written for another offset.
    WrongOffset {
        /// The offset recorded in the block.
        found: u64,
    },
    /// The block holds an older or newer write than the last one acknowledged.
    WrongGeneration {
        /// Generation expected.
        expected: u64,
        /// Generation found.
        found: u64,
    },
    /// The header is intact but the contents do not match their checksum.
    BadChecksum {
        /// CRC recorded.
        stored: u32,
        /// CRC computed.
        computed: u32,
    },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::NoHeader { found } => {
                write!(f, "no verify header (first bytes {found:02x?})")
            }
            Mismatch::WrongOffset { found } => {
                write!(f, "block holds data written for offset {found}")
            }
            Mismatch::WrongGeneration { expected, found } => {
                write!(
                    f,
                    "stale or misplaced write: generation {found} found, {expected} expected"
                )
            }
            Mismatch::BadChecksum { stored, computed } => {
                write!(
                    f,
                    "checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
                )
            }
        }
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn crc_of(block: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&block[..24]);
    crc32c::crc32c_append(crc, &block[28..])
}

/// Fills `block` (at least [`HEADER_BYTES`] long, a multiple of 8) for `offset`, `generation`.
pub fn fill(block: &mut [u8], offset: u64, generation: u64) {
    debug_assert!(block.len() >= HEADER_BYTES && block.len().is_multiple_of(8));
    let mut state = offset ^ generation.rotate_left(32) ^ MAGIC;
    for chunk in block[HEADER_BYTES..].chunks_exact_mut(8) {
        chunk.copy_from_slice(&splitmix(&mut state).to_le_bytes());
    }
    block[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    block[8..16].copy_from_slice(&offset.to_le_bytes());
    block[16..24].copy_from_slice(&generation.to_le_bytes());
    let len = block.len() as u32;
    block[28..32].copy_from_slice(&len.to_le_bytes());
    let crc = crc_of(block);
    block[24..28].copy_from_slice(&crc.to_le_bytes());
}

/// Checks that `block`, read at `offset`, holds exactly generation `expected`.
pub fn check(block: &[u8], offset: u64, expected: u64) -> Result<(), Mismatch> {
    let word = |at: usize| u64::from_le_bytes(block[at..at + 8].try_into().expect("8 bytes"));
    if word(0) != MAGIC {
        return Err(Mismatch::NoHeader {
            found: block[..8].try_into().expect("8 bytes"),
        });
    }
    let stored = u32::from_le_bytes(block[24..28].try_into().expect("4 bytes"));
    let computed = crc_of(block);
    if stored != computed {
        return Err(Mismatch::BadChecksum { stored, computed });
    }
    if word(8) != offset {
        return Err(Mismatch::WrongOffset { found: word(8) });
    }
    if word(16) != expected {
        return Err(Mismatch::WrongGeneration {
            expected,
            found: word(16),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_kind_of_damage() {
        let mut b = vec![0u8; 4096];
        fill(&mut b, 8192, 7);
        assert_eq!(check(&b, 8192, 7), Ok(()));
        assert!(matches!(
            check(&b, 4096, 7),
            Err(Mismatch::WrongOffset { found: 8192 })
        ));
        assert!(matches!(
            check(&b, 8192, 8),
            Err(Mismatch::WrongGeneration { .. })
        ));
        let mut flipped = b.clone();
        flipped[1000] ^= 1;
        assert!(matches!(
            check(&flipped, 8192, 7),
            Err(Mismatch::BadChecksum { .. })
        ));
        let zeros = vec![0u8; 4096];
        assert!(matches!(
            check(&zeros, 8192, 7),
            Err(Mismatch::NoHeader { .. })
        ));
        let mut other = vec![0u8; 4096];
        fill(&mut other, 8192, 8);
        assert_ne!(b[HEADER_BYTES..], other[HEADER_BYTES..]);
    }
}
