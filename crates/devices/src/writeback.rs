//! Write-back settings and dirty throttling (technique 3's groundwork).
//!
//! The `[writeback]` table of a stack file sets one dirty budget shared by every cache
//! device, after the kernel's knobs: `background` (dirty_background_ratio/bytes: flushers
//! start writing back), `limit` (dirty_ratio/bytes: writers are held back hardest),
//! `expire` (dirty_expire_centisecs: data older than this is written back even below the
//! background level) and `interval` (dirty_writeback_centisecs: how often flushers wake).
//!
//! [`Throttle`] is the writer-side model, after Linux's `balance_dirty_pages`: below the
//! "freerun" level halfway between background and limit, writers run free; above it each
//! write is paced at the measured write-back rate scaled by a position ratio that falls
//! smoothly (a cubic) from 1 at the setpoint to 0 at the limit, so dirty data settles
//! near the setpoint instead of hitting the limit and stopping writers dead.

use std::time::Duration;

use cairn_core::size::{parse_duration, parse_size};
use cairn_core::Error;
use toml::{Table, Value};

/// A level of dirty data: bytes, or a percentage of the cache memory of all caches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Amount {
    /// Bytes.
    Bytes(u64),
    /// Percent of the total cache memory (0 to 100).
    Percent(f64),
}

impl Amount {
    /// The level in bytes, for caches holding `cache_bytes` in all.
    pub fn bytes(self, cache_bytes: u64) -> u64 {
        match self {
            Amount::Bytes(b) => b,
            Amount::Percent(p) => (cache_bytes as f64 * p / 100.0) as u64,
        }
    }

    fn parse(key: &str, v: &Value) -> Result<Amount, Error> {
        let bad = || {
            Error::Invalid(format!(
                "writeback: key '{key}' must be a size such as \"64M\" or a percentage such as \"10%\""
            ))
        };
        match v {
            Value::String(s) if s.trim_end().ends_with('%') => {
                let p: f64 = s
                    .trim_end()
                    .trim_end_matches('%')
                    .trim()
                    .parse()
                    .map_err(|_| bad())?;
                if !(0.0..=100.0).contains(&p) {
                    return Err(Error::Invalid(format!(
                        "writeback: key '{key}' is {p}%, not from 0% to 100%"
                    )));
                }
                Ok(Amount::Percent(p))
            }
            Value::String(s) => parse_size(s).map(Amount::Bytes).map_err(|_| bad()),
            Value::Integer(n) if *n >= 0 => Ok(Amount::Bytes(*n as u64)),
            _ => Err(bad()),
        }
    }
}

/// The `[writeback]` table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Writeback {
    /// Flushers start writing back above this.
    pub background: Amount,
    /// Writers are held back hardest at this level.
    pub limit: Amount,
    /// Dirty data older than this is written back regardless of the level.
    pub expire: Duration,
    /// How often flushers wake up to look.
    pub interval: Duration,
}

impl Default for Writeback {
    /// The kernel's defaults: 10% and 20%, 30 s, 5 s.
    fn default() -> Writeback {
        Writeback {
            background: Amount::Percent(10.0),
            limit: Amount::Percent(20.0),
            expire: Duration::from_secs(30),
            interval: Duration::from_secs(5),
        }
    }
}

const KEYS: [&str; 4] = ["background", "limit", "expire", "interval"];

impl Writeback {
    /// Parses a `[writeback]` table; missing keys keep the defaults.
    pub fn parse(table: &Table) -> Result<Writeback, Error> {
        let mut w = Writeback::default();
        for (k, v) in table {
            match k.as_str() {
                "background" => w.background = Amount::parse(k, v)?,
                "limit" => w.limit = Amount::parse(k, v)?,
                "expire" | "interval" => {
                    let Value::String(s) = v else {
                        return Err(Error::Invalid(format!(
                            "writeback: key '{k}' must be a duration such as \"5s\""
                        )));
                    };
                    let d = parse_duration(s)
                        .map_err(|e| Error::Invalid(format!("writeback: key '{k}' is {e}")))?;
                    if d.is_zero() {
                        return Err(Error::Invalid(format!(
                            "writeback: key '{k}' must be more than 0"
                        )));
                    }
                    if k == "expire" {
                        w.expire = d;
                    } else {
                        w.interval = d;
                    }
                }
                _ => {
                    return Err(Error::Invalid(format!(
                        "writeback: unknown key '{k}' (known: {})",
                        KEYS.join(", ")
                    )))
                }
            }
        }
        Ok(w)
    }

    /// The throttle for caches holding `cache_bytes` in all; an error when the
    /// background level is not below the limit.
    pub fn throttle(&self, cache_bytes: u64) -> Result<Throttle, Error> {
        let (bg, limit) = (
            self.background.bytes(cache_bytes),
            self.limit.bytes(cache_bytes),
        );
        if bg >= limit {
            return Err(Error::Invalid(format!(
                "writeback: background ({bg} bytes) must be below limit ({limit} bytes)"
            )));
        }
        Ok(Throttle {
            background: bg,
            limit,
        })
    }
}

/// The dirty budget several cache devices share: their dirty bytes together, the throttle
/// computed on their memory together, and the timing knobs.
#[derive(Debug)]
pub struct Budget {
    /// Dirty bytes of every cache sharing the budget.
    pub dirty: std::sync::atomic::AtomicU64,
    /// Levels for all of them together.
    pub throttle: Throttle,
    /// Write back data older than this.
    pub expire: Duration,
    /// Flushers wake at least this often.
    pub interval: Duration,
    /// The shared write-back pool, with `--writeback shared`.
    pub(crate) pool: std::sync::OnceLock<std::sync::Arc<crate::cache::Pool>>,
    /// The caches sharing the budget, to wake all their flushers.
    pub(crate) members: std::sync::Mutex<Vec<std::sync::Weak<crate::cache::Shared>>>,
}

impl Budget {
    /// The budget of caches holding `cache_bytes` of memory in all.
    pub fn new(w: &Writeback, cache_bytes: u64) -> Result<Budget, Error> {
        Ok(Budget {
            dirty: std::sync::atomic::AtomicU64::new(0),
            throttle: w.throttle(cache_bytes)?,
            expire: w.expire,
            interval: w.interval,
            pool: std::sync::OnceLock::new(),
            members: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Dirty bytes now, across the caches.
    pub fn dirty_bytes(&self) -> u64 {
        self.dirty.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Wakes the flusher of every cache sharing the budget.
    pub(crate) fn kick_all(&self) {
        let members = self.members.lock().unwrap_or_else(|p| p.into_inner());
        for m in members.iter().filter_map(std::sync::Weak::upgrade) {
            m.kick();
        }
    }

    pub(crate) fn add(&self, bytes: u64) {
        self.dirty
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn sub(&self, bytes: u64) {
        let _ = self.dirty.fetch_update(
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
            |d| Some(d.saturating_sub(bytes)),
        );
    }
}

/// Writer pacing from the dirty level (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttle {
    /// Flushers write back above this many dirty bytes.
    pub background: u64,
    /// Writers are held back hardest at this many dirty bytes.
    pub limit: u64,
}

/// Longest a single write is paused.
pub const MAX_PAUSE: Duration = Duration::from_millis(200);

impl Throttle {
    /// Below this, writers are not paced at all.
    pub fn freerun(&self) -> u64 {
        self.background + (self.limit - self.background) / 2
    }

    /// Where pacing aims to hold the dirty level.
    pub fn setpoint(&self) -> u64 {
        self.freerun() + (self.limit - self.freerun()) / 2
    }

    /// The position ratio at `dirty` bytes: 0 at or above the limit, 2 at the freerun
    /// level, 1 at the setpoint, a cubic in between (as Linux's `pos_ratio`).
    pub fn position_ratio(&self, dirty: u64) -> f64 {
        if dirty >= self.limit {
            return 0.0;
        }
        let (setpoint, limit) = (self.setpoint() as f64, self.limit as f64);
        let x = (setpoint - dirty as f64) / (limit - setpoint).max(1.0);
        (1.0 + x * x * x).clamp(0.0, 2.0)
    }

    /// How long a writer that just dirtied `bytes` waits, with `dirty` bytes dirty and
    /// write-back running at `writeback_bps` bytes per second.
    pub fn pause(&self, dirty: u64, bytes: u64, writeback_bps: f64) -> Duration {
        if dirty < self.freerun() {
            return Duration::ZERO;
        }
        let rate = writeback_bps.max(1.0) * self.position_ratio(dirty);
        if rate <= 0.0 {
            return MAX_PAUSE;
        }
        Duration::from_secs_f64(bytes as f64 / rate).min(MAX_PAUSE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> Table {
        text.parse().unwrap()
    }

    #[test]
    fn parses_bytes_percentages_and_durations() {
        let w = Writeback::parse(&table(
            "background = \"64M\"\nlimit = \"25%\"\nexpire = \"3s\"\ninterval = \"500ms\"",
        ))
        .unwrap();
        assert_eq!(w.background, Amount::Bytes(64 << 20));
        assert_eq!(w.limit, Amount::Percent(25.0));
        assert_eq!(w.expire, Duration::from_secs(3));
        assert_eq!(w.interval, Duration::from_millis(500));
        assert_eq!(Writeback::parse(&table("")).unwrap(), Writeback::default());
        let t = w.throttle(1 << 30).unwrap();
        assert_eq!((t.background, t.limit), (64 << 20, 256 << 20));
    }

    #[test]
    fn every_mistake_names_its_key() {
        for (text, key) in [
            ("background = \"lots\"", "background"),
            ("limit = \"120%\"", "limit"),
            ("expire = 5", "expire"),
            ("interval = \"0s\"", "interval"),
            ("speed = 1", "speed"),
        ] {
            let e = Writeback::parse(&table(text)).unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
        let w = Writeback::parse(&table("background = \"30%\"\nlimit = \"20%\"")).unwrap();
        assert!(w
            .throttle(1 << 30)
            .unwrap_err()
            .to_string()
            .contains("below"));
    }

    fn throttle() -> Throttle {
        Throttle {
            background: 100 << 20,
            limit: 200 << 20,
        }
    }

    #[test]
    fn writers_run_free_below_the_freerun_level() {
        let t = throttle();
        assert_eq!(t.freerun(), 150 << 20);
        for dirty in [0, 100 << 20, (150 << 20) - 1] {
            assert_eq!(t.pause(dirty, 4096, 1e8), Duration::ZERO);
        }
    }

    #[test]
    fn pacing_is_smooth_and_grows_toward_the_limit() {
        let t = throttle();
        assert!((t.position_ratio(t.setpoint()) - 1.0).abs() < 1e-9);
        assert_eq!(t.position_ratio(t.limit), 0.0);
        // Monotonic, and no jump larger than 1% of the ratio's range between levels
        // 1/1000 of the window apart: writers slow down gradually, never stop-and-go.
        let (lo, hi) = (t.freerun(), t.limit);
        let step = (hi - lo) / 1000;
        let mut last = t.position_ratio(lo);
        for i in 1..1000 {
            let r = t.position_ratio(lo + i * step);
            assert!(r <= last + 1e-12, "ratio rises at step {i}");
            assert!(last - r < 0.02, "jump of {} at step {i}", last - r);
            last = r;
        }
        // At the setpoint a writer goes at the write-back rate: 4 KiB at 100 MB/s.
        let p = t.pause(t.setpoint(), 4096, 1e8);
        assert!((p.as_secs_f64() - 4096.0 / 1e8).abs() < 1e-9, "{p:?}");
        // Above the setpoint, slower than write-back; at the limit, the longest pause.
        assert!(t.pause(t.setpoint() + (10 << 20), 4096, 1e8) > p);
        assert_eq!(t.pause(t.limit, 4096, 1e8), MAX_PAUSE);
    }
}
