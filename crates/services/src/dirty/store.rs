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
//!
//! Every directory goes to both copies in turn ([`Store::commit`]); every page of bits is
//! written whole and sealed with its checksum. Opening a store, and what damage does
//! there, is `open`.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cairn_core::Error;

use super::bitmap::{Bitmap, BitmapInfo, Reader, Words};
use super::error::DirtyError;
use super::format::{self, Directory, Entry, INCONSISTENT, PAGE, PAGE_WORDS, SLOT, VERSION};

/// The granularity of a checkpoint's first bitmap: 64 KiB per bit.
pub const GRANULARITY: u64 = 64 << 10;

/// Pages written at once when a whole area is written.
const CHUNK_PAGES: usize = 256;

pub(super) struct State {
    /// The current directory on disk.
    pub(super) dir: Directory,
    /// Its bitmaps, in the same order.
    pub(super) bitmaps: Vec<Arc<Bitmap>>,
    /// The copy the next directory write goes to first: one that may not hold the
    /// current directory (damaged, behind, or torn by a failed write). `None`: both hold
    /// it, and copy A goes first.
    pub(super) stale: Option<usize>,
    /// The highest sequence number written or tried: none names two directories.
    pub(super) seq: u64,
    /// A directory whose write failed, which may yet be on disk: new areas avoid its.
    pub(super) tried: Option<Directory>,
}

/// The bitmaps a write sets ([`Store::enabled`]), as of a generation of the store: a
/// queue's copy, taken again when the generation moves on.
pub struct Enabled {
    /// The store's generation they are of.
    pub generation: u64,
    /// The enabled bitmaps.
    pub bitmaps: Vec<Arc<Bitmap>>,
}

/// The bitmaps of one device.
pub struct Store {
    pub(super) path: PathBuf,
    pub(super) file: File,
    pub(super) device_bytes: u64,
    /// Examine only: nothing is written.
    pub(super) dry: bool,
    /// The store's identity: every page of bits is sealed with it.
    pub(super) identity: u64,
    pub(super) state: Mutex<State>,
    /// Bumped whenever the enabled bitmaps change, so queues refresh their list.
    pub(super) generation: AtomicU64,
}

pub(super) fn os(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::os(format!("bitmap store {}: {what}", path.display()), e)
}

/// "A" or "B".
pub(super) fn copy_name(copy: usize) -> &'static str {
    if copy == 0 {
        "A"
    } else {
        "B"
    }
}

impl Store {
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
    pub fn enabled(&self) -> Enabled {
        let st = self.lock();
        Enabled {
            generation: self.generation(),
            bitmaps: st.bitmaps.iter().filter(|b| b.enabled()).cloned().collect(),
        }
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
                    let image = b.page_image(self.identity, p, need);
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

    /// Writes the directory of what is in memory, as the next sequence number, to both
    /// copies in turn, each synced: first the one that may not hold the current
    /// directory, so that a write torn there leaves the other whole. Done once the first
    /// is synced (a failure of the second is logged, and that copy goes first next time).
    pub(super) fn commit(&self, st: &mut State) -> Result<(), Error> {
        if self.dry {
            return Ok(());
        }
        let Some(seq) = st.seq.checked_add(1) else {
            return Err(Error::Invalid(format!(
                "bitmap store {}: its sequence numbers are used up",
                self.path.display()
            )));
        };
        let dir = Directory {
            version: VERSION,
            seq,
            identity: self.identity,
            device: st.dir.device.clone(),
            device_bytes: self.device_bytes,
            entries: st.bitmaps.iter().map(|b| b.entry()).collect(),
        };
        assert!(dir.seq > st.dir.seq, "sequence numbers only grow");
        st.seq = dir.seq;
        let image = dir.encode();
        let first = st.stale.unwrap_or(0);
        if let Err(e) = write_copy(&self.file, &image, first) {
            st.stale = Some(first);
            st.tried = Some(dir);
            let what = format!("write directory copy {}", copy_name(first));
            return Err(os(&self.path, &what, e));
        }
        st.dir = dir;
        st.tried = None;
        let second = 1 - first;
        match write_copy(&self.file, &image, second) {
            Ok(()) => st.stale = None,
            Err(e) => {
                log::error!(
                    "cairn: bitmap store {}: write directory copy {}: {e}; copy {} holds the directory alone until the next directory write",
                    self.path.display(),
                    copy_name(second),
                    copy_name(first)
                );
                st.stale = Some(second);
            }
        }
        Ok(())
    }

    /// Writes every page of `b`'s area as it is in memory (not synced).
    pub(super) fn write_pages(&self, b: &Bitmap) -> std::io::Result<()> {
        self.write_area(b.area, b.pages(), |p| b.page_image(self.identity, p, &[]))
    }

    /// Writes `e`'s area as empty pages (not synced).
    fn write_empty(&self, e: &Entry) -> std::io::Result<()> {
        let pages = (e.area_bytes() / PAGE) as usize;
        self.write_area(e.area, pages, |p| {
            let mut page = vec![0u8; PAGE as usize];
            format::seal_page(&mut page, self.identity, e.area, p as u64);
            page
        })
    }

    /// Writes `pages` pages at `area`, page `p` being `page(p)`, a chunk at a time.
    fn write_area(
        &self,
        area: u64,
        pages: usize,
        page: impl Fn(usize) -> Vec<u8>,
    ) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(pages.min(CHUNK_PAGES) * PAGE as usize);
        for first in (0..pages).step_by(CHUNK_PAGES) {
            buf.clear();
            for p in first..pages.min(first + CHUNK_PAGES) {
                buf.extend_from_slice(&page(p));
            }
            self.file.write_all_at(&buf, area + first as u64 * PAGE)?;
        }
        Ok(())
    }

    fn find<'a>(&self, st: &'a State, name: &str) -> Result<&'a Arc<Bitmap>, DirtyError> {
        st.bitmaps
            .iter()
            .find(|b| b.name == name)
            .ok_or_else(|| DirtyError::NotFound {
                name: name.to_string(),
                known: st.bitmaps.iter().map(|b| b.name.clone()).collect(),
            })
    }

    pub(super) fn refuse_dry(&self) -> Result<(), DirtyError> {
        if self.dry {
            return Err(DirtyError::ReadOnly);
        }
        Ok(())
    }

    /// Adds an empty, enabled bitmap `name` of `granularity` bytes per bit.
    pub fn add(&self, name: &str, granularity: u64) -> Result<(), DirtyError> {
        format::check_name(name)?;
        self.refuse_dry()?;
        let mut st = self.lock();
        if st.bitmaps.iter().any(|b| b.name == name) {
            return Err(DirtyError::Exists {
                name: name.to_string(),
                checkpoint: false,
            });
        }
        let e = self.new_entry(&st, name, granularity, 0)?;
        st.bitmaps.push(Arc::new(Bitmap::new(&e)));
        if let Err(err) = self.commit(&mut st) {
            st.bitmaps.pop();
            return Err(err.into());
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// An entry for a new bitmap, its area written with empty pages and synced (before
    /// any directory names it, so that none names pages that fail their check).
    pub(super) fn new_entry(
        &self,
        st: &State,
        name: &str,
        granularity: u64,
        flags: u32,
    ) -> Result<Entry, DirtyError> {
        if !granularity.is_power_of_two()
            || !(format::GRANULARITY_MIN..=format::GRANULARITY_MAX).contains(&granularity)
        {
            return Err(DirtyError::BadGranularity { granularity });
        }
        let bits = self.device_bytes.div_ceil(granularity).max(1);
        if bits > format::BITS_MAX {
            return Err(DirtyError::TooManyBits {
                granularity,
                bits,
                most_bits: format::BITS_MAX,
            });
        }
        if st.bitmaps.len() >= format::BITMAPS_MAX {
            return Err(DirtyError::Full);
        }
        // Clear of every area the directory on disk names (and one whose write failed
        // may): should the next directory be torn, the one before it still finds its bits.
        let used: Vec<(u64, u64)> = st
            .dir
            .entries
            .iter()
            .chain(st.tried.iter().flat_map(|d| d.entries.iter()))
            .cloned()
            .chain(st.bitmaps.iter().map(|b| b.entry()))
            .map(|e| (e.area, e.area_bytes()))
            .collect();
        let e = Entry {
            name: name.to_string(),
            owner: String::new(),
            shift: granularity.trailing_zeros(),
            bits,
            flags,
            area: format::place(&used, format::area_bytes(VERSION, bits)),
        };
        self.write_empty(&e).and_then(|()| self.file.sync_data())?;
        Ok(e)
    }

    pub(super) fn refuse_read(b: &Bitmap, action: &'static str) -> Result<(), DirtyError> {
        let n = b.readers.load(Ordering::Relaxed);
        if n > 0 {
            return Err(DirtyError::BeingRead {
                name: b.name.clone(),
                readers: n as u64,
                action,
            });
        }
        Ok(())
    }

    /// Removes bitmap `name` (refused while a client reads it).
    pub fn remove(&self, name: &str) -> Result<(), DirtyError> {
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
            return Err(e.into());
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Clears every bit of bitmap `name` (and its inconsistency: it starts afresh).
    pub fn clear(&self, name: &str) -> Result<(), DirtyError> {
        self.refuse_dry()?;
        let mut st = self.lock();
        let b = self.find(&st, name)?.clone();
        Self::refuse_read(&b, "cleared")?;
        // Empty pages on disk first: the bits in memory are never fewer than there.
        self.write_empty(&b.entry())
            .and_then(|()| self.file.sync_data())?;
        for w in b.words.iter() {
            w.store(0, Ordering::Release);
        }
        // It starts afresh, consistent, unless the device has outgrown it.
        if b.bits << b.shift >= self.device_bytes {
            b.flags.fetch_and(!INCONSISTENT, Ordering::Relaxed);
        }
        Ok(self.commit(&mut st)?)
    }

    /// Sets in `target` the bits covering every range set in `sources` (of any
    /// granularity: a coarser target takes every granule a source range touches). An
    /// inconsistent source makes the target inconsistent.
    pub fn merge(&self, target: &str, sources: &[&str]) -> Result<(), DirtyError> {
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
            self.file.write_all_at(
                &t.page_image(self.identity, p, &need),
                t.area + p as u64 * PAGE,
            )?;
        }
        self.file.sync_data()?;
        for &(w, bits) in &need {
            t.words[w].fetch_or(bits, Ordering::Release);
        }
        if srcs.iter().any(|s| s.has(INCONSISTENT)) && !t.has(INCONSISTENT) {
            t.flags.fetch_or(INCONSISTENT, Ordering::Relaxed);
            self.commit(&mut st)?;
        }
        Ok(())
    }
}

/// Writes a directory's `image` to copy `copy` (0: A, 1: B) and syncs it.
fn write_copy(f: &File, image: &[u8], copy: usize) -> std::io::Result<()> {
    f.write_all_at(image, copy as u64 * SLOT)?;
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
        let enabled = s.enabled().bitmaps;
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

    /// The dirty bytes `list()` shows for bitmap `name`.
    fn listed(s: &Store, name: &str) -> (u64, bool) {
        let b = s.list().into_iter().find(|b| b.name == name).unwrap();
        (b.dirty_bytes, b.inconsistent)
    }

    /// What a user meets at the admin: a bitmap that is not there, a name taken, a name
    /// no bitmap may have, a granularity out of range; each its own kind, and the store
    /// unchanged.
    #[test]
    fn refusals_say_what_is_wrong_by_kind() {
        let dir = tempfile::tempdir().unwrap();
        let s = open(&dir, 64 * MB);
        s.add("b1", GRANULARITY).unwrap();
        let e = s.remove("nope").unwrap_err();
        assert!(
            matches!(&e, DirtyError::NotFound { name, known } if name == "nope" && known == &["b1"]),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "no bitmap 'nope' (bitmaps: b1)");
        let e = s.add("b1", GRANULARITY).unwrap_err();
        assert!(
            matches!(&e, DirtyError::Exists { name, checkpoint: false } if name == "b1"),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "a bitmap 'b1' exists");
        let e = s.add("a b", GRANULARITY).unwrap_err();
        assert!(matches!(e, DirtyError::BadName { .. }), "{e:?}");
        let e = s.add("b2", 1000).unwrap_err();
        assert!(
            matches!(e, DirtyError::BadGranularity { granularity: 1000 }),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .starts_with("granularity 1000: a power of two"),
            "{e}"
        );
        assert_eq!(s.names(""), vec!["b1".to_string()]);
    }

    #[test]
    fn one_damaged_directory_copy_leaves_the_same_state_and_is_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let s = open(&dir, 16 * MB);
        s.add("b0", 64 << 10).unwrap();
        s.mark(0, 4096).unwrap();
        s.add("b1", 64 << 10).unwrap();
        drop(s);
        let good = std::fs::read(&path).unwrap();
        for copy in [0, format::SLOT as usize] {
            let mut bytes = good.clone();
            bytes[copy + 30] ^= 0xff;
            std::fs::write(&path, &bytes).unwrap();
            let s = open(&dir, 16 * MB);
            assert_eq!(s.names(""), ["b0", "b1"], "copy at {copy} damaged");
            assert_eq!(dirty(&s, "", "b0", 65536), [(65536, true)]);
            // Rewritten at the open: the other copy damaged now, the state holds.
            drop(s);
            let mut bytes = std::fs::read(&path).unwrap();
            bytes[format::SLOT as usize - copy + 30] ^= 0xff;
            std::fs::write(&path, &bytes).unwrap();
            let s = open(&dir, 16 * MB);
            assert_eq!(s.names(""), ["b0", "b1"], "then the other copy damaged");
            drop(s);
            std::fs::write(&path, &good).unwrap();
        }
        // New bitmaps never take an area a directory copy names.
        let s = open(&dir, 16 * MB);
        s.remove("b0").unwrap();
        s.add("b2", 64 << 10).unwrap();
        assert_eq!(dirty(&s, "", "b2", 65536), [(65536, false)]);
    }

    #[test]
    fn an_empty_or_short_store_is_refused_and_left_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let s = open(&dir, 16 * MB);
        s.add("b0", 64 << 10).unwrap();
        s.mark(0, 4096).unwrap();
        drop(s);
        let full = std::fs::read(&path).unwrap();
        // Empty, or cut inside the first copy's directory (the second is further on).
        for len in [0, 1, 100] {
            std::fs::write(&path, &full[..len]).unwrap();
            for dry in [true, false] {
                let e = Store::open(&path, "vm", 16 * MB, dry)
                    .err()
                    .unwrap_or_else(|| panic!("{len} bytes opened"))
                    .to_string();
                assert!(e.contains("move it away"), "{e}");
                assert_eq!(std::fs::read(&path).unwrap(), &full[..len]);
            }
        }
        // An absent file is a new store, and its file is whole from the start.
        std::fs::remove_file(&path).unwrap();
        let s = open(&dir, 16 * MB);
        assert!(s.names("").is_empty());
        drop(s);
        let bytes = std::fs::read(&path).unwrap();
        // Copy B is written as far as its directory's pages: the file ends there.
        let slot = format::SLOT as usize;
        assert!(format::Directory::decode(&bytes[..slot]).is_ok());
        assert!(format::Directory::decode(&bytes[slot..]).is_ok());
        // Made under a temporary name, which is gone.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["s"]);
    }

    #[test]
    fn a_zeroed_or_damaged_page_of_bits_makes_its_bitmap_inconsistent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let s = open(&dir, 64 * MB);
        s.add("b1", 4096).unwrap();
        s.add("b2", 64 << 10).unwrap();
        for i in 0..300u64 {
            s.mark((i * 7919 % 16384) * 4096, 4096).unwrap();
        }
        let (want, _) = listed(&s, "b1");
        let (area, area_bytes) = {
            let st = s.lock();
            let e = &st.dir.entries[0];
            (e.area as usize, e.area_bytes() as usize)
        };
        drop(s);
        let good = std::fs::read(&path).unwrap();
        // Zeroed whole, zeroed half, one byte flipped.
        for (from, to, flip) in [
            (area, area + area_bytes, false),
            (area, area + area_bytes / 2, false),
            (area + 100, area + 101, true),
        ] {
            let mut bytes = good.clone();
            for b in &mut bytes[from..to] {
                *b = if flip { *b ^ 0x10 } else { 0 };
            }
            std::fs::write(&path, &bytes).unwrap();
            let s = open(&dir, 64 * MB);
            let (got, inconsistent) = listed(&s, "b1");
            assert!(inconsistent, "{from}..{to}: not flagged");
            assert!(got >= want, "{from}..{to}: {got} < {want}");
            assert!(!listed(&s, "b2").1, "b2 flagged too");
            drop(s);
            // Flagged on disk: it stays inconsistent.
            let s = open(&dir, 64 * MB);
            assert!(listed(&s, "b1").1);
            drop(s);
        }
    }

    /// A version 1 store as an older cairn left it: copy A holds sequence 2 with bitmap
    /// b0 (64 KiB over 5 MiB: 80 bits, the last word partial) whose granules 1 and 65
    /// are dirty, copy B sequence 1 with no bitmap; bits 8 to a byte, unchecked.
    fn version_1_store(path: &Path) -> Vec<u8> {
        let dir = |seq, entries| Directory {
            version: 1,
            seq,
            identity: 0,
            device: "vm".into(),
            device_bytes: 5 * MB,
            entries,
        };
        let e = Entry {
            name: "b0".into(),
            owner: String::new(),
            shift: 16,
            bits: 80,
            flags: 0,
            area: format::AREAS,
        };
        let mut bytes = vec![0u8; (format::AREAS + PAGE) as usize];
        let a = dir(2, vec![e]).encode();
        let b = dir(1, Vec::new()).encode();
        bytes[..a.len()].copy_from_slice(&a);
        bytes[SLOT as usize..SLOT as usize + b.len()].copy_from_slice(&b);
        bytes[format::AREAS as usize] = 0b10;
        bytes[format::AREAS as usize + 8] = 0b10;
        std::fs::write(path, &bytes).unwrap();
        bytes
    }

    #[test]
    fn a_version_1_store_reads_back_and_is_upgraded_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let old = version_1_store(&path);
        let want = [
            (65536, false),
            (65536, true),
            (63 * 65536, false),
            (65536, true),
            (14 * 65536, false),
        ];
        // Examined only: read as it is, nothing written.
        let s = Store::open(&path, "vm", 5 * MB, true).unwrap();
        assert_eq!(dirty(&s, "", "b0", 5 * MB), want);
        drop(s);
        assert_eq!(std::fs::read(&path).unwrap(), old);
        // Opened for writing: both copies of version 2, the bits in a new area (the old
        // one untouched), sealed.
        let s = open(&dir, 5 * MB);
        assert_eq!(dirty(&s, "", "b0", 5 * MB), want);
        assert!(!listed(&s, "b0").1);
        s.mark(0, 1).unwrap();
        drop(s);
        let bytes = std::fs::read(&path).unwrap();
        let a = Directory::decode(&bytes[..SLOT as usize]).unwrap();
        let b = Directory::decode(&bytes[SLOT as usize..2 * SLOT as usize]).unwrap();
        assert_eq!((a.version, a.seq), (VERSION, 3));
        assert_eq!(a, b);
        let area = a.entries[0].area;
        assert!(area >= format::AREAS + PAGE, "{area}");
        assert_eq!(
            bytes[format::AREAS as usize..(format::AREAS + PAGE) as usize],
            old[format::AREAS as usize..]
        );
        let page = &bytes[area as usize..(area + PAGE) as usize];
        assert_eq!(format::check_page(page, a.identity, area, 0), Ok(()));
        let s = open(&dir, 5 * MB);
        assert_eq!(dirty(&s, "", "b0", 65536 * 2), [(2 * 65536, true)]);
        assert_eq!(listed(&s, "b0").0, 3 * 65536);
    }

    #[test]
    fn a_version_1_store_missing_a_copy_flags_its_bitmaps() {
        // Copy B unreadable: it may have held a newer directory than A's.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let mut bytes = version_1_store(&path);
        bytes[SLOT as usize + 30] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let s = Store::open(&path, "vm", 5 * MB, true).unwrap();
        assert!(listed(&s, "b0").1);
        drop(s);
        let s = open(&dir, 5 * MB);
        assert_eq!(listed(&s, "b0"), (2 * 65536, true));
        drop(s);
        assert!(listed(&open(&dir, 5 * MB), "b0").1);
    }

    #[test]
    fn a_device_not_a_whole_number_of_64_granules_keeps_its_last_bits() {
        let dir = tempfile::tempdir().unwrap();
        // 5 MiB: 80 granules of 64 KiB; 5 MiB + 8 KiB: 1282 of 4 KiB.
        for (bytes, g) in [(5 * MB, 64 << 10), (5 * MB + 8192, 4096)] {
            let path = dir.path().join("s");
            let s = Store::open(&path, "vm", bytes, false).unwrap();
            s.add("b0", g).unwrap();
            s.mark(64 << 10, 1).unwrap();
            s.mark(bytes - 1, 1).unwrap();
            let want = dirty(&s, "", "b0", bytes);
            assert_eq!(listed(&s, "b0").0, 2 * g);
            drop(s);
            let s = Store::open(&path, "vm", bytes, false).unwrap();
            assert_eq!(dirty(&s, "", "b0", bytes), want, "{bytes} bytes");
            assert_eq!(listed(&s, "b0").0, 2 * g);
            drop(s);
            std::fs::remove_file(&path).unwrap();
        }
        // Through a checkpoint: the bitmap attached to the snapshot keeps the last write.
        let path = dir.path().join("s");
        let s = Store::open(&path, "vm", 5 * MB, false).unwrap();
        s.checkpoint_begin("c1", None).unwrap();
        s.checkpoint_end("c1", true);
        s.mark(5 * MB - 4096, 4096).unwrap();
        s.checkpoint_begin("c2", None).unwrap();
        s.checkpoint_end("c2", true);
        drop(s);
        let s = Store::open(&path, "vm", 5 * MB, false).unwrap();
        assert_eq!(
            dirty(&s, "c2", "c1", 5 * MB),
            [(5 * MB - 65536, false), (65536, true)]
        );
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
        assert!(s.enabled().bitmaps.iter().all(|b| b.name() == "c2"));
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
