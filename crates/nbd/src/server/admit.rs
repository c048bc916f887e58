//! Who may connect: a limit on connections in total and per client address, and the
//! choice of an idle connection to close when a slot is needed (see [`victim`]).
//!
//! Connections are counted from `accept` (handshakes included) until they close. Only the
//! accepting thread adds; any thread may take away (a handshake that fails, a reactor
//! closing a connection), so a check followed by an add never overshoots. The lock is
//! taken once per connection, never per request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::server::conn::Msg;
use crate::server::observe::{Client, ConnInfo};
use crate::server::{Config, Shared};

/// Connection counts against their limits.
pub(crate) struct Admission {
    max_total: usize,
    max_per_client: usize,
    live: AtomicUsize,
    per_client: Mutex<HashMap<Client, usize>>,
}

/// Why a connection cannot be admitted as things stand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Full {
    /// `--max-connections` connections are open.
    Total,
    /// The client's address holds `--max-connections-per-address` of them.
    Client,
}

impl Admission {
    pub fn new(max_total: usize, max_per_client: usize) -> Admission {
        Admission {
            max_total,
            max_per_client,
            live: AtomicUsize::new(0),
            per_client: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Client, usize>> {
        self.per_client.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `client` may connect now (called by the accepting thread only).
    pub fn check(&self, client: Client) -> Result<(), Full> {
        if self.lock().get(&client).copied().unwrap_or(0) >= self.max_per_client {
            return Err(Full::Client);
        }
        if self.live.load(Ordering::SeqCst) >= self.max_total {
            return Err(Full::Total);
        }
        Ok(())
    }

    /// Counts a connection of `client` (after [`Admission::check`], or past the limit
    /// when an idle connection is on its way out to make room).
    pub fn enter(&self, client: Client) {
        *self.lock().entry(client).or_insert(0) += 1;
        self.live.fetch_add(1, Ordering::SeqCst);
    }

    /// A connection of `client` ended.
    pub fn leave(&self, client: Client) {
        let mut per = self.lock();
        if let Some(n) = per.get_mut(&client) {
            *n -= 1;
            if *n == 0 {
                per.remove(&client);
            }
        }
        drop(per);
        self.live.fetch_sub(1, Ordering::SeqCst);
    }

    /// Connections open now, handshakes included.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// Connections of `client` open now.
    #[cfg(test)]
    pub fn of(&self, client: Client) -> usize {
        self.lock().get(&client).copied().unwrap_or(0)
    }
}

/// How long a connection must have been idle to give up its slot to a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Patience {
    /// A quiet connection: no request of it at the device, none partly received, no
    /// reply waiting to be read (`--evict-idle-after`, or `--idle-timeout` if shorter).
    pub quiet: Option<Duration>,
    /// One in the middle of a request or reply, however slowly it moves
    /// (`--idle-timeout`): a slow transfer is not cut short by a newcomer.
    pub moving: Option<Duration>,
}

impl Patience {
    /// How long `c` must have been idle.
    pub fn of(&self, c: &ConnInfo) -> Option<Duration> {
        if c.in_transfer() {
            self.moving
        } else {
            self.quiet
        }
    }
}

/// Of `conns`, the connection to close so that a new one can be served: one idle for as
/// long as `patience` asks at `now_ns` (nothing of it at the device), not being evicted
/// already. With `only`, the longest idle of that client's connections (its per-address
/// limit was met). Else (the server is full) the client holding the most connections
/// gives one up, its longest idle: a client that fills the server with idle connections
/// evicts its own before anyone else's, and among clients holding as many, the longest
/// idle goes first.
pub(crate) fn victim(
    conns: &[Arc<ConnInfo>],
    now_ns: u64,
    patience: Patience,
    only: Option<Client>,
) -> Option<(&ConnInfo, Duration)> {
    let live = || conns.iter().filter(|c| !c.evicting.load(Ordering::Relaxed));
    let mut held: HashMap<Client, usize> = HashMap::new();
    if only.is_none() {
        for c in live() {
            *held.entry(c.client).or_insert(0) += 1;
        }
    }
    live()
        .filter(|c| only.is_none_or(|o| c.client == o))
        .filter_map(|c| Some((&**c, c.idle_for(now_ns)?)))
        .filter(|(c, idle)| patience.of(c).is_some_and(|p| *idle >= p))
        .max_by_key(|(c, idle)| (held.get(&c.client).copied().unwrap_or(0), *idle))
}

/// Whether a new connection from `client` may be served; if so it is counted. At a limit,
/// an idle connection is closed to make room (see [`crate::server::admit::victim`]): a quiet one
/// idle for `--evict-idle-after` (or `--idle-timeout`, if shorter), one in the middle of
/// a request or reply idle for `--idle-timeout`; else the new one is refused.
pub(super) fn admit(config: &Config, shared: &Shared, peer: &str, client: Client) -> bool {
    let adm = &shared.admission;
    let full = match adm.check(client) {
        Ok(()) => {
            adm.enter(client);
            return true;
        }
        Err(full) => full,
    };
    let (only, limit, flag) = match full {
        Full::Client => (
            Some(client),
            format!(
                "{} connections from {client} already",
                config.max_connections_per_address
            ),
            "--max-connections-per-address",
        ),
        Full::Total => (
            None,
            format!("{} connections already", config.max_connections),
            "--max-connections",
        ),
    };
    let patience = Patience {
        quiet: match (config.evict_idle_after, config.idle_timeout) {
            (Some(e), Some(t)) => Some(e.min(t)),
            (e, t) => e.or(t),
        },
        moving: config.idle_timeout,
    };
    let conns = config.observer.connections();
    let now = cairn_core::clock::monotonic_ns();
    if let Some((victim, idle)) = victim(&conns, now, patience, only) {
        // The rule that let it go: the short one for a quiet connection (unless the idle
        // timeout is shorter still), the idle timeout for one in mid-transfer.
        let need = patience.of(victim).unwrap_or_default();
        let (rule, why) = if Some(need) == config.idle_timeout {
            (
                "--idle-timeout",
                "closed: idle past --idle-timeout, its slot was needed",
            )
        } else {
            (
                "--evict-idle-after",
                "closed: idle for --evict-idle-after, its slot was needed",
            )
        };
        log::info!(
            "cairn: serve: {peer}: {limit} ({flag}): closing {} (idle {:.0} s, over {rule}) to make room",
            victim.peer,
            idle.as_secs_f64()
        );
        evict(shared, victim, need, why);
        adm.enter(client);
        return true;
    }
    log::warn!("cairn: serve: {peer}: refused, {limit} ({flag})");
    false
}

/// Asks the reactor of `victim` to close it (see [`Msg::Evict`]).
fn evict(
    shared: &Shared,
    victim: &crate::server::observe::ConnInfo,
    idle: Duration,
    why: &'static str,
) {
    victim.evicting.store(true, Ordering::Relaxed);
    if let Some((tx, w)) = shared.reactors.get(victim.reactor) {
        let msg = Msg::Evict {
            slot: victim.slot,
            id: victim.id,
            idle,
            why,
        };
        if tx.send(msg).is_ok() {
            cairn_core::event::wake(&**w);
        }
    }
}

/// Closes every connection idle for `timeout`: with `--idle-close`, or (`holding`) those
/// that hold buffer memory while other connections wait for it.
pub(super) fn close_idle(
    observer: &crate::Observer,
    shared: &Shared,
    timeout: Duration,
    holding: bool,
) {
    let now = cairn_core::clock::monotonic_ns();
    for c in observer.connections() {
        if c.evicting.load(Ordering::Relaxed)
            || c.idle_for(now).is_none_or(|d| d < timeout)
            || (holding && c.held() == 0)
        {
            continue;
        }
        let why = if holding {
            log::info!(
                "cairn: serve: {}: closing, idle for {:?} (--idle-timeout) with {} bytes of buffers that other connections wait for (--memory-budget)",
                c.peer,
                timeout,
                c.held()
            );
            "closed: idle past --idle-timeout, holding memory others waited for"
        } else {
            log::info!(
                "cairn: serve: {}: closing, idle for {:?} (--idle-timeout, --idle-close)",
                c.peer,
                timeout
            );
            "closed: idle for --idle-timeout (--idle-close)"
        };
        evict(shared, &c, timeout, why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::observe::Observer;

    /// The same patience with every connection.
    fn each(d: Duration) -> Patience {
        Patience {
            quiet: Some(d),
            moving: Some(d),
        }
    }

    #[test]
    fn limits_per_client_and_in_total() {
        let a = Client::Ip([10, 0, 0, 1].into());
        let b = Client::Ip([10, 0, 0, 2].into());
        let adm = Admission::new(3, 2);
        for _ in 0..2 {
            assert_eq!(adm.check(a), Ok(()));
            adm.enter(a);
        }
        assert_eq!(adm.check(a), Err(Full::Client));
        assert_eq!(adm.check(b), Ok(()));
        adm.enter(b);
        assert_eq!(adm.check(b), Err(Full::Total));
        assert_eq!((adm.live(), adm.of(a), adm.of(b)), (3, 2, 1));
        adm.leave(a);
        assert_eq!(adm.check(a), Ok(()));
        adm.leave(b);
        adm.leave(a);
        assert_eq!((adm.live(), adm.of(a), adm.of(b)), (0, 0, 0));
    }

    #[test]
    fn the_longest_idle_connection_is_chosen_and_busy_ones_never() {
        let o = Observer::default();
        let a = Client::Ip([10, 0, 0, 1].into());
        let b = Client::Uid(0);
        let x = o.open(("10.0.0.1:1", a), "", false, "simple", (0, 0));
        let y = o.open(("unix", b), "", false, "simple", (0, 1));
        let z = o.open(("10.0.0.1:2", a), "", false, "simple", (1, 0));
        let s = 1_000_000_000u64;
        x.active(false, 10 * s);
        y.active(false, 5 * s);
        z.active(true, 0);
        let conns = o.connections();
        let sec = Duration::from_secs(1);
        let (c, idle) = victim(&conns, 20 * s, each(sec), Some(b)).unwrap();
        assert_eq!((c.id, idle), (y.id, 15 * sec));
        let (c, _) = victim(&conns, 20 * s, each(sec), Some(a)).unwrap();
        assert_eq!(c.id, x.id);
        // Not idle long enough; busy; chosen already.
        assert!(victim(&conns, 20 * s, each(16 * sec), None).is_none());
        x.evicting.store(true, Ordering::Relaxed);
        assert!(victim(&conns, 20 * s, each(sec), Some(a)).is_none());
        z.active(false, 19 * s);
        assert_eq!(
            victim(&conns, 20 * s, each(sec), Some(a)).unwrap().0.id,
            z.id
        );
    }

    #[test]
    fn a_full_server_takes_from_the_client_holding_the_most_connections() {
        let o = Observer::default();
        let (a, b, c) = (
            Client::Ip([10, 0, 0, 1].into()),
            Client::Ip([10, 0, 0, 2].into()),
            Client::Ip([10, 0, 0, 3].into()),
        );
        let s = 1_000_000_000u64;
        let sec = Duration::from_secs(1);
        // b's connection has been idle longest; a holds three, c two.
        let old_b = o.open(("10.0.0.2:1", b), "", false, "simple", (0, 0));
        old_b.active(false, 0);
        let a_conns: Vec<_> = (0..3u32)
            .map(|i| {
                let x = o.open(("10.0.0.1:1", a), "", false, "simple", (0, 1 + i));
                x.active(false, u64::from(5 + i) * s);
                x
            })
            .collect();
        let c_conns: Vec<_> = (0..2u32)
            .map(|i| {
                let x = o.open(("10.0.0.3:1", c), "", false, "simple", (1, i));
                x.active(false, s);
                x
            })
            .collect();
        let conns = o.connections();
        // a's longest idle (15 s), though b's and c's have been idle longer.
        let (v, idle) = victim(&conns, 20 * s, each(10 * sec), None).unwrap();
        assert_eq!((v.id, idle), (a_conns[0].id, 15 * sec));
        // None of a's has been idle for 16 s: then c (two), not b (one).
        let (v, _) = victim(&conns, 20 * s, each(16 * sec), None).unwrap();
        assert_eq!(v.client, c);
        // Busy connections count for their client but are never chosen.
        a_conns[0].active(true, 0);
        a_conns[1].active(true, 0);
        let (v, _) = victim(&conns, 20 * s, each(10 * sec), None).unwrap();
        assert_eq!(v.id, a_conns[2].id);
        // Connections on their way out count for nobody: a then holds one, like b.
        a_conns[0].evicting.store(true, Ordering::Relaxed);
        a_conns[1].evicting.store(true, Ordering::Relaxed);
        let (v, _) = victim(&conns, 20 * s, each(10 * sec), None).unwrap();
        assert_eq!(v.client, c);
        // Between clients holding as many, the longest idle: b's (20 s) before a's (13 s).
        for x in &c_conns {
            x.active(true, 0);
        }
        let (v, _) = victim(&conns, 20 * s, each(10 * sec), None).unwrap();
        assert_eq!(v.id, old_b.id);
    }

    #[test]
    fn a_connection_in_the_middle_of_a_request_waits_for_the_longer_patience() {
        let o = Observer::default();
        let a = Client::Ip([10, 0, 0, 1].into());
        let s = 1_000_000_000u64;
        let sec = Duration::from_secs(1);
        // x has been idle 15 s but a payload of it is still arriving; y is quiet, 12 s.
        let x = o.open(("10.0.0.1:1", a), "", false, "simple", (0, 0));
        let y = o.open(("10.0.0.1:2", a), "", false, "simple", (0, 1));
        x.active(false, 5 * s);
        x.moving(true);
        y.active(false, 8 * s);
        let conns = o.connections();
        let p = Patience {
            quiet: Some(10 * sec),
            moving: Some(60 * sec),
        };
        assert_eq!(victim(&conns, 20 * s, p, None).unwrap().0.id, y.id);
        y.moving(true);
        assert!(victim(&conns, 20 * s, p, Some(a)).is_none());
        // Past the longer patience, or with no quiet rule at all.
        assert_eq!(victim(&conns, 70 * s, p, None).unwrap().0.id, x.id);
        let only_moving = Patience {
            quiet: None,
            moving: Some(sec),
        };
        x.moving(false);
        assert_eq!(
            victim(&conns, 20 * s, only_moving, None).unwrap().0.id,
            y.id
        );
    }
}
