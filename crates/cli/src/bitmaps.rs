//! `cairn admin SOCKET bitmap ...`: the dirty bitmaps of served devices, by hand.

use std::sync::Arc;

use cairn_core::Device;
use cairn_services::dirty::bitmap::BitmapInfo;
use cairn_services::dirty::store::Store;

use crate::view::all_devices;

/// The default granularity of `bitmap add`: 64 KiB per bit.
pub const GRANULARITY: u64 = 64 << 10;

const USAGE: &str = "usage: bitmap list DEVICE [--json] | add DEVICE NAME [GRANULARITY] | remove DEVICE NAME | clear DEVICE NAME | merge DEVICE TARGET SOURCE...";

/// The bitmap store of device `d`, if it has one.
pub(crate) fn store_of(d: &Arc<dyn Device>) -> Option<Arc<Store>> {
    d.capability::<Store>()
}

/// `bitmap ACTION DEVICE ...`.
pub(crate) fn command(args: &[&str], roots: &[Arc<dyn Device>]) -> String {
    let (Some(&action), Some(&device)) = (args.first(), args.get(1)) else {
        return format!("error: {USAGE}\n");
    };
    let all = all_devices(roots);
    let Some((_, d)) = all.iter().find(|(_, d)| d.name() == device) else {
        return format!("error: no device '{device}' is served (see the 'devices' command)\n");
    };
    let Some(store) = store_of(d) else {
        return format!(
            "error: device '{device}' keeps no dirty bitmaps (give it a store: bitmaps = \"PATH\" in its [device.{device}] table)\n"
        );
    };
    let done = match (action, &args[2..]) {
        ("list", []) => return format!("ok\n{}", list_text(&store.list())),
        ("list", ["--json"]) => return format!("ok\n{}\n", list_json(&store.list())),
        ("add", [name]) => store
            .add(name, GRANULARITY)
            .map(|()| format!("bitmap '{name}' added")),
        ("add", [name, g]) => match cairn_core::size::parse_size(g) {
            Ok(g) => store
                .add(name, g)
                .map(|()| format!("bitmap '{name}' added")),
            Err(e) => return format!("error: granularity '{g}': {e}\n"),
        },
        ("remove", [name]) => store
            .remove(name)
            .map(|()| format!("bitmap '{name}' removed")),
        ("clear", [name]) => store
            .clear(name)
            .map(|()| format!("bitmap '{name}' cleared")),
        ("merge", [target, sources @ ..]) if !sources.is_empty() => store
            .merge(target, sources)
            .map(|()| format!("merged {} into '{target}'", sources.join(", "))),
        _ => return format!("error: {USAGE}\n"),
    };
    match done {
        Ok(what) => {
            log::info!("cairn: admin: device '{device}': {what}");
            format!("ok: {what}\n")
        }
        Err(why) => format!("error: {why}\n"),
    }
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
