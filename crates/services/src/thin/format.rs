//! A thin pool's metadata log: pure encode and decode, no I/O.
//!
//! Every change to a pool's mappings and volumes is a [`Record`]. A commit writes its
//! records in consecutive 4 KiB [`LogBlock`]s of a ring, the last one flagged. Since
//! format version 2 every block also says which commit it belongs to (the sequence number
//! of the commit's first block, and how many blocks the commit has) and which superblock's
//! log it extends (its `epoch`: the generation of the superblock in use when it was
//! written; every open writes a new superblock, so every open starts a new epoch).
//!
//! [`replay`] takes commits in sequence order while every block is valid and in place,
//! and then looks at the rest of the ring to tell a torn tail from damage:
//!
//! - A commit counts only when all its blocks were read back valid, so a write torn by a
//!   power cut leaves the pool as its last whole commit left it, and a block left over
//!   from a commit torn before an earlier open (another epoch) is never taken for one.
//! - Commits are written one after another, each flushed before the next starts: a valid
//!   block of a *later* commit of this epoch, found past the point where replay stopped,
//!   proves that the commit replay stopped in was whole once. That is damage, not a torn
//!   tail, and [`replay`] refuses it ([`Damage::Inside`]).
//! - A block of a *later* epoch proves that a newer superblock was written and flushed
//!   before it, so the superblock in use is older than the pool ([`Damage::Newer`]).
//!
//! What cannot be told apart: damage to the blocks of the last commit before a crash
//! looks like that commit torn by the crash, and is dropped as one (with a warning).
//!
//! Version 1 blocks (no epoch, no commit length) are still read, with version 1's rules,
//! so that a pool made by an older cairn opens; the open then writes the current version.
//! Version 3 keeps version 2's blocks and adds the records of backup checkpoints
//! ([`Record::Mark`], [`Record::Unsnap`], [`Record::Changed`], [`Record::Unmark`]),
//! refused in a block of an older version.
//!
//! All integers are little-endian.

/// Bytes of one log block.
pub const BLOCK_BYTES: usize = 4096;
/// The log block's magic: its first 8 bytes.
pub const MAGIC: [u8; 8] = *b"CAIRNTL2";
/// A checkpoint page's magic (the same layout as a log block: `seq` is the page's
/// index, `epoch` the checkpoint's generation, `last` its final page).
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"CAIRNTC2";
/// Version 1's magics (a block of one version never reads as one of the other).
pub const MAGIC_V1: [u8; 8] = *b"CAIRNTL\0";
/// See [`MAGIC_V1`].
pub const CHECKPOINT_MAGIC_V1: [u8; 8] = *b"CAIRNTC\0";
/// Longest volume name a record carries.
pub const NAME_MAX: usize = 255;

/// Where the header's fields are in a log block.
mod at {
    pub const MAGIC: usize = 0;
    pub const UUID: usize = 8;
    pub const SEQ: usize = 24;
    pub const COMMIT: usize = 32;
    pub const FLAGS: usize = 40;
    pub const RECORD_BYTES: usize = 44;
    /// Version 1: the records start here.
    pub const RECORDS_V1: usize = 48;
    pub const EPOCH: usize = 48;
    pub const BLOCKS: usize = 56;
    pub const RESERVED: usize = 60;
    pub const RECORDS: usize = 64;
    pub const CRC: usize = super::BLOCK_BYTES - 4;
}

/// Room for records in one block.
pub const RECORDS_MAX_BYTES: usize = at::CRC - at::RECORDS;
/// Flag: the last block of its commit.
const FLAG_LAST: u32 = 1;
/// One change to the pool. Volumes are named by id (`vol`); data blocks by their index
/// on the data device, in units of the pool's block size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// Volume `vol`'s virtual block `vblock` maps to `entry` (0: a hole; else the data
    /// block + 1, with the top bit set when the volume owns it alone).
    Set {
        /// The volume.
        vol: u32,
        /// Its virtual block.
        vblock: u64,
        /// The mapping.
        entry: u32,
    },
    /// Data blocks `[start, start + len)` are handed to reactors for allocation.
    Reserve {
        /// The first block.
        start: u64,
        /// How many.
        len: u64,
    },
    /// Freed data blocks `[start, start + len)` have been zeroed and are free again.
    Zeroed {
        /// The first block.
        start: u64,
        /// How many.
        len: u64,
    },
    /// A volume is created, empty.
    Create {
        /// Its id.
        vol: u32,
        /// Its virtual size in bytes.
        size: u64,
        /// Bit 0: read-only.
        flags: u32,
        /// Its name (at most [`NAME_MAX`] bytes of UTF-8).
        name: String,
    },
    /// Volume `new` is made a copy of `src`'s mappings (a snapshot or a clone).
    Snapshot {
        /// The volume copied.
        src: u32,
        /// The new volume's id.
        new: u32,
        /// Bit 0: read-only (a snapshot; a clone is writable).
        flags: u32,
        /// The new volume's name.
        name: String,
    },
    /// A volume is deleted; its blocks lose a reference each.
    Delete {
        /// The volume.
        vol: u32,
    },
    /// A volume's virtual size changes.
    Grow {
        /// The volume.
        vol: u32,
        /// Its new size in bytes.
        size: u64,
    },
    /// Checkpoints only: `len` consecutive virtual blocks from `vblock` map to
    /// consecutive entries from `entry` (same ownership bit).
    Run {
        /// The volume.
        vol: u32,
        /// The first virtual block.
        vblock: u64,
        /// The first one's entry.
        entry: u32,
        /// How many.
        len: u32,
    },
    /// Checkpoints only: data blocks `[start, start + len)` are in `state` (1 reserved,
    /// 2 used by `count` volumes, 3 freed and not yet zeroed); blocks named by no such
    /// record are free.
    Blocks {
        /// The first block.
        start: u64,
        /// How many.
        len: u64,
        /// The state.
        state: u8,
        /// With state 2: how many volumes map each.
        count: u32,
    },
    /// Version 3: snapshot `snap` of volume `vol` is checkpoint `id`, named `name` (as the
    /// snapshot is), whose changes are counted at `1 << shift` bytes. In a checkpoint
    /// page, `snap` 0: its snapshot is gone (a [`Record::Unsnap`] follows).
    Mark {
        /// The checkpoint's id: higher than every checkpoint's before it.
        id: u32,
        /// The volume checkpointed.
        vol: u32,
        /// Its snapshot at the checkpoint.
        snap: u32,
        /// Log2 of the granularity its changes are reported in.
        shift: u8,
        /// The checkpoint's name.
        name: String,
    },
    /// Version 3: checkpoint `id`'s snapshot is gone; the virtual blocks that changed
    /// from it to checkpoint `target` of the same volume are the [`Record::Changed`]
    /// runs that follow (any it had before are dropped).
    Unsnap {
        /// The checkpoint.
        id: u32,
        /// A later checkpoint of the same volume.
        target: u32,
    },
    /// Version 3: virtual blocks `[vblock, vblock + len)` changed between checkpoint `id`
    /// (whose snapshot is gone) and its target.
    Changed {
        /// The checkpoint.
        id: u32,
        /// The first virtual block.
        vblock: u64,
        /// How many.
        len: u64,
    },
    /// Version 3: checkpoint `id` is no more.
    Unmark {
        /// The checkpoint.
        id: u32,
    },
    /// Version 3: volume `vol` is served as export `name` (one added while serving, kept
    /// for the next start); flags bit 0: writable.
    Export {
        /// The volume.
        vol: u32,
        /// Bit 0: writable.
        flags: u32,
        /// The export's name.
        name: String,
    },
    /// Version 3: export `name` is no more.
    Unexport {
        /// The export's name.
        name: String,
    },
}

mod tag {
    pub const SET: u8 = 1;
    pub const RESERVE: u8 = 2;
    pub const ZEROED: u8 = 3;
    pub const CREATE: u8 = 4;
    pub const SNAPSHOT: u8 = 5;
    pub const DELETE: u8 = 6;
    pub const GROW: u8 = 7;
    pub const RUN: u8 = 8;
    pub const BLOCKS: u8 = 9;
    pub const MARK: u8 = 10;
    pub const UNSNAP: u8 = 11;
    pub const CHANGED: u8 = 12;
    pub const UNMARK: u8 = 13;
    pub const EXPORT: u8 = 14;
    pub const UNEXPORT: u8 = 15;
}

/// Why bytes are not a valid log block (or record).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalid {
    /// All zeros: never written.
    Blank,
    /// Not this format's magic.
    Magic,
    /// The checksum does not match (a torn or damaged write).
    Checksum,
    /// Another pool's block.
    Pool,
    /// A field out of range, named.
    Field(&'static str),
}

impl Record {
    /// Whether only version 3 has it (a checkpoint's record).
    fn is_version_3(&self) -> bool {
        matches!(
            self,
            Record::Mark { .. }
                | Record::Unsnap { .. }
                | Record::Changed { .. }
                | Record::Unmark { .. }
                | Record::Export { .. }
                | Record::Unexport { .. }
        )
    }

    /// Bytes this record takes in a block.
    pub fn encoded_len(&self) -> usize {
        1 + match self {
            Record::Set { .. } => 4 + 8 + 4,
            Record::Reserve { .. } | Record::Zeroed { .. } => 16,
            Record::Create { name, .. } => 4 + 8 + 4 + 1 + name.len(),
            Record::Snapshot { name, .. } => 4 + 4 + 4 + 1 + name.len(),
            Record::Delete { .. } => 4,
            Record::Grow { .. } => 4 + 8,
            Record::Run { .. } => 4 + 8 + 4 + 4,
            Record::Blocks { .. } => 8 + 8 + 1 + 4,
            Record::Mark { name, .. } => 4 + 4 + 4 + 1 + 1 + name.len(),
            Record::Unsnap { .. } => 4 + 4,
            Record::Changed { .. } => 4 + 8 + 8,
            Record::Unmark { .. } => 4,
            Record::Export { name, .. } => 4 + 4 + 1 + name.len(),
            Record::Unexport { name } => 1 + name.len(),
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        let name_of = |out: &mut Vec<u8>, name: &str| {
            assert!(name.len() <= NAME_MAX, "a name of at most {NAME_MAX} bytes");
            out.push(name.len() as u8);
            out.extend_from_slice(name.as_bytes());
        };
        match self {
            Record::Set { vol, vblock, entry } => {
                out.push(tag::SET);
                out.extend_from_slice(&vol.to_le_bytes());
                out.extend_from_slice(&vblock.to_le_bytes());
                out.extend_from_slice(&entry.to_le_bytes());
            }
            Record::Reserve { start, len } | Record::Zeroed { start, len } => {
                out.push(if matches!(self, Record::Reserve { .. }) {
                    tag::RESERVE
                } else {
                    tag::ZEROED
                });
                out.extend_from_slice(&start.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            Record::Create {
                vol,
                size,
                flags,
                name,
            } => {
                out.push(tag::CREATE);
                out.extend_from_slice(&vol.to_le_bytes());
                out.extend_from_slice(&size.to_le_bytes());
                out.extend_from_slice(&flags.to_le_bytes());
                name_of(out, name);
            }
            Record::Snapshot {
                src,
                new,
                flags,
                name,
            } => {
                out.push(tag::SNAPSHOT);
                out.extend_from_slice(&src.to_le_bytes());
                out.extend_from_slice(&new.to_le_bytes());
                out.extend_from_slice(&flags.to_le_bytes());
                name_of(out, name);
            }
            Record::Delete { vol } => {
                out.push(tag::DELETE);
                out.extend_from_slice(&vol.to_le_bytes());
            }
            Record::Grow { vol, size } => {
                out.push(tag::GROW);
                out.extend_from_slice(&vol.to_le_bytes());
                out.extend_from_slice(&size.to_le_bytes());
            }
            Record::Run {
                vol,
                vblock,
                entry,
                len,
            } => {
                out.push(tag::RUN);
                out.extend_from_slice(&vol.to_le_bytes());
                out.extend_from_slice(&vblock.to_le_bytes());
                out.extend_from_slice(&entry.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            Record::Blocks {
                start,
                len,
                state,
                count,
            } => {
                out.push(tag::BLOCKS);
                out.extend_from_slice(&start.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
                out.push(*state);
                out.extend_from_slice(&count.to_le_bytes());
            }
            _ => self.encode_v3(out),
        }
    }

    /// [`Record::encode`] for the records version 3 added.
    fn encode_v3(&self, out: &mut Vec<u8>) {
        let name_of = |out: &mut Vec<u8>, name: &str| {
            assert!(name.len() <= NAME_MAX, "a name of at most {NAME_MAX} bytes");
            out.push(name.len() as u8);
            out.extend_from_slice(name.as_bytes());
        };
        match self {
            Record::Mark {
                id,
                vol,
                snap,
                shift,
                name,
            } => {
                out.push(tag::MARK);
                out.extend_from_slice(&id.to_le_bytes());
                out.extend_from_slice(&vol.to_le_bytes());
                out.extend_from_slice(&snap.to_le_bytes());
                out.push(*shift);
                name_of(out, name);
            }
            Record::Unsnap { id, target } => {
                out.push(tag::UNSNAP);
                out.extend_from_slice(&id.to_le_bytes());
                out.extend_from_slice(&target.to_le_bytes());
            }
            Record::Changed { id, vblock, len } => {
                out.push(tag::CHANGED);
                out.extend_from_slice(&id.to_le_bytes());
                out.extend_from_slice(&vblock.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            Record::Unmark { id } => {
                out.push(tag::UNMARK);
                out.extend_from_slice(&id.to_le_bytes());
            }
            Record::Export { vol, flags, name } => {
                out.push(tag::EXPORT);
                out.extend_from_slice(&vol.to_le_bytes());
                out.extend_from_slice(&flags.to_le_bytes());
                name_of(out, name);
            }
            Record::Unexport { name } => {
                out.push(tag::UNEXPORT);
                name_of(out, name);
            }
            _ => unreachable!("a record of versions 1 and 2: {self:?}"),
        }
    }

    /// Reads one record from the start of `b`; returns it and the bytes it took.
    fn decode(b: &[u8]) -> Result<(Record, usize), Invalid> {
        let mut r = Reader { b, at: 1 };
        let t = *b.first().ok_or(Invalid::Field("record"))?;
        let rec = match t {
            tag::SET => Record::Set {
                vol: r.u32()?,
                vblock: r.u64()?,
                entry: r.u32()?,
            },
            tag::RESERVE => Record::Reserve {
                start: r.u64()?,
                len: r.u64()?,
            },
            tag::ZEROED => Record::Zeroed {
                start: r.u64()?,
                len: r.u64()?,
            },
            tag::CREATE => Record::Create {
                vol: r.u32()?,
                size: r.u64()?,
                flags: r.u32()?,
                name: r.name()?,
            },
            tag::SNAPSHOT => Record::Snapshot {
                src: r.u32()?,
                new: r.u32()?,
                flags: r.u32()?,
                name: r.name()?,
            },
            tag::DELETE => Record::Delete { vol: r.u32()? },
            tag::GROW => Record::Grow {
                vol: r.u32()?,
                size: r.u64()?,
            },
            tag::RUN => Record::Run {
                vol: r.u32()?,
                vblock: r.u64()?,
                entry: r.u32()?,
                len: r.u32()?,
            },
            tag::BLOCKS => Record::Blocks {
                start: r.u64()?,
                len: r.u64()?,
                state: r.take(1)?[0],
                count: r.u32()?,
            },
            tag::MARK => Record::Mark {
                id: r.u32()?,
                vol: r.u32()?,
                snap: r.u32()?,
                shift: r.take(1)?[0],
                name: r.name()?,
            },
            tag::UNSNAP => Record::Unsnap {
                id: r.u32()?,
                target: r.u32()?,
            },
            tag::CHANGED => Record::Changed {
                id: r.u32()?,
                vblock: r.u64()?,
                len: r.u64()?,
            },
            tag::UNMARK => Record::Unmark { id: r.u32()? },
            tag::EXPORT => Record::Export {
                vol: r.u32()?,
                flags: r.u32()?,
                name: r.name()?,
            },
            tag::UNEXPORT => Record::Unexport { name: r.name()? },
            _ => return Err(Invalid::Field("record type")),
        };
        Ok((rec, r.at))
    }
}

/// Reads little-endian fields from a record, failing at its end.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Invalid> {
        let s = self
            .b
            .get(self.at..self.at + n)
            .ok_or(Invalid::Field("record length"))?;
        self.at += n;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, Invalid> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, Invalid> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn name(&mut self) -> Result<String, Invalid> {
        let n = self.take(1)?[0] as usize;
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| Invalid::Field("name"))
    }
}

/// One 4 KiB block of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogBlock {
    /// The pool it belongs to.
    pub pool_uuid: [u8; 16],
    /// Its place in the log: one more than the block before it.
    pub seq: u64,
    /// The commit it is part of: the sequence number of the commit's first block (version
    /// 1: a commit number).
    pub commit: u64,
    /// The generation of the superblock whose log it extends (version 1: 0).
    pub epoch: u64,
    /// Blocks in its commit (version 1: 0, not recorded).
    pub blocks: u32,
    /// The last block of that commit.
    pub last: bool,
    /// Its records, in order.
    pub records: Vec<Record>,
}

impl LogBlock {
    /// The block's bytes. Panics if the records do not fit (see [`pack`]).
    pub fn encode(&self) -> Vec<u8> {
        self.encode_as(&MAGIC)
    }

    /// [`LogBlock::decode_as`] of a log block of the current version.
    pub fn decode(b: &[u8], pool_uuid: &[u8; 16]) -> Result<LogBlock, Invalid> {
        LogBlock::decode_as(b, pool_uuid, &MAGIC, VERSION)
    }

    /// The bytes of a block with `magic` (a log block or a checkpoint page), in the
    /// current version's layout.
    pub fn encode_as(&self, magic: &[u8; 8]) -> Vec<u8> {
        let mut recs = Vec::new();
        for r in &self.records {
            r.encode(&mut recs);
        }
        assert!(recs.len() <= RECORDS_MAX_BYTES, "records fit one block");
        let mut b = vec![0u8; BLOCK_BYTES];
        b[at::MAGIC..at::MAGIC + 8].copy_from_slice(magic);
        b[at::UUID..at::UUID + 16].copy_from_slice(&self.pool_uuid);
        b[at::SEQ..at::SEQ + 8].copy_from_slice(&self.seq.to_le_bytes());
        b[at::COMMIT..at::COMMIT + 8].copy_from_slice(&self.commit.to_le_bytes());
        let flags = if self.last { FLAG_LAST } else { 0 };
        b[at::FLAGS..at::FLAGS + 4].copy_from_slice(&flags.to_le_bytes());
        b[at::RECORD_BYTES..at::RECORD_BYTES + 4]
            .copy_from_slice(&(recs.len() as u32).to_le_bytes());
        b[at::EPOCH..at::EPOCH + 8].copy_from_slice(&self.epoch.to_le_bytes());
        b[at::BLOCKS..at::BLOCKS + 4].copy_from_slice(&self.blocks.to_le_bytes());
        b[at::RECORDS..at::RECORDS + recs.len()].copy_from_slice(&recs);
        let crc = crc32c::crc32c(&b[..at::CRC]);
        b[at::CRC..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Reads a block with `magic` of pool `pool_uuid`, laid out as format `version` (1 or
    /// 2) has it; every field and record is checked.
    pub fn decode_as(
        b: &[u8],
        pool_uuid: &[u8; 16],
        magic: &[u8; 8],
        version: u32,
    ) -> Result<LogBlock, Invalid> {
        if b.len() != BLOCK_BYTES {
            return Err(Invalid::Field("block length"));
        }
        if b[at::MAGIC..at::MAGIC + 8] != magic[..] {
            return Err(if b.iter().all(|&x| x == 0) {
                Invalid::Blank
            } else {
                Invalid::Magic
            });
        }
        let crc = u32::from_le_bytes(b[at::CRC..].try_into().expect("4 bytes"));
        if crc != crc32c::crc32c(&b[..at::CRC]) {
            return Err(Invalid::Checksum);
        }
        if b[at::UUID..at::UUID + 16] != pool_uuid[..] {
            return Err(Invalid::Pool);
        }
        let get64 = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let get32 = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let flags = get32(at::FLAGS);
        if flags & !FLAG_LAST != 0 {
            return Err(Invalid::Field("flags"));
        }
        let (first, epoch, blocks) = match version {
            1 => (at::RECORDS_V1, 0, 0),
            2 | 3 => (at::RECORDS, get64(at::EPOCH), get32(at::BLOCKS)),
            _ => return Err(Invalid::Field("version")),
        };
        if version >= 2 {
            if blocks == 0 {
                return Err(Invalid::Field("blocks"));
            }
            if get32(at::RESERVED) != 0 {
                return Err(Invalid::Field("reserved"));
            }
        }
        let len = get32(at::RECORD_BYTES) as usize;
        if len > at::CRC - first {
            return Err(Invalid::Field("record bytes"));
        }
        let mut recs = &b[first..first + len];
        let mut records = Vec::new();
        while !recs.is_empty() {
            let (r, n) = Record::decode(recs)?;
            if version < 3 && r.is_version_3() {
                return Err(Invalid::Field("record type"));
            }
            records.push(r);
            recs = &recs[n..];
        }
        let block = LogBlock {
            pool_uuid: *pool_uuid,
            seq: get64(at::SEQ),
            commit: get64(at::COMMIT),
            epoch,
            blocks,
            last: flags & FLAG_LAST != 0,
            records,
        };
        if version >= 2 && !block.in_its_commit() {
            return Err(Invalid::Field("commit"));
        }
        Ok(block)
    }

    /// Version 2: the block lies inside its commit, flagged last exactly at its end.
    fn in_its_commit(&self) -> bool {
        let Some(index) = self.seq.checked_sub(self.commit) else {
            return false;
        };
        index < u64::from(self.blocks) && self.last == (index + 1 == u64::from(self.blocks))
    }
}

/// The format version this code writes: version 3 blocks are laid out as version 2's and
/// may hold the checkpoint records ([`Record::Mark`] and those after it).
pub const VERSION: u32 = 3;

/// The blocks of the commit holding `records` in order, numbered from `first_seq`, in
/// the log of the superblock of generation `epoch`. A commit of no records is one block
/// holding none.
pub fn pack(pool_uuid: [u8; 16], epoch: u64, first_seq: u64, records: &[Record]) -> Vec<LogBlock> {
    let mut blocks = Vec::new();
    let mut current = Vec::new();
    let mut used = 0;
    for r in records {
        let n = r.encoded_len();
        if used + n > RECORDS_MAX_BYTES {
            blocks.push(std::mem::take(&mut current));
            used = 0;
        }
        current.push(r.clone());
        used += n;
    }
    blocks.push(current);
    let count = blocks.len();
    blocks
        .into_iter()
        .enumerate()
        .map(|(i, records)| LogBlock {
            pool_uuid,
            seq: first_seq + i as u64,
            commit: first_seq,
            epoch,
            blocks: count as u32,
            last: i + 1 == count,
            records,
        })
        .collect()
}

/// What [`replay`] found: the records of every whole commit, where the next commit goes,
/// and the torn commit it dropped, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// The records, in order.
    pub records: Vec<Record>,
    /// Blocks replayed.
    pub blocks: u64,
    /// Whole commits replayed.
    pub commits: u64,
    /// The sequence number replay ended at (where the next commit goes).
    pub end: u64,
    /// A commit dropped as torn: the sequence number it started at, and how many of its
    /// blocks were found valid.
    pub torn: Option<(u64, u64)>,
    /// The highest epoch of any valid block in the ring (at least the one replayed): a
    /// repaired pool's next superblock goes past it, so no block seen is ever of its
    /// epoch.
    pub epoch_max: u64,
}

/// Why the log cannot be replayed as it is: damage that loses acknowledged commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Damage {
    /// Replay stopped at block `seq` (why: `invalid`, or out of place), but the commit
    /// starting at `later` comes after it, whole or not: the commits between were whole
    /// once.
    Inside {
        /// Where replay stopped.
        seq: u64,
        /// What is wrong with the block there.
        why: String,
        /// The first sequence number of a later commit found valid.
        later: u64,
    },
    /// Block `seq` was written in the log of superblock generation `epoch`, newer than
    /// the superblock in use: the newest superblock is damaged or was rolled back.
    Newer {
        /// The block.
        seq: u64,
        /// Its epoch.
        epoch: u64,
    },
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Damage::Inside { seq, why, later } => write!(
                f,
                "log block {seq} is damaged ({why}) but the commit at block {later} comes after it: the commits from block {seq} on were acknowledged"
            ),
            Damage::Newer { seq, epoch } => write!(
                f,
                "log block {seq} was written under superblock generation {epoch}, newer than the superblock in use: the newest superblock is damaged or was put back from an older copy"
            ),
        }
    }
}

/// Replay's rule: the records of every whole commit in `ring` (the log's pages in ring
/// order, starting at the page of sequence number `first_seq`), in the log of the
/// superblock of generation `epoch`, read as format `version`. Replay stops at the first
/// block that is invalid, of another epoch, out of sequence or out of its commit; the
/// commit it stops in is dropped whole. Then the rest of the ring tells a torn tail (fine)
/// from damage (an error): see the module's documentation.
pub fn replay(
    ring: &[&[u8]],
    pool_uuid: &[u8; 16],
    first_seq: u64,
    epoch: u64,
    version: u32,
) -> Result<Replayed, Damage> {
    match replay_past_damage(ring, pool_uuid, first_seq, epoch, version) {
        (out, None) => Ok(out),
        (_, Some(d)) => Err(d),
    }
}

/// [`replay`], returning what it replayed up to the damage as well (for a repair that
/// accepts losing the rest).
pub fn replay_past_damage(
    ring: &[&[u8]],
    pool_uuid: &[u8; 16],
    first_seq: u64,
    epoch: u64,
    version: u32,
) -> (Replayed, Option<Damage>) {
    if version == 1 {
        return (replay_v1(ring, pool_uuid, first_seq), None);
    }
    let mut out = Replayed {
        records: Vec::new(),
        blocks: 0,
        commits: 0,
        end: first_seq,
        torn: None,
        epoch_max: epoch,
    };
    let mut pending = Vec::new();
    let mut i = 0;
    let mut why = "the end of the log".to_string();
    while i < ring.len() {
        let seq = first_seq + i as u64;
        let block = match LogBlock::decode(ring[i], pool_uuid) {
            Ok(b) if b.epoch != epoch => {
                why = format!("of epoch {}", b.epoch);
                break;
            }
            Ok(b) if b.seq != seq || b.commit != out.end => {
                why = format!("block {} of the commit at {}", b.seq, b.commit);
                break;
            }
            Ok(b) => b,
            Err(e) => {
                why = format!("{e:?}").to_lowercase();
                break;
            }
        };
        i += 1;
        pending.extend(block.records);
        if block.last {
            out.records.append(&mut pending);
            out.blocks = i as u64;
            out.commits += 1;
            out.end = seq + 1;
        }
    }
    let damage = look_past_the_end(ring, pool_uuid, first_seq, epoch, &mut out, why).err();
    (out, damage)
}

/// After replay stopped at `out.end`: any block of a later commit of this epoch is
/// damage before it, any block of a later epoch a superblock too old; blocks of the
/// dropped commit itself make it a torn tail. The whole ring is read (for
/// [`Replayed::epoch_max`]); the first damage found is returned.
fn look_past_the_end(
    ring: &[&[u8]],
    pool_uuid: &[u8; 16],
    first_seq: u64,
    epoch: u64,
    out: &mut Replayed,
    why: String,
) -> Result<(), Damage> {
    let stop = out.end;
    let mut found = 0;
    let mut damage = None;
    for (i, b) in ring.iter().enumerate() {
        let place = first_seq + i as u64;
        let Ok(block) = LogBlock::decode(b, pool_uuid) else {
            // A block whose header says it is this commit's, here, but that fails its
            // checksum was written (torn, or damaged since): the commit is incomplete.
            if place >= stop && header(b, pool_uuid) == Some((place, stop, epoch)) {
                found += 1;
            }
            continue;
        };
        out.epoch_max = out.epoch_max.max(block.epoch);
        if block.epoch > epoch {
            damage.get_or_insert(Damage::Newer {
                seq: block.seq,
                epoch: block.epoch,
            });
            continue;
        }
        // Only a block at its own place counts: one elsewhere is from an older lap.
        if block.epoch != epoch || block.seq != place || place < stop {
            continue;
        }
        if block.commit > stop {
            damage.get_or_insert(Damage::Inside {
                seq: stop,
                why: why.clone(),
                later: block.commit,
            });
        }
        if block.commit == stop {
            found += 1;
        }
    }
    if found > 0 {
        out.torn = Some((stop, found));
    }
    damage.map_or(Ok(()), Err)
}

/// The sequence number, commit and epoch a version 2 log block's header says, checksum
/// or not (`None` when its magic or pool is not this log's).
fn header(b: &[u8], pool_uuid: &[u8; 16]) -> Option<(u64, u64, u64)> {
    if b.len() != BLOCK_BYTES || b[at::MAGIC..at::MAGIC + 8] != MAGIC {
        return None;
    }
    if b[at::UUID..at::UUID + 16] != pool_uuid[..] {
        return None;
    }
    let get64 = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
    Some((get64(at::SEQ), get64(at::COMMIT), get64(at::EPOCH)))
}

/// Version 1's rule: blocks in sequence, of the commit in progress, until the first that
/// is not; a commit counts when its last block is read.
fn replay_v1(ring: &[&[u8]], pool_uuid: &[u8; 16], first_seq: u64) -> Replayed {
    let mut out = Replayed {
        records: Vec::new(),
        blocks: 0,
        commits: 0,
        end: first_seq,
        torn: None,
        epoch_max: 0,
    };
    let mut pending = Vec::new();
    let mut commit_of_pending = None;
    for (i, b) in ring.iter().enumerate() {
        let Ok(block) = LogBlock::decode_as(b, pool_uuid, &MAGIC_V1, 1) else {
            break;
        };
        let seq = first_seq + i as u64;
        if block.seq != seq || commit_of_pending.is_some_and(|c| c != block.commit) {
            break;
        }
        commit_of_pending = Some(block.commit);
        pending.extend(block.records);
        if block.last {
            out.records.append(&mut pending);
            commit_of_pending = None;
            out.blocks = i as u64 + 1;
            out.commits += 1;
            out.end = seq + 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: [u8; 16] = *b"0123456789abcdef";
    const PAGES: usize = 64;

    fn every_kind() -> Vec<Record> {
        vec![
            Record::Set {
                vol: 3,
                vblock: 1 << 40,
                entry: 0x8000_0007,
            },
            Record::Reserve { start: 64, len: 32 },
            Record::Zeroed { start: 8, len: 1 },
            Record::Create {
                vol: 4,
                size: 1 << 30,
                flags: 0,
                name: "vm-ä".into(),
            },
            Record::Snapshot {
                src: 4,
                new: 5,
                flags: 1,
                name: "before-upgrade".into(),
            },
            Record::Delete { vol: 5 },
            Record::Grow {
                vol: 4,
                size: 2 << 30,
            },
        ]
    }

    /// `n` records, each a block's worth of `Set`s after the first: a commit of about
    /// `n / 250` blocks.
    fn sets(from: u64, n: u64) -> Vec<Record> {
        (from..from + n)
            .map(|i| Record::Set {
                vol: 1,
                vblock: i,
                entry: i as u32 + 1,
            })
            .collect()
    }

    /// A log ring of [`PAGES`] pages, written as the commit thread writes it.
    struct Ring {
        pages: Vec<Vec<u8>>,
    }

    impl Ring {
        fn new() -> Ring {
            Ring {
                pages: vec![vec![0u8; BLOCK_BYTES]; PAGES],
            }
        }

        /// Writes a commit of `records` from `seq` in epoch `epoch`; returns the next seq.
        fn commit(&mut self, epoch: u64, seq: u64, records: &[Record]) -> u64 {
            let blocks = pack(UUID, epoch, seq, records);
            for b in &blocks {
                self.pages[b.seq as usize % PAGES] = b.encode();
            }
            seq + blocks.len() as u64
        }

        fn replay(&self, first_seq: u64, epoch: u64) -> Result<Replayed, Damage> {
            let refs: Vec<&[u8]> = (0..PAGES)
                .map(|i| self.pages[(first_seq as usize + i) % PAGES].as_slice())
                .collect();
            replay(&refs, &UUID, first_seq, epoch, VERSION)
        }

        fn page(&mut self, seq: u64) -> &mut Vec<u8> {
            &mut self.pages[seq as usize % PAGES]
        }
    }

    #[test]
    fn every_record_kind_round_trips() {
        let block = LogBlock {
            pool_uuid: UUID,
            seq: 9,
            commit: 9,
            epoch: 3,
            blocks: 1,
            last: true,
            records: every_kind(),
        };
        let b = block.encode();
        assert_eq!(b.len(), BLOCK_BYTES);
        assert_eq!(LogBlock::decode(&b, &UUID), Ok(block));
        for r in every_kind() {
            let mut out = Vec::new();
            r.encode(&mut out);
            assert_eq!(out.len(), r.encoded_len(), "{r:?}");
        }
    }

    #[test]
    fn damage_is_found() {
        let b = pack(UUID, 1, 1, &every_kind()).remove(0).encode();
        let mut torn = b.clone();
        torn[100] ^= 1;
        assert_eq!(LogBlock::decode(&torn, &UUID), Err(Invalid::Checksum));
        assert_eq!(
            LogBlock::decode(&b, b"fedcba9876543210"),
            Err(Invalid::Pool)
        );
        assert_eq!(
            LogBlock::decode(&vec![0u8; BLOCK_BYTES], &UUID),
            Err(Invalid::Blank)
        );
        let mut other = b.clone();
        other[0] = b'X';
        assert_eq!(LogBlock::decode(&other, &UUID), Err(Invalid::Magic));
        assert!(LogBlock::decode(&b[..100], &UUID).is_err());
        // A block of one version never reads as one of the other.
        assert_eq!(
            LogBlock::decode_as(&b, &UUID, &MAGIC_V1, 1),
            Err(Invalid::Magic)
        );
    }

    /// Rewrites a header field of `b` and its checksum.
    fn forge(b: &mut [u8], at: usize, bytes: &[u8]) {
        b[at..at + bytes.len()].copy_from_slice(bytes);
        let crc = crc32c::crc32c(&b[..at::CRC]);
        b[at::CRC..].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn fields_that_break_the_rules_are_refused() {
        let good = pack(UUID, 1, 1, &every_kind()).remove(0).encode();
        let len = u32::from_le_bytes(good[at::RECORD_BYTES..][..4].try_into().unwrap());
        let cases: Vec<(usize, Vec<u8>, Invalid)> = vec![
            // A record length that cuts the last record short.
            (
                at::RECORD_BYTES,
                (len - 3).to_le_bytes().to_vec(),
                Invalid::Field("record length"),
            ),
            (
                at::RECORD_BYTES,
                4096u32.to_le_bytes().to_vec(),
                Invalid::Field("record bytes"),
            ),
            (
                at::BLOCKS,
                0u32.to_le_bytes().to_vec(),
                Invalid::Field("blocks"),
            ),
            // A one-block commit's only block said to be the first of many.
            (
                at::BLOCKS,
                2u32.to_le_bytes().to_vec(),
                Invalid::Field("commit"),
            ),
            (
                at::RESERVED,
                1u32.to_le_bytes().to_vec(),
                Invalid::Field("reserved"),
            ),
            (
                at::FLAGS,
                2u32.to_le_bytes().to_vec(),
                Invalid::Field("flags"),
            ),
            // Not the last block of a one-block commit; a seq before its commit.
            (
                at::FLAGS,
                0u32.to_le_bytes().to_vec(),
                Invalid::Field("commit"),
            ),
            (
                at::COMMIT,
                2u64.to_le_bytes().to_vec(),
                Invalid::Field("commit"),
            ),
            (
                at::SEQ,
                u64::MAX.to_le_bytes().to_vec(),
                Invalid::Field("commit"),
            ),
        ];
        for (at, bytes, want) in cases {
            let mut b = good.clone();
            forge(&mut b, at, &bytes);
            assert_eq!(LogBlock::decode(&b, &UUID), Err(want), "field at {at}");
        }
    }

    #[test]
    fn a_large_commit_spans_blocks_and_replays_whole() {
        let records = sets(0, 1000);
        let blocks = pack(UUID, 5, 10, &records);
        assert!(blocks.len() > 1);
        assert!(blocks.iter().rev().skip(1).all(|b| !b.last) && blocks.last().unwrap().last);
        assert!(blocks
            .iter()
            .all(|b| b.commit == 10 && b.blocks as usize == blocks.len()));
        let mut ring = Ring::new();
        let end = ring.commit(5, 10, &records);
        let got = ring.replay(10, 5).unwrap();
        assert_eq!(got.records, records);
        assert_eq!((got.end, got.commits, got.torn), (end, 1, None));
        // The same blocks are not of the next epoch's log.
        let next = ring.replay(10, 6).unwrap();
        assert_eq!((next.records.len(), next.end), (0, 10));
    }

    #[test]
    fn a_torn_commit_leaves_the_last_whole_one() {
        let first = every_kind();
        let mut ring = Ring::new();
        let s = ring.commit(1, 0, &first);
        let end = ring.commit(1, s, &sets(0, 600));
        assert_eq!(ring.replay(0, 1).unwrap().records.len(), first.len() + 600);
        // Any block of the last commit missing (never written) or torn: only the first
        // commit counts, and the rest of the torn one is reported.
        for lost in s..end {
            let mut r = Ring {
                pages: ring.pages.clone(),
            };
            if lost % 2 == 0 {
                *r.page(lost) = vec![0u8; BLOCK_BYTES];
            } else {
                r.page(lost)[200] ^= 0xff;
            }
            let got = r.replay(0, 1).unwrap();
            assert_eq!(got.records, first, "block {lost} lost");
            assert_eq!(got.end, s);
            // A zeroed block is not found; a damaged one is, by its header.
            let found = if lost % 2 == 0 { end - s - 1 } else { end - s };
            assert_eq!(got.torn, Some((s, found)));
        }
    }

    #[test]
    fn damage_before_a_later_commit_is_refused_not_dropped() {
        // Commits of 1, 3 and 1 blocks; damage to any block of the first two is found,
        // because a block of a later commit survives.
        let mut ring = Ring::new();
        let a = ring.commit(4, 7, &every_kind());
        let b = ring.commit(4, a, &sets(0, 600));
        let c = ring.commit(4, b, &sets(1000, 3));
        for bad in 7..b {
            for how in 0..3 {
                let mut r = Ring {
                    pages: ring.pages.clone(),
                };
                match how {
                    0 => r.page(bad)[100] ^= 1,
                    1 => *r.page(bad) = vec![0u8; BLOCK_BYTES],
                    _ => r.page(bad)[0] = b'X',
                }
                let got = r.replay(7, 4);
                let stop = if bad < a { 7 } else { a };
                assert!(
                    matches!(got, Err(Damage::Inside { seq, later, .. }) if seq == stop && later > stop),
                    "block {bad}, damage {how}: {got:?}"
                );
            }
        }
        // Damage to the last commit cannot be told from a tear: dropped, and said when
        // its header survives; a block zeroed looks never written.
        let mut r = Ring {
            pages: ring.pages.clone(),
        };
        r.page(b)[300] ^= 1;
        let got = r.replay(7, 4).unwrap();
        assert_eq!((got.end, got.commits, got.torn), (b, 2, Some((b, 1))));
        *r.page(b) = vec![0u8; BLOCK_BYTES];
        let got = r.replay(7, 4).unwrap();
        assert_eq!((got.end, got.commits, got.torn), (b, 2, None));
        assert_eq!(ring.replay(7, 4).unwrap().end, c);
    }

    #[test]
    fn a_block_left_by_a_commit_torn_before_an_earlier_open_is_never_replayed() {
        // Epoch 1: a commit of three blocks whose first never reached the disk.
        let mut ring = Ring::new();
        let s = ring.commit(1, 20, &every_kind());
        let torn_end = ring.commit(1, s, &sets(0, 600));
        *ring.page(s) = vec![0u8; BLOCK_BYTES];
        let got = ring.replay(20, 1).unwrap();
        assert_eq!((got.end, got.torn), (s, Some((s, torn_end - s - 1))));
        // The open wrote a new superblock (epoch 2) with the log starting at `s`; a
        // one-block commit lands there, then a crash: the stale blocks after it are of
        // epoch 1 and end replay, however well they fit the sequence.
        let e2 = ring.commit(2, s, &sets(5000, 1));
        let got = ring.replay(s, 2).unwrap();
        assert_eq!((got.records.len(), got.end, got.torn), (1, e2, None));
        // Third open, epoch 3, from `e2`: another one-block commit, another crash.
        let e3 = ring.commit(3, e2, &sets(6000, 1));
        let got = ring.replay(e2, 3).unwrap();
        assert_eq!((got.records.len(), got.end), (1, e3));
    }

    #[test]
    fn a_block_of_a_newer_superblock_means_the_one_in_use_is_old() {
        let mut ring = Ring::new();
        let a = ring.commit(7, 0, &every_kind());
        // A checkpoint moved the log to `a` under superblock 8, then commits.
        ring.commit(8, a, &sets(0, 10));
        // Superblock 8 damaged: superblock 7 is picked, its log replays whole, and the
        // newer block is found.
        let got = ring.replay(0, 7);
        assert_eq!(got, Err(Damage::Newer { seq: a, epoch: 8 }));
        // A repair takes what replayed, and knows to go past epoch 8.
        let refs: Vec<&[u8]> = ring.pages.iter().map(Vec::as_slice).collect();
        let (prefix, damage) = replay_past_damage(&refs, &UUID, 0, 7, VERSION);
        assert_eq!((prefix.end, prefix.commits, prefix.epoch_max), (a, 1, 8));
        assert!(damage.is_some());
    }

    #[test]
    fn a_version_1_log_replays_by_version_1_rules() {
        let v1 = |seq: u64, commit: u64, last: bool, records: Vec<Record>| {
            let mut b = LogBlock {
                pool_uuid: UUID,
                seq,
                commit,
                epoch: 0,
                blocks: 0,
                last,
                records,
            }
            .encode_as(&MAGIC_V1);
            // Version 1 has the records at 48: move them back and seal.
            let len = u32::from_le_bytes(b[at::RECORD_BYTES..][..4].try_into().unwrap()) as usize;
            let recs = b[at::RECORDS..at::RECORDS + len].to_vec();
            b[at::RECORDS_V1..at::CRC].fill(0);
            b[at::RECORDS_V1..at::RECORDS_V1 + len].copy_from_slice(&recs);
            forge(&mut b, 0, &MAGIC_V1);
            b
        };
        let pages = [
            v1(3, 3, true, every_kind()),
            v1(4, 4, false, sets(0, 2)),
            v1(5, 4, true, sets(2, 2)),
            vec![0u8; BLOCK_BYTES],
        ];
        let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        let got = replay(&refs, &UUID, 3, 0, 1).unwrap();
        assert_eq!(got.records.len(), every_kind().len() + 4);
        assert_eq!((got.end, got.commits), (6, 2));
        // And a version 1 block never reads as version 2.
        assert_eq!(LogBlock::decode(&pages[0], &UUID), Err(Invalid::Magic));
    }
}
