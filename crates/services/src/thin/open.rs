//! Opening a thin pool: where its metadata areas go, a new pool's superblock, loading the
//! checkpoint and replaying the log, and recovery after an unclean stop.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};

use cairn_core::blocking::BlockingQueue;
use cairn_core::ondisk::{Invalid, Picked};
use cairn_core::size::format_bytes;
use cairn_core::{Device, Error, IoFlags, Switches};

use super::checkpoint;
use super::commit::{runs, zero_runs, Committer};
use super::error::ThinError;
use super::format::{self, BLOCK_BYTES as LOG_PAGE};
use super::pool::{
    lock, now_secs, Free, Inner, LowWater, PoolOptions, PoolReport, Work, BLOCK_DEFAULT,
    CHECKPOINT_BYTES_PER_BLOCK,
};
use super::state::{self, BlockState, PoolState};
use super::superblock::{self as sbk, PoolSuperblock};
use super::table::LEAF_ENTRIES;

/// Where the metadata areas are, for a pool of `data_blocks` (pure).
struct Layout {
    log_offset: u64,
    log_bytes: u64,
    checkpoints: [u64; 2],
    capacity: u64,
    end: u64,
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

fn layout(data_blocks: u64) -> Layout {
    let capacity = round_up(
        data_blocks * CHECKPOINT_BYTES_PER_BLOCK + (1 << 20),
        sbk::PAGE,
    );
    let log_bytes = round_up((capacity / 2).clamp(1 << 20, 256 << 20), sbk::PAGE);
    let log_offset = (sbk::SLOTS * sbk::SLOT_BYTES) as u64;
    let a = log_offset + log_bytes;
    Layout {
        log_offset,
        log_bytes,
        checkpoints: [a, a + capacity],
        capacity,
        end: a + 2 * capacity,
    }
}

/// Reads the whole superblock area and picks; `Ok(None)` when both slots are blank.
fn read_superblock(
    q: &BlockingQueue,
    what: &str,
) -> Result<Option<(PoolSuperblock, usize)>, Error> {
    let mut area = vec![0u8; sbk::SLOTS * sbk::SLOT_BYTES];
    q.read(0, &mut area)
        .map_err(|e| Error::Invalid(format!("reading the thin pool superblock on {what}: {e}")))?;
    match sbk::pick(&area) {
        Picked::Valid {
            record: sb,
            slot,
            other,
            damaged,
        } => {
            // Every update writes both slots: a blank one was zeroed, or left by a stop
            // between the two writes, and is named as any damage is.
            let damaged = damaged.or_else(|| other.is_none().then_some(Invalid::Blank));
            if let Some(d) = damaged {
                log::warn!("cairn: thin pool on {what}: superblock slot {} is damaged ({d}); using the other", 1 - slot);
            }
            Ok(Some((sb, slot)))
        }
        Picked::Blank => Ok(None),
        Picked::Foreign {
            second: Invalid::Blank,
            ..
        } if torn_creation(&area) => {
            log::warn!("cairn: thin pool on {what}: the first superblock is torn and the second blank: a creation was interrupted; making the pool again");
            Ok(None)
        }
        Picked::Foreign { first, second } => Err(Error::Invalid(format!(
            "{what} holds no thin pool superblock (slot 0: {first}; slot 1: {second}): a pool is created on blank devices only"
        ))),
    }
}

/// Whether the superblock area holds what a stop during a pool's creation leaves: the
/// first slot torn (its first page written and not its last, or the reverse: only the
/// checksum at its end) and the second never written. A pool is made again there, if the
/// rest of the area is blank too (see [`refuse_unless_blank`]).
fn torn_creation(area: &[u8]) -> bool {
    let page = sbk::PAGE as usize;
    let (first, second) = area.split_at(sbk::SLOT_BYTES);
    if second.iter().any(|&b| b != 0) {
        return false;
    }
    let head_only =
        first[..sbk::MAGIC.len()] == sbk::MAGIC && first[page..].iter().all(|&b| b == 0);
    let tail_only = first[..sbk::SLOT_BYTES - 4].iter().all(|&b| b == 0);
    head_only || tail_only
}

/// A new pool's superblock for `data` (and `meta`).
fn new_superblock(
    data: &Arc<dyn Device>,
    meta: Option<&dyn Device>,
    opts: PoolOptions,
    meta_name: &str,
) -> Result<PoolSuperblock, Error> {
    let bad = |m: String| Error::Invalid(m);
    let block = opts.block_bytes.unwrap_or(BLOCK_DEFAULT);
    let size = data.geometry().size_bytes;
    let (data_offset, data_blocks, lay) = match meta {
        Some(m) => {
            let data_offset = sbk::DATA_OFFSET_MIN.max(block);
            let blocks = size.saturating_sub(data_offset) / block;
            let lay = layout(blocks);
            let have = m.geometry().size_bytes;
            if have < lay.end {
                return Err(bad(format!(
                    "metadata device '{meta_name}' is {}: a pool of {} blocks of {} needs at least {}",
                    format_bytes(have),
                    blocks,
                    format_bytes(block),
                    format_bytes(lay.end)
                )));
            }
            (data_offset, blocks, lay)
        }
        None => {
            let first = layout(size / block);
            let data_offset = round_up(first.end.max(sbk::DATA_OFFSET_MIN), block);
            let blocks = size.saturating_sub(data_offset) / block;
            (data_offset, blocks, layout(blocks))
        }
    };
    if data_blocks < 2 {
        return Err(bad(format!(
            "data device '{}' is {}: too small for a thin pool of {} blocks (it needs {} of metadata and 2 blocks at least)",
            data.name(),
            format_bytes(size),
            format_bytes(block),
            format_bytes(data_offset)
        )));
    }
    if data_blocks >= u64::from(u32::MAX >> 1) {
        return Err(bad(format!(
            "data device '{}' has {} blocks of {}; a pool has at most {} (use a larger block)",
            data.name(),
            data_blocks,
            format_bytes(block),
            (u32::MAX >> 1) - 1
        )));
    }
    let low_water_blocks = match opts.low_water {
        LowWater::Bytes(b) => (b / block).min(data_blocks),
        LowWater::Percent(p) => data_blocks * u64::from(p) / 100,
    };
    let sb = PoolSuperblock {
        version: sbk::VERSION,
        generation: 1,
        pool_uuid: cairn_core::ondisk::new_uuid(),
        flags: if meta.is_none() {
            sbk::FLAG_META_ON_DATA
        } else {
            0
        },
        block_bytes: block,
        data_offset,
        data_blocks,
        log_offset: lay.log_offset,
        log_bytes: lay.log_bytes,
        checkpoints: lay.checkpoints,
        checkpoint_capacity: lay.capacity,
        checkpoint_in_use: 0,
        checkpoint_generation: 0,
        checkpoint_pages: 0,
        checkpoint_crc: 0,
        log_start_seq: 1,
        log_start_offset: (1 % (lay.log_bytes / LOG_PAGE as u64)) * LOG_PAGE as u64,
        low_water_blocks,
        created_secs: now_secs(),
        updated_secs: now_secs(),
        next_volume: 1,
    };
    Ok(sb)
}

/// A pool is made only where no pool's metadata could be: both superblock slots are
/// blank already; so must be the log and the first page of each checkpoint area (every
/// pool wrote one at its first open). Zeroed superblocks over a pool's log and
/// checkpoints are damage to restore, not a place to make a new pool in.
fn refuse_unless_blank(q: &BlockingQueue, sb: &PoolSuperblock, what: &str) -> Result<(), Error> {
    let regions = [
        (sb.log_offset, sb.log_bytes, "log"),
        (sb.checkpoints[0], sbk::PAGE, "first checkpoint area"),
        (sb.checkpoints[1], sbk::PAGE, "second checkpoint area"),
    ];
    let mut buf = vec![0u8; 1 << 20];
    for (offset, len, name) in regions {
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(buf.len() as u64) as usize;
            q.read(at, &mut buf[..n]).map_err(|e| {
                Error::Invalid(format!("reading the thin pool metadata on '{what}': {e}"))
            })?;
            if let Some(i) = buf[..n].iter().position(|&b| b != 0) {
                return Err(Error::Invalid(format!(
                    "'{what}' has no thin pool superblock but is not blank (a byte at {} in the {name}'s place): a pool is created on blank devices only; if it held a pool, its superblocks are damaged (restore them; see 'Damaged metadata' in the README), else zero the area to make a pool there",
                    at + i as u64
                )));
            }
            at += n as u64;
        }
    }
    Ok(())
}

/// The state the metadata on `q` holds: the checkpoint, then every whole commit of the
/// log; with the sequence number the next commit gets and what was found, in words.
fn load(
    q: &BlockingQueue,
    sb: &PoolSuperblock,
    repair: bool,
) -> Result<(PoolState, u64, Vec<String>, u64), Error> {
    let bad = |m: String| Error::Invalid(m);
    let mut words = Vec::new();
    let mut state = if sb.checkpoint_in_use == 0 {
        PoolState::new(sb.block_bytes, sb.data_blocks as usize)
    } else {
        let at = sb.checkpoints[sb.checkpoint_in_use as usize - 1];
        let mut area = vec![0u8; (sb.checkpoint_pages * sbk::PAGE) as usize];
        q.read(at, &mut area)
            .map_err(|e| bad(format!("reading the thin pool checkpoint: {e}")))?;
        let pages: Vec<&[u8]> = area.chunks(sbk::PAGE as usize).collect();
        let crcs: Vec<u8> = pages
            .iter()
            .flat_map(|p| p[p.len() - 4..].to_vec())
            .collect();
        if crc32c::crc32c(&crcs) != sb.checkpoint_crc {
            return Err(bad(
                "the thin pool's checkpoint does not match its superblock (damaged metadata)"
                    .into(),
            ));
        }
        let s = checkpoint::load(
            &pages,
            &sb.pool_uuid,
            sb.checkpoint_generation,
            sb.version,
            sb.block_bytes,
            sb.data_blocks as usize,
        )
        .map_err(|e| bad(format!("the thin pool's checkpoint is damaged: {e}")))?;
        words.push(format!(
            "checkpoint {} ({} pages) valid",
            sb.checkpoint_generation, sb.checkpoint_pages
        ));
        s
    };
    let pages = sb.log_bytes / LOG_PAGE as u64;
    let mut ring = vec![0u8; sb.log_bytes as usize];
    q.read(sb.log_offset, &mut ring)
        .map_err(|e| bad(format!("reading the thin pool log: {e}")))?;
    let start = sb.log_start_offset / LOG_PAGE as u64;
    let blocks: Vec<&[u8]> = (0..pages)
        .map(|i| {
            let p = ((start + i) % pages) as usize * LOG_PAGE;
            &ring[p..p + LOG_PAGE]
        })
        .collect();
    let (log, damage) = format::replay_past_damage(
        &blocks,
        &sb.pool_uuid,
        sb.log_start_seq,
        sb.generation,
        sb.version,
    );
    if let Some(d) = damage {
        if !repair {
            return Err(bad(format!(
                "the thin pool's metadata is damaged: {d}; nothing was changed (restore the metadata area from a copy, or accept losing those commits with 'cairn check --repair-thin POOL STACK'; see 'Damaged metadata' in the README)"
            )));
        }
        let said = format!(
            "repair: {d}; the pool opens as of block {}, and the commits after it are dropped",
            log.end
        );
        log::warn!("cairn: thin pool: {said}");
        words.push(said);
    }
    for r in &log.records {
        state.apply(r).map_err(|e| {
            bad(format!(
                "the thin pool's log holds a record that breaks the pool's rules ({e}); the metadata needs checking"
            ))
        })?;
    }
    words.push(format!(
        "log: {} records in {} blocks replayed",
        log.records.len(),
        log.blocks
    ));
    if let Some((seq, found)) = log.torn {
        // Loud: a commit damaged after a crash looks the same as one the crash tore.
        let said = format!(
            "log: the commit at block {seq} is incomplete ({found} of its blocks found): dropped as torn by the last stop"
        );
        log::warn!("cairn: thin pool: {said}");
        words.push(said);
    }
    let (end, epoch_max) = (log.end, log.epoch_max);
    state.freed.clear();
    Ok((state, end, words, epoch_max))
}

/// After opening: zeroes what may hold data no mapping names, writes a checkpoint of the
/// recovered state (the log starts afresh), and fills the volumes and the free list.
pub(super) fn recover(c: &mut Committer) -> Result<(), ThinError> {
    let new = c.new;
    let clean = c.sb.flags & sbk::FLAG_CLEAN != 0 && !new;
    let mut dirty = Vec::new();
    for (b, s) in c.state.blocks.iter().enumerate() {
        let zero = match s {
            BlockState::Free => !clean,
            BlockState::Reserved | BlockState::FreeDirty => true,
            BlockState::Used(_) => false,
        };
        if zero {
            dirty.push(b as u64);
        }
    }
    let r = runs(&dirty);
    zero_runs(&c.data, &c.inner, &r)?;
    for b in &dirty {
        c.state.blocks[*b as usize] = BlockState::Free;
    }
    if !clean && !new {
        log::info!(
            "cairn: {}: thin pool was not stopped cleanly: {} free blocks zeroed",
            c.inner.name,
            dirty.len()
        );
    }
    c.checkpoint(false)?;
    let mut used = 0;
    let mut zeroed = Vec::new();
    for (b, s) in c.state.blocks.iter().enumerate().rev() {
        match s {
            BlockState::Free => zeroed.push(b as u32),
            _ => used += 1,
        }
    }
    lock(&c.inner.free).zeroed = zeroed;
    c.inner.used_blocks.store(used, Relaxed);
    let volumes: Vec<(u32, state::Volume)> = c
        .state
        .volumes
        .iter()
        .map(|(id, v)| (*id, v.clone()))
        .collect();
    for (id, v) in volumes {
        let live = c.add_volume(id, &v.name, v.size, v.flags & 1 != 0);
        for (&vb, &e) in &v.map {
            live.table.set(vb, e);
        }
        live.mapped.store(v.map.len() as u64, Relaxed);
        if id >= c.sb.next_volume {
            c.sb.next_volume = id + 1;
        }
    }
    c.publish();
    Ok(())
}

/// Opens the metadata on this thread: the committed state, the run-time pool (not
/// running yet), what was found in words, and the pool's one-line description. A new
/// pool's superblock is written unless `dry`.
pub(super) fn prepare(
    name: &str,
    data: Arc<dyn Device>,
    meta: Option<Arc<dyn Device>>,
    opts: PoolOptions,
    switches: Switches,
    dry: bool,
) -> Result<(Committer, Vec<String>, String), Error> {
    let data_q = BlockingQueue::open(&data, switches)?;
    let meta_q = meta
        .as_ref()
        .map(|m| BlockingQueue::open(m, switches))
        .transpose()?;
    let meta_name = meta.as_ref().map_or(data.name(), |m| m.name()).to_string();
    let mq = meta_q.as_ref().unwrap_or(&data_q);
    let mut examined = Vec::new();
    let (sb, slot, state, fresh) = match read_superblock(mq, &format!("'{meta_name}'"))? {
        Some((sb, slot)) => {
            check_recorded(&sb, &data, meta.is_none(), opts)?;
            let (state, seq, words, epoch_max) = load(mq, &sb, opts.repair)?;
            examined.extend(words);
            // The next superblock goes past every epoch in the log (a repair may leave
            // blocks of a newer one there): none of them is ever taken for its own.
            let mut sb = sb;
            sb.generation = sb.generation.max(epoch_max);
            (sb, slot, state, Some(seq))
        }
        None => {
            let sb = new_superblock(&data, meta.as_deref(), opts, &meta_name)?;
            refuse_unless_blank(mq, &sb, &meta_name)?;
            examined.push(format!(
                "new thin pool: {} blocks of {}, metadata {} (to be created)",
                sb.data_blocks,
                format_bytes(sb.block_bytes),
                format_bytes(layout(sb.data_blocks).end)
            ));
            let state = PoolState::new(sb.block_bytes, sb.data_blocks as usize);
            (sb, 1, state, None)
        }
    };
    let inner = new_inner(name, &data, &sb, !dry);
    let describe = format!(
        "thin-pool block={} data={} blocks metadata={}",
        format_bytes(sb.block_bytes),
        sb.data_blocks,
        if meta.is_some() {
            meta_name.clone()
        } else {
            "on data".into()
        }
    );
    let mut c = Committer {
        inner,
        state,
        sb,
        sb_slot: slot,
        next_seq: 0,
        log_used: 0,
        pending: Vec::new(),
        checkpoint_bytes: 0,
        data: data_q,
        meta: meta_q,
        leaf: Box::new([0; LEAF_ENTRIES]),
        commits: 0,
        new: false,
        thaw: None,
        zeroing: super::zeroing::Zeroing::new(switches),
    };
    c.next_seq = fresh.unwrap_or(1);
    c.checkpoint_bytes = c.sb.checkpoint_pages * sbk::PAGE;
    c.new = fresh.is_none();
    if !dry && fresh.is_none() {
        write_new_superblock(&mut c, name, &meta_name)?;
    }
    Ok((c, examined, describe))
}

/// Refuses a recorded pool whose superblock `sb` does not fit what the stack file gives:
/// another block size, a data device too small (`data`), or its metadata elsewhere than
/// `meta_on_data` says.
fn check_recorded(
    sb: &PoolSuperblock,
    data: &Arc<dyn Device>,
    meta_on_data: bool,
    opts: PoolOptions,
) -> Result<(), Error> {
    let bad = |m: String| Error::Invalid(m);
    if let Some(b) = opts.block_bytes {
        if b != sb.block_bytes {
            return Err(bad(format!(
                "the pool was made with block = {}; the stack file says {} (a pool's block size never changes)",
                format_bytes(sb.block_bytes),
                format_bytes(b)
            )));
        }
    }
    let data_size = data.geometry().size_bytes;
    let need = sb.data_offset + (sb.data_blocks << sb.block_bytes.trailing_zeros());
    if data_size < need {
        return Err(bad(format!(
            "data device '{}' is {}, smaller than the pool's {} (wrong device?)",
            data.name(),
            format_bytes(data_size),
            format_bytes(need)
        )));
    }
    if (sb.flags & sbk::FLAG_META_ON_DATA != 0) != meta_on_data {
        return Err(bad(
            "the pool's metadata is recorded as being elsewhere: check the 'metadata' key".into(),
        ));
    }
    Ok(())
}

/// The run-time pool of superblock `sb` on `data`, with no volume yet.
fn new_inner(name: &str, data: &Arc<dyn Device>, sb: &PoolSuperblock, running: bool) -> Arc<Inner> {
    let low_water_blocks = sb.low_water_blocks;
    let mut report = PoolReport {
        name: name.to_string(),
        block_bytes: sb.block_bytes,
        data_blocks: sb.data_blocks,
        checkpoint_capacity: sb.checkpoint_capacity,
        log_bytes: sb.log_bytes,
        low_water_blocks,
        ..PoolReport::default()
    };
    report.checkpoint_bytes = sb.checkpoint_pages * sbk::PAGE;
    Arc::new(Inner {
        name: name.to_string(),
        data: data.clone(),
        block_shift: sb.block_bytes.trailing_zeros(),
        data_offset: sb.data_offset,
        data_blocks: sb.data_blocks,
        volumes: Mutex::new(BTreeMap::new()),
        free: Mutex::new(Free::default()),
        epoch: AtomicU64::new(0),
        gates: Mutex::new(Vec::new()),
        work: Mutex::new(Work::default()),
        work_cv: Condvar::new(),
        failed: AtomicBool::new(false),
        used_blocks: AtomicU64::new(0),
        low_water_blocks,
        low_said: AtomicBool::new(false),
        report: Mutex::new(report),
        running,
        crashed: AtomicBool::new(false),
        marks: Mutex::new((0, Arc::new(BTreeMap::new()), Arc::new(BTreeMap::new()))),
        commit_seq: Default::default(),
    })
}

/// Writes a new pool's superblock (and flushes it) before anything else, so that a crash
/// leaves a pool to open.
fn write_new_superblock(c: &mut Committer, name: &str, meta_name: &str) -> Result<(), Error> {
    let mut sb = c.sb.clone();
    sb.created_secs = now_secs();
    c.meta()
        .write(0, &sb.encode(), IoFlags::NONE)
        .and_then(|()| c.meta().flush())
        .map_err(|e| {
            Error::Invalid(format!(
                "writing the thin pool superblock on '{meta_name}': {e}"
            ))
        })?;
    c.sb = sb;
    c.sb_slot = 0;
    log::info!(
        "cairn: {name}: new thin pool of {} ({} blocks of {})",
        format_bytes(c.sb.data_blocks << c.sb.block_bytes.trailing_zeros()),
        c.sb.data_blocks,
        format_bytes(c.sb.block_bytes)
    );
    Ok(())
}
