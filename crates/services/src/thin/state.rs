//! A thin pool's state as its log describes it: volumes, their mappings, and a reference
//! count per data block. Replay applies records to it in order, checking each one's
//! preconditions, and `cairn check` compares the counts it derives with the ones a
//! checkpoint stored. Pure logic, no I/O; the reactors' lock-free tables are built from
//! it at open.

use std::collections::BTreeMap;

use super::backup::Mark;
use super::error::ThinError;
use super::format::Record;
use super::pool::{check_name, check_size, VOLUME_BLOCKS_MAX};
use super::superblock::checkpoint_capacity_max;

/// A mapping entry's bit meaning "this volume holds the block alone" (a hint for the hot
/// path; the reference count is the truth).
pub const OWNED: u32 = 1 << 31;

/// The data block an entry names, if any (entries are block + 1, 0 a hole).
pub fn block_of(entry: u32) -> Option<u64> {
    match entry & !OWNED {
        0 => None,
        b => Some(u64::from(b - 1)),
    }
}

/// A record the state cannot take, read from the log (or made by a commit).
fn bad(why: String) -> ThinError {
    ThinError::damaged("log record", why)
}

/// Bytes a mapping may take in a checkpoint: one run record. The commit admits a volume
/// only while every mapping could take that much in the checkpoint area.
const MAPPING_BYTES: u64 = 21;

/// Virtual blocks of a volume of `size` bytes (the last one may be partial).
pub fn volume_blocks(size: u64, block_bytes: u64) -> u64 {
    size.div_ceil(block_bytes.max(1))
}

/// A volume size read from the metadata, within what the pool lets a volume have.
pub fn check_volume_size(size: u64, block_bytes: u64) -> Result<(), ThinError> {
    check_size(size, block_bytes, VOLUME_BLOCKS_MAX)
}

/// One volume (a thin volume, a snapshot or a clone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    /// Its name.
    pub name: String,
    /// Virtual size in bytes.
    pub size: u64,
    /// Bit 0: read-only.
    pub flags: u32,
    /// Virtual block -> entry, holes left out.
    pub map: BTreeMap<u64, u32>,
}

/// What a data block is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Free and zeroed.
    Free,
    /// Handed to a reactor for allocation, not mapped yet.
    Reserved,
    /// Mapped by this many volumes.
    Used(u32),
    /// Unmapped by its last volume, waiting to be zeroed.
    FreeDirty,
}

/// The pool.
#[derive(Debug, Clone)]
pub struct PoolState {
    /// Block size in bytes.
    pub block_bytes: u64,
    /// The volumes by id.
    pub volumes: BTreeMap<u32, Volume>,
    /// One per data block.
    pub blocks: Vec<BlockState>,
    /// Blocks that became [`BlockState::FreeDirty`] since the owner last took them (the
    /// commit thread zeroes them once the commit is durable). Not part of the state.
    pub freed: Vec<u64>,
    /// Backup checkpoints by id (see [`super::backup`]).
    pub marks: BTreeMap<u32, Mark>,
    /// Counts changes to `marks` and `exports` (so that the run-time copy is made again
    /// only after one). Not part of the state.
    pub marks_changed: u64,
    /// Exports added while serving, kept for the next start: name -> (volume, flags).
    pub exports: BTreeMap<String, (u32, u32)>,
}

impl PartialEq for PoolState {
    fn eq(&self, other: &PoolState) -> bool {
        self.block_bytes == other.block_bytes
            && self.volumes == other.volumes
            && self.blocks == other.blocks
            && self.marks == other.marks
            && self.exports == other.exports
    }
}

impl Eq for PoolState {}

impl PoolState {
    /// An empty pool of `data_blocks` blocks of `block_bytes`.
    pub fn new(block_bytes: u64, data_blocks: usize) -> PoolState {
        PoolState {
            block_bytes,
            volumes: BTreeMap::new(),
            blocks: vec![BlockState::Free; data_blocks],
            freed: Vec::new(),
            marks: BTreeMap::new(),
            marks_changed: 0,
            exports: BTreeMap::new(),
        }
    }

    /// The most mappings (all volumes together) a pool of this many blocks holds: what its
    /// largest checkpoint area has room for, a run record each. A state claiming more is
    /// refused before it is built, so damaged metadata cannot make opening allocate
    /// without bound.
    pub fn mappings_max(&self) -> u64 {
        checkpoint_capacity_max(self.blocks.len() as u64) / MAPPING_BYTES
    }

    /// Mappings of every volume together.
    pub fn mappings(&self) -> u64 {
        self.volumes.values().map(|v| v.map.len() as u64).sum()
    }

    /// One volume less maps block `b` (checked to be in use by the caller).
    fn drop_ref(&mut self, b: u64) {
        let s = &mut self.blocks[b as usize];
        *s = match *s {
            BlockState::Used(1) => {
                self.freed.push(b);
                BlockState::FreeDirty
            }
            BlockState::Used(n) => BlockState::Used(n - 1),
            other => other,
        };
    }

    fn volume(&mut self, vol: u32) -> Result<&mut Volume, ThinError> {
        self.volumes
            .get_mut(&vol)
            .ok_or_else(|| bad(format!("volume {vol} does not exist")))
    }

    /// Applies one record, or says which precondition it breaks (and changes nothing:
    /// every check comes before the first change). Every number a record carries is
    /// checked against what the pool and the volume hold before it is used.
    pub fn apply(&mut self, r: &Record) -> Result<(), ThinError> {
        match r {
            Record::Set { vol, vblock, entry } => self.set(*vol, *vblock, *entry),
            Record::Reserve { start, len } => {
                self.move_range(*start, *len, BlockState::Free, BlockState::Reserved)
            }
            Record::Zeroed { start, len } => {
                self.move_range(*start, *len, BlockState::FreeDirty, BlockState::Free)
            }
            Record::Create {
                vol,
                size,
                flags,
                name,
            } => {
                self.new_volume(*vol, name)?;
                check_volume_size(*size, self.block_bytes)
                    .map_err(|e| e.of_volume("log record", *vol))?;
                self.volumes.insert(
                    *vol,
                    Volume {
                        name: name.clone(),
                        size: *size,
                        flags: *flags,
                        map: BTreeMap::new(),
                    },
                );
                Ok(())
            }
            Record::Snapshot {
                src,
                new,
                flags,
                name,
            } => self.snapshot(*src, *new, *flags, name),
            Record::Delete { vol } => self.delete(*vol),
            Record::Run { .. } | Record::Blocks { .. } => {
                Err(bad("a checkpoint's record in the log".into()))
            }
            Record::Mark { .. }
            | Record::Unsnap { .. }
            | Record::Changed { .. }
            | Record::Unmark { .. }
            | Record::Export { .. }
            | Record::Unexport { .. } => self.apply_mark(r, false),
            Record::Grow { vol, size } => {
                let block_bytes = self.block_bytes;
                let v = self.volume(*vol)?;
                if *size < v.size {
                    return Err(bad(format!(
                        "volume {vol}: {size} bytes is smaller than its {}",
                        v.size
                    )));
                }
                check_volume_size(*size, block_bytes)
                    .map_err(|e| e.of_volume("log record", *vol))?;
                v.size = *size;
                Ok(())
            }
        }
    }

    /// [`Record::Set`]: volume `vol`'s block `vblock` maps to `entry` from now on.
    fn set(&mut self, vol: u32, vblock: u64, entry: u32) -> Result<(), ThinError> {
        let v = self
            .volumes
            .get(&vol)
            .ok_or_else(|| bad(format!("volume {vol} does not exist")))?;
        if vblock >= volume_blocks(v.size, self.block_bytes) {
            return Err(bad(format!("volume {vol}: block {vblock} is past its end")));
        }
        if entry == OWNED {
            return Err(bad(format!(
                "volume {vol} block {vblock}: an empty entry marked owned"
            )));
        }
        let old = v.map.get(&vblock).copied().and_then(block_of);
        let new = block_of(entry);
        if old != new {
            if let Some(b) = new {
                // Only a block just reserved is mapped by a write: a block already in
                // use is shared by snapshots, never by a second write.
                match self.blocks.get(b as usize) {
                    Some(BlockState::Reserved) => {}
                    Some(s) => {
                        return Err(bad(format!(
                            "block {b} is mapped while {s:?}, not reserved"
                        )))
                    }
                    None => {
                        return Err(bad(format!(
                            "block {b} is past the pool's {} blocks",
                            self.blocks.len()
                        )))
                    }
                }
            }
            if let Some(b) = old {
                if !matches!(self.blocks.get(b as usize), Some(BlockState::Used(_))) {
                    return Err(bad(format!("block {b} is unmapped while not in use")));
                }
            }
        }
        let v = self.volumes.get_mut(&vol).expect("checked above");
        if entry == 0 {
            v.map.remove(&vblock);
        } else {
            v.map.insert(vblock, entry);
        }
        if old != new {
            if let Some(b) = new {
                self.blocks[b as usize] = BlockState::Used(1);
            }
            if let Some(b) = old {
                self.drop_ref(b);
            }
        }
        Ok(())
    }

    /// [`Record::Reserve`] and [`Record::Zeroed`]: blocks `[start, start + len)`, all
    /// `from`, become `to`.
    fn move_range(
        &mut self,
        start: u64,
        len: u64,
        from: BlockState,
        to: BlockState,
    ) -> Result<(), ThinError> {
        let end = start
            .checked_add(len)
            .filter(|&e| e <= self.blocks.len() as u64)
            .ok_or_else(|| {
                bad(format!(
                    "blocks {start}+{len} are past the pool's {} blocks",
                    self.blocks.len()
                ))
            })?;
        let range = start as usize..end as usize;
        if let Some(b) = range.clone().find(|&b| self.blocks[b] != from) {
            return Err(bad(format!(
                "block {b} is {:?}, not {from:?}",
                self.blocks[b]
            )));
        }
        self.blocks[range].fill(to);
        Ok(())
    }

    /// [`Record::Snapshot`]: volume `new` named `name`, a copy of `src`'s mappings.
    fn snapshot(&mut self, src: u32, new: u32, flags: u32, name: &str) -> Result<(), ThinError> {
        self.new_volume(new, name)?;
        let source = self
            .volumes
            .get(&src)
            .ok_or_else(|| bad(format!("volume {src} does not exist")))?;
        for b in source.map.values().filter_map(|&e| block_of(e)) {
            // Every block gains a reference: its count must be one that can grow.
            if !matches!(self.blocks.get(b as usize), Some(BlockState::Used(n)) if *n < u32::MAX) {
                return Err(bad(format!(
                    "volume {src} maps block {b}, which is not in use"
                )));
            }
        }
        // As the commit admits a copy: with room left for a mapping of every block, so
        // that the writes to come cannot take the mappings past what a checkpoint holds.
        let copied = source.map.len() as u64;
        let after = self
            .mappings()
            .saturating_add(copied)
            .saturating_add(self.blocks.len() as u64);
        if after > self.mappings_max() {
            return Err(bad(format!(
                "a copy of volume {src}'s {copied} mappings is more than the pool's metadata holds ({})",
                self.mappings_max()
            )));
        }
        let mut copy = source.clone();
        for e in copy.map.values_mut() {
            *e &= !OWNED;
        }
        for b in copy.map.values().filter_map(|&e| block_of(e)) {
            if let BlockState::Used(n) = &mut self.blocks[b as usize] {
                *n = n.saturating_add(1);
            }
        }
        // The origin shares every block now: no entry is owned any more.
        for e in self
            .volumes
            .get_mut(&src)
            .expect("checked")
            .map
            .values_mut()
        {
            *e &= !OWNED;
        }
        copy.name = name.to_string();
        copy.flags = flags;
        self.volumes.insert(new, copy);
        Ok(())
    }

    /// [`Record::Delete`]: volume `vol` goes, and its blocks lose a reference each.
    fn delete(&mut self, vol: u32) -> Result<(), ThinError> {
        let v = self
            .volumes
            .get(&vol)
            .ok_or_else(|| bad(format!("volume {vol} does not exist")))?;
        if let Some(b) = v
            .map
            .values()
            .filter_map(|&e| block_of(e))
            .find(|&b| !matches!(self.blocks.get(b as usize), Some(BlockState::Used(_))))
        {
            return Err(bad(format!(
                "volume {vol} maps block {b}, which is not in use"
            )));
        }
        self.marks_before_delete(vol)?;
        let v = self.volumes.remove(&vol).expect("checked");
        for b in v.map.values().filter_map(|&e| block_of(e)) {
            self.drop_ref(b);
        }
        Ok(())
    }

    /// Whether volume `vol` named `name` may be added: a new id, and a name the pool
    /// gives volumes (no other, and none a refusal would print on two lines).
    fn new_volume(&self, vol: u32, name: &str) -> Result<(), ThinError> {
        check_name(name).map_err(|e| e.of_volume("log record", vol))?;
        if self.volumes.contains_key(&vol) {
            return Err(bad(format!("volume {vol} exists already")));
        }
        if self.volumes.values().any(|v| v.name == name) {
            return Err(bad(format!("a volume is named '{name}' already")));
        }
        Ok(())
    }

    /// What `cairn check` finds wrong: every block's count against the mappings that
    /// name it, and every mapping's block in range. Empty when all agree.
    pub fn check(&self) -> Vec<String> {
        let mut counted = vec![0u32; self.blocks.len()];
        let mut problems = Vec::new();
        for (id, v) in &self.volumes {
            for (vb, &e) in &v.map {
                match block_of(e) {
                    Some(b) if (b as usize) < counted.len() => {
                        counted[b as usize] = counted[b as usize].saturating_add(1)
                    }
                    Some(b) => {
                        problems.push(format!("volume {id} block {vb} maps to {b}, past the pool"))
                    }
                    None => problems.push(format!("volume {id} block {vb} holds an empty entry")),
                }
            }
        }
        for (b, (&n, s)) in counted.iter().zip(&self.blocks).enumerate() {
            let ok = match s {
                BlockState::Used(m) => *m == n,
                _ => n == 0,
            };
            if !ok {
                problems.push(format!("block {b} is {s:?} but {n} mappings name it"));
            }
        }
        self.check_marks(&mut problems);
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(vol: u32, vblock: u64, block: u64) -> Record {
        Record::Set {
            vol,
            vblock,
            entry: (block as u32 + 1) | OWNED,
        }
    }

    fn create(vol: u32, name: &str) -> Record {
        Record::Create {
            vol,
            size: 64 << 20,
            flags: 0,
            name: name.into(),
        }
    }

    fn pool(records: &[Record]) -> PoolState {
        let mut p = PoolState::new(64 << 10, 64);
        for r in records {
            p.apply(r).unwrap_or_else(|e| panic!("{r:?}: {e}"));
        }
        assert_eq!(p.check(), Vec::<String>::new());
        p
    }

    #[test]
    fn snapshots_share_blocks_and_deletes_in_any_order_free_them() {
        let mut p = pool(&[
            Record::Reserve { start: 0, len: 4 },
            create(1, "vm"),
            set(1, 0, 0),
            set(1, 1, 1),
            Record::Snapshot {
                src: 1,
                new: 2,
                flags: 1,
                name: "snap".into(),
            },
        ]);
        assert_eq!(p.blocks[0], BlockState::Used(2));
        assert!(p.volumes[&1].map.values().all(|e| e & OWNED == 0));
        // The origin's copy on write: block 0 replaced by block 2.
        p.apply(&set(1, 0, 2)).unwrap();
        assert_eq!(p.blocks[0], BlockState::Used(1));
        assert_eq!(p.blocks[2], BlockState::Used(1));
        // A clone of the snapshot, then the snapshot deleted before the clone.
        p.apply(&Record::Snapshot {
            src: 2,
            new: 3,
            flags: 0,
            name: "clone".into(),
        })
        .unwrap();
        p.apply(&Record::Delete { vol: 2 }).unwrap();
        assert_eq!(p.blocks[0], BlockState::Used(1));
        p.apply(&Record::Delete { vol: 1 }).unwrap();
        assert_eq!(p.blocks[1], BlockState::Used(1));
        assert_eq!(p.blocks[2], BlockState::FreeDirty);
        p.apply(&Record::Delete { vol: 3 }).unwrap();
        assert!(p.blocks[..3].iter().all(|&s| s == BlockState::FreeDirty));
        p.apply(&Record::Zeroed { start: 0, len: 3 }).unwrap();
        assert_eq!(p.check(), Vec::<String>::new());
    }

    #[test]
    fn a_record_breaking_a_rule_is_refused_and_changes_nothing() {
        let p = pool(&[
            Record::Reserve { start: 0, len: 2 },
            create(1, "vm"),
            set(1, 0, 0),
        ]);
        for bad in [
            set(1, 1, 5),                         // block 5 was never reserved
            set(1, 1, 100),                       // past the pool
            set(9, 0, 1),                         // no such volume
            set(1, 1 << 20, 1),                   // past the volume's end
            create(1, "other"),                   // id taken
            create(2, "vm"),                      // name taken
            Record::Reserve { start: 0, len: 1 }, // block 0 is in use
            Record::Zeroed { start: 1, len: 1 },  // block 1 is reserved, not dirty
            Record::Delete { vol: 7 },
            Record::Grow {
                vol: 1,
                size: 1 << 20,
            }, // shrinking
            // Sizes outside what the pool lets a volume have: none, not whole 4 KiB
            // pages, more blocks than a volume's table holds.
            Record::Create {
                vol: 2,
                size: 0,
                flags: 0,
                name: "empty".into(),
            },
            Record::Create {
                vol: 2,
                size: 4097,
                flags: 0,
                name: "odd".into(),
            },
            Record::Create {
                vol: 2,
                size: u64::MAX,
                flags: 0,
                name: "huge".into(),
            },
            Record::Grow {
                vol: 1,
                size: (VOLUME_BLOCKS_MAX + 1) * (64 << 10),
            },
            Record::Grow {
                vol: 1,
                size: (64 << 20) + 512,
            },
            // An entry naming no block but marked owned.
            Record::Set {
                vol: 1,
                vblock: 1,
                entry: OWNED,
            },
            Record::Set {
                vol: 1,
                vblock: u64::MAX,
                entry: 2 | OWNED,
            },
            Record::Reserve {
                start: u64::MAX,
                len: 2,
            },
            Record::Zeroed {
                start: 1,
                len: u64::MAX,
            },
            // Names the pool never gives a volume (a refusal would print them).
            create(2, "two\nlines"),
            create(2, ""),
            Record::Snapshot {
                src: 1,
                new: 2,
                flags: 1,
                name: "a/b".into(),
            },
        ] {
            let mut q = p.clone();
            let e = q.apply(&bad).expect_err("taken");
            assert!(!e.to_string().contains('\n'), "{bad:?}: {e}");
            assert_eq!(q, p, "{bad:?} changed the state");
        }
    }

    /// A snapshot is refused when the mappings would outgrow what the pool's metadata
    /// holds (each copy makes the state a checkpoint must hold larger), and when a block's
    /// count cannot grow.
    #[test]
    fn a_snapshot_past_what_the_metadata_holds_is_refused() {
        let blocks = 60_000u64;
        let mut p = PoolState::new(64 << 10, blocks as usize);
        p.apply(&Record::Reserve {
            start: 0,
            len: blocks,
        })
        .unwrap();
        p.apply(&Record::Create {
            vol: 1,
            size: blocks * (64 << 10),
            flags: 0,
            name: "full".into(),
        })
        .unwrap();
        for b in 0..blocks {
            p.apply(&set(1, b, b)).unwrap();
        }
        let mut taken = 0;
        let refused = (2..20u32).find_map(|new| {
            let r = Record::Snapshot {
                src: 1,
                new,
                flags: 1,
                name: format!("s{new}"),
            };
            match p.apply(&r) {
                Ok(()) => {
                    taken += 1;
                    None
                }
                Err(e) => Some(e),
            }
        });
        let e = refused.expect("a snapshot refused");
        assert!(
            e.to_string()
                .contains("more than the pool's metadata holds"),
            "{e}"
        );
        // Every snapshot taken left room for a mapping of every block.
        assert!(taken >= 1);
        assert!(p.mappings() + blocks <= p.mappings_max());
        assert_eq!(p.check(), Vec::<String>::new());

        let mut q = pool(&[
            Record::Reserve { start: 0, len: 1 },
            create(1, "vm"),
            set(1, 0, 0),
        ]);
        q.blocks[0] = BlockState::Used(u32::MAX);
        let before = q.clone();
        let snap = Record::Snapshot {
            src: 1,
            new: 2,
            flags: 1,
            name: "snap".into(),
        };
        assert!(q.apply(&snap).is_err());
        assert_eq!(q, before);
    }

    #[test]
    fn check_finds_counts_that_disagree_with_the_mappings() {
        let mut p = pool(&[
            Record::Reserve { start: 0, len: 2 },
            create(1, "vm"),
            set(1, 0, 0),
        ]);
        p.blocks[0] = BlockState::Used(2);
        p.blocks[1] = BlockState::Used(1);
        let problems = p.check();
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("block 0"), "{problems:?}");
    }

    mod model {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Create,
            Write(usize, u64),
            Discard(usize, u64),
            Snapshot(usize),
            Delete(usize),
            ZeroFreed,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                1 => Just(Op::Create),
                8 => (0..6usize, 0..16u64).prop_map(|(v, b)| Op::Write(v, b)),
                2 => (0..6usize, 0..16u64).prop_map(|(v, b)| Op::Discard(v, b)),
                2 => (0..6usize).prop_map(Op::Snapshot),
                2 => (0..6usize).prop_map(Op::Delete),
                1 => Just(Op::ZeroFreed),
            ]
        }

        proptest! {
            // Failures are printed with their minimal case; nothing is written to the tree.
            #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

            /// Random creates, writes, discards, snapshots, deletes and zeroing over a
            /// 24-block pool: after every record the counts agree with the mappings, and
            /// every volume maps exactly the data a plain model says it holds.
            #[test]
            fn the_state_follows_a_model_of_every_volume(ops in prop::collection::vec(op(), 1..80)) {
                let mut p = PoolState::new(64 << 10, 24);
                // Volume id -> (vblock -> the write that put its data there).
                let mut model: BTreeMap<u32, BTreeMap<u64, u64>> = BTreeMap::new();
                // Data block -> the write whose data it holds.
                let mut disk: BTreeMap<u64, u64> = BTreeMap::new();
                let (mut next_vol, mut next_write) = (1u32, 1u64);
                let pick = |model: &BTreeMap<u32, BTreeMap<u64, u64>>, i: usize| {
                    let ids: Vec<u32> = model.keys().copied().collect();
                    (!ids.is_empty()).then(|| ids[i % ids.len()])
                };
                for op in ops {
                    let records = match op {
                        Op::Create => {
                            next_vol += 1;
                            model.insert(next_vol, BTreeMap::new());
                            vec![create(next_vol, &format!("v{next_vol}"))]
                        }
                        Op::Write(i, vb) => {
                            let Some(vol) = pick(&model, i) else { continue };
                            let Some(b) = p.blocks.iter().position(|&s| s == BlockState::Free) else {
                                continue; // a full pool: ENOSPC, nothing changes
                            };
                            let b = b as u64;
                            next_write += 1;
                            disk.insert(b, next_write);
                            model.get_mut(&vol).unwrap().insert(vb, next_write);
                            vec![Record::Reserve { start: b, len: 1 }, set(vol, vb, b)]
                        }
                        Op::Discard(i, vb) => {
                            let Some(vol) = pick(&model, i) else { continue };
                            model.get_mut(&vol).unwrap().remove(&vb);
                            vec![Record::Set { vol, vblock: vb, entry: 0 }]
                        }
                        Op::Snapshot(i) => {
                            let Some(src) = pick(&model, i) else { continue };
                            next_vol += 1;
                            let copy = model[&src].clone();
                            model.insert(next_vol, copy);
                            vec![Record::Snapshot { src, new: next_vol, flags: 1, name: format!("s{next_vol}") }]
                        }
                        Op::Delete(i) => {
                            let Some(vol) = pick(&model, i) else { continue };
                            model.remove(&vol);
                            vec![Record::Delete { vol }]
                        }
                        Op::ZeroFreed => (0..p.blocks.len() as u64)
                            .filter(|&b| p.blocks[b as usize] == BlockState::FreeDirty)
                            .map(|b| Record::Zeroed { start: b, len: 1 })
                            .collect(),
                    };
                    for r in &records {
                        prop_assert!(p.apply(r).is_ok(), "{:?} refused: {:?}", r, p.apply(r));
                    }
                    prop_assert_eq!(p.check(), Vec::<String>::new());
                    prop_assert_eq!(p.volumes.len(), model.len());
                    for (vol, want) in &model {
                        let got: BTreeMap<u64, u64> = p.volumes[vol]
                            .map
                            .iter()
                            .map(|(&vb, &e)| (vb, disk[&block_of(e).unwrap()]))
                            .collect();
                        prop_assert_eq!(&got, want, "volume {}", vol);
                    }
                }
            }
        }
    }
}
