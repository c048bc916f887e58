//! Keeping the stack file `cairn serve` was started from in step with its arrays.
//!
//! When an array's members change while it runs (`add`, `replace`, `remove`, a spare
//! taking a failed member's place), the stack file's `members` list no longer says how to
//! start it again, and started from the old list it would be refused (the members taken
//! out carry superblocks that say so). If the file can be written, it is updated in place:
//! the `members` list rewritten, a `[device.NAME]` table added for each new member, and
//! the tables of members taken out (and of what only they used) removed, with a comment
//! saying what changed; comments and layout elsewhere are kept, and the new text replaces
//! the old by a rename, so a crash leaves one or the other. If it cannot be written, the
//! admin's replies and `status` say which lines no longer match.
//!
//! Not for devices given on the command line (`--device`): those have no file.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use toml_edit::{DocumentMut, Item, Table, Value};

/// An array's name, its members now and its spares now, as
/// [`cairn_core::Device::members_now`] and [`cairn_core::Device::spares_now`] give them.
pub type Arrays = (
    String,
    Vec<(String, Option<String>)>,
    Vec<(String, Option<String>)>,
);

/// How often the stack file is looked at for changes nobody asked for by command (the end
/// of a replace, a spare taking a member's place).
const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// The thread that calls `sync` every [`WATCH_INTERVAL`] until it returns false or this
/// is dropped.
pub struct Watch {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Starts the [`Watch`] thread.
pub fn watch(sync: impl Fn() -> bool + Send + 'static) -> std::io::Result<Watch> {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let thread = std::thread::Builder::new()
        .name("cairn-stackfile".into())
        .spawn(move || {
            cairn_core::reactor::block_signals_in_this_thread();
            while !s.load(Ordering::SeqCst) {
                std::thread::park_timeout(WATCH_INTERVAL);
                if s.load(Ordering::SeqCst) || !sync() {
                    return;
                }
            }
        })?;
    Ok(Watch {
        stop,
        thread: Some(thread),
    })
}

/// The stack file of a running server, and what is known of it.
pub struct Keeper {
    path: PathBuf,
    /// Lines saying what no longer matches (empty: the file is in step).
    stale: Mutex<Vec<String>>,
}

impl Keeper {
    /// Keeps `path`, the stack file the devices were opened from.
    pub fn new(path: &Path) -> Keeper {
        Keeper {
            path: path.to_path_buf(),
            stale: Mutex::new(Vec::new()),
        }
    }

    /// Brings the file in step with the arrays under `roots`: lines saying what was
    /// changed in it, or what no longer matches and why it could not be changed. Empty
    /// when it was in step already.
    pub fn sync(&self, arrays: &[Arrays]) -> Vec<String> {
        let mut stale = self.stale.lock().unwrap_or_else(|p| p.into_inner());
        if arrays.is_empty() {
            return Vec::new();
        }
        let file = self.path.display().to_string();
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) => {
                *stale = vec![format!("stack file {file}: cannot read it: {e}")];
                return stale.clone();
            }
        };
        let mut doc = match text.parse::<DocumentMut>() {
            Ok(d) => d,
            Err(e) => {
                *stale = vec![format!(
                    "stack file {file}: cannot parse it any more: {}",
                    e.to_string().lines().next().unwrap_or_default()
                )];
                return stale.clone();
            }
        };
        let changes = update(&mut doc, arrays);
        if changes.is_empty() {
            stale.clear();
            return Vec::new();
        }
        match write_in_place(&self.path, &doc.to_string()) {
            Ok(()) => {
                stale.clear();
                for c in &changes {
                    log::info!("cairn: stack file {file} updated: {c}");
                }
                changes
                    .iter()
                    .map(|c| format!("stack file {file} updated: {c}"))
                    .collect()
            }
            Err(e) => {
                *stale = changes
                    .iter()
                    .map(|c| {
                        format!("stack file {file} no longer matches (cannot update it: {e}): {c}")
                    })
                    .collect();
                for line in stale.iter() {
                    log::warn!("cairn: {line}");
                }
                stale.clone()
            }
        }
    }

    /// After `thin grow POOL VOLUME SIZE`: every thin device table of that volume whose
    /// `size` is smaller gets `size = SIZE` (the next start would refuse the smaller size:
    /// a volume never shrinks). Lines saying what was changed, or what no longer matches.
    pub fn grow_thin(&self, pool: &str, volume: &str, size: u64) -> Vec<String> {
        let file = self.path.display().to_string();
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) => return vec![format!("stack file {file}: cannot read it: {e}")],
        };
        let Ok(mut doc) = text.parse::<DocumentMut>() else {
            return vec![format!("stack file {file}: cannot parse it any more")];
        };
        let changes = set_thin_size(&mut doc, pool, volume, size);
        if changes.is_empty() {
            return Vec::new();
        }
        match write_in_place(&self.path, &doc.to_string()) {
            Ok(()) => changes
                .iter()
                .map(|c| {
                    log::info!("cairn: stack file {file} updated: {c}");
                    format!("stack file {file} updated: {c}")
                })
                .collect(),
            Err(e) => changes
                .iter()
                .map(|c| {
                    format!("stack file {file} no longer matches (cannot update it: {e}): set {c}")
                })
                .collect(),
        }
    }

    /// What `status` says of the file: lines that no longer match (empty: in step).
    pub fn stale(&self) -> Vec<String> {
        self.stale.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Rewrites `doc` so that each array's `members` and `spares` lists are as `arrays`
/// says: what was changed, one line each.
fn update(doc: &mut DocumentMut, arrays: &[Arrays]) -> Vec<String> {
    arrays
        .iter()
        .filter_map(|(array, now, spares_now)| update_array(doc, array, now, spares_now))
        .collect()
}

/// [`update`] for one array: the line saying what changed, or `None` when its lists are
/// as they were (or the file has no such array).
fn update_array(
    doc: &mut DocumentMut,
    array: &str,
    now: &[(String, Option<String>)],
    spares_now: &[(String, Option<String>)],
) -> Option<String> {
    let old = list_of(doc, array, "members")?;
    let old_spares = list_of(doc, array, "spares").unwrap_or_default();
    let names: Vec<String> = now.iter().map(|(n, _)| n.clone()).collect();
    let spares: Vec<String> = spares_now.iter().map(|(n, _)| n.clone()).collect();
    if old == names && old_spares == spares {
        return None;
    }
    let stamp = jiff::Timestamp::now()
        .strftime("%Y-%m-%d %H:%M:%S UTC")
        .to_string();
    set_list(doc, array, "members", &names);
    set_list(doc, array, "spares", &spares);
    // Members and spares taken out, and what only they used, go (they would be
    // top-level devices of their own otherwise); their text stays as comments, with
    // whatever comments stood before them, where the first of them stood.
    let mut removed: Vec<(String, Table)> = Vec::new();
    for gone in old
        .iter()
        .chain(&old_spares)
        .filter(|o| !names.contains(o) && !spares.contains(o))
    {
        remove_unused(doc, gone, &mut removed);
    }
    let mut note = removed_note(array, &removed, &stamp);
    let first_removed = removed.iter().filter_map(|(_, t)| t.position()).min();
    let new = now
        .iter()
        .map(|n| (n, "member"))
        .chain(spares_now.iter().map(|n| (n, "spare")));
    let added = add_tables(doc, array, new, (&mut note, first_removed), &stamp);
    if !note.is_empty() {
        // Nothing was added (a member removed): the note goes before the array.
        note_before(doc, array, &note);
    }
    let removed: Vec<String> = removed.into_iter().map(|(n, _)| n).collect();
    let mut lists = Vec::new();
    if old != names {
        lists.push(format!(
            "members = [{}] (was [{}])",
            quoted_list(&names),
            quoted_list(&old)
        ));
    }
    if old_spares != spares {
        lists.push(format!(
            "spares = [{}] (was [{}])",
            quoted_list(&spares),
            quoted_list(&old_spares)
        ));
    }
    let mut line = format!("{} {}", header(array), lists.join(", "));
    if !added.is_empty() {
        line += &format!("; added {}", headers(&added));
    }
    if !removed.is_empty() {
        line += &format!("; removed {}, no longer used", headers(&removed));
    }
    Some(line)
}

/// A device's name as a TOML header writes it: `[device."c.img"]`.
fn header(name: &str) -> String {
    format!("[device.{}]", toml_edit::Key::new(name).display_repr())
}

/// Headers of `names`, comma-separated.
fn headers(names: &[String]) -> String {
    names
        .iter()
        .map(|n| header(n))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The comment that keeps the tables taken out of `array`: the comments that stood
/// before them, a line saying when, then each table's text commented out.
fn removed_note(array: &str, removed: &[(String, Table)], stamp: &str) -> String {
    let mut note = String::new();
    for (_, t) in removed {
        if let Some(prefix) = t.decor().prefix().and_then(|p| p.as_str()) {
            note += prefix;
        }
    }
    if !removed.is_empty() {
        note += &format!("# Taken out of '{array}' by cairn serve at {stamp}, no longer used:\n");
        for (name, t) in removed {
            let mut body = t.clone();
            body.decor_mut().clear();
            note += &format!(
                "# [device.{}]\n",
                toml_edit::Key::new(name.as_str()).display_repr()
            );
            for line in body.to_string().lines() {
                note += &format!("#   {line}\n");
            }
        }
    }
    note
}

/// Tables for new members and spares added while serving (a device named in the file
/// already keeps its own): where the first device taken out stood (`first_removed`),
/// with the `note` of what was taken out before the first, else at the end. Their names.
fn add_tables<'a>(
    doc: &mut DocumentMut,
    array: &str,
    new: impl Iterator<Item = (&'a (String, Option<String>), &'static str)>,
    (note, first_removed): (&mut String, Option<usize>),
    stamp: &str,
) -> Vec<String> {
    let last = doc_tables_max_position(doc);
    let mut added = Vec::new();
    for ((name, spec), role) in new {
        let Some(spec) = spec else { continue };
        if device_table(doc, name).is_some() {
            continue;
        }
        let Ok(parsed) = format!("[t]\n{spec}").parse::<DocumentMut>() else {
            continue;
        };
        let Some(Item::Table(mut t)) = parsed.as_table().get("t").cloned() else {
            continue;
        };
        let mut prefix = if added.is_empty() {
            std::mem::take(note)
        } else {
            String::new()
        };
        prefix += &format!("\n# Added by cairn serve at {stamp}: a {role} of '{array}'.\n");
        t.decor_mut().set_prefix(prefix);
        t.set_implicit(false);
        let at = match first_removed {
            Some(p) if added.is_empty() => p,
            _ => last + 1 + added.len(),
        };
        t.set_position(at);
        if let Some(Item::Table(devices)) = doc.get_mut("device") {
            devices.insert(name, Item::Table(t));
            added.push(name.clone());
        }
    }
    added
}

/// Puts `note` before the table of `array`, above the comments already there.
fn note_before(doc: &mut DocumentMut, array: &str, note: &str) {
    if let Some(t) = doc
        .get_mut("device")
        .and_then(Item::as_table_mut)
        .and_then(|d| d.get_mut(array))
        .and_then(Item::as_table_mut)
    {
        let before = t
            .decor()
            .prefix()
            .and_then(|p| p.as_str())
            .unwrap_or_default()
            .to_string();
        t.decor_mut().set_prefix(format!("{note}{before}"));
    }
}

/// The list `key` (`members`, `spares`) of `[device.NAME]`, if the file has that table
/// with such a list.
/// `size = SIZE` in every `[device.NAME]` of type "thin" on volume `volume` of pool
/// `pool` whose size is smaller; a line per table changed.
fn set_thin_size(doc: &mut DocumentMut, pool: &str, volume: &str, size: u64) -> Vec<String> {
    let Some(devices) = doc.get_mut("device").and_then(Item::as_table_mut) else {
        return Vec::new();
    };
    let text = cairn_core::size::exact_size(size);
    let mut out = Vec::new();
    for (name, item) in devices.iter_mut() {
        let Some(t) = item.as_table_mut() else {
            continue;
        };
        let s = |k: &str| t.get(k).and_then(Item::as_str).map(str::to_string);
        let on_it = s("type").as_deref() == Some("thin")
            && s("pool").as_deref() == Some(pool)
            && s("volume").as_deref().unwrap_or(name.get()) == volume;
        let smaller = match t.get("size") {
            Some(i) => match i.as_str() {
                Some(v) => cairn_core::size::parse_size(v).is_ok_and(|v| v < size),
                None => i.as_integer().is_some_and(|v| (v as u64) < size),
            },
            None => false,
        };
        if on_it && smaller {
            t["size"] = toml_edit::value(text.clone());
            out.push(format!("{} size = \"{text}\" (grown)", header(name.get())));
        }
    }
    out
}

fn list_of(doc: &DocumentMut, name: &str, key: &str) -> Option<Vec<String>> {
    let list = device_table(doc, name)?.get(key)?.as_array()?;
    Some(
        list.iter()
            .map(|v| v.as_str().unwrap_or_default().to_string())
            .collect(),
    )
}

fn device_table<'a>(doc: &'a DocumentMut, name: &str) -> Option<&'a Table> {
    doc.get("device")?.as_table()?.get(name)?.as_table()
}

/// Rewrites the list `key` of `[device.NAME]` in place (its comments kept): added after
/// the others if the table has none, removed when `names` is empty (for `spares`).
fn set_list(doc: &mut DocumentMut, name: &str, key: &str, names: &[String]) {
    let Some(table) = doc
        .get_mut("device")
        .and_then(Item::as_table_mut)
        .and_then(|d| d.get_mut(name))
        .and_then(Item::as_table_mut)
    else {
        return;
    };
    if names.is_empty() && key == "spares" {
        table.remove(key);
        return;
    }
    let Some(list) = table.get_mut(key).and_then(Item::as_array_mut) else {
        let mut list = toml_edit::Array::new();
        for n in names {
            list.push(n.as_str());
        }
        table.insert(key, toml_edit::value(list));
        return;
    };
    if list
        .iter()
        .map(|v| v.as_str().unwrap_or_default())
        .eq(names.iter().map(String::as_str))
    {
        return;
    }
    let decor = list.decor().clone();
    list.clear();
    for n in names {
        list.push(n.as_str());
    }
    *list.decor_mut() = decor;
}

/// Removes `[device.NAME]` if nothing in the file uses it any more, then what it used
/// (a fault or cache's `base`, a nested array's members) the same way.
fn remove_unused(doc: &mut DocumentMut, name: &str, removed: &mut Vec<(String, Table)>) {
    if name == cairn_config::MISSING || used(doc, name) {
        return;
    }
    let Some(devices) = doc.get_mut("device").and_then(Item::as_table_mut) else {
        return;
    };
    let Some(Item::Table(t)) = devices.remove(name) else {
        return;
    };
    let mut below: Vec<String> = Vec::new();
    if let Some(b) = t.get("base").and_then(Item::as_str) {
        below.push(b.to_string());
    }
    for key in ["members", "spares"] {
        if let Some(m) = t.get(key).and_then(Item::as_array) {
            below.extend(m.iter().filter_map(Value::as_str).map(str::to_string));
        }
    }
    removed.push((name.to_string(), t));
    for b in below {
        remove_unused(doc, &b, removed);
    }
}

/// Whether a device's `members` or `base`, or an export's `device`, names `name`.
fn used(doc: &DocumentMut, name: &str) -> bool {
    let by_device = doc
        .get("device")
        .and_then(Item::as_table)
        .is_some_and(|devices| {
            devices.iter().any(|(_, t)| {
                t.get("base").and_then(Item::as_str) == Some(name)
                    || ["members", "spares"].iter().any(|key| {
                        t.get(key)
                            .and_then(Item::as_array)
                            .is_some_and(|m| m.iter().any(|v| v.as_str() == Some(name)))
                    })
            })
        });
    let by_export = doc
        .get("export")
        .and_then(Item::as_table)
        .is_some_and(|exports| {
            exports
                .iter()
                .any(|(_, t)| t.get("device").and_then(Item::as_str) == Some(name))
        });
    by_device || by_export
}

/// The highest document position of any table (tables print in position order).
fn doc_tables_max_position(doc: &DocumentMut) -> usize {
    fn walk(t: &Table, max: &mut usize) {
        if let Some(p) = t.position() {
            *max = (*max).max(p);
        }
        for (_, item) in t.iter() {
            if let Item::Table(sub) = item {
                walk(sub, max);
            }
        }
    }
    let mut max = 0;
    walk(doc.as_table(), &mut max);
    max
}

fn quoted_list(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("\"{n}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Replaces `path`'s contents with `text`: a new file beside it (same permissions),
/// synced, renamed over it, and the directory synced.
fn write_in_place(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let meta = std::fs::metadata(path)?;
    if meta.permissions().readonly() {
        return Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied));
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.cairn-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.set_permissions(meta.permissions())?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(&dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"# my mirror
[device.a]   # the first disk
type = "file"
path = "/x/a.img"

[device.fa]
type = "fault"
base = "a"
fail = ["write"]

[device.b]
type = "file"
path = "/x/b.img"

[device.m]
type = "mirror"
members = ["fa", "b"]   # keep in order
bitmap = "64M"
"#;

    #[test]
    fn a_replaced_member_is_written_with_its_table_and_the_old_ones_go() {
        let mut doc: DocumentMut = FILE.parse().expect("parses");
        let spec = "type = \"file\"\npath = \"/y/c.img\"\nsize = 8388608\n";
        let changes = update(
            &mut doc,
            &[(
                "m".into(),
                vec![("c.img".into(), Some(spec.into())), ("b".into(), None)],
                vec![],
            )],
        );
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert!(
            changes[0].contains("members = [\"c.img\", \"b\"] (was [\"fa\", \"b\"])")
                && changes[0].contains("added [device.\"c.img\"]")
                && changes[0].contains("removed [device.fa], [device.a]"),
            "{}",
            changes[0]
        );
        let text = doc.to_string();
        // The tables taken out stay as comments where they stood, after the comments
        // that stood before them.
        assert!(
            text.contains("# my mirror\n# Taken out of 'm' by cairn serve at ")
                && text.contains("# [device.a]\n#   type = \"file\"\n#   path = \"/x/a.img\"\n")
                && text.contains("# [device.fa]\n#   type = \"fault\"\n"),
            "{text}"
        );
        assert!(
            text.contains("members = [\"c.img\", \"b\"]   # keep in order"),
            "{text}"
        );
        assert!(
            text.contains("\n[device.\"c.img\"]\ntype = \"file\"\npath = \"/y/c.img\""),
            "{text}"
        );
        assert!(
            !text.contains("\n[device.a]") && !text.contains("\n[device.fa]"),
            "{text}"
        );
        // The result is a stack file that opens the array as it is now.
        let stack = cairn_config::StackFile::parse(&text).expect("a valid stack file");
        assert_eq!(stack.roots(), vec!["m".to_string()]);
        // In step now: nothing more to change.
        assert!(update(
            &mut doc,
            &[(
                "m".into(),
                vec![("c.img".into(), Some(spec.into())), ("b".into(), None)],
                vec![]
            )]
        )
        .is_empty());
    }

    #[test]
    fn a_removed_member_is_written_missing_and_a_device_still_used_stays() {
        let text = format!("{FILE}\n[export.raw]\ndevice = \"a\"\n");
        let mut doc: DocumentMut = text.parse().expect("parses");
        let changes = update(
            &mut doc,
            &[(
                "m".into(),
                vec![("missing".into(), None), ("b".into(), None)],
                vec![],
            )],
        );
        assert_eq!(changes.len(), 1, "{changes:?}");
        let out = doc.to_string();
        assert!(out.contains("members = [\"missing\", \"b\"]"), "{out}");
        // fa went; a is exported, so it stays.
        assert!(
            !out.contains("\n[device.fa]") && out.contains("\n[device.a]"),
            "{out}"
        );
        assert!(out.contains("# [device.fa]\n#   type = \"fault\""), "{out}");
        cairn_config::StackFile::parse(&out).expect("a valid stack file");
    }

    #[test]
    fn spares_added_online_are_written_and_one_taking_a_place_moves_to_members() {
        let mut doc: DocumentMut = FILE.parse().expect("parses");
        let spec = |p: &str| format!("type = \"file\"\npath = \"{p}\"\nsize = 8388608\n");
        let changes = update(
            &mut doc,
            &[(
                "m".into(),
                vec![("fa".into(), None), ("b".into(), None)],
                vec![("s.img".into(), Some(spec("/y/s.img")))],
            )],
        );
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert!(
            changes[0].contains("spares = [\"s.img\"] (was [])")
                && !changes[0].contains("members =")
                && changes[0].contains("added [device.\"s.img\"]"),
            "{}",
            changes[0]
        );
        let text = doc.to_string();
        assert!(text.contains("spares = [\"s.img\"]"), "{text}");
        assert!(text.contains("a spare of 'm'"), "{text}");
        let stack = cairn_config::StackFile::parse(&text).expect("a valid stack file");
        assert_eq!(stack.roots(), vec!["m".to_string()]);
        // fa fails and the spare takes its place: members change, the spares list goes,
        // the spare's table stays (a member's now) and fa's and a's go.
        let changes = update(
            &mut doc,
            &[(
                "m".into(),
                vec![("s.img".into(), Some(spec("/y/s.img"))), ("b".into(), None)],
                vec![],
            )],
        );
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert!(
            changes[0].contains("members = [\"s.img\", \"b\"] (was [\"fa\", \"b\"])")
                && changes[0].contains("spares = [] (was [\"s.img\"])")
                && changes[0].contains("removed [device.fa], [device.a]"),
            "{}",
            changes[0]
        );
        let text = doc.to_string();
        assert!(!text.contains("spares ="), "{text}");
        assert!(text.contains("\n[device.\"s.img\"]\n"), "{text}");
        cairn_config::StackFile::parse(&text).expect("a valid stack file");
    }

    #[test]
    fn a_file_that_cannot_be_written_is_reported_and_left_alone() {
        let dir = tempfile::tempdir().expect("a directory");
        let path = dir.path().join("stack.toml");
        std::fs::write(&path, FILE).expect("write");
        let mut p = std::fs::metadata(&path).expect("meta").permissions();
        p.set_readonly(true);
        std::fs::set_permissions(&path, p).expect("read-only");
        assert!(write_in_place(&path, "x").is_err());
        assert_eq!(std::fs::read_to_string(&path).expect("read"), FILE);
        let leftovers = std::fs::read_dir(dir.path()).expect("dir").count();
        assert_eq!(leftovers, 1, "no temporary file left behind");
    }
}
