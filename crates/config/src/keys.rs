//! One `[device.NAME]` or `[export.NAME]` table to a typed spec, with every key checked.
//!
//! Each key has a type and, when it is a number, a range ([`super::limits`]); a value
//! outside it is refused with one line naming the device, the key, the value as written
//! and the range. Nothing here touches the file system or opens a device: checks that
//! need the members (their sizes and block sizes) happen when the stack is opened.

use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use cairn_core::size::{format_bytes, parse_duration, parse_size};
use cairn_core::{Error, Op};
use toml::{Table, Value};

use super::limits;
use super::{err, DeviceSpec, ExportSpec, DEFAULT_CHUNK_BYTES};
use cairn_leaves::spec::{Engine, LeafSpec};
use cairn_leaves::DEFAULT_BLOCK_BYTES;
use cairn_stacks::wrap::{Delays, FaultRule};

mod crypt;
pub use crypt::crypt_kdf;

const EXPORT_KEYS: [&str; 6] = [
    "device",
    "read_only",
    "description",
    "default",
    "fuse",
    "strict_alignment",
];

/// Parses one `[export.NAME]` table.
pub(super) fn parse_export(name: &str, table: &Table) -> Result<ExportSpec, Error> {
    let bad = |key: &str, what: &str| err(format!("export '{name}': key '{key}' {what}"));
    // Limits and a group (a throttle's keys) limit the export.
    let mut limited = Table::new();
    for (k, v) in table {
        if THROTTLE_KEYS[1..].contains(&k.as_str()) {
            limited.insert(k.clone(), v.clone());
        }
    }
    for key in table.keys().filter(|k| !limited.contains_key(*k)) {
        if !EXPORT_KEYS.contains(&key.as_str()) {
            return Err(err(format!(
                "export '{name}': unknown key '{}' (known: {}, and a throttle's limits and group)",
                shown(key),
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
        Some(Value::String(d)) if d.len() <= limits::DESCRIPTION_BYTES_MAX => d.clone(),
        Some(Value::String(_)) => {
            return Err(bad(
                "description",
                &format!("is longer than {} bytes", limits::DESCRIPTION_BYTES_MAX),
            ))
        }
        Some(_) => return Err(bad("description", "must be a string")),
    };
    let fuse = match table.get("fuse") {
        None => None,
        Some(Value::String(p)) if !p.is_empty() && !p.contains('\0') => {
            Some(std::path::PathBuf::from(p))
        }
        Some(_) => {
            return Err(bad(
                "fuse",
                "must be the path of a file to mount the export on",
            ))
        }
    };
    let throttle = if limited.is_empty() {
        None
    } else {
        limited.insert("base".into(), Value::String(device.clone()));
        let keys = Keys {
            device: name,
            noun: "export",
            kind: "throttle",
            table: &limited,
            known: &THROTTLE_KEYS,
        };
        match keys.throttle()? {
            DeviceSpec::Throttle { group, limits, .. } => Some((group, limits)),
            _ => None,
        }
    };
    Ok(ExportSpec {
        throttle,
        device,
        read_only: flag("read_only")?,
        description,
        default: flag("default")?,
        fuse,
        strict_alignment: flag("strict_alignment")?,
    })
}

/// Reads the typed keys of one device table and refuses the rest.
struct Keys<'a> {
    device: &'a str,
    /// What `device` names: "device", or "export" (an export's limits).
    noun: &'static str,
    kind: &'a str,
    table: &'a Table,
    known: &'static [&'static str],
}

impl Keys<'_> {
    fn check_unknown(&self) -> Result<(), Error> {
        for key in self.table.keys() {
            if key != "type" && !self.known.contains(&key.as_str()) {
                // `bitmaps` is taken out of a device's table before its keys are read
                // (split_bitmaps): every device but a pool and an export's limits has it.
                let bitmaps = self.noun == "device" && self.kind != "thin-pool";
                return Err(err(format!(
                    "{} '{}': unknown key '{}' for type {} (known: {}{})",
                    self.noun,
                    self.device,
                    shown(key),
                    self.kind,
                    self.known.join(", "),
                    if bitmaps { ", bitmaps" } else { "" }
                )));
            }
        }
        Ok(())
    }

    /// The keys of `type = "rbd"`: `pool`, `image` (both needed), `namespace`, `conf`,
    /// `id`, `snapshot`, `timeout` and `connection`.
    fn rbd(&self) -> Result<cairn_leaves::rbd::RbdTarget, Error> {
        use cairn_leaves::spec::rbd_name;
        let name = |key: &str, what: &str, needed: bool| -> Result<Option<String>, Error> {
            match self.string(key)? {
                Some(v) => {
                    rbd_name(what, v).map_err(|e| self.bad(key, &format!("is wrong: {e}")))?;
                    Ok(Some(v.to_string()))
                }
                None if needed => Err(self.bad(key, "is missing")),
                None => Ok(None),
            }
        };
        let pool = name("pool", "pool", true)?.unwrap_or_default();
        let image = name("image", "image", true)?.unwrap_or_default();
        let conf = match self.string("conf")? {
            Some(p) if p.is_empty() || p.contains('\0') => {
                return Err(self.bad("conf", "must be a file's path (not empty, no NUL)"))
            }
            p => p.map(PathBuf::from),
        };
        let timeout = match self.duration_in(
            "timeout",
            cairn_leaves::spec::RBD_TIMEOUT_MIN..=cairn_leaves::spec::RBD_TIMEOUT_MAX,
            true,
        )? {
            Some(d) => cairn_leaves::spec::rbd_timeout(d)
                .map_err(|e| self.bad("timeout", &e.to_string()))?,
            None => cairn_leaves::rbd::DEFAULT_TIMEOUT,
        };
        Ok(cairn_leaves::rbd::RbdTarget {
            pool,
            namespace: name("namespace", "namespace", false)?,
            image,
            conf,
            id: name("id", "client id", false)?.map(|id| {
                id.strip_prefix("client.")
                    .map_or(id.clone(), str::to_string)
            }),
            snapshot: name("snapshot", "snapshot", false)?,
            timeout,
            connection: match self.string("connection")? {
                Some(c) => cairn_leaves::rbd::Connection::parse(c)
                    .map_err(|e| self.bad("connection", &format!("is wrong: {e}")))?,
                None => cairn_leaves::rbd::Connection::default(),
            },
        })
    }

    /// A `thin-pool` device's keys.
    /// The limits of a throttle's table, and which of the six it names. `live`: a
    /// change to a running throttle, where 0 takes a limit away.
    fn limits(&self, live: bool) -> Result<(cairn_services::throttle::Limits, [bool; 6]), Error> {
        use cairn_services::throttle::{Limits, Rate};
        let named = |key: &str| {
            [
                key.to_string(),
                format!("{key}_max"),
                format!("{key}_max_length"),
            ]
            .iter()
            .any(|k| self.table.contains_key(k))
        };
        let rate = |key: &str, bytes: bool| -> Result<Rate, Error> {
            let value = |k: &str| -> Result<u64, Error> {
                let v = if bytes {
                    self.size(k)?
                } else {
                    self.integer(k)?
                };
                match v {
                    Some(0) if live && k == key => Ok(0),
                    Some(0) => Err(self.bad(k, "is 0: leave the key out for no limit")),
                    Some(v) => Ok(v),
                    None => Ok(0),
                }
            };
            let length = format!("{key}_max_length");
            let r = Rate {
                avg: value(key)?,
                max: value(&format!("{key}_max"))?,
                max_length: match self.integer(&length)? {
                    Some(0) => return Err(self.bad(&length, "is 0: leave the key out")),
                    Some(v) => v,
                    None => 0,
                },
            };
            r.check(key)
                .map_err(|e| err(format!("{} '{}': {e}", self.noun, self.device)))?;
            Ok(r)
        };
        let limits = Limits {
            iops: rate("iops", false)?,
            iops_read: rate("iops_read", false)?,
            iops_write: rate("iops_write", false)?,
            bps: rate("bps", true)?,
            bps_read: rate("bps_read", true)?,
            bps_write: rate("bps_write", true)?,
        };
        let keys = [
            "iops",
            "iops_read",
            "iops_write",
            "bps",
            "bps_read",
            "bps_write",
        ];
        Ok((limits, keys.map(named)))
    }

    /// A `throttle` device: its base, its group, and the limits it gives (none: those of
    /// its group, given by another device of the group).
    fn throttle(&self) -> Result<DeviceSpec, Error> {
        use cairn_services::throttle::Limits;
        let group = match self.string("group")? {
            Some(g) => {
                super::graph::check_name("group", g)?;
                Some(g.to_string())
            }
            None => None,
        };
        let limits = self.limits(false)?.0;
        let given = limits != Limits::default();
        if given {
            limits
                .check()
                .map_err(|e| err(format!("{} '{}': {e}", self.noun, self.device)))?;
        } else if group.is_none() {
            return Err(err(format!(
                "{} '{}': a throttle needs a limit (iops, iops_read, iops_write, bps, bps_read, bps_write) or a group that has them",
                self.noun, self.device
            )));
        }
        Ok(DeviceSpec::Throttle {
            base: self.base()?,
            group,
            limits: given.then_some(limits),
        })
    }

    fn thin_pool(&self) -> Result<DeviceSpec, Error> {
        use cairn_services::thin::pool::{LowWater, PoolOptions};
        use cairn_services::thin::superblock::{BLOCK_MAX, BLOCK_MIN};
        let data = self
            .string("data")?
            .ok_or_else(|| self.bad("data", "is missing"))?
            .to_string();
        let mut devices = vec![data];
        devices.extend(self.string("metadata")?.map(str::to_string));
        let block_bytes = self.size_in("block", BLOCK_MIN..=BLOCK_MAX, "")?;
        if let Some(b) = block_bytes {
            if !b.is_power_of_two() {
                return Err(self.bad(
                    "block",
                    &format!("= {} must be a power of two", self.written("block")),
                ));
            }
        }
        let low_water = match self.table.get("low_water") {
            None => LowWater::default(),
            Some(Value::String(s)) if s.trim_end().ends_with('%') => {
                let n = s.trim_end().trim_end_matches('%').trim();
                match n.parse::<u8>() {
                    Ok(p) if p <= 100 => LowWater::Percent(p),
                    _ => return Err(self.out_of_range("low_water", "a percentage from 0% to 100%")),
                }
            }
            Some(_) => LowWater::Bytes(self.required("low_water", self.size("low_water")?)?),
        };
        Ok(DeviceSpec::ThinPool {
            devices,
            options: PoolOptions {
                block_bytes,
                low_water,
                repair: false,
            },
        })
    }

    fn bad(&self, key: &str, what: &str) -> Error {
        err(format!(
            "{} '{}': key '{key}' {what}",
            self.noun, self.device
        ))
    }

    /// The value of `key` as written (TOML syntax, cut short), for messages.
    fn written(&self, key: &str) -> String {
        self.table
            .get(key)
            .map(|v| shown(&v.to_string()))
            .unwrap_or_default()
    }

    /// `key = VALUE is out of range (RANGE)`.
    fn out_of_range(&self, key: &str, range: &str) -> Error {
        self.bad(
            key,
            &format!("= {} is out of range ({range})", self.written(key)),
        )
    }

    fn size(&self, key: &str) -> Result<Option<u64>, Error> {
        match self.table.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => parse_size(s)
                .map(Some)
                .map_err(|e| self.bad(key, &format!("is {}", shown(&e)))),
            Some(Value::Integer(n)) if *n >= 0 => Ok(Some(*n as u64)),
            Some(_) => Err(self.bad(key, "must be a size such as \"10G\" or a positive number")),
        }
    }

    /// A size within `range`; `why` says where the upper end comes from, if anywhere.
    fn size_in(
        &self,
        key: &str,
        range: RangeInclusive<u64>,
        why: &str,
    ) -> Result<Option<u64>, Error> {
        let Some(v) = self.size(key)? else {
            return Ok(None);
        };
        if !range.contains(&v) {
            let mut text = bytes_range(&range);
            if !why.is_empty() {
                text += &format!(", {why}");
            }
            return Err(self.out_of_range(key, &text));
        }
        Ok(Some(v))
    }

    fn required(&self, key: &str, v: Option<u64>) -> Result<u64, Error> {
        v.ok_or_else(|| self.bad(key, "is missing"))
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

    /// A duration within `range`: a string with a unit, or (with `bare_seconds`) a number
    /// of seconds.
    fn duration_in(
        &self,
        key: &str,
        range: RangeInclusive<Duration>,
        bare_seconds: bool,
    ) -> Result<Option<Duration>, Error> {
        let out = || self.out_of_range(key, &duration_range(&range));
        let d = match self.table.get(key) {
            None => return Ok(None),
            Some(Value::String(s)) => {
                parse_duration(s).map_err(|e| self.bad(key, &format!("is {}", shown(&e))))?
            }
            Some(Value::Integer(n)) if bare_seconds && *n >= 0 => Duration::from_secs(*n as u64),
            Some(Value::Float(f)) if bare_seconds && *f >= 0.0 && f.is_finite() => {
                // Checked before converting: a huge number of seconds has no Duration.
                if *f > range.end().as_secs_f64() {
                    return Err(out());
                }
                Duration::from_secs_f64(*f)
            }
            Some(_) if bare_seconds => {
                return Err(self.bad(
                    key,
                    "must be a duration such as \"30s\" or a number of seconds",
                ))
            }
            Some(_) => return Err(self.bad(key, "must be a duration such as \"1ms\"")),
        };
        if !range.contains(&d) {
            return Err(out());
        }
        Ok(Some(d))
    }

    fn base(&self) -> Result<String, Error> {
        Ok(self
            .string("base")?
            .ok_or_else(|| self.bad("base", "is missing"))?
            .to_string())
    }

    fn block(&self) -> Result<u32, Error> {
        let b = self
            .size_in("block", limits::BLOCK, "")?
            .unwrap_or(u64::from(DEFAULT_BLOCK_BYTES));
        if !b.is_power_of_two() {
            return Err(self.bad(
                "block",
                &format!("= {} must be a power of two", self.written("block")),
            ));
        }
        Ok(b as u32)
    }

    /// The size of a null or mem device: whole blocks, up to `max`.
    fn leaf_size(&self, block: u32, max: u64, why: &str) -> Result<u64, Error> {
        let size = self.size_in("size", u64::from(block)..=max, why)?;
        let size = self.required("size", size)?;
        if !size.is_multiple_of(u64::from(block)) {
            return Err(self.bad(
                "size",
                &format!(
                    "= {} is not a whole number of {block}-byte blocks",
                    self.written("size")
                ),
            ));
        }
        Ok(size)
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
                        "must be EIO, ENOSPC, EPERM, EINVAL, ENODEV, ETIMEDOUT or a number from 1 to 4095",
                    ))
                }
            },
            Some(_) => {
                return Err(self.bad(
                    "errno",
                    "must be a name such as \"EIO\" or a number from 1 to 4095",
                ))
            }
        };
        Ok(FaultRule {
            ops,
            after_ios: self.integer("after_ios")?,
            after: self.duration_in("after_secs", limits::AFTER, true)?,
            probability,
            sectors,
            times: self.integer("times")?,
            errno,
            power_cut: self.bool("power_cut")?.unwrap_or(false),
            torn: false,
        })
    }

    /// A list of member names: `min` to [`limits::MEMBERS_MAX`], each once.
    fn members(&self, min: usize, max: usize) -> Result<Vec<String>, Error> {
        let list = match self.table.get("members") {
            None => return Err(self.bad("members", "is missing")),
            Some(Value::Array(a)) => a,
            Some(_) => return Err(self.bad("members", "must be a list of device names")),
        };
        if list.is_empty() {
            return Err(self.bad("members", "is empty"));
        }
        // Counted before anything else: the check for names given twice is quadratic.
        if !(min..=max).contains(&list.len()) {
            return Err(self.bad(
                "members",
                &format!(
                    "lists {} devices; a {} has from {min} to {max}",
                    list.len(),
                    self.kind
                ),
            ));
        }
        let mut out: Vec<String> = Vec::with_capacity(list.len());
        for v in list {
            let Value::String(name) = v else {
                return Err(self.bad("members", "must be a list of device names"));
            };
            if name != super::MISSING && out.contains(name) {
                return Err(self.bad("members", &format!("names '{}' twice", shown(name))));
            }
            out.push(name.clone());
        }
        Ok(out)
    }

    /// `spares`: device names that take the place of members that fail (only with
    /// metadata: a spare's superblock says whose it is), none of them a member, each once.
    fn spares(&self, metadata: bool, members: &[String]) -> Result<Vec<String>, Error> {
        let list = match self.table.get("spares") {
            None => return Ok(Vec::new()),
            Some(Value::Array(a)) => a,
            Some(_) => return Err(self.bad("spares", "must be a list of device names")),
        };
        if !metadata {
            return Err(self.bad(
                "spares",
                "needs metadata (a spare's superblock says whose spare it is), not metadata = \"none\"",
            ));
        }
        if list.len() > limits::MEMBERS_MAX {
            return Err(self.bad(
                "spares",
                &format!(
                    "lists {} devices; at most {}",
                    list.len(),
                    limits::MEMBERS_MAX
                ),
            ));
        }
        let mut out: Vec<String> = Vec::with_capacity(list.len());
        for v in list {
            let Value::String(name) = v else {
                return Err(self.bad("spares", "must be a list of device names"));
            };
            if name == super::MISSING {
                return Err(self.bad("spares", "names 'missing', which is for members only"));
            }
            if members.contains(name) {
                return Err(self.bad("spares", &format!("names '{}', a member too", shown(name))));
            }
            if out.contains(name) {
                return Err(self.bad("spares", &format!("names '{}' twice", shown(name))));
            }
            out.push(name.clone());
        }
        Ok(out)
    }

    /// `metadata = "1"` (superblocks on the members, format version 1: the default) or
    /// `"none"` (the raw layout, asked for by name); `missing` members are allowed only
    /// with metadata and only when `missing_allowed` (redundant layouts).
    fn metadata(&self, missing_allowed: bool) -> Result<bool, Error> {
        let on = match self.table.get("metadata") {
            None => true,
            Some(Value::String(s)) if s == "1" => true,
            Some(Value::String(s)) if s == "none" => false,
            Some(_) => {
                return Err(self.bad(
                    "metadata",
                    "must be \"1\" (superblocks on the members) or \"none\"",
                ))
            }
        };
        let names_missing = matches!(self.table.get("members"), Some(Value::Array(a))
            if a.iter().any(|v| v.as_str() == Some(super::MISSING)));
        if names_missing && !(on && missing_allowed) {
            return Err(self.bad(
                "members",
                if on {
                    "names 'missing', but a linear or stripe cannot run without a member"
                } else {
                    "names 'missing', which needs metadata (the superblocks record what is absent), not metadata = \"none\""
                },
            ));
        }
        Ok(on)
    }

    /// `rebuild_min` and `rebuild_max` (bytes a second), `bitmap` (a region size or
    /// "none") and `bitmap_delay`; only with metadata.
    fn rebuild_rate(&self, metadata: bool) -> Result<super::ArrayOptions, Error> {
        let mut rate = super::ArrayOptions::default();
        for key in [
            "rebuild_min",
            "rebuild_max",
            "bitmap",
            "bitmap_delay",
            "readd",
        ] {
            if self.table.contains_key(key) && !metadata {
                let why = if key.starts_with("bitmap") {
                    "needs metadata (the bitmap is kept in the superblocks), not metadata = \"none\""
                } else if key == "readd" {
                    "needs metadata (a member is known again by its superblock), not metadata = \"none\""
                } else {
                    "needs metadata (only such arrays rebuild), not metadata = \"none\""
                };
                return Err(self.bad(key, why));
            }
        }
        if matches!(self.table.get("bitmap"), Some(Value::String(s)) if s == "none") {
            rate.bitmap_region = 0;
        } else if let Some(r) = self.size_in("bitmap", limits::BITMAP_REGION, "")? {
            if !r.is_power_of_two() {
                return Err(self.bad(
                    "bitmap",
                    &format!(
                        "= {} must be a power of two (a region size such as \"64M\"), or \"none\"",
                        self.written("bitmap")
                    ),
                ));
            }
            rate.bitmap_region = r;
        }
        if let Some(d) = self.duration_in("bitmap_delay", limits::BITMAP_DELAY, false)? {
            if rate.bitmap_region == 0 {
                return Err(self.bad("bitmap_delay", "is set, but bitmap = \"none\""));
            }
            rate.bitmap_delay = d;
        }
        if matches!(self.table.get("readd"), Some(Value::String(s)) if s == "none") {
            rate.readd = None;
        } else if let Some(d) = self.duration_in("readd", limits::READD, false)? {
            rate.readd = Some(d);
        }
        if let Some(min) = self.size_in("rebuild_min", limits::BANDWIDTH_MIN..=u64::MAX, "")? {
            rate.min_bytes = min;
        }
        if let Some(max) = self.size_in("rebuild_max", limits::BANDWIDTH_MIN..=u64::MAX, "")? {
            if max < rate.min_bytes {
                return Err(self.bad(
                    "rebuild_max",
                    &format!(
                        "= {} is below rebuild_min ({} a second)",
                        self.written("rebuild_max"),
                        format_bytes(rate.min_bytes)
                    ),
                ));
            }
            rate.max_bytes = max;
        }
        Ok(rate)
    }

    fn chunk(&self) -> Result<u64, Error> {
        let chunk = self
            .size_in("chunk", limits::CHUNK, "")?
            .unwrap_or(DEFAULT_CHUNK_BYTES);
        if !chunk.is_power_of_two() {
            return Err(self.bad("chunk", &format!("must be a power of two, not {chunk}")));
        }
        Ok(chunk)
    }
}

/// Parses one `[device.NAME]` table; `memory_bytes` is this machine's memory (the upper
/// end of a cache's `memory`).
/// Takes the key every device may have, `bitmaps` (the path of its dirty bitmaps' store),
/// out of its table: the table without it, and the path.
pub(super) fn split_bitmaps(name: &str, table: &Table) -> Result<(Table, Option<PathBuf>), Error> {
    let Some(v) = table.get("bitmaps") else {
        return Ok((table.clone(), None));
    };
    let path = match v {
        Value::String(p) if !p.is_empty() && !p.contains('\0') => PathBuf::from(p),
        _ => {
            return Err(err(format!(
                "device '{name}': key 'bitmaps' must be the path of a file for its dirty bitmaps (not empty, no NUL)"
            )))
        }
    };
    if table.get("type").and_then(Value::as_str) == Some("thin-pool") {
        return Err(err(format!(
            "device '{name}': a thin pool cannot hold dirty bitmaps (it serves no data of its own): set 'bitmaps' on its thin volumes"
        )));
    }
    let mut rest = table.clone();
    rest.remove("bitmaps");
    Ok((rest, Some(path)))
}

/// A throttle's keys: `base`, `group`, and each limit with `_max` and `_max_length`.
const THROTTLE_KEYS: [&str; 20] = [
    "base",
    "group",
    "iops",
    "iops_max",
    "iops_max_length",
    "iops_read",
    "iops_read_max",
    "iops_read_max_length",
    "iops_write",
    "iops_write_max",
    "iops_write_max_length",
    "bps",
    "bps_max",
    "bps_max_length",
    "bps_read",
    "bps_read_max",
    "bps_read_max_length",
    "bps_write",
    "bps_write_max",
    "bps_write_max_length",
];

/// `KEY=VALUE` words (an admin command's) as a table of the stack file's keys: numbers
/// as integers, anything else as strings.
fn words_table(words: &[&str]) -> Result<Table, Error> {
    let mut table = Table::new();
    for w in words {
        let Some((k, v)) = w.split_once('=') else {
            return Err(err(format!("'{}' is not KEY=VALUE", shown(w))));
        };
        let value = match v.parse::<i64>() {
            Ok(n) => Value::Integer(n),
            Err(_) => Value::String(v.to_string()),
        };
        table.insert(k.to_string(), value);
    }
    Ok(table)
}

/// A live change of throttle `device`'s `limits`: `words` as `KEY=VALUE` (the stack
/// file's keys; 0 takes a limit away). Returns the limits after it; the six not named
/// stay as they are.
pub(super) fn change_limits(
    device: &str,
    limits: cairn_services::throttle::Limits,
    words: &[&str],
) -> Result<cairn_services::throttle::Limits, Error> {
    let table = words_table(words)?;
    let keys = Keys {
        device,
        noun: "device",
        kind: "throttle",
        table: &table,
        known: &THROTTLE_KEYS[2..],
    };
    keys.check_unknown()?;
    let (given, named) = keys.limits(true)?;
    let mut now = limits;
    let slots = [
        (&mut now.iops, given.iops),
        (&mut now.iops_read, given.iops_read),
        (&mut now.iops_write, given.iops_write),
        (&mut now.bps, given.bps),
        (&mut now.bps_read, given.bps_read),
        (&mut now.bps_write, given.bps_write),
    ];
    for ((slot, new), named) in slots.into_iter().zip(named) {
        if named {
            *slot = new;
        }
    }
    now.check()
        .map_err(|e| err(format!("device '{device}': {e}")))?;
    Ok(now)
}

pub(super) fn parse_device(
    name: &str,
    table: &Table,
    memory_bytes: u64,
) -> Result<DeviceSpec, Error> {
    let kind = device_type(name, table)?;
    let keys = Keys {
        device: name,
        noun: "device",
        kind,
        table,
        known: known_keys(name, kind)?,
    };
    if kind == "crypt" {
        keys.no_inline_secret()?;
    }
    keys.check_unknown()?;
    Ok(match kind {
        "null" => keys.null()?,
        "mem" => keys.mem()?,
        "file" => keys.file()?,
        "nbd" => keys.nbd()?,
        "rbd" => DeviceSpec::Leaf(LeafSpec::Rbd(keys.rbd()?)),
        "linear" => DeviceSpec::Linear {
            members: keys.members(1, limits::MEMBERS_MAX)?,
            metadata: keys.metadata(false)?,
        },
        "mirror" => keys.mirror()?,
        "stripe" => DeviceSpec::Stripe {
            members: keys.members(1, limits::MEMBERS_MAX)?,
            chunk: keys.chunk()?,
            metadata: keys.metadata(false)?,
        },
        "fault" => DeviceSpec::Fault {
            base: keys.base()?,
            rule: keys.fault_rule()?,
        },
        "cache" => keys.cache(memory_bytes)?,
        "thin-pool" => keys.thin_pool()?,
        "throttle" => keys.throttle()?,
        "crypt" => keys.crypt()?,
        "thin" => keys.thin()?,
        "delay" => keys.delay()?,
        // known_keys refused every other type.
        _ => keys.raid10()?,
    })
}

/// The device's `type`, or why it has none (with a hint when the header's name had an
/// unquoted dot).
fn device_type<'a>(name: &str, table: &'a Table) -> Result<&'a str, Error> {
    match table.get("type") {
        Some(Value::String(t)) => Ok(t.as_str()),
        Some(_) => Err(err(format!("device '{name}': key 'type' must be a string"))),
        None => {
            // `[device.c.img]` is device `c` holding a table `img`: a name with a dot
            // must be quoted.
            let nested: Vec<&String> = table
                .iter()
                .filter(|(_, v)| v.is_table())
                .map(|(k, _)| k)
                .collect();
            if !nested.is_empty() && nested.len() == table.len() {
                let dotted = format!("{name}.{}", nested[0]);
                return Err(err(format!(
                    "device '{name}': key 'type' is missing (the header [device.{dotted}] names a device '{name}' with a table '{}' in it: a name with a dot is quoted, [device.\"{dotted}\"])",
                    nested[0]
                )));
            }
            Err(err(format!("device '{name}': key 'type' is missing")))
        }
    }
}

/// The keys a device of type `kind` may have, or why `kind` is not a type.
fn known_keys(name: &str, kind: &str) -> Result<&'static [&'static str], Error> {
    Ok(match kind {
        "null" => &["size", "block"],
        "mem" => &["size", "block", "volatile"],
        "file" => &["path", "size", "engine", "direct", "sparse"],
        "nbd" => &["uri", "connections", "timeout"],
        "rbd" => &[
            "pool",
            "namespace",
            "image",
            "conf",
            "id",
            "snapshot",
            "timeout",
            "connection",
        ],
        "linear" => &["members", "metadata"],
        "mirror" => &[
            "members",
            "spares",
            "metadata",
            "rebuild_min",
            "rebuild_max",
            "bitmap",
            "bitmap_delay",
            "readd",
        ],
        "stripe" => &["members", "chunk", "metadata"],
        "raid10" => &[
            "members",
            "spares",
            "chunk",
            "copies",
            "metadata",
            "rebuild_min",
            "rebuild_max",
            "bitmap",
            "bitmap_delay",
            "readd",
        ],
        "fault" => &[
            "base",
            "fail",
            "after_ios",
            "after_secs",
            "probability",
            "sectors",
            "times",
            "errno",
            "power_cut",
        ],
        "delay" => &["base", "read", "write", "flush", "bandwidth", "seek"],
        "cache" => &["base", "memory"],
        "thin-pool" => &["data", "metadata", "block", "low_water"],
        "thin" => &["pool", "volume", "size"],
        "throttle" => &THROTTLE_KEYS,
        "crypt" => &crypt::CRYPT_KEYS,
        _ => {
            return Err(err(format!(
                "device '{name}': unknown type '{}' (known: null, mem, file, nbd, rbd, linear, stripe, mirror, raid10, fault, delay, cache, thin-pool, thin, throttle, crypt)",
                shown(kind)
            )))
        }
    })
}

/// One method per device type whose keys take more than a line to read.
impl Keys<'_> {
    fn null(&self) -> Result<DeviceSpec, Error> {
        let block_bytes = self.block()?;
        Ok(DeviceSpec::Leaf(LeafSpec::Null {
            size_bytes: self.leaf_size(block_bytes, limits::SIZE_MAX, "")?,
            block_bytes,
        }))
    }

    fn mem(&self) -> Result<DeviceSpec, Error> {
        let block_bytes = self.block()?;
        Ok(DeviceSpec::Leaf(LeafSpec::Mem {
            size_bytes: self.leaf_size(
                block_bytes,
                cairn_leaves::mem::MEM_SIZE_MAX,
                "the most a mem device can have",
            )?,
            block_bytes,
            volatile: self.bool("volatile")?.unwrap_or(false),
        }))
    }

    fn file(&self) -> Result<DeviceSpec, Error> {
        let path = self
            .string("path")?
            .ok_or_else(|| self.bad("path", "is missing"))?;
        if path.is_empty() || path.contains('\0') {
            return Err(self.bad("path", "must be a file's path (not empty, no NUL)"));
        }
        Ok(DeviceSpec::Leaf(LeafSpec::File {
            path: PathBuf::from(path),
            engine: match self.string("engine")? {
                Some(e) => Engine::parse(e).map_err(|e| {
                    self.bad("engine", &format!("is wrong: {}", shown(&e.to_string())))
                })?,
                None => Engine::default(),
            },
            direct: self.bool("direct")?.unwrap_or(false),
            size_bytes: self.size_in("size", limits::FILE_SIZE, "")?,
            sparse: self.bool("sparse")?.unwrap_or(false),
        }))
    }

    fn nbd(&self) -> Result<DeviceSpec, Error> {
        use cairn_nbd::client::{CONNECTIONS_MAX, DEFAULT_TIMEOUT};
        let uri = self
            .string("uri")?
            .ok_or_else(|| self.bad("uri", "is missing"))?;
        cairn_nbd::uri::NbdUri::parse(uri)
            .map_err(|e| self.bad("uri", &format!("is wrong: {}", shown(&e.to_string()))))?;
        let connections = match self.integer("connections")? {
            None => 1,
            Some(n) if (1..=u64::from(CONNECTIONS_MAX)).contains(&n) => n as u32,
            Some(_) => {
                return Err(
                    self.out_of_range("connections", &format!("from 1 to {CONNECTIONS_MAX}"))
                )
            }
        };
        Ok(DeviceSpec::Leaf(LeafSpec::Nbd {
            uri: uri.to_string(),
            connections,
            timeout: self
                .duration_in(
                    "timeout",
                    cairn_leaves::spec::NBD_TIMEOUT_MIN..=cairn_leaves::spec::NBD_TIMEOUT_MAX,
                    true,
                )?
                .unwrap_or(DEFAULT_TIMEOUT),
        }))
    }

    fn mirror(&self) -> Result<DeviceSpec, Error> {
        let metadata = self.metadata(true)?;
        let members = self.members(2, cairn_stacks::stack::COPIES_MAX)?;
        Ok(DeviceSpec::Mirror {
            spares: self.spares(metadata, &members)?,
            members,
            metadata,
            rebuild: self.rebuild_rate(metadata)?,
        })
    }

    fn raid10(&self) -> Result<DeviceSpec, Error> {
        let metadata = self.metadata(true)?;
        let members = self.members(2, limits::MEMBERS_MAX)?;
        let most = members.len().min(cairn_stacks::stack::COPIES_MAX);
        let copies = match self.integer("copies")? {
            None => 2,
            Some(c) if (2..=most as u64).contains(&c) => c as usize,
            Some(_) => {
                return Err(self.out_of_range(
                    "copies",
                    &format!("from 2 to the number of members, {most}"),
                ))
            }
        };
        Ok(DeviceSpec::Raid10 {
            spares: self.spares(metadata, &members)?,
            members,
            chunk: self.chunk()?,
            copies,
            metadata,
            rebuild: self.rebuild_rate(metadata)?,
        })
    }

    /// A cache may take at most half of this machine's memory (`memory_bytes`).
    fn cache(&self, memory_bytes: u64) -> Result<DeviceSpec, Error> {
        let most = memory_bytes / 2;
        let memory = self.size_in(
            "memory",
            limits::CACHE_MIN..=most.max(limits::CACHE_MIN),
            "half of this machine's memory",
        )?;
        Ok(DeviceSpec::Cache {
            base: self.base()?,
            memory: self.required("memory", memory)?,
        })
    }

    /// A thin volume: `volume` defaults to the device's name when that is a valid one.
    fn thin(&self) -> Result<DeviceSpec, Error> {
        use cairn_services::thin::pool::check_name;
        // The keys are checked in the order the table lists them: pool, volume, size.
        let pool = self
            .string("pool")?
            .ok_or_else(|| self.bad("pool", "is missing"))?
            .to_string();
        let volume = match self.string("volume")? {
            Some(v) => {
                check_name(v).map_err(|e| self.bad("volume", &format!("is wrong: {e}")))?;
                v.to_string()
            }
            None => {
                check_name(self.device).map_err(|e| {
                    self.bad(
                        "volume",
                        &format!("is missing, and the device's name will not do: {e}"),
                    )
                })?;
                self.device.to_string()
            }
        };
        Ok(DeviceSpec::Thin {
            pool,
            volume,
            size: self.size("size")?,
        })
    }

    fn delay(&self) -> Result<DeviceSpec, Error> {
        let latency = |key: &str| {
            self.duration_in(key, Duration::ZERO..=limits::LATENCY_MAX, false)
                .map(Option::unwrap_or_default)
        };
        Ok(DeviceSpec::Delay {
            base: self.base()?,
            delays: Delays {
                read: latency("read")?,
                write: latency("write")?,
                flush: latency("flush")?,
                bandwidth: match self.size("bandwidth")? {
                    Some(b) if b < limits::BANDWIDTH_MIN => {
                        return Err(self.out_of_range(
                            "bandwidth",
                            &format!("at least {} a second", format_bytes(limits::BANDWIDTH_MIN)),
                        ))
                    }
                    b => b,
                },
                seek: latency("seek")?,
            },
        })
    }
}

/// `from 64KiB to 12GiB`, or `at least 1MiB` when the range is open above.
pub(super) fn bytes_range(range: &RangeInclusive<u64>) -> String {
    if *range.end() == u64::MAX {
        format!("at least {}", format_bytes(*range.start()))
    } else {
        format!(
            "from {} to {}",
            format_bytes(*range.start()),
            format_bytes(*range.end())
        )
    }
}

/// `from 0s to 10s`.
pub(super) fn duration_range(range: &RangeInclusive<Duration>) -> String {
    format!(
        "from {} to {}",
        format_duration(*range.start()),
        format_duration(*range.end())
    )
}

/// A duration in the largest unit that gives a whole number: `10s`, `365d`, `1ms`.
pub(crate) fn format_duration(d: Duration) -> String {
    const UNITS: [(u128, &str); 7] = [
        (86_400_000_000_000, "d"),
        (3_600_000_000_000, "h"),
        (60_000_000_000, "min"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
        (1_000, "us"),
        (1, "ns"),
    ];
    let ns = d.as_nanos();
    if ns == 0 {
        return "0s".into();
    }
    let (scale, unit) = UNITS
        .iter()
        .find(|(scale, _)| ns.is_multiple_of(*scale))
        .copied()
        .unwrap_or((1, "ns"));
    format!("{}{unit}", ns / scale)
}

/// Text from the input, made safe for a one-line message: control characters escaped,
/// and cut short when long.
pub(crate) fn shown(text: &str) -> String {
    escaped(text, 80)
}

/// [`shown`] without cutting short.
pub(super) fn shown_all(text: &str) -> String {
    escaped(text, usize::MAX)
}

fn escaped(text: &str, max_chars: usize) -> String {
    let mut out = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == max_chars {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}
