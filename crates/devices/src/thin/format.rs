//! A thin pool's metadata log, format version 1: pure encode and decode, no I/O.
//!
//! Every change to a pool's mappings and volumes is a [`Record`]. A commit writes its
//! records in consecutive 4 KiB [`LogBlock`]s of a ring, the last one flagged; replay
//! takes commits in sequence order while every block's checksum, pool UUID and sequence
//! number agree, and stops at the first that does not. A commit counts only when its last
//! block was read back valid, so a write torn by a power cut leaves the pool as its last
//! whole commit left it. (Design: /work/briefs/thin-research.md, section 4.3; WORK IN
//! PROGRESS on the thin-37 branch, not yet documented in the README.)
//!
//! All integers are little-endian.

/// Bytes of one log block.
pub const BLOCK_BYTES: usize = 4096;
/// The log block's magic: its first 8 bytes.
pub const MAGIC: [u8; 8] = *b"CAIRNTL\0";
/// A checkpoint page's magic (the same layout as a log block: `seq` is the page's
/// index, `commit` the checkpoint's generation, `last` its final page).
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"CAIRNTC\0";
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
    pub const RECORDS: usize = 48;
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
    /// The commit it is part of.
    pub commit: u64,
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

    /// [`LogBlock::decode`] of a log block.
    pub fn decode(b: &[u8], pool_uuid: &[u8; 16]) -> Result<LogBlock, Invalid> {
        LogBlock::decode_as(b, pool_uuid, &MAGIC)
    }

    /// The bytes of a block with `magic` (a log block or a checkpoint page).
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
        b[at::RECORDS..at::RECORDS + recs.len()].copy_from_slice(&recs);
        let crc = crc32c::crc32c(&b[..at::CRC]);
        b[at::CRC..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Reads a block with `magic` of pool `pool_uuid`; every record is checked.
    pub fn decode_as(b: &[u8], pool_uuid: &[u8; 16], magic: &[u8; 8]) -> Result<LogBlock, Invalid> {
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
        let len = get32(at::RECORD_BYTES) as usize;
        if len > RECORDS_MAX_BYTES {
            return Err(Invalid::Field("record bytes"));
        }
        let mut recs = &b[at::RECORDS..at::RECORDS + len];
        let mut records = Vec::new();
        while !recs.is_empty() {
            let (r, n) = Record::decode(recs)?;
            records.push(r);
            recs = &recs[n..];
        }
        Ok(LogBlock {
            pool_uuid: *pool_uuid,
            seq: get64(at::SEQ),
            commit: get64(at::COMMIT),
            last: flags & FLAG_LAST != 0,
            records,
        })
    }
}

/// The blocks of commit `commit` holding `records` in order, numbered from `first_seq`.
pub fn pack(pool_uuid: [u8; 16], first_seq: u64, commit: u64, records: &[Record]) -> Vec<LogBlock> {
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
            commit,
            last: i + 1 == count,
            records,
        })
        .collect()
}

/// Replay's rule: the records of every whole commit in `blocks` (read in log order from
/// the sequence number `first_seq`), stopping at the first block that is invalid, out of
/// sequence, or of another commit than the one in progress. A commit whose last block is
/// missing or torn is dropped whole. Returns the records and the sequence number replay
/// ended at (where the next commit goes).
pub fn replay(blocks: &[&[u8]], pool_uuid: &[u8; 16], first_seq: u64) -> (Vec<Record>, u64) {
    let mut committed = Vec::new();
    let mut pending = Vec::new();
    let mut commit_of_pending = None;
    let mut next = first_seq;
    let mut end = first_seq;
    for b in blocks {
        let Ok(block) = LogBlock::decode(b, pool_uuid) else {
            break;
        };
        if block.seq != next || commit_of_pending.is_some_and(|c| c != block.commit) {
            break;
        }
        next += 1;
        commit_of_pending = Some(block.commit);
        pending.extend(block.records);
        if block.last {
            committed.append(&mut pending);
            commit_of_pending = None;
            end = next;
        }
    }
    (committed, end)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: [u8; 16] = *b"0123456789abcdef";

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

    #[test]
    fn every_record_kind_round_trips() {
        let block = LogBlock {
            pool_uuid: UUID,
            seq: 9,
            commit: 4,
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
    }

    #[test]
    fn a_record_that_runs_past_its_bytes_is_refused() {
        // A valid block whose record length cuts the last record short.
        let mut b = pack(UUID, 1, 1, &every_kind()).remove(0).encode();
        let len = u32::from_le_bytes(
            b[at::RECORD_BYTES..at::RECORD_BYTES + 4]
                .try_into()
                .unwrap(),
        );
        b[at::RECORD_BYTES..at::RECORD_BYTES + 4].copy_from_slice(&(len - 3).to_le_bytes());
        let crc = crc32c::crc32c(&b[..at::CRC]);
        b[at::CRC..].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(
            LogBlock::decode(&b, &UUID),
            Err(Invalid::Field("record length"))
        );
    }

    #[test]
    fn a_large_commit_spans_blocks_and_replays_whole() {
        let records: Vec<Record> = (0..1000)
            .map(|i| Record::Set {
                vol: 1,
                vblock: i,
                entry: i as u32 + 1,
            })
            .collect();
        let blocks = pack(UUID, 10, 7, &records);
        assert!(blocks.len() > 1);
        assert!(blocks.iter().rev().skip(1).all(|b| !b.last) && blocks.last().unwrap().last);
        let bytes: Vec<Vec<u8>> = blocks.iter().map(LogBlock::encode).collect();
        let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        let (got, end) = replay(&refs, &UUID, 10);
        assert_eq!(got, records);
        assert_eq!(end, 10 + blocks.len() as u64);
    }

    #[test]
    fn a_torn_commit_leaves_the_last_whole_one() {
        let first = vec![Record::Create {
            vol: 1,
            size: 1 << 20,
            flags: 0,
            name: "a".into(),
        }];
        let second: Vec<Record> = (0..600)
            .map(|i| Record::Set {
                vol: 1,
                vblock: i,
                entry: 1,
            })
            .collect();
        let mut blocks = pack(UUID, 0, 1, &first);
        blocks.extend(pack(UUID, 1, 2, &second));
        let mut bytes: Vec<Vec<u8>> = blocks.iter().map(LogBlock::encode).collect();
        let all: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        assert_eq!(replay(&all, &UUID, 0).0.len(), 1 + 600);
        // The second commit's last block torn: only the first counts.
        let last = bytes.len() - 1;
        bytes[last][200] ^= 0xff;
        let torn: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        assert_eq!(replay(&torn, &UUID, 0), (first.clone(), 1));
        // A stale block from an older lap of the ring (wrong sequence) ends replay too.
        let stale = pack(UUID, 99, 2, &second);
        let mut lapped: Vec<Vec<u8>> = vec![pack(UUID, 0, 1, &first)[0].encode()];
        lapped.extend(stale.iter().map(LogBlock::encode));
        let refs: Vec<&[u8]> = lapped.iter().map(Vec::as_slice).collect();
        assert_eq!(replay(&refs, &UUID, 0), (first, 1));
    }
}
