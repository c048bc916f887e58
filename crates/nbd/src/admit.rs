//! Who may connect: a limit on connections in total and per client address, and the
//! choice of an idle connection to close when a slot is needed.
//!
//! Connections are counted from `accept` (handshakes included) until they close. Only the
//! accepting thread adds; any thread may take away (a handshake that fails, a reactor
//! closing a connection), so a check followed by an add never overshoots. The lock is
//! taken once per connection, never per request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::observe::{Client, ConnInfo};

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

/// Of `conns`, the one idle longest, if it has been idle for `at_least` at `now_ns` and
/// is not being evicted already; `only` narrows the choice to one client's connections.
pub(crate) fn longest_idle(
    conns: &[std::sync::Arc<ConnInfo>],
    now_ns: u64,
    at_least: Duration,
    only: Option<Client>,
) -> Option<(&ConnInfo, Duration)> {
    conns
        .iter()
        .filter(|c| only.is_none_or(|o| c.client == o))
        .filter(|c| !c.evicting.load(Ordering::Relaxed))
        .filter_map(|c| Some((&**c, c.idle_for(now_ns)?)))
        .filter(|(_, idle)| *idle >= at_least)
        .max_by_key(|(_, idle)| *idle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::Observer;

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
        let (c, idle) = longest_idle(&conns, 20 * s, sec, None).unwrap();
        assert_eq!((c.id, idle), (y.id, 15 * sec));
        let (c, _) = longest_idle(&conns, 20 * s, sec, Some(a)).unwrap();
        assert_eq!(c.id, x.id);
        // Not idle long enough; busy; chosen already.
        assert!(longest_idle(&conns, 20 * s, 16 * sec, None).is_none());
        x.evicting.store(true, Ordering::Relaxed);
        assert!(longest_idle(&conns, 20 * s, sec, Some(a)).is_none());
        z.active(false, 19 * s);
        assert_eq!(
            longest_idle(&conns, 20 * s, sec, Some(a)).unwrap().0.id,
            z.id
        );
    }
}
