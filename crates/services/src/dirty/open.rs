//! Opening a bitmap store: a new one made whole under a temporary name before it takes
//! its own; an existing one read (both directory copies, every page of bits), its damage
//! logged and its damaged bitmaps flagged inconsistent; then, unless it is only
//! examined, its damage repaired and a version 1 store upgraded. Every refusal comes
//! before the first write, so a refused store is left exactly as it was.
//!
//! Not for the store's life after open (`store`), nor for the layout itself (`format`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cairn_core::ondisk::{pick, Invalid, Picked};
use cairn_core::Error;

use super::bitmap::Bitmap;
use super::error::PageDamage;
use super::format::{self, Directory, Entry, INCONSISTENT, PAGE, PAGE_WORDS, SLOT, VERSION};
use super::store::{copy_name, os, State, Store};

/// Pages read or written at once.
const CHUNK_PAGES: u64 = 256;

/// The current directory of a store and what its other copy holds.
struct Found {
    dir: Directory,
    /// The copy it was read from (0: A, 1: B).
    copy: usize,
    /// Why the other copy does not hold it too (`None`: it does).
    other: Option<String>,
    /// The other copy cannot be read at all (not merely older).
    other_unreadable: bool,
}

/// Pages of one bitmap that failed their check: (page, why).
type Damage = Vec<(u64, PageDamage)>;

impl Store {
    /// Opens the store at `path` for device `device` of `device_bytes`. An absent file
    /// is made a new, empty store; an existing one must be a store (an empty or cut
    /// file is refused). `dry`: examine only, nothing written (an absent file is then
    /// an empty store). Damage is logged; what it may have cost a bitmap flags that
    /// bitmap inconsistent.
    pub fn open(path: &Path, device: &str, device_bytes: u64, dry: bool) -> Result<Store, Error> {
        let invalid = |m: String| Error::Invalid(format!("bitmap store {}: {m}", path.display()));
        let Some(file) = open_file(path, device, device_bytes, dry)? else {
            return Self::absent(path, device, device_bytes);
        };
        let len = file.metadata().map_err(|e| os(path, "stat", e))?.len();
        if len == 0 {
            return Err(invalid(
                "the file is empty, which no store is (it was cut short, or made by hand); move it away to start with no bitmaps".into(),
            ));
        }
        let found = read_directories(&file, len).map_err(|e| invalid(e.to_string()))?;
        if found.dir.device != format::device_tag(device) {
            return Err(invalid(format!(
                "it holds the bitmaps of device '{}', not of '{device}'",
                found.dir.device
            )));
        }
        let mut bitmaps = Vec::with_capacity(found.dir.entries.len());
        let mut damage = Vec::with_capacity(found.dir.entries.len());
        for e in &found.dir.entries {
            let (b, bad) = load(&file, len, &found.dir, e).map_err(|e| os(path, "read", e))?;
            bitmaps.push(b);
            damage.push(bad);
        }
        // Nothing was written above: every refusal is made before this line.
        let upgrade = found.dir.version != VERSION && !dry;
        let identity = if upgrade {
            new_identity()
        } else {
            found.dir.identity
        };
        if upgrade {
            relocate(&found.dir, &mut bitmaps);
        }
        let stale = match (found.dir.version, &found.other) {
            (1, _) | (_, Some(_)) => Some(1 - found.copy),
            _ => None,
        };
        let store = Store {
            path: path.to_path_buf(),
            file,
            device_bytes,
            dry,
            identity,
            state: Mutex::new(State {
                seq: found.dir.seq,
                dir: found.dir.clone(),
                bitmaps: Vec::new(),
                stale,
                tried: None,
            }),
            generation: AtomicU64::new(1),
        };
        let flagged = store.flag_damage(&found, &bitmaps, &damage);
        store.lock().bitmaps = bitmaps.into_iter().map(Arc::new).collect();
        if !dry {
            store.repair(upgrade, flagged, &damage)?;
        }
        Ok(store)
    }

    /// An empty store that writes nothing, for a dry open of an absent file.
    fn absent(path: &Path, device: &str, device_bytes: u64) -> Result<Store, Error> {
        let dir = Directory {
            version: VERSION,
            seq: 1,
            identity: 0,
            device: format::device_tag(device).to_string(),
            device_bytes,
            entries: Vec::new(),
        };
        Ok(Store {
            path: path.to_path_buf(),
            file: File::open("/dev/null").map_err(|e| os(path, "open /dev/null", e))?,
            device_bytes,
            dry: true,
            identity: 0,
            state: Mutex::new(State {
                seq: 1,
                dir,
                bitmaps: Vec::new(),
                stale: None,
                tried: None,
            }),
            generation: AtomicU64::new(1),
        })
    }

    /// Logs the damage found and flags the bitmaps it may have cost changes (in memory:
    /// [`Store::repair`] writes the flags). Returns whether any flag changed.
    fn flag_damage(&self, found: &Found, bitmaps: &[Bitmap], damage: &[Damage]) -> bool {
        let path = self.path.display();
        let (bad, good) = (copy_name(1 - found.copy), copy_name(found.copy));
        let then = if self.dry {
            "left as it is (examined only)"
        } else {
            "rewritten from it"
        };
        // Version 1 kept older directories in the other copy: only an unreadable one
        // says something, and there it may have been the newer.
        let doubt = found.dir.version == 1
            && found.other_unreadable
            && !(found.dir.seq == 1 && found.dir.entries.is_empty());
        match &found.other {
            Some(why) if found.dir.version != 1 => log::warn!(
                "cairn: bitmap store {path}: directory copy {bad} {why}; copy {good} holds sequence {}: copy {bad} is {then}",
                found.dir.seq
            ),
            Some(why) if doubt => log::warn!(
                "cairn: bitmap store {path}: directory copy {bad} {why}; this version 1 store kept its newest directory in one copy only, and it may have been that one: every bitmap is marked inconsistent (one only that copy named is lost; take full backups)"
            ),
            _ => {}
        }
        let mut changed = false;
        for (b, bad) in bitmaps.iter().zip(damage) {
            // A device grown past an enabled bitmap: the new bytes are not tracked.
            let grown = b.enabled() && self.device_bytes > b.bits << b.shift;
            let flag = doubt || !bad.is_empty() || grown;
            if flag && !b.has(INCONSISTENT) {
                b.flags.fetch_or(INCONSISTENT, Ordering::Relaxed);
                changed = true;
            }
            if !bad.is_empty() {
                log::warn!(
                    "cairn: bitmap store {path}: bitmap '{}': {}: it is marked inconsistent, and the granules of {} read as dirty (take a full backup, then clear it)",
                    b.name,
                    describe(bad),
                    if bad.len() == 1 { "that page" } else { "those pages" }
                );
            } else if grown {
                log::warn!(
                    "cairn: bitmap store {path}: device is larger than bitmap '{}' covers: it is marked inconsistent",
                    b.name
                );
            }
        }
        changed
    }

    /// Writes what the open found: a version 1 store's bits in their new areas, then the
    /// directory (to the copy that does not hold the current one first), then the pages
    /// that failed their check, sealed again with every bit set.
    fn repair(&self, upgrade: bool, flagged: bool, damage: &[Damage]) -> Result<(), Error> {
        let mut st = self.lock();
        let write = |what: &str, e: std::io::Error| os(&self.path, what, e);
        if upgrade {
            for b in &st.bitmaps {
                self.write_pages(b)
                    .map_err(|e| write("write the upgraded bits", e))?;
            }
            self.file.sync_data().map_err(|e| write("sync", e))?;
        }
        if upgrade || flagged || st.stale.is_some() {
            self.commit(&mut st)?;
            if upgrade {
                log::info!(
                    "cairn: bitmap store {}: upgraded to version {VERSION}",
                    self.path.display()
                );
            }
        }
        if upgrade || damage.iter().all(Vec::is_empty) {
            return Ok(());
        }
        for (b, bad) in st.bitmaps.iter().zip(damage) {
            for &(p, _) in bad {
                let image = b.page_image(self.identity, p as usize, &[]);
                self.file
                    .write_all_at(&image, b.area + p * PAGE)
                    .map_err(|e| write("rewrite a damaged page", e))?;
            }
        }
        self.file.sync_data().map_err(|e| write("sync", e))
    }
}

/// The store's file: opened for writing and locked, made first when absent (unless
/// `dry`); `None`: absent, and only examined.
fn open_file(
    path: &Path,
    device: &str,
    device_bytes: u64,
    dry: bool,
) -> Result<Option<File>, Error> {
    if dry {
        // What the real open would meet is refused here already: a store it could not
        // make (no such directory, or one it may not write), a file it could not write,
        // or one another device or cairn holds.
        return match File::open(path) {
            Ok(f) => {
                writable(path, path)?;
                cairn_core::ondisk::lock_exclusive(&f, path)?;
                Ok(Some(f))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let dir = match path.parent() {
                    Some(d) if !d.as_os_str().is_empty() => d,
                    _ => Path::new("."),
                };
                writable(path, dir)?;
                Ok(None)
            }
            Err(e) => Err(os(path, "open", e)),
        };
    }
    let rw = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
    };
    let f = match rw() {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            create(path, device, device_bytes)?;
            rw().map_err(|e| os(path, "open", e))?
        }
        Err(e) => return Err(os(path, "open", e)),
    };
    cairn_core::ondisk::lock_exclusive(&f, path)?;
    Ok(Some(f))
}

/// The store at `path` could be written at `what` (the file, or the directory it would
/// be made in).
fn writable(path: &Path, what: &Path) -> Result<(), Error> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(what.as_os_str().as_bytes())
        .map_err(|_| Error::Invalid(format!("bitmap store {}: a NUL byte", path.display())))?;
    let access = if what == path {
        rustix::fs::Access::WRITE_OK
    } else {
        rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK
    };
    rustix::fs::access(c.as_c_str(), access).map_err(|e| {
        let how = if what == path {
            "open for writing".to_string()
        } else {
            format!("cannot be made in {}", what.display())
        };
        os(path, &how, e.into())
    })
}

/// Makes a new, empty store at `path`: written whole and synced under a temporary name
/// in the same directory, then renamed into place (never over a file that appeared
/// meanwhile) and the directory synced, so that a crash leaves either no store or a
/// whole one, never an empty file.
fn create(path: &Path, device: &str, device_bytes: u64) -> Result<(), Error> {
    let dir = Directory {
        version: VERSION,
        seq: 1,
        identity: new_identity(),
        device: format::device_tag(device).to_string(),
        device_bytes,
        entries: Vec::new(),
    };
    let image = dir.encode();
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy();
    let tmp = parent.join(format!(".{name}.new-{}", std::process::id()));
    let written = (|| -> std::io::Result<()> {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all_at(&image, 0)?;
        f.write_all_at(&image, SLOT)?;
        f.sync_all()
    })();
    let placed = written.and_then(|()| {
        use rustix::fs::{renameat_with, RenameFlags, CWD};
        match renameat_with(CWD, &tmp, CWD, path, RenameFlags::NOREPLACE) {
            // Another process made it meanwhile: that one is opened.
            Ok(()) | Err(rustix::io::Errno::EXIST) => Ok(()),
            // A file system without the no-replace rename: a hard link never replaces.
            Err(rustix::io::Errno::INVAL) => match std::fs::hard_link(&tmp, path) {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
                linked => linked,
            },
            Err(e) => Err(e.into()),
        }
    });
    let _ = std::fs::remove_file(&tmp);
    placed
        .and_then(|()| File::open(parent)?.sync_all())
        .map_err(|e| os(path, "create", e))
}

/// 64 random bits for a new store's identity.
fn new_identity() -> u64 {
    let u = cairn_core::ondisk::new_uuid();
    let (a, b) = u.split_at(8);
    u64::from_le_bytes(a.try_into().unwrap_or_default())
        ^ u64::from_le_bytes(b.try_into().unwrap_or_default())
}

/// Both directory copies read, and the current one picked: the valid one with the
/// higher sequence number ([`cairn_core::ondisk::pick`]). `Err`: neither is valid.
fn read_directories(f: &File, len: u64) -> Result<Found, NoDirectory> {
    let read = |c: usize| -> Result<Directory, Invalid> {
        let at = c as u64 * SLOT;
        if at >= len {
            return Err(Invalid::Other("is absent (the file ends before it)".into()));
        }
        let mut b = vec![0u8; (len - at).min(SLOT) as usize];
        f.read_exact_at(&mut b, at)
            .map_err(|e| Invalid::Other(e.to_string()))?;
        let d = Directory::decode(&b)?;
        if d.version == 1 && d.seq % 2 != c as u64 {
            return Err(Invalid::Other(format!(
                "holds sequence {}, which belongs in the other copy",
                d.seq
            )));
        }
        Ok(d)
    };
    match pick(read(0), read(1), |d| d.seq) {
        Picked::Valid {
            record: dir,
            slot: copy,
            other: Some(old),
            ..
        } => {
            let other = if dir == old {
                None
            } else if dir.seq == old.seq {
                Some(format!("holds another directory of sequence {}", old.seq))
            } else {
                Some(format!(
                    "holds the older sequence {} (a stop during a directory write, or an older copy put back)",
                    old.seq
                ))
            };
            Ok(Found {
                dir,
                copy,
                other,
                other_unreadable: false,
            })
        }
        // Both copies are always written: a blank one is damage too.
        Picked::Valid {
            record: dir,
            slot: copy,
            other: None,
            damaged,
        } => Ok(Found {
            dir,
            copy,
            other: Some(format!(
                "is damaged or missing ({})",
                damaged.unwrap_or(Invalid::Blank)
            )),
            other_unreadable: true,
        }),
        Picked::Blank => Err(NoDirectory(Invalid::Blank, Invalid::Blank)),
        Picked::Foreign { first, second } => Err(NoDirectory(first, second)),
    }
}

/// The refusal of a store whose two copies are not valid, each saying why (copy A, then
/// copy B): damaged metadata, with nothing left to open.
#[derive(Debug, thiserror::Error)]
#[error("no readable directory (copy A: {0}; copy B: {1}); move it away to start with no bitmaps")]
struct NoDirectory(Invalid, Invalid);

/// Bitmap `e` as its area holds it, and the pages of it that failed their check (or lie
/// past the end of the file): those read as dirty.
fn load(f: &File, len: u64, dir: &Directory, e: &Entry) -> std::io::Result<(Bitmap, Damage)> {
    let mut b = Bitmap::new(e);
    let mut bad = Vec::new();
    if dir.version == 1 {
        // Version 1: the bits, 8 a byte, with no check but the end of the file.
        let need = e.bits.div_ceil(8);
        let have = len.saturating_sub(e.area).min(need);
        let mut bytes = vec![0u8; have as usize];
        f.read_exact_at(&mut bytes, e.area)?;
        b.load(0, &bytes);
        if have < need {
            bad.push((have / PAGE, PageDamage::PastEnd));
            b.fill((have / 8) as usize, usize::MAX);
        }
        return Ok((b, bad));
    }
    let pages = format::area_bytes(dir.version, e.bits) / PAGE;
    let mut buf = vec![0u8; (pages.min(CHUNK_PAGES) * PAGE) as usize];
    for first in (0..pages).step_by(CHUNK_PAGES as usize) {
        let n = (pages - first).min(CHUNK_PAGES);
        let start = e.area + first * PAGE;
        let have = len.saturating_sub(start).min(n * PAGE) as usize;
        f.read_exact_at(&mut buf[..have], start)?;
        for i in 0..n {
            let p = first + i;
            let at = (i * PAGE) as usize;
            let check = if at + PAGE as usize <= have {
                let page = &buf[at..at + PAGE as usize];
                format::check_page(page, dir.identity, e.area, p).map(|()| page)
            } else {
                Err(PageDamage::PastEnd)
            };
            match check {
                Ok(page) => b.load(p as usize * PAGE_WORDS, &page[..PAGE_WORDS * 8]),
                Err(why) => {
                    b.fill(p as usize * PAGE_WORDS, PAGE_WORDS);
                    bad.push((p, why));
                }
            }
        }
    }
    Ok((b, bad))
}

/// New areas for the bits of a version 1 store: clear of every area its current
/// directory names, so that a stop during the upgrade leaves that directory whole.
fn relocate(dir: &Directory, bitmaps: &mut [Bitmap]) {
    let mut used: Vec<(u64, u64)> = dir
        .entries
        .iter()
        .map(|e| (e.area, format::area_bytes(dir.version, e.bits)))
        .collect();
    for b in bitmaps {
        let bytes = format::area_bytes(VERSION, b.bits);
        b.area = format::place(&used, bytes);
        used.push((b.area, bytes));
    }
}

/// The pages that failed, in a line: "page 3 of its bits fails its check (zeroed)", or
/// "pages 0, 1, 2 and 5 more of its bits fail their check (page 0: zeroed)".
fn describe(bad: &Damage) -> String {
    const SHOWN: usize = 8;
    if let [(p, why)] = bad.as_slice() {
        return format!("page {p} of its bits fails its check ({why})");
    }
    let list: Vec<String> = bad.iter().take(SHOWN).map(|(p, _)| p.to_string()).collect();
    let more = bad.len().saturating_sub(SHOWN);
    format!(
        "pages {}{} of its bits fail their check (page {}: {})",
        list.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        },
        bad[0].0,
        bad[0].1
    )
}
