//! What `status` shows of an array (`Array::status`), line by line: its members
//! and their states, the rebuild or resync, the spares, the bitmap, the read repairs.

use std::sync::atomic::Ordering::Relaxed;

use super::Shared;
use crate::array::superblock::MemberState;

impl Shared {
    /// Each member's flag in the map of `Array::status` (`U`: read, `_`: not), and its
    /// name and state (and its replacement's, while one is built).
    pub(super) fn member_states(&self, states: &[MemberState]) -> (String, Vec<String>) {
        let mut flags = String::new();
        let mut members = Vec::new();
        for (m, s) in states.iter().enumerate() {
            let state = match s {
                _ if self.given_up.get(m).is_some_and(|g| g.load(Relaxed))
                    && !self.health.ok(m) =>
                {
                    "failed (re-adds given up)"
                }
                _ if !self.health.ok(m) && *s != MemberState::Missing => "failed",
                MemberState::Rebuilding if self.health.readable(m) => "active",
                s => s.name(),
            };
            flags.push(if self.health.readable(m) { 'U' } else { '_' });
            members.push(format!("{} {state}", self.health.name(m)));
            if self.health.being_replaced(m) {
                members.push(format!(
                    "{} replacing {}",
                    self.health.name(self.health.n + m),
                    self.health.name(m)
                ));
            }
        }
        (flags, members)
    }

    /// `array_report`'s members: what [`Shared::member_states`] says, as fields.
    pub(super) fn member_report(&self, states: &[MemberState]) -> Vec<cairn_core::ArrayMember> {
        let mut out = Vec::new();
        for (m, s) in states.iter().enumerate() {
            let given_up = self.given_up.get(m).is_some_and(|g| g.load(Relaxed));
            let state = match s {
                _ if !self.health.ok(m) && *s != MemberState::Missing => "failed",
                MemberState::Rebuilding if self.health.readable(m) => "active",
                s => s.name(),
            };
            out.push(cairn_core::ArrayMember {
                name: self.health.name(m).to_string(),
                role: m,
                state,
                readable: self.health.readable(m),
                readd_given_up: given_up && !self.health.ok(m),
            });
            if self.health.being_replaced(m) {
                out.push(cairn_core::ArrayMember {
                    name: self.health.name(self.health.n + m).to_string(),
                    role: m,
                    state: "replacing",
                    readable: false,
                    readd_given_up: false,
                });
            }
        }
        out
    }

    /// `array_report`'s rebuild or resync, while one runs.
    pub(super) fn sync_report(&self) -> Option<cairn_core::ArraySync> {
        let sync = &self.health.sync;
        sync.running().then(|| cairn_core::ArraySync {
            kind: if sync.resync.load(Relaxed) {
                "resync"
            } else {
                "rebuild"
            },
            done_bytes: sync.done_bytes.load(Relaxed),
            total_bytes: sync.total_bytes.load(Relaxed),
            rate_bytes_per_s: sync.rate.load(Relaxed),
        })
    }

    /// `array_report`'s spares, by name.
    pub(super) fn spare_names(&self) -> Vec<String> {
        self.spares
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(_, n)| n.clone())
            .collect()
    }

    /// The rebuild or resync line of `Array::status`: its progress while one runs, else
    /// that reads use one copy until a resync, else what the last one did (empty if none
    /// ran).
    pub(super) fn sync_line(&self) -> String {
        use cairn_core::size::format_bytes;
        let sync = &self.health.sync;
        let mut out = String::new();
        if sync.running() {
            let (done, total) = (
                sync.done_bytes.load(Relaxed),
                sync.total_bytes.load(Relaxed).max(1),
            );
            let rate = sync.rate.load(Relaxed);
            out += &format!(
                "    {} {:.1}% ({} of {}, {}/s, {} s left)\n",
                if sync.resync.load(Relaxed) {
                    "resync"
                } else {
                    "rebuild"
                },
                done as f64 * 100.0 / total as f64,
                format_bytes(done),
                format_bytes(total),
                format_bytes(rate),
                (total - done)
                    .checked_div(rate)
                    .map_or_else(|| "?".to_string(), |s| s.to_string())
            );
        } else if self.health.one_copy.load(Relaxed) {
            out += "    not stopped cleanly: reads from one copy until resynced\n";
        } else if sync.read_bytes.load(Relaxed) > 0 {
            out += &format!(
                "    last {}: read {} bytes, wrote {} bytes\n",
                if sync.resync.load(Relaxed) {
                    "resync"
                } else {
                    "rebuild"
                },
                sync.read_bytes.load(Relaxed),
                sync.written_bytes.load(Relaxed)
            );
        }
        out
    }

    /// The spares line of `Array::status` (empty without spares).
    pub(super) fn spares_line(&self) -> String {
        let mut out = String::new();
        let spares: Vec<String> = self
            .spares
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(_, n)| n.clone())
            .collect();
        if !spares.is_empty() {
            out += &format!("    spares: {}\n", spares.join(", "));
        }
        out
    }

    /// The bitmap line of `Array::status` (empty without a bitmap).
    pub(super) fn bitmap_line(&self) -> String {
        use cairn_core::size::format_bytes;
        let mut out = String::new();
        if let Some(bm) = &self.health.bitmap {
            out += &format!(
                "    bitmap: {} of {} regions of {} dirty\n",
                bm.dirty_count(),
                bm.regions(),
                format_bytes(bm.region_bytes())
            );
        }
        out
    }

    /// The read repairs line of `Array::status` (empty before the first).
    pub(super) fn repairs_line(&self) -> String {
        use cairn_core::size::format_bytes;
        let repairs = &self.health.repairs;
        let r = repairs.counters.snapshot();
        let pending = repairs.pending_count();
        if r.repaired + r.failed == 0 && pending == 0 {
            return String::new();
        }
        let by_member: Vec<String> = (0..self.health.n)
            .filter_map(|m| {
                let (done, failed) = (
                    repairs.repaired[m].load(Relaxed),
                    repairs.failed[m].load(Relaxed),
                );
                let name = self.health.name(m);
                match (done, failed) {
                    (0, 0) => None,
                    (d, 0) => Some(format!("{name} {d}")),
                    (d, f) => Some(format!("{name} {d} ({f} failed)")),
                }
            })
            .collect();
        format!(
            "    read repairs: {} rewritten ({}), {} failed{}{}\n",
            r.repaired,
            format_bytes(r.repaired_bytes),
            r.failed,
            if pending > 0 {
                format!(", {pending} pending")
            } else {
                String::new()
            },
            if by_member.is_empty() {
                String::new()
            } else {
                format!(": {}", by_member.join(", "))
            }
        )
    }
}
