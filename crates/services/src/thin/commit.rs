//! The commit thread of a thin pool (see [`super::pool`] for the whole picture): it
//! captures what the reactors changed in the tables, makes it durable in the log (data
//! flushed first), writes checkpoints, frees blocks after a grace period (zeroed by
//! [`super::zeroing`]'s thread meanwhile), and runs the admin operations.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_core::blocking::BlockingQueue;
use cairn_core::size::format_bytes;
use cairn_core::{IoFlags, IoStatus, Op};

use super::checkpoint;
use super::error::{Down, ThinError};
use super::format::{self, Record, BLOCK_BYTES as LOG_PAGE};
use super::pool::{
    check_name, check_size, lock, now_secs, table_blocks, Admin, Inner, Volume, COMMIT_PERIOD,
    VOLUME_BLOCKS_MAX,
};
use super::state::{block_of, BlockState, PoolState, OWNED};
use super::superblock::{self as sbk, PoolSuperblock};
use super::table::{Table, LEAF_ENTRIES};
use super::zeroing::{Batch, Zeroed, Zeroing};

/// How long a snapshot held its source's writes, and what for (its reply says).
pub(super) struct HeldFor {
    all: Duration,
    /// Waiting for the writes in flight that change the table (see [`Inner::hold_writes`]).
    drain: Duration,
    /// Capturing and copying the table.
    copy: Duration,
}

impl std::fmt::Display for HeldFor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let commit = self.all.saturating_sub(self.drain + self.copy);
        write!(
            f,
            "{} us: {} us for the writes in flight, {} us to copy the table, {} us to commit",
            self.all.as_micros(),
            self.drain.as_micros(),
            self.copy.as_micros(),
            commit.as_micros()
        )
    }
}

/// The commit thread's own state: the committed pool state and where the metadata is.
pub(super) struct Committer {
    pub(super) inner: Arc<Inner>,
    pub(super) state: PoolState,
    pub(super) sb: PoolSuperblock,
    /// The slot the newest superblock is in.
    pub(super) sb_slot: usize,
    pub(super) next_seq: u64,
    /// Log pages written since the checkpoint.
    pub(super) log_used: u64,
    /// Records for the next commit (blocks zeroed).
    pub(super) pending: Vec<Record>,
    pub(super) checkpoint_bytes: u64,
    pub(super) data: BlockingQueue,
    /// The metadata device's queue (`None`: the metadata is on the data device).
    pub(super) meta: Option<BlockingQueue>,
    pub(super) leaf: Box<[u32; LEAF_ENTRIES]>,
    pub(super) commits: u64,
    /// The pool was created by this open.
    pub(super) new: bool,
    /// A snapshot's source, whose writes wait until the snapshot's reply is sent.
    pub(super) thaw: Option<Arc<Volume>>,
    /// Where freed blocks are zeroed.
    pub(super) zeroing: Zeroing,
}

impl Committer {
    pub(super) fn meta(&self) -> &BlockingQueue {
        self.meta.as_ref().unwrap_or(&self.data)
    }

    pub(super) fn log_pages(&self) -> u64 {
        self.sb.log_bytes / LOG_PAGE as u64
    }

    /// Compares every changed leaf with the committed state: a record per entry that
    /// differs (with the reservation of a block mapped for the first time).
    pub(super) fn capture(&mut self, out: &mut Vec<Record>) {
        let volumes: Vec<Arc<Volume>> = lock(&self.inner.volumes).values().cloned().collect();
        // Counted as a capture only if it takes a leaf's flag (before the first): one
        // that finds nothing changed leaves every FUA write free to go down as it is.
        let mut counted = false;
        for v in volumes {
            let Some(st) = self.state.volumes.get(&v.id) else {
                continue;
            };
            for i in 0..v.table.leaves() {
                if !v.table.is_dirty(i) {
                    continue;
                }
                if !counted {
                    self.inner.commit_seq.capturing();
                    counted = true;
                }
                if !v.table.take_dirty(i) {
                    continue;
                }
                v.table.leaf_entries(i, &mut self.leaf);
                let base = (i * LEAF_ENTRIES) as u64;
                let mut old = [0u32; LEAF_ENTRIES];
                for (&vb, &e) in st.map.range(base..base + LEAF_ENTRIES as u64) {
                    old[(vb - base) as usize] = e;
                }
                for (j, (&now, &was)) in self.leaf.iter().zip(old.iter()).enumerate() {
                    if now == was {
                        continue;
                    }
                    if let Some(b) = block_of(now) {
                        if block_of(was) != Some(b)
                            && self.state.blocks.get(b as usize) == Some(&BlockState::Free)
                        {
                            out.push(Record::Reserve { start: b, len: 1 });
                        }
                    }
                    out.push(Record::Set {
                        vol: v.id,
                        vblock: base + j as u64,
                        entry: now,
                    });
                }
            }
        }
    }

    /// One commit of `records` (and the pending ones, and whatever the tables changed):
    /// see the module's documentation for the order.
    pub(super) fn commit(&mut self, mut records: Vec<Record>) -> Result<(), ThinError> {
        if self.inner.failed.load(Relaxed) || self.inner.crashed.load(SeqCst) {
            return Err(self.inner.down(Down::Failed));
        }
        // Pending records are in the state already; then the operation's own (a
        // snapshot's come before any change made to its source after it), then what the
        // tables changed since the last capture.
        let mut all = std::mem::take(&mut self.pending);
        let mut captured = Vec::new();
        for pass in 0..2 {
            if pass == 1 {
                self.capture(&mut captured);
                records = std::mem::take(&mut captured);
            }
            for r in &records {
                if let Err(e) = self.state.apply(r) {
                    return Err(self.fail(refused(r, e)));
                }
            }
            all.append(&mut records);
        }
        // Every capture so far is in `all` or in an earlier commit (this thread runs
        // them one at a time): durable with this one.
        let captured = self.inner.commit_seq.last();
        self.data
            .flush()
            .map_err(|e| self.fail(ThinError::io("data flush failed", e)))?;
        if all.is_empty() {
            self.inner.commit_seq.made_durable(captured);
            return Ok(());
        }
        // The blocks carry the superblock's generation: replay takes no block written
        // under another superblock (a leftover of a commit torn before an open).
        let blocks = format::pack(self.sb.pool_uuid, self.sb.generation, self.next_seq, &all);
        let room = self.log_pages() / 2;
        if self.log_used + blocks.len() as u64 > room {
            // Too much for the log: the whole state goes into a checkpoint instead.
            self.checkpoint(false)?;
            self.inner.commit_seq.made_durable(captured);
            return Ok(());
        }
        let pages = self.log_pages();
        for b in &blocks {
            // The ring's slots from the checkpoint's first log block on hold what replay
            // needs: a block written over one of them loses a commit.
            debug_assert!(
                b.seq >= self.sb.log_start_seq && b.seq - self.sb.log_start_seq < pages,
                "log block {} would overwrite one replay needs (the log starts at {}, {pages} pages)",
                b.seq,
                self.sb.log_start_seq
            );
            let at = self.sb.log_offset + (b.seq % pages) * LOG_PAGE as u64;
            self.meta()
                .write(at, &b.encode(), IoFlags::NONE)
                .map_err(|e| self.fail(ThinError::io("log write failed", e)))?;
        }
        self.meta()
            .flush()
            .map_err(|e| self.fail(ThinError::io("metadata flush failed", e)))?;
        self.next_seq += blocks.len() as u64;
        self.log_used += blocks.len() as u64;
        self.commits += 1;
        self.inner.commit_seq.made_durable(captured);
        self.publish();
        Ok(())
    }

    /// Marks the pool failed (logged once); returns `why`.
    pub(super) fn fail(&self, why: ThinError) -> ThinError {
        if !self.inner.failed.swap(true, SeqCst) {
            log::error!(
                "cairn: {}: thin pool failed, it takes no more changes: {why}",
                self.inner.name
            );
        }
        why
    }

    /// Writes the whole state to the checkpoint area not in use, then a superblock that
    /// points at it (the log starts afresh after it). `clean`: the pool stops.
    pub(super) fn checkpoint(&mut self, clean: bool) -> Result<(), ThinError> {
        if self.inner.crashed.load(SeqCst) {
            return Err(ThinError::Crashed);
        }
        let generation = self.sb.checkpoint_generation + 1;
        let pages = checkpoint::pages(self.sb.pool_uuid, generation, &self.state);
        let bytes = pages.len() as u64 * sbk::PAGE;
        if bytes > self.sb.checkpoint_capacity {
            return Err(self.fail(ThinError::MetadataFull {
                need: bytes,
                capacity: self.sb.checkpoint_capacity,
            }));
        }
        let slot = if self.sb.checkpoint_in_use == 1 { 1 } else { 0 };
        let mut area = Vec::with_capacity(bytes as usize);
        let mut crcs = Vec::with_capacity(pages.len() * 4);
        for p in &pages {
            area.extend_from_slice(p);
            crcs.extend_from_slice(&p[p.len() - 4..]);
        }
        self.meta()
            .write(self.sb.checkpoints[slot], &area, IoFlags::NONE)
            .and_then(|()| self.meta().flush())
            .map_err(|e| self.fail(ThinError::io("checkpoint write failed", e)))?;
        let mut sb = self.sb.clone();
        sb.generation += 1;
        sb.checkpoint_in_use = slot as u32 + 1;
        sb.checkpoint_generation = generation;
        sb.checkpoint_pages = pages.len() as u64;
        sb.checkpoint_crc = crc32c::crc32c(&crcs);
        sb.log_start_seq = self.next_seq;
        sb.log_start_offset = (self.next_seq % self.log_pages()) * LOG_PAGE as u64;
        sb.updated_secs = now_secs();
        if clean {
            sb.flags |= sbk::FLAG_CLEAN;
        } else {
            sb.flags &= !sbk::FLAG_CLEAN;
        }
        // Both slots, each flushed before the next: first the one not holding the
        // newest copy, so a torn write leaves the newest; then the other, so that damage
        // to either slot later leaves a copy as new as the pool (falling back to an older
        // superblock could drop a commit that only its checkpoint holds).
        let bytes_sb = sb.encode();
        for to in [1 - self.sb_slot, self.sb_slot] {
            self.meta()
                .write((to * sbk::SLOT_BYTES) as u64, &bytes_sb, IoFlags::NONE)
                .and_then(|()| self.meta().flush())
                .map_err(|e| self.fail(ThinError::io("superblock write failed", e)))?;
        }
        self.sb = sb;
        self.log_used = 0;
        self.checkpoint_bytes = bytes;
        self.commits += 1;
        self.publish();
        Ok(())
    }

    /// Updates what `status` shows and each volume's mapped count.
    pub(super) fn publish(&self) {
        let mut r = lock(&self.inner.report);
        r.checkpoint_bytes = self.checkpoint_bytes;
        r.log_used = self.log_used * LOG_PAGE as u64;
        r.commits = self.commits;
        drop(r);
        let mut marks = lock(&self.inner.marks);
        if marks.0 != self.state.marks_changed {
            *marks = (
                self.state.marks_changed,
                Arc::new(self.state.marks.clone()),
                Arc::new(self.state.exports.clone()),
            );
        }
        drop(marks);
        for v in lock(&self.inner.volumes).values() {
            if let Some(st) = self.state.volumes.get(&v.id) {
                v.mapped.store(st.map.len() as u64, Relaxed);
            }
        }
    }

    /// Frees the blocks the zeroing thread finished with; hands it the blocks the last
    /// commits freed (after a grace period) and those queues wrote and could not map.
    pub(super) fn release(&mut self) {
        let done = self.zeroing.take();
        self.zeroed(done);
        let freed = std::mem::take(&mut self.state.freed);
        let some_unmapped = !lock(&self.inner.free).unmapped.is_empty();
        if !freed.is_empty() || some_unmapped {
            lock(&self.inner.free).coming += freed.len() as u64;
            self.inner.grace();
        }
        // Taken after the grace period: a queue notes a block after it unmapped it, in
        // the same request, so every block whose unmapping a commit recorded is noted by
        // now, and is told apart by its state (freed, not free).
        let (dirty, unmapped) = {
            let mut free = lock(&self.inner.free);
            (
                std::mem::take(&mut free.dirty),
                std::mem::take(&mut free.unmapped),
            )
        };
        // Unmapped before any commit recorded them mapped: no record frees them.
        let leaked: Vec<u32> = unmapped
            .into_iter()
            .filter(|&b| self.state.blocks.get(b as usize) == Some(&BlockState::Free))
            .collect();
        if freed.is_empty() && dirty.is_empty() && leaked.is_empty() {
            return;
        }
        let mut all: Vec<u64> = freed.to_vec();
        all.extend(dirty.iter().chain(&leaked).map(|&b| u64::from(b)));
        // Space that is coming (the freed blocks are counted already).
        lock(&self.inner.free).coming += (dirty.len() + leaked.len()) as u64;
        let batch = Batch { freed, all };
        if let Err(e) = self.zeroing.send(&self.inner, batch) {
            self.fail(e);
        }
    }

    /// Records and frees the blocks of each batch the zeroing thread finished (see
    /// [`super::zeroing`]).
    pub(super) fn zeroed(&mut self, batches: Vec<Zeroed>) {
        for Zeroed { batch, result } in batches {
            if let Err(e) = result {
                self.fail(match e {
                    ThinError::Io { doing, source } => {
                        ThinError::io(format!("zeroing freed blocks failed: {doing}"), source)
                    }
                    other => other,
                });
                return;
            }
            let Batch { freed, all } = batch;
            for (start, len) in runs(&freed) {
                let r = Record::Zeroed { start, len };
                if let Err(e) = self.state.apply(&r) {
                    self.fail(refused(&r, e));
                    return;
                }
                self.pending.push(r);
            }
            let mut free = lock(&self.inner.free);
            free.coming -= all.len() as u64;
            debug_assert!(
                self.no_block_twice(&all, &free.zeroed),
                "a block freed twice, or freed while free: {all:?}"
            );
            free.zeroed.extend(all.iter().map(|&b| b as u32));
            free.zeroed.sort_unstable_by(|a, b| b.cmp(a));
            let left = free.zeroed.len() as u64;
            drop(free);
            self.inner.used_blocks.fetch_sub(all.len() as u64, Relaxed);
            if left >= self.inner.low_water_blocks {
                self.inner.low_said.store(false, Relaxed);
            }
        }
    }

    /// Whether `blocks`, about to join the free list `free`, are inside the pool, each
    /// once, and none of them free already (a block handed out twice is two volumes'
    /// data in one place). Debug builds and tests only: it reads the whole free list.
    fn no_block_twice(&self, blocks: &[u64], free: &[u32]) -> bool {
        let mut seen = std::collections::HashSet::with_capacity(blocks.len());
        blocks
            .iter()
            .all(|&b| b < self.inner.data_blocks && seen.insert(b))
            && free.iter().all(|&b| !seen.contains(&u64::from(b)))
    }

    /// Runs one admin operation: checks, then its record in a commit of its own.
    pub(super) fn admin(&mut self, op: Admin) -> Result<String, ThinError> {
        if self.inner.failed.load(Relaxed) {
            return Err(self.inner.down(Down::Failed));
        }
        let pool = self.inner.name.clone();
        let find = |name: &str| {
            self.inner.volume(name).ok_or_else(|| ThinError::NoVolume {
                pool: pool.clone(),
                name: name.to_string(),
            })
        };
        match op {
            Admin::Create { name, size } => {
                self.check_new(&name, size, 0)?;
                let id = self.next_volume();
                self.add_volume(id, &name, size, false);
                self.commit(vec![Record::Create {
                    vol: id,
                    size,
                    flags: 0,
                    name: name.clone(),
                }])?;
                Ok(format!(
                    "created volume '{name}' ({}) in thin pool '{pool}'",
                    format_bytes(size)
                ))
            }
            Admin::Snapshot {
                src,
                name,
                read_only,
            } => {
                let source = find(&src)?;
                if !read_only && !source.read_only {
                    return Err(ThinError::CloneOfWritable { src });
                }
                self.check_copy(&source, &name)?;
                let held = self.snapshot(&source, &name, read_only, None)?;
                // A clone is made of a snapshot, which no one writes: nothing was held.
                Ok(if read_only {
                    format!(
                        "snapshot '{name}' of '{src}' taken (writes to '{src}' held for {held})"
                    )
                } else {
                    format!("clone '{name}' of snapshot '{src}' made (writable)")
                })
            }
            Admin::Checkpoint {
                src,
                name,
                granularity,
            } => self.take_checkpoint(&src, &name, granularity),
            Admin::Uncheckpoint { volume, name } => self.remove_checkpoint(&volume, &name),
            Admin::Export {
                name,
                volume,
                writable,
            } => self.keep_export(&name, &volume, writable),
            Admin::Unexport { name } => self.drop_export(&name),
            Admin::Delete { name } => {
                let v = find(&name)?;
                let users = v.users.load(SeqCst);
                if users > 0 {
                    return Err(ThinError::Busy { name, users });
                }
                // A checkpoint's snapshot leaves the changes from it behind first; then
                // its last changes are captured before it leaves the tables.
                let mut records = self.before_delete(&v)?;
                self.capture(&mut records);
                lock(&self.inner.volumes).remove(&v.id);
                records.push(Record::Delete { vol: v.id });
                self.commit(records)?;
                let owned = self.reown();
                self.commit(owned)?;
                Ok(format!("deleted volume '{name}' from thin pool '{pool}'"))
            }
            Admin::Grow { name, size } => {
                let v = find(&name)?;
                let now = v.size.load(Relaxed);
                if size < now {
                    return Err(ThinError::Shrink {
                        name,
                        size: now,
                        asked: size,
                    });
                }
                let block = self.inner.block_bytes();
                check_size(size, block, VOLUME_BLOCKS_MAX)?;
                let blocks = size.div_ceil(block);
                if blocks > v.table.blocks() {
                    // Past the table's room: a larger directory, made while the
                    // volume's writes are held (no leaf is made, no entry marked).
                    self.inner.hold_writes(&v);
                    v.table.grow(table_blocks(blocks));
                    v.frozen.store(false, SeqCst);
                }
                self.commit(vec![Record::Grow { vol: v.id, size }])?;
                v.size.store(size, SeqCst);
                Ok(format!(
                    "volume '{name}' grown to {} (clients see it when they connect again)",
                    format_bytes(size)
                ))
            }
        }
    }

    /// Refuses a new volume named `name` of `size` bytes that would bring `entries`
    /// mappings with it, when the name is taken or bad, or the next checkpoint could not
    /// hold it.
    pub(super) fn check_new(&self, name: &str, size: u64, entries: u64) -> Result<(), ThinError> {
        check_name(name)?;
        if self.inner.volume(name).is_some() {
            return Err(ThinError::VolumeExists {
                pool: self.inner.name.clone(),
                name: name.to_string(),
            });
        }
        check_size(size, self.inner.block_bytes(), VOLUME_BLOCKS_MAX)?;
        // The next checkpoint: every mapping a run, every block a state, and room for a
        // mapping of every free block (writes to come).
        let mapped: u64 = self
            .state
            .volumes
            .values()
            .map(|v| v.map.len() as u64)
            .sum();
        let volumes = self.state.volumes.len() as u64 + 1;
        let need = (mapped + entries + self.inner.data_blocks) * 21
            + self.inner.data_blocks * 22
            + volumes * 300;
        if need > self.sb.checkpoint_capacity {
            return Err(ThinError::NoMetadataRoom {
                pool: self.inner.name.clone(),
                capacity: self.sb.checkpoint_capacity,
                need,
            });
        }
        Ok(())
    }

    pub(super) fn next_volume(&mut self) -> u32 {
        let id = self.sb.next_volume.max(1);
        self.sb.next_volume = id + 1;
        id
    }

    pub(super) fn add_volume(
        &self,
        id: u32,
        name: &str,
        size: u64,
        read_only: bool,
    ) -> Arc<Volume> {
        let blocks = size.div_ceil(self.inner.block_bytes()).max(1);
        let v = Arc::new(Volume {
            id,
            name: name.to_string(),
            read_only,
            size: AtomicU64::new(size),
            table: Table::new(table_blocks(blocks)),
            frozen: AtomicBool::new(false),
            users: AtomicU32::new(0),
            mapped: AtomicU64::new(0),
            changes: std::sync::OnceLock::new(),
        });
        lock(&self.inner.volumes).insert(id, v.clone());
        v
    }

    /// Whether a copy of `source` named `name` fits (a new name, room in the next
    /// checkpoint for its entries).
    pub(super) fn check_copy(&self, source: &Volume, name: &str) -> Result<(), ThinError> {
        let mapped = self
            .state
            .volumes
            .get(&source.id)
            .map_or(0, |v| v.map.len());
        self.check_new(name, source.size.load(Relaxed), mapped as u64)
    }

    /// A snapshot or clone of `source` named `name`: writes to the source wait while
    /// its table is copied (see [`Inner::hold_writes`]); returns how long they waited.
    pub(super) fn snapshot(
        &mut self,
        source: &Arc<Volume>,
        name: &str,
        read_only: bool,
        mark: Option<(u32, u8)>,
    ) -> Result<HeldFor, ThinError> {
        // What changed so far is committed first, while writes go on: the commit made
        // while they wait then holds only the last few changes and the snapshot's record.
        self.commit(Vec::new())?;
        let id = self.next_volume();
        let size = source.size.load(SeqCst);
        let began = Instant::now();
        self.inner.hold_writes(source);
        let drained = began.elapsed();
        // Every write to the source acknowledged so far is in its table, and none that
        // changes it (or writes into a block it maps) is in flight; copies on write may
        // be, but their entries keep the block they copy until writes go on again, and
        // then they swap (after the snapshot, as a write that started after it would):
        // capture the table, copy it, and let writes go on (they copy on write now).
        let mut records = Vec::new();
        self.capture(&mut records);
        let copy = self.add_volume(id, name, size, read_only);
        for (vb, e) in source.table.mapped() {
            copy.table.set(vb, e & !OWNED);
            if e & OWNED != 0 {
                let _ = source.table.swap_if(vb, e, e & !OWNED);
            }
        }
        records.push(Record::Snapshot {
            src: source.id,
            new: id,
            flags: u32::from(read_only),
            name: name.to_string(),
        });
        if let Some((mark, shift)) = mark {
            // A backup checkpoint: marked in the same commit as its snapshot.
            records.push(Record::Mark {
                id: mark,
                vol: source.id,
                snap: id,
                shift,
                name: name.to_string(),
            });
        }
        // Writes wait until the reply is on its way (see `run`): none acknowledged
        // before it is missing from the snapshot.
        self.thaw = Some(source.clone());
        let copied = began.elapsed();
        let committed = self.commit(records);
        if let Err(e) = committed {
            lock(&self.inner.volumes).remove(&id);
            return Err(e);
        }
        Ok(HeldFor {
            all: began.elapsed(),
            drain: drained,
            copy: copied - drained,
        })
    }

    /// After a delete: entries whose block no other volume maps any more are owned again,
    /// so that writes to them go in place instead of copying (a full pool could not
    /// copy). Returns the records; the tables are changed already (an entry a queue
    /// changed meanwhile is left to the next capture).
    pub(super) fn reown(&mut self) -> Vec<Record> {
        let live = lock(&self.inner.volumes).clone();
        let mut out = Vec::new();
        for (id, v) in &self.state.volumes {
            let Some(table) = live.get(id).map(|l| &l.table) else {
                continue;
            };
            for (&vb, &e) in &v.map {
                let alone = block_of(e).is_some_and(|b| {
                    self.state.blocks.get(b as usize) == Some(&BlockState::Used(1))
                });
                if e & OWNED == 0 && alone && table.swap_if(vb, e, e | OWNED).is_ok() {
                    out.push(Record::Set {
                        vol: *id,
                        vblock: vb,
                        entry: e | OWNED,
                    });
                }
            }
        }
        out
    }

    /// The commit thread's loop: see the module's documentation.
    pub(super) fn run(mut self) {
        loop {
            let (waiters, admin, stop) = {
                let mut w = lock(&self.inner.work);
                if w.waiters.is_empty() && w.admin.is_empty() && !w.kicked && !w.stop {
                    w = self
                        .inner
                        .work_cv
                        .wait_timeout(w, COMMIT_PERIOD)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                w.kicked = false;
                (
                    std::mem::take(&mut w.waiters),
                    std::mem::take(&mut w.admin),
                    w.stop,
                )
            };
            let result = self.commit(Vec::new());
            let status = match &result {
                Ok(()) => IoStatus::OK,
                Err(_) => IoStatus::errno(libc::EIO),
            };
            lock(&self.inner.report).commit_waits += waiters.len() as u64;
            for w in waiters {
                let _ = w.reply.send((w.token, status));
                cairn_core::event::wake(&*w.wake);
            }
            for (op, reply) in admin {
                let _ = reply.send(self.admin(op));
                if let Some(v) = self.thaw.take() {
                    v.frozen.store(false, SeqCst);
                }
            }
            self.release();
            if !self.inner.failed.load(Relaxed) && self.log_used * 4 > self.log_pages() {
                let _ = self.checkpoint(false);
            }
            if stop {
                break;
            }
        }
        // Stopping: the last changes, then a checkpoint marked clean.
        if self.commit(Vec::new()).is_ok() {
            self.release();
            let done = self.zeroing.finish();
            self.zeroed(done);
            let _ = self.commit(Vec::new());
            let _ = self.checkpoint(true);
        }
        let left = std::mem::take(&mut lock(&self.inner.work).admin);
        for (_, reply) in left {
            let _ = reply.send(Err(self.inner.down(Down::Stopped)));
        }
    }
}

/// The failure of a commit whose record `r` the pool's state refused (`why`).
fn refused(r: &Record, why: ThinError) -> ThinError {
    ThinError::Refused {
        record: format!("{r:?}"),
        why: Box::new(why),
    }
}

/// Consecutive runs of sorted `blocks`.
pub(super) fn runs(blocks: &[u64]) -> Vec<(u64, u64)> {
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for b in sorted {
        match out.last_mut() {
            Some((s, l)) if *s + *l == b => *l += 1,
            _ => out.push((b, 1)),
        }
    }
    out
}

/// Makes every block of `runs` read as zeros through `q` (the data device).
pub(super) fn zero_runs(
    q: &BlockingQueue,
    inner: &Inner,
    runs: &[(u64, u64)],
) -> Result<(), ThinError> {
    let caps = q.geometry().caps;
    let op = if caps.discard {
        Op::Discard
    } else if caps.write_zeroes {
        Op::WriteZeroes
    } else {
        Op::Write
    };
    for &(start, len) in runs {
        let mut at = inner.data_offset + (start << inner.block_shift);
        let end = at + (len << inner.block_shift);
        while at < end {
            let n = (end - at).min(1 << 30);
            let r = if op == Op::Write {
                q.write(at, &vec![0u8; n.min(8 << 20) as usize], IoFlags::NONE)
                    .map(|()| n.min(8 << 20))
            } else {
                q.zero(op, at, n, IoFlags::NONE).map(|()| n)
            };
            at += r.map_err(|e| ThinError::io(format!("zeroing at {at}"), e))?;
        }
    }
    Ok(())
}
