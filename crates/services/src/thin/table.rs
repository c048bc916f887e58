//! A volume's mapping table as the reactors use it: virtual block -> entry, read and
//! changed without a lock. A directory of leaves of 1024 entries each; a lookup is three
//! dependent loads (the directory, the leaf, the entry), a change one compare-and-swap.
//! Leaves are made on first write ([`Table::ensure_leaf`]) and live as long as the table.
//!
//! The directory is made for a few times the volume's size; a volume grown past it gets a
//! larger directory ([`Table::grow`]) while its writes are held: the leaves are the same,
//! the old directory stays allocated until the table drops (a reader may still be looking
//! through it; it holds the same leaves).

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering};
use std::sync::Mutex;

use super::state::OWNED;

/// Entries per leaf (one 4 KiB page of u32s).
pub const LEAF_ENTRIES: usize = 1024;

type Leaf = [AtomicU32; LEAF_ENTRIES];

/// The leaves of a table of `blocks` virtual blocks.
struct Dir {
    leaves: Box<[AtomicPtr<Leaf>]>,
    /// Per leaf: an entry changed since the commit thread last looked ([`Table::take_dirty`]).
    dirty: Box<[AtomicBool]>,
    /// Per leaf: reactors in the middle of a [`Table::change`] (its entry swapped, its
    /// leaf not yet marked).
    changing: Box<[AtomicU32]>,
    blocks: u64,
}

impl Dir {
    fn new(blocks: u64) -> Dir {
        let leaves = (blocks as usize).div_ceil(LEAF_ENTRIES);
        Dir {
            leaves: (0..leaves)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
            dirty: (0..leaves).map(|_| AtomicBool::new(false)).collect(),
            changing: (0..leaves).map(|_| AtomicU32::new(0)).collect(),
            blocks,
        }
    }
}

/// One volume's table.
pub struct Table {
    /// The directory in use (made from a Box, replaced only by [`Table::grow`]).
    dir: AtomicPtr<Dir>,
    /// Directories replaced by larger ones, freed when the table drops. Boxed: a reader
    /// may still hold a pointer to one, which must not move.
    #[allow(clippy::vec_box)]
    retired: Mutex<Vec<Box<Dir>>>,
}

impl Table {
    /// A table of `blocks` virtual blocks, all holes, with no leaf yet.
    pub fn new(blocks: u64) -> Table {
        Table {
            dir: AtomicPtr::new(Box::into_raw(Box::new(Dir::new(blocks)))),
            retired: Mutex::new(Vec::new()),
        }
    }

    #[inline]
    fn dir(&self) -> &Dir {
        // SAFETY: the pointer comes from Box::into_raw; a directory replaced by `grow` is
        // kept in `retired`, and all are freed only when the table drops.
        unsafe { &*self.dir.load(Ordering::Acquire) }
    }

    /// Virtual blocks it maps.
    pub fn blocks(&self) -> u64 {
        self.dir().blocks
    }

    /// Makes room for `blocks` virtual blocks (no less than now). The caller holds every
    /// write to the volume (none in flight, none starting: no leaf is made and no entry
    /// marked meanwhile); readers may go on, through either directory.
    pub fn grow(&self, blocks: u64) {
        let old = self.dir();
        if blocks <= old.blocks {
            return;
        }
        let new = Dir::new(blocks);
        for (i, (l, d)) in old.leaves.iter().zip(old.dirty.iter()).enumerate() {
            new.leaves[i].store(l.load(Ordering::Acquire), Ordering::Relaxed);
            new.dirty[i].store(d.load(Ordering::Acquire), Ordering::Relaxed);
            // No change is under way: writes are held.
            debug_assert_eq!(old.changing[i].load(Ordering::Acquire), 0, "leaf {i}");
        }
        let was = self
            .dir
            .swap(Box::into_raw(Box::new(new)), Ordering::AcqRel);
        // SAFETY: `was` came from Box::into_raw and is no longer the table's directory.
        let was = unsafe { Box::from_raw(was) };
        self.retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(was);
    }

    #[inline]
    fn leaf(&self, vblock: u64) -> Option<&Leaf> {
        let p = self
            .dir()
            .leaves
            .get(vblock as usize / LEAF_ENTRIES)?
            .load(Ordering::Acquire);
        // SAFETY: a non-null pointer in the directory is a leaf made by `ensure_leaf`
        // from a Box, never freed or replaced before the table drops.
        (!p.is_null()).then(|| unsafe { &*p })
    }

    /// The entry of `vblock` (0: a hole, or past the end).
    #[inline]
    pub fn get(&self, vblock: u64) -> u32 {
        self.leaf(vblock).map_or(0, |l| {
            l[vblock as usize % LEAF_ENTRIES].load(Ordering::Acquire)
        })
    }

    /// Whether `vblock`'s leaf exists (a write there needs none made first).
    pub fn has_leaf(&self, vblock: u64) -> bool {
        self.leaf(vblock).is_some()
    }

    /// Makes the leaf holding `vblock` if it is missing (it allocates: once per 1024
    /// blocks of virtual space, on the first write there).
    pub fn ensure_leaf(&self, vblock: u64) {
        let Some(slot) = self.dir().leaves.get(vblock as usize / LEAF_ENTRIES) else {
            return;
        };
        if !slot.load(Ordering::Acquire).is_null() {
            return;
        }
        let fresh: Box<Leaf> = Box::new(std::array::from_fn(|_| AtomicU32::new(0)));
        let p = Box::into_raw(fresh);
        if slot
            .compare_exchange(std::ptr::null_mut(), p, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // SAFETY: `p` came from Box::into_raw above and was never published.
            drop(unsafe { Box::from_raw(p) });
        }
    }

    /// Changes `vblock`'s entry from `old` to `new`; the entry found if it was not `old`
    /// (or `Err(0)` when the leaf is missing or `vblock` is past the end).
    #[inline]
    pub fn swap_if(&self, vblock: u64, old: u32, new: u32) -> Result<(), u32> {
        debug_assert_ne!(new, OWNED, "vblock {vblock}: an empty entry marked owned");
        let Some(l) = self.leaf(vblock) else {
            return Err(0);
        };
        l[vblock as usize % LEAF_ENTRIES]
            .compare_exchange(old, new, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
    }

    /// Notes that `vblock`'s entry changed, for the next commit (after the change, so that
    /// the commit thread, which clears the flag before it reads the entries, sees it).
    #[inline]
    pub fn mark(&self, vblock: u64) {
        if let Some(d) = self.dir().dirty.get(vblock as usize / LEAF_ENTRIES) {
            if !d.load(Ordering::Relaxed) {
                d.store(true, Ordering::Release);
            }
        }
    }

    /// A reactor's change of `vblock`'s entry from `old` to `new` ([`Table::swap_if`]),
    /// marked for the next commit ([`Table::mark`]). Counted in the leaf's `changing`
    /// from before the swap until after the mark, so that whoever sees the new entry also
    /// sees that its leaf holds a change no capture took yet (see [`Table::captured`]).
    #[inline]
    pub fn change(&self, vblock: u64, old: u32, new: u32) -> Result<(), u32> {
        let Some(changing) = self.dir().changing.get(vblock as usize / LEAF_ENTRIES) else {
            return Err(0);
        };
        changing.fetch_add(1, Ordering::SeqCst);
        let swapped = self.swap_if(vblock, old, new);
        if swapped.is_ok() {
            self.mark(vblock);
        }
        changing.fetch_sub(1, Ordering::SeqCst);
        swapped
    }

    /// Whether every change made so far to `vblock`'s leaf through [`Table::change`] was
    /// taken by a capture of the commit thread ([`Table::take_dirty`]): none is under
    /// way, none came since. Called after the entry was read: the entry read is then one
    /// a capture took (durable once that capture's commit is).
    #[inline]
    pub fn captured(&self, vblock: u64) -> bool {
        let i = vblock as usize / LEAF_ENTRIES;
        let dir = self.dir();
        match (dir.changing.get(i), dir.dirty.get(i)) {
            (Some(c), Some(d)) => c.load(Ordering::SeqCst) == 0 && !d.load(Ordering::SeqCst),
            _ => false,
        }
    }

    /// Leaves in the directory.
    pub fn leaves(&self) -> usize {
        self.dir().leaves.len()
    }

    /// Whether leaf `i` changed since the last [`Table::take_dirty`] (commit thread).
    pub fn is_dirty(&self, i: usize) -> bool {
        self.dir()
            .dirty
            .get(i)
            .is_some_and(|d| d.load(Ordering::SeqCst))
    }

    /// Whether leaf `i` changed since the last call, clearing the flag (commit thread).
    pub fn take_dirty(&self, i: usize) -> bool {
        let dirty = &self.dir().dirty;
        dirty
            .get(i)
            .is_some_and(|d| d.load(Ordering::Relaxed) && d.swap(false, Ordering::AcqRel))
    }

    /// Leaf `i`'s entries as they are now (all holes if it has no leaf).
    pub fn leaf_entries(&self, i: usize, out: &mut [u32; LEAF_ENTRIES]) {
        match self.leaf((i * LEAF_ENTRIES) as u64) {
            Some(l) => {
                for (o, e) in out.iter_mut().zip(l.iter()) {
                    *o = e.load(Ordering::Acquire);
                }
            }
            None => out.fill(0),
        }
    }

    /// Sets `vblock`'s entry without looking (control plane, with no reactor writing the
    /// volume: a snapshot's copy, opening). Makes the leaf if needed.
    pub fn set(&self, vblock: u64, entry: u32) {
        debug_assert_ne!(entry, OWNED, "vblock {vblock}: an empty entry marked owned");
        // Past the end the entry would be dropped: a mapping lost without a word.
        debug_assert!(
            vblock < self.blocks(),
            "vblock {vblock} of {}",
            self.blocks()
        );
        self.ensure_leaf(vblock);
        if let Some(l) = self.leaf(vblock) {
            l[vblock as usize % LEAF_ENTRIES].store(entry, Ordering::Release);
        }
    }

    /// Every mapped (vblock, entry), in order (control plane: a snapshot's copy, a
    /// checkpoint).
    pub fn mapped(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        (0..self.leaves()).flat_map(move |i| {
            let leaf = self.leaf((i * LEAF_ENTRIES) as u64);
            leaf.into_iter().flat_map(move |l| {
                l.iter().enumerate().filter_map(move |(j, e)| {
                    let e = e.load(Ordering::Acquire);
                    (e != 0).then_some(((i * LEAF_ENTRIES + j) as u64, e))
                })
            })
        })
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: from Box::into_raw; nothing else holds the table.
        let dir = unsafe { Box::from_raw(self.dir.load(Ordering::Acquire)) };
        // The directory in use holds every leaf (a retired one holds some of the same).
        for slot in dir.leaves.iter() {
            let p = slot.load(Ordering::Acquire);
            if !p.is_null() {
                // SAFETY: made by `ensure_leaf` from a Box; nothing else holds the table.
                drop(unsafe { Box::from_raw(p) });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holes_leaves_and_swaps() {
        let t = Table::new(3000);
        assert_eq!(t.get(5), 0);
        assert_eq!(t.swap_if(5, 0, 7), Err(0), "no leaf yet");
        t.ensure_leaf(5);
        t.ensure_leaf(6);
        assert!(t.has_leaf(1023) && !t.has_leaf(1024));
        assert_eq!(t.swap_if(5, 0, 7), Ok(()));
        assert_eq!(t.swap_if(5, 0, 9), Err(7));
        assert_eq!(t.get(5), 7);
        t.ensure_leaf(2999);
        assert_eq!(t.swap_if(2999, 0, 1), Ok(()));
        assert_eq!(t.get(3000), 0);
        t.ensure_leaf(5000); // past the end: nothing
        assert_eq!(t.mapped().collect::<Vec<_>>(), vec![(5, 7), (2999, 1)]);
        // Grown: the same leaves and marks, room past the old end.
        t.mark(2999);
        t.grow(10_000);
        assert_eq!(t.blocks(), 10_000);
        assert!(t.take_dirty(2) && !t.take_dirty(2));
        t.set(9_999, 3);
        assert_eq!(
            t.mapped().collect::<Vec<_>>(),
            vec![(5, 7), (2999, 1), (9_999, 3)]
        );
        assert_eq!(t.swap_if(5, 7, 8), Ok(()));
        assert_eq!(t.get(5), 8);
    }

    /// The invariants debug builds check: a mapping set past the table's end would be
    /// dropped, and an entry marked owned with no block names nothing.
    #[test]
    #[cfg(debug_assertions)]
    fn debug_builds_refuse_a_mapping_past_the_end_or_an_owned_hole() {
        let t = Table::new(10);
        let past = std::panic::catch_unwind(|| t.set(10, 5));
        assert!(past.is_err(), "a set past the end");
        let owned_hole = std::panic::catch_unwind(|| t.set(1, OWNED));
        assert!(owned_hole.is_err(), "an owned hole");
        t.ensure_leaf(2);
        assert!(std::panic::catch_unwind(|| t.swap_if(2, 0, OWNED)).is_err());
        t.set(9, 5 | OWNED);
        assert_eq!(t.get(9), 5 | OWNED);
    }

    #[test]
    fn concurrent_writers_each_win_their_own_entries_and_readers_see_whole_values() {
        let t = std::sync::Arc::new(Table::new(4096));
        for vb in (0..4096).step_by(LEAF_ENTRIES) {
            t.ensure_leaf(vb);
        }
        std::thread::scope(|s| {
            for w in 0..2u32 {
                let t = t.clone();
                s.spawn(move || {
                    for vb in (w as u64..4096).step_by(2) {
                        t.swap_if(vb, 0, 0x1234_5678 + w).unwrap();
                    }
                });
            }
            let t2 = t.clone();
            s.spawn(move || {
                for _ in 0..100 {
                    for vb in 0..4096 {
                        let e = t2.get(vb);
                        assert!(e == 0 || e == 0x1234_5678 + (vb % 2) as u32, "{vb}: {e:#x}");
                    }
                }
            });
        });
        assert_eq!(t.mapped().count(), 4096);
        // A second claim of an entry loses and says who has it.
        assert_eq!(t.swap_if(10, 0, 1), Err(0x1234_5678));
    }
}
