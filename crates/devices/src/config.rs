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
//! [`StackFile::parse`] turns the text into typed specs once; every error names the
//! device and the key. [`StackFile::open`] builds the devices, members first.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cairn_core::size::{parse_duration, parse_size};
use cairn_core::{Device, Error};
use toml::{Table, Value};

use crate::spec::{Engine, LeafSpec};
use crate::stack::{AnyLayout, Linear, Mirror, Raid10, StackDevice, Stripe};
use crate::wrap::{Delays, FaultRule, Faults, WrapDevice};
use crate::DEFAULT_BLOCK_BYTES;
use cairn_core::Op;

/// Default chunk of stripe and raid10.
pub const DEFAULT_CHUNK_BYTES: u64 = 64 << 10;

/// What one `[device.NAME]` table describes.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceSpec {
    /// null, mem or file.
    Leaf(LeafSpec),
    /// Members end to end.
    Linear {
        /// Member names.
        members: Vec<String>,
    },
    /// RAID0.
    Stripe {
        /// Member names.
        members: Vec<String>,
        /// Chunk size in bytes.
        chunk: u64,
    },
    /// RAID1.
    Mirror {
        /// Member names.
        members: Vec<String>,
    },
    /// RAID10, md's near layout.
    Raid10 {
        /// Member names.
        members: Vec<String>,
        /// Chunk size in bytes.
        chunk: u64,
        /// Copies of each chunk.
        copies: usize,
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
}

impl DeviceSpec {
    /// Names of the devices this one is built from.
    pub fn members(&self) -> &[String] {
        match self {
            DeviceSpec::Leaf(_) => &[],
            DeviceSpec::Linear { members }
            | DeviceSpec::Stripe { members, .. }
            | DeviceSpec::Mirror { members }
            | DeviceSpec::Raid10 { members, .. } => members,
            DeviceSpec::Fault { base, .. }
            | DeviceSpec::Delay { base, .. }
            | DeviceSpec::Cache { base, .. } => std::slice::from_ref(base),
        }
    }

    /// The key that names this device's members (for error messages).
    fn members_key(&self) -> &'static str {
        match self {
            DeviceSpec::Fault { .. } | DeviceSpec::Delay { .. } | DeviceSpec::Cache { .. } => {
                "base"
            }
            _ => "members",
        }
    }
}

/// The `[tuning]` table: switch values by name (validated by the binary).
pub type Tuning = BTreeMap<String, String>;

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
    pub writeback: Option<crate::writeback::Writeback>,
}

const EXPORT_KEYS: [&str; 4] = ["device", "read_only", "description", "default"];

fn parse_export(name: &str, table: &Table) -> Result<ExportSpec, Error> {
    let bad = |key: &str, what: &str| err(format!("export '{name}': key '{key}' {what}"));
    for key in table.keys() {
        if !EXPORT_KEYS.contains(&key.as_str()) {
            return Err(err(format!(
                "export '{name}': unknown key '{key}' (known: {})",
                EXPORT_KEYS.join(", ")
            )));
        }
    }
    let device = match table.get("device") {
        Some(Value::String(d)) => d.clone(),
        Some(_) => return Err(bad("device", "must be a string")),
        None => return Err(bad("device", "is missing")),
    };
    let flag = |key: &str| match table.get(key) {
        None => Ok(false),
        Some(Value::Boolean(b)) => Ok(*b),
        Some(_) => Err(bad(key, "must be true or false")),
    };
    let description = match table.get("description") {
        None => String::new(),
        Some(Value::String(d)) if d.len() <= 4096 => d.clone(),
        Some(Value::String(_)) => return Err(bad("description", "is longer than 4096 bytes")),
        Some(_) => return Err(bad("description", "must be a string")),
    };
    if name.len() > 4096 {
        return Err(err("an export name is longer than 4096 bytes".into()));
    }
    Ok(ExportSpec {
        device,
        read_only: flag("read_only")?,
        description,
        default: flag("default")?,
    })
}

const TUNING_KEYS: [&str; 6] = ["clock", "reap", "stats", "dispatch", "flush", "writeback"];

fn err(msg: String) -> Error {
    Error::Invalid(msg)
}

/// Reads the typed keys of one device table and refuses the rest.
struct Keys<'a> {
    device: &'a str,
    kind: &'a str,
    table: &'a Table,
    known: &'static [&'static str],
}

impl Keys<'_> {
    fn check_unknown(&self) -> Result<(), Error> {
        for key in self.table.keys() {
            if key != "type" && !self.known.contains(&key.as_str()) {
                return Err(err(format!(
                    "device '{}': unknown key '{key}' for type {} (known: {})",
                    self.device,
                    self.kind,
                    self.known.join(", ")
                )));
            }
        }
        Ok(())
    }

    fn bad(&self, key: &str, what: &str) -> Error {
        err(format!("device '{}': key '{key}' {what}", self.device))
    }

    fn size(&self, key: &str) -> Result<Option<u64>, Error> {
        match self.table.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => parse_size(s)
                .map(Some)
                .map_err(|e| self.bad(key, &format!("is {e}"))),
            Some(Value::Integer(n)) if *n > 0 => Ok(Some(*n as u64)),
            Some(_) => Err(self.bad(key, "must be a size such as \"10G\" or a positive number")),
        }
    }

    fn required_size(&self, key: &str) -> Result<u64, Error> {
        self.size(key)?.ok_or_else(|| self.bad(key, "is missing"))
    }

    fn string(&self, key: &str) -> Result<Option<&str>, Error> {
        match self.table.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(self.bad(key, "must be a string")),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, Error> {
        match self.table.get(key) {
            None => Ok(None),
            Some(Value::Boolean(b)) => Ok(Some(*b)),
            Some(Value::Integer(0)) => Ok(Some(false)),
            Some(Value::Integer(1)) => Ok(Some(true)),
            Some(_) => Err(self.bad(key, "must be true or false")),
        }
    }

    fn integer(&self, key: &str) -> Result<Option<u64>, Error> {
        match self.table.get(key) {
            None => Ok(None),
            Some(Value::Integer(n)) if *n >= 0 => Ok(Some(*n as u64)),
            Some(_) => Err(self.bad(key, "must be a whole number")),
        }
    }

    fn duration(&self, key: &str) -> Result<Option<Duration>, Error> {
        match self.table.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => parse_duration(s)
                .map(Some)
                .map_err(|e| self.bad(key, &format!("is {e}"))),
            Some(_) => Err(self.bad(key, "must be a duration such as \"1ms\"")),
        }
    }

    fn base(&self) -> Result<String, Error> {
        Ok(self
            .string("base")?
            .ok_or_else(|| self.bad("base", "is missing"))?
            .to_string())
    }

    fn seconds(&self, key: &str) -> Result<Option<Duration>, Error> {
        match self.table.get(key) {
            Some(Value::Integer(n)) if *n >= 0 => Ok(Some(Duration::from_secs(*n as u64))),
            Some(Value::Float(f)) if *f >= 0.0 && f.is_finite() => {
                Ok(Some(Duration::from_secs_f64(*f)))
            }
            _ => self.duration(key),
        }
    }

    fn fault_rule(&self) -> Result<FaultRule, Error> {
        let mut ops = [false; Op::COUNT];
        match self.table.get("fail") {
            None => {
                ops[Op::Read.index()] = true;
                ops[Op::Write.index()] = true;
                ops[Op::Flush.index()] = true;
            }
            Some(Value::Array(list)) if !list.is_empty() => {
                for v in list {
                    let op =
                        match v.as_str() {
                            Some("read") => Op::Read,
                            Some("write") => Op::Write,
                            Some("flush") => Op::Flush,
                            Some("discard") => Op::Discard,
                            Some("write-zeroes") => Op::WriteZeroes,
                            _ => return Err(self.bad(
                                "fail",
                                "must list operations: read, write, flush, discard, write-zeroes",
                            )),
                        };
                    ops[op.index()] = true;
                }
            }
            Some(_) => return Err(self.bad("fail", "must be a non-empty list such as [\"write\"]")),
        }
        let probability = match self.table.get("probability") {
            None => None,
            Some(Value::Float(p)) if (0.0..=1.0).contains(p) => Some(*p),
            Some(Value::Integer(p)) if (0..=1).contains(p) => Some(*p as f64),
            Some(_) => return Err(self.bad("probability", "must be a number from 0 to 1")),
        };
        let sectors = match self.table.get("sectors") {
            None => None,
            Some(Value::Array(a)) => match a.as_slice() {
                [Value::Integer(x), Value::Integer(y)] if 0 <= *x && x < y => {
                    Some((*x as u64, *y as u64))
                }
                _ => return Err(self.bad("sectors", "must be [first, end] with first < end")),
            },
            Some(_) => return Err(self.bad("sectors", "must be [first, end] with first < end")),
        };
        let errno = match self.table.get("errno") {
            None => libc::EIO,
            Some(Value::Integer(n)) if (1..4096).contains(n) => *n as i32,
            Some(Value::String(name)) => match name.as_str() {
                "EIO" => libc::EIO,
                "ENOSPC" => libc::ENOSPC,
                "EPERM" => libc::EPERM,
                "EINVAL" => libc::EINVAL,
                "ENODEV" => libc::ENODEV,
                "ETIMEDOUT" => libc::ETIMEDOUT,
                _ => {
                    return Err(self.bad(
                        "errno",
                        "must be EIO, ENOSPC, EPERM, EINVAL, ENODEV, ETIMEDOUT or a number",
                    ))
                }
            },
            Some(_) => return Err(self.bad("errno", "must be a name such as \"EIO\" or a number")),
        };
        Ok(FaultRule {
            ops,
            after_ios: self.integer("after_ios")?,
            after: self.seconds("after_secs")?,
            probability,
            sectors,
            errno,
            power_cut: self.bool("power_cut")?.unwrap_or(false),
        })
    }

    fn members(&self) -> Result<Vec<String>, Error> {
        let list = match self.table.get("members") {
            None => return Err(self.bad("members", "is missing")),
            Some(Value::Array(a)) => a,
            Some(_) => return Err(self.bad("members", "must be a list of device names")),
        };
        let mut out: Vec<String> = Vec::new();
        for v in list {
            let Value::String(name) = v else {
                return Err(self.bad("members", "must be a list of device names"));
            };
            if out.contains(name) {
                return Err(self.bad("members", &format!("names '{name}' twice")));
            }
            out.push(name.clone());
        }
        if out.is_empty() {
            return Err(self.bad("members", "is empty"));
        }
        Ok(out)
    }

    fn chunk(&self) -> Result<u64, Error> {
        let chunk = self.size("chunk")?.unwrap_or(DEFAULT_CHUNK_BYTES);
        if !chunk.is_power_of_two() {
            return Err(self.bad("chunk", &format!("must be a power of two, not {chunk}")));
        }
        Ok(chunk)
    }
}

fn parse_device(name: &str, table: &Table) -> Result<DeviceSpec, Error> {
    let kind = match table.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(_) => return Err(err(format!("device '{name}': key 'type' must be a string"))),
        None => return Err(err(format!("device '{name}': key 'type' is missing"))),
    };
    let known: &'static [&'static str] = match kind {
        "null" => &["size", "block"],
        "mem" => &["size", "block", "volatile"],
        "file" => &["path", "size", "engine", "direct"],
        "linear" | "mirror" => &["members"],
        "stripe" => &["members", "chunk"],
        "raid10" => &["members", "chunk", "copies"],
        "fault" => &[
            "base",
            "fail",
            "after_ios",
            "after_secs",
            "probability",
            "sectors",
            "errno",
            "power_cut",
        ],
        "delay" => &["base", "read", "write", "flush", "bandwidth", "seek"],
        "cache" => &["base", "memory"],
        _ => {
            return Err(err(format!(
                "device '{name}': unknown type '{kind}' (known: null, mem, file, linear, stripe, mirror, raid10, fault, delay, cache)"
            )))
        }
    };
    let keys = Keys {
        device: name,
        kind,
        table,
        known,
    };
    keys.check_unknown()?;
    let block = |k: &Keys| -> Result<u32, Error> {
        let b = k.size("block")?.unwrap_or(u64::from(DEFAULT_BLOCK_BYTES));
        u32::try_from(b).map_err(|_| k.bad("block", "is too large"))
    };
    Ok(match kind {
        "null" => DeviceSpec::Leaf(LeafSpec::Null {
            size_bytes: keys.required_size("size")?,
            block_bytes: block(&keys)?,
        }),
        "mem" => DeviceSpec::Leaf(LeafSpec::Mem {
            size_bytes: keys.required_size("size")?,
            block_bytes: block(&keys)?,
            volatile: keys.bool("volatile")?.unwrap_or(false),
        }),
        "file" => DeviceSpec::Leaf(LeafSpec::File {
            path: PathBuf::from(
                keys.string("path")?
                    .ok_or_else(|| keys.bad("path", "is missing"))?,
            ),
            engine: match keys.string("engine")? {
                Some(e) => {
                    Engine::parse(e).map_err(|e| keys.bad("engine", &format!("is wrong: {e}")))?
                }
                None => Engine::default(),
            },
            direct: keys.bool("direct")?.unwrap_or(false),
            size_bytes: keys.size("size")?,
        }),
        "linear" => DeviceSpec::Linear {
            members: keys.members()?,
        },
        "mirror" => DeviceSpec::Mirror {
            members: keys.members()?,
        },
        "stripe" => DeviceSpec::Stripe {
            members: keys.members()?,
            chunk: keys.chunk()?,
        },
        "fault" => DeviceSpec::Fault {
            base: keys.base()?,
            rule: keys.fault_rule()?,
        },
        "cache" => DeviceSpec::Cache {
            base: keys.base()?,
            memory: keys.required_size("memory")?,
        },
        "delay" => DeviceSpec::Delay {
            base: keys.base()?,
            delays: Delays {
                read: keys.duration("read")?.unwrap_or_default(),
                write: keys.duration("write")?.unwrap_or_default(),
                flush: keys.duration("flush")?.unwrap_or_default(),
                bandwidth: keys.size("bandwidth")?,
                seek: keys.duration("seek")?.unwrap_or_default(),
            },
        },
        _ => DeviceSpec::Raid10 {
            members: keys.members()?,
            chunk: keys.chunk()?,
            copies: keys.integer("copies")?.unwrap_or(2) as usize,
        },
    })
}

impl StackFile {
    /// Parses and checks a stack file's text.
    pub fn parse(text: &str) -> Result<StackFile, Error> {
        let root: Table = text
            .parse()
            .map_err(|e: toml::de::Error| toml_error(text, &e))?;
        let mut devices = BTreeMap::new();
        let mut tuning = Tuning::new();
        let mut exports = BTreeMap::new();
        let mut writeback = None;
        for (key, value) in &root {
            match (key.as_str(), value) {
                ("device", Value::Table(t)) => {
                    for (name, dv) in t {
                        let Value::Table(dt) = dv else {
                            return Err(err(format!(
                                "device '{name}' must be a table ([device.{name}])"
                            )));
                        };
                        devices.insert(name.clone(), parse_device(name, dt)?);
                    }
                }
                ("export", Value::Table(t)) => {
                    for (name, ev) in t {
                        let Value::Table(et) = ev else {
                            return Err(err(format!(
                                "export '{name}' must be a table ([export.{name}])"
                            )));
                        };
                        exports.insert(name.clone(), parse_export(name, et)?);
                    }
                }
                ("writeback", Value::Table(t)) => {
                    writeback = Some(crate::writeback::Writeback::parse(t)?);
                }
                ("tuning", Value::Table(t)) => {
                    for (k, v) in t {
                        if !TUNING_KEYS.contains(&k.as_str()) {
                            return Err(err(format!(
                                "tuning: unknown key '{k}' (known: {})",
                                TUNING_KEYS.join(", ")
                            )));
                        }
                        let Value::String(s) = v else {
                            return Err(err(format!("tuning: key '{k}' must be a string")));
                        };
                        tuning.insert(k.clone(), s.clone());
                    }
                }
                _ => {
                    return Err(err(format!(
                        "unknown top-level key '{key}' (known: [device.NAME] and [export.NAME] tables, [tuning] and [writeback])"
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
        };
        file.check_graph()?;
        file.check_exports()?;
        Ok(file)
    }

    /// Missing members, devices used twice, cycles.
    fn check_graph(&self) -> Result<(), Error> {
        let mut used_by: HashMap<&str, &str> = HashMap::new();
        for (name, spec) in &self.devices {
            let key = spec.members_key();
            for m in spec.members() {
                if !self.devices.contains_key(m) {
                    return Err(err(format!(
                        "device '{name}': key '{key}' names '{m}', which is not defined"
                    )));
                }
                if m == name {
                    return Err(err(format!(
                        "device '{name}': key '{key}' names the device itself"
                    )));
                }
                if let Some(other) = used_by.insert(m, name) {
                    let other_key = self.devices[other].members_key();
                    return Err(err(format!(
                        "device '{m}' is used twice (by key '{other_key}' of '{other}' and key '{key}' of '{name}'); a device can be a member of one device only"
                    )));
                }
            }
        }
        // With every device used at most once, the graph is a forest unless it has a cycle;
        // walk up from each device and give up after more steps than there are devices.
        for start in self.devices.keys() {
            let mut at = start.as_str();
            let mut path = vec![at];
            while let Some(&up) = used_by.get(at) {
                if up == start {
                    path.push(up);
                    // Walked from member to user; print from user to member, as written.
                    path.reverse();
                    let keys: BTreeSet<String> = path
                        .iter()
                        .map(|d| format!("'{}'", self.devices[*d].members_key()))
                        .collect();
                    let shown: Vec<String> = path.iter().map(|d| format!("'{d}'")).collect();
                    return Err(err(format!(
                        "devices form a cycle (each names the next in key {}): {}",
                        keys.into_iter().collect::<Vec<_>>().join(" or "),
                        shown.join(" -> ")
                    )));
                }
                path.push(up);
                at = up;
                if path.len() > self.devices.len() + 1 {
                    break;
                }
            }
        }
        Ok(())
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
            if !roots.contains(&e.device) {
                return Err(err(format!(
                    "export '{name}': key 'device' names '{}', which is a member of another device; export the device at the top instead",
                    e.device
                )));
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
        let used: Vec<&String> = self.devices.values().flat_map(|d| d.members()).collect();
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
        self.open_with(name, cairn_core::Switches::default())
    }

    /// Opens `name` and everything below it, with the switches that shape devices (the
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

    /// write-back mode of caches).
    pub fn open_with(
        &self,
        name: &str,
        switches: cairn_core::Switches,
    ) -> Result<Arc<dyn Device>, Error> {
        let mut opened = HashMap::new();
        // Every cache of the file shares one dirty budget, sized on their memory together.
        let cache_bytes = self.cache_bytes();
        let budget = if cache_bytes > 0 {
            let w = self.writeback.unwrap_or_default();
            Some(Arc::new(crate::writeback::Budget::new(&w, cache_bytes)?))
        } else {
            None
        };
        self.open_rec(name, &mut opened, &budget, switches)
    }

    fn open_rec(
        &self,
        name: &str,
        opened: &mut HashMap<String, Arc<dyn Device>>,
        budget: &Option<Arc<crate::writeback::Budget>>,
        switches: cairn_core::Switches,
    ) -> Result<Arc<dyn Device>, Error> {
        if let Some(d) = opened.get(name) {
            return Ok(d.clone());
        }
        let spec = self
            .devices
            .get(name)
            .ok_or_else(|| err(format!("no device '{name}'")))?;
        let members = spec
            .members()
            .iter()
            .map(|m| self.open_rec(m, opened, budget, switches))
            .collect::<Result<Vec<_>, _>>()?;
        let sizes: Vec<u64> = members.iter().map(|m| m.geometry().size_bytes).collect();
        let smallest = sizes.iter().copied().min().unwrap_or(0);
        let block = members
            .iter()
            .map(|m| u64::from(m.geometry().block_bytes))
            .max()
            .unwrap_or(512);
        let named = |e: Error| match e {
            Error::Invalid(m) => err(format!("device '{name}': {m}")),
            Error::Os { context, source } => Error::Os {
                context: format!("device '{name}': {context}"),
                source,
            },
            other => other,
        };
        let device: Arc<dyn Device> = match spec {
            DeviceSpec::Leaf(leaf) => crate::open(leaf, name).map_err(named)?,
            DeviceSpec::Linear { .. } => stacked(
                name,
                Arc::new(AnyLayout::Linear(Linear::new(&sizes, block))),
                members,
            )
            .map_err(named)?,
            DeviceSpec::Stripe { chunk, .. } => {
                let layout = Stripe::new(members.len(), *chunk, smallest, block).map_err(named)?;
                stacked(name, Arc::new(layout.into()), members).map_err(named)?
            }
            DeviceSpec::Mirror { .. } => {
                let layout = Mirror::new(members.len(), smallest).map_err(named)?;
                stacked(name, Arc::new(layout.into()), members).map_err(named)?
            }
            DeviceSpec::Fault { rule, .. } => Arc::new(WrapDevice::new(
                name,
                members[0].clone(),
                Arc::new(Faults::new(rule.clone())),
            )),
            DeviceSpec::Cache { memory, .. } => Arc::new(
                crate::cache::CacheDevice::new(
                    name,
                    members[0].clone(),
                    *memory,
                    budget.clone().expect("a budget when the file has caches"),
                    switches,
                )
                .map_err(named)?,
            ),
            DeviceSpec::Delay { delays, .. } => Arc::new(WrapDevice::new(
                name,
                members[0].clone(),
                Arc::new(crate::wrap::Delay::new(*delays)),
            )),
            DeviceSpec::Raid10 { chunk, copies, .. } => {
                let layout =
                    Raid10::new(members.len(), *copies, *chunk, smallest, block).map_err(named)?;
                stacked(name, Arc::new(layout.into()), members).map_err(named)?
            }
        };
        opened.insert(name.to_string(), device.clone());
        Ok(device)
    }
}

/// A TOML syntax error as one line, with the line number where the parser stopped.
fn toml_error(text: &str, e: &toml::de::Error) -> Error {
    let message: Vec<&str> = e
        .message()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let message = message.join("; ");
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

/// The device tree below `device`, one line each, indented, with sizes.
pub fn tree(device: &dyn Device) -> String {
    fn walk(d: &dyn Device, depth: usize, out: &mut String) {
        let g = d.geometry();
        out.push_str(&format!(
            "{:indent$}{} ({}) {}\n",
            "",
            d.name(),
            cairn_core::size::format_bytes(g.size_bytes),
            d.describe(),
            indent = depth * 2
        ));
        for c in d.children() {
            walk(&*c, depth + 1, out);
        }
    }
    let mut out = String::new();
    walk(device, 0, &mut out);
    out
}
