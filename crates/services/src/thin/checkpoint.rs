//! A checkpoint: the whole [`PoolState`] as records, in pages laid out like log blocks
//! ([`format::CHECKPOINT_MAGIC`]). Written to the checkpoint area not in use, then the
//! superblock points at it; opening loads it and replays the log from where it ends.

use std::collections::BTreeMap;

use super::error::ThinError;
use super::format::{self, LogBlock, Record};
use super::pool::check_name;
use super::state::{block_of, check_volume_size, volume_blocks, BlockState, PoolState, Volume};
use super::superblock::DATA_BLOCKS_MAX;

/// The records of `state`: every volume, its mappings as runs, every block not free.
pub fn records_of(state: &PoolState) -> Vec<Record> {
    let mut out = Vec::new();
    for (&vol, v) in &state.volumes {
        out.push(Record::Create {
            vol,
            size: v.size,
            flags: v.flags,
            name: v.name.clone(),
        });
        let mut run: Option<(u64, u32, u32)> = None;
        for (&vb, &e) in &v.map {
            match &mut run {
                Some((start, first, len))
                    if *start + u64::from(*len) == vb && first.wrapping_add(*len) == e =>
                {
                    *len += 1
                }
                _ => {
                    if let Some((start, first, len)) = run.take() {
                        out.push(Record::Run {
                            vol,
                            vblock: start,
                            entry: first,
                            len,
                        });
                    }
                    run = Some((vb, e, 1));
                }
            }
        }
        if let Some((start, first, len)) = run {
            out.push(Record::Run {
                vol,
                vblock: start,
                entry: first,
                len,
            });
        }
    }
    let code = |s: BlockState| match s {
        BlockState::Free => (0, 0),
        BlockState::Reserved => (1, 0),
        BlockState::Used(n) => (2, n),
        BlockState::FreeDirty => (3, 0),
    };
    let mut b = 0;
    while b < state.blocks.len() {
        let s = state.blocks[b];
        let n = state.blocks[b..].iter().take_while(|&&x| x == s).count();
        let (st, count) = code(s);
        if st != 0 {
            out.push(Record::Blocks {
                start: b as u64,
                len: n as u64,
                state: st,
                count,
            });
        }
        b += n;
    }
    state.mark_records(&mut out);
    out
}

/// The pool state `records` (from [`records_of`]) describe, checked: every mapping and
/// every count agree, or the checkpoint is refused. Every number a record carries is
/// checked against what the pool and its volumes hold before anything is built from it.
pub fn state_from(
    records: &[Record],
    block_bytes: u64,
    data_blocks: usize,
) -> Result<PoolState, ThinError> {
    let mut state = PoolState::new(block_bytes, data_blocks);
    let mut mappings = 0u64;
    for r in records {
        match r {
            Record::Create {
                vol,
                size,
                flags,
                name,
            } => {
                if state.volumes.contains_key(vol) {
                    return Err(bad(format!("volume {vol} twice")));
                }
                check_volume_size(*size, block_bytes)
                    .map_err(|e| e.of_volume("checkpoint", *vol))?;
                check_name(name).map_err(|e| e.of_volume("checkpoint", *vol))?;
                state.volumes.insert(
                    *vol,
                    Volume {
                        name: name.clone(),
                        size: *size,
                        flags: *flags,
                        map: BTreeMap::new(),
                    },
                );
            }
            Record::Run {
                vol,
                vblock,
                entry,
                len,
            } => {
                add_run(&mut state, &mut mappings, (*vol, *vblock, *entry, *len))?;
            }
            Record::Blocks {
                start,
                len,
                state: st,
                count,
            } => {
                let s = match (st, count) {
                    (1, 0) => BlockState::Reserved,
                    (2, n) if *n > 0 => BlockState::Used(*n),
                    (3, 0) => BlockState::FreeDirty,
                    _ => return Err(bad(format!("blocks {start}: state {st} count {count}"))),
                };
                let end = start.checked_add(*len).filter(|&e| e <= data_blocks as u64);
                let Some(end) = end else {
                    return Err(bad(format!("blocks {start}+{len} are past the pool")));
                };
                state.blocks[*start as usize..end as usize].fill(s);
            }
            Record::Mark { .. }
            | Record::Unsnap { .. }
            | Record::Changed { .. }
            | Record::Export { .. } => state.apply_mark(r, true)?,
            other => return Err(bad(format!("{other:?} in a checkpoint"))),
        }
    }
    let problems = state.check();
    if !problems.is_empty() {
        return Err(bad(format!(
            "the checkpoint disagrees with itself: {}",
            problems.join("; ")
        )));
    }
    Ok(state)
}

/// A [`Record::Run`] (`vol`, `vblock`, `entry`, `len`) added to the volume's mappings:
/// `len` virtual blocks from `vblock`, all inside the volume, to as many data blocks
/// from `entry`'s, all inside the pool (so neither count can wrap), none mapped already,
/// and `mappings` (the runs' lengths so far) within what the pool's metadata holds.
fn add_run(
    state: &mut PoolState,
    mappings: &mut u64,
    (vol, vblock, entry, len): (u32, u64, u32, u32),
) -> Result<(), ThinError> {
    let mappings_max = state.mappings_max();
    // Capped as the superblock caps it, so that an entry plus a count stays in 31 bits.
    let data_blocks = (state.blocks.len() as u64).min(DATA_BLOCKS_MAX);
    let v = state
        .volumes
        .get_mut(&vol)
        .ok_or_else(|| bad(format!("a run of volume {vol}, which is not there")))?;
    let vblocks = volume_blocks(v.size, state.block_bytes);
    if len == 0
        || vblock
            .checked_add(u64::from(len))
            .is_none_or(|end| end > vblocks)
    {
        return Err(bad(format!(
            "volume {vol}: a run of {len} blocks from {vblock} is outside its {vblocks} blocks"
        )));
    }
    let first = block_of(entry);
    if first.is_none_or(|b| b + u64::from(len) > data_blocks) {
        return Err(bad(format!(
            "volume {vol} block {vblock}: a run of {len} entries from {entry:#x} is outside the pool's {data_blocks} blocks"
        )));
    }
    *mappings = mappings.saturating_add(u64::from(len));
    if *mappings > mappings_max {
        return Err(bad(format!(
            "more mappings than the pool's metadata holds ({mappings_max})"
        )));
    }
    for i in 0..len {
        let vb = vblock + u64::from(i);
        if v.map.insert(vb, entry + i).is_some() {
            return Err(bad(format!("volume {vol} block {vb}: a repeated entry")));
        }
    }
    Ok(())
}

/// Damage to a checkpoint: `why` it cannot be the pool's state.
fn bad(why: String) -> ThinError {
    ThinError::damaged("checkpoint", why)
}

/// The pages of checkpoint `generation` of `state`.
pub fn pages(pool_uuid: [u8; 16], generation: u64, state: &PoolState) -> Vec<Vec<u8>> {
    format::pack(pool_uuid, generation, 0, &records_of(state))
        .iter()
        .map(|p| p.encode_as(&format::CHECKPOINT_MAGIC))
        .collect()
}

/// The state in checkpoint `generation`'s `pages`, written by format `version` (1 or
/// 2): every page valid, in order, ending with the last, or the checkpoint is refused.
pub fn load(
    pages: &[&[u8]],
    pool_uuid: &[u8; 16],
    generation: u64,
    version: u32,
    block_bytes: u64,
    data_blocks: usize,
) -> Result<PoolState, ThinError> {
    if pages.is_empty() {
        return Err(bad("a checkpoint of no pages".into()));
    }
    let magic = if version == 1 {
        format::CHECKPOINT_MAGIC_V1
    } else {
        format::CHECKPOINT_MAGIC
    };
    let mut records = Vec::new();
    for (i, p) in pages.iter().enumerate() {
        let page = LogBlock::decode_as(p, pool_uuid, &magic, version)
            .map_err(|e| bad(format!("checkpoint page {i}: {e:?}")))?;
        let ours = if version == 1 {
            page.commit == generation
        } else {
            page.epoch == generation && page.blocks as usize == pages.len()
        };
        if page.seq != i as u64 || !ours || page.last != (i + 1 == pages.len()) {
            return Err(bad(format!("checkpoint page {i} is out of place")));
        }
        records.extend(page.records);
    }
    state_from(&records, block_bytes, data_blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::thin::state::OWNED;

    const UUID: [u8; 16] = *b"cpcpcpcpcpcpcpcp";

    fn sample() -> PoolState {
        let mut p = PoolState::new(64 << 10, 5000);
        let mut recs = vec![
            Record::Reserve {
                start: 0,
                len: 4000,
            },
            Record::Create {
                vol: 1,
                size: 1 << 30,
                flags: 0,
                name: "vm".into(),
            },
        ];
        // A sequential fill (one run) and scattered writes.
        for i in 0..3000u64 {
            recs.push(Record::Set {
                vol: 1,
                vblock: i,
                entry: (i as u32 + 1) | OWNED,
            });
        }
        for i in 0..500u64 {
            recs.push(Record::Set {
                vol: 1,
                vblock: 5000 + i * 7,
                entry: (3000 + i as u32 + 1) | OWNED,
            });
        }
        recs.push(Record::Snapshot {
            src: 1,
            new: 2,
            flags: 1,
            name: "snap".into(),
        });
        recs.push(Record::Set {
            vol: 1,
            vblock: 3,
            entry: 3600 | OWNED,
        });
        recs.push(Record::Delete { vol: 2 });
        for r in &recs {
            p.apply(r).unwrap();
        }
        p
    }

    #[test]
    fn a_state_round_trips_through_its_pages() {
        let state = sample();
        let pages = pages(UUID, 4, &state);
        assert!(pages.len() > 1 && pages.len() < 20, "{} pages", pages.len());
        let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        assert_eq!(load(&refs, &UUID, 4, 2, 64 << 10, 5000).ok(), Some(state));
    }

    #[test]
    fn a_damaged_missing_or_stale_page_is_refused() {
        let state = sample();
        let mut pages = pages(UUID, 4, &state);
        let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        assert!(load(&refs[..refs.len() - 1], &UUID, 4, 2, 64 << 10, 5000).is_err());
        assert!(load(&refs, &UUID, 5, 2, 64 << 10, 5000).is_err());
        pages[1][500] ^= 1;
        let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        assert!(load(&refs, &UUID, 4, 2, 64 << 10, 5000).is_err());
    }

    fn create(vol: u32, size: u64) -> Record {
        Record::Create {
            vol,
            size,
            flags: 0,
            name: format!("v{vol}"),
        }
    }

    fn run(vol: u32, vblock: u64, block: u32, len: u32) -> Record {
        Record::Run {
            vol,
            vblock,
            entry: (block + 1) | OWNED,
            len,
        }
    }

    fn used(start: u64, len: u64, count: u32) -> Record {
        Record::Blocks {
            start,
            len,
            state: 2,
            count,
        }
    }

    /// Runs and sizes with valid checksums but numbers past what their volume or the
    /// pool holds are refused before anything is built from them (a run of four
    /// billion blocks used to be inserted block by block).
    #[test]
    fn runs_and_sizes_outside_their_volume_or_the_pool_are_refused() {
        let mib = 1 << 20;
        let cases: Vec<(Vec<Record>, &str)> = vec![
            // The run in the report: 4,160,749,569 blocks of a 1 MiB volume.
            (
                vec![create(1, mib), run(1, 0, 0, 4_160_749_569), used(0, 1, 1)],
                "outside its 16 blocks",
            ),
            // 20 blocks of a 16-block volume, the counts agreeing: taken before.
            (
                vec![create(1, mib), run(1, 0, 0, 20), used(0, 20, 1)],
                "outside its 16 blocks",
            ),
            // vblock + i overflowed.
            (
                vec![create(1, mib), run(1, u64::MAX - 1, 0, 3)],
                "outside its 16 blocks",
            ),
            (
                vec![create(1, mib), run(1, 0, 0, 0)],
                "outside its 16 blocks",
            ),
            // Entries past the pool's 100 blocks, and no block at all.
            (
                vec![create(1, 64 * mib), run(1, 0, 90, 20)],
                "outside the pool's 100 blocks",
            ),
            (
                vec![
                    create(1, mib),
                    Record::Run {
                        vol: 1,
                        vblock: 0,
                        entry: OWNED,
                        len: 1,
                    },
                ],
                "outside the pool's 100 blocks",
            ),
            // Sizes the pool never lets a volume have.
            (vec![create(1, 0)], "positive multiple of 4KiB"),
            (vec![create(1, mib + 1)], "positive multiple of 4KiB"),
            (vec![create(1, u64::MAX)], "positive multiple of 4KiB"),
            (
                vec![create(1, u64::MAX / 4096 * 4096)],
                "larger than the most",
            ),
            (vec![create(1, mib), used(90, 11, 1)], "past the pool"),
            (vec![create(1, mib), used(u64::MAX, 2, 1)], "past the pool"),
            // A name the pool never gives a volume, printed on one line.
            (
                vec![Record::Create {
                    vol: 1,
                    size: mib,
                    flags: 0,
                    name: "two\nlines".into(),
                }],
                "'two\\nlines' is not a volume name",
            ),
        ];
        for (records, want) in cases {
            let e = state_from(&records, 64 << 10, 100).unwrap_err();
            assert!(e.to_string().contains(want), "{records:?}: {e}");
        }
        assert!(load(&[], &UUID, 1, 2, 64 << 10, 100).is_err());
    }

    /// More mappings than the pool's largest checkpoint area holds are refused, however
    /// few records say so: 26,000 volumes mapping both blocks of a 2-block pool.
    #[test]
    fn more_mappings_than_the_metadata_holds_are_refused() {
        let volumes = 26_000u32;
        let mut records = Vec::new();
        for v in 1..=volumes {
            records.push(create(v, 128 << 10));
            records.push(Record::Run {
                vol: v,
                vblock: 0,
                entry: 1,
                len: 2,
            });
        }
        records.push(used(0, 2, volumes));
        // (A match, not unwrap_err: the state would print as 26,000 volumes.)
        match state_from(&records, 64 << 10, 2) {
            Ok(_) => panic!("52,000 mappings taken"),
            Err(e) => assert!(e.to_string().contains("more mappings than"), "{e}"),
        }
        // Half as many volumes fit.
        records.retain(|r| !matches!(r, Record::Create { vol, .. } | Record::Run { vol, .. } if *vol > volumes / 2));
        records.pop();
        records.push(used(0, 2, volumes / 2));
        assert!(state_from(&records, 64 << 10, 2).is_ok());
    }

    #[test]
    fn counts_that_disagree_with_the_mappings_are_refused() {
        let mut recs = records_of(&sample());
        for r in &mut recs {
            if let Record::Blocks {
                state: 2, count, ..
            } = r
            {
                *count += 1;
                break;
            }
        }
        assert!(state_from(&recs, 64 << 10, 5000)
            .unwrap_err()
            .to_string()
            .contains("disagrees"));
    }
}
