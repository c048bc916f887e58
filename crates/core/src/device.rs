//! Devices and queues.
//!
//! A [`Device`] is the shared, configured object (a file, a RAM disk, a stack). It opens
//! one [`Queue`] per reactor, the way SPDK opens an I/O channel per thread: all hot-path
//! state lives in the queue, so submitting never takes a lock or touches another thread.

use std::rc::Rc;
use std::sync::Arc;

use crate::capability::{Offer, Want};
use crate::error::{Error, IoError};
use crate::io::{Io, Op};
use crate::reactor::Core;
use crate::stats::QueueStats;

/// Largest read or write a single request may carry (1 GiB).
pub const MAX_IO_BYTES: u64 = 1 << 30;

/// Which optional operations a device supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Flush makes completed writes durable.
    pub flush: bool,
    /// Writes honour FUA.
    pub fua: bool,
    /// Discard is supported.
    pub discard: bool,
    /// Write-zeroes is supported.
    pub write_zeroes: bool,
}

impl Caps {
    /// Every operation supported.
    pub const ALL: Caps = Caps {
        flush: true,
        fua: true,
        discard: true,
        write_zeroes: true,
    };
}

/// Size, block size and capabilities: what every request is checked against at the edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Device size in bytes, a multiple of `block_bytes`.
    pub size_bytes: u64,
    /// Logical block size: offsets and lengths are multiples of it.
    pub block_bytes: u32,
    /// Optional operations.
    pub caps: Caps,
}

impl Geometry {
    /// Checks a request once, at the edge (a bench job, an NBD connection); devices below
    /// trust what reaches them.
    pub fn check(&self, op: Op, offset: u64, len: u64) -> Result<(), IoError> {
        let supported = match op {
            Op::Read | Op::Write => true,
            Op::Flush => true, // a device without a cache completes flush at once
            Op::Discard => self.caps.discard,
            Op::WriteZeroes => self.caps.write_zeroes,
        };
        if !supported {
            return Err(IoError::Unsupported(op));
        }
        if !op.has_range() {
            return Ok(());
        }
        if len == 0 || (op.has_data() && len > MAX_IO_BYTES) {
            return Err(IoError::BadLength { op, len });
        }
        let block = u64::from(self.block_bytes);
        if !offset.is_multiple_of(block) || !len.is_multiple_of(block) {
            return Err(IoError::Misaligned {
                op,
                offset,
                len,
                block: self.block_bytes,
            });
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.size_bytes => Ok(()),
            _ => Err(IoError::OutOfRange {
                op,
                offset,
                len,
                size: self.size_bytes,
            }),
        }
    }
}

/// What a device can say about writes it acknowledged that it may no longer hold
/// ([`Device::lost_writes`]): a remote device loses those acknowledged without FUA and not
/// yet flushed when its server restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LostWrites {
    /// None that it knows of: a flush that succeeds now makes every write it
    /// acknowledged durable.
    None,
    /// Some are on a connection not heard from since the server may have restarted: a
    /// flush that succeeds now does not vouch for them until the device has checked that
    /// connection (which it does by itself, soon).
    Unverified,
    /// Some were lost (their connection dropped before a flush covered them), and nobody
    /// has made up for them yet ([`Device::lost_writes_made_up`]).
    Lost,
}

/// A configured block device, shared by every reactor that uses it.
pub trait Device: Send + Sync {
    /// The device's name, as reports print it (e.g. `mem0`, `d1`).
    fn name(&self) -> &str;

    /// One line describing the device, e.g. `file /dev/shm/a engine=io_uring direct=0`.
    fn describe(&self) -> String;

    /// Size, block size and capabilities.
    fn geometry(&self) -> Geometry;

    /// Opens this device's queue on the reactor `core` (call on the reactor's own thread).
    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error>;

    /// For a wrapper, a device that passes every request to one device below it (a
    /// fault, delay or throttle device, a crypt device, a write-back cache, the dirty
    /// layer): that device. The defaults of [`Device::children`],
    /// [`Device::power_cut`], [`Device::power_cut_torn`],
    /// [`Device::coherent_across_queues`], [`Device::lost_writes`],
    /// [`Device::lost_writes_made_up`] and [`Device::read_only`] then answer as it does,
    /// so that no wrapper forgets one; a wrapper overrides only what it changes (a cache
    /// holds writes of its own that a power cut loses). [`Device::extents`] is not
    /// forwarded: a wrapper that changes the data (crypt) cannot vouch for the holes of
    /// the device below, so one that keeps the data says so itself. `None` for the rest.
    fn base(&self) -> Option<&Arc<dyn Device>> {
        None
    }

    /// Devices this one is built from, for printing the tree (the default: its
    /// [`Device::base`], if it has one).
    fn children(&self) -> Vec<Arc<dyn Device>> {
        self.base().into_iter().cloned().collect()
    }

    /// How `[offset, offset + len)` is allocated, as consecutive extents from `offset`
    /// (NBD's `base:allocation`). The extents may stop early (callers ask again) but never
    /// claim a hole or zeroes that are not there. The default: all data.
    fn extents(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        let _ = offset;
        out.push(Extent::data(len));
        Ok(())
    }

    /// Simulates a power cut: every write not yet made durable by a flush is lost (only
    /// volatile devices hold such writes; the default passes the cut to its base, or
    /// else to the children).
    fn power_cut(&self) {
        if let Some(base) = self.base() {
            return base.power_cut();
        }
        for c in self.children() {
            c.power_cut();
        }
    }

    /// A power cut that tears: of the writes not yet made durable, some pages reach the
    /// disk and some do not, as `seed` picks (volatile mem devices model it; the default
    /// passes the torn cut to its base, or else is a plain [`Device::power_cut`]).
    fn power_cut_torn(&self, seed: u64) {
        match self.base() {
            Some(base) => base.power_cut_torn(seed),
            None => self.power_cut(),
        }
    }

    /// Whether writes completed on one queue are seen by every other queue, and a flush
    /// on any queue makes them all durable (NBD's `CAN_MULTI_CONN` promise). The default:
    /// its base's answer, or else whether every child's is yes.
    fn coherent_across_queues(&self) -> bool {
        match self.base() {
            Some(base) => base.coherent_across_queues(),
            None => self.children().iter().all(|c| c.coherent_across_queues()),
        }
    }

    /// Whether this device may have lost writes it acknowledged (see [`LostWrites`]).
    /// Until a loss is made up for, the next flush on each queue fails with EIO (once per
    /// queue). The default: its base's answer, or [`LostWrites::None`] (devices that hand
    /// completed writes to a kernel or keep them in memory lose them only with power,
    /// which a flush reports).
    fn lost_writes(&self) -> LostWrites {
        self.base().map_or(LostWrites::None, |b| b.lost_writes())
    }

    /// Whoever uses this device has made up for every write it acknowledged until now and
    /// may have lost (an array re-adding a member copies to it again whatever it may have
    /// missed): losses of those writes, found now or later, are no longer reported. Writes
    /// acknowledged after this call are reported as before. The default tells its base,
    /// if it has one.
    fn lost_writes_made_up(&self) {
        if let Some(base) = self.base() {
            base.lost_writes_made_up();
        }
    }

    /// Whether writes are refused whatever the export says (a thin pool's snapshot, or a
    /// wrapper over one: the default is its base's answer, else false).
    fn read_only(&self) -> bool {
        self.base().is_some_and(|b| b.read_only())
    }

    /// The capabilities it offers beyond this trait (see [`crate::capability`]): for each
    /// trait it implements, `want.offer::<dyn Trait>(|| self)`, chained with `or_else`.
    /// The default offers none. A wrapper offers its own, not its base's: the base is a
    /// device of the tree in its own right, found there by whoever looks for it (unless
    /// the wrapper stands in for it under the same name, as the dirty layer does).
    fn offer(self: Arc<Self>, want: Want) -> Option<Offer> {
        let _ = want;
        None
    }
}

/// A run of bytes with one allocation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes.
    pub len: u64,
    /// No storage is allocated.
    pub hole: bool,
    /// Reads return zeroes.
    pub zero: bool,
}

impl Extent {
    /// Allocated data.
    pub fn data(len: u64) -> Extent {
        Extent {
            len,
            hole: false,
            zero: false,
        }
    }

    /// Allocated storage that reads as zeroes (a write-zeroes with `NO_HOLE`).
    pub fn allocated_zero(len: u64) -> Extent {
        Extent {
            len,
            hole: false,
            zero: true,
        }
    }

    /// A hole that reads as zeroes.
    pub fn hole(len: u64) -> Extent {
        Extent {
            len,
            hole: true,
            zero: true,
        }
    }

    /// Appends to `out`, merging with the last extent when the state is the same.
    pub fn push(out: &mut Vec<Extent>, e: Extent) {
        if e.len == 0 {
            return;
        }
        match out.last_mut() {
            Some(last) if last.hole == e.hole && last.zero == e.zero => last.len += e.len,
            _ => out.push(e),
        }
    }
}

/// One device's submission path on one reactor.
pub trait Queue {
    /// Starts a request that has passed [`Geometry::check`]. It never completes inside this
    /// call: the completion is delivered through the reactor's FIFO to `io.sink`.
    fn submit(&self, io: Io);

    /// This queue's statistics.
    fn stats(&self) -> &QueueStats;

    /// Queues of the devices below this one (for per-device statistics).
    fn children(&self) -> Vec<Rc<dyn Queue>> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo() -> Geometry {
        Geometry {
            size_bytes: 1 << 20,
            block_bytes: 512,
            caps: Caps::ALL,
        }
    }

    #[test]
    fn accepts_in_range() {
        assert_eq!(geo().check(Op::Read, 0, 4096), Ok(()));
        assert_eq!(geo().check(Op::Write, (1 << 20) - 512, 512), Ok(()));
        assert_eq!(geo().check(Op::Flush, 12345, 0), Ok(()));
    }

    #[test]
    fn refuses_bad_requests() {
        let g = geo();
        assert!(matches!(
            g.check(Op::Read, 1, 512),
            Err(IoError::Misaligned { .. })
        ));
        assert!(matches!(
            g.check(Op::Read, 0, 100),
            Err(IoError::Misaligned { .. })
        ));
        assert!(matches!(
            g.check(Op::Read, 0, 0),
            Err(IoError::BadLength { .. })
        ));
        assert!(matches!(
            g.check(Op::Write, 1 << 20, 512),
            Err(IoError::OutOfRange { .. })
        ));
        assert!(matches!(
            g.check(Op::Read, u64::MAX - 511, 512),
            Err(IoError::OutOfRange { .. })
        ));
        assert_eq!(
            g.check(Op::Write, 1 << 20, 512).unwrap_err().errno(),
            libc::ENOSPC
        );
        assert_eq!(
            g.check(Op::Read, 1 << 20, 512).unwrap_err().errno(),
            libc::EINVAL
        );
        let nodiscard = Geometry {
            caps: Caps {
                discard: false,
                ..Caps::ALL
            },
            ..g
        };
        assert_eq!(
            nodiscard.check(Op::Discard, 0, 512),
            Err(IoError::Unsupported(Op::Discard))
        );
    }
}
