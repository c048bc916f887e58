//! Stack files: a TOML description of devices and how they stack.
//!
//! ```toml
//! [tuning]                 # optional: the global switches (command-line flags win)
//! clock = "cached"
//!
//! [device.d0]
//! type = "file"
//! path = "/var/lib/cairn/d0.img"
//! size = "10G"             # created if missing
//!
//! [device.r]
//! type = "raid10"
//! members = ["d0", "d1", "d2", "d3"]
//! chunk = "64K"
//! ```
//!
//! [`StackFile::parse`] turns the text into typed specs once: every key has a type and,
//! if it is a number, a range ([`limits`]); the device graph is checked (members
//! defined, each used once, no cycle, at most [`limits::DEPTH_MAX`] levels). Every error
//! is one line that names the device (or the table) and the key. [`StackFile::open`]
//! refuses two devices backed by the same file, then builds the devices, members first.
//!
//! Nothing that input drives recurses without a bound: the graph walks are iterative, and
//! opening recurses once per level of a graph already checked to be shallow.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

#[doc(hidden)]
pub mod fuzz;
mod graph;
mod keys;
mod writeback;

pub(crate) use keys::{format_duration, shown};

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cairn_core::{
    ClockMode, CoalesceMode, Device, DispatchMode, Error, FlushMode, ReapMode, StatsMode, Switches,
    WritebackMode,
};
use toml::{Table, Value};

use cairn_leaves::spec::LeafSpec;
use cairn_stacks::array::Start;
use cairn_stacks::stack::{AnyLayout, Linear, Mirror, Raid10, StackDevice, Stripe};
use cairn_stacks::wrap::{Delays, FaultRule, Faults, WrapDevice};

// The arrays' own options and names: the parser fills them in, the arrays use them.
pub use cairn_stacks::stack::{ArrayOptions, DEFAULT_BITMAP_REGION, MISSING};

/// Default chunk of stripe and raid10.
pub const DEFAULT_CHUNK_BYTES: u64 = 64 << 10;

/// The bounds a stack file is checked against when it is parsed.
///
/// A value outside them is a mistake, not a configuration: a 20,000-level chain, a cache
/// larger than the machine, a disk modelled at 0 bytes a second. Each bound is generous
/// for real use and keeps every walk, wait and allocation that input drives finite.
pub mod limits {
    use std::ops::RangeInclusive;
    use std::time::Duration;

    /// Bytes of a stack file cairn reads; a longer file is refused.
    pub const FILE_BYTES_MAX: u64 = 1 << 20;
    /// Devices in one stack file.
    pub const DEVICES_MAX: usize = 4096;
    /// Exports in one stack file.
    pub const EXPORTS_MAX: usize = 4096;
    /// Levels of a device graph: a leaf alone is one level.
    pub const DEPTH_MAX: usize = 64;
    /// Members of a linear, stripe or raid10 device (a mirror has at most
    /// [`cairn_stacks::stack::COPIES_MAX`]).
    pub const MEMBERS_MAX: usize = 256;
    /// Bytes of a device or export name.
    pub const NAME_BYTES_MAX: usize = 255;
    /// Bytes of an export's description.
    pub const DESCRIPTION_BYTES_MAX: usize = 4096;
    /// Logical block size (also a power of two).
    pub const BLOCK: RangeInclusive<u64> = 512..=65536;
    /// Size of a null device (1 EiB; mem has [`cairn_leaves::mem::MEM_SIZE_MAX`]).
    pub const SIZE_MAX: u64 = 1 << 60;
    /// `size` of a file device.
    pub const FILE_SIZE: RangeInclusive<u64> = 512..=(1 << 60);
    /// Chunk of stripe and raid10 (also a power of two).
    pub const CHUNK: RangeInclusive<u64> = 512..=(1 << 30);
    /// A cache's `memory`, at least; at most half of the machine's memory, for each cache
    /// and for all of a file's caches together.
    pub const CACHE_MIN: u64 = 64 << 10;
    /// A delay's `read`, `write`, `flush` and `seek`.
    pub const LATENCY_MAX: Duration = Duration::from_secs(10);
    /// A delay's `bandwidth`, in bytes per second.
    pub const BANDWIDTH_MIN: u64 = 1 << 20;
    /// A fault's `after_secs`.
    pub const AFTER: RangeInclusive<Duration> =
        Duration::ZERO..=Duration::from_secs(365 * 24 * 3600);
    /// `[writeback]` `interval`.
    pub const INTERVAL: RangeInclusive<Duration> =
        Duration::from_millis(1)..=Duration::from_secs(3600);
    /// `bitmap` of mirror and raid10 (a power of two; it grows if the array needs more
    /// regions than a superblock holds).
    pub const BITMAP_REGION: RangeInclusive<u64> = (64 << 10)..=(1 << 40);
    /// `bitmap_delay` of mirror and raid10.
    pub const BITMAP_DELAY: RangeInclusive<Duration> =
        Duration::from_millis(100)..=Duration::from_secs(3600);
    /// `readd` of mirror and raid10.
    pub const READD: RangeInclusive<Duration> =
        Duration::from_millis(100)..=Duration::from_secs(3600);
    /// `[writeback]` `expire`.
    pub const EXPIRE: RangeInclusive<Duration> =
        Duration::from_millis(1)..=Duration::from_secs(24 * 3600);
}

/// This machine's memory in bytes (the upper end of cache memory is half of it).
pub fn machine_memory_bytes() -> u64 {
    // What sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE) gives: the total RAM sysinfo
    // reports, in whole pages.
    let info = rustix::system::sysinfo();
    let page = rustix::param::page_size() as u64;
    let pages = (info.totalram as u64).saturating_mul(u64::from(info.mem_unit)) / page;
    if pages == 0 {
        // Unknown: no bound from memory beyond what a cache can address.
        return u64::MAX;
    }
    pages.saturating_mul(page)
}

/// What one `[device.NAME]` table describes.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceSpec {
    /// null, mem or file.
    Leaf(LeafSpec),
    /// Members end to end.
    Linear {
        /// Member names.
        members: Vec<String>,
        /// Keeps superblocks on its members (`metadata = "1"`).
        metadata: bool,
    },
    /// RAID0.
    Stripe {
        /// Member names.
        members: Vec<String>,
        /// Chunk size in bytes.
        chunk: u64,
        /// Keeps superblocks on its members.
        metadata: bool,
    },
    /// RAID1.
    Mirror {
        /// Member names ([`MISSING`] for an absent one, with metadata).
        members: Vec<String>,
        /// Spares: devices that take the place of members that fail (with metadata).
        spares: Vec<String>,
        /// Keeps superblocks on its members.
        metadata: bool,
        /// How fast a rebuild or resync goes, and the bitmap.
        rebuild: ArrayOptions,
    },
    /// RAID10, md's near layout.
    Raid10 {
        /// Member names ([`MISSING`] for an absent one, with metadata).
        members: Vec<String>,
        /// Spares, as a mirror's.
        spares: Vec<String>,
        /// Chunk size in bytes.
        chunk: u64,
        /// Copies of each chunk.
        copies: usize,
        /// Keeps superblocks on its members.
        metadata: bool,
        /// How fast a rebuild or resync goes, and the bitmap.
        rebuild: ArrayOptions,
    },
    /// Fails requests to `base` per a rule.
    Fault {
        /// The wrapped device.
        base: String,
        /// When to fail.
        rule: FaultRule,
    },
    /// Adds latency to requests to `base`.
    Delay {
        /// The wrapped device.
        base: String,
        /// How much.
        delays: Delays,
    },
    /// A write-back cache in memory over `base`.
    Cache {
        /// The cached device.
        base: String,
        /// Cache memory in bytes.
        memory: u64,
    },
    /// A thin pool: its data device, then its metadata device if it has one of its own.
    ThinPool {
        /// `data`, then `metadata` if set.
        devices: Vec<String>,
        /// Allocation unit and low-water mark.
        options: cairn_services::thin::pool::PoolOptions,
    },
    /// Rate limits on `base`, alone or shared with the other throttles of its group.
    Throttle {
        /// The limited device.
        base: String,
        /// Throttles of one group share its limits (fairly, in arrival order).
        group: Option<String>,
        /// Its limits (`None`: its group's, given by another of its devices).
        limits: Option<cairn_services::throttle::Limits>,
    },
    /// Encrypted data on `base`, in LUKS format.
    Crypt {
        /// The device holding the ciphertext and the header.
        base: String,
        /// Where the key comes from, and what `create` makes.
        options: cairn_services::crypt::device::CryptOptions,
    },
    /// A volume of a thin pool.
    Thin {
        /// The pool device.
        pool: String,
        /// The volume's name in the pool.
        volume: String,
        /// Its virtual size (created with it when absent; grown when larger).
        size: Option<u64>,
    },
}

impl DeviceSpec {
    /// Names of the devices this one is built from.
    pub fn members(&self) -> &[String] {
        match self {
            DeviceSpec::Leaf(_) => &[],
            DeviceSpec::Linear { members, .. }
            | DeviceSpec::Stripe { members, .. }
            | DeviceSpec::Mirror { members, .. }
            | DeviceSpec::Raid10 { members, .. } => members,
            DeviceSpec::Fault { base, .. }
            | DeviceSpec::Delay { base, .. }
            | DeviceSpec::Throttle { base, .. }
            | DeviceSpec::Crypt { base, .. }
            | DeviceSpec::Cache { base, .. } => std::slice::from_ref(base),
            DeviceSpec::ThinPool { devices, .. } => devices,
            DeviceSpec::Thin { pool, .. } => std::slice::from_ref(pool),
        }
    }

    /// Names of the spares of a mirror or raid10 (none for other devices).
    pub fn spares(&self) -> &[String] {
        match self {
            DeviceSpec::Mirror { spares, .. } | DeviceSpec::Raid10 { spares, .. } => spares,
            _ => &[],
        }
    }

    /// Every device this one uses, with the key that names it: members (or base), then
    /// spares.
    pub fn uses(&self) -> impl Iterator<Item = (&'static str, &String)> {
        let key = self.members_key();
        let pool = matches!(self, DeviceSpec::ThinPool { .. });
        self.members()
            .iter()
            .enumerate()
            .map(move |(i, m)| (if pool && i == 1 { "metadata" } else { key }, m))
            .chain(self.spares().iter().map(|s| ("spares", s)))
    }

    /// The key that names this device's members (for error messages).
    fn members_key(&self) -> &'static str {
        match self {
            DeviceSpec::Fault { .. }
            | DeviceSpec::Delay { .. }
            | DeviceSpec::Cache { .. }
            | DeviceSpec::Crypt { .. }
            | DeviceSpec::Throttle { .. } => "base",
            DeviceSpec::ThinPool { .. } => "data",
            DeviceSpec::Thin { .. } => "pool",
            _ => "members",
        }
    }
}

/// The `[tuning]` table: the switches a stack file sets (command-line flags win).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tuning {
    /// `clock = "cached" | "precise"`.
    pub clock: Option<ClockMode>,
    /// `reap = "eager" | "lazy"`.
    pub reap: Option<ReapMode>,
    /// `stats = "on" | "off"`.
    pub stats: Option<StatsMode>,
    /// `flush = "batched" | "serial"`.
    pub flush: Option<FlushMode>,
    /// `dispatch = "inline" | "handoff"`.
    pub dispatch: Option<DispatchMode>,
    /// `writeback = "per-device" | "shared"`.
    pub writeback: Option<WritebackMode>,
    /// `coalesce = "on" | "off"`.
    pub coalesce: Option<CoalesceMode>,
}

impl Tuning {
    /// The switches this table sets, over `defaults`.
    pub fn over(&self, defaults: Switches) -> Switches {
        Switches {
            clock: self.clock.unwrap_or(defaults.clock),
            reap: self.reap.unwrap_or(defaults.reap),
            stats: self.stats.unwrap_or(defaults.stats),
            flush: self.flush.unwrap_or(defaults.flush),
            dispatch: self.dispatch.unwrap_or(defaults.dispatch),
            writeback: self.writeback.unwrap_or(defaults.writeback),
            coalesce: self.coalesce.unwrap_or(defaults.coalesce),
        }
    }

    fn parse(table: &Table) -> Result<Tuning, Error> {
        fn pick<T: Copy>(key: &str, text: &str, names: &[(&str, T)]) -> Result<T, Error> {
            names
                .iter()
                .find(|(n, _)| *n == text)
                .map(|(_, v)| *v)
                .ok_or_else(|| {
                    let known: Vec<&str> = names.iter().map(|(n, _)| *n).collect();
                    err(format!(
                        "tuning: {key} = \"{}\" is not one of {}",
                        keys::shown(text),
                        known.join(", ")
                    ))
                })
        }
        let mut t = Tuning::default();
        for (k, v) in table {
            let Value::String(s) = v else {
                if TUNING_KEYS.contains(&k.as_str()) {
                    return Err(err(format!("tuning: key '{k}' must be a string")));
                }
                return Err(unknown_tuning_key(k));
            };
            let s = s.as_str();
            match k.as_str() {
                "clock" => {
                    t.clock = Some(pick(
                        k,
                        s,
                        &[
                            ("cached", ClockMode::Cached),
                            ("precise", ClockMode::Precise),
                        ],
                    )?)
                }
                "reap" => {
                    t.reap = Some(pick(
                        k,
                        s,
                        &[("eager", ReapMode::Eager), ("lazy", ReapMode::Lazy)],
                    )?)
                }
                "stats" => {
                    t.stats = Some(pick(
                        k,
                        s,
                        &[("on", StatsMode::On), ("off", StatsMode::Off)],
                    )?)
                }
                "flush" => {
                    t.flush = Some(pick(
                        k,
                        s,
                        &[
                            ("batched", FlushMode::Batched),
                            ("serial", FlushMode::Serial),
                        ],
                    )?)
                }
                "dispatch" => {
                    t.dispatch = Some(pick(
                        k,
                        s,
                        &[
                            ("inline", DispatchMode::Inline),
                            ("handoff", DispatchMode::Handoff),
                        ],
                    )?)
                }
                "writeback" => {
                    t.writeback = Some(pick(
                        k,
                        s,
                        &[
                            ("per-device", WritebackMode::PerDevice),
                            ("shared", WritebackMode::Shared),
                        ],
                    )?)
                }
                "coalesce" => {
                    t.coalesce = Some(pick(
                        k,
                        s,
                        &[("on", CoalesceMode::On), ("off", CoalesceMode::Off)],
                    )?)
                }
                _ => return Err(unknown_tuning_key(k)),
            }
        }
        Ok(t)
    }
}

const TUNING_KEYS: [&str; 7] = [
    "clock",
    "reap",
    "stats",
    "dispatch",
    "flush",
    "writeback",
    "coalesce",
];

fn unknown_tuning_key(key: &str) -> Error {
    err(format!(
        "tuning: unknown key '{}' (known: {})",
        keys::shown(key),
        TUNING_KEYS.join(", ")
    ))
}

/// What every device of one open shares: the caches' dirty budget, the throttle groups.
type Shared<'a> = (
    &'a Option<Arc<cairn_stacks::cache::writeback::Budget>>,
    &'a HashMap<String, Arc<cairn_services::throttle::Throttle>>,
);

pub use keys::crypt_kdf;

/// Throttle `device`'s `limits` changed by `words` (`KEY=VALUE`, the stack file's keys;
/// 0 takes a limit away), or why not.
pub fn change_limits(
    device: &str,
    limits: cairn_services::throttle::Limits,
    words: &[&str],
) -> Result<cairn_services::throttle::Limits, Error> {
    keys::change_limits(device, limits, words)
}

/// Whether `name` may name an export (as in an `[export.NAME]` table).
pub fn check_export_name(name: &str) -> Result<(), Error> {
    graph::check_name("export", name)
}

fn err(msg: String) -> Error {
    Error::Invalid(msg)
}

/// An `[export.NAME]` table: a device that `cairn serve` offers to NBD clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSpec {
    /// The device served (a top-level device of the file).
    pub device: String,
    /// Refuse every request that would change data.
    pub read_only: bool,
    /// Shown to clients that list exports.
    pub description: String,
    /// Chosen by clients that ask for the default export (the empty name).
    pub default: bool,
    /// Also mounted as a file at this path (`cairn serve`'s FUSE export).
    pub fuse: Option<std::path::PathBuf>,
    /// Requests not aligned to the device's blocks are refused (EINVAL) even from NBD
    /// clients that did not ask for block sizes, instead of served by read-modify-write.
    pub strict_alignment: bool,
    /// The export's limits and throttle group, if it has any (served through a throttle
    /// device named `export:NAME`, which parse adds and points `device` at).
    pub throttle: Option<(Option<String>, Option<cairn_services::throttle::Limits>)>,
}

/// A parsed stack file.
#[derive(Debug, Clone, PartialEq)]
pub struct StackFile {
    /// Devices by name.
    pub devices: BTreeMap<String, DeviceSpec>,
    /// The `[tuning]` table.
    pub tuning: Tuning,
    /// `[export.NAME]` tables by name.
    pub exports: BTreeMap<String, ExportSpec>,
    /// The `[writeback]` table (the dirty budget of cache devices), if present.
    pub writeback: Option<cairn_stacks::cache::writeback::Writeback>,
    /// Devices with dirty bitmaps (`bitmaps = PATH` in their table), and their stores.
    pub bitmaps: BTreeMap<String, std::path::PathBuf>,
}

impl StackFile {
    /// Makes every relative `path` of a file device (and a crypt device's key files, an
    /// export's FUSE file, a bitmap store) relative to `dir` (the stack file's directory),
    /// as a reader of the file expects, rather than to wherever cairn runs.
    pub fn relative_to(mut self, dir: &std::path::Path) -> StackFile {
        if dir.as_os_str().is_empty() {
            return self;
        }
        for spec in self.devices.values_mut() {
            if let DeviceSpec::Leaf(cairn_leaves::LeafSpec::File { path, .. }) = spec {
                if path.is_relative() {
                    *path = dir.join(&*path);
                }
            }
            if let DeviceSpec::Crypt { options, .. } = spec {
                for p in [&mut options.passphrase_file, &mut options.key_file]
                    .into_iter()
                    .flatten()
                {
                    if p.is_relative() {
                        *p = dir.join(&*p);
                    }
                }
            }
        }
        for e in self.exports.values_mut() {
            if let Some(p) = e.fuse.as_mut().filter(|p| p.is_relative()) {
                *p = dir.join(&*p);
            }
        }
        for p in self.bitmaps.values_mut() {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        }
        self
    }

    /// Parses and checks a stack file's text.
    pub fn parse(text: &str) -> Result<StackFile, Error> {
        StackFile::parse_on(text, machine_memory_bytes())
    }

    /// Parses as on a machine with `memory_bytes` of memory (caches may take half).
    pub fn parse_on(text: &str, memory_bytes: u64) -> Result<StackFile, Error> {
        if text.len() as u64 > limits::FILE_BYTES_MAX {
            return Err(err(format!(
                "the stack file is {} bytes; at most {} are read",
                text.len(),
                limits::FILE_BYTES_MAX
            )));
        }
        let root: Table = text
            .parse()
            .map_err(|e: toml::de::Error| toml_error(text, &e))?;
        let mut devices = BTreeMap::new();
        let mut tuning = Tuning::default();
        let mut exports = BTreeMap::new();
        let mut writeback = None;
        let mut bitmaps = BTreeMap::new();
        for (key, value) in &root {
            match (key.as_str(), value) {
                ("device", Value::Table(t)) => {
                    if t.len() > limits::DEVICES_MAX {
                        return Err(err(format!(
                            "the stack file defines {} devices; at most {} are allowed",
                            t.len(),
                            limits::DEVICES_MAX
                        )));
                    }
                    for (name, dv) in t {
                        graph::check_name("device", name)?;
                        let Value::Table(dt) = dv else {
                            return Err(err(format!(
                                "device '{name}' must be a table ([device.{name}])"
                            )));
                        };
                        let (dt, store) = keys::split_bitmaps(name, dt)?;
                        devices.insert(name.clone(), keys::parse_device(name, &dt, memory_bytes)?);
                        if let Some(path) = store {
                            if let Some((other, _)) = bitmaps.iter().find(|(_, p)| **p == path) {
                                return Err(err(format!(
                                    "devices '{other}' and '{name}' both keep their bitmaps in {}: each needs a store of its own",
                                    path.display()
                                )));
                            }
                            bitmaps.insert(name.clone(), path);
                        }
                    }
                }
                ("export", Value::Table(t)) => {
                    if t.len() > limits::EXPORTS_MAX {
                        return Err(err(format!(
                            "the stack file defines {} exports; at most {} are allowed",
                            t.len(),
                            limits::EXPORTS_MAX
                        )));
                    }
                    for (name, ev) in t {
                        // The empty name is NBD's default export, and allowed.
                        if !name.is_empty() {
                            graph::check_name("export", name)?;
                        }
                        let Value::Table(et) = ev else {
                            return Err(err(format!(
                                "export '{name}' must be a table ([export.{name}])"
                            )));
                        };
                        exports.insert(name.clone(), keys::parse_export(name, et)?);
                    }
                }
                ("writeback", Value::Table(t)) => {
                    writeback = Some(writeback::parse(t)?);
                }
                ("tuning", Value::Table(t)) => tuning = Tuning::parse(t)?,
                ("device" | "export" | "writeback" | "tuning", _) => {
                    return Err(err(format!(
                        "'{key}' must be a table ([{key}{}])",
                        if matches!(key.as_str(), "device" | "export") {
                            ".NAME"
                        } else {
                            ""
                        }
                    )))
                }
                _ => {
                    return Err(err(format!(
                        "unknown top-level key '{}' (known: [device.NAME] and [export.NAME] tables, [tuning] and [writeback])",
                        keys::shown(key)
                    )))
                }
            }
        }
        if devices.is_empty() {
            return Err(err("the stack file defines no [device.NAME] table".into()));
        }
        let file = StackFile {
            devices,
            tuning,
            exports,
            writeback,
            bitmaps,
        };
        let mut file = file;
        graph::check(&file.devices)?;
        file.check_exports()?;
        file.add_export_throttles()?;
        graph::check(&file.devices)?;
        file.check_throttle_groups()?;
        file.check_cache_memory(memory_bytes)?;
        Ok(file)
    }

    /// The caches together fit in half of the machine's memory, and a `[writeback]` table's
    /// levels fit in the caches.
    fn check_cache_memory(&self, memory_bytes: u64) -> Result<(), Error> {
        let total = self.cache_bytes();
        if total > memory_bytes / 2 {
            let caches: Vec<String> = self
                .devices
                .iter()
                .filter(|(_, d)| matches!(d, DeviceSpec::Cache { .. }))
                .map(|(n, _)| format!("'{n}'"))
                .collect();
            return Err(err(format!(
                "devices {} together set key 'memory' to {}, more than half of this machine's memory ({})",
                caches.join(", "),
                cairn_core::size::format_bytes(total),
                cairn_core::size::format_bytes(memory_bytes / 2)
            )));
        }
        match (&self.writeback, total) {
            (Some(w), 1..) => w.check_for(total),
            _ => Ok(()),
        }
    }

    /// Exports name defined top-level devices; at most one is the default.
    fn check_exports(&self) -> Result<(), Error> {
        let roots = self.roots();
        for (name, e) in &self.exports {
            if !self.devices.contains_key(&e.device) {
                return Err(err(format!(
                    "export '{name}': key 'device' names '{}', which is not defined",
                    e.device
                )));
            }
            if matches!(self.devices[&e.device], DeviceSpec::ThinPool { .. }) {
                return Err(err(format!(
                    "export '{name}': key 'device' names '{}', which is a thin pool; export a 'thin' device on it",
                    e.device
                )));
            }
            if !roots.contains(&e.device) {
                return Err(err(format!(
                    "export '{name}': key 'device' names '{}', which is a member of another device; export the device at the top instead",
                    e.device
                )));
            }
        }
        let mut fuse: BTreeMap<&std::path::Path, &String> = BTreeMap::new();
        for (name, e) in &self.exports {
            if let Some(p) = &e.fuse {
                if let Some(other) = fuse.insert(p, name) {
                    return Err(err(format!(
                        "exports '{other}' and '{name}' both set 'fuse = \"{}\"'; each needs a file of its own",
                        p.display()
                    )));
                }
            }
        }
        let defaults: Vec<&String> = self
            .exports
            .iter()
            .filter(|(_, e)| e.default)
            .map(|(n, _)| n)
            .collect();
        if defaults.len() > 1 {
            return Err(err(format!(
                "exports {} all set 'default = true'; at most one can be the default",
                defaults
                    .iter()
                    .map(|n| format!("'{n}'"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        if let (Some(d), true) = (defaults.first(), self.exports.contains_key("")) {
            if !d.is_empty() {
                return Err(err(format!(
                    "export '{d}' sets 'default = true', but an export named \"\" exists and is the default"
                )));
            }
        }
        Ok(())
    }

    /// Devices that are not a member of any other device.
    pub fn roots(&self) -> Vec<String> {
        let used: std::collections::HashSet<&String> = self
            .devices
            .values()
            .flat_map(|d| d.uses().map(|(_, n)| n))
            .collect();
        self.devices
            .keys()
            .filter(|n| !used.contains(n))
            .cloned()
            .collect()
    }

    /// The device to run on: `name`, or the single root.
    pub fn pick(&self, name: Option<&str>) -> Result<String, Error> {
        match name {
            Some(n) if self.devices.contains_key(n) => Ok(n.to_string()),
            Some(n) => Err(err(format!(
                "no device '{n}' in the stack file (defined: {})",
                self.devices.keys().cloned().collect::<Vec<_>>().join(", ")
            ))),
            None => {
                let roots = self.roots();
                match roots.as_slice() {
                    [one] => Ok(one.clone()),
                    _ => Err(err(format!(
                        "the stack file has {} top-level devices ({}); choose one with --device NAME",
                        roots.len(),
                        roots.join(", ")
                    ))),
                }
            }
        }
    }

    /// Opens `name` and everything below it.
    pub fn open(&self, name: &str) -> Result<Arc<dyn Device>, Error> {
        self.open_with(name, Switches::default())
    }

    /// Makes thin pool `name` open by repair (see
    /// [`cairn_services::thin::pool::PoolOptions::repair`]): `cairn check --repair-thin`.
    pub fn repair_thin(&mut self, name: &str) -> Result<(), Error> {
        match self.devices.get_mut(name) {
            Some(DeviceSpec::ThinPool { options, .. }) => {
                options.repair = true;
                Ok(())
            }
            Some(_) => Err(Error::Invalid(format!(
                "device '{name}' is not a thin pool"
            ))),
            None => Err(Error::Invalid(format!(
                "no device '{name}' in the stack file"
            ))),
        }
    }

    /// What `cairn check` shows: opens `device` (or every top-level device) with
    /// everything below it, and returns their trees, the caches' budget and the exports.
    /// Everything is opened before anything is shown, so an error comes alone.
    pub fn check(&self, device: Option<&str>, switches: Switches) -> Result<String, Error> {
        let names = match device {
            Some(n) => vec![self.pick(Some(n))?],
            None => self.roots(),
        };
        // Arrays are examined, not started: `check` writes no superblock, and creates or
        // extends no file.
        let devices = self.open_many(&names, switches, Start::Dry)?;
        let mut out = String::new();
        let mut seen = Vec::new();
        for device in devices {
            out += &tree_seen(&*device, &mut seen);
        }
        if let Some(w) = self.writeback_summary() {
            out += &w;
            out.push('\n');
        }
        for (name, e) in &self.exports {
            out += &format!(
                "export '{name}': device {}{}{}\n",
                e.device,
                if e.read_only { ", read-only" } else { "" },
                if e.default { ", default" } else { "" }
            );
        }
        Ok(out)
    }

    /// The cache memory of every cache device of the file together.
    fn cache_bytes(&self) -> u64 {
        self.devices
            .values()
            .map(|d| match d {
                DeviceSpec::Cache { memory, .. } => *memory,
                _ => 0,
            })
            .sum()
    }

    /// The dirty budget the file's caches share, in bytes, for `cairn check`: `None`
    /// without caches.
    pub fn writeback_summary(&self) -> Option<String> {
        use cairn_core::size::format_bytes;
        let caches = self
            .devices
            .values()
            .filter(|d| matches!(d, DeviceSpec::Cache { .. }))
            .count();
        let memory = self.cache_bytes();
        if memory == 0 {
            return None;
        }
        let w = self.writeback.unwrap_or_default();
        let t = w.throttle(memory).ok()?;
        Some(format!(
            "writeback: {caches} cache{} with {} of memory share one budget: flushers write back over {}, \
             writers are paced from {} (held near {}) to {}; expire {:?}, interval {:?}",
            if caches == 1 { "" } else { "s" },
            format_bytes(memory),
            format_bytes(t.background),
            format_bytes(t.freerun()),
            format_bytes(t.setpoint()),
            format_bytes(t.limit),
            w.expire,
            w.interval,
        ))
    }

    /// Opens `name` and everything below it, with the switches that shape devices (the
    /// write-back mode of caches). Two devices of the file backed by the same file are
    /// refused first, whichever of them `name` uses.
    pub fn open_with(&self, name: &str, switches: Switches) -> Result<Arc<dyn Device>, Error> {
        self.open_inner(name, switches, Start::Write)
    }

    /// Everything that could refuse opening `names` (each as [`StackFile::open_with`]
    /// would, all open at once), found without changing anything: for `cairn serve` and
    /// `cairn bench`, so that a start refused for any device, an address in use or
    /// anything else is refused before a file is created or a superblock written.
    ///
    /// The devices are opened as `cairn check` opens them (arrays examined, not started;
    /// a file that `size=` would create or extend gets a stand-in that reads what the
    /// file would then hold), logging nothing and counting their reads in no statistics
    /// (the queues opened on this thread), and closed again before this returns, so that
    /// their locks are free for the real open.
    pub fn preflight(&self, names: &[String], switches: Switches) -> Result<(), Error> {
        cairn_core::stats::unregistered(|| {
            let opened = self.open_many(names, switches, Start::Silent)?;
            drop(opened);
            Ok(())
        })
    }

    /// [`StackFile::open_with`]; unless `how` is [`Start::Write`], nothing is changed:
    /// arrays with metadata are examined and not started (no superblock is written, at
    /// open or at close), and a file that `size=` would create or extend gets a stand-in
    /// of that size.
    fn open_inner(
        &self,
        name: &str,
        switches: Switches,
        how: Start,
    ) -> Result<Arc<dyn Device>, Error> {
        let mut all = self.open_many(&[name.to_string()], switches, how)?;
        Ok(all.remove(0))
    }

    /// Opens every device of `names` and everything below them, each device once (two
    /// volumes of one thin pool share the pool).
    fn open_many(
        &self,
        names: &[String],
        switches: Switches,
        how: Start,
    ) -> Result<Vec<Arc<dyn Device>>, Error> {
        graph::check_paths(&self.devices, &self.bitmaps)?;
        let mut opened = HashMap::new();
        // Every cache of the file shares one dirty budget, sized on their memory together.
        let cache_bytes = self.cache_bytes();
        let budget = if cache_bytes > 0 {
            let w = self.writeback.unwrap_or_default();
            Some(Arc::new(cairn_stacks::cache::writeback::Budget::new(
                &w,
                cache_bytes,
            )?))
        } else {
            None
        };
        let groups = self.throttle_groups();
        names
            .iter()
            .map(|name| self.open_rec(name, &mut opened, (&budget, &groups), (switches, how), 1))
            .collect()
    }

    /// An export with limits is served through a throttle device of its own,
    /// `export:NAME`, over the device it names.
    fn add_export_throttles(&mut self) -> Result<(), Error> {
        for (name, e) in self.exports.iter_mut() {
            let Some((group, limits)) = e.throttle.clone() else {
                continue;
            };
            let device = format!("export:{}", if name.is_empty() { "default" } else { name });
            if self.devices.contains_key(&device) {
                return Err(err(format!(
                    "export '{name}' has limits, served through a device named '{device}': that name is taken"
                )));
            }
            self.devices.insert(
                device.clone(),
                DeviceSpec::Throttle {
                    base: e.device.clone(),
                    group,
                    limits,
                },
            );
            e.device = device;
        }
        Ok(())
    }

    /// Each throttle group's throttle, with the limits its devices give.
    fn throttle_groups(&self) -> HashMap<String, Arc<cairn_services::throttle::Throttle>> {
        let mut out = HashMap::new();
        for spec in self.devices.values() {
            if let DeviceSpec::Throttle {
                group: Some(g),
                limits: Some(l),
                ..
            } = spec
            {
                out.entry(g.clone())
                    .or_insert_with(|| Arc::new(cairn_services::throttle::Throttle::new(*l)));
            }
        }
        out
    }

    /// Every throttle group has limits, and its devices that give limits give the same.
    fn check_throttle_groups(&self) -> Result<(), Error> {
        let mut groups: BTreeMap<&str, Vec<(&str, Option<cairn_services::throttle::Limits>)>> =
            BTreeMap::new();
        for (name, spec) in &self.devices {
            if let DeviceSpec::Throttle {
                group: Some(g),
                limits,
                ..
            } = spec
            {
                groups.entry(g).or_default().push((name, *limits));
            }
        }
        for (g, members) in groups {
            let given: Vec<_> = members
                .iter()
                .filter_map(|(n, l)| l.map(|l| (n, l)))
                .collect();
            let Some((first, limits)) = given.first() else {
                return Err(err(format!(
                    "throttle group '{g}' has no limits: give them on one of its devices ({})",
                    members
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            };
            if let Some((other, _)) = given.iter().find(|(_, l)| l != limits) {
                return Err(err(format!(
                    "throttle group '{g}': devices '{first}' and '{other}' give different limits (give them once, on one device)"
                )));
            }
        }
        Ok(())
    }

    /// [`StackFile::open_with`] for several devices at once, each device below them
    /// opened once.
    pub fn open_all(
        &self,
        names: &[String],
        switches: Switches,
    ) -> Result<Vec<Arc<dyn Device>>, Error> {
        self.open_many(names, switches, Start::Write)
    }

    fn open_rec(
        &self,
        name: &str,
        opened: &mut HashMap<String, Arc<dyn Device>>,
        shared: Shared<'_>,
        (switches, how): (Switches, Start),
        depth: usize,
    ) -> Result<Arc<dyn Device>, Error> {
        if let Some(d) = opened.get(name) {
            return Ok(d.clone());
        }
        // `parse` refused deeper graphs; this bounds the recursion on its own all the same.
        if depth > limits::DEPTH_MAX {
            return Err(err(format!(
                "device '{name}' is more than {} levels deep",
                limits::DEPTH_MAX
            )));
        }
        let spec = self
            .devices
            .get(name)
            .ok_or_else(|| err(format!("no device '{name}'")))?;
        let mut present = Vec::with_capacity(spec.members().len());
        for m in spec.members() {
            present.push(if m == MISSING {
                None
            } else {
                Some(self.open_rec(m, opened, shared, (switches, how), depth + 1)?)
            });
        }
        let named = in_device(name);
        if let Some(expect) = array_expect(name, spec) {
            let mut spares = Vec::with_capacity(spec.spares().len());
            for s in spec.spares() {
                let d = self.open_rec(s, opened, shared, (switches, how), depth + 1)?;
                spares.push((d, s.clone()));
            }
            let device = open_array(name, spec, expect, (present, spares), how).map_err(named)?;
            opened.insert(name.to_string(), device.clone());
            return Ok(device);
        }
        // Only arrays with metadata have missing members (parse makes sure).
        let members: Vec<Arc<dyn Device>> = present.into_iter().flatten().collect();
        let device = open_device(name, spec, members, shared, (switches, how)).map_err(&named)?;
        let device = match self.bitmaps.get(name) {
            Some(path) => track(name, device, path, how).map_err(named)?,
            None => device,
        };
        opened.insert(name.to_string(), device.clone());
        Ok(device)
    }
}

/// An error of opening device `name`, named after it (unless it already names a device).
fn in_device(name: &str) -> impl Fn(Error) -> Error + '_ {
    move |e: Error| match e {
        Error::Invalid(m) if m.starts_with("device '") => Error::Invalid(m),
        Error::Invalid(m) => err(format!("device '{name}': {m}")),
        Error::Os { context, source } => Error::Os {
            context: format!("device '{name}': {context}"),
            source,
        },
        other => other,
    }
}

/// A linear, stripe, mirror or raid10 device without metadata over `members`.
fn open_layout(
    name: &str,
    spec: &DeviceSpec,
    members: &[Arc<dyn Device>],
) -> Result<Arc<dyn Device>, Error> {
    let sizes: Vec<u64> = members.iter().map(|m| m.geometry().size_bytes).collect();
    let smallest = sizes.iter().copied().min().unwrap_or(0);
    let block = members
        .iter()
        .map(|m| u64::from(m.geometry().block_bytes))
        .max()
        .unwrap_or(512);
    let layout: AnyLayout = match spec {
        DeviceSpec::Linear { .. } => AnyLayout::Linear(Linear::new(&sizes, block)),
        DeviceSpec::Stripe { chunk, .. } => {
            Stripe::new(members.len(), *chunk, smallest, block)?.into()
        }
        DeviceSpec::Mirror { .. } => Mirror::new(members.len(), smallest)?.into(),
        DeviceSpec::Raid10 { chunk, copies, .. } => {
            Raid10::new(members.len(), *copies, *chunk, smallest, block)?.into()
        }
        _ => {
            return Err(err(format!(
                "device '{name}' is not a linear, stripe, mirror or raid10"
            )))
        }
    };
    stacked(name, Arc::new(layout), members.to_vec())
}

/// Device `name` (not an array with metadata) over its members, opened.
fn open_device(
    name: &str,
    spec: &DeviceSpec,
    members: Vec<Arc<dyn Device>>,
    (budget, groups): Shared<'_>,
    (switches, how): (Switches, Start),
) -> Result<Arc<dyn Device>, Error> {
    let base = || members[0].clone();
    Ok(match spec {
        DeviceSpec::Leaf(leaf) if how != Start::Write => open_dry(leaf, name)?,
        DeviceSpec::Leaf(leaf) => cairn_leaves::open(leaf, name)?,
        DeviceSpec::Fault { rule, .. } => Arc::new(WrapDevice::new(
            name,
            base(),
            Arc::new(Faults::new(rule.clone())),
        )),
        DeviceSpec::Delay { delays, .. } => Arc::new(WrapDevice::new(
            name,
            base(),
            Arc::new(cairn_stacks::wrap::Delay::new(*delays)),
        )),
        DeviceSpec::Cache { memory, .. } => {
            let budget = budget
                .clone()
                .ok_or_else(|| err(format!("device '{name}': the caches have no memory")))?;
            Arc::new(cairn_stacks::cache::CacheDevice::new(
                name,
                base(),
                *memory,
                budget,
                switches,
            )?)
        }
        DeviceSpec::Throttle { group, limits, .. } => {
            let throttle = match (group, limits) {
                (Some(g), _) => groups[g].clone(),
                (None, Some(l)) => Arc::new(cairn_services::throttle::Throttle::new(*l)),
                (None, None) => return Err(err(format!("device '{name}': no limits"))),
            };
            let policy = cairn_services::throttle::ThrottlePolicy::new(throttle, group.clone());
            Arc::new(WrapDevice::new(name, base(), Arc::new(policy)))
        }
        DeviceSpec::Crypt { options, .. } => {
            Arc::new(cairn_services::crypt::device::CryptDevice::open(
                name,
                base(),
                options,
                how == Start::Write,
            )?)
        }
        DeviceSpec::ThinPool { options, .. } => {
            Arc::new(cairn_services::thin::pool::ThinPool::open(
                name,
                base(),
                members.get(1).cloned(),
                *options,
                switches,
                how != Start::Write,
            )?)
        }
        DeviceSpec::Thin { volume, size, .. } => Arc::new(cairn_services::thin::ThinDevice::open(
            name,
            base(),
            volume,
            *size,
            how == Start::Write,
        )?),
        DeviceSpec::Linear { .. }
        | DeviceSpec::Stripe { .. }
        | DeviceSpec::Mirror { .. }
        | DeviceSpec::Raid10 { .. } => open_layout(name, spec, &members)?,
    })
}

/// `device` with its dirty bitmaps, kept in the store at `path`.
fn track(
    name: &str,
    device: Arc<dyn Device>,
    path: &std::path::Path,
    how: Start,
) -> Result<Arc<dyn Device>, Error> {
    let store = cairn_services::dirty::store::Store::open(
        path,
        name,
        device.geometry().size_bytes,
        how != Start::Write,
    )?;
    Ok(Arc::new(cairn_services::dirty::device::TrackedDevice::new(
        device, store,
    )?))
}

/// [`StackFile::preflight`] for one device given on the command line (`--device
/// file:PATH,size=1G`): whatever would refuse opening it, found without changing
/// anything (a file `size=` would create is not created).
pub fn preflight_leaf(leaf: &cairn_leaves::LeafSpec, name: &str) -> Result<(), Error> {
    cairn_core::stats::unregistered(|| open_dry(leaf, name).map(drop))
}

/// A leaf for `cairn check` and preflights: the device itself, or, for a file that
/// `size=` would create or extend, a stand-in of the size it would have that reads what
/// the file would then hold (nothing on disk changes).
fn open_dry(leaf: &cairn_leaves::LeafSpec, name: &str) -> Result<Arc<dyn Device>, Error> {
    use cairn_leaves::LeafSpec;
    let LeafSpec::File {
        path,
        engine,
        size_bytes: Some(want),
        sparse,
        ..
    } = leaf
    else {
        return cairn_leaves::open(leaf, name);
    };
    let shown = path.display();
    let now = match std::fs::metadata(path) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        // What the real open would meet: refused here already.
        Err(e) => return Err(Error::os(format!("file {shown}: open"), e)),
    };
    let Some(now) = now else {
        if cairn_leaves::file::under_dev(path) {
            // Refused by the open itself (no file is made under /dev), before anything.
            return cairn_leaves::open(leaf, name);
        }
        creatable(path)?;
        cairn_leaves::file::room_for(path, *want, 0, *sparse)?;
        return Ok(Arc::new(Planned {
            stand_in: Arc::new(cairn_leaves::null::NullDevice::new(name, *want, 512)?),
            what: format!("file {shown}, to be created by serve or bench"),
        }));
    };
    if !now.file_type().is_file() || now.len() >= *want {
        return cairn_leaves::open(leaf, name);
    }
    cairn_leaves::file::room_for(path, *want, now.len(), *sparse)?;
    // To be extended: exactly what the file will read once extended (what it holds now,
    // then zeros), in 512-byte blocks as for a file to be created (with `direct=1` the
    // real blocks may be larger; the bytes are the same). Its whole blocks are the file
    // opened as it is (which also finds its lock taken), a last partial block is copied
    // into memory, and zeros follow.
    let end = want - want % 512;
    if end == 0 {
        return Err(Error::Invalid(format!(
            "file {shown}: empty (add size=SIZE to extend it)"
        )));
    }
    let whole = now.len() - now.len() % 512;
    let mut parts: Vec<(Arc<dyn Device>, u64)> = Vec::with_capacity(3);
    if whole > 0 {
        let file = cairn_leaves::file::FileDevice::open(name, path, *engine, false, None)?;
        parts.push((Arc::new(file), whole));
    }
    if whole < now.len() && whole + 512 <= end {
        use std::io::{Read, Seek};
        let mut last = Vec::with_capacity(512);
        std::fs::File::open(path)
            .and_then(|mut f| {
                f.seek(std::io::SeekFrom::Start(whole))?;
                f.take(512).read_to_end(&mut last)
            })
            .map_err(|e| Error::os(format!("file {shown}: read"), e))?;
        let mem = cairn_leaves::mem::MemDevice::new(name, 512, 512)?;
        mem.store().write_slice(0, &last[..last.len().min(512)]);
        parts.push((Arc::new(mem), 512));
    }
    let covered: u64 = parts.iter().map(|(_, len)| len).sum();
    if covered < end {
        let zeros = cairn_leaves::null::NullDevice::new(name, end - covered, 512)?;
        parts.push((Arc::new(zeros), end - covered));
    }
    let stand_in = if parts.len() == 1 {
        parts.remove(0).0
    } else {
        let sizes: Vec<u64> = parts.iter().map(|(_, len)| *len).collect();
        let layout = Linear::new(&sizes, 512);
        let members = parts.into_iter().map(|(d, _)| d).collect();
        stacked(name, Arc::new(AnyLayout::Linear(layout)), members)?
    };
    Ok(Arc::new(Planned {
        stand_in,
        what: format!("file {shown}, to be extended by serve or bench"),
    }))
}

/// Whether a file could be created at `path` (its directory exists and may be written),
/// with the error the real open would give if not.
fn creatable(path: &std::path::Path) -> Result<(), Error> {
    use std::os::unix::ffi::OsStrExt;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    let shown = path.display();
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| Error::Invalid(format!("file {shown}: the path holds a NUL byte")))?;
    rustix::fs::access(
        c.as_c_str(),
        rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK,
    )
    .map_err(|e| Error::os(format!("file {shown}: open"), e.into()))
}

/// A file `cairn check` leaves as it is: a stand-in of the size it will have.
struct Planned {
    stand_in: Arc<dyn Device>,
    what: String,
}

impl Device for Planned {
    fn name(&self) -> &str {
        self.stand_in.name()
    }

    fn describe(&self) -> String {
        self.what.clone()
    }

    fn geometry(&self) -> cairn_core::Geometry {
        self.stand_in.geometry()
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        out: &mut Vec<cairn_core::Extent>,
    ) -> Result<(), Error> {
        self.stand_in.extents(offset, len, out)
    }

    fn open_queue(
        &self,
        core: &std::rc::Rc<cairn_core::Core>,
    ) -> Result<std::rc::Rc<dyn cairn_core::Queue>, Error> {
        self.stand_in.open_queue(core)
    }
}

/// What the stack file says an array with metadata is; `None` for any other device.
fn array_expect(name: &str, spec: &DeviceSpec) -> Option<cairn_stacks::array::assemble::Expect> {
    use cairn_stacks::array::superblock::Level;
    let (level, members, chunk, copies, bitmap_region) = match spec {
        DeviceSpec::Linear {
            members,
            metadata: true,
        } => (Level::Linear, members, 0, 1, 0),
        DeviceSpec::Stripe {
            members,
            chunk,
            metadata: true,
        } => (Level::Stripe, members, *chunk, 1, 0),
        DeviceSpec::Mirror {
            members,
            metadata: true,
            rebuild,
            ..
        } => (
            Level::Mirror,
            members,
            0,
            members.len() as u32,
            rebuild.bitmap_region,
        ),
        DeviceSpec::Raid10 {
            members,
            chunk,
            copies,
            metadata: true,
            rebuild,
            ..
        } => (
            Level::Raid10,
            members,
            *chunk,
            *copies as u32,
            rebuild.bitmap_region,
        ),
        _ => return None,
    };
    Some(cairn_stacks::array::assemble::Expect {
        name: name.to_string(),
        level,
        chunk_bytes: chunk,
        copies,
        members: members.clone(),
        bitmap_region,
    })
}

/// An array's spares, opened, with their names.
type Spares = Vec<(Arc<dyn Device>, String)>;

/// Opens an array that keeps superblocks on its members: reads them, decides the array
/// (create, assemble or refuse), builds the layout on the members' data areas, and starts
/// it (superblocks rewritten, dirty), with its spares. Missing members get a stand-in
/// that is never used.
fn open_array(
    name: &str,
    spec: &DeviceSpec,
    expect: cairn_stacks::array::assemble::Expect,
    (present, spares): (Vec<Option<Arc<dyn Device>>>, Spares),
    how: Start,
) -> Result<Arc<dyn Device>, Error> {
    let examined = cairn_stacks::array::examine(&expect, &present)?;
    let block = present
        .iter()
        .flatten()
        .map(|m| u64::from(m.geometry().block_bytes))
        .max()
        .unwrap_or(512);
    let smallest = examined
        .member_data
        .iter()
        .zip(&present)
        .filter(|(_, m)| m.is_some())
        .map(|(d, _)| *d)
        .min()
        .unwrap_or(0);
    let n = present.len();
    let layout: AnyLayout = match spec {
        DeviceSpec::Linear { .. } => AnyLayout::Linear(Linear::new(&examined.member_data, block)),
        DeviceSpec::Stripe { chunk, .. } => Stripe::new(n, *chunk, smallest, block)?.into(),
        DeviceSpec::Mirror { .. } => Mirror::new(n, smallest)?.into(),
        DeviceSpec::Raid10 { chunk, copies, .. } => {
            Raid10::new(n, *copies, *chunk, smallest, block)?.into()
        }
        _ => return Err(err(format!("device '{name}' is not an array"))),
    };
    // Spares are examined before anything is written to the members.
    for (d, s) in &spares {
        examined
            .check_spare(d, s, block)
            .map_err(|e| err(format!("device '{name}': spare {e}")))?;
    }
    let data_offset = examined.data_offset;
    let members = present
        .iter()
        .map(|m| match m {
            Some(d) => Ok(d.clone()),
            None => {
                cairn_leaves::null::NullDevice::new(MISSING, data_offset + smallest, block as u32)
                    .map(|d| Arc::new(d) as Arc<dyn Device>)
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let device = StackDevice::new(name, Arc::new(layout), members)?;
    let array_bytes = device.geometry().size_bytes;
    let meta = cairn_stacks::array::Metadata::start(expect, present, examined, array_bytes, how)?;
    let rate = match spec {
        DeviceSpec::Mirror { rebuild, .. } | DeviceSpec::Raid10 { rebuild, .. } => *rebuild,
        _ => ArrayOptions::default(),
    };
    Ok(Arc::new(
        device.with_metadata(meta, rate).with_spares(spares)?,
    ))
}

/// A TOML syntax error as one line, with the line number where the parser stopped.
fn toml_error(text: &str, e: &toml::de::Error) -> Error {
    let message: Vec<&str> = e
        .message()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let mut message = message.join("; ");
    if message.is_empty() {
        message = if e.span().is_some_and(|s| s.start >= text.len()) {
            "the file ends in the middle of a line".into()
        } else {
            "a syntax error".into()
        };
    }
    // The parser quotes the input: keep control characters out of a one-line message.
    let message = keys::shown_all(&message);
    match e.span() {
        Some(span) => {
            let before = &text.as_bytes()[..span.start.min(text.len())];
            let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
            err(format!("not valid TOML at line {line}: {message}"))
        }
        None => err(format!("not valid TOML: {message}")),
    }
}

fn stacked(
    name: &str,
    layout: Arc<AnyLayout>,
    members: Vec<Arc<dyn Device>>,
) -> Result<Arc<dyn Device>, Error> {
    Ok(Arc::new(StackDevice::new(name, layout, members)?))
}

/// What `d` describes itself as, with the explanation of a file's engine (a few hundred
/// characters) given once per tree: a later file whose engine was chosen for the same
/// reason refers to the first device that gave it. `seen` holds (explanation, device).
pub fn described_once(d: &dyn Device, seen: &mut Vec<(String, String)>) -> String {
    const MARK: &str = "; engine: ";
    let text = d.describe();
    let Some(at) = text.find(MARK) else {
        return text;
    };
    let why = &text[at + MARK.len()..];
    match seen.iter().find(|(w, _)| w == why) {
        Some((_, first)) => format!("{}{MARK}as for {first}", &text[..at]),
        None => {
            seen.push((why.to_string(), d.name().to_string()));
            text
        }
    }
}

/// The device tree below `device`, one line each, indented, with sizes.
pub fn tree(device: &dyn Device) -> String {
    tree_seen(device, &mut Vec::new())
}

/// [`tree`], giving each engine's explanation once over several trees (`seen`, as
/// [`described_once`] keeps it).
fn tree_seen(device: &dyn Device, seen: &mut Vec<(String, String)>) -> String {
    let mut line = |d: &dyn Device, depth: usize, out: &mut String| {
        out.push_str(&format!(
            "{:indent$}{} ({}) {}\n",
            "",
            d.name(),
            cairn_core::size::format_bytes(d.geometry().size_bytes),
            described_once(d, seen),
            indent = depth * 2
        ));
    };
    // Depth first, members in order, without recursion.
    let mut out = String::new();
    line(device, 0, &mut out);
    let below = |d: &dyn Device, depth: usize| {
        d.children()
            .into_iter()
            .rev()
            .map(move |c| (c, depth + 1))
            .collect::<Vec<_>>()
    };
    let mut stack = below(device, 0);
    while let Some((d, depth)) = stack.pop() {
        line(&*d, depth, &mut out);
        stack.extend(below(&*d, depth));
    }
    out
}
