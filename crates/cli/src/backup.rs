//! `cairn admin SOCKET checkpoint ...` and `export ...`: the server side of an
//! incremental backup. A checkpoint snapshots a thin volume and turns its bitmaps over;
//! `export add` serves a snapshot, read-only, with the bitmaps attached to it, for a
//! backup client to read what changed.

use std::sync::Arc;

use cairn_core::{Device, DirtyBitmaps};
use cairn_services::dirty::device::{checkpoint, TrackedDevice};
use cairn_services::dirty::store::Store;
use cairn_services::thin::queue::ThinDevice;
use cairn_services::thin::ThinVolume;

use crate::view::{all_devices, View};

/// A served thin volume that keeps bitmaps: the volume, and the store of its bitmaps.
struct Tracked {
    volume: Arc<dyn ThinVolume>,
    store: Arc<Store>,
}

/// The served thin volumes that keep bitmaps.
fn tracked_volumes(roots: &[Arc<dyn Device>]) -> Vec<Tracked> {
    all_devices(roots)
        .into_iter()
        .filter_map(|(_, d)| {
            Some(Tracked {
                volume: d.capability::<dyn ThinVolume>()?,
                store: d.capability::<Store>()?,
            })
        })
        .collect()
}

/// `checkpoint POOL VOLUME NAME [GRANULARITY]`.
pub(crate) fn checkpoint_command(args: &[&str], roots: &[Arc<dyn Device>]) -> String {
    let (pool, volume, name, granularity) = match args {
        [p, v, n] => (p, v, n, None),
        [p, v, n, g] => match cairn_core::size::parse_size(g) {
            Ok(g) => (p, v, n, Some(g)),
            Err(e) => return format!("error: granularity '{g}': {e}\n"),
        },
        _ => return "error: usage: checkpoint POOL VOLUME NAME [GRANULARITY]\n".into(),
    };
    let all = tracked_volumes(roots);
    let found = all
        .iter()
        .find(|t| t.volume.pool().name() == *pool && t.volume.volume() == *volume);
    let Some(tracked) = found else {
        let served = crate::admin::pools(roots)
            .iter()
            .any(|(_, p)| p.name() == *pool);
        return if served {
            format!(
                "error: volume '{volume}' of pool '{pool}' is not served with bitmaps (a [device] table with type = \"thin\", pool = \"{pool}\", volume = \"{volume}\" and bitmaps = \"PATH\")\n"
            )
        } else {
            format!("error: no thin pool '{pool}' is served\n")
        };
    };
    match checkpoint(&tracked.store, &*tracked.volume, name, granularity) {
        Ok(done) => {
            log::info!("cairn: admin: {done}");
            format!("ok: {done}\n")
        }
        Err(why) => format!("error: {why}\n"),
    }
}

/// After volume `name` of pool `pool` was deleted: the bitmaps attached to it go.
pub(crate) fn volume_deleted(pool: &str, name: &str, roots: &[Arc<dyn Device>]) {
    for t in tracked_volumes(roots) {
        if t.volume.pool().name() == pool {
            if let Err(e) = t.store.drop_owner(name) {
                log::warn!(
                    "cairn: admin: the bitmaps of deleted volume '{name}': {e} (they go at the next start)"
                );
            }
        }
    }
}

const EXPORT_USAGE: &str =
    "usage: export list | add NAME POOL VOLUME (read-only, with the bitmaps attached to it) | remove NAME";

/// `export ACTION ...`.
pub(crate) fn export_command(args: &[&str], view: &View) -> String {
    let Some((table, max_payload)) = view.table() else {
        return "error: no NBD server here\n".into();
    };
    match args {
        ["list"] => {
            let mut out = String::from("ok\n");
            for l in table.snapshot() {
                let e = &l.export.info;
                out += &format!(
                    "'{}': {} ({} bytes{})\n",
                    e.name,
                    e.description,
                    e.size,
                    if e.flags & cairn_nbd::proto::tflags::READ_ONLY != 0 {
                        ", read-only"
                    } else {
                        ""
                    }
                );
            }
            out
        }
        ["add", name, pool, volume] => {
            match add_volume(name, pool, volume, &view.roots(), (table, *max_payload)) {
                Ok(what) => {
                    log::info!("cairn: admin: {what}");
                    format!("ok: {what}\n")
                }
                Err(why) => format!("error: {why}\n"),
            }
        }
        ["remove", name] => match table.remove(name) {
            Ok(n) => {
                log::info!("cairn: admin: export '{name}' removed");
                format!(
                    "ok: export '{name}' removed{}\n",
                    if n > 0 {
                        format!(
                            "; {} connected to it keep it until they end",
                            cairn_core::size::plural(n as u64, "client", "clients")
                        )
                    } else {
                        String::new()
                    }
                )
            }
            Err(why) => format!("error: {why}\n"),
        },
        _ => format!("error: {EXPORT_USAGE}\n"),
    }
}

/// Serves volume `volume` of pool `pool` as export `name`, read-only, with the bitmaps
/// some served volume's store holds for it.
fn add_volume(
    name: &str,
    pool: &str,
    volume: &str,
    roots: &[Arc<dyn Device>],
    (table, max_payload): (&cairn_nbd::ExportTable, u32),
) -> Result<String, String> {
    cairn_config::check_export_name(name).map_err(|e| e.to_string())?;
    // Named as the thin volumes the admin makes are (and usually after one): one word,
    // no '/'.
    if name.contains('/') {
        return Err(format!(
            "export name '{name}' has a '/' (an export added here is named as a thin volume is: no '/', spaces or control characters)"
        ));
    }
    let pools = crate::admin::pools(roots);
    let Some((p, inner)) = pools.iter().find(|(_, p)| p.name() == pool) else {
        return Err(format!("no thin pool '{pool}' is served"));
    };
    if !inner.has_volume(volume) {
        return Err(format!("pool '{pool}' has no volume '{volume}'"));
    }
    let thin: Arc<dyn Device> = Arc::new(
        ThinDevice::open(volume, p.clone(), volume, None, false).map_err(|e| e.to_string())?,
    );
    let store = tracked_volumes(roots)
        .into_iter()
        .find(|t| t.volume.pool().name() == pool && t.store.owns(volume))
        .map(|t| t.store);
    let (device, bitmaps): (Arc<dyn Device>, Vec<String>) = match store {
        Some(store) => {
            let view = TrackedDevice::view(thin, store, volume);
            let names = DirtyBitmaps::names(&view);
            (Arc::new(view), names)
        }
        None => (thin, Vec::new()),
    };
    let description = format!("volume {volume} of thin pool {pool}");
    table
        .add(crate::serve::added_export(
            name,
            description,
            device,
            max_payload,
        ))
        .map_err(|e| e.to_string())?;
    Ok(format!(
        "export '{name}' serves volume '{volume}' of pool '{pool}' read-only{}",
        if bitmaps.is_empty() {
            String::new()
        } else {
            format!(
                ", with bitmap{} {} (contexts qemu:dirty-bitmap:NAME)",
                if bitmaps.len() == 1 { "" } else { "s" },
                bitmaps.join(", ")
            )
        }
    ))
}
