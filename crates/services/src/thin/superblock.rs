//! A thin pool's superblock, format version 3 (versions 1 and 2 still read): pure encode and
//! decode, no I/O. The README's "On-disk format: thin pool, version 3" documents it.
//!
//! It is kept in two 8 KiB slots at the start of the metadata area. Every checkpoint
//! writes both, with a generation one higher: first the slot not holding the newest valid
//! copy, then the other, each flushed, so a torn write leaves a valid copy and damage to
//! one slot at rest leaves the other as new as the pool. The framing (magic, version,
//! checksum) and the pick of a slot are those every record format of cairn's own shares
//! ([`cairn_core::ondisk::record`]). It says where everything else is: the data blocks,
//! the log ring ([`super::format`]) and the two checkpoint areas, of which one (or none,
//! for a new pool) holds the state replay starts from.
//!
//! All integers are little-endian.

use cairn_core::ondisk::{get32, get64, put32, put64, Frame, Invalid, Picked};

use super::pool::CHECKPOINT_BYTES_PER_BLOCK;

/// Bytes of one slot.
pub const SLOT_BYTES: usize = 8192;
/// Slots at the start of the metadata area.
pub const SLOTS: usize = 2;
/// The magic: the first 8 bytes of a slot.
pub const MAGIC: [u8; 8] = *b"CAIRNTP\0";
/// The format version this code writes. Version 2 changed the log blocks (an epoch and
/// the commit's length in every block, new magics); version 3 added the records of backup
/// checkpoints. Pools of versions 1 and 2 are still read, and written as version 3 by the
/// first open.
pub const VERSION: u32 = 3;
/// The record framing ([`cairn_core::ondisk::record`]): the magic, the version (1 to 3),
/// and the CRC-32C in the slot's last 4 bytes over all before them.
pub const FRAME: Frame = Frame::new("superblock", MAGIC, 1, VERSION, SLOT_BYTES);
/// The smallest and largest allocation unit.
pub const BLOCK_MIN: u64 = 64 << 10;
/// See [`BLOCK_MIN`].
pub const BLOCK_MAX: u64 = 1 << 30;
/// Data starts at least this far into the data device.
pub const DATA_OFFSET_MIN: u64 = 1 << 20;
/// Metadata pages (log blocks, checkpoint pages) are this size and aligned to it.
pub const PAGE: u64 = 4096;
/// Most data blocks a pool has: a mapping entry holds its block + 1 in 31 bits.
pub const DATA_BLOCKS_MAX: u64 = (1 << 31) - 2;
/// The longest log ring (a new pool's is at most this long).
pub const LOG_BYTES_MAX: u64 = 256 << 20;

/// Flag: the pool was closed cleanly (its last checkpoint holds everything).
pub const FLAG_CLEAN: u32 = 1;
/// Flag: a check found something wrong; the pool opens read-only until checked.
pub const FLAG_NEEDS_CHECK: u32 = 2;
/// Flag: the metadata area is the start of the data device.
pub const FLAG_META_ON_DATA: u32 = 4;
const FLAGS_KNOWN: u32 = FLAG_CLEAN | FLAG_NEEDS_CHECK | FLAG_META_ON_DATA;

/// Where the fields are in a slot (the magic at 0, the version at 8 and the checksum in
/// the last 4 bytes are [`FRAME`]'s).
mod at {
    pub const SLOT_BYTES: usize = 12;
    pub const GENERATION: usize = 16;
    pub const UUID: usize = 24;
    pub const FLAGS: usize = 40;
    pub const INCOMPAT: usize = 44;
    pub const BLOCK: usize = 48;
    pub const DATA_OFFSET: usize = 56;
    pub const DATA_BLOCKS: usize = 64;
    pub const LOG_OFFSET: usize = 72;
    pub const LOG_BYTES: usize = 80;
    pub const CHECKPOINT_A: usize = 88;
    pub const CHECKPOINT_B: usize = 96;
    pub const CHECKPOINT_CAPACITY: usize = 104;
    pub const CHECKPOINT_IN_USE: usize = 112;
    pub const CHECKPOINT_GENERATION: usize = 120;
    pub const CHECKPOINT_PAGES: usize = 128;
    pub const CHECKPOINT_CRC: usize = 136;
    pub const LOG_START_SEQ: usize = 144;
    pub const LOG_START_OFFSET: usize = 152;
    pub const LOW_WATER: usize = 160;
    pub const CREATED: usize = 168;
    pub const UPDATED: usize = 176;
    pub const NEXT_VOLUME: usize = 184;
}

/// The pool's superblock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSuperblock {
    /// The format version it was read as (1 or 2); [`PoolSuperblock::encode`] always
    /// writes [`VERSION`].
    pub version: u32,
    /// The valid slot with the higher one wins.
    pub generation: u64,
    /// The pool's identity (log blocks and the data device's label carry it too).
    pub pool_uuid: [u8; 16],
    /// [`FLAG_CLEAN`], [`FLAG_NEEDS_CHECK`], [`FLAG_META_ON_DATA`].
    pub flags: u32,
    /// The allocation unit: a power of two from [`BLOCK_MIN`] to [`BLOCK_MAX`].
    pub block_bytes: u64,
    /// Where data block 0 starts on the data device.
    pub data_offset: u64,
    /// Data blocks in the pool.
    pub data_blocks: u64,
    /// The log ring on the metadata area: where, and how long (whole pages).
    pub log_offset: u64,
    /// See [`PoolSuperblock::log_offset`].
    pub log_bytes: u64,
    /// The two checkpoint areas, each `checkpoint_capacity` bytes.
    pub checkpoints: [u64; 2],
    /// See [`PoolSuperblock::checkpoints`].
    pub checkpoint_capacity: u64,
    /// Which checkpoint replay starts from: 0 none (an empty pool), 1 the first, 2 the second.
    pub checkpoint_in_use: u32,
    /// The checkpoint's own generation, pages written, and CRC-32C of its pages' CRCs.
    pub checkpoint_generation: u64,
    /// See [`PoolSuperblock::checkpoint_generation`].
    pub checkpoint_pages: u64,
    /// See [`PoolSuperblock::checkpoint_generation`].
    pub checkpoint_crc: u32,
    /// Replay reads the log from this sequence number, at this offset in the ring.
    pub log_start_seq: u64,
    /// See [`PoolSuperblock::log_start_seq`].
    pub log_start_offset: u64,
    /// Below this many free blocks the pool says so (the low-water mark).
    pub low_water_blocks: u64,
    /// Unix seconds.
    pub created_secs: u64,
    /// Unix seconds.
    pub updated_secs: u64,
    /// The id the next volume gets.
    pub next_volume: u32,
}

impl PoolSuperblock {
    /// The slot's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; SLOT_BYTES];
        put32(&mut b, at::SLOT_BYTES, SLOT_BYTES as u32);
        put64(&mut b, at::GENERATION, self.generation);
        b[at::UUID..at::UUID + 16].copy_from_slice(&self.pool_uuid);
        put32(&mut b, at::FLAGS, self.flags);
        put64(&mut b, at::BLOCK, self.block_bytes);
        put64(&mut b, at::DATA_OFFSET, self.data_offset);
        put64(&mut b, at::DATA_BLOCKS, self.data_blocks);
        put64(&mut b, at::LOG_OFFSET, self.log_offset);
        put64(&mut b, at::LOG_BYTES, self.log_bytes);
        put64(&mut b, at::CHECKPOINT_A, self.checkpoints[0]);
        put64(&mut b, at::CHECKPOINT_B, self.checkpoints[1]);
        put64(&mut b, at::CHECKPOINT_CAPACITY, self.checkpoint_capacity);
        put32(&mut b, at::CHECKPOINT_IN_USE, self.checkpoint_in_use);
        put64(
            &mut b,
            at::CHECKPOINT_GENERATION,
            self.checkpoint_generation,
        );
        put64(&mut b, at::CHECKPOINT_PAGES, self.checkpoint_pages);
        put32(&mut b, at::CHECKPOINT_CRC, self.checkpoint_crc);
        put64(&mut b, at::LOG_START_SEQ, self.log_start_seq);
        put64(&mut b, at::LOG_START_OFFSET, self.log_start_offset);
        put64(&mut b, at::LOW_WATER, self.low_water_blocks);
        put64(&mut b, at::CREATED, self.created_secs);
        put64(&mut b, at::UPDATED, self.updated_secs);
        put32(&mut b, at::NEXT_VOLUME, self.next_volume);
        FRAME.seal(&mut b, VERSION);
        b
    }

    /// Reads one slot; every field is checked.
    pub fn decode(b: &[u8]) -> Result<PoolSuperblock, Invalid> {
        let version = FRAME.open(b)?.version;
        let sb = PoolSuperblock {
            version,
            generation: get64(b, at::GENERATION),
            pool_uuid: b[at::UUID..at::UUID + 16].try_into().expect("16 bytes"),
            flags: get32(b, at::FLAGS),
            block_bytes: get64(b, at::BLOCK),
            data_offset: get64(b, at::DATA_OFFSET),
            data_blocks: get64(b, at::DATA_BLOCKS),
            log_offset: get64(b, at::LOG_OFFSET),
            log_bytes: get64(b, at::LOG_BYTES),
            checkpoints: [get64(b, at::CHECKPOINT_A), get64(b, at::CHECKPOINT_B)],
            checkpoint_capacity: get64(b, at::CHECKPOINT_CAPACITY),
            checkpoint_in_use: get32(b, at::CHECKPOINT_IN_USE),
            checkpoint_generation: get64(b, at::CHECKPOINT_GENERATION),
            checkpoint_pages: get64(b, at::CHECKPOINT_PAGES),
            checkpoint_crc: get32(b, at::CHECKPOINT_CRC),
            log_start_seq: get64(b, at::LOG_START_SEQ),
            log_start_offset: get64(b, at::LOG_START_OFFSET),
            low_water_blocks: get64(b, at::LOW_WATER),
            created_secs: get64(b, at::CREATED),
            updated_secs: get64(b, at::UPDATED),
            next_volume: get32(b, at::NEXT_VOLUME),
        };
        if get32(b, at::SLOT_BYTES) as usize != SLOT_BYTES {
            return Err(FRAME.field("slot_bytes"));
        }
        if get32(b, at::INCOMPAT) != 0 {
            return Err(FRAME.field("incompat"));
        }
        sb.check().map(|()| sb)
    }

    /// Every field in range, and the metadata regions (slots, log, checkpoints) apart.
    fn check(&self) -> Result<(), Invalid> {
        let f = |name| FRAME.field(name);
        if self.flags & !FLAGS_KNOWN != 0 {
            return Err(f("flags"));
        }
        if !self.block_bytes.is_power_of_two()
            || !(BLOCK_MIN..=BLOCK_MAX).contains(&self.block_bytes)
        {
            return Err(f("block_bytes"));
        }
        if self.data_offset < DATA_OFFSET_MIN || !self.data_offset.is_multiple_of(PAGE) {
            return Err(f("data_offset"));
        }
        if self.data_blocks == 0
            || self.data_blocks > DATA_BLOCKS_MAX
            || self
                .data_blocks
                .checked_mul(self.block_bytes)
                .and_then(|d| d.checked_add(self.data_offset))
                .is_none()
        {
            return Err(f("data_blocks"));
        }
        // Opening reads the whole log ring and the checkpoint into memory: both are
        // bounded before anything is allocated for them.
        if self.log_bytes < 2 * PAGE
            || self.log_bytes > LOG_BYTES_MAX
            || !self.log_bytes.is_multiple_of(PAGE)
        {
            return Err(f("log_bytes"));
        }
        if self.checkpoint_capacity < PAGE
            || self.checkpoint_capacity > checkpoint_capacity_max(self.data_blocks)
            || !self.checkpoint_capacity.is_multiple_of(PAGE)
        {
            return Err(f("checkpoint_capacity"));
        }
        // The slots, the log and the two checkpoints: page-aligned and apart.
        let mut regions = [
            (0, (SLOTS * SLOT_BYTES) as u64, "slots"),
            (self.log_offset, self.log_bytes, "log_offset"),
            (self.checkpoints[0], self.checkpoint_capacity, "checkpoints"),
            (self.checkpoints[1], self.checkpoint_capacity, "checkpoints"),
        ];
        regions.sort_unstable();
        let mut end = 0u64;
        for (offset, len, name) in regions {
            if !offset.is_multiple_of(PAGE) || offset < end {
                return Err(f(name));
            }
            end = offset.checked_add(len).ok_or(f(name))?;
        }
        if self.flags & FLAG_META_ON_DATA != 0 && end > self.data_offset {
            return Err(f("data_offset"));
        }
        // A checkpoint in use has one page at least (an empty state is one page).
        let in_use_pages_ok = match self.checkpoint_in_use {
            0 => self.checkpoint_pages == 0,
            1 | 2 => self.checkpoint_pages >= 1,
            _ => false,
        };
        let pages_fit = self
            .checkpoint_pages
            .checked_mul(PAGE)
            .is_some_and(|b| b <= self.checkpoint_capacity);
        if !in_use_pages_ok || !pages_fit {
            return Err(f("checkpoint_in_use"));
        }
        // Replay reads block `seq` at page `seq % pages`: the start must be its page.
        if self.log_start_offset != (self.log_start_seq % (self.log_bytes / PAGE)) * PAGE {
            return Err(f("log_start_offset"));
        }
        if self.low_water_blocks > self.data_blocks {
            return Err(f("low_water_blocks"));
        }
        Ok(())
    }
}

/// The largest checkpoint area a pool of `data_blocks` has: what a new pool of that many
/// blocks gets (a whole number of pages).
pub fn checkpoint_capacity_max(data_blocks: u64) -> u64 {
    data_blocks
        .saturating_mul(CHECKPOINT_BYTES_PER_BLOCK)
        .saturating_add(1 << 20)
        .div_ceil(PAGE)
        .saturating_mul(PAGE)
}

/// What the two slots hold: the newest valid superblock (by generation) and its slot,
/// and why the other is damaged (unless valid or blank); or that both are blank, or why
/// neither is valid.
pub fn pick(area: &[u8]) -> Picked<PoolSuperblock> {
    FRAME.pick(area, PoolSuperblock::decode, |sb| sb.generation)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PoolSuperblock {
        PoolSuperblock {
            version: VERSION,
            generation: 7,
            pool_uuid: *b"poolpoolpoolpool",
            flags: FLAG_CLEAN,
            block_bytes: 64 << 10,
            data_offset: 1 << 20,
            data_blocks: 32768,
            log_offset: 16 << 10,
            log_bytes: 4 << 20,
            checkpoints: [(4 << 20) + (16 << 10), (8 << 20) + (16 << 10)],
            checkpoint_capacity: 4 << 20,
            checkpoint_in_use: 2,
            checkpoint_generation: 3,
            checkpoint_pages: 5,
            checkpoint_crc: 0xdead_beef,
            log_start_seq: 1234,
            log_start_offset: (1234 % 1024) * 4096,
            low_water_blocks: 100,
            created_secs: 1_800_000_000,
            updated_secs: 1_800_000_100,
            next_volume: 9,
        }
    }

    #[test]
    fn round_trips() {
        let b = sample().encode();
        assert_eq!(b.len(), SLOT_BYTES);
        assert_eq!(PoolSuperblock::decode(&b), Ok(sample()));
    }

    #[test]
    fn the_newest_valid_slot_wins_and_a_torn_one_leaves_the_other() {
        let older = sample();
        let newer = PoolSuperblock {
            generation: 8,
            ..sample()
        };
        let mut area = [older.encode(), newer.encode()].concat();
        assert_eq!(
            pick(&area),
            Picked::Valid {
                record: newer.clone(),
                slot: 1,
                other: Some(older.clone()),
                damaged: None,
            }
        );
        area[SLOT_BYTES + 300] ^= 1;
        assert_eq!(
            pick(&area),
            Picked::Valid {
                record: older,
                slot: 0,
                other: None,
                damaged: Some(Invalid::Checksum {
                    record: "superblock"
                }),
            }
        );
        assert_eq!(pick(&vec![0u8; 2 * SLOT_BYTES]), Picked::Blank);
    }

    /// Counts and sizes that checked arithmetic and the pool's limits refuse: each one
    /// passed before (or overflowed: a panic in a debug build, a wrapped product that
    /// passed in a release build), and opening would then allocate what it says.
    #[test]
    fn sizes_past_what_a_pool_holds_are_refused() {
        let far = 1u64 << 40;
        let cases: Vec<(PoolSuperblock, &str)> = vec![
            // 2^52 pages of 4 KiB: 2^64 bytes, which wraps to 0.
            (
                PoolSuperblock {
                    checkpoint_pages: 1 << 52,
                    ..sample()
                },
                "checkpoint_in_use",
            ),
            (
                PoolSuperblock {
                    checkpoint_pages: u64::MAX,
                    ..sample()
                },
                "checkpoint_in_use",
            ),
            // A checkpoint in use has a page at least.
            (
                PoolSuperblock {
                    checkpoint_pages: 0,
                    ..sample()
                },
                "checkpoint_in_use",
            ),
            // More blocks than a mapping entry can name.
            (
                PoolSuperblock {
                    data_blocks: DATA_BLOCKS_MAX + 1,
                    ..sample()
                },
                "data_blocks",
            ),
            // A log ring of a TiB, read whole at open.
            (
                PoolSuperblock {
                    log_bytes: far,
                    checkpoints: [far + (16 << 10), far + (16 << 10) + (4 << 20)],
                    ..sample()
                },
                "log_bytes",
            ),
            // A checkpoint area far larger than a pool of this many blocks gets.
            (
                PoolSuperblock {
                    checkpoint_capacity: far,
                    checkpoints: [(4 << 20) + (16 << 10), far + (8 << 20)],
                    ..sample()
                },
                "checkpoint_capacity",
            ),
        ];
        for (sb, field) in cases {
            assert_eq!(
                PoolSuperblock::decode(&sb.encode()),
                Err(FRAME.field(field)),
                "{sb:?}"
            );
        }
        // The limits themselves are taken.
        let edge = PoolSuperblock {
            data_blocks: DATA_BLOCKS_MAX,
            log_bytes: LOG_BYTES_MAX,
            checkpoints: [
                LOG_BYTES_MAX + (16 << 10),
                LOG_BYTES_MAX + (16 << 10) + (5 << 20),
            ],
            checkpoint_capacity: 5 << 20,
            checkpoint_pages: (5 << 20) / PAGE,
            log_start_offset: (1234 % (LOG_BYTES_MAX / PAGE)) * PAGE,
            ..sample()
        };
        assert_eq!(PoolSuperblock::decode(&edge.encode()), Ok(edge));
    }

    #[test]
    fn fields_out_of_range_are_refused() {
        let cases: Vec<(PoolSuperblock, &str)> = vec![
            (
                PoolSuperblock {
                    block_bytes: 4096,
                    ..sample()
                },
                "block_bytes",
            ),
            (
                PoolSuperblock {
                    block_bytes: 96 << 10,
                    ..sample()
                },
                "block_bytes",
            ),
            (
                PoolSuperblock {
                    data_offset: 4096,
                    ..sample()
                },
                "data_offset",
            ),
            (
                PoolSuperblock {
                    data_blocks: 0,
                    ..sample()
                },
                "data_blocks",
            ),
            (
                PoolSuperblock {
                    data_blocks: u64::MAX,
                    ..sample()
                },
                "data_blocks",
            ),
            (
                PoolSuperblock {
                    log_bytes: 4096,
                    ..sample()
                },
                "log_bytes",
            ),
            // The log over the slots; a checkpoint over the log.
            (
                PoolSuperblock {
                    log_offset: 8192,
                    ..sample()
                },
                "log_offset",
            ),
            (
                PoolSuperblock {
                    checkpoints: [1 << 20, 8 << 20],
                    ..sample()
                },
                "checkpoints",
            ),
            (
                PoolSuperblock {
                    checkpoint_in_use: 3,
                    ..sample()
                },
                "checkpoint_in_use",
            ),
            (
                PoolSuperblock {
                    checkpoint_pages: 2000,
                    ..sample()
                },
                "checkpoint_in_use",
            ),
            (
                PoolSuperblock {
                    log_start_offset: 4 << 20,
                    ..sample()
                },
                "log_start_offset",
            ),
            // Not the page of the start's sequence number.
            (
                PoolSuperblock {
                    log_start_offset: (1235 % 1024) * 4096,
                    ..sample()
                },
                "log_start_offset",
            ),
            (
                PoolSuperblock {
                    low_water_blocks: 40000,
                    ..sample()
                },
                "low_water_blocks",
            ),
            (
                PoolSuperblock {
                    flags: 8,
                    ..sample()
                },
                "flags",
            ),
            // Metadata on the data device must end before the data.
            (
                PoolSuperblock {
                    flags: FLAG_META_ON_DATA,
                    ..sample()
                },
                "data_offset",
            ),
        ];
        for (sb, field) in cases {
            assert_eq!(
                PoolSuperblock::decode(&sb.encode()),
                Err(FRAME.field(field)),
                "{sb:?}"
            );
        }
        let mut b = sample().encode();
        put32(&mut b, at::INCOMPAT, 1);
        FRAME.seal(&mut b, VERSION);
        assert_eq!(PoolSuperblock::decode(&b), Err(FRAME.field("incompat")));
        let mut b = sample().encode();
        put32(&mut b, 8, 4);
        assert_eq!(
            PoolSuperblock::decode(&b).map_err(|e| e.to_string()),
            Err("superblock version 4, this cairn reads versions 1 to 3".into())
        );
        // Version 1 is read (its checksum sealed again after the change).
        let mut b = sample().encode();
        FRAME.seal(&mut b, 1);
        assert_eq!(PoolSuperblock::decode(&b).map(|s| s.version), Ok(1));
    }
}
