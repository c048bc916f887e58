//! What bounds a connection's memory and time: waiting for the server's memory budget,
//! giving an idle connection's input buffer back, and closing idle connections when the
//! connection slots run out (eviction).

use super::{
    Conn, ConnState, Next, RecvTarget, ServerLoop, CANCEL, RECV, TRIM_IDLE_NS, TRIM_TOKEN,
};

impl ServerLoop {
    /// The connection needs memory the budget does not have: it stops reading until some
    /// comes back (a release anywhere wakes this reactor).
    #[cold]
    pub(super) fn wait_memory(&self, conn: &Conn, st: &mut ConnState) -> Next {
        if !st.mem_wait {
            st.mem_wait = true;
            self.mem_waiting.borrow_mut().push(conn.index);
            self.mem.budget().waiting(self.reactor, self.mem.seen());
        }
        Next::Stop
    }

    /// Lets the connections waiting for memory try again if any came back; returns how
    /// many did.
    #[cold]
    pub(super) fn retry_memory(&self) -> usize {
        let budget = self.mem.budget();
        let now = budget.generation();
        if !self.mem.take_freed() && now == self.mem_retried_at.get() {
            return 0;
        }
        self.mem_retried_at.set(now);
        budget.retrying(self.reactor);
        let list = std::mem::take(&mut *self.mem_waiting.borrow_mut());
        let n = list.len();
        for ci in list {
            let Some(conn) = self.conn(ci) else { continue };
            {
                let mut st = conn.st.borrow_mut();
                st.mem_wait = false;
                self.mark_dirty(&conn, &mut st);
            }
            self.process(&conn);
        }
        n
    }

    /// Looks at the connections with wide input buffers in a second.
    pub(super) fn set_trim_timer(&self) {
        if !self.trim_timer.replace(true) && !self.shutting.get() {
            self.core.add_timer(
                self.core.now_ns() + TRIM_IDLE_NS,
                self.sink.get(),
                TRIM_TOKEN,
            );
        }
    }

    /// Gives back the input buffers of listed connections idle for `TRIM_IDLE_NS`: at
    /// once when no receive targets the buffer (a payload received directly), else once
    /// the receive in flight is cancelled (see `received`; on TLS, the ciphertext buffer
    /// goes back then too). Cold: at most once a second, and only while some
    /// connection's input buffer is wide.
    #[cold]
    pub(super) fn trim_idle(&self) {
        self.trim_timer.set(false);
        let now = self.core.now_ns();
        let listed = std::mem::take(&mut *self.wide.borrow_mut());
        let mut keep = Vec::new();
        for (index, id) in listed {
            let Some(conn) = self.conn(index) else {
                continue;
            };
            if conn.info.id != id {
                continue;
            }
            let mut st = conn.st.borrow_mut();
            let idle = st.in_flight == 0 && now.saturating_sub(st.progress_ns) >= TRIM_IDLE_NS;
            if !idle || st.rs != st.re || st.eof || st.dead {
                keep.push((index, id));
            } else if st.recv_armed && st.recv_target != RecvTarget::Payload {
                if !st.trimming {
                    st.trimming = true;
                    let cookie = u64::from(index) << 8;
                    self.core
                        .cancel_sqe(self.user.get(), cookie | RECV, cookie | CANCEL);
                }
                keep.push((index, id));
            } else {
                let touched = st.touched;
                st.inbuf.release(touched);
                (st.rs, st.re, st.touched, st.wide) = (0, 0, 0, false);
                log::debug!(
                    "cairn: serve: {}: idle: {} KiB of input buffer given back",
                    conn.peer,
                    touched >> 10
                );
            }
        }
        self.wide.borrow_mut().extend(keep);
        if !self.wide.borrow().is_empty() {
            self.set_trim_timer();
        }
    }

    /// Closes connection `id` in `slot` (see [`Msg::Evict`]).
    #[cold]
    pub(super) fn evict(&self, slot: u32, id: u64, idle: std::time::Duration, why: &'static str) {
        let Some(conn) = self.conn(slot) else { return };
        if conn.info.id != id {
            return;
        }
        let now = cairn_core::clock::monotonic_ns();
        let mut st = conn.st.borrow_mut();
        st.end(why);
        if conn.info.idle_for(now).is_some_and(|d| d >= idle) {
            st.dead = true;
        } else {
            st.eof = true;
        }
        self.mark_dirty(&conn, &mut st);
    }
}
