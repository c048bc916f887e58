//! A checkpoint: the whole [`PoolState`] as records, in pages laid out like log blocks
//! ([`format::CHECKPOINT_MAGIC`]). Written to the checkpoint area not in use, then the
//! superblock points at it; opening loads it and replays the log from where it ends.
//! (WORK IN PROGRESS on the thin-37 branch.)

use std::collections::BTreeMap;

use super::format::{self, LogBlock, Record};
use super::state::{BlockState, PoolState, Volume};

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
    out
}

/// The pool state `records` (from [`records_of`]) describe, checked: every mapping and
/// every count agree, or the checkpoint is refused.
pub fn state_from(
    records: &[Record],
    block_bytes: u64,
    data_blocks: usize,
) -> Result<PoolState, String> {
    let mut state = PoolState::new(block_bytes, data_blocks);
    for r in records {
        match r {
            Record::Create {
                vol,
                size,
                flags,
                name,
            } => {
                if state.volumes.contains_key(vol) {
                    return Err(format!("volume {vol} twice"));
                }
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
                let v = state
                    .volumes
                    .get_mut(vol)
                    .ok_or_else(|| format!("a run of volume {vol}, which is not there"))?;
                for i in 0..*len {
                    let (vb, e) = (vblock + u64::from(i), entry.wrapping_add(i));
                    if e & !super::state::OWNED == 0 || v.map.insert(vb, e).is_some() {
                        return Err(format!("volume {vol} block {vb}: a bad or repeated entry"));
                    }
                }
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
                    _ => return Err(format!("blocks {start}: state {st} count {count}")),
                };
                let end = start.checked_add(*len).filter(|&e| e <= data_blocks as u64);
                let Some(end) = end else {
                    return Err(format!("blocks {start}+{len} are past the pool"));
                };
                for b in *start..end {
                    state.blocks[b as usize] = s;
                }
            }
            other => return Err(format!("{other:?} in a checkpoint")),
        }
    }
    let problems = state.check();
    if !problems.is_empty() {
        return Err(format!(
            "the checkpoint disagrees with itself: {}",
            problems.join("; ")
        ));
    }
    Ok(state)
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
) -> Result<PoolState, String> {
    let magic = if version == 1 {
        format::CHECKPOINT_MAGIC_V1
    } else {
        format::CHECKPOINT_MAGIC
    };
    let mut records = Vec::new();
    for (i, p) in pages.iter().enumerate() {
        let page = LogBlock::decode_as(p, pool_uuid, &magic, version)
            .map_err(|e| format!("checkpoint page {i}: {e:?}"))?;
        let ours = if version == 1 {
            page.commit == generation
        } else {
            page.epoch == generation && page.blocks as usize == pages.len()
        };
        if page.seq != i as u64 || !ours || page.last != (i + 1 == pages.len()) {
            return Err(format!("checkpoint page {i} is out of place"));
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
        assert_eq!(load(&refs, &UUID, 4, 2, 64 << 10, 5000), Ok(state));
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
            .contains("disagrees"));
    }
}
