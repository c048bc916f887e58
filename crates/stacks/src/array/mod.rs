//! Arrays that keep their state on their members: superblocks, assembly, the bitmap.
//!
//! - [`superblock`]: the on-disk superblock, format version 1: identity, role, layout,
//!   event counter, every member's state and rebuild checkpoint, in two checksummed slots
//!   so a torn write leaves the last good copy. Pure encode and decode.
//! - [`assemble`]: from what the members hold to the array to run (create, assemble,
//!   refuse). Pure.
//! - [`Metadata`] (here): the control-plane I/O around them. When the array opens, every
//!   member's slots are read and the plan made; the superblocks are then rewritten with
//!   the event count bumped and the clean flag off (the array is in use). When it closes,
//!   they are written again with the clean flag on and every member's state, so a member
//!   that failed while the array ran is known as failed at the next start, and not read.
//!
//! Superblock I/O is synchronous on the calling thread (a [`BlockingQueue`] per member),
//! never on a reactor: it happens at open and close, not per request.
//!
//! - [`bitmap`]: the write-intent bitmap in memory; its bits travel in the superblocks.
//!
//! Every superblock write holds one lock ([`Metadata`]'s `writing`), so the bits one
//! write carries are never undone on disk by an older image another write carries.
//!
//! - [`admin`]: the admin's actions on a running array ([`ArrayAdmin`]), which fail with
//!   [`crate::Error`].

pub mod admin;
pub mod assemble;
pub mod bitmap;
pub mod superblock;

use std::sync::{Arc, Mutex};

use cairn_core::blocking::BlockingQueue;
use cairn_core::ondisk::{new_uuid, Invalid, Picked};
use cairn_core::{Device, Error, IoFlags, Switches};

use crate::error::MemberIs;
use crate::Error as StackError;
pub use admin::{ArrayAction, ArrayAdmin};
use assemble::{Expect, Part, Plan, Seen};
use bitmap::Bitmap;
use superblock::{MemberState, Role, Superblock, DATA_OFFSET_MIN, SLOTS, SLOT_BYTES};

/// What the members hold, read when the array opens: the plan, where data starts and how
/// much of each member is data.
#[derive(Debug)]
pub struct Examined {
    /// The array to run.
    pub plan: Plan,
    /// Where data starts on every member.
    pub data_offset: u64,
    /// Data bytes of each member (by position), as recorded, or as the members give for a
    /// new array.
    pub member_data: Vec<u64>,
    /// Each present member's newest superblock generation (0 when blank).
    generations: Vec<u64>,
    /// The array's name as recorded (the stack file's name when created).
    name: String,
    /// The record's bitmap: its region (0: none), the union of the bits of the members
    /// as new as the record, the array size it covers, and when bits were last cleared.
    recorded_bitmap: (u64, Vec<u8>, u64, u64),
}

impl Examined {
    /// Whether `device` can be a spare of the array examined, read only (nothing is
    /// written, so a refusal leaves the members as they were): big enough for a member's
    /// data, blocks no larger than `block`, and blank or carrying this array's superblock
    /// (a spare's, or a member's taken out of it). The spare's superblock is written once
    /// the array runs ([`Metadata::make_spare`]).
    pub fn check_spare(
        &self,
        device: &Arc<dyn Device>,
        name: &str,
        block: u64,
    ) -> Result<(), StackError> {
        let g = device.geometry();
        let need = self.data_offset + self.member_data.iter().copied().max().unwrap_or(0);
        if g.size_bytes < need {
            return Err(StackError::TooSmall {
                device: name.to_string(),
                array: self.name.clone(),
                size_bytes: g.size_bytes,
                need_bytes: need,
            });
        }
        if u64::from(g.block_bytes) > block {
            return Err(StackError::BlocksTooLarge {
                device: name.to_string(),
                array: self.name.clone(),
                block_bytes: u64::from(g.block_bytes),
                array_block_bytes: block,
            });
        }
        let q = queue(device, &self.name, name)?;
        let mut area = vec![0u8; SLOTS * SLOT_BYTES];
        q.read(0, &mut area).map_err(|source| StackError::Io {
            device: Some(name.to_string()),
            doing: "reading its superblocks",
            source,
        })?;
        joinable(&q, device, &area, name, &self.plan.array_uuid)
    }
}

/// Reads every present member's superblock slots and decides the array.
pub fn examine(expect: &Expect, members: &[Option<Arc<dyn Device>>]) -> Result<Examined, Error> {
    let name = &expect.name;
    let mut seen = Vec::with_capacity(members.len());
    let mut generations = Vec::with_capacity(members.len());
    for (i, m) in members.iter().enumerate() {
        let Some(device) = m else {
            seen.push(Seen::Missing);
            generations.push(0);
            continue;
        };
        let member = &expect.members[i];
        holds_metadata(name, member, device)?;
        let mut area = vec![0u8; SLOTS * SLOT_BYTES];
        let q = queue(device, name, member)?;
        q.read(0, &mut area).map_err(|e| {
            Error::Invalid(format!(
                "device '{name}': member '{member}': reading its superblock failed: {e}"
            ))
        })?;
        match superblock::pick(&area) {
            Picked::Blank => match data_found(&q, device, &area)
                .map_err(|e| Error::Invalid(format!("device '{name}': member '{member}': {e}")))?
            {
                None => {
                    seen.push(Seen::Blank);
                    generations.push(0);
                }
                Some(why) => {
                    seen.push(Seen::Foreign(why));
                    generations.push(0);
                }
            },
            Picked::Valid {
                record: sb,
                slot,
                damaged,
                ..
            } => {
                if let Some(why) = damaged {
                    log::warn!(
                        "cairn: {name}: member '{member}': superblock slot {} is damaged ({why}); \
                         slot {slot} (generation {}) is used, and the next superblock write replaces the damaged one",
                        1 - slot,
                        sb.generation
                    );
                }
                generations.push(sb.generation);
                seen.push(if sb.spare() {
                    Seen::Spare(sb.array_uuid)
                } else {
                    Seen::Valid(sb)
                });
            }
            Picked::Foreign { first, second } => {
                let not_ours = |e: &Invalid| matches!(e, Invalid::Magic { .. } | Invalid::Blank);
                let why = if not_ours(&first) && not_ours(&second) {
                    first_nonzero(&area).map_or_else(
                        || "no cairn superblock".to_string(),
                        |at| format!("non-zero bytes at offset {at}"),
                    )
                } else {
                    format!("superblock slot 0: {first}; slot 1: {second}")
                };
                seen.push(Seen::Foreign(why));
                generations.push(0);
            }
        }
    }
    let now = now_secs();
    let plan = assemble::plan(expect, &seen, now, new_uuid)?;
    let record = seen
        .iter()
        .filter_map(|s| match s {
            Seen::Valid(sb) => Some(sb),
            _ => None,
        })
        .max_by_key(|sb| sb.events);
    let recorded_bitmap = record.map_or((0, Vec::new(), 0, 0), |r| recorded_bitmap(r, &seen));
    let (data_offset, member_data, recorded_name) = match record {
        None => (
            DATA_OFFSET_MIN,
            new_member_data(expect, members),
            expect.name.clone(),
        ),
        Some(r) => (
            r.data_offset,
            recorded_member_data(expect, members, &seen, r)?,
            r.name.clone(),
        ),
    };
    Ok(Examined {
        plan,
        data_offset,
        member_data,
        generations,
        name: recorded_name,
        recorded_bitmap,
    })
}

/// Refuses member `member` of array `name` if its blocks are too large for the
/// superblock slots, or it is too small for the metadata area and one block of data.
fn holds_metadata(name: &str, member: &str, device: &Arc<dyn Device>) -> Result<(), Error> {
    let g = device.geometry();
    if u64::from(g.block_bytes) > SLOT_BYTES as u64 {
        return Err(Error::Invalid(format!(
            "device '{name}': member '{member}' has {}-byte blocks; an array with metadata needs blocks of at most {SLOT_BYTES}",
            g.block_bytes
        )));
    }
    if g.size_bytes < DATA_OFFSET_MIN + u64::from(g.block_bytes) {
        return Err(Error::Invalid(format!(
            "device '{name}': member '{member}' ({} bytes) is smaller than the metadata area ({DATA_OFFSET_MIN} bytes) and one block of data \
             (metadata = \"none\" gives the raw layout)",
            g.size_bytes
        )));
    }
    Ok(())
}

/// The record `r`'s bitmap as [`Examined::recorded_bitmap`] keeps it: its bits, with
/// those of every member as new as the record (and with the same regions) added.
fn recorded_bitmap(r: &Superblock, seen: &[Seen]) -> (u64, Vec<u8>, u64, u64) {
    let mut bits = r.bitmap.clone();
    for s in seen {
        if let Seen::Valid(sb) = s {
            if sb.events == r.events && sb.region_bytes == r.region_bytes {
                for (b, x) in bits.iter_mut().zip(&sb.bitmap) {
                    *b |= x;
                }
            }
        }
    }
    (r.region_bytes, bits, r.array_bytes, r.events_cleared)
}

/// Data bytes of each member of a new array, its data after the metadata area. Linear
/// members each give what they have; the others all give what the smallest has.
fn new_member_data(expect: &Expect, members: &[Option<Arc<dyn Device>>]) -> Vec<u64> {
    let mut data: Vec<u64> = members
        .iter()
        .map(|m| {
            m.as_ref()
                .map_or(0, |d| d.geometry().size_bytes - DATA_OFFSET_MIN)
        })
        .collect();
    if expect.level != superblock::Level::Linear {
        let smallest = data
            .iter()
            .zip(members)
            .filter(|(_, m)| m.is_some())
            .map(|(d, _)| *d)
            .min()
            .unwrap_or(0);
        data.iter_mut().for_each(|d| *d = smallest);
    }
    data
}

/// Data bytes of each member as the record `r` (and, for linear members, their own
/// superblocks) say; refuses a member too small for them.
fn recorded_member_data(
    expect: &Expect,
    members: &[Option<Arc<dyn Device>>],
    seen: &[Seen],
    r: &Superblock,
) -> Result<Vec<u64>, Error> {
    let name = &expect.name;
    let mut data = Vec::with_capacity(members.len());
    for (i, s) in seen.iter().enumerate() {
        // Linear members each record their own size; the others share one.
        let bytes = match s {
            Seen::Valid(sb) if expect.level == superblock::Level::Linear => sb.member_data_bytes,
            _ => r.member_data_bytes,
        };
        if let Some(d) = &members[i] {
            let size = d.geometry().size_bytes;
            // Each superblock's offset and size add up, but a linear member's
            // size and the newest superblock's offset come from two of them.
            let Some(need) = r.data_offset.checked_add(bytes) else {
                return Err(Error::Invalid(format!(
                    "device '{name}': member '{}': its superblock's data size ({bytes} bytes) after the array's data offset ({}) is past any device",
                    expect.members[i], r.data_offset
                )));
            };
            if size < need {
                return Err(Error::Invalid(format!(
                    "device '{name}': member '{}' ({size} bytes) is smaller than the array needs ({need} bytes)",
                    expect.members[i]
                )));
            }
        }
        data.push(bytes);
    }
    Ok(data)
}

/// Logs what starting the array finds: the notes on its members, an unclean stop, a
/// creation.
fn log_start(expect: &Expect, plan: &Plan, dry: bool, resync_pending: bool) {
    for note in &plan.notes {
        log::info!("cairn: {}: {note}", expect.name);
    }
    if resync_pending {
        log::warn!(
            "cairn: {}: was not stopped cleanly: its copies may differ, so every read goes to one copy until it is resynced",
            expect.name
        );
    }
    if !plan.created {
        return;
    }
    // The UUID is named only once it is written: a dry run's is drawn at random and is
    // not the one a real start would write.
    if dry {
        log::info!(
            "cairn: {}: would create a {} of {} members",
            expect.name,
            expect.level.name(),
            expect.members.len()
        );
    } else {
        log::info!(
            "cairn: {}: created a {} of {} members ({})",
            expect.name,
            expect.level.name(),
            expect.members.len(),
            superblock::uuid_text(&plan.array_uuid)
        );
    }
}

/// The bitmap of regions of `region` over `array_bytes` (the stack file's region, grown
/// to fit) with the recorded bits carried over (converted if the region changed), and
/// the event count its bits were last cleared at. An array that had none starts with
/// every bit clear if it stopped cleanly, every bit set if not.
fn start_bitmap(examined: &Examined, region: u64, array_bytes: u64) -> (Bitmap, u64) {
    let (old_region, old_bits, old_bytes, old_cleared) = &examined.recorded_bitmap;
    let (bits, cleared) = if *old_region == region && *old_bytes == array_bytes {
        (old_bits.clone(), *old_cleared)
    } else if *old_region != 0 {
        let bits = convert_bits(*old_region, old_bits, *old_bytes, region, array_bytes);
        (bits, *old_cleared)
    } else {
        let fill = if examined.plan.created || examined.plan.clean {
            0
        } else {
            0xff
        };
        let bits = vec![fill; superblock::bitmap_bytes(array_bytes, region)];
        // Members that left before now cannot use it.
        (bits, examined.plan.events + 1)
    };
    (Bitmap::new(region, array_bytes, &bits), cleared)
}

/// The bits for regions of `region` over `array_bytes`, from bits recorded for regions of
/// `old` over `old_bytes`: a region is dirty if any old region it overlaps was.
fn convert_bits(old: u64, bits: &[u8], old_bytes: u64, region: u64, array_bytes: u64) -> Vec<u8> {
    let mut out = vec![0u8; superblock::bitmap_bytes(array_bytes, region)];
    let old_regions = old_bytes.div_ceil(old);
    for r in 0..old_regions {
        if bits
            .get((r / 8) as usize)
            .is_some_and(|b| b & (1 << (r % 8)) != 0)
        {
            // The recorded size and region come from a superblock: the last old region
            // may end past 2^64 (r * old itself is below old_bytes).
            let (start, end) = (r * old, (r + 1).saturating_mul(old).min(array_bytes.max(1)));
            if start >= array_bytes {
                // Past the end of a smaller array now: the last region covers it.
                let last = array_bytes.div_ceil(region).saturating_sub(1);
                out[(last / 8) as usize] |= 1 << (last % 8);
                continue;
            }
            for n in start / region..=(end - 1) / region {
                out[(n / 8) as usize] |= 1 << (n % 8);
            }
        }
    }
    out
}

/// How [`Metadata::start`] starts an array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// For real: superblocks are written now (dirty) and at stop (clean).
    Write,
    /// Examined only (`cairn check`): nothing is written; the log says what starting for
    /// real would do (create the array, members not read, a resync due).
    Dry,
    /// Examined only, before starting for real (`cairn serve`, `cairn bench`): nothing
    /// is written or logged, so the real start says it once.
    Silent,
}

/// An open array's metadata: writes the superblocks when the array starts and stops.
pub struct Metadata {
    expect: Expect,
    data_offset: u64,
    member_data: Vec<u64>,
    array_bytes: u64,
    array_uuid: [u8; 16],
    created_secs: u64,
    name: String,
    /// Examined only (`cairn check`): no superblock is written.
    dry: bool,
    /// Held by every superblock write and the bitmap changes around it. A second queue
    /// that finds the same member failed waits until the first has written the
    /// superblocks, so that neither answers its request before the failure is on disk.
    writing: Mutex<()>,
    /// The write-intent bitmap, if the array keeps one.
    bitmap: Option<Arc<Bitmap>>,
    /// The array was not stopped cleanly: its copies may differ until resynced.
    resync_pending: std::sync::atomic::AtomicBool,
    /// Where the resync resumes: its copies agree below (a stop during the last resync
    /// recorded it).
    resync_from: u64,
    state: Mutex<MetaState>,
    /// Told of every member a superblock write failed, so that the array's I/O path
    /// stops reading and writing it at once (set by the array when it starts).
    on_fail: std::sync::OnceLock<FailHook>,
}

/// What [`Metadata::set_on_fail`] installs: called with a member's position.
pub type FailHook = Box<dyn Fn(usize) + Send + Sync>;

struct MetaState {
    events: u64,
    events_cleared: u64,
    parts: Vec<Part>,
    generations: Vec<u64>,
    /// The member devices (`None`: missing or removed) and their names.
    members: Vec<Option<Arc<dyn Device>>>,
    names: Vec<String>,
    /// Set by a stop during a resync: how far it got, for the last superblocks.
    resync_reached: u64,
}

impl Metadata {
    /// Starts the array: every present member gets a superblock with the event count
    /// bumped and the clean flag off. Logs the members not read. Unless `how` is
    /// [`Start::Write`], nothing is written, now or at [`Metadata::stop`]; with
    /// [`Start::Silent`], nothing is logged either.
    pub fn start(
        expect: Expect,
        members: Vec<Option<Arc<dyn Device>>>,
        examined: Examined,
        array_bytes: u64,
        how: Start,
    ) -> Result<Metadata, Error> {
        let dry = how != Start::Write;
        let logged = how != Start::Silent;
        let redundant = matches!(
            expect.level,
            superblock::Level::Mirror | superblock::Level::Raid10
        );
        let resync_pending = redundant && !examined.plan.created && !examined.plan.clean;
        if logged {
            log_start(&expect, &examined.plan, dry, resync_pending);
        }
        let region = if redundant && expect.bitmap_region != 0 {
            superblock::region_for(array_bytes, expect.bitmap_region)
        } else {
            0
        };
        let (bitmap, events_cleared) = if region == 0 {
            (None, 0)
        } else {
            let (bm, cleared) = start_bitmap(&examined, region, array_bytes);
            if !examined.plan.created && bm.to_recover_count() > 0 && logged {
                log::info!(
                    "cairn: {}: write-intent bitmap: {} of {} regions of {} dirty",
                    expect.name,
                    bm.to_recover_count(),
                    bm.regions(),
                    cairn_core::size::format_bytes(region)
                );
            }
            (Some(Arc::new(bm)), cleared)
        };
        let meta = Metadata {
            bitmap,
            data_offset: examined.data_offset,
            member_data: examined.member_data,
            array_bytes,
            array_uuid: examined.plan.array_uuid,
            created_secs: examined.plan.created_secs,
            name: examined.name,
            dry,
            writing: Mutex::new(()),
            resync_pending: std::sync::atomic::AtomicBool::new(resync_pending),
            resync_from: if resync_pending {
                examined.plan.resync_from.min(array_bytes)
            } else {
                0
            },
            on_fail: std::sync::OnceLock::new(),
            state: Mutex::new(MetaState {
                events: examined.plan.events,
                events_cleared,
                parts: examined.plan.parts,
                generations: examined.generations,
                names: expect.members.clone(),
                resync_reached: 0,
                members,
            }),
            expect,
        };
        if !dry {
            let _writing = meta.writing();
            meta.write(false)?;
        }
        Ok(meta)
    }

    /// Installs what is told of members failed because their superblock could not be
    /// written (once; later calls are ignored).
    pub fn set_on_fail(&self, hook: FailHook) {
        let _ = self.on_fail.set(hook);
    }

    fn writing(&self) -> std::sync::MutexGuard<'_, ()> {
        self.writing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The write-intent bitmap, if the array keeps one.
    pub fn bitmap(&self) -> Option<&Arc<Bitmap>> {
        self.bitmap.as_ref()
    }

    /// Whether member `m` is recovered from the bitmap (only its regions to recover).
    pub fn partial(&self, m: usize) -> bool {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.parts.get(m).is_some_and(|p| p.partial)
    }

    /// Sets the bits of the regions `[offset, offset + len)` touches on disk, on every
    /// member in use, before a write to them is submitted. Synchronous on the calling
    /// thread: it runs once per region each time the region goes from clean to dirty,
    /// not per request. Fails if no member took the superblock.
    pub fn mark(&self, offset: u64, len: u64) -> Result<(), Error> {
        let Some(bm) = &self.bitmap else {
            return Ok(());
        };
        if self.dry {
            return Ok(());
        }
        let _writing = self.writing();
        let need: Vec<usize> = bm
            .regions_of(offset, len)
            .filter(|&r| !bm.durable(r))
            .collect();
        if need.is_empty() {
            // Another queue set them meanwhile.
            return Ok(());
        }
        self.write_with(false, false, &need)?;
        for r in need {
            bm.set_durable(r);
        }
        Ok(())
    }

    /// Clears the bits of the regions in `idle` that are still idle since `before` (see
    /// [`Bitmap::idle`]). The caller has checked that every member is current, then
    /// flushed every member after taking `before`. Returns how many bits it cleared.
    pub fn clear_idle(&self, idle: &[usize], before: &[u64]) -> usize {
        let Some(bm) = &self.bitmap else { return 0 };
        if self.dry || idle.is_empty() {
            return 0;
        }
        let _writing = self.writing();
        let mut cleared = Vec::with_capacity(idle.len());
        for &r in idle {
            // Cleared in memory first, then checked: a write that starts after the check
            // sees the bit clear and waits for `mark`, which needs this lock.
            bm.clear_durable(r);
            if bm.written_since(r, before) {
                bm.set_durable(r);
            } else {
                cleared.push(r);
            }
        }
        if cleared.is_empty() {
            return 0;
        }
        {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.events_cleared = st.events;
        }
        if let Err(e) = self.write_with(false, false, &[]) {
            log::error!("cairn: {}: {e}", self.expect.name);
        }
        cleared.len()
    }

    /// Whether the copies may differ (an unclean stop, not resynced yet): reads must go to
    /// one copy.
    pub fn resync_pending(&self) -> bool {
        self.resync_pending
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether this array was examined only (`cairn check`): nothing is written, nothing
    /// rebuilt.
    pub fn dry(&self) -> bool {
        self.dry
    }

    /// Member `m`'s rebuild checkpoint: bytes of its data area in sync from the start.
    pub fn recovery_offset(&self, m: usize) -> u64 {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.parts.get(m).map_or(0, |p| p.recovery_offset)
    }

    /// Records the rebuild's progress: `members` are in sync below `member_offset`.
    pub fn checkpoint(&self, members: &[usize], member_offset: u64) {
        if self.dry {
            return;
        }
        let _writing = self.writing();
        {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            for &m in members {
                if st.parts[m].state == MemberState::Rebuilding {
                    st.parts[m].recovery_offset = member_offset.min(self.member_data[m]);
                }
            }
        }
        if let Err(e) = self.write(false) {
            log::error!("cairn: {}: {e}", self.expect.name);
        }
    }

    /// The rebuild is done: `members` are active (current), and after a resync the
    /// copies agree again.
    pub fn rebuilt(&self, members: &[usize], resync: bool) {
        if self.dry {
            return;
        }
        let _writing = self.writing();
        {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            for &m in members {
                if st.parts[m].state == MemberState::Rebuilding {
                    st.parts[m].state = MemberState::Active;
                    st.parts[m].recovery_offset = self.member_data[m];
                    st.parts[m].partial = false;
                }
            }
        }
        if resync {
            self.resync_pending
                .store(false, std::sync::atomic::Ordering::SeqCst);
        }
        if let Err(e) = self.write(false) {
            log::error!("cairn: {}: {e}", self.expect.name);
        }
    }

    /// The array's UUID as people read it.
    pub fn uuid_text(&self) -> String {
        superblock::uuid_text(&self.array_uuid)
    }

    /// The event count the superblocks record now.
    pub fn events(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).events
    }

    /// Where data starts on every member.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Each member's state now.
    pub fn states(&self) -> Vec<MemberState> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.parts.iter().map(|p| p.state).collect()
    }

    /// Records that member `m` failed: every other member in use gets a superblock that
    /// says so (events bumped) before this returns. A member already failed is left as
    /// it is.
    pub fn fail_member(&self, m: usize) {
        if self.dry {
            return;
        }
        let _writing = self.writing();
        {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            match st.parts.get(m).map(|p| p.state) {
                Some(MemberState::Active | MemberState::Rebuilding) => {
                    st.parts[m].state = MemberState::Failed
                }
                _ => return,
            }
        }
        if let Err(e) = self.write(false) {
            log::error!("cairn: {}: {e}", self.expect.name);
        }
    }

    /// Records that failed member `m` is removed: the array runs without it (`missing`).
    pub fn remove_member(&self, m: usize) -> Result<(), StackError> {
        if self.dry {
            return Err(StackError::ExaminedOnly);
        }
        let _writing = self.writing();
        let retiring = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            match st.parts.get(m).map(|p| p.state) {
                Some(MemberState::Failed) => {
                    let old = (
                        st.members[m].take(),
                        st.parts[m],
                        st.generations[m],
                        st.names[m].clone(),
                    );
                    st.parts[m].state = MemberState::Missing;
                    old
                }
                Some(MemberState::Missing) => {
                    return Err(StackError::Member(MemberIs::MissingAlready))
                }
                Some(_) => return Err(StackError::Member(MemberIs::InUse)),
                None => return Err(StackError::NoPosition(m)),
            }
        };
        self.write(false)?;
        if let (Some(old), part, generation, name) = retiring {
            self.retire(m, &old, (part, generation, &name), [0; 16]);
        }
        Ok(())
    }

    /// Takes failed member `m` back (its device still open): its superblock is read, and
    /// must be this member's. Returns whether the bitmap can bring it back (it was
    /// current when it left and no bit was cleared since; else it is rebuilt whole).
    /// Then every member in use, `m` too, gets a superblock that marks it rebuilding
    /// (events bumped). Nothing is written if it is refused.
    pub fn readd_member(&self, m: usize) -> Result<bool, StackError> {
        let sb = self.probe(m)?;
        let _writing = self.writing();
        let partial = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if st.parts.get(m).map(|p| p.state) != Some(MemberState::Failed) {
                return Err(StackError::Member(MemberIs::NotFailed));
            }
            let partial = self.bitmap_covers(&st, m, &sb);
            st.parts[m].state = MemberState::Rebuilding;
            st.parts[m].recovery_offset = 0;
            st.parts[m].partial = partial;
            st.generations[m] = st.generations[m].max(sb.generation);
            partial
        };
        self.write_rebuilding(m)
            .map_err(|e| StackError::StaysFailed(Box::new(e)))?;
        Ok(partial)
    }

    /// A member's metadata area (both superblock slots), and the queue it was read
    /// through.
    fn read_area(
        &self,
        device: &Arc<dyn Device>,
        name: &str,
    ) -> Result<(BlockingQueue, Vec<u8>), StackError> {
        let mut area = vec![0u8; SLOTS * SLOT_BYTES];
        let q = queue(device, &self.expect.name, name)?;
        q.read(0, &mut area).map_err(|source| StackError::Io {
            device: None,
            doing: "reading its superblocks",
            source,
        })?;
        Ok((q, area))
    }

    /// Writes the superblocks after member `m` was made rebuilding; fails if it did not
    /// take its own (then it is failed again).
    fn write_rebuilding(&self, m: usize) -> Result<(), StackError> {
        self.write(false)?;
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.parts[m].state != MemberState::Rebuilding {
            return Err(StackError::SuperblockNotTaken);
        }
        Ok(())
    }

    /// Whether the bitmap holds everything member `m`, whose last superblock is `sb`,
    /// missed: as at assembly, it was current when it left (active, or recovered from the
    /// bitmap, whose regions are still dirty) and no bit was cleared since.
    fn bitmap_covers(&self, st: &MetaState, m: usize, sb: &Superblock) -> bool {
        self.bitmap.is_some()
            && sb.events >= st.events_cleared
            && sb.roles.get(m).is_some_and(|r| {
                r.state == MemberState::Active || (r.state == MemberState::Rebuilding && r.partial)
            })
    }

    /// Whether failed member `m` answers with its superblock (see
    /// [`Metadata::readd_member`]). Writes nothing.
    pub fn probe_member(&self, m: usize) -> Result<(), StackError> {
        self.probe(m).map(|_| ())
    }

    /// Reads failed member `m`'s superblock: it must be this member's.
    fn probe(&self, m: usize) -> Result<Superblock, StackError> {
        if self.dry {
            return Err(StackError::ExaminedOnly);
        }
        let (device, name, member_uuid) = {
            let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            match (st.parts.get(m), st.members.get(m)) {
                (Some(p), Some(Some(d))) if p.state == MemberState::Failed => {
                    (d.clone(), st.names[m].clone(), p.member_uuid)
                }
                (Some(p), _) if p.state == MemberState::Missing => {
                    return Err(StackError::Member(MemberIs::Removed))
                }
                (Some(_), _) => return Err(StackError::Member(MemberIs::NotFailed)),
                (None, _) => return Err(StackError::NoPosition(m)),
            }
        };
        let (_, area) = self
            .read_area(&device, &name)
            .map_err(|e| StackError::StaysFailed(Box::new(e)))?;
        match superblock::pick(&area) {
            Picked::Valid { record: sb, .. }
                if sb.array_uuid == self.array_uuid && sb.member_uuid == member_uuid =>
            {
                Ok(sb)
            }
            _ => Err(StackError::Member(MemberIs::NotItsSuperblock)),
        }
    }

    /// Whether `device` may become a member: blank, or carrying a superblock of this
    /// array (a member that left, added back). Anything else could be someone's data.
    pub fn may_join(&self, device: &Arc<dyn Device>, name: &str) -> Result<(), StackError> {
        let (q, area) = self.read_area(device, name)?;
        joinable(&q, device, &area, name, &self.array_uuid)?;
        // It must keep what is written (a null device does not): a pattern over its
        // metadata area (blank, or this array's), read back, then the area as it was.
        let pattern: Vec<u8> = (0..area.len()).map(|i| (i % 251) as u8 ^ 0x5a).collect();
        let mut back = vec![0u8; area.len()];
        q.write(0, &pattern, IoFlags::FUA)
            .and_then(|()| q.read(0, &mut back))
            .and_then(|()| q.write(0, &area, IoFlags::FUA))
            .map_err(|source| StackError::Io {
                device: Some(name.to_string()),
                doing: "writing its metadata area",
                source,
            })?;
        if back != pattern {
            return Err(StackError::KeepsNoWrites {
                device: name.to_string(),
            });
        }
        Ok(())
    }

    /// Makes `device` a spare of this array: it must be fit to join
    /// ([`Metadata::may_join`]) and not a member in use; then it gets a spare's
    /// superblock in both slots ([`superblock::FLAG_SPARE`]), so that a restart knows it
    /// for one. Examined only ([`Metadata::dry`]): checked, nothing written.
    pub fn make_spare(&self, device: &Arc<dyn Device>, name: &str) -> Result<(), StackError> {
        let (q, area) = self.read_area(device, name)?;
        joinable(&q, device, &area, name, &self.array_uuid)?;
        let generation = match superblock::pick(&area) {
            Picked::Valid { record: sb, .. } => {
                let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                let in_use = st
                    .parts
                    .iter()
                    .zip(&st.members)
                    .position(|(p, d)| d.is_some() && p.member_uuid == sb.member_uuid)
                    .filter(|_| !sb.spare());
                if let Some(m) = in_use {
                    return Err(StackError::SpareInUse {
                        device: name.to_string(),
                        member: st.names[m].clone(),
                    });
                }
                sb.generation
            }
            _ => 0,
        };
        if self.dry {
            return Ok(());
        }
        self.may_join(device, name)?;
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let roles = self.roles(&st);
        let events = st.events;
        drop(st);
        let mut sb = self.superblock(0, new_uuid(), generation, events, roles);
        sb.role = superblock::ROLE_SPARE;
        sb.flags = superblock::FLAG_SPARE;
        for _ in 0..SLOTS {
            sb.generation += 1;
            let at = (sb.slot() * SLOT_BYTES) as u64;
            q.write(at, &sb.encode(), IoFlags::FUA)
                .and_then(|()| q.flush())
                .map_err(|source| StackError::Io {
                    device: Some(name.to_string()),
                    doing: "writing its spare's superblock",
                    source,
                })?;
        }
        Ok(())
    }

    /// Makes `device` member `m`, rebuilding. A device that was this member (this
    /// array's superblock, role `m`, an identity no other member has) is taken back as
    /// [`Metadata::readd_member`] takes one: returns whether the bitmap can bring it
    /// back. Any other device is made a new member ([`Metadata::set_member`]) and
    /// rebuilt whole. One that ran on without this array's other members (events ahead
    /// of the array's) is refused: what it holds is newer than what the array served.
    pub fn join(&self, m: usize, device: Arc<dyn Device>, name: &str) -> Result<bool, StackError> {
        if self.dry {
            return Err(StackError::ExaminedOnly);
        }
        let (_, area) = self.read_area(&device, name)?;
        let sb = match superblock::pick(&area) {
            Picked::Valid { record: sb, .. }
                if sb.array_uuid == self.array_uuid && sb.role == m as u32 && !sb.retired() =>
            {
                sb
            }
            _ => {
                self.set_member(m, device, name, MemberState::Rebuilding)?;
                return Ok(false);
            }
        };
        let _writing = self.writing();
        let partial = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if sb.events > st.events {
                return Err(StackError::RanOn {
                    member_events: sb.events,
                    array_events: st.events,
                });
            }
            let taken =
                st.parts.iter().enumerate().any(|(i, p)| {
                    i != m && p.member_uuid == sb.member_uuid && st.members[i].is_some()
                });
            if taken {
                drop(st);
                drop(_writing);
                self.set_member(m, device, name, MemberState::Rebuilding)?;
                return Ok(false);
            }
            let partial = self.bitmap_covers(&st, m, &sb);
            st.parts[m] = Part {
                state: MemberState::Rebuilding,
                recovery_offset: 0,
                member_uuid: sb.member_uuid,
                partial,
            };
            st.generations[m] = sb.generation;
            st.members[m] = Some(device);
            st.names[m] = name.to_string();
            partial
        };
        self.write_rebuilding(m)?;
        Ok(partial)
    }

    /// Makes `device` member `m` (`state`: rebuilding for a member added, active for a
    /// replacement fully copied): its old superblocks are cleared, then every member in
    /// use gets a superblock that says so (events bumped).
    pub fn set_member(
        &self,
        m: usize,
        device: Arc<dyn Device>,
        name: &str,
        state: MemberState,
    ) -> Result<(), StackError> {
        if self.dry {
            return Err(StackError::ExaminedOnly);
        }
        let q = queue(&device, &self.expect.name, name)?;
        q.write(0, &vec![0u8; SLOTS * SLOT_BYTES], IoFlags::FUA)
            .and_then(|()| q.flush())
            .map_err(|source| StackError::Io {
                device: None,
                doing: "clearing its superblocks",
                source,
            })?;
        let _writing = self.writing();
        let (retiring, by) = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if m >= st.parts.len() {
                return Err(StackError::NoPosition(m));
            }
            let by = new_uuid();
            let old = (
                st.members[m].clone(),
                st.parts[m],
                st.generations[m],
                st.names[m].clone(),
            );
            st.parts[m] = Part {
                state,
                recovery_offset: 0,
                member_uuid: by,
                partial: false,
            };
            st.generations[m] = 0;
            st.members[m] = Some(device.clone());
            st.names[m] = name.to_string();
            (old, by)
        };
        self.write(false)?;
        if let (Some(old), part, generation, old_name) = retiring {
            if !Arc::ptr_eq(&old, &device) && part.state != MemberState::Missing {
                self.retire(m, &old, (part, generation, &old_name), by);
            }
        }
        Ok(())
    }

    /// Data bytes member `m` holds (a new member needs at least this after the metadata
    /// area).
    pub fn member_data(&self, m: usize) -> u64 {
        self.member_data.get(m).copied().unwrap_or(0)
    }

    /// Where a resync resumes: the copies agree below this array offset (0 unless a
    /// stop during the last resync recorded how far it got).
    pub fn resync_from(&self) -> u64 {
        self.resync_from
    }

    /// Stops the array: members that failed while it ran are recorded as failed, and
    /// every member still in use gets a superblock with the clean flag on. The copies
    /// still to be resynced stay marked so, with `resynced_below`, how far the resync
    /// got (nothing is in flight now, so the copies agree below it).
    pub fn stop(&self, failed: &[bool], resynced_below: u64) {
        if self.dry {
            return;
        }
        let _writing = self.writing();
        {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            for (p, &f) in st.parts.iter_mut().zip(failed) {
                if f && p.state != MemberState::Missing {
                    p.state = MemberState::Failed;
                }
            }
            st.resync_reached = resynced_below.min(self.array_bytes);
        }
        // Copies that may differ stay marked so until a resync makes them agree.
        if let Err(e) = self.write(!self.resync_pending()) {
            log::error!("cairn: {}: {e}", self.expect.name);
        }
    }

    /// Writes the next superblock to every member in use, event count bumped, `clean` as
    /// given. A member that does not take it is failed, and the others are written again
    /// so that they record it. Fails if no member took it. The caller holds `writing`.
    fn write(&self, clean: bool) -> Result<(), Error> {
        self.write_with(clean, true, &[])
    }

    /// [`Metadata::write`], with the event count bumped only if `bump` (a state change;
    /// bitmap changes are not), and the bits of the regions in `extra` set.
    fn write_with(&self, clean: bool, bump: bool, extra: &[usize]) -> Result<(), Error> {
        let mut bump = bump;
        // Each round fails at least one more member or ends: at most one per member.
        for _ in 0..=self.expect.members.len() {
            let failed = self.write_once(clean, bump, extra)?;
            if failed.is_empty() {
                return Ok(());
            }
            // A member failed: a state change.
            bump = true;
            {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                for &i in &failed {
                    st.parts[i].state = MemberState::Failed;
                    log::error!(
                        "cairn: {}: member '{}' failed (its superblock could not be written); running degraded",
                        self.expect.name, st.names[i]
                    );
                }
            }
            // Out of reads and writes before the superblocks that record it are written,
            // and before whatever waits on this write goes on.
            if let Some(hook) = self.on_fail.get() {
                for &i in &failed {
                    hook(i);
                }
            }
        }
        Ok(())
    }

    /// Member `m`'s superblock (identity `member_uuid`) at `generation` and `events`:
    /// no flags, no bitmap, no bits cleared; the callers set what differs.
    fn superblock(
        &self,
        m: usize,
        member_uuid: [u8; 16],
        generation: u64,
        events: u64,
        roles: Vec<Role>,
    ) -> Superblock {
        Superblock {
            generation,
            array_uuid: self.array_uuid,
            member_uuid,
            level: self.expect.level,
            chunk_bytes: self.expect.chunk_bytes,
            copies: self.expect.copies,
            role: m as u32,
            data_offset: self.data_offset,
            member_data_bytes: self.member_data[m],
            array_bytes: self.array_bytes,
            events,
            flags: 0,
            retired_by: [0; 16],
            resync_offset: 0,
            region_bytes: 0,
            bitmap: Vec::new(),
            events_cleared: 0,
            created_secs: self.created_secs,
            updated_secs: now_secs(),
            name: truncated(&self.name, 64),
            roles,
        }
    }

    /// Every member's entry of the role table, as the state has them.
    fn roles(&self, st: &MetaState) -> Vec<Role> {
        st.parts
            .iter()
            .enumerate()
            .map(|(i, p)| Role {
                state: p.state,
                recovery_offset: if p.state == MemberState::Active {
                    self.member_data[i]
                } else {
                    p.recovery_offset
                },
                partial: p.state == MemberState::Rebuilding && p.partial,
            })
            .collect()
    }

    /// Marks `device`, member `m` until now (`old`, its superblock generation
    /// `generation`), as taken out of the array at the current event, in its place by
    /// `by` (zeros: removed). Both of its slots get the retired superblock, so no older
    /// copy of it can be read as current: assembled again, alone or with others taken out
    /// with it, it is refused. A device that cannot be written (it failed) is only
    /// logged. The caller holds `writing`.
    fn retire(&self, m: usize, device: &Arc<dyn Device>, old: (Part, u64, &str), by: [u8; 16]) {
        let (part, generation, name) = old;
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let roles = self.roles(&st);
        let events = st.events;
        let events_cleared = st.events_cleared.min(events);
        drop(st);
        let mut sb = self.superblock(m, part.member_uuid, generation, events, roles);
        sb.flags = superblock::FLAG_RETIRED;
        sb.retired_by = by;
        sb.events_cleared = events_cleared;
        let result = queue(device, &self.expect.name, name).and_then(|q| {
            for _ in 0..SLOTS {
                sb.generation += 1;
                let at = (sb.slot() * SLOT_BYTES) as u64;
                q.write(at, &sb.encode(), IoFlags::FUA)
                    .and_then(|()| q.flush())
                    .map_err(|e| Error::Invalid(e.to_string()))?;
            }
            Ok(())
        });
        match result {
            Ok(()) => log::info!(
                "cairn: {}: '{name}' is marked taken out of the array (event {events}): it is never assembled as current again",
                self.expect.name
            ),
            Err(e) => log::warn!(
                "cairn: {}: '{name}' could not be marked taken out of the array ({e}); it is out of date from event {events}",
                self.expect.name
            ),
        }
    }

    /// One round of [`Metadata::write`]: the members that did not take it.
    fn write_once(&self, clean: bool, bump: bool, extra: &[usize]) -> Result<Vec<usize>, Error> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if bump {
            st.events += 1;
        }
        let (region_bytes, bitmap) = match &self.bitmap {
            Some(bm) => (bm.region_bytes(), bm.image(extra)),
            None => (0, Vec::new()),
        };
        let roles = self.roles(&st);
        let mut written = 0;
        let mut errors = Vec::new();
        let mut failed = Vec::new();
        for i in 0..st.parts.len() {
            let part = st.parts[i];
            let Some(device) = st.members[i].clone() else {
                continue;
            };
            if !matches!(part.state, MemberState::Active | MemberState::Rebuilding) {
                continue;
            }
            let generation = st.generations[i] + 1;
            let mut sb = self.superblock(i, part.member_uuid, generation, st.events, roles.clone());
            sb.flags = if clean { superblock::FLAG_CLEAN } else { 0 };
            if !clean {
                sb.resync_offset = st.resync_reached;
            }
            sb.region_bytes = region_bytes;
            sb.bitmap = bitmap.clone();
            sb.events_cleared = st.events_cleared.min(st.events);
            let member = st.names[i].clone();
            let result = queue(&device, &self.expect.name, &member).and_then(|q| {
                let at = (sb.slot() * SLOT_BYTES) as u64;
                q.write(at, &sb.encode(), IoFlags::FUA)
                    .and_then(|()| q.flush())
                    .map_err(|e| Error::Invalid(format!("member '{member}': {e}")))
            });
            match result {
                Ok(()) => {
                    st.generations[i] = generation;
                    written += 1;
                }
                Err(e) => {
                    errors.push(e.to_string());
                    failed.push(i);
                }
            }
        }
        if written == 0 {
            return Err(Error::Invalid(format!(
                "device '{}': no member took its superblock ({})",
                self.expect.name,
                errors.join("; ")
            )));
        }
        Ok(failed)
    }
}

/// Whether a device whose metadata area is `area` may join the array `array_uuid`, read
/// only: blank (with no data past its metadata area either), or carrying a superblock of
/// that array. Anything else may be someone's data.
fn joinable(
    q: &BlockingQueue,
    device: &Arc<dyn Device>,
    area: &[u8],
    name: &str,
    array_uuid: &[u8; 16],
) -> Result<(), StackError> {
    let device_name = name.to_string();
    match superblock::pick(area) {
        Picked::Blank => match data_found(q, device, area)? {
            None => Ok(()),
            Some(why) => Err(StackError::HoldsData {
                device: device_name,
                found: Some(why),
            }),
        },
        Picked::Valid { record: sb, .. } if sb.array_uuid == *array_uuid => Ok(()),
        // Refused before anything is written to it.
        Picked::Valid { record: sb, .. } => Err(StackError::OtherArray {
            device: device_name,
            spare: sb.spare(),
            other: sb.name,
            uuid: superblock::uuid_text(&sb.array_uuid),
        }),
        Picked::Foreign { .. } => Err(StackError::HoldsData {
            device: device_name,
            found: None,
        }),
    }
}

/// Most bytes of a blank-looking member's allocated data read to find out whether it holds
/// data (its metadata area is always read whole).
const DATA_SCAN_BYTES_MAX: u64 = 64 << 20;

/// Whether a member whose superblock slots are blank holds data all the same (a raw
/// array's member, a disk another program wrote): the first non-zero byte found in its
/// metadata area, or in what its allocation map shows allocated after it, read up to
/// [`DATA_SCAN_BYTES_MAX`] bytes (a sparse new file reads nothing more; a block device,
/// which shows all of itself allocated, its first 64 MiB). `None`: blank as far as read.
/// File systems, partition tables and volume managers put their signatures in the first
/// MiB, which is always read. `slots` is the member's first [`SLOTS`] slots, read already.
fn data_found(
    q: &BlockingQueue,
    device: &Arc<dyn Device>,
    slots: &[u8],
) -> Result<Option<String>, Error> {
    let size = device.geometry().size_bytes;
    let found = |at: u64| {
        Ok(Some(format!(
            "no superblock, and non-zero bytes at offset {at}"
        )))
    };
    if let Some(at) = first_nonzero(slots) {
        return found(at);
    }
    let mut buf = vec![0u8; 1 << 20];
    let mut read_range = |from: u64, to: u64, budget: &mut u64| -> Result<Option<u64>, Error> {
        let mut at = from;
        while at < to && *budget > 0 {
            let n = (to - at).min(buf.len() as u64).min(*budget) as usize;
            q.read(at, &mut buf[..n]).map_err(|e| {
                Error::Invalid(format!("reading {n} bytes at offset {at} failed: {e}"))
            })?;
            if let Some(i) = first_nonzero(&buf[..n]) {
                return Ok(Some(at + i));
            }
            at += n as u64;
            *budget -= n as u64;
        }
        Ok(None)
    };
    let slots_end = slots.len() as u64;
    let mut unlimited = u64::MAX;
    if let Some(at) = read_range(slots_end, DATA_OFFSET_MIN.min(size), &mut unlimited)? {
        return found(at);
    }
    let mut budget = DATA_SCAN_BYTES_MAX;
    let mut at = DATA_OFFSET_MIN;
    let mut extents = Vec::new();
    // The map may come in pieces; each call moves on by at least one extent.
    while at < size && budget > 0 {
        extents.clear();
        device.extents(at, size - at, &mut extents)?;
        if extents.iter().all(|e| e.len == 0) {
            break;
        }
        for e in &extents {
            let end = (at + e.len).min(size);
            if !e.hole && !e.zero {
                if let Some(hit) = read_range(at, end, &mut budget)? {
                    return found(hit);
                }
            }
            at = end;
            if at >= size || budget == 0 {
                break;
            }
        }
    }
    Ok(None)
}

/// The offset of the first byte of `bytes` that is not zero.
fn first_nonzero(bytes: &[u8]) -> Option<u64> {
    bytes.iter().position(|&b| b != 0).map(|i| i as u64)
}

fn queue(device: &Arc<dyn Device>, array: &str, member: &str) -> Result<BlockingQueue, Error> {
    BlockingQueue::open(device, Switches::default()).map_err(|e| {
        Error::Invalid(format!(
            "device '{array}': member '{member}': cannot open it for its superblock: {e}"
        ))
    })
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn truncated(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_carried_to_another_region_size_cover_every_old_dirty_region() {
        const M: u64 = 1 << 20;
        // 10 regions of 1 MiB, 1 and 9 dirty.
        let old = [0b10u8, 0b10];
        // Larger regions: 0 (0-4M) holds old 1, 2 (8-12M) holds old 9.
        assert_eq!(convert_bits(M, &old, 10 * M, 4 * M, 10 * M), vec![0b101]);
        // Smaller: old 1 is new 2 and 3; old 9 is new 18 and 19.
        assert_eq!(
            convert_bits(M, &old, 10 * M, M / 2, 10 * M),
            vec![0b1100, 0, 0b1100]
        );
        // The array shrank below old region 9: the last region takes it.
        assert_eq!(convert_bits(M, &old, 10 * M, M, 8 * M), vec![0b1000_0010]);
        // A recorded array whose last region ends past 2^64 (a superblock may say so:
        // the region count is what it bounds) used to overflow.
        assert_eq!(
            convert_bits(1 << 63, &[0b11], u64::MAX, 4 * M, 10 * M),
            vec![0b111]
        );
    }
}
