//! A bitmap store: the named dirty bitmaps of one device, in memory and in their file.
//!
//! The rule that makes a bitmap exact after any stop, clean or not (the arrays'
//! write-intent rule): a change of data is sent to the device only once every enabled
//! bitmap has its bits on disk ([`Store::mark`]). The bits in memory are the ones on
//! disk; a bit is set in memory only after the page that carries it is synced, so a
//! queue that finds its bits set may send its write at once, and readers never see a bit
//! that a crash could take back. Marking runs on the thread of the write that needs it,
//! under the store's lock: once per granule going from clean to dirty, not per request.
//!
//! A mark that cannot be written makes the bitmap inconsistent (in the directory, before
//! the write goes on); when not even that can be written, the write fails.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cairn_core::Error;

use super::bitmap::{Bitmap, BitmapInfo, Reader, Words, PAGE_WORDS};
use super::format::{self, Directory, Entry, INCONSISTENT, PAGE};

/// The granularity of a checkpoint's first bitmap: 64 KiB per bit.
pub const GRANULARITY: u64 = 64 << 10;

pub(super) struct State {
    /// The directory on disk (the newer copy).
    pub(super) dir: Directory,
    /// Its bitmaps, in the same order.
    pub(super) bitmaps: Vec<Arc<Bitmap>>,
}

/// The bitmaps of one device.
pub struct Store {
    pub(super) path: PathBuf,
    file: File,
    device_bytes: u64,
    /// Examine only: nothing is written.
    pub(super) dry: bool,
    state: Mutex<State>,
    /// Bumped whenever the enabled bitmaps change, so queues refresh their list.
    pub(super) generation: AtomicU64,
}

fn os(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::os(format!("bitmap store {}: {what}", path.display()), e)
}

impl Store {
    /// Opens the store at `path` for device `device` of `device_bytes` (created empty
    /// when the file is absent or empty). `dry`: read only, and an absent file is an
    /// empty store.
    pub fn open(path: &Path, device: &str, device_bytes: u64, dry: bool) -> Result<Store, Error> {
        let invalid = |m: String| Error::Invalid(format!("bitmap store {}: {m}", path.display()));
        let file = if dry {
            match File::open(path) {
                Ok(f) => Some(f),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(os(path, "open", e)),
            }
        } else {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
                .map_err(|e| os(path, "open", e))?;
            crate::file::lock_exclusive(&f, path)?;
            Some(f)
        };
        let len = match &file {
            Some(f) => f.metadata().map_err(|e| os(path, "stat", e))?.len(),
            None => 0,
        };
        let fresh = Directory {
            seq: 1,
            device: format::device_tag(device).to_string(),
            device_bytes,
            entries: Vec::new(),
        };
        let (file, dir) = match file {
            Some(f) if len > 0 => {
                let dir = Self::read_directory(&f, len).map_err(invalid)?;
                if dir.device != format::device_tag(device) {
                    return Err(invalid(format!(
                        "it holds the bitmaps of device '{}', not of '{device}'",
                        dir.device
                    )));
                }
                (f, dir)
            }
            Some(f) => {
                if !dry {
                    write_dir(&f, &fresh).map_err(|e| os(path, "write", e))?;
                }
                (f, fresh)
            }
            None => (
                File::open("/dev/null").map_err(|e| os(path, "open /dev/null", e))?,
                fresh,
            ),
        };
        let mut bitmaps = Vec::with_capacity(dir.entries.len());
        for e in &dir.entries {
            let mut bytes = vec![0u8; e.bits.div_ceil(8) as usize];
            if e.area + bytes.len() as u64 > len {
                return Err(invalid(format!(
                    "bitmap '{}': its bits are past the end",
                    e.name
                )));
            }
            file.read_exact_at(&mut bytes, e.area)
                .map_err(|e| os(path, "read", e))?;
            bitmaps.push(Arc::new(Bitmap::new(e, &bytes)));
        }
        let store = Store {
            path: path.to_path_buf(),
            file,
            device_bytes,
            dry,
            state: Mutex::new(State { dir, bitmaps }),
            generation: AtomicU64::new(1),
        };
        // A device grown past an enabled bitmap: the new bytes are not tracked.
        let short: Vec<String> = store
            .lock()
            .bitmaps
            .iter()
            .filter(|b| b.enabled() && device_bytes > b.bits << b.shift)
            .map(|b| b.name.clone())
            .collect();
        if !short.is_empty() {
            log::warn!(
                "cairn: bitmap store {}: device '{device}' is larger than bitmaps {} cover: they are marked inconsistent",
                path.display(),
                short.join(", ")
            );
            let mut st = store.lock();
            store.flag_inconsistent(&mut st, &short)?;
        }
        Ok(store)
    }

    fn read_directory(f: &File, len: u64) -> Result<Directory, String> {
        let mut best: Option<Directory> = None;
        let mut why = Vec::new();
        for slot in 0..2u64 {
            let at = slot * format::SLOT;
            if at >= len {
                why.push(format!("copy {slot}: absent"));
                continue;
            }
            let mut b = vec![0u8; (len - at).min(format::SLOT) as usize];
            if let Err(e) = f.read_exact_at(&mut b, at) {
                why.push(format!("copy {slot}: {e}"));
                continue;
            }
            match Directory::decode(&b) {
                Ok(d) if d.slot_offset() != at => {
                    why.push(format!(
                        "copy {slot}: sequence {} belongs in the other copy",
                        d.seq
                    ));
                }
                Ok(d) => {
                    if best.as_ref().is_none_or(|b| d.seq > b.seq) {
                        best = Some(d);
                    }
                }
                Err(e) => why.push(format!("copy {slot}: {e}")),
            }
        }
        best.ok_or_else(|| {
            format!(
                "no readable directory ({}); move the file away to start with no bitmaps",
                why.join("; ")
            )
        })
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the store is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bumped whenever the enabled bitmaps change.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The bitmaps writes set now, and the generation they are of.
    pub fn enabled(&self) -> (u64, Vec<Arc<Bitmap>>) {
        let st = self.lock();
        let g = self.generation();
        (
            g,
            st.bitmaps.iter().filter(|b| b.enabled()).cloned().collect(),
        )
    }

    /// Every bitmap, as listed.
    pub fn list(&self) -> Vec<BitmapInfo> {
        self.lock()
            .bitmaps
            .iter()
            .map(|b| b.info(self.device_bytes))
            .collect()
    }

    /// Names of the bitmaps of `owner` (empty: the device's own; else a snapshot's).
    pub fn names(&self, owner: &str) -> Vec<String> {
        self.lock()
            .bitmaps
            .iter()
            .filter(|b| b.owner() == owner)
            .map(|b| b.name.clone())
            .collect()
    }

    /// Whether some bitmap is attached to snapshot `owner`.
    pub fn owns(&self, owner: &str) -> bool {
        self.lock().bitmaps.iter().any(|b| b.owner() == owner)
    }

    /// A reader's hold on bitmap `name` of `owner`.
    pub fn reader(&self, owner: &str, name: &str) -> Option<Reader> {
        let st = self.lock();
        st.bitmaps
            .iter()
            .find(|b| b.name == name && b.owner() == owner)
            .map(|b| Reader::new(b.clone()))
    }

    /// Sets on disk, then in memory, the bits of every enabled bitmap that
    /// `[offset, offset + len)` touches. Call before sending a change of that range.
    pub fn mark(&self, offset: u64, len: u64) -> Result<(), Error> {
        if self.dry || len == 0 {
            return Ok(());
        }
        let mut st = self.lock();
        let mut plan: Vec<(Arc<Bitmap>, Words)> = Vec::new();
        let mut past = Vec::new();
        for b in st.bitmaps.iter().filter(|b| b.enabled()) {
            let (need, beyond) = b.missing(offset, len);
            if beyond && b.flags.load(Ordering::Relaxed) & INCONSISTENT == 0 {
                past.push(b.name.clone());
            }
            if !need.is_empty() {
                plan.push((b.clone(), need));
            }
        }
        if !past.is_empty() {
            self.flag_inconsistent(&mut st, &past)?;
        }
        if plan.is_empty() {
            return Ok(());
        }
        let written = (|| -> std::io::Result<()> {
            for (b, need) in &plan {
                let mut pages: Vec<usize> = need.iter().map(|(w, _)| w / PAGE_WORDS).collect();
                pages.dedup();
                for p in pages {
                    let image = b.page_image(p, need);
                    self.file.write_all_at(&image, b.area + p as u64 * PAGE)?;
                }
            }
            self.file.sync_data()
        })();
        match written {
            Ok(()) => {
                for (b, need) in &plan {
                    for &(w, bits) in need {
                        b.words[w].fetch_or(bits, Ordering::Release);
                    }
                }
                Ok(())
            }
            Err(e) => {
                let names: Vec<String> = plan.iter().map(|(b, _)| b.name.clone()).collect();
                log::error!(
                    "cairn: bitmap store {}: marking {}: {e}; they are marked inconsistent",
                    self.path.display(),
                    names.join(", ")
                );
                self.flag_inconsistent(&mut st, &names)?;
                // Set in memory all the same: readers see the change, and the next
                // writes to these granules do not try again.
                for (b, need) in &plan {
                    for &(w, bits) in need {
                        b.words[w].fetch_or(bits, Ordering::Release);
                    }
                }
                Ok(())
            }
        }
    }

    /// Marks `names` inconsistent, in memory and then on disk.
    fn flag_inconsistent(&self, st: &mut State, names: &[String]) -> Result<(), Error> {
        for b in st.bitmaps.iter().filter(|b| names.contains(&b.name)) {
            b.flags.fetch_or(INCONSISTENT, Ordering::Relaxed);
        }
        self.commit(st)
    }

    /// Writes the directory of what is in memory, as the next sequence number.
    pub(super) fn commit(&self, st: &mut State) -> Result<(), Error> {
        if self.dry {
            return Ok(());
        }
        let dir = Directory {
            seq: st.dir.seq + 1,
            device: st.dir.device.clone(),
            device_bytes: self.device_bytes,
            entries: st.bitmaps.iter().map(|b| b.entry()).collect(),
        };
        write_dir(&self.file, &dir).map_err(|e| os(&self.path, "write the directory", e))?;
        st.dir = dir;
        Ok(())
    }

    fn find<'a>(&self, st: &'a State, name: &str) -> Result<&'a Arc<Bitmap>, String> {
        st.bitmaps.iter().find(|b| b.name == name).ok_or_else(|| {
            let names: Vec<&str> = st.bitmaps.iter().map(|b| b.name.as_str()).collect();
            format!(
                "no bitmap '{name}' (bitmaps: {})",
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                }
            )
        })
    }

    pub(super) fn refuse_dry(&self) -> Result<(), String> {
        if self.dry {
            return Err("the store was opened to examine only".into());
        }
        Ok(())
    }

    /// Adds an empty, enabled bitmap `name` of `granularity` bytes per bit.
    pub fn add(&self, name: &str, granularity: u64) -> Result<(), String> {
        format::check_name(name)?;
        self.refuse_dry()?;
        let mut st = self.lock();
        if st.bitmaps.iter().any(|b| b.name == name) {
            return Err(format!("a bitmap '{name}' exists"));
        }
        let e = self.new_entry(&st, name, granularity, 0)?;
        st.bitmaps.push(Arc::new(Bitmap::new(&e, &[])));
        if let Err(err) = self.commit(&mut st) {
            st.bitmaps.pop();
            return Err(err.to_string());
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// An entry for a new bitmap, its area zeroed (not synced: the directory's sync
    /// covers it, and stale bits there could only add changes).
    pub(super) fn new_entry(
        &self,
        st: &State,
        name: &str,
        granularity: u64,
        flags: u32,
    ) -> Result<Entry, String> {
        if !granularity.is_power_of_two()
            || !(format::GRANULARITY_MIN..=format::GRANULARITY_MAX).contains(&granularity)
        {
            return Err(format!(
                "granularity {granularity}: a power of two from {} to {}",
                cairn_core::size::format_bytes(format::GRANULARITY_MIN),
                cairn_core::size::format_bytes(format::GRANULARITY_MAX)
            ));
        }
        let bits = self.device_bytes.div_ceil(granularity).max(1);
        if format::area_bytes(bits) > format::AREA_MAX {
            return Err(format!(
                "granularity {} needs {} of bits for this device; at most {} (pick a coarser one)",
                cairn_core::size::format_bytes(granularity),
                cairn_core::size::format_bytes(format::area_bytes(bits)),
                cairn_core::size::format_bytes(format::AREA_MAX)
            ));
        }
        if st.bitmaps.len() >= format::BITMAPS_MAX {
            return Err(format!(
                "the store holds {} bitmaps already",
                format::BITMAPS_MAX
            ));
        }
        // Clear of every area the directory on disk names: should the next directory be
        // torn, the one before it still finds its bits.
        let used: Vec<(u64, u64)> = st
            .dir
            .entries
            .iter()
            .chain(
                st.bitmaps
                    .iter()
                    .map(|b| b.entry())
                    .collect::<Vec<_>>()
                    .iter(),
            )
            .map(|e| (e.area, e.area_bytes()))
            .collect();
        let e = Entry {
            name: name.to_string(),
            owner: String::new(),
            shift: granularity.trailing_zeros(),
            bits,
            flags,
            area: format::place(&used, format::area_bytes(bits)),
        };
        let zeros = vec![0u8; e.area_bytes().min(1 << 20) as usize];
        let mut at = 0;
        while at < e.area_bytes() {
            let n = (e.area_bytes() - at).min(zeros.len() as u64) as usize;
            self.file
                .write_all_at(&zeros[..n], e.area + at)
                .map_err(|err| err.to_string())?;
            at += n as u64;
        }
        Ok(e)
    }

    pub(super) fn refuse_read(b: &Bitmap, what: &str) -> Result<(), String> {
        let n = b.readers.load(Ordering::Relaxed);
        if n > 0 {
            return Err(format!(
                "bitmap '{}' is being read by {} (an NBD client's qemu:dirty-bitmap context): not {what} while it is",
                b.name,
                cairn_core::size::plural(n as u64, "connection", "connections")
            ));
        }
        Ok(())
    }

    /// Removes bitmap `name` (refused while a client reads it).
    pub fn remove(&self, name: &str) -> Result<(), String> {
        self.refuse_dry()?;
        let mut st = self.lock();
        let b = self.find(&st, name)?.clone();
        Self::refuse_read(&b, "removed")?;
        let i = st
            .bitmaps
            .iter()
            .position(|x| Arc::ptr_eq(x, &b))
            .expect("found");
        st.bitmaps.remove(i);
        if let Err(e) = self.commit(&mut st) {
            st.bitmaps.insert(i, b);
            return Err(e.to_string());
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Clears every bit of bitmap `name` (and its inconsistency: it starts afresh).
    pub fn clear(&self, name: &str) -> Result<(), String> {
        self.refuse_dry()?;
        let mut st = self.lock();
        let b = self.find(&st, name)?.clone();
        Self::refuse_read(&b, "cleared")?;
        let zeros = vec![0u8; b.words.len() * 8];
        self.file
            .write_all_at(&zeros, b.area)
            .and_then(|()| self.file.sync_data())
            .map_err(|e| e.to_string())?;
        for w in b.words.iter() {
            w.store(0, Ordering::Release);
        }
        // It starts afresh, consistent, unless the device has outgrown it.
        if b.bits << b.shift >= self.device_bytes {
            b.flags.fetch_and(!INCONSISTENT, Ordering::Relaxed);
        }
        self.commit(&mut st).map_err(|e| e.to_string())
    }

    /// Sets in `target` the bits covering every range set in `sources` (of any
    /// granularity: a coarser target takes every granule a source range touches). An
    /// inconsistent source makes the target inconsistent.
    pub fn merge(&self, target: &str, sources: &[&str]) -> Result<(), String> {
        self.refuse_dry()?;
        let mut st = self.lock();
        let t = self.find(&st, target)?.clone();
        let mut srcs = Vec::new();
        for s in sources {
            srcs.push(self.find(&st, s)?.clone());
        }
        let mut want: std::collections::BTreeMap<usize, u64> = Default::default();
        for s in &srcs {
            for (w, word) in s.words.iter().enumerate() {
                let mut v = word.load(Ordering::Acquire);
                while v != 0 {
                    let bit = w as u64 * 64 + u64::from(v.trailing_zeros());
                    v &= v - 1;
                    if bit >= s.bits {
                        break;
                    }
                    let (start, end) = (bit << s.shift, (bit + 1) << s.shift);
                    let first = start >> t.shift;
                    let last = ((end - 1) >> t.shift).min(t.bits - 1);
                    for tb in first..=last {
                        *want.entry((tb / 64) as usize).or_default() |= 1 << (tb % 64);
                    }
                }
            }
        }
        let need: Vec<(usize, u64)> = want
            .into_iter()
            .map(|(w, bits)| (w, bits & !t.words[w].load(Ordering::Relaxed)))
            .filter(|&(_, bits)| bits != 0)
            .collect();
        let mut pages: Vec<usize> = need.iter().map(|(w, _)| w / PAGE_WORDS).collect();
        pages.dedup();
        for p in pages {
            self.file
                .write_all_at(&t.page_image(p, &need), t.area + p as u64 * PAGE)
                .map_err(|e| e.to_string())?;
        }
        self.file.sync_data().map_err(|e| e.to_string())?;
        for &(w, bits) in &need {
            t.words[w].fetch_or(bits, Ordering::Release);
        }
        if srcs.iter().any(|s| s.has(INCONSISTENT)) && !t.has(INCONSISTENT) {
            t.flags.fetch_or(INCONSISTENT, Ordering::Relaxed);
            self.commit(&mut st).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// Writes `dir` to its copy and syncs it.
fn write_dir(f: &File, dir: &Directory) -> std::io::Result<()> {
    f.write_all_at(&dir.encode(), dir.slot_offset())?;
    f.sync_data()
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_core::DirtyMap;

    const MB: u64 = 1 << 20;

    fn open(dir: &tempfile::TempDir, bytes: u64) -> Store {
        Store::open(&dir.path().join("s"), "vm", bytes, false).unwrap()
    }

    fn dirty(s: &Store, owner: &str, name: &str, len: u64) -> Vec<(u64, bool)> {
        let mut out = Vec::new();
        s.reader(owner, name)
            .unwrap()
            .runs(0, len, usize::MAX, &mut out);
        out
    }

    #[test]
    fn marks_reach_the_file_and_read_back_after_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let s = open(&dir, 64 * MB);
        s.add("b0", 64 << 10).unwrap();
        s.add("fine", 4096).unwrap();
        s.mark(70_000, 5000).unwrap();
        s.mark(63 * MB, MB).unwrap();
        let (_, enabled) = s.enabled();
        assert!(enabled.iter().all(|b| b.covers(70_000, 5000)));
        assert!(!enabled.iter().any(|b| b.covers(0, 4096)));
        drop(s);
        let s = open(&dir, 64 * MB);
        assert_eq!(
            dirty(&s, "", "b0", 64 * MB),
            [
                (65536, false),
                (65536, true),
                (62 * MB - 131072 + MB, false),
                (MB, true)
            ]
        );
        assert_eq!(
            dirty(&s, "", "fine", 128 << 10),
            [(69632, false), (8192, true), ((128 << 10) - 77824, false)]
        );
        // At most `most` runs.
        let mut out = Vec::new();
        s.reader("", "fine").unwrap().runs(0, 64 * MB, 2, &mut out);
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn a_torn_directory_leaves_the_one_before() {
        let dir = tempfile::tempdir().unwrap();
        let s = open(&dir, 16 * MB);
        s.add("b0", 64 << 10).unwrap(); // seq 2
        s.mark(0, 4096).unwrap();
        s.add("b1", 64 << 10).unwrap(); // seq 3, copy B
        drop(s);
        let path = dir.path().join("s");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[format::SLOT as usize + 30] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let s = open(&dir, 16 * MB);
        assert_eq!(s.names(""), ["b0"]);
        assert_eq!(dirty(&s, "", "b0", 65536), [(65536, true)]);
        // And new bitmaps never take the area the surviving directory names.
        s.add("b2", 64 << 10).unwrap();
        assert_eq!(dirty(&s, "", "b0", 65536), [(65536, true)]);
        assert_eq!(dirty(&s, "", "b2", 65536), [(65536, false)]);
    }

    #[test]
    fn a_checkpoint_settles_from_the_snapshots_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let s = open(&dir, 16 * MB);
        assert_eq!(s.checkpoint_begin("c1", None).unwrap(), None);
        s.checkpoint_end("c1", true);
        s.mark(0, 4096).unwrap();
        // c2 begun, never ended (a stop before its snapshot): undone at open.
        assert_eq!(s.checkpoint_begin("c2", None).unwrap(), Some("c1".into()));
        assert_eq!(s.names("c2"), ["c1"]);
        drop(s);
        let s = open(&dir, 16 * MB);
        s.reconcile(&|_| false).unwrap();
        assert_eq!(s.names(""), ["c1"]);
        assert_eq!(s.names("c2"), Vec::<String>::new());
        assert_eq!(dirty(&s, "", "c1", 65536), [(65536, true)]);
        // c2 begun, its snapshot taken, the stop before the end: finished at open.
        s.checkpoint_begin("c2", None).unwrap();
        drop(s);
        let s = open(&dir, 16 * MB);
        s.reconcile(&|n| n == "c2").unwrap();
        assert_eq!(s.names(""), ["c2"]);
        assert_eq!(s.names("c2"), ["c1"]);
        assert!(s.enabled().1.iter().all(|b| b.name() == "c2"));
        // A snapshot deleted meanwhile takes its bitmaps along.
        s.reconcile(&|_| false).unwrap();
        assert_eq!(s.names("c2"), Vec::<String>::new());
        // A checkpoint whose snapshot fails is undone at once.
        s.mark(MB, 4096).unwrap();
        s.checkpoint_begin("c3", Some(4096)).unwrap();
        s.checkpoint_end("c3", false);
        assert_eq!(s.names(""), ["c2"]);
        assert_eq!(dirty(&s, "", "c2", 2 * MB)[1], (65536, true));
    }

    #[test]
    fn past_the_end_is_inconsistent_and_merges_carry_it() {
        let dir = tempfile::tempdir().unwrap();
        let s = open(&dir, 16 * MB);
        s.add("b0", 64 << 10).unwrap();
        s.add("b1", 1 << 20).unwrap();
        s.mark(4096, 4096).unwrap();
        s.merge("b1", &["b0"]).unwrap();
        assert_eq!(dirty(&s, "", "b1", 2 * MB), [(MB, true), (MB, false)]);
        assert!(!s.list().iter().any(|b| b.inconsistent));
        drop(s);
        // The device grew: its bitmaps no longer cover it.
        let s = open(&dir, 32 * MB);
        assert!(s.list().iter().all(|b| b.inconsistent));
        let mut out = Vec::new();
        s.reader("", "b0")
            .unwrap()
            .runs(16 * MB, 16 * MB, 8, &mut out);
        assert_eq!(out, [(16 * MB, true)]);
        // Cleared, it still does not cover the device; added again, it does.
        s.clear("b0").unwrap();
        assert!(s.list()[0].inconsistent);
        s.remove("b0").unwrap();
        s.add("b0", 64 << 10).unwrap();
        assert!(
            !s.list()
                .iter()
                .find(|b| b.name == "b0")
                .unwrap()
                .inconsistent
        );
    }
}
