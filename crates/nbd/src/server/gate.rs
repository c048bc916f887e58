//! Requests that are not aligned to the device's blocks, from clients that never asked for
//! block sizes, are widened to whole blocks ([`Wide`](crate::proto::command::Wide)); here
//! is the gate that orders the read-modify-writes they need against every other write to
//! the same blocks.
//!
//! A read-modify-write (RMW) reads the partly covered blocks at its edges, lays the new
//! bytes over them and writes the blocks back whole. Anything else that writes one of those
//! blocks between the read and the write would be undone by it, although its bytes did not
//! overlap the RMW's. So an export that may see unaligned requests keeps a [`Gate`]:
//!
//! - An RMW takes a ticket for its widened range and starts once no earlier ticket
//!   overlaps it and every write that started without a ticket has ended.
//! - While no RMW holds or waits for a ticket (the common case, and always for clients
//!   that negotiated block sizes), a write, trim or write-zeroes takes no ticket: it adds
//!   one to its reactor's counter and checks one flag. That is the whole cost of the gate
//!   to aligned I/O: no lock, no shared cache line written.
//! - While an RMW is active, writes take tickets too (under the gate's mutex) and wait
//!   only for earlier RMW tickets that overlap them. Tickets are served in order, so
//!   neither side starves.
//!
//! Reads take no part: an RMW writes back the bytes it read, so a read of a block being
//! rewritten sees either the old or the new content of each byte.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A counter on its own cache line, written by one reactor.
#[repr(align(64))]
#[derive(Default)]
struct Padded(AtomicU32);

/// One ticket: a range that an RMW or, while RMWs are active, a write has claimed.
#[derive(Debug)]
struct Ticket {
    id: u64,
    start: u64,
    end: u64,
    rmw: bool,
}

/// How a write was let through the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Pass {
    /// Not through a gate (a read, or an export with strict alignment).
    #[default]
    None,
    /// Counted on its reactor, without a ticket.
    Counted,
    /// With this ticket.
    Ticket(u64),
}

/// Orders read-modify-writes against the other writes of one export, on every reactor.
pub(crate) struct Gate {
    /// RMWs holding a ticket: while not 0, writes take tickets.
    rmws: AtomicU32,
    /// Per reactor: writes in flight that passed without a ticket.
    counted: Box<[Padded]>,
    tickets: Mutex<Vec<Ticket>>,
    next_id: AtomicU64,
    wake: Arc<Wake>,
}

impl Gate {
    /// A gate for an export served on `reactors` reactors.
    pub fn new(reactors: usize, wake: Arc<Wake>) -> Gate {
        Gate {
            rmws: AtomicU32::new(0),
            counted: (0..reactors).map(|_| Padded::default()).collect(),
            tickets: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            wake,
        }
    }

    /// A write of `start..end` wants to start on reactor `me`. Either it is counted and
    /// goes ahead, or it gets a ticket to wait on with [`Gate::ready`].
    #[inline]
    pub fn write(&self, me: usize, start: u64, end: u64) -> Pass {
        // Counted first, then the flag: an RMW sets the flag first, then reads the
        // counters. Sequentially consistent on both sides, so one sees the other.
        self.counted[me].0.fetch_add(1, Ordering::SeqCst);
        if self.rmws.load(Ordering::SeqCst) == 0 {
            return Pass::Counted;
        }
        self.ticketed_write(me, start, end)
    }

    #[cold]
    fn ticketed_write(&self, me: usize, start: u64, end: u64) -> Pass {
        self.counted[me].0.fetch_sub(1, Ordering::SeqCst);
        // An RMW may be waiting for this counter.
        self.wake.notify();
        Pass::Ticket(self.ticket(start, end, false))
    }

    /// Takes a ticket for an RMW of `start..end`; wait for it with [`Gate::ready`].
    pub fn rmw(&self, start: u64, end: u64) -> u64 {
        self.rmws.fetch_add(1, Ordering::SeqCst);
        self.ticket(start, end, true)
    }

    fn ticket(&self, start: u64, end: u64, rmw: bool) -> u64 {
        let mut t = self.tickets.lock().unwrap_or_else(|e| e.into_inner());
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        t.push(Ticket {
            id,
            start,
            end,
            rmw,
        });
        id
    }

    /// Whether ticket `id` may start: no earlier ticket overlaps it where either is an
    /// RMW, and, for an RMW, no counted write is in flight on any reactor.
    pub fn ready(&self, id: u64) -> bool {
        let t = self.tickets.lock().unwrap_or_else(|e| e.into_inner());
        let Some(me) = t.iter().find(|x| x.id == id) else {
            return true;
        };
        let blocked = t
            .iter()
            .any(|x| x.id < id && (x.rmw || me.rmw) && x.start < me.end && me.start < x.end);
        if blocked {
            return false;
        }
        !me.rmw || self.counted.iter().all(|c| c.0.load(Ordering::SeqCst) == 0)
    }

    /// The write or RMW that passed with `pass` on reactor `me` has ended.
    #[inline]
    pub fn done(&self, me: usize, pass: Pass) {
        match pass {
            Pass::None => {}
            Pass::Counted => {
                self.counted[me].0.fetch_sub(1, Ordering::SeqCst);
                if self.rmws.load(Ordering::SeqCst) != 0 {
                    self.wake.notify();
                }
            }
            Pass::Ticket(id) => self.release(id),
        }
    }

    #[cold]
    fn release(&self, id: u64) {
        let mut t = self.tickets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = t.iter().position(|x| x.id == id) {
            if t.swap_remove(i).rmw {
                self.rmws.fetch_sub(1, Ordering::SeqCst);
            }
        }
        drop(t);
        self.wake.notify();
    }
}

/// Wakes the reactors that hold requests waiting at a gate, whenever a gate opens a bit.
pub(crate) struct Wake {
    /// Bumped by every release; a reactor retries its waiting requests when it changed.
    gen: AtomicU64,
    /// Per reactor: holds waiting requests.
    waiting: Box<[AtomicBool]>,
    /// Per reactor: its eventfd.
    fds: Box<[Arc<OwnedFd>]>,
}

impl Wake {
    /// Wakes through the reactors' eventfds.
    pub fn new(fds: Vec<Arc<OwnedFd>>) -> Wake {
        Wake {
            gen: AtomicU64::new(0),
            waiting: fds.iter().map(|_| AtomicBool::new(false)).collect(),
            fds: fds.into_boxed_slice(),
        }
    }

    /// The current generation: read it before checking whether a request may start.
    pub fn generation(&self) -> u64 {
        self.gen.load(Ordering::SeqCst)
    }

    /// Something was released: every reactor with waiting requests retries them.
    pub fn notify(&self) {
        self.gen.fetch_add(1, Ordering::SeqCst);
        for (w, fd) in self.waiting.iter().zip(self.fds.iter()) {
            if w.load(Ordering::SeqCst) {
                cairn_core::event::wake(&**fd);
            }
        }
    }

    /// Reactor `me` holds waiting requests, which it checked at generation `seen`. If a
    /// release came since, it wakes itself to check again.
    pub fn waiting(&self, me: usize, seen: u64) {
        self.waiting[me].store(true, Ordering::SeqCst);
        if self.generation() != seen {
            cairn_core::event::wake(&*self.fds[me]);
        }
    }

    /// Reactor `me` is about to retry every waiting request.
    pub fn retrying(&self, me: usize) {
        self.waiting[me].store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wake(n: usize) -> Arc<Wake> {
        Arc::new(Wake::new(
            (0..n)
                .map(|_| cairn_core::event::eventfd("test").unwrap())
                .collect(),
        ))
    }

    #[test]
    fn writes_pass_counted_until_an_rmw_arrives() {
        let g = Gate::new(2, wake(2));
        assert_eq!(g.write(0, 0, 4096), Pass::Counted);
        assert_eq!(g.write(1, 8192, 12288), Pass::Counted);
        let r = g.rmw(0, 4096);
        // Counted writes are in flight: the RMW waits for them, whatever their range.
        assert!(!g.ready(r));
        g.done(0, Pass::Counted);
        assert!(!g.ready(r));
        g.done(1, Pass::Counted);
        assert!(g.ready(r));
        // Now writes take tickets; one overlapping the RMW waits, another does not.
        let Pass::Ticket(a) = g.write(0, 0, 512) else {
            panic!("no ticket")
        };
        let Pass::Ticket(b) = g.write(1, 4096, 8192) else {
            panic!("no ticket")
        };
        assert!(!g.ready(a));
        assert!(g.ready(b));
        // A second RMW on the same block waits for the first and for the write before it.
        let r2 = g.rmw(100, 200);
        assert!(!g.ready(r2));
        g.done(0, Pass::Ticket(r));
        assert!(g.ready(a));
        assert!(!g.ready(r2));
        g.done(0, Pass::Ticket(a));
        assert!(g.ready(r2));
        g.done(1, Pass::Ticket(b));
        g.done(0, Pass::Ticket(r2));
        // No RMW left: counted again.
        assert_eq!(g.write(0, 0, 4096), Pass::Counted);
    }

    #[test]
    fn rmws_on_other_blocks_run_together() {
        let g = Gate::new(1, wake(1));
        let a = g.rmw(0, 4096);
        let b = g.rmw(4096, 8192);
        let c = g.rmw(4000, 4100);
        assert!(g.ready(a) && g.ready(b));
        assert!(!g.ready(c));
        g.done(0, Pass::Ticket(a));
        assert!(!g.ready(c));
        g.done(0, Pass::Ticket(b));
        assert!(g.ready(c));
    }

    #[test]
    fn a_release_wakes_waiting_reactors() {
        let w = wake(2);
        let g = Gate::new(2, w.clone());
        let r = g.rmw(0, 4096);
        let seen = w.generation();
        let Pass::Ticket(t) = g.write(1, 0, 4096) else {
            panic!("no ticket")
        };
        assert!(!g.ready(t));
        // The write's own pass bumped the generation: reactor 1 wakes itself at once.
        w.waiting(1, seen);
        assert!(fired(&w.fds[1]));
        let seen = w.generation();
        w.waiting(1, seen);
        assert!(!fired(&w.fds[1]));
        g.done(0, Pass::Ticket(r));
        assert!(fired(&w.fds[1]));
        assert!(!fired(&w.fds[0]));
        assert!(g.ready(t));
    }

    /// Whether the eventfd fired (and resets it).
    fn fired(fd: &OwnedFd) -> bool {
        let mut value = [0u8; 8];
        rustix::io::read(fd, &mut value).is_ok_and(|n| n == 8 && u64::from_ne_bytes(value) > 0)
    }
}
