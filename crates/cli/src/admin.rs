//! The admin socket of `cairn serve --admin PATH`, and `cairn admin PATH COMMAND`.
//!
//! A Unix socket, readable and writable by its owner only. Each connection carries one
//! command line (at most 1 KiB) and gets one reply, then is closed; each command runs on
//! a thread of its own, so none waits for another ([`crate::admin_threads`]). The
//! commands are in [`COMMANDS`], the one list that help texts and dispatch share.
//!
//! A reply starts with `ok` or with `error:`.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cairn_core::capability::writeback_totals;
use cairn_core::socket::SocketFile;
use cairn_core::{Array, Device, WriteBackCache};
use cairn_services::thin::ThinPoolAdmin;
use cairn_stacks::array::{ArrayAction, ArrayAdmin};

use crate::admin_error::{self, AdminError};
use crate::admin_threads::{self, Ticket, Workers, CLIENT_TIMEOUT};
use crate::view::{self, all_devices, View};

/// How long `cairn admin` waits for a reply: a new key slot's derivation may take up to
/// a minute by design ([`cairn_services::crypt::kdf::NEW_SLOT_SECONDS_MAX`]).
const REPLY_TIMEOUT: Duration = Duration::from_secs(300);

/// Every command the admin socket answers: its name, its usage and what it does. The
/// one list: `cairn admin help`, `cairn admin --help`, the server's `help` reply and its
/// refusal of an unknown command are all made from it, and [`command`] dispatches on
/// these names (a unit test checks that each is dispatched).
pub const COMMANDS: &[(&str, &str, &str)] = &[
    (
        "devices",
        "devices",
        "every device served, with its members",
    ),
    (
        "status",
        "status [--json]",
        "the device tree with sizes, failed members and caches' write-back; the exports \
         with their connections and FUSE files; then every array with metadata (members, \
         states, rebuild), as /proc/mdstat",
    ),
    (
        "stats",
        "stats [--json]",
        "every device's /proc/diskstats-shaped counters and latency percentiles, summed \
         over reactors (`cairn stat` shows rates)",
    ),
    (
        "fail",
        "fail ARRAY MEMBER",
        "mark a member of a mirror or raid10 failed (never the last current copy of any data)",
    ),
    (
        "remove",
        "remove ARRAY MEMBER",
        "record a failed member as missing, and close it",
    ),
    (
        "re-add",
        "re-add ARRAY MEMBER",
        "take a failed member back once its device answers again: only the regions \
         written since it left are copied (with a bitmap; else all of it)",
    ),
    (
        "add",
        "add ARRAY SPEC",
        "a new device (file:PATH[,size=N]) in place of a missing or failed member, rebuilt \
         online while the array serves; a spare when no member is missing or failed",
    ),
    (
        "replace",
        "replace ARRAY OLD SPEC",
        "build a new device from the array while OLD keeps working, then swap it in and \
         close OLD (redundancy never drops)",
    ),
    (
        "power-cut",
        "power-cut [DEVICE...]",
        "lose what these devices (default: every export's) hold that no flush has made \
         durable (cache memory, volatile mem layers), as in a power cut",
    ),
    (
        "thin",
        "thin ACTION POOL ...",
        "a thin pool's volumes: list POOL [--json], create POOL NAME SIZE, delete POOL \
         NAME, grow POOL NAME SIZE, snapshot POOL VOLUME NAME (read-only, online: holds \
         every write acknowledged before it), clone POOL SNAPSHOT NAME (writable)",
    ),
    (
        "bitmap",
        "bitmap ACTION DEVICE ...",
        "a device's dirty bitmaps (with bitmaps = PATH in its table): list DEVICE \
         [--json], add DEVICE NAME [GRANULARITY] (64K default), remove DEVICE NAME, clear \
         DEVICE NAME, merge DEVICE TARGET SOURCE...",
    ),
    (
        "checkpoint",
        "checkpoint POOL VOLUME NAME [GRANULARITY]",
        "a snapshot NAME of a thin volume, taken while its writes are held and marked in \
         the pool's metadata as its next checkpoint: exports of the volume, and of later \
         checkpoints' snapshots, offer the changes since it (qemu:dirty-bitmap:NAME, in \
         units of GRANULARITY: the pool's block by default); checkpoint list POOL [--json]; \
         checkpoint remove POOL VOLUME NAME (with its snapshot; the checkpoints before it \
         keep their changes)",
    ),
    (
        "export",
        "export ACTION ...",
        "exports while serving: list, add NAME POOL VOLUME (a thin volume, a checkpoint's \
         snapshot say, read-only with the changes since the checkpoints before it), remove \
         NAME (clients connected keep it until they end)",
    ),
    (
        "throttle",
        "throttle ACTION ...",
        "throttle devices: list [--json] (limits, requests let through and delayed, \
         waiting now, rates since the last look), set DEVICE KEY=VALUE... (a live change of \
         its limits, its group's for a group, that the requests waiting follow too; 0 \
         takes a limit away, the last one too)",
    ),
    (
        "crypt",
        "crypt ACTION ...",
        "crypt devices' LUKS key slots: list [--json], add DEVICE PASSPHRASE_FILE \
         [KEY=VALUE...] (a new slot opened by the file's passphrase; kdf, kdf_iterations, \
         kdf_memory, kdf_parallel, kdf_hash as in the stack file), remove DEVICE SLOT (never \
         the last); key rotation is add then remove",
    ),
    ("help", "help", "this list"),
];

/// The command list, usage and description, wrapped under a 26-column usage.
pub fn help_text() -> String {
    // Lines of at most 72 columns (a man page indents them by 7): a usage too long for its column stands on a line of
    // its own, and the description follows below it.
    const WIDTH: usize = 72;
    const INDENT: usize = 26;
    let mut out = String::new();
    for (_, usage, what) in COMMANDS {
        let head = format!("  {usage}");
        let mut line = if head.len() >= INDENT {
            out += &head;
            out.push('\n');
            " ".repeat(INDENT)
        } else {
            format!("{head:<INDENT$}")
        };
        let mut first = true;
        for word in what.split_whitespace() {
            if !first && line.len() + 1 + word.len() > WIDTH {
                out += &line;
                out.push('\n');
                line = " ".repeat(INDENT);
                first = true;
            }
            if !first {
                line.push(' ');
            }
            line += word;
            first = false;
        }
        out += &line;
        out.push('\n');
    }
    out
}

/// The commands' names, for a refusal.
fn command_names() -> String {
    COMMANDS
        .iter()
        .map(|(name, _, _)| *name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The admin socket, bound and not yet answering: [`bind`] comes before any device is
/// opened (a path in use refuses the start before anything is created), [`start`] once
/// the devices are open. Dropping it removes the file.
pub struct Bound {
    listener: UnixListener,
    file: SocketFile,
}

impl Bound {
    /// The socket file (see [`SocketFile::remover`] for exits that skip drops).
    pub fn file(&self) -> &SocketFile {
        &self.file
    }
}

/// The listening admin socket. Dropping it stops its threads and removes the file.
///
/// The threads hold the devices weakly: when serving ends, they close (and caches write
/// back) as if there were no admin socket. A command holds devices only while it runs
/// and not during slow work that needs none (a key slot's derivation), and the drop
/// waits only for the commands holding devices: the devices close here, never on a
/// command's thread after the process has gone on to exit.
pub struct Admin {
    /// The listening socket, shared with the thread: shut down to wake its accept, and
    /// closed after the thread has ended (fields drop after `drop`, in this order).
    listener: Arc<UnixListener>,
    /// Removed after the thread has ended, and the socket closed.
    _file: SocketFile,
    stop: Arc<AtomicBool>,
    workers: Arc<Workers>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Admin {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept (even if the socket file is gone): on Linux, shutting a
        // listening socket down makes a blocked accept return.
        let _ = rustix::net::shutdown(&*self.listener, rustix::net::Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.workers.stop();
        // The socket file goes with `_file`, after this.
    }
}

/// Binds the admin socket at `path`, readable and writable by its owner only. A stale
/// socket there (its server is gone) is replaced; a live one, or anything that is not a
/// socket, is refused and left as it is (see [`cairn_core::socket`]).
pub fn bind(path: &Path) -> Result<Bound, String> {
    // Owner only from the start (no moment when others could connect).
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
    let bound = cairn_core::socket::bind(path, &format!("--admin {}", path.display()));
    rustix::process::umask(old);
    let (listener, mut file) = bound.map_err(|e| e.to_string())?;
    // The umask does it, unless a default ACL of the directory overrides it.
    file.set_mode(0o600)
        .map_err(|e| format!("--admin {}: {e}", path.display()))?;
    Ok(Bound { listener, file })
}

/// Answers commands about the devices of `view` on the socket `bound`: a thread accepts,
/// each command runs on a thread of its own.
pub fn start(bound: Bound, view: Arc<View>) -> Result<Admin, String> {
    let Bound { listener, file } = bound;
    let listener = Arc::new(listener);
    let l = listener.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let workers = Arc::new(Workers::default());
    let w = workers.clone();
    let thread = std::thread::Builder::new()
        .name("cairn-admin".into())
        .spawn(move || {
            cairn_core::reactor::block_signals_in_this_thread();
            for conn in l.incoming() {
                if s.load(Ordering::SeqCst) {
                    return;
                }
                match conn {
                    Ok(conn) => accepted(conn, &view, &w),
                    Err(e) => {
                        // Out of descriptors, say: not a reason to spin.
                        log::warn!("cairn: admin: accept: {e}");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
        .map_err(|e| format!("--admin: cannot start its thread: {e}"))?;
    Ok(Admin {
        listener,
        _file: file,
        stop,
        workers,
        thread: Some(thread),
    })
}

/// Runs the command of `conn` on a thread of its own, or refuses it (too many at once).
fn accepted(conn: UnixStream, view: &Arc<View>, workers: &Arc<Workers>) {
    // A slow client is cut off, not waited for.
    let _ = conn.set_read_timeout(Some(CLIENT_TIMEOUT));
    let _ = conn.set_write_timeout(Some(CLIENT_TIMEOUT));
    // Admitted here, on the accepting thread: the count never runs past the most.
    let ticket = match workers.admit() {
        Ok(t) => t,
        Err(why) => return admin_threads::refuse(conn, &why),
    };
    let view = view.clone();
    let spawned = std::thread::Builder::new()
        .name("cairn-admin-cmd".into())
        .spawn(move || {
            cairn_core::reactor::block_signals_in_this_thread();
            serve_one(conn, &view, &ticket);
        });
    // A thread that did not start drops its closure: the command's place is given back.
    if let Err(e) = spawned {
        log::warn!("cairn: admin: cannot start a thread for a command: {e}");
    }
}

fn serve_one(conn: UnixStream, view: &View, ticket: &Ticket) {
    let reply = match admin_threads::read_command(&conn) {
        Ok(line) => command(line.trim(), view, ticket),
        Err(e) => admin_error::reply(Err(AdminError::NotTaken(e))),
    };
    admin_threads::reply(conn, &reply);
}

/// One device's line of the tree: size, what it is, and its health.
fn device_line(depth: usize, d: &Arc<dyn Device>, seen: &mut Vec<(String, String)>) -> String {
    use cairn_core::size::format_bytes;
    let failed = cairn_core::array::failed_members(d);
    let cache = match d.capability::<dyn WriteBackCache>() {
        Some(c) => format!(
            ", {} written back ({}/s now)",
            format_bytes(c.counters().written_bytes),
            format_bytes(c.rate_bytes_per_s())
        ),
        None => String::new(),
    };
    format!(
        "{}{} ({}) {}{}{}\n",
        "  ".repeat(depth),
        d.name(),
        format_bytes(d.geometry().size_bytes),
        cairn_config::described_once(&**d, seen),
        if failed.is_empty() {
            String::new()
        } else {
            format!(" [DEGRADED: failed {}]", failed.join(", "))
        },
        cache
    )
}

/// What `status` says, without the reply's `ok`: for a status report in the log (bench's
/// SIGUSR1).
pub fn status_report(view: &View) -> String {
    let text = status_text(view);
    text.strip_prefix("ok\n").unwrap_or(&text).to_string()
}

/// `status`: the device tree with sizes and health, then every array with metadata as
/// /proc/mdstat shows md's.
fn status_text(view: &View) -> String {
    consistent(view, status_text_once)
}

/// `build`'s reply, read again while a change of members ran during it (at most for about
/// a second), so one reply never mixes the members before a change and after it.
fn consistent(view: &View, build: impl Fn(&View) -> String) -> String {
    let seq = || -> (u64, bool) {
        all_devices(&view.roots())
            .iter()
            .filter_map(|(_, d)| d.capability::<dyn Array>())
            .map(|a| a.change_seq())
            .fold((0, false), |(sum, odd), s| {
                (sum.wrapping_add(s), odd || s % 2 == 1)
            })
    };
    let mut out = String::new();
    for _ in 0..200 {
        let (before, running) = seq();
        if running {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        out = build(view);
        if seq() == (before, false) {
            return out;
        }
    }
    if out.is_empty() {
        out = build(view);
    }
    out
}

/// The thin pools served: each pool's device, and the pool.
pub(crate) fn pools(roots: &[Arc<dyn Device>]) -> Vec<(Arc<dyn Device>, Arc<dyn ThinPoolAdmin>)> {
    all_devices(roots)
        .into_iter()
        .filter_map(|(_, d)| {
            let pool = d.capability::<dyn ThinPoolAdmin>()?;
            Some((d, pool))
        })
        .collect()
}

/// `thin ACTION POOL ...`.
fn thin_command(
    args: &[&str],
    view: &View,
    roots: &[Arc<dyn Device>],
) -> Result<String, AdminError> {
    use cairn_services::thin::pool::Admin;
    const USAGE: &str = "thin list POOL [--json] | create POOL NAME SIZE | delete POOL NAME | grow POOL NAME SIZE | snapshot POOL VOLUME NAME | clone POOL SNAPSHOT NAME";
    let usage = || AdminError::Usage(USAGE.into());
    let (Some(&action), Some(&pool)) = (args.first(), args.get(1)) else {
        return Err(usage());
    };
    let all = pools(roots);
    let Some((_, inner)) = all.iter().find(|(d, _)| d.name() == pool) else {
        return Err(AdminError::NoPool {
            pool: pool.to_string(),
            served: Some(all.iter().map(|(d, _)| d.name().to_string()).collect()),
        });
    };
    let inner = &**inner;
    let op = match (action, &args[2..]) {
        ("list", []) => return Ok(format!("ok\n{}", thin_list(inner))),
        ("list", ["--json"]) => return Ok(format!("ok\n{}\n", thin_json(inner))),
        ("create", [name, s]) => Admin::Create {
            name: name.to_string(),
            size: admin_error::size("size", s)?,
        },
        ("grow", [name, s]) => Admin::Grow {
            name: name.to_string(),
            size: admin_error::size("size", s)?,
        },
        ("delete", [name]) => Admin::Delete {
            name: name.to_string(),
        },
        ("snapshot" | "clone", [src, name]) => Admin::Snapshot {
            src: src.to_string(),
            name: name.to_string(),
            read_only: action == "snapshot",
        },
        _ => return Err(usage()),
    };
    let deleted = match &op {
        Admin::Delete { name } => Some(name.clone()),
        _ => None,
    };
    let grown = match &op {
        Admin::Grow { name, size } => Some((name.clone(), *size)),
        _ => None,
    };
    let done = inner.admin(op)?;
    if let Some(name) = deleted {
        crate::backup::volume_deleted(pool, &name, roots);
    }
    // The stack file follows: a smaller 'size' would stop the next start.
    let mut out = format!("ok: {done}\n");
    if let (Some((name, size)), Some(keeper)) = (grown, view.stack_file()) {
        for line in keeper.grow_thin(pool, &name, size) {
            out += &line;
            out.push('\n');
        }
    }
    Ok(out)
}

/// A pool's volumes, a line each, under a line for the pool.
fn thin_list(inner: &dyn ThinPoolAdmin) -> String {
    use cairn_core::size::format_bytes;
    let r = inner.report();
    let checkpoints = inner.checkpoints();
    let mut out = thin_pool_line(&r);
    for (name, size, mapped, ro, users) in &r.volumes {
        let of = checkpoints
            .iter()
            .find(|c| c.snapshot && c.name == *name)
            .map(|c| format!(", checkpoint of {}", c.volume))
            .unwrap_or_default();
        out += &format!(
            "  {name}: {} virtual, {} mapped{}{of}{}\n",
            format_bytes(*size),
            format_bytes(*mapped),
            if *ro { ", snapshot (read-only)" } else { "" },
            if *users > 0 { ", open" } else { "" }
        );
    }
    out
}

fn thin_pool_line(r: &cairn_services::thin::pool::PoolReport) -> String {
    use cairn_core::size::format_bytes;
    let total = r.data_blocks * r.block_bytes;
    let used = r.used_blocks * r.block_bytes;
    format!(
        "thin pool {}: data {} of {} used ({}%), block {}, low water {}; metadata: checkpoint {} of {}, log {} of {}; {} volume{}{}\n",
        r.name,
        format_bytes(used),
        format_bytes(total),
        (used * 100).checked_div(total).unwrap_or(0),
        format_bytes(r.block_bytes),
        format_bytes(r.low_water_blocks * r.block_bytes),
        format_bytes(r.checkpoint_bytes),
        format_bytes(r.checkpoint_capacity),
        format_bytes(r.log_used),
        format_bytes(r.log_bytes / 2),
        r.volumes.len(),
        if r.volumes.len() == 1 { "" } else { "s" },
        if r.failed { "; FAILED (a metadata write failed: no more changes are taken)" } else { "" }
    )
}

fn thin_json(inner: &dyn ThinPoolAdmin) -> serde_json::Value {
    let r = inner.report();
    serde_json::json!({
        "name": r.name,
        "block_bytes": r.block_bytes,
        "data_bytes": r.data_blocks * r.block_bytes,
        "used_bytes": r.used_blocks * r.block_bytes,
        "low_water_bytes": r.low_water_blocks * r.block_bytes,
        "metadata": {
            "checkpoint_bytes": r.checkpoint_bytes,
            "checkpoint_capacity_bytes": r.checkpoint_capacity,
            "log_used_bytes": r.log_used,
            "log_bytes": r.log_bytes,
        },
        "commits": r.commits,
        "failed": r.failed,
        "volumes": r.volumes.iter().map(|(name, size, mapped, ro, users)| serde_json::json!({
            "name": name,
            "size_bytes": size,
            "mapped_bytes": mapped,
            "read_only": ro,
            "open": *users > 0,
        })).collect::<Vec<_>>(),
        "checkpoints": inner.checkpoints().iter().map(crate::backup::checkpoint_json).collect::<Vec<_>>(),
    })
}

fn status_text_once(view: &View) -> String {
    let all = all_devices(&view.roots());
    let mut out = String::from("ok\n");
    let mut seen = Vec::new();
    for (depth, d) in &all {
        out += &device_line(*depth, d, &mut seen);
    }
    out += &view::exports_text(view);
    // Arrays with metadata (the default) have a status block; nothing is said of the rest.
    let arrays: Vec<String> = all
        .iter()
        .filter_map(|(_, d)| d.capability::<dyn Array>()?.status())
        .collect();
    out += &arrays.concat();
    for (_, pool) in pools(&view.roots()) {
        out += &thin_list(&*pool);
    }
    out += &crate::bitmaps::status_text(&view.roots());
    out += &crate::crypt::status_text(&view.roots());
    if let Some(k) = view.stack_file() {
        // As of now, not of the last look.
        view.sync_stack_file();
        let stale = k.stale();
        if stale.is_empty() {
            out += &format!(
                "stack file {}: in step with the arrays\n",
                k.path().display()
            );
        }
        for line in stale {
            out += &line;
            out.push('\n');
        }
    }
    out
}

/// `status --json`: the same for scripts.
fn status_json(view: &View) -> String {
    consistent(view, status_json_once)
}

fn status_json_once(view: &View) -> String {
    let devices: Vec<serde_json::Value> = all_devices(&view.roots())
        .iter()
        .map(|(depth, d)| {
            let totals = writeback_totals(d);
            let array = d.capability::<dyn Array>();
            serde_json::json!({
                "name": d.name(),
                "depth": depth,
                "size_bytes": d.geometry().size_bytes,
                "block_bytes": d.geometry().block_bytes,
                "describe": d.describe(),
                "children": d.children().iter().map(|c| c.name().to_string()).collect::<Vec<_>>(),
                "failed_members": cairn_core::array::failed_members(d),
                "dirty_bytes": totals.dirty_bytes,
                "written_back_bytes": totals.written_bytes,
                "writeback_bytes_per_s": d
                    .capability::<dyn WriteBackCache>()
                    .map_or(0, |c| c.rate_bytes_per_s()),
                "array_status": array.and_then(|a| a.status()),
            })
        })
        .collect();
    let arrays: Vec<serde_json::Value> = all_devices(&view.roots())
        .iter()
        .filter_map(|(_, d)| {
            let r = d.capability::<dyn Array>()?.report()?;
            Some(array_json(d.name(), &r))
        })
        .collect();
    let mut doc = view::exports_json(view);
    doc["devices"] = devices.into();
    doc["arrays"] = arrays.into();
    doc["thin_pools"] = pools(&view.roots())
        .iter()
        .map(|(_, pool)| thin_json(&**pool))
        .collect::<Vec<_>>()
        .into();
    doc["bitmaps"] = crate::bitmaps::status_json(&view.roots());
    doc["crypt"] = crate::crypt::status_json(&view.roots());
    if let Some(k) = view.stack_file() {
        view.sync_stack_file();
        let stale = k.stale();
        doc["stack_file"] = serde_json::json!({
            "path": k.path().display().to_string(),
            "in_step": stale.is_empty(),
            "stale": stale,
        });
    }
    format!("ok\n{doc}\n")
}

/// One array of `status --json`'s `arrays`: its state as fields, after `mdadm --detail
/// --export` (the README lists them).
fn array_json(name: &str, r: &cairn_core::ArrayReport) -> serde_json::Value {
    let state = match (&r.sync, r.degraded, r.unclean) {
        (Some(s), _, _) if s.kind == "resync" => "resyncing",
        (Some(_), _, _) => "rebuilding",
        (None, true, _) => "degraded",
        (None, false, true) => "unclean",
        (None, false, false) => "clean",
    };
    serde_json::json!({
        "name": name,
        "level": r.level,
        "size_bytes": r.size_bytes,
        "uuid": r.uuid,
        "metadata": r.metadata,
        "events": r.events,
        "copies": r.copies,
        "state": state,
        "degraded": r.degraded,
        "members": r.members.iter().map(|m| serde_json::json!({
            "name": m.name,
            "role": m.role,
            "state": m.state,
            "readable": m.readable,
            "readd_given_up": m.readd_given_up,
        })).collect::<Vec<_>>(),
        "spares": r.spares,
        "sync": r.sync.as_ref().map(|s| serde_json::json!({
            "kind": s.kind,
            "done_bytes": s.done_bytes,
            "total_bytes": s.total_bytes,
            "percent": if s.total_bytes > 0 {
                (s.done_bytes as f64 * 1000.0 / s.total_bytes as f64).round() / 10.0
            } else {
                0.0
            },
            "rate_bytes_per_s": s.rate_bytes_per_s,
            "eta_seconds": s.total_bytes
                .saturating_sub(s.done_bytes)
                .checked_div(s.rate_bytes_per_s),
        })),
        "bitmap": r.bitmap.map(|(region, regions, dirty)| serde_json::json!({
            "region_bytes": region,
            "regions": regions,
            "dirty_regions": dirty,
        })),
        "read_repairs": {
            "rewritten": r.read_repairs.0,
            "rewritten_bytes": r.read_repairs.1,
            "failed": r.read_repairs.2,
            "pending": r.read_repairs.3,
        },
    })
}

/// Runs one command line; the reply. Every command refuses words it does not take.
fn command(line: &str, view: &View, ticket: &Ticket) -> String {
    let mut words = line.split_whitespace();
    let Some(name) = words.next() else {
        return format!("ok: commands:\n{}", help_text());
    };
    let args: Vec<&str> = words.collect();
    // Before the devices are taken: a crypt command lets go of them for a key slot's
    // derivation.
    if name == "crypt" {
        return admin_error::reply(crate::crypt::command(&args, view, ticket));
    }
    admin_error::reply(run(name, &args, view))
}

/// Command `name` with words `args`, on the devices of `view`.
fn run(name: &str, args: &[&str], view: &View) -> Result<String, AdminError> {
    let roots = &view.roots();
    let usage = |u: &str| Err(AdminError::Usage(u.into()));
    match name {
        "help" => match args {
            [] => Ok(format!("ok: commands:\n{}", help_text())),
            _ => usage("help (it takes no words)"),
        },
        "devices" => match args {
            [] => {
                let mut out = String::from("ok\n");
                for (depth, d) in all_devices(roots) {
                    out += &format!("{}{}\n", "  ".repeat(depth), d.name());
                }
                Ok(out)
            }
            _ => usage("devices (it takes no words)"),
        },
        "status" => match args {
            [] => Ok(status_text(view)),
            ["--json"] => Ok(status_json(view)),
            _ => usage("status [--json]"),
        },
        "stats" => match args {
            [] => Ok(format!("ok\n{}", view::stats_text(view))),
            ["--json"] => Ok(format!("ok\n{}\n", view::stats_json(view))),
            _ => usage("stats [--json]"),
        },
        "fail" | "remove" | "re-add" | "add" | "replace" => array_command(name, args, view, roots),
        "thin" => thin_command(args, view, roots),
        "bitmap" => crate::bitmaps::command(args, roots),
        "throttle" => crate::throttle::command(args, roots),
        "checkpoint" => crate::backup::checkpoint_command(args, roots),
        "export" => crate::backup::export_command(args, view),
        "power-cut" => power_cut(args, roots),
        other => Err(AdminError::UnknownCommand {
            name: other.to_string(),
            known: command_names(),
        }),
    }
}

/// `fail|remove|re-add ARRAY MEMBER`, `add ARRAY SPEC`, `replace ARRAY OLD SPEC`.
fn array_command(
    action: &str,
    args: &[&str],
    view: &View,
    roots: &[Arc<dyn Device>],
) -> Result<String, AdminError> {
    let Some((array, act)) = array_action(action, args) else {
        return Err(AdminError::Usage(
            match action {
                "add" => "add ARRAY SPEC",
                "replace" => "replace ARRAY OLD SPEC",
                _ => "fail|remove|re-add ARRAY MEMBER",
            }
            .into(),
        ));
    };
    let all = all_devices(roots);
    let Some((_, d)) = all.iter().find(|(_, d)| d.name() == array) else {
        return Err(AdminError::NoDevice(array.to_string()));
    };
    let Some(a) = d.capability::<dyn ArrayAdmin>() else {
        return Err(AdminError::NotAnArray {
            device: array.to_string(),
            action: action.to_string(),
        });
    };
    let done = a.act(&act)?;
    let mut out = format!("ok: {done}\n");
    for line in view.sync_stack_file() {
        out += &line;
        out.push('\n');
    }
    if matches!(act, ArrayAction::Replace { .. }) {
        out += &match view.stack_file() {
            Some(k) => format!(
                "when the replace ends, stack file {} is updated (or status says what no longer matches)\n",
                k.path().display()
            ),
            None => "when the replace ends, list the new member in the stack file in place of the old one\n".into(),
        };
    }
    Ok(out)
}

/// The array an admin's action names, and the action, from its words (`None`: not the
/// words it takes).
fn array_action<'a>(action: &str, args: &[&'a str]) -> Option<(&'a str, ArrayAction)> {
    let act = match (action, args) {
        ("fail", [_, member]) => ArrayAction::Fail {
            member: member.to_string(),
        },
        ("remove", [_, member]) => ArrayAction::Remove {
            member: member.to_string(),
        },
        ("re-add", [_, member]) => ArrayAction::ReAdd {
            member: member.to_string(),
        },
        ("add", [_, spec]) => ArrayAction::Add {
            spec: spec.to_string(),
        },
        ("replace", [_, old, spec]) => ArrayAction::Replace {
            old: old.to_string(),
            spec: spec.to_string(),
        },
        _ => return None,
    };
    Some((args[0], act))
}

/// `power-cut [DEVICE...]`: nothing is cut unless every name is known.
fn power_cut(names: &[&str], roots: &[Arc<dyn Device>]) -> Result<String, AdminError> {
    let all = all_devices(roots);
    let chosen: Vec<Arc<dyn Device>> = if names.is_empty() {
        roots.to_vec()
    } else {
        let mut v = Vec::new();
        for n in names {
            match all.iter().find(|(_, d)| d.name() == *n) {
                Some((_, d)) => v.push(d.clone()),
                None => return Err(AdminError::NoDevice(n.to_string())),
            }
        }
        v
    };
    let mut done: Vec<String> = Vec::new();
    for d in chosen {
        if !done.iter().any(|n| n == d.name()) {
            log::info!("cairn: admin: power cut of {}", d.name());
            d.power_cut();
            done.push(d.name().to_string());
        }
    }
    Ok(format!("ok: power cut: {}\n", done.join(", ")))
}

/// `cairn admin PATH COMMAND...`: sends the command and prints the reply; an error reply
/// is an `Err`.
pub fn client(path: &Path, words: &[String]) -> Result<(), String> {
    // The server reads a command as words split at white space: a word holding some
    // would be read as two (a name "bad name!" as a name and a granularity, say).
    if let Some(w) = words
        .iter()
        .find(|w| w.is_empty() || w.contains(char::is_whitespace))
    {
        return Err(format!(
            "admin: {w:?} is not one word: names, sizes and paths are given to the server as words without spaces"
        ));
    }
    crate::out(&request(path, &words.join(" "))?);
    Ok(())
}

/// Sends one command line; the reply's body (after `ok`), or the error it gives.
pub fn request(path: &Path, line: &str) -> Result<String, String> {
    let mut conn = UnixStream::connect(path).map_err(|e| connect_error(path, &e))?;
    let _ = conn.set_read_timeout(Some(REPLY_TIMEOUT));
    conn.write_all(format!("{line}\n").as_bytes())
        .map_err(|e| format!("admin {}: {e}", path.display()))?;
    // The end of the command, for a server that reads on to find it (a line too long).
    let _ = conn.shutdown(std::net::Shutdown::Write);
    let mut reply = String::new();
    conn.read_to_string(&mut reply)
        .map_err(|e| format!("admin {}: {e}", path.display()))?;
    if reply.is_empty() {
        return Err(format!(
            "admin {}: the server closed the connection without a reply (did it stop?)",
            path.display()
        ));
    }
    if let Some(err) = reply.strip_prefix("error: ") {
        return Err(err.trim_end().to_string());
    }
    let body = reply.strip_prefix("ok").unwrap_or(&reply);
    let body = body
        .strip_prefix(": ")
        .or_else(|| body.strip_prefix('\n'))
        .unwrap_or(body);
    Ok(body.to_string())
}

/// Why `cairn admin` could not reach a server at `path`, said by what the path is.
fn connect_error(path: &Path, e: &std::io::Error) -> String {
    use std::os::unix::fs::FileTypeExt;
    let shown = path.display();
    let what = match std::fs::metadata(path) {
        Err(m) if m.kind() == std::io::ErrorKind::NotFound => {
            "nothing is there (start the server with --admin PATH)".to_string()
        }
        Err(m) => format!("cannot look at it: {m}"),
        Ok(m) if m.file_type().is_socket() => match e.kind() {
            std::io::ErrorKind::ConnectionRefused => {
                "a socket nobody listens on (the server that made it has stopped)".to_string()
            }
            _ => format!("a socket, but connecting failed: {e}"),
        },
        Ok(m) if m.is_dir() => "a directory, not an admin socket".to_string(),
        Ok(m) if m.is_file() => "a regular file, not an admin socket".to_string(),
        Ok(_) => "not a socket".to_string(),
    };
    format!("admin {shown}: {what}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> View {
        let spec = cairn_leaves::LeafSpec::parse("null:1M").expect("a spec");
        let device = cairn_leaves::open(&spec, "n").expect("a null device");
        View::new(&[device], Vec::new(), None)
    }

    /// Every command of the list is dispatched, and an unknown one is refused naming
    /// them all.
    #[test]
    fn every_listed_command_is_dispatched() {
        let view = view();
        let ticket = Ticket::detached();
        let command = |line: &str, view: &View| command(line, view, &ticket);
        for (name, _, _) in COMMANDS {
            let reply = command(name, &view);
            assert!(
                !reply.starts_with("error: unknown command"),
                "{name}: {reply}"
            );
        }
        let reply = command("frobnicate", &view);
        assert!(reply.starts_with("error: unknown command 'frobnicate'"));
        for (name, _, _) in COMMANDS {
            assert!(reply.contains(name), "{name} missing from: {reply}");
        }
        let help = command("help", &view);
        for (_, usage, _) in COMMANDS {
            assert!(help.contains(usage), "{usage} missing from: {help}");
        }
    }

    /// Words a command does not take are refused, never ignored.
    #[test]
    fn extra_words_are_refused() {
        let view = view();
        let ticket = Ticket::detached();
        for line in [
            "devices extra words",
            "help me",
            "status --json x",
            "status x",
            "stats --json --json",
            "fail a",
            "crypt list extra",
            "throttle list --json x",
        ] {
            let reply = command(line, &view, &ticket);
            assert!(reply.starts_with("error: usage:"), "{line}: {reply}");
            assert_eq!(reply.lines().count(), 1, "{line}: {reply}");
        }
    }

    #[test]
    fn help_lines_fit_and_keep_every_word() {
        let help = help_text();
        for line in help.lines() {
            assert!(line.len() <= 92, "{line}");
        }
        for (_, _, what) in COMMANDS {
            for word in what.split_whitespace() {
                assert!(help.contains(word), "{word}");
            }
        }
    }
}
