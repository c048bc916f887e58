//! Checks across devices: names, the device graph (members defined and used once, no
//! cycle, bounded depth) and backing files used twice.
//!
//! Every walk here is iterative and linear in the number of devices, so a stack file of
//! any shape is checked in bounded stack and time.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use cairn_core::Error;

use super::keys::shown;
use super::{err, limits, DeviceSpec};
use cairn_leaves::spec::LeafSpec;

/// A device or export name: 1 to [`limits::NAME_BYTES_MAX`] bytes, no control characters
/// (names are printed in one-line messages and typed on command lines).
pub(super) fn check_name(what: &str, name: &str) -> Result<(), Error> {
    let problem = if what == "device" && name == super::MISSING {
        "is reserved (an array's absent member)"
    } else if name.is_empty() {
        "is empty"
    } else if name.len() > limits::NAME_BYTES_MAX {
        "is too long"
    } else if name.chars().any(char::is_control) {
        "contains a control character"
    } else {
        return Ok(());
    };
    Err(err(format!(
        "{what} name '{}' {problem} (a name has 1 to {} bytes and no control characters)",
        shown(name),
        limits::NAME_BYTES_MAX
    )))
}

/// Members are defined, not the device itself, each used by one device only; the graph
/// has no cycle and is at most [`limits::DEPTH_MAX`] levels deep.
pub(super) fn check(devices: &BTreeMap<String, DeviceSpec>) -> Result<(), Error> {
    let mut used_by: HashMap<&str, &str> = HashMap::new();
    for (name, spec) in devices {
        for (key, m) in spec.uses() {
            if m == super::MISSING {
                // An absent member of an array with metadata (checked when parsed).
                continue;
            }
            if !devices.contains_key(m) {
                return Err(err(format!(
                    "device '{name}': key '{key}' names '{}', which is not defined",
                    shown(m)
                )));
            }
            if m == name {
                return Err(err(format!(
                    "device '{name}': key '{key}' names the device itself"
                )));
            }
            if key == "pool" && matches!(devices[m], DeviceSpec::ThinPool { .. }) {
                // A pool serves many volumes.
                used_by.entry(m).or_insert(name);
                continue;
            }
            if key == "pool" {
                return Err(err(format!(
                    "device '{name}': key 'pool' names '{}', which is not a thin-pool device",
                    shown(m)
                )));
            }
            if matches!(spec, DeviceSpec::ThinPool { .. })
                && matches!(devices[m], DeviceSpec::Thin { .. })
            {
                return Err(err(format!(
                    "device '{name}': key '{key}' names thin volume '{m}'; a pool's data and metadata are not thin volumes"
                )));
            }
            let throttle = |d: &DeviceSpec| matches!(d, DeviceSpec::Throttle { .. });
            if throttle(spec)
                && used_by
                    .get(m.as_str())
                    .is_none_or(|o| throttle(&devices[*o]))
            {
                // Throttles pass requests through unchanged: several may share a device
                // (each export with limits has one).
                used_by.entry(m).or_insert(name);
                continue;
            }
            if let Some(other) = used_by.insert(m, name) {
                let other_key = devices[other]
                    .uses()
                    .find(|(_, n)| *n == m)
                    .map_or("members", |(k, _)| k);
                return Err(err(format!(
                    "device '{m}' is used twice (by key '{other_key}' of '{other}' and key '{key}' of '{name}'); a device can be a member of one device only"
                )));
            }
        }
    }
    // With every device used at most once, each device has at most one user: walking up
    // from any device ends at a top-level device or goes round a cycle. Each walk stops
    // at the first device whose level is known, so every device is walked over once.
    let mut level: HashMap<&str, usize> = HashMap::new();
    for start in devices.keys() {
        let mut path: Vec<&str> = Vec::new();
        let mut on_path: HashMap<&str, usize> = HashMap::new();
        let mut at = start.as_str();
        let above = loop {
            if let Some(&l) = level.get(at) {
                break l;
            }
            if let Some(&i) = on_path.get(at) {
                return Err(cycle(devices, &path[i..]));
            }
            on_path.insert(at, path.len());
            path.push(at);
            match used_by.get(at) {
                Some(&up) => at = up,
                None => break 0,
            }
        };
        // Levels count from the top: a top-level device is level 1.
        for (i, d) in path.iter().rev().enumerate() {
            let l = above + i + 1;
            if l > limits::DEPTH_MAX {
                return Err(too_deep(d, &used_by));
            }
            level.insert(d, l);
        }
    }
    Ok(())
}

/// The cycle `walked` (each device followed by its user), printed from user to member.
fn cycle(devices: &BTreeMap<String, DeviceSpec>, walked: &[&str]) -> Error {
    let mut path: Vec<&str> = walked.to_vec();
    path.push(walked[0]);
    path.reverse();
    let mut keys: Vec<String> = path
        .iter()
        .map(|d| format!("'{}'", devices[*d].members_key()))
        .collect();
    keys.sort();
    keys.dedup();
    let shown: Vec<String> = path.iter().map(|d| format!("'{d}'")).collect();
    err(format!(
        "devices form a cycle (each names the next in key {}): {}",
        keys.join(" or "),
        shown.join(" -> ")
    ))
}

/// `device` is one level too deep: the chain from its top-level device down to it.
fn too_deep(device: &str, used_by: &HashMap<&str, &str>) -> Error {
    let mut chain = vec![device];
    let mut at = device;
    while let Some(&up) = used_by.get(at) {
        chain.push(up);
        at = up;
    }
    chain.reverse();
    let shown: Vec<String> = chain.iter().map(|d| format!("'{d}'")).collect();
    err(format!(
        "device '{device}' is {} levels down, and a stack has at most {}: {}",
        chain.len(),
        limits::DEPTH_MAX,
        shown.join(" -> ")
    ))
}

/// Two file devices backed by the same file (the same path after symlinks and relative
/// parts are resolved, or the same inode or block device under another name) are refused
/// with an error naming both; so is a bitmap store (`bitmaps`, by device) in a file a
/// device serves.
pub(super) fn check_paths(
    devices: &BTreeMap<String, DeviceSpec>,
    bitmaps: &BTreeMap<String, PathBuf>,
) -> Result<(), Error> {
    let mut by_path: HashMap<PathBuf, (&str, &Path)> = HashMap::new();
    let mut by_identity: HashMap<Identity, (&str, &Path)> = HashMap::new();
    for (name, spec) in devices {
        let DeviceSpec::Leaf(LeafSpec::File { path, .. }) = spec else {
            continue;
        };
        let resolved = resolve(path);
        let twice = |(other, first): (&str, &Path)| {
            err(format!(
                "devices '{other}' and '{name}' both use the file {} (key 'path' = \"{}\" and \"{}\"); a file can back one device only",
                resolved.display(),
                first.display(),
                path.display()
            ))
        };
        if let Some(other) = by_path.insert(resolved.clone(), (name, path)) {
            return Err(twice(other));
        }
        if let Some(id) = identity(&resolved) {
            if let Some(other) = by_identity.insert(id, (name, path)) {
                return Err(twice(other));
            }
        }
    }
    for (name, store) in bitmaps {
        let resolved = resolve(store);
        let served = by_path
            .get(&resolved)
            .or_else(|| identity(&resolved).and_then(|id| by_identity.get(&id)));
        if let Some((other, path)) = served {
            return Err(err(format!(
                "device '{name}': key 'bitmaps' = \"{}\" is the file device '{other}' serves (key 'path' = \"{}\"); a bitmap store is a file of its own, e.g. \"{}.bitmaps\"",
                store.display(),
                path.display(),
                path.display()
            )));
        }
    }
    Ok(())
}

/// What makes two names the same file: its inode, or for a block device its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Identity {
    Inode { dev: u64, ino: u64 },
    Block { rdev: u64 },
}

fn identity(path: &Path) -> Option<Identity> {
    let m = std::fs::metadata(path).ok()?;
    Some(if m.file_type().is_block_device() {
        Identity::Block { rdev: m.rdev() }
    } else {
        Identity::Inode {
            dev: m.dev(),
            ino: m.ino(),
        }
    })
}

/// The absolute path a device's file has or will have: symlinks followed (also one that
/// points at a file not created yet) and `.` and `..` resolved.
pub fn resolve(path: &Path) -> PathBuf {
    /// As the kernel's limit on symlinks followed in one lookup.
    const LINKS_MAX: usize = 40;
    let mut at = absolute(path);
    for _ in 0..LINKS_MAX {
        if let Ok(p) = std::fs::canonicalize(&at) {
            return p;
        }
        // Not there (yet): a dangling symlink is followed; otherwise the directory is
        // resolved and the name kept.
        match std::fs::read_link(&at) {
            Ok(target) => {
                let dir = at.parent().map(Path::to_path_buf).unwrap_or_default();
                at = normalize(&dir.join(target));
            }
            Err(_) => {
                return match (at.parent(), at.file_name()) {
                    (Some(dir), Some(name)) => std::fs::canonicalize(dir)
                        .map(|d| d.join(name))
                        .unwrap_or(at),
                    _ => at,
                }
            }
        }
    }
    at
}

fn absolute(path: &Path) -> PathBuf {
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(path)
    };
    normalize(&joined)
}

/// Removes `.` and `..` without looking at the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_drops_dots() {
        assert_eq!(normalize(Path::new("/a/./b/../c")), PathBuf::from("/a/c"));
        assert_eq!(normalize(Path::new("/../a")), PathBuf::from("/a"));
    }

    #[test]
    fn resolve_follows_links_to_files_not_yet_created() {
        let dir = tempfile::tempdir().unwrap();
        let real = std::fs::canonicalize(dir.path()).unwrap();
        std::os::unix::fs::symlink(real.join("target.img"), real.join("link.img")).unwrap();
        assert_eq!(resolve(&real.join("link.img")), real.join("target.img"));
        std::fs::create_dir(real.join("sub")).unwrap();
        assert_eq!(
            resolve(&real.join("sub/../target.img")),
            real.join("target.img")
        );
        // A loop of links ends.
        std::os::unix::fs::symlink(real.join("b"), real.join("a")).unwrap();
        std::os::unix::fs::symlink(real.join("a"), real.join("b")).unwrap();
        let _ = resolve(&real.join("a"));
    }
}
