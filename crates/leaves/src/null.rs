//! `null`: completes every request at once; reads return zeros.
//!
//! Like Linux's null_blk it measures everything above the device: the cost of cairn's
//! submission path, statistics, clock and completion delivery.

use std::rc::Rc;

use cairn_core::{Caps, Core, Device, Error, Geometry, Io, IoStatus, Op, Queue, QueueStats};

/// A device of a given size that stores nothing.
pub struct NullDevice {
    name: String,
    geometry: Geometry,
}

impl NullDevice {
    /// A null device of `size_bytes` with `block_bytes` logical blocks.
    pub fn new(name: &str, size_bytes: u64, block_bytes: u32) -> Result<NullDevice, Error> {
        crate::check_size("null", size_bytes, block_bytes)?;
        Ok(NullDevice {
            name: name.into(),
            geometry: Geometry {
                size_bytes,
                block_bytes,
                caps: Caps::ALL,
            },
        })
    }
}

impl Device for NullDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn describe(&self) -> String {
        format!(
            "null {} bytes, {}-byte blocks",
            self.geometry.size_bytes, self.geometry.block_bytes
        )
    }

    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn extents(
        &self,
        _offset: u64,
        len: u64,
        out: &mut Vec<cairn_core::Extent>,
    ) -> Result<(), Error> {
        cairn_core::Extent::push(out, cairn_core::Extent::hole(len));
        Ok(())
    }

    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        Ok(Rc::new(NullQueue {
            core: core.clone(),
            stats: QueueStats::named_leaf(core.switches().stats, self.name()),
        }))
    }
}

struct NullQueue {
    core: Rc<Core>,
    stats: QueueStats,
}

impl Queue for NullQueue {
    #[inline]
    fn submit(&self, io: Io) {
        if io.op == Op::Read {
            // SAFETY: the submitter guarantees `buf` is valid for `len` bytes until the
            // completion is delivered, and nobody else touches it meanwhile.
            unsafe { std::ptr::write_bytes(io.buf, 0, io.len as usize) };
        }
        if self.stats.enabled() {
            let now = self.core.now_ns();
            self.stats.start(io.flags, now);
            self.stats.done(io.flags, io.op, io.len, now, now, true);
        }
        self.core.complete(io.sink, io.token, IoStatus::OK);
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }
}
