//! Backup checkpoints of thin volumes, kept in the pool's own metadata.
//!
//! A checkpoint of volume V is a read-only snapshot of V taken while V's writes are held,
//! and a [`Mark`] naming it. Nothing is written per I/O: after a snapshot every block of V
//! is shared, so a write to V copies it (or maps a hole) and a discard unmaps it, and
//! "what changed since checkpoint c" is the set of virtual blocks whose entry in c's
//! snapshot names another data block than the entry of the volume read now (a block two
//! volumes share is never written in place, and is not freed while the snapshot maps it,
//! so the same block number means the same data). Marks are committed with the pool's
//! mappings, in the same commits, so a crash leaves them agreeing.
//!
//! When a checkpoint's snapshot is deleted, the blocks that changed from it to the next
//! checkpoint that still has its snapshot (its *target*) are recorded first as runs
//! ([`Record::Changed`]), so nothing a later incremental backup needs is lost; the
//! volume's newest checkpoint always keeps its snapshot (the changes since it are counted
//! against it).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

use cairn_core::DirtyMap;

use super::commit::Committer;
use super::error::ThinError;
use super::format::Record;
use super::pool::{check_name, lock, Inner, Marks, Volume, VOLUME_BLOCKS_MAX};
use super::state::{block_of, volume_blocks, PoolState};
use super::table::LEAF_ENTRIES;

/// Largest granularity a checkpoint reports in (1 GiB, the largest pool block).
pub const SHIFT_MAX: u8 = 30;

/// One checkpoint of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    /// The volume checkpointed.
    pub vol: u32,
    /// Its snapshot at the checkpoint, while it exists.
    pub snap: Option<u32>,
    /// The checkpoint's name (its snapshot's).
    pub name: String,
    /// Changes are reported in units of `1 << shift` bytes.
    pub shift: u8,
    /// Once the snapshot is gone: what changed from it to a later checkpoint.
    pub delta: Option<Delta>,
}

/// The virtual blocks that changed from a checkpoint to its target.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Delta {
    /// The later checkpoint (same volume).
    pub target: u32,
    /// Runs of virtual blocks, `(first, count)`, in order, apart.
    pub runs: Vec<(u64, u64)>,
}

impl Delta {
    /// Whether virtual block `vb` changed.
    pub fn has(&self, vb: u64) -> bool {
        let i = self.runs.partition_point(|&(s, _)| s <= vb);
        i > 0 && {
            let (s, n) = self.runs[i - 1];
            vb < s + n
        }
    }

    /// Whether any block of `[from, to)` changed.
    pub fn any_in(&self, from: u64, to: u64) -> bool {
        let i = self.runs.partition_point(|&(s, n)| s + n <= from);
        self.runs.get(i).is_some_and(|&(s, _)| s < to)
    }
}

/// The runs of virtual blocks whose entries name different data blocks in `a` and `b`
/// (an entry's ownership bit aside; a hole against a block is a change).
pub fn diff(a: &BTreeMap<u64, u32>, b: &BTreeMap<u64, u32>) -> Vec<(u64, u64)> {
    let mut changed: Vec<u64> = Vec::new();
    for (vb, e) in a {
        if b.get(vb).copied().and_then(block_of) != block_of(*e) {
            changed.push(*vb);
        }
    }
    for (vb, e) in b {
        if !a.contains_key(vb) && block_of(*e).is_some() {
            changed.push(*vb);
        }
    }
    changed.sort_unstable();
    runs_of(&changed)
}

/// Sorted blocks as runs.
fn runs_of(sorted: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &b in sorted {
        match out.last_mut() {
            Some((s, n)) if *s + *n == b => *n += 1,
            _ => out.push((b, 1)),
        }
    }
    out
}

/// The union of two sets of runs.
pub fn union(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut all: Vec<(u64, u64)> = a.iter().chain(b).copied().collect();
    all.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, n) in all {
        match out.last_mut() {
            Some((ps, pn)) if s <= *ps + *pn => *pn = (*pn).max(s + n - *ps),
            _ => out.push((s, n)),
        }
    }
    out
}

/// The records that give checkpoint `id` the delta `runs` to `target`.
pub fn unsnap_records(id: u32, target: u32, runs: &[(u64, u64)]) -> Vec<Record> {
    let mut out = vec![Record::Unsnap { id, target }];
    out.extend(
        runs.iter()
            .map(|&(vblock, len)| Record::Changed { id, vblock, len }),
    );
    out
}

/// Damage: `why` a record of checkpoints cannot apply.
fn bad(why: String) -> ThinError {
    ThinError::damaged("log record", why)
}

impl PoolState {
    /// Applies a checkpoint's record ([`Record::Mark`] and those after it). `in_checkpoint`:
    /// read from a checkpoint page, where a mark whose snapshot is gone says so with a
    /// `snap` of 0. Every check comes before the first change.
    pub fn apply_mark(&mut self, r: &Record, in_checkpoint: bool) -> Result<(), ThinError> {
        match r {
            Record::Mark {
                id,
                vol,
                snap,
                shift,
                name,
            } => self.add_mark(*id, (*vol, *snap, *shift, name), in_checkpoint),
            Record::Unsnap { id, target } => {
                let m = self.mark(*id)?;
                let t = self.marks.get(target);
                if *target <= *id || t.is_none_or(|t| t.vol != m.vol) {
                    return Err(bad(format!(
                        "checkpoint {id}: target {target} is not a later checkpoint of its volume"
                    )));
                }
                let m = self.marks.get_mut(id).expect("checked");
                m.snap = None;
                m.delta = Some(Delta {
                    target: *target,
                    runs: Vec::new(),
                });
                self.marks_changed += 1;
                Ok(())
            }
            Record::Changed { id, vblock, len } => self.add_changed(*id, *vblock, *len),
            Record::Export { vol, flags, name } => {
                check_name(name).map_err(|e| e.of_volume("log record", *vol))?;
                let writable = flags & 1 != 0;
                match self.volumes.get(vol) {
                    Some(v) if !writable || v.flags & 1 == 0 => {}
                    _ => {
                        return Err(bad(format!(
                            "export '{name}': volume {vol} is not there, or not writable"
                        )))
                    }
                }
                if *flags & !1 != 0 || self.exports.contains_key(name) {
                    return Err(bad(format!("export '{name}' twice, or flags {flags:#x}")));
                }
                self.exports.insert(name.clone(), (*vol, *flags));
                self.marks_changed += 1;
                Ok(())
            }
            Record::Unexport { name } => {
                if self.exports.remove(name).is_none() {
                    return Err(bad(format!("export '{name}' does not exist")));
                }
                self.marks_changed += 1;
                Ok(())
            }
            Record::Unmark { id } => {
                self.mark(*id)?;
                if let Some((o, _)) = self
                    .marks
                    .iter()
                    .find(|(_, m)| m.delta.as_ref().is_some_and(|d| d.target == *id))
                {
                    return Err(bad(format!("checkpoint {id} is checkpoint {o}'s target")));
                }
                let m = self.marks.remove(id).expect("checked");
                let last = self.marks.values().rev().find(|x| x.vol == m.vol);
                if last.is_some_and(|l| l.snap.is_none()) {
                    self.marks.insert(*id, m);
                    return Err(bad(format!(
                        "checkpoint {id}: without it its volume's newest checkpoint has no snapshot"
                    )));
                }
                self.marks_changed += 1;
                Ok(())
            }
            other => Err(bad(format!("{other:?} is not a checkpoint's record"))),
        }
    }

    fn mark(&self, id: u32) -> Result<&Mark, ThinError> {
        self.marks
            .get(&id)
            .ok_or_else(|| bad(format!("checkpoint {id} does not exist")))
    }

    /// [`Record::Mark`].
    fn add_mark(
        &mut self,
        id: u32,
        (vol, snap, shift, name): (u32, u32, u8, &str),
        in_checkpoint: bool,
    ) -> Result<(), ThinError> {
        if id == 0 || self.marks.keys().next_back().is_some_and(|&l| l >= id) {
            return Err(bad(format!(
                "checkpoint {id} is not newer than every checkpoint before it"
            )));
        }
        check_name(name).map_err(|e| e.of_volume("log record", vol))?;
        let block_shift = self.block_bytes.trailing_zeros() as u8;
        if !(block_shift..=SHIFT_MAX).contains(&shift) {
            return Err(bad(format!("checkpoint {id}: granularity 2^{shift}")));
        }
        match self.volumes.get(&vol) {
            Some(v) if v.flags & 1 == 0 => {}
            _ => {
                return Err(bad(format!(
                    "checkpoint {id}: volume {vol} is not a writable volume"
                )))
            }
        }
        if snap == 0 && !in_checkpoint {
            return Err(bad(format!("checkpoint {id} without a snapshot")));
        }
        if snap != 0 {
            match self.volumes.get(&snap) {
                Some(s) if s.flags & 1 != 0 && s.name == name => {}
                _ => {
                    return Err(bad(format!(
                        "checkpoint {id}: volume {snap} is not its snapshot '{name}'"
                    )))
                }
            }
            if self.marks.values().any(|m| m.snap == Some(snap)) {
                return Err(bad(format!(
                    "checkpoint {id}: volume {snap} is another checkpoint's snapshot"
                )));
            }
        }
        self.marks.insert(
            id,
            Mark {
                vol,
                snap: (snap != 0).then_some(snap),
                name: name.to_string(),
                shift,
                delta: None,
            },
        );
        self.marks_changed += 1;
        Ok(())
    }

    /// [`Record::Changed`]: a run after the ones the checkpoint's delta has (merged with
    /// the last when they touch), inside the largest volume, and within what the pool's
    /// metadata holds in all.
    fn add_changed(&mut self, id: u32, vblock: u64, len: u64) -> Result<(), ThinError> {
        let runs_max = self.mappings_max();
        let total: u64 = self
            .marks
            .values()
            .filter_map(|m| m.delta.as_ref())
            .map(|d| d.runs.len() as u64)
            .sum();
        let m = self.mark(id)?;
        let Some(d) = &m.delta else {
            return Err(bad(format!("checkpoint {id} still has its snapshot")));
        };
        let end = vblock
            .checked_add(len)
            .filter(|&e| len > 0 && e <= VOLUME_BLOCKS_MAX);
        let after = d.runs.last().is_none_or(|&(s, n)| vblock >= s + n);
        if end.is_none() || !after || total >= runs_max {
            return Err(bad(format!(
                "checkpoint {id}: a run of {len} changed blocks from {vblock} out of place"
            )));
        }
        let d = self
            .marks
            .get_mut(&id)
            .and_then(|m| m.delta.as_mut())
            .expect("checked");
        match d.runs.last_mut() {
            Some((s, n)) if *s + *n == vblock => *n += len,
            _ => d.runs.push((vblock, len)),
        }
        self.marks_changed += 1;
        Ok(())
    }

    /// Before volume `vol` is deleted: refused while it is a checkpoint's snapshot (its
    /// delta is recorded first); its own checkpoints and its exports go with it.
    pub(super) fn marks_before_delete(&mut self, vol: u32) -> Result<(), ThinError> {
        if let Some((id, _)) = self.marks.iter().find(|(_, m)| m.snap == Some(vol)) {
            return Err(bad(format!(
                "volume {vol} is checkpoint {id}'s snapshot, deleted before its changes were recorded"
            )));
        }
        let before = self.marks.len() + self.exports.len();
        self.marks.retain(|_, m| m.vol != vol);
        self.exports.retain(|_, (v, _)| *v != vol);
        if self.marks.len() + self.exports.len() != before {
            self.marks_changed += 1;
        }
        Ok(())
    }

    /// What is wrong with the checkpoints (for [`PoolState::check`]).
    pub(super) fn check_marks(&self, problems: &mut Vec<String>) {
        for (id, m) in &self.marks {
            if self.volumes.get(&m.vol).is_none_or(|v| v.flags & 1 != 0) {
                problems.push(format!("checkpoint {id}: volume {} is not writable", m.vol));
            }
            match (m.snap, &m.delta) {
                (Some(s), None) if self.volumes.get(&s).is_some_and(|v| v.flags & 1 != 0) => {}
                (None, Some(d))
                    if d.target > *id
                        && self.marks.get(&d.target).is_some_and(|t| t.vol == m.vol) => {}
                _ => problems.push(format!(
                    "checkpoint {id}: neither a snapshot nor the changes to a later checkpoint"
                )),
            }
            let newest = self.marks.range(id + 1..).all(|(_, x)| x.vol != m.vol);
            if newest && m.snap.is_none() {
                problems.push(format!(
                    "checkpoint {id}: the newest of volume {} has no snapshot",
                    m.vol
                ));
            }
        }
    }

    /// The records a checkpoint page holds for the checkpoints: every mark, then the
    /// deltas (whose targets are later marks).
    pub(super) fn mark_records(&self, out: &mut Vec<Record>) {
        for (&id, m) in &self.marks {
            out.push(Record::Mark {
                id,
                vol: m.vol,
                snap: m.snap.unwrap_or(0),
                shift: m.shift,
                name: m.name.clone(),
            });
        }
        for (&id, m) in &self.marks {
            if let Some(d) = &m.delta {
                out.extend(unsnap_records(id, d.target, &d.runs));
            }
        }
        for (name, &(vol, flags)) in &self.exports {
            out.push(Record::Export {
                vol,
                flags,
                name: name.clone(),
            });
        }
    }

    /// The checkpoints of volume `vol`, oldest first.
    pub fn marks_of(&self, vol: u32) -> impl Iterator<Item = (u32, &Mark)> {
        self.marks
            .iter()
            .filter(move |(_, m)| m.vol == vol)
            .map(|(&id, m)| (id, m))
    }
}

impl Committer {
    /// `checkpoint`: a snapshot `name` of `src` marked as its next checkpoint, in one
    /// commit, while writes to `src` are held.
    pub(super) fn take_checkpoint(
        &mut self,
        src: &str,
        name: &str,
        granularity: Option<u64>,
    ) -> Result<String, ThinError> {
        let source = self.find(src)?;
        if source.read_only {
            return Err(ThinError::CheckpointOfSnapshot {
                src: src.to_string(),
            });
        }
        let block = self.inner.block_bytes();
        let previous = self.state.marks_of(source.id).last().map(|(_, m)| m.shift);
        let shift = match granularity {
            None => previous.unwrap_or(block.trailing_zeros() as u8),
            Some(g) if g.is_power_of_two() && g >= block && g <= 1 << SHIFT_MAX => {
                g.trailing_zeros() as u8
            }
            Some(asked) => return Err(ThinError::Granularity { block, asked }),
        };
        let id = self.state.marks.keys().next_back().map_or(1, |l| l + 1);
        self.check_copy(&source, name)?;
        let held = self.snapshot(&source, name, true, Some((id, shift)))?;
        let before = self.state.marks_of(source.id).count() - 1;
        Ok(format!(
            "checkpoint '{name}' of '{src}' taken (writes to '{src}' held for {held}); the changes since it are counted from the pool's mappings{}",
            if before > 0 {
                format!(
                    ", and an export of snapshot '{name}' offers the changes up to it since {}",
                    self.state
                        .marks_of(source.id)
                        .take(before)
                        .map(|(_, m)| format!("'{}'", m.name))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else {
                String::new()
            }
        ))
    }

    /// Before volume `v` is deleted: if it is a checkpoint's snapshot, the records that
    /// keep the changes from it to the next checkpoint with a snapshot; refused for the
    /// newest checkpoint's.
    pub(super) fn before_delete(&mut self, v: &Volume) -> Result<Vec<Record>, ThinError> {
        let Some((&id, m)) = self.state.marks.iter().find(|(_, m)| m.snap == Some(v.id)) else {
            return Ok(Vec::new());
        };
        let Some((target, t_snap)) = self.next_snapshot(m.vol, id) else {
            return Err(ThinError::NewestCheckpoint {
                pool: self.inner.name.clone(),
                volume: self.name_of(m.vol),
                name: m.name.clone(),
            });
        };
        let runs = self.diff_volumes(v.id, t_snap);
        Ok(unsnap_records(id, target, &runs))
    }

    /// `checkpoint remove`: away with checkpoint `name` of `volume` and its snapshot. The
    /// checkpoints whose changes went through it keep them (they reach the next one), or,
    /// when it was the newest, go too (nothing later counts the changes since them).
    pub(super) fn remove_checkpoint(
        &mut self,
        volume: &str,
        name: &str,
    ) -> Result<String, ThinError> {
        let v = self.find(volume)?;
        let Some((id, m)) = self
            .state
            .marks_of(v.id)
            .find(|(_, m)| m.name == name)
            .map(|(id, m)| (id, m.clone()))
        else {
            return Err(ThinError::NoCheckpoint {
                pool: self.inner.name.clone(),
                volume: volume.to_string(),
                name: name.to_string(),
                known: self
                    .state
                    .marks_of(v.id)
                    .map(|(_, m)| m.name.clone())
                    .collect(),
            });
        };
        let snap = match m.snap {
            Some(s) => Some(self.volume_in_use(s)?),
            None => None,
        };
        // Where its changes lead: the next checkpoint with a snapshot, with what changed
        // on the way there.
        let next = match (&m.delta, m.snap) {
            (Some(d), _) => Some((d.target, d.runs.clone())),
            (None, Some(s)) => self
                .next_snapshot(m.vol, id)
                .map(|(t, ts)| (t, self.diff_volumes(s, ts))),
            (None, None) => None,
        };
        let mut records = Vec::new();
        let mut dropped = Vec::new();
        let through: Vec<(u32, Delta)> = self
            .state
            .marks
            .iter()
            .filter_map(|(&i, x)| Some((i, x.delta.clone()?)))
            .filter(|(_, d)| d.target == id)
            .collect();
        match &next {
            Some((target, runs)) => {
                for (i, d) in &through {
                    records.extend(unsnap_records(*i, *target, &union(&d.runs, runs)));
                }
            }
            None => {
                // The newest: every checkpoint whose changes reach the volume only
                // through it goes as well, oldest first (none is another's target then).
                for (&i, x) in self.state.marks.range(..id).filter(|(_, x)| x.vol == v.id) {
                    if chain(&self.state.marks, i).is_some_and(|(_, s)| Some(s) == m.snap) {
                        records.push(Record::Unmark { id: i });
                        dropped.push(x.name.clone());
                    }
                }
            }
        }
        records.push(Record::Unmark { id });
        if let Some(s) = &snap {
            self.capture(&mut records);
            lock(&self.inner.volumes).remove(&s.id);
            records.push(Record::Delete { vol: s.id });
        }
        self.commit(records)?;
        if snap.is_some() {
            let owned = self.reown();
            self.commit(owned)?;
        }
        let newest = self
            .state
            .marks_of(v.id)
            .last()
            .map(|(_, x)| x.name.clone());
        Ok(removed_reply(
            volume,
            name,
            snap.is_some(),
            &dropped,
            newest,
        ))
    }

    /// `export add`: export `name` of `volume` kept in the metadata for the next start.
    pub(super) fn keep_export(
        &mut self,
        name: &str,
        volume: &str,
        writable: bool,
    ) -> Result<String, ThinError> {
        let v = self.find(volume)?;
        if writable && v.read_only {
            return Err(ThinError::Invalid(format!(
                "'{volume}' is a snapshot: it is served read-only"
            )));
        }
        if self.state.exports.contains_key(name) {
            return Err(ThinError::Invalid(format!(
                "thin pool '{}' keeps an export '{name}' already",
                self.inner.name
            )));
        }
        self.commit(vec![Record::Export {
            vol: v.id,
            flags: u32::from(writable),
            name: name.to_string(),
        }])?;
        Ok(format!(
            "kept in thin pool '{}' for the next start",
            self.inner.name
        ))
    }

    /// `export remove`: export `name` is no longer kept.
    pub(super) fn drop_export(&mut self, name: &str) -> Result<String, ThinError> {
        if !self.state.exports.contains_key(name) {
            return Err(ThinError::Invalid(format!(
                "thin pool '{}' keeps no export '{name}'",
                self.inner.name
            )));
        }
        self.commit(vec![Record::Unexport {
            name: name.to_string(),
        }])?;
        Ok(format!("no longer kept in thin pool '{}'", self.inner.name))
    }

    /// Volume `name`, or the error naming it.
    fn find(&self, name: &str) -> Result<Arc<Volume>, ThinError> {
        self.inner.volume(name).ok_or_else(|| ThinError::NoVolume {
            pool: self.inner.name.clone(),
            name: name.to_string(),
        })
    }

    /// The first checkpoint of volume `vol` after `id` that has its snapshot, and that
    /// snapshot.
    fn next_snapshot(&self, vol: u32, id: u32) -> Option<(u32, u32)> {
        self.state
            .marks
            .range(id + 1..)
            .find_map(|(&t, x)| (x.vol == vol).then_some(x.snap.map(|s| (t, s)))?)
    }

    /// The runs of virtual blocks volumes `a` and `b` map differently (committed state:
    /// both are snapshots, which change no more).
    fn diff_volumes(&self, a: u32, b: u32) -> Vec<(u64, u64)> {
        let empty = BTreeMap::new();
        let map = |v: u32| self.state.volumes.get(&v).map_or(&empty, |x| &x.map);
        diff(map(a), map(b))
    }

    fn name_of(&self, vol: u32) -> String {
        self.state
            .volumes
            .get(&vol)
            .map_or_else(|| format!("#{vol}"), |v| v.name.clone())
    }

    /// Volume `id`, refused while devices are open on it.
    fn volume_in_use(&self, id: u32) -> Result<Arc<Volume>, ThinError> {
        let v = self
            .inner
            .volume_by_id(id)
            .ok_or_else(|| ThinError::NoVolume {
                pool: self.inner.name.clone(),
                name: self.name_of(id),
            })?;
        let users = v.users.load(std::sync::atomic::Ordering::SeqCst);
        if users > 0 {
            return Err(ThinError::Busy {
                name: v.name.clone(),
                users,
            });
        }
        Ok(v)
    }
}

/// A checkpoint as `checkpoint list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// The volume checkpointed.
    pub volume: String,
    /// The checkpoint's name (its snapshot's, while it exists).
    pub name: String,
    /// Its snapshot is still in the pool.
    pub snapshot: bool,
    /// Bytes per unit its changes are reported in.
    pub granularity: u64,
    /// With its snapshot gone: the checkpoint its kept changes lead to, and their bytes.
    pub kept: Option<(String, u64)>,
}

/// Every checkpoint of the pool, by volume and age.
pub(crate) fn list(inner: &Inner) -> Vec<CheckpointInfo> {
    let marks = inner.marks();
    let volumes = lock(&inner.volumes);
    let name = |v: u32| {
        volumes
            .get(&v)
            .map_or_else(|| format!("#{v}"), |x| x.name.clone())
    };
    let mut out: Vec<CheckpointInfo> = marks
        .values()
        .map(|m| CheckpointInfo {
            volume: name(m.vol),
            name: m.name.clone(),
            snapshot: m.snap.is_some(),
            granularity: 1 << m.shift,
            kept: m.delta.as_ref().map(|d| {
                let blocks: u64 = d.runs.iter().map(|r| r.1).sum();
                (
                    marks
                        .get(&d.target)
                        .map_or_else(String::new, |t| t.name.clone()),
                    blocks << inner.block_shift,
                )
            }),
        })
        .collect();
    out.sort_by(|a, b| a.volume.cmp(&b.volume));
    out
}

/// What `checkpoint remove` replies: what went, and the volume's newest checkpoint now.
fn removed_reply(
    volume: &str,
    name: &str,
    with_snapshot: bool,
    dropped: &[String],
    newest: Option<String>,
) -> String {
    format!(
        "checkpoint '{name}' of '{volume}' removed{}{}; {}",
        if with_snapshot {
            " with its snapshot"
        } else {
            ""
        },
        if dropped.is_empty() {
            String::new()
        } else {
            format!(
                ", and {} (whose changes were counted through it)",
                dropped
                    .iter()
                    .map(|d| format!("'{d}'"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        },
        match newest {
            Some(n) => format!("'{n}' is its newest checkpoint now"),
            None => format!("'{volume}' has no checkpoint now: its next backup is a full one"),
        }
    )
}

/// The checkpoints an export of volume `vol` offers the changes since: of a writable
/// volume, each of its own; of a checkpoint's snapshot, each of its volume's before it
/// (the changes up to that snapshot). Oldest first.
pub(crate) fn offered(marks: &Marks, vol: u32) -> Vec<(u32, &Mark)> {
    let from = match marks.iter().find(|(_, m)| m.snap == Some(vol)) {
        Some((&id, m)) => marks
            .range(..id)
            .filter(|(_, x)| x.vol == m.vol)
            .collect::<Vec<_>>(),
        None => marks.iter().filter(|(_, m)| m.vol == vol).collect(),
    };
    from.into_iter().map(|(&id, m)| (id, m)).collect()
}

/// The blocks changed since checkpoint `id`, to be compared against volume `of`: the
/// deltas of the checkpoints on the way (whose snapshots are gone) and the first
/// snapshot met. `None`: the checkpoint is gone.
fn chain(marks: &Marks, id: u32) -> Option<(Vec<Delta>, u32)> {
    let mut deltas = Vec::new();
    let mut m = marks.get(&id)?;
    loop {
        if let Some(s) = m.snap {
            return Some((deltas, s));
        }
        let d = m.delta.as_ref()?;
        deltas.push(d.clone());
        m = marks.get(&d.target)?;
    }
}

/// A checkpoint's changes as an NBD client reads them (`qemu:dirty-bitmap:NAME`) on an
/// export of a volume (the volume itself, or a later checkpoint's snapshot): computed
/// from the mappings when asked, never stored.
pub(crate) struct Changes {
    inner: Arc<Inner>,
    /// The volume exported.
    of: Arc<Volume>,
    /// The checkpoint.
    id: u32,
    shift: u8,
    /// The checkpoint went while this reader was held: every range reads as changed.
    gone: AtomicBool,
}

impl Changes {
    pub(crate) fn new(inner: Arc<Inner>, of: Arc<Volume>, id: u32, shift: u8) -> Changes {
        Changes {
            inner,
            of,
            id,
            shift,
            gone: AtomicBool::new(false),
        }
    }
}

/// What a walk over the changes compares: the snapshot, the volume exported, the deltas.
struct Compare<'a> {
    snap: &'a Volume,
    of: &'a Volume,
    deltas: &'a [Delta],
    /// The exported volume's blocks (past them: changed).
    blocks: u64,
}

impl Compare<'_> {
    /// Whether virtual block `vb` changed, and the next block whose answer may differ
    /// (past a stretch neither table has a leaf for and no delta names, at once).
    fn at(&self, vb: u64) -> (bool, u64) {
        if vb >= self.blocks {
            return (true, u64::MAX);
        }
        if !self.snap.table.has_leaf(vb) && !self.of.table.has_leaf(vb) {
            let leaf_end = (vb / LEAF_ENTRIES as u64 + 1) * LEAF_ENTRIES as u64;
            let end = leaf_end.min(self.blocks);
            if !self.deltas.iter().any(|d| d.any_in(vb, end)) {
                return (false, end);
            }
        }
        let changed = self.deltas.iter().any(|d| d.has(vb))
            || block_of(self.snap.table.get(vb)) != block_of(self.of.table.get(vb));
        (changed, vb + 1)
    }
}

impl DirtyMap for Changes {
    fn granularity(&self) -> u64 {
        1 << self.shift
    }

    fn runs(&self, offset: u64, len: u64, most: usize, out: &mut Vec<(u64, bool)>) {
        let marks = self.inner.marks();
        let found = chain(&marks, self.id)
            .and_then(|(deltas, s)| Some((deltas, self.inner.volume_by_id(s)?)));
        let Some((deltas, snap)) = found else {
            self.gone.store(true, Relaxed);
            if len > 0 && most > 0 {
                out.push((len, true));
            }
            return;
        };
        let shift = self.inner.block_shift;
        let cmp = Compare {
            snap: &snap,
            of: &self.of,
            deltas: &deltas,
            blocks: volume_blocks(self.of.size.load(Relaxed), 1 << shift),
        };
        let g = 1u64 << self.shift;
        let end = offset.saturating_add(len);
        let mut at = offset;
        let first = out.len();
        let push = |n: u64, dirty: bool, out: &mut Vec<(u64, bool)>| {
            if out.len() > first && out.last().is_some_and(|&(_, d)| d == dirty) {
                if let Some(last) = out.last_mut() {
                    last.0 += n;
                }
            } else {
                out.push((n, dirty));
            }
        };
        while at < end {
            let unit = at & !(g - 1);
            let unit_end = unit.saturating_add(g).min(end);
            let (first_b, last_b) = (unit >> shift, unit.saturating_add(g) >> shift);
            let mut vb = first_b;
            let mut dirty = false;
            while vb < last_b {
                let (d, next) = cmp.at(vb);
                if d {
                    dirty = true;
                    break;
                }
                vb = next;
            }
            let to = if dirty {
                unit_end
            } else {
                // Clean up to block `vb` (maybe far past this unit): whole units of it.
                (vb.saturating_mul(1 << shift) & !(g - 1)).clamp(unit_end, end)
            };
            if out.len() - first >= most && out.last().is_none_or(|&(_, d)| d != dirty) {
                break;
            }
            push(to - at, dirty, out);
            at = to;
        }
    }

    fn inconsistent(&self) -> bool {
        self.gone.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_unite_and_answer_membership() {
        let a = [(0, 2), (10, 5)];
        let b = [(1, 3), (15, 1), (30, 1)];
        let u = union(&a, &b);
        assert_eq!(u, vec![(0, 4), (10, 6), (30, 1)]);
        let d = Delta { target: 2, runs: u };
        assert!(d.has(0) && d.has(3) && !d.has(4) && d.has(15) && !d.has(16) && d.has(30));
        assert!(d.any_in(4, 11) && !d.any_in(4, 10) && !d.any_in(16, 30) && d.any_in(16, 31));
    }

    #[test]
    fn diff_sees_holes_against_blocks_and_ignores_ownership() {
        let owned = super::super::state::OWNED;
        let a: BTreeMap<u64, u32> = [(0, 5), (1, 6), (2, 7)].into();
        let b: BTreeMap<u64, u32> = [(0, 5 | owned), (2, 9), (3, 10)].into();
        assert_eq!(diff(&a, &b), vec![(1, 3)]);
        assert_eq!(diff(&b, &a), vec![(1, 3)]);
        assert_eq!(diff(&a, &a), vec![]);
    }
}
