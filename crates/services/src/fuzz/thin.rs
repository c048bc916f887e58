//! The thin pool's targets: its superblock (two slots, as the array's), its log (blocks
//! decoded, then replayed as opening replays them, the records applied to a pool), and
//! its checkpoints (loaded, then written and loaded again).
//!
//! A state the log's records build, and a state a checkpoint loads, must checkpoint and
//! load back the same: that is how a pool reopens.

use crate::thin::checkpoint;
use crate::thin::format::{self, LogBlock, Record, BLOCK_BYTES};
use crate::thin::state::{PoolState, OWNED};
use crate::thin::superblock::{
    pick, PoolSuperblock, FLAG_CLEAN, FLAG_META_ON_DATA, PAGE, SLOT_BYTES, VERSION,
};
use cairn_core::fuzzing::{padded, pieces, pieces_input, trimmed, Input, RESEAL};
use cairn_core::ondisk::{Invalid, Picked};

/// The pool every log block and checkpoint page of the targets belongs to.
pub const UUID: [u8; 16] = *b"cairn-fuzz-pool!";
/// The checkpoint generation the checkpoint target loads.
const GENERATION: u64 = 1;
/// The superblock generation (epoch) the log target replays in.
const EPOCH: u64 = 3;
/// The block size of the pools the log and checkpoint targets build.
const BLOCK_BYTES_POOL: u64 = 64 << 10;
/// Data blocks of the pool the log's records are applied to.
const LOG_POOL_BLOCKS: usize = 64;
/// Most log blocks and checkpoint pages one input holds.
const PIECES_MAX: usize = 32;

/// Writes the CRC-32C of a superblock slot, log block or checkpoint page (its last 4
/// bytes, over all before them) again.
fn reseal(piece: &mut [u8]) {
    let at = piece.len() - 4;
    let crc = crc32c::crc32c(&piece[..at]);
    piece[at..].copy_from_slice(&crc.to_le_bytes());
}

/// The superblock target. Input: flags, the first slot's length (u16), the first slot,
/// the second slot (each zero-padded to [`SLOT_BYTES`]).
pub fn superblock(data: &[u8]) -> bool {
    let mut input = Input::new(data);
    let flags = input.u8();
    let first = usize::from(input.u16());
    let mut area = padded(input.take(first), SLOT_BYTES);
    area.extend_from_slice(&padded(input.rest(), SLOT_BYTES));
    if flags & RESEAL != 0 {
        area.chunks_mut(SLOT_BYTES).for_each(reseal);
    }
    let decoded: Vec<Result<PoolSuperblock, Invalid>> = area
        .chunks(SLOT_BYTES)
        .map(PoolSuperblock::decode)
        .collect();
    for sb in decoded.iter().flatten() {
        // A version 1 superblock is written back as the current version, the rest the
        // same.
        let written = PoolSuperblock {
            version: VERSION,
            ..sb.clone()
        };
        assert_eq!(PoolSuperblock::decode(&sb.encode()), Ok(written));
    }
    match pick(&area) {
        Picked::Valid {
            record: sb,
            slot,
            other,
            damaged,
        } => {
            assert_eq!(decoded[slot].as_ref(), Ok(&sb));
            match &decoded[1 - slot] {
                Ok(o) => {
                    assert!(damaged.is_none());
                    assert_eq!(other.as_ref(), Some(o));
                    assert!(
                        o.generation < sb.generation
                            || (o.generation == sb.generation && slot == 0)
                    );
                }
                Err(e) => {
                    assert!(other.is_none());
                    assert_eq!(damaged, (*e != Invalid::Blank).then(|| e.clone()));
                }
            }
        }
        Picked::Blank => assert!(decoded.iter().all(|d| *d == Err(Invalid::Blank))),
        Picked::Foreign { first, second } => assert_eq!(
            [Err(first), Err(second)],
            [decoded[0].clone(), decoded[1].clone()]
        ),
    }
    decoded.iter().any(Result::is_ok)
}

/// The log target. Input: flags, the first sequence number (u8), then log blocks as
/// [`pieces_input`] lays them out (each zero-padded to [`BLOCK_BYTES`]).
pub fn log(data: &[u8]) -> bool {
    let mut input = Input::new(data);
    let flags = input.u8();
    let first_seq = u64::from(input.u8());
    let mut blocks = pieces(&mut input, BLOCK_BYTES, PIECES_MAX);
    if flags & RESEAL != 0 {
        blocks.iter_mut().for_each(|b| reseal(b));
    }
    let decoded: Vec<Option<LogBlock>> = blocks
        .iter()
        .map(|b| LogBlock::decode(b, &UUID).ok())
        .collect();
    for block in decoded.iter().flatten() {
        assert_eq!(LogBlock::decode(&block.encode(), &UUID).as_ref(), Ok(block));
    }
    let refs: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
    let (out, damage) = format::replay_past_damage(&refs, &UUID, first_seq, EPOCH, VERSION);
    assert_eq!(
        format::replay(&refs, &UUID, first_seq, EPOCH, VERSION),
        damage.map_or(Ok(out.clone()), Err)
    );
    let taken = usize::try_from(out.blocks)
        .ok()
        .filter(|&n| n <= blocks.len() && out.end == first_seq + out.blocks)
        .expect("replay ends within the blocks it was given");
    assert!(out.epoch_max >= EPOCH);
    let records = out.records;
    // Replay's records are those of the blocks it took, in order.
    let from_taken: Vec<Record> = decoded[..taken]
        .iter()
        .flat_map(|b| {
            b.as_ref()
                .expect("replay took a block that does not decode")
                .records
                .clone()
        })
        .collect();
    assert_eq!(records, from_taken);
    // Written again as one commit, they replay the same.
    let packed: Vec<Vec<u8>> = format::pack(UUID, EPOCH, first_seq, &records)
        .iter()
        .map(LogBlock::encode)
        .collect();
    let refs: Vec<&[u8]> = packed.iter().map(Vec::as_slice).collect();
    let again = format::replay(&refs, &UUID, first_seq, EPOCH, VERSION)
        .expect("a commit packed whole replays");
    assert_eq!(again.records, records);
    assert_eq!(again.end, first_seq + packed.len() as u64);
    // Applied as opening applies them, up to the first one refused.
    let mut state = PoolState::new(BLOCK_BYTES_POOL, LOG_POOL_BLOCKS);
    for r in &records {
        if let Err(e) = state.apply(r) {
            assert!(
                !e.to_string().contains('\n'),
                "a refusal of more than one line: {e}"
            );
            break;
        }
    }
    reopens(&state);
    decoded.iter().any(Option::is_some)
}

/// The checkpoint target. Input: flags, the pool's data blocks (u16, 1 to 4096), then
/// the checkpoint's pages as [`pieces_input`] lays them out (each zero-padded to a page).
pub fn checkpoint(data: &[u8]) -> bool {
    let mut input = Input::new(data);
    let flags = input.u8();
    let data_blocks = usize::from(input.u16() & 0x0fff) + 1;
    let mut pages = pieces(&mut input, PAGE as usize, PIECES_MAX);
    if flags & RESEAL != 0 {
        pages.iter_mut().for_each(|p| reseal(p));
    }
    let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
    match checkpoint::load(
        &refs,
        &UUID,
        GENERATION,
        VERSION,
        BLOCK_BYTES_POOL,
        data_blocks,
    ) {
        Ok(state) => {
            reopens(&state);
            true
        }
        Err(e) => {
            assert!(
                !e.to_string().contains('\n'),
                "a refusal of more than one line: {e}"
            );
            false
        }
    }
}

/// `state` agrees with itself, and its checkpoint loads back the same.
fn reopens(state: &PoolState) {
    assert_eq!(state.check(), Vec::<String>::new());
    let pages = checkpoint::pages(UUID, GENERATION, state);
    let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
    match checkpoint::load(
        &refs,
        &UUID,
        GENERATION,
        VERSION,
        state.block_bytes,
        state.blocks.len(),
    ) {
        Ok(loaded) => assert!(&loaded == state, "a checkpoint loads back another state"),
        Err(e) => panic!("the checkpoint of a valid state is refused: {e}"),
    }
}

/// A superblock as a new pool of `data_blocks` gets it.
fn pool_superblock(data_blocks: u64, generation: u64) -> PoolSuperblock {
    let capacity = (data_blocks * 128 + (1 << 20)).div_ceil(PAGE) * PAGE;
    let log_bytes = 1 << 20;
    let log_offset = 2 * SLOT_BYTES as u64;
    PoolSuperblock {
        version: VERSION,
        generation,
        pool_uuid: UUID,
        flags: 0,
        block_bytes: BLOCK_BYTES_POOL,
        data_offset: 1 << 20,
        data_blocks,
        log_offset,
        log_bytes,
        checkpoints: [log_offset + log_bytes, log_offset + log_bytes + capacity],
        checkpoint_capacity: capacity,
        checkpoint_in_use: 0,
        checkpoint_generation: 0,
        checkpoint_pages: 0,
        checkpoint_crc: 0,
        log_start_seq: 1,
        log_start_offset: PAGE,
        low_water_blocks: data_blocks / 10,
        created_secs: 1_800_000_000,
        updated_secs: 1_800_000_000,
        next_volume: 1,
    }
}

/// Two slots as an input; resealed ones trimmed (their checksum is made again).
fn slots_input(flags: u8, a: &[u8], b: &[u8]) -> Vec<u8> {
    let strip = |s: &[u8]| -> Vec<u8> {
        if flags & RESEAL == 0 {
            return s.to_vec();
        }
        let mut s = s.to_vec();
        let n = s.len();
        s[n.saturating_sub(4)..].fill(0);
        trimmed(&s).to_vec()
    };
    let (a, b) = (strip(a), strip(b));
    let mut out = vec![flags];
    out.extend_from_slice(&(a.len() as u16).to_le_bytes());
    out.extend_from_slice(&a);
    out.extend_from_slice(&b);
    out
}

/// Superblock seeds: a new pool's, a clean one's with a checkpoint, metadata on the data
/// device, a torn newer slot, fields out of range.
pub fn superblock_seeds() -> Vec<(String, Vec<u8>)> {
    let fresh = pool_superblock(16384, 1);
    let mut clean = pool_superblock(16384, 9);
    clean.flags = FLAG_CLEAN;
    clean.checkpoint_in_use = 2;
    clean.checkpoint_generation = 4;
    clean.checkpoint_pages = 3;
    clean.checkpoint_crc = 0x1234_5678;
    clean.log_start_seq = 4711;
    clean.log_start_offset = (4711 % (clean.log_bytes / PAGE)) * PAGE;
    clean.next_volume = 5;
    let mut on_data = pool_superblock(4096, 2);
    on_data.flags = FLAG_META_ON_DATA;
    on_data.data_offset = on_data.checkpoints[1] + on_data.checkpoint_capacity;
    on_data.data_offset = on_data.data_offset.div_ceil(BLOCK_BYTES_POOL) * BLOCK_BYTES_POOL;
    let mut torn = pool_superblock(16384, 10).encode();
    torn[SLOT_BYTES / 2..].fill(0);
    // As a version 1 pool wrote it (the same fields; read, then written as version 2).
    let mut version_1 = clean.encode();
    version_1[8..12].copy_from_slice(&1u32.to_le_bytes());
    let mut wide = pool_superblock(16384, 3);
    wide.checkpoint_pages = 1 << 52;
    wide.checkpoint_in_use = 1;
    vec![
        ("valid-new".into(), slots_input(0, &fresh.encode(), &[])),
        (
            "valid-pair".into(),
            slots_input(0, &fresh.encode(), &clean.encode()),
        ),
        (
            "valid-clean".into(),
            slots_input(RESEAL, &[], &clean.encode()),
        ),
        (
            "valid-meta-on-data".into(),
            slots_input(RESEAL, &on_data.encode(), &[]),
        ),
        (
            "valid-torn-newer".into(),
            slots_input(0, &clean.encode(), &torn),
        ),
        (
            "valid-version-1".into(),
            slots_input(RESEAL, &version_1, &[]),
        ),
        (
            "damaged-pages".into(),
            slots_input(RESEAL, &wide.encode(), &[]),
        ),
        ("damaged-blank".into(), slots_input(0, &[], &[])),
    ]
}

/// A pool's history: volumes made, written, snapshotted, deleted, blocks zeroed, grown.
fn history() -> Vec<Vec<Record>> {
    let set = |vol, vblock, block: u32| Record::Set {
        vol,
        vblock,
        entry: (block + 1) | OWNED,
    };
    let mut commits = vec![vec![
        Record::Reserve { start: 0, len: 16 },
        Record::Create {
            vol: 1,
            size: 64 << 20,
            flags: 0,
            name: "vm".into(),
        },
    ]];
    commits.push((0..8).map(|i| set(1, i * 3, i as u32)).collect());
    commits.push(vec![Record::Snapshot {
        src: 1,
        new: 2,
        flags: 1,
        name: "before".into(),
    }]);
    commits.push(vec![
        set(1, 0, 8),
        Record::Set {
            vol: 1,
            vblock: 3,
            entry: 0,
        },
        Record::Grow {
            vol: 1,
            size: 128 << 20,
        },
    ]);
    commits.push(vec![Record::Delete { vol: 2 }]);
    commits.push(vec![Record::Zeroed { start: 0, len: 1 }]);
    // A commit of many records, over several blocks.
    commits.push((9..16).map(|b| set(1, 1000 + u64::from(b), b)).collect());
    commits.push(
        (0..400)
            .map(|i| Record::Set {
                vol: 1,
                vblock: 1600 + i,
                entry: 0,
            })
            .collect(),
    );
    commits
}

/// The log blocks of `commits`, numbered from `first_seq`.
fn log_blocks(commits: &[Vec<Record>], first_seq: u64) -> Vec<Vec<u8>> {
    let mut seq = first_seq;
    let mut out = Vec::new();
    for c in commits {
        for b in format::pack(UUID, EPOCH, seq, c) {
            out.push(b.encode());
            seq += 1;
        }
    }
    out
}

/// Blocks as a log input; resealed ones trimmed (their checksum is made again).
fn log_input(flags: u8, first_seq: u8, blocks: &[Vec<u8>]) -> Vec<u8> {
    let stripped: Vec<Vec<u8>> = blocks
        .iter()
        .map(|b| {
            if flags & RESEAL == 0 {
                return b.clone();
            }
            let mut b = b.clone();
            b[BLOCK_BYTES - 4..].fill(0);
            trimmed(&b).to_vec()
        })
        .collect();
    let refs: Vec<&[u8]> = stripped.iter().map(Vec::as_slice).collect();
    pieces_input(flags, &[first_seq], &refs)
}

/// Log seeds: a pool's history whole, its last commit torn, a stale block from an older
/// lap of the ring, a block of another pool.
pub fn log_seeds() -> Vec<(String, Vec<u8>)> {
    let blocks = log_blocks(&history(), 5);
    let mut torn = blocks.clone();
    let last = torn.len() - 1;
    torn[last][300] ^= 0x10;
    let mut lapped = blocks[..3].to_vec();
    lapped.extend(log_blocks(&history()[..2], 90));
    let mut foreign = blocks[..2].to_vec();
    foreign[1][10] ^= 1;
    vec![
        ("valid-history".into(), log_input(RESEAL, 5, &blocks)),
        ("valid-history-exact".into(), log_input(0, 5, &blocks[..4])),
        ("valid-torn-commit".into(), log_input(0, 5, &torn)),
        ("valid-lapped".into(), log_input(RESEAL, 5, &lapped)),
        ("valid-foreign".into(), log_input(RESEAL, 5, &foreign)),
        ("damaged-sequence".into(), log_input(RESEAL, 9, &blocks)),
    ]
}

/// Checkpoint seeds: the states the history leaves after each commit, and damaged pages.
pub fn checkpoint_seeds() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut state = PoolState::new(BLOCK_BYTES_POOL, LOG_POOL_BLOCKS);
    let head = ((LOG_POOL_BLOCKS - 1) as u16).to_le_bytes();
    for (i, commit) in history().iter().enumerate() {
        for r in commit {
            state.apply(r).expect("the history applies");
        }
        let pages = checkpoint::pages(UUID, GENERATION, &state);
        let trimmed_pages: Vec<Vec<u8>> = pages
            .iter()
            .map(|p| {
                let mut p = p.clone();
                let n = p.len();
                p[n - 4..].fill(0);
                trimmed(&p).to_vec()
            })
            .collect();
        let refs: Vec<&[u8]> = trimmed_pages.iter().map(Vec::as_slice).collect();
        out.push((
            format!("valid-after-{i}"),
            pieces_input(RESEAL, &head, &refs),
        ));
        if i == 3 {
            let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
            out.push(("valid-exact".into(), pieces_input(0, &head, &refs)));
            let mut bad = pages.clone();
            bad[0][200] ^= 0x40;
            let refs: Vec<&[u8]> = bad.iter().map(Vec::as_slice).collect();
            out.push(("damaged-byte".into(), pieces_input(RESEAL, &head, &refs)));
            // A pool of fewer blocks than the pages name.
            out.push(("damaged-small-pool".into(), pieces_input(0, &[3, 0], &refs)));
        }
    }
    out
}
