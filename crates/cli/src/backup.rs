//! `cairn admin SOCKET checkpoint ...` and `export ...`: the server side of an
//! incremental backup. A checkpoint snapshots a thin volume and turns its bitmaps over;
//! `export add` serves a snapshot, read-only, with the bitmaps attached to it, for a
//! backup client to read what changed.

use std::sync::Arc;

use cairn_core::{Device, DirtyBitmaps};
use cairn_services::dirty::device::{checkpoint, TrackedDevice};
use cairn_services::dirty::store::Store;
use cairn_services::thin::ThinDevice;
use cairn_services::thin::ThinVolume;

use crate::admin_error::{self, AdminError};
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
pub(crate) fn checkpoint_command(
    args: &[&str],
    roots: &[Arc<dyn Device>],
) -> Result<String, AdminError> {
    let (pool, volume, name, granularity) = match args {
        [p, v, n] => (p, v, n, None),
        [p, v, n, g] => (p, v, n, Some(admin_error::size("granularity", g)?)),
        _ => {
            return Err(AdminError::Usage(
                "checkpoint POOL VOLUME NAME [GRANULARITY]".into(),
            ))
        }
    };
    let all = tracked_volumes(roots);
    let found = all
        .iter()
        .find(|t| t.volume.pool().name() == *pool && t.volume.volume() == *volume);
    let Some(tracked) = found else {
        let served = crate::admin::pools(roots)
            .iter()
            .any(|(_, p)| p.name() == *pool);
        return Err(if served {
            AdminError::NotTracked {
                pool: pool.to_string(),
                volume: volume.to_string(),
            }
        } else {
            AdminError::NoPool {
                pool: pool.to_string(),
                served: None,
            }
        });
    };
    let done = checkpoint(&tracked.store, &*tracked.volume, name, granularity)?;
    log::info!("cairn: admin: {done}");
    Ok(format!("ok: {done}\n"))
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
    "export list | add NAME POOL VOLUME (read-only, with the bitmaps attached to it) | remove NAME";

/// `export ACTION ...`.
pub(crate) fn export_command(args: &[&str], view: &View) -> Result<String, AdminError> {
    let Some((table, max_payload)) = view.table() else {
        return Err(AdminError::NoServer);
    };
    match args {
        ["list"] => Ok(export_list(table)),
        ["add", name, pool, volume] => {
            let what = add_volume(name, pool, volume, &view.roots(), (table, *max_payload))?;
            log::info!("cairn: admin: {what}");
            Ok(format!("ok: {what}\n"))
        }
        ["remove", name] => {
            let n = table.remove(name)?;
            log::info!("cairn: admin: export '{name}' removed");
            Ok(format!(
                "ok: export '{name}' removed{}\n",
                if n > 0 {
                    format!(
                        "; {} connected to it keep it until they end",
                        cairn_core::size::plural(n as u64, "client", "clients")
                    )
                } else {
                    String::new()
                }
            ))
        }
        _ => Err(AdminError::Usage(EXPORT_USAGE.into())),
    }
}

/// `export list`: a line per export.
fn export_list(table: &cairn_nbd::ExportTable) -> String {
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

/// Serves volume `volume` of pool `pool` as export `name`, read-only, with the bitmaps
/// some served volume's store holds for it.
fn add_volume(
    name: &str,
    pool: &str,
    volume: &str,
    roots: &[Arc<dyn Device>],
    (table, max_payload): (&cairn_nbd::ExportTable, u32),
) -> Result<String, AdminError> {
    cairn_config::check_export_name(name)?;
    // Named as the thin volumes the admin makes are (and usually after one): one word,
    // no '/'.
    if name.contains('/') {
        return Err(AdminError::ExportName(name.to_string()));
    }
    let pools = crate::admin::pools(roots);
    let Some((p, inner)) = pools.iter().find(|(_, p)| p.name() == pool) else {
        return Err(AdminError::NoPool {
            pool: pool.to_string(),
            served: None,
        });
    };
    if !inner.has_volume(volume) {
        return Err(AdminError::NoVolume {
            pool: pool.to_string(),
            volume: volume.to_string(),
        });
    }
    let thin: Arc<dyn Device> = Arc::new(ThinDevice::open(volume, p.clone(), volume, None, false)?);
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
    table.add(crate::serve::added_export(
        name,
        description,
        device,
        max_payload,
    ))?;
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
