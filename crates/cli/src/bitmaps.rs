//! `cairn admin SOCKET bitmap ...`: the dirty bitmaps of served devices, by hand.

use std::sync::Arc;

use cairn_core::Device;
use cairn_services::dirty::bitmap::BitmapInfo;
use cairn_services::dirty::store::Store;

use crate::admin_error::{self, AdminError};
use crate::view::all_devices;

/// The default granularity of `bitmap add`: 64 KiB per bit.
pub const GRANULARITY: u64 = 64 << 10;

const USAGE: &str = "bitmap list DEVICE [--json] | add DEVICE NAME [GRANULARITY] | remove DEVICE NAME | clear DEVICE NAME | merge DEVICE TARGET SOURCE...";

/// The bitmap store of device `d`, if it has one.
pub(crate) fn store_of(d: &Arc<dyn Device>) -> Option<Arc<Store>> {
    d.capability::<Store>()
}

/// `bitmap ACTION DEVICE ...`.
pub(crate) fn command(args: &[&str], roots: &[Arc<dyn Device>]) -> Result<String, AdminError> {
    let usage = || AdminError::Usage(USAGE.into());
    let (Some(&action), Some(&device)) = (args.first(), args.get(1)) else {
        return Err(usage());
    };
    let all = all_devices(roots);
    let Some((_, d)) = all.iter().find(|(_, d)| d.name() == device) else {
        return Err(AdminError::NoDevice(device.to_string()));
    };
    let Some(store) = store_of(d) else {
        return Err(AdminError::NoBitmaps(device.to_string()));
    };
    let what = match (action, &args[2..]) {
        ("list", []) => return Ok(format!("ok\n{}", list_text(&store.list()))),
        ("list", ["--json"]) => return Ok(format!("ok\n{}\n", list_json(&store.list()))),
        ("add", [name]) => {
            store.add(name, GRANULARITY)?;
            format!("bitmap '{name}' added")
        }
        ("add", [name, g]) => {
            store.add(name, admin_error::size("granularity", g)?)?;
            format!("bitmap '{name}' added")
        }
        ("remove", [name]) => {
            store.remove(name)?;
            format!("bitmap '{name}' removed")
        }
        ("clear", [name]) => {
            store.clear(name)?;
            format!("bitmap '{name}' cleared")
        }
        ("merge", [target, sources @ ..]) if !sources.is_empty() => {
            store.merge(target, sources)?;
            format!("merged {} into '{target}'", sources.join(", "))
        }
        _ => return Err(usage()),
    };
    log::info!("cairn: admin: device '{device}': {what}");
    Ok(format!("ok: {what}\n"))
}

/// Every served device that keeps bitmaps, with its bitmaps.
pub(crate) fn served(roots: &[Arc<dyn Device>]) -> Vec<(String, Vec<BitmapInfo>)> {
    all_devices(roots)
        .iter()
        .filter_map(|(_, d)| store_of(d).map(|s| (d.name().to_string(), s.list())))
        .collect()
}

/// `status`: a block per device that keeps bitmaps.
pub(crate) fn status_text(roots: &[Arc<dyn Device>]) -> String {
    let mut out = String::new();
    for (device, list) in served(roots) {
        out += &format!("bitmaps of {device}:\n");
        for line in list_text(&list).lines() {
            out += &format!("  {line}\n");
        }
    }
    out
}

/// `status --json`'s `bitmaps`: one object per device that keeps them.
pub(crate) fn status_json(roots: &[Arc<dyn Device>]) -> serde_json::Value {
    served(roots)
        .into_iter()
        .map(|(device, list)| serde_json::json!({ "device": device, "bitmaps": list_json(&list) }))
        .collect()
}

/// A line per bitmap.
fn list_text(bitmaps: &[BitmapInfo]) -> String {
    if bitmaps.is_empty() {
        return "no bitmaps\n".into();
    }
    let mut out = String::new();
    for b in bitmaps {
        out += &format!(
            "{}: granularity {}, dirty {}{}{}{}\n",
            b.name,
            cairn_core::size::format_bytes(b.granularity),
            cairn_core::size::format_bytes(b.dirty_bytes),
            match (&b.snapshot, b.enabled) {
                (Some(s), _) => format!(", attached to snapshot {s} (the changes up to it)"),
                (None, true) => String::new(),
                (None, false) => ", disabled".to_string(),
            },
            if b.inconsistent {
                ", INCONSISTENT (may miss changes: take a full backup, then remove it and add it again)"
            } else {
                ""
            },
            if b.readers > 0 {
                format!(
                    ", read by {}",
                    cairn_core::size::plural(b.readers as u64, "connection", "connections")
                )
            } else {
                String::new()
            }
        );
    }
    out
}

/// The bitmaps as JSON.
pub(crate) fn list_json(bitmaps: &[BitmapInfo]) -> serde_json::Value {
    bitmaps
        .iter()
        .map(|b| {
            serde_json::json!({
                "name": b.name,
                "granularity": b.granularity,
                "dirty_bytes": b.dirty_bytes,
                "enabled": b.enabled,
                "snapshot": b.snapshot,
                "checkpoint": b.checkpoint,
                "inconsistent": b.inconsistent,
                "readers": b.readers,
            })
        })
        .collect()
}
