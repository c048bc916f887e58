//! What `status` shows of an array (`Device::array_status`), line by line: its members
//! and their states, the rebuild or resync, the spares, the bitmap, the read repairs.

use std::sync::atomic::Ordering::Relaxed;

use super::Shared;

impl Shared {
    /// The read repairs line of `array_status` (empty before the first).
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
