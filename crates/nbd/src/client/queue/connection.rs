//! A queue's connections coming and going: one installed (at open, or from the connector
//! thread, with backoff when they keep dropping), one given up (shut down) and then reset
//! once its SQEs are done, its unanswered requests sent again elsewhere or later; and the
//! queue's side of the `ledger`: what it publishes, and the flushes of its own that
//! verify connections holding unflushed writes after a turnover.

use std::sync::atomic::Ordering;
use std::time::Duration;

use cairn_core::{Io, Op};

use crate::client::handshake::Connected;
use crate::tls_send::TlsOut;

use super::super::connect::connector;
use super::super::{Idle, BACKOFF_MAX, CONNECTIONS_MAX};
use super::{ClientTls, IoSlot, Link, NbdQueue, Rx, State, NO_CONN, RAW_IN, VERIFY};

impl NbdQueue {
    /// A new queue's connections: kept ones first (the device's first, or those of a
    /// closed queue), then new ones; a server that is down now leaves the queue
    /// reconnecting in the background (requests wait up to the timeout).
    pub(super) fn connect_all(&self, st: &mut State) {
        let now = self.core.now_ns();
        for i in 0..st.conns.len() {
            let kept = self
                .shared
                .idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop();
            let got = match kept {
                Some(c) => Ok(c),
                None => self.shared.connect().map(|made| Idle {
                    made,
                    unflushed: None,
                }),
            };
            match got {
                Ok(c) => self.install(st, i, c, now),
                Err(e) => {
                    log::warn!(
                        "cairn: {}: cannot connect to {}: {e}; retrying in the background",
                        self.shared.name,
                        self.shared.uri_text
                    );
                    break;
                }
            }
        }
        if st.conns.iter().all(|c| c.link != Link::Up) {
            st.down_since = Some(now);
            st.down_connects = self.shared.ledger.connects.load(Ordering::SeqCst);
        }
        self.start_connector(st);
    }

    pub(super) fn install(&self, st: &mut State, ci: usize, idle: Idle, now: u64) {
        let Idle { made, unflushed } = idle;
        // Requests sent from now on carry a turnover no older than this connection.
        st.era = self.shared.ledger.era.load(Ordering::SeqCst);
        st.turnover = self.shared.ledger.turnover.load(Ordering::SeqCst);
        let c = &mut st.conns[ci];
        debug_assert!(c.link == Link::Down);
        c.fd = Some(made.fd);
        c.extended = made.neg.extended;
        c.tls = made.tls.map(|mut conn| {
            // What is buffered is bounded here (TLS_BATCH a send), not by rustls.
            conn.set_buffer_limit(None);
            Box::new(ClientTls {
                conn,
                raw_in: vec![0u8; RAW_IN].into_boxed_slice(),
                raw_pos: 0,
                raw_len: 0,
                out: TlsOut::with_capacity(RAW_IN),
            })
        });
        c.link = Link::Up;
        c.rs = 0;
        c.re = 0;
        c.rx = Rx::Header;
        c.out.clear();
        c.out_sent = 0;
        c.outstanding = 0;
        c.progress_ns = now;
        // Writes a closed queue left unflushed on it are owed still.
        c.acked_writes = u64::from(unflushed.is_some());
        c.flushed_writes = 0;
        c.unflushed_era = unflushed.map_or(0, |u| u.era);
        c.heard = unflushed.map_or(0, |u| u.heard);
        c.verifying = false;
        c.why = "";
        st.down_since = None;
        self.publish(st);
        // Requests that waited for a connection go first, in their order.
        while let Some(slot) = st.parked.pop_front() {
            st.ios[slot as usize].conn = ci as u16;
            st.conns[ci].ready.push_back(slot);
        }
        self.issue(st, ci);
    }

    /// A connection from the connector thread.
    pub(super) fn connected(&self, st: &mut State, made: Connected) {
        let Some(ci) = st.conns.iter().position(|c| c.link == Link::Down) else {
            // More than needed: keep it for a later queue.
            self.keep(made);
            return;
        };
        log::info!(
            "cairn: {}: connected to {} again",
            self.shared.name,
            self.shared.uri_text
        );
        self.shared.reconnects.fetch_add(1, Ordering::Relaxed);
        // A server that drops every connection soon after it is made is not hammered:
        // the next attempt waits longer each time, until one lasts a while.
        let now = self.core.now_ns();
        st.backoff = if now.saturating_sub(st.connected_ns) < 1_000_000_000 {
            (st.backoff * 2).clamp(Duration::from_millis(50), BACKOFF_MAX)
        } else {
            Duration::ZERO
        };
        st.connected_ns = now;
        self.install(
            st,
            ci,
            Idle {
                made,
                unflushed: None,
            },
            now,
        );
    }

    pub(super) fn keep(&self, made: Connected) {
        let mut idle = self.shared.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < 2 * CONNECTIONS_MAX as usize {
            idle.push(Idle {
                made,
                unflushed: None,
            });
        }
    }

    /// Starts a thread that makes connections until every one is up (if none runs).
    pub(super) fn start_connector(&self, st: &mut State) {
        let missing = st.conns.iter().filter(|c| c.link == Link::Down).count();
        if st.connecting || missing == 0 {
            return;
        }
        st.connecting = true;
        let shared = self.shared.clone();
        let tx = self.tx.clone();
        let wake = self.wake.clone();
        let stop = self.stop.clone();
        let first_delay = st.backoff;
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-connect-{}", shared.name))
            .spawn(move || {
                cairn_core::reactor::block_signals_in_this_thread();
                connector(&shared, missing, first_delay, &tx, &wake, &stop);
            });
        if let Err(e) = spawned {
            log::error!(
                "cairn: {}: cannot start a thread to reconnect: {e}",
                self.shared.name
            );
            st.connecting = false;
        }
    }

    /// Gives up connection `ci`: its socket is shut down, and once its receive and send
    /// have finished it is reset (see `reset`).
    pub(super) fn kill(&self, st: &mut State, ci: usize, why: &'static str) {
        let c = &mut st.conns[ci];
        if c.link != Link::Up {
            return;
        }
        log::warn!(
            "cairn: {}: connection to {} lost ({why}); {} request{} outstanding",
            self.shared.name,
            self.shared.uri_text,
            c.outstanding,
            if c.outstanding == 1 { "" } else { "s" }
        );
        c.link = Link::Dying;
        c.why = why;
        if let Some(fd) = &c.fd {
            let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
        }
        self.mark_dirty(st, ci);
    }

    /// A dead connection whose SQEs have all finished: close it, and retry or fail what
    /// was on it.
    pub(super) fn reset(&self, st: &mut State, ci: usize) {
        let now = self.core.now_ns();
        self.close_conn(st, ci);
        self.publish(st);
        // The server may have restarted: every queue looks at its other connections.
        self.shared.ledger.turn();
        self.requeue(st, ci);
        if st.conns.iter().all(|c| c.link != Link::Up) && st.down_since.is_none() {
            st.down_since = Some(now);
            st.down_connects = self.shared.ledger.connects.load(Ordering::SeqCst);
        }
        // Requests go to another connection if one is up, else wait for the reconnect.
        let parked: Vec<u32> = st.parked.drain(..).collect();
        for slot in parked {
            self.route(st, slot);
        }
        self.start_connector(st);
        self.arm_tick(st);
    }

    /// Closes connection `ci` and empties its buffers. Writes it acknowledged that no
    /// flush covered may be lost: the ledger counts the loss.
    fn close_conn(&self, st: &mut State, ci: usize) {
        let c = &mut st.conns[ci];
        c.fd = None;
        c.tls = None;
        c.link = Link::Down;
        c.out.clear();
        c.out_sent = 0;
        c.rs = 0;
        c.re = 0;
        c.rx = Rx::Header;
        c.outstanding = 0;
        c.ready.clear();
        c.verifying = false;
        if c.acked_writes > c.flushed_writes && self.shared.geometry.caps.flush {
            let n = c.acked_writes - c.flushed_writes;
            if self.shared.ledger.lost(c.unflushed_era) {
                log::warn!(
                    "cairn: {}: the connection to {} that was lost held writes acknowledged but not flushed ({n} or fewer): they may be lost, and the next flush fails",
                    self.shared.name,
                    self.shared.uri_text
                );
            } else {
                log::info!(
                    "cairn: {}: the connection to {} that was lost held writes acknowledged but not flushed ({n} or fewer), made up for already",
                    self.shared.name,
                    self.shared.uri_text
                );
            }
        }
        c.acked_writes = 0;
        c.flushed_writes = 0;
    }

    /// What was on connection `ci` once it is closed: its NBD requests free; the queue's
    /// own flushes on it done, requests the server broke the protocol answering failed,
    /// and every other request parked, oldest first, to be sent again.
    fn requeue(&self, st: &mut State, ci: usize) {
        for r in 0..st.reqs.len() {
            let q = &mut st.reqs[r];
            if q.in_use && q.conn == ci as u16 {
                q.in_use = false;
                q.gen = q.gen.wrapping_add(1);
                st.free_reqs.push(r as u32);
            }
        }
        for slot in 0..st.ios.len() as u32 {
            let s = &mut st.ios[slot as usize];
            if !s.in_use || s.conn != ci as u16 {
                continue;
            }
            if s.internal {
                // The connection it checked is gone: the loss is counted already.
                self.finish(st, slot, 0);
                continue;
            }
            if s.poisoned {
                self.finish(st, slot, libc::EIO);
                continue;
            }
            // Not acknowledged: safe to send again, from the start. A flush too: if the
            // connection held unflushed writes, the loss is counted, and the flush fails
            // when it is done unless the loss was made up for.
            s.next = 0;
            s.outstanding = 0;
            s.error = 0;
            s.tail_flush = self.ends_with_flush(&s.io);
            s.conn = NO_CONN;
            st.parked.push_back(slot);
        }
        let ios = &st.ios;
        st.parked
            .make_contiguous()
            .sort_by_key(|&s| ios[s as usize].start_ns);
    }

    /// Stores in the queue's watch the oldest turnover at which a connection holding
    /// unflushed writes was heard from (see [`Ledger`]), if that changed.
    pub(super) fn publish(&self, st: &mut State) {
        let v = st
            .conns
            .iter()
            .filter(|c| c.owes())
            .map(|c| c.heard + 1)
            .min()
            .unwrap_or(0);
        if v != st.published {
            st.published = v;
            self.watch.unflushed.store(v, Ordering::Release);
            if v != 0 {
                // The tick looks for turnovers while writes are owed (see `verify`).
                self.arm_tick(st);
            }
        }
    }

    /// Sends a flush of the queue's own on each connection that holds unflushed writes
    /// and was not heard from since the latest turnover: it makes them durable, or finds
    /// the connection dead (a loss). Runs at each reap (each pass of an eager reactor, or
    /// a wake-up while connecting) and at each tick, which stays armed while writes are
    /// owed: an idle queue finds out within a tick.
    pub(super) fn verify(&self, st: &mut State) {
        if st.published == 0 || !self.shared.geometry.caps.flush {
            return;
        }
        let now = self.shared.ledger.turnover.load(Ordering::SeqCst);
        // `published` is 1 + the oldest turnover heard at: every one heard since.
        if st.published > now {
            return;
        }
        // Its reply proves the connection alive at this turnover.
        st.turnover = now;
        for ci in 0..st.conns.len() {
            let c = &st.conns[ci];
            if c.link != Link::Up || !c.owes() || c.heard >= now || c.verifying {
                continue;
            }
            let Some(slot) = st.free_ios.pop() else {
                // Every slot is busy: their replies will tell (and the next wake-up).
                return;
            };
            st.ios[slot as usize] = IoSlot {
                io: Io::nodata(Op::Flush, 0, 0, self.sink.get(), VERIFY),
                start_ns: self.core.now_ns(),
                conn: ci as u16,
                next: 0,
                tail_flush: true,
                outstanding: 0,
                error: 0,
                poisoned: false,
                internal: true,
                in_use: true,
            };
            st.conns[ci].verifying = true;
            st.conns[ci].ready.push_back(slot);
            self.issue(st, ci);
        }
        self.arm_tick(st);
    }
}
