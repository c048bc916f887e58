//! `cairn admin SOCKET checkpoint ...` and `export ...`: the server side of an
//! incremental backup. A checkpoint snapshots a thin volume and marks it in the pool's
//! metadata; `export add` serves a snapshot, read-only, with the changes since the
//! checkpoints before it, for a backup client to read what changed.

use std::sync::Arc;

use cairn_core::size::format_bytes;
use cairn_core::{Device, DirtyBitmaps};
use cairn_services::dirty::device::TrackedDevice;
use cairn_services::dirty::store::Store;
use cairn_services::thin::pool::Admin;
use cairn_services::thin::{ThinDevice, ThinPoolAdmin, ThinVolume};

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

const CHECKPOINT_USAGE: &str = "checkpoint POOL VOLUME NAME [GRANULARITY] | checkpoint list POOL [--json] | checkpoint remove POOL VOLUME NAME";

/// `checkpoint POOL VOLUME NAME [GRANULARITY]`, `checkpoint list POOL [--json]`,
/// `checkpoint remove POOL VOLUME NAME`. The words `list` and `remove` are commands
/// unless a pool has that name.
pub(crate) fn checkpoint_command(
    args: &[&str],
    roots: &[Arc<dyn Device>],
) -> Result<String, AdminError> {
    let usage = || AdminError::Usage(CHECKPOINT_USAGE.into());
    let pools = crate::admin::pools(roots);
    let pool_named = |name: &str| {
        pools
            .iter()
            .find(|(_, p)| p.name() == name)
            .map(|(_, p)| p.clone())
            .ok_or_else(|| AdminError::NoPool {
                pool: name.to_string(),
                served: Some(pools.iter().map(|(_, p)| p.name().to_string()).collect()),
            })
    };
    let is_pool = |name: &str| pools.iter().any(|(_, p)| p.name() == name);
    let op = match args {
        ["list", pool] if !is_pool("list") => {
            return Ok(checkpoint_list(&*pool_named(pool)?, false))
        }
        ["list", pool, "--json"] if !is_pool("list") => {
            return Ok(checkpoint_list(&*pool_named(pool)?, true))
        }
        ["remove", pool, volume, name] if !is_pool("remove") => (
            pool,
            Admin::Uncheckpoint {
                volume: volume.to_string(),
                name: name.to_string(),
            },
        ),
        [pool, volume, name] | [pool, volume, name, _] => (
            pool,
            Admin::Checkpoint {
                src: volume.to_string(),
                name: name.to_string(),
                granularity: match args.get(3) {
                    Some(g) => Some(admin_error::size("granularity", g)?),
                    None => None,
                },
            },
        ),
        _ => return Err(usage()),
    };
    let (pool, op) = op;
    let removed = match &op {
        Admin::Uncheckpoint { name, .. } => Some(name.clone()),
        _ => None,
    };
    let done = pool_named(pool)?.admin(op)?;
    if let Some(name) = removed {
        volume_deleted(pool, &name, roots);
    }
    log::info!("cairn: admin: {done}");
    Ok(format!("ok: {done}\n"))
}

/// A checkpoint as `checkpoint list --json`, `thin list --json` and `status --json` give it.
pub(crate) fn checkpoint_json(
    c: &cairn_services::thin::backup::CheckpointInfo,
) -> serde_json::Value {
    serde_json::json!({
        "volume": c.volume,
        "name": c.name,
        "snapshot": c.snapshot,
        "granularity": c.granularity,
        "kept_until": c.kept.as_ref().map(|k| k.0.clone()),
        "kept_bytes": c.kept.as_ref().map(|k| k.1),
    })
}

/// `checkpoint list POOL`: a line per checkpoint (or JSON).
fn checkpoint_list(pool: &dyn ThinPoolAdmin, json: bool) -> String {
    let all = pool.checkpoints();
    if json {
        let items: Vec<serde_json::Value> = all.iter().map(checkpoint_json).collect();
        return format!("ok\n{}\n", serde_json::Value::Array(items));
    }
    let mut out = String::from("ok\n");
    for c in &all {
        out += &format!(
            "{} {}: {}, changes in units of {}\n",
            c.volume,
            c.name,
            match &c.kept {
                None => format!("snapshot '{}'", c.name),
                Some((to, bytes)) => format!(
                    "snapshot deleted, the {} changed from it to '{to}' kept",
                    format_bytes(*bytes)
                ),
            },
            format_bytes(c.granularity)
        );
    }
    if all.is_empty() {
        out += &format!("(thin pool '{}' has no checkpoint)\n", pool.name());
    }
    out
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
    "export list | add NAME POOL VOLUME [--writable] (read-only unless --writable, with the changes since the checkpoints before it; kept across restarts) | remove NAME";

/// `export ACTION ...`.
pub(crate) fn export_command(args: &[&str], view: &View) -> Result<String, AdminError> {
    let Some((table, max_payload)) = view.table() else {
        return Err(AdminError::NoServer);
    };
    match args {
        ["list"] => Ok(export_list(table)),
        ["add", name, pool, volume] | ["add", name, pool, volume, "--writable"] => {
            let adding = Adding {
                name,
                pool,
                volume,
                writable: args.len() == 5,
                keep: true,
            };
            let what = add_volume(&adding, &view.roots(), (table, *max_payload))?;
            log::info!("cairn: admin: {what}");
            Ok(format!("ok: {what}\n"))
        }
        ["remove", name] => {
            let n = table.remove(name)?;
            let mut kept = String::new();
            for (_, p) in crate::admin::pools(&view.roots()) {
                if p.exports().iter().any(|(n, _, _)| n == name) {
                    kept = format!(
                        " ({})",
                        p.admin(Admin::Unexport {
                            name: name.to_string()
                        })?
                    );
                }
            }
            log::info!("cairn: admin: export '{name}' removed{kept}");
            Ok(format!(
                "ok: export '{name}' removed{kept}{}\n",
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
            // Now: a thin volume grown while served is listed at its new size.
            l.export.device.geometry().size_bytes,
            if e.flags & cairn_nbd::proto::tflags::READ_ONLY != 0 {
                ", read-only"
            } else {
                ""
            }
        );
    }
    out
}

/// An export to add: its name, the volume, and how.
struct Adding<'a> {
    name: &'a str,
    pool: &'a str,
    volume: &'a str,
    /// Served writable (a volume, not a snapshot, that no other export writes).
    writable: bool,
    /// Kept in the pool's metadata for the next start (not when the start restores it).
    keep: bool,
}

/// The exports the pools keep, added again as the server starts (`export add` made them
/// while an earlier run served). One that cannot be is logged and left out.
pub(crate) fn restore_exports(view: &View) {
    let Some((table, max_payload)) = view.table() else {
        return;
    };
    let roots = view.roots();
    for (_, p) in crate::admin::pools(&roots) {
        for (name, volume, writable) in p.exports() {
            let adding = Adding {
                name: &name,
                pool: p.name(),
                volume: &volume,
                writable,
                keep: false,
            };
            match add_volume(&adding, &roots, (table, *max_payload)) {
                Ok(what) => log::info!("cairn: serve: {what} (added by 'export add' before)"),
                Err(e) => log::warn!(
                    "cairn: serve: export '{name}' kept by thin pool '{}' is not served: {e} ('export remove {name}' forgets it)",
                    p.name()
                ),
            }
        }
    }
}

/// Serves volume `a.volume` of pool `a.pool` as export `a.name`, read-only unless
/// `a.writable`, with the changes since its checkpoints (and the bitmaps a served
/// volume's store keeps for it); kept in the pool for the next start if `a.keep`.
fn add_volume(
    a: &Adding<'_>,
    roots: &[Arc<dyn Device>],
    (table, max_payload): (&cairn_nbd::ExportTable, u32),
) -> Result<String, AdminError> {
    let (name, pool, volume) = (a.name, a.pool, a.volume);
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
    if a.writable {
        refuse_second_writer(&*thin, pool, volume, table)?;
    }
    let store = tracked_volumes(roots)
        .into_iter()
        .find(|t| t.volume.pool().name() == pool && t.store.owns(volume))
        .map(|t| t.store);
    let device: Arc<dyn Device> = match store {
        Some(store) => Arc::new(TrackedDevice::view(thin, store, volume)),
        None => thin,
    };
    let bitmaps = device
        .capability::<dyn DirtyBitmaps>()
        .map(|b| b.names())
        .unwrap_or_default();
    let description = format!("volume {volume} of thin pool {pool}");
    table.add(
        crate::serve::added_export(name, description, (device, !a.writable), max_payload),
        a.writable,
    )?;
    let kept = if a.keep {
        let op = Admin::Export {
            name: name.to_string(),
            volume: volume.to_string(),
            writable: a.writable,
        };
        match inner.admin(op) {
            Ok(kept) => format!("; {kept}"),
            Err(e) => {
                let _ = table.remove(name);
                return Err(e.into());
            }
        }
    } else {
        String::new()
    };
    Ok(format!(
        "export '{name}' serves volume '{volume}' of pool '{pool}' {}{}{kept}",
        if a.writable { "writable" } else { "read-only" },
        if bitmaps.is_empty() {
            String::new()
        } else {
            format!(
                ", with the changes since {} (contexts qemu:dirty-bitmap:NAME)",
                bitmaps.join(", ")
            )
        }
    ))
}

/// Refuses a writable export of a snapshot, or of a volume another export writes.
fn refuse_second_writer(
    thin: &dyn Device,
    pool: &str,
    volume: &str,
    table: &cairn_nbd::ExportTable,
) -> Result<(), AdminError> {
    if thin.read_only() {
        return Err(AdminError::Usage(format!(
            "'{volume}' is a snapshot: it is served read-only (leave out --writable, or serve a clone: thin clone {pool} {volume} NAME)"
        )));
    }
    for l in table.snapshot() {
        let e = &l.export;
        let writes = e.info.flags & cairn_nbd::proto::tflags::READ_ONLY == 0;
        let same = e
            .device
            .capability::<dyn ThinVolume>()
            .is_some_and(|v| v.pool().name() == pool && v.volume() == volume);
        if writes && same {
            return Err(AdminError::Usage(format!(
                "export '{}' writes volume '{volume}' of pool '{pool}' already: one export writes a volume",
                e.info.name
            )));
        }
    }
    Ok(())
}
