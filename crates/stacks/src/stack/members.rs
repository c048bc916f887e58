//! Changes of members of a running array: the admin's `fail`, `remove`, `add`,
//! `re-add` and `replace` (dispatched by `ArrayAdmin::act`), and the steps they share
//! with the members' thread (`watch`): opening and checking a new device, putting it in a
//! member's place, taking a failed member back.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use cairn_core::Device;

use super::{Layout, Shared, MISSING};
use crate::error::{Error, MemberIs};

impl Shared {
    /// Member `member`'s index, or an error naming the members.
    fn member_index(&self, member: &str) -> Result<usize, Error> {
        let names: Vec<String> = (0..self.health.n).map(|m| self.health.name(m)).collect();
        match names.iter().position(|n| n == member) {
            Some(m) => Ok(m),
            None => Err(Error::NoSuchMember {
                array: self.name.clone(),
                member: member.to_string(),
                members: names,
            }),
        }
    }

    /// The refusal of an action on `member` because of what it is.
    fn member_is(&self, member: &str, state: MemberIs) -> Error {
        Error::MemberState {
            array: self.name.clone(),
            member: member.to_string(),
            state,
        }
    }

    /// `source`, as the reason `action` on `member` was refused.
    fn refused(&self, action: &'static str, member: &str, source: Error) -> Error {
        Error::Refused {
            action,
            member: member.to_string(),
            array: self.name.clone(),
            source: Box::new(source),
        }
    }

    /// The level, for the coverage rules.
    fn level(&self) -> crate::array::superblock::Level {
        use crate::array::superblock::Level;
        match self.layout.kind() {
            "mirror" => Level::Mirror,
            _ => Level::Raid10,
        }
    }

    /// `fail MEMBER`: never below what the array can run on.
    pub(super) fn fail(
        &self,
        meta: &crate::array::Metadata,
        member: &str,
    ) -> Result<String, Error> {
        let name = &self.name;
        let m = self.member_index(member)?;
        if !self.health.ok(m) {
            return Err(self.member_is(member, MemberIs::FailedAlready));
        }
        // Every piece keeps a current copy.
        let current: Vec<bool> = (0..self.health.n)
            .map(|i| i != m && self.health.readable(i))
            .collect();
        if let Some(set) =
            crate::array::assemble::uncovered(self.level(), self.layout.copies(), &current)
        {
            return Err(Error::LastCopy {
                array: name.clone(),
                member: member.to_string(),
                holders: set.iter().map(|&i| self.health.name(i)).collect(),
            });
        }
        self.by_admin[m].store(true, Relaxed);
        self.health.readable[m].store(false, Relaxed);
        self.health.failed[m].store(true, Relaxed);
        log::warn!("cairn: {name}: member {member} failed by the admin; running degraded");
        meta.fail_member(m);
        self.health.failed_event();
        Ok(format!(
            "{name}: member '{member}' failed; running degraded"
        ))
    }

    /// `remove MEMBER`: a failed member recorded as missing, and its file closed.
    pub(super) fn remove(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        member: &str,
    ) -> Result<String, Error> {
        use crate::array::superblock::MemberState;
        let name = &self.name;
        let m = self.member_index(member)?;
        if meta.states()[m] == MemberState::Active && self.health.ok(m) {
            return Err(self.member_is(member, MemberIs::InUse));
        }
        if self.health.being_replaced(m) {
            return Err(self.member_is(member, MemberIs::BeingReplaced));
        }
        meta.remove_member(m)
            .map_err(|e| self.refused("remove", member, e))?;
        // A stand-in that is never used takes its place, so its file closes.
        let stand_in = self.stand_in()?;
        let n = self.health.n;
        self.with_threads_stopped(|| {
            self.health.switch(|devices, _| {
                devices[m] = Some(stand_in);
                // A replacement of it that failed goes too.
                devices[n + m] = None;
            })
        });
        log::info!("cairn: {name}: member {member} removed by the admin");
        Ok(format!(
            "{name}: member '{member}' removed: recorded as missing, and closed"
        ))
    }

    /// A device that stands in for a missing member (never written nor read).
    fn stand_in(&self) -> Result<Arc<dyn Device>, Error> {
        let size = self.data_offset + self.metadata.as_ref().map_or(0, |m| m.member_data(0));
        cairn_leaves::null::NullDevice::new(
            MISSING,
            size.max(u64::from(self.geometry.block_bytes)),
            self.geometry.block_bytes,
        )
        .map(|d| Arc::new(d) as Arc<dyn Device>)
        .map_err(Error::from)
    }

    /// Opens the device `spec` names as a new member of this array, checking it fits.
    fn open_new(
        &self,
        meta: &crate::array::Metadata,
        spec: &str,
        slot: usize,
    ) -> Result<(Arc<dyn Device>, String), Error> {
        let leaf = cairn_leaves::LeafSpec::parse(spec).map_err(|source| Error::Spec {
            spec: spec.to_string(),
            source,
        })?;
        let new_name = leaf.default_name();
        let taken = (0..2 * self.health.n)
            .any(|i| self.health.name(i) == new_name && self.health.devices()[i].is_some());
        if taken || new_name == MISSING {
            return Err(Error::NameTaken {
                array: self.name.clone(),
                name: new_name,
            });
        }
        let device = cairn_leaves::open(&leaf, &new_name)?;
        self.fits(&device, &new_name, meta.member_data(slot))?;
        meta.may_join(&device, &new_name)?;
        let mut added = self.added.lock().unwrap_or_else(|p| p.into_inner());
        added.retain(|(n, _)| *n != new_name);
        added.push((new_name.clone(), leaf.stack_table()));
        Ok((device, new_name))
    }

    /// Whether `device` can be a member holding `member_data` bytes of data: its size,
    /// block size and what it can do.
    pub(super) fn fits(
        &self,
        device: &Arc<dyn Device>,
        new_name: &str,
        member_data: u64,
    ) -> Result<(), Error> {
        let g = device.geometry();
        let need = self.data_offset + member_data;
        if g.size_bytes < need {
            return Err(Error::TooSmall {
                device: new_name.to_string(),
                array: self.name.clone(),
                size_bytes: g.size_bytes,
                need_bytes: need,
            });
        }
        if g.block_bytes > self.geometry.block_bytes {
            return Err(Error::BlocksTooLarge {
                device: new_name.to_string(),
                array: self.name.clone(),
                block_bytes: u64::from(g.block_bytes),
                array_block_bytes: u64::from(self.geometry.block_bytes),
            });
        }
        let caps = self.geometry.caps;
        let lacks: Vec<&str> = [
            ("flush", caps.flush && !g.caps.flush),
            ("fua", caps.fua && !g.caps.fua),
            ("discard", caps.discard && !g.caps.discard),
            ("write-zeroes", caps.write_zeroes && !g.caps.write_zeroes),
        ]
        .iter()
        .filter(|(_, l)| *l)
        .map(|(n, _)| *n)
        .collect();
        if !lacks.is_empty() {
            return Err(Error::LacksCaps {
                device: new_name.to_string(),
                array: self.name.clone(),
                lacks,
            });
        }
        Ok(())
    }

    /// `add SPEC`: the device takes the place of a missing (removed) or failed member and
    /// is rebuilt online; reads use it once it is current.
    pub(super) fn add(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        spec: &str,
    ) -> Result<String, Error> {
        let name = &self.name;
        let Some(m) = self.free_slot(meta) else {
            // A spare: it takes the place of the next member that fails.
            let (device, new_name) = self.open_new(meta, spec, 0)?;
            if let Err(e) = meta.make_spare(&device, &new_name) {
                let mut added = self.added.lock().unwrap_or_else(|p| p.into_inner());
                added.retain(|(n, _)| *n != new_name);
                return Err(e);
            }
            self.spares
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((device, new_name.clone()));
            self.watch_members();
            log::info!("cairn: {name}: '{new_name}' added as a spare");
            return Ok(format!(
                "{name}: '{new_name}' added as a spare: it takes the place of the next member that fails (to swap a working member for a new device: replace {name} OLD SPEC)"
            ));
        };
        let (device, new_name) = self.open_new(meta, spec, m)?;
        let old = self.add_device(meta, m, device, &new_name)?;
        Ok(format!(
            "{name}: '{new_name}' added in place of '{old}', rebuilding (see status)\n{}",
            self.members_line()
        ))
    }

    /// A member a new device may take the place of: missing (removed), or failed and
    /// recorded so (never one being replaced by a working replacement).
    pub(super) fn free_slot(&self, meta: &crate::array::Metadata) -> Option<usize> {
        use crate::array::superblock::MemberState;
        let states = meta.states();
        let n = self.health.n;
        let free = |m: usize| !self.health.being_replaced(m);
        (0..n)
            .find(|&m| states[m] == MemberState::Missing && free(m))
            .or_else(|| {
                (0..n).find(|&m| !self.health.ok(m) && states[m] == MemberState::Failed && free(m))
            })
    }

    /// Makes `device` member `m` (missing or failed), rebuilt online. The old name.
    pub(super) fn add_device(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        m: usize,
        device: Arc<dyn Device>,
        new_name: &str,
    ) -> Result<String, Error> {
        let name = &self.name;
        let old = self.health.name(m);
        // Recorded first: the new member is known as rebuilding before it gets a write.
        let partial = meta
            .join(m, device.clone(), new_name)
            .map_err(|e| self.refused("add", new_name, e))?;
        self.with_threads_stopped(|| {
            // Nothing sent to the old device is in flight once the switch returns; from
            // then on writes go to the new one, which is read only below its rebuild's
            // progress.
            let n = self.health.n;
            self.health.switch(|devices, names| {
                devices[m] = Some(device);
                names[m] = new_name.to_string();
                // A replacement of the old member that failed goes too.
                devices[n + m] = None;
            });
            self.health.readable[m].store(false, Relaxed);
            self.health.partial[m].store(partial, Relaxed);
            self.health.below[m].store(0, Relaxed);
            self.health.failed[m].store(false, Relaxed);
            if partial {
                self.recover_for(m);
            }
        });
        self.by_admin[m].store(false, Relaxed);
        self.given_up[m].store(false, Relaxed);
        log::info!(
            "cairn: {name}: '{new_name}' added in place of '{old}'; {}",
            self.how(partial)
        );
        Ok(old)
    }

    /// `re-add MEMBER`: a failed member whose device answers again (a remote one back on
    /// the network, a disk reconnected) is taken back. It was current when it left, so
    /// with a bitmap only the regions written since are copied to it; it is read
    /// elsewhere until then. Without a bitmap, or if bits were cleared since it left, it
    /// is rebuilt whole.
    pub(super) fn readd(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        member: &str,
    ) -> Result<String, Error> {
        let name = &self.name;
        let m = self.member_index(member)?;
        if self.health.ok(m) {
            return Err(self.member_is(member, MemberIs::NotFailed));
        }
        if self.health.being_replaced(m) {
            return Err(self.member_is(member, MemberIs::BeingReplaced));
        }
        let how = self
            .take_back(meta, m)
            .map_err(|e| self.refused("re-add", member, e))?;
        log::info!("cairn: {name}: member {member} re-added by the admin; {how}");
        Ok(format!("{name}: '{member}' re-added: {how} (see status)"))
    }

    /// Takes failed member `m` back (see [`Shared::readd`]): how it is brought up to
    /// date.
    pub(super) fn take_back(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        m: usize,
    ) -> Result<String, Error> {
        // Whatever its device acknowledged and may have lost until now (a remote server
        // that restarted), found now or later, is copied to it again by this re-add (it
        // gets no write while failed, and no bit is cleared meanwhile): its flushes no
        // longer report it, or the member would fail again for what the re-add covers.
        // First: the superblocks the re-add writes are flushed too.
        if let Some(Some(device)) = self.health.devices().get(m) {
            device.lost_writes_made_up();
        }
        let partial = meta.readd_member(m)?;
        self.by_admin[m].store(false, Relaxed);
        self.given_up[m].store(false, Relaxed);
        self.with_threads_stopped(|| {
            let h = &self.health;
            h.readable[m].store(false, Relaxed);
            h.below[m].store(0, Relaxed);
            h.partial[m].store(partial, Relaxed);
            h.failed[m].store(false, Relaxed);
            if partial {
                self.recover_for(m);
            }
        });
        Ok(self.how(partial))
    }

    /// Member `m`, back and taking writes, is to get the regions the bitmap marks now.
    fn recover_for(&self, m: usize) {
        let h = &self.health;
        if let Some(bm) = &h.bitmap {
            // Every write that could have missed it has ended once this returns, with
            // its bit on disk: the bits then are all it needs.
            h.switch(|_, _| {});
            let others = h.one_copy.load(Relaxed)
                || (0..h.n).any(|i| i != m && h.ok(i) && h.partial[i].load(Relaxed));
            bm.recover_dirty(others);
        }
    }

    /// How a member taken back is brought up to date, for the log and the reply.
    fn how(&self, partial: bool) -> String {
        match &self.health.bitmap {
            Some(bm) if partial => format!(
                "copying the {} of {} regions of {} the bitmap marks",
                bm.to_recover_count(),
                bm.regions(),
                cairn_core::size::format_bytes(bm.region_bytes())
            ),
            _ => "rebuilding it whole".to_string(),
        }
    }

    /// `replace OLD SPEC`: the device is written with every write to OLD and filled by a
    /// rebuild; once it is current it takes OLD's place and OLD is closed. The array
    /// never has fewer current copies than before.
    pub(super) fn replace(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        old: &str,
        spec: &str,
    ) -> Result<String, Error> {
        let name = &self.name;
        let m = self.member_index(old)?;
        // A replacement that failed is given up: a new one may take its place.
        if self.health.being_replaced(m) {
            return Err(self.member_is(old, MemberIs::ReplacedAlready));
        }
        if !self.health.ok(m) {
            return Err(self.member_is(old, MemberIs::FailedOrMissing));
        }
        let (device, new_name) = self.open_new(meta, spec, m)?;
        let r = self.health.n + m;
        self.with_threads_stopped(|| {
            self.health.readable[r].store(false, Relaxed);
            self.health.below[r].store(0, Relaxed);
            self.health.partial[r].store(false, Relaxed);
            self.health.failed[r].store(false, Relaxed);
            self.health.switch(|devices, names| {
                devices[r] = Some(device);
                names[r] = new_name.clone();
            });
        });
        log::info!("cairn: {name}: replacing '{old}' by '{new_name}'");
        Ok(format!(
            "{name}: replacing '{old}' by '{new_name}': it is written with every write to '{old}' and filled by a rebuild, then takes its place (see status)"
        ))
    }

    /// The stack file line for the members as they are now.
    pub(super) fn members_line(&self) -> String {
        let names: Vec<String> = (0..self.health.n)
            .map(|m| format!("\"{}\"", self.health.name(m)))
            .collect();
        format!("members now: [{}]", names.join(", "))
    }
}
