//! A slab: per-queue storage for in-flight request state, indexed by a `u32` token.
//!
//! Entries are allocated up front and reused through a free list, so the steady state
//! allocates nothing. If more requests are in flight than the slab was sized for, it
//! grows once to the new high-water mark (the bound is then the caller's queue depth).

/// Fixed storage with a free list.
pub struct Slab<T> {
    entries: Vec<Option<T>>,
    free: Vec<u32>,
}

impl<T> Slab<T> {
    /// A slab with room for `capacity` entries before it grows.
    pub fn with_capacity(capacity: usize) -> Slab<T> {
        let mut entries = Vec::with_capacity(capacity);
        entries.resize_with(capacity, || None);
        Slab {
            entries,
            free: (0..capacity as u32).rev().collect(),
        }
    }

    /// Stores `value`; returns its index.
    #[inline]
    pub fn insert(&mut self, value: T) -> u32 {
        match self.free.pop() {
            Some(i) => {
                debug_assert!(self.entries[i as usize].is_none());
                self.entries[i as usize] = Some(value);
                i
            }
            None => {
                self.entries.push(Some(value));
                self.free.reserve(self.entries.len());
                (self.entries.len() - 1) as u32
            }
        }
    }

    /// The entry at `i`.
    ///
    /// # Panics
    /// If `i` is not in use: tokens come only from `insert`, so that is a bug.
    #[inline]
    pub fn get(&self, i: u32) -> &T {
        self.entries[i as usize]
            .as_ref()
            .expect("slab index in use")
    }

    /// The entry at `i`, mutably (same contract as [`Slab::get`]).
    #[inline]
    pub fn get_mut(&mut self, i: u32) -> &mut T {
        self.entries[i as usize]
            .as_mut()
            .expect("slab index in use")
    }

    /// Takes the entry at `i` out and frees its index.
    #[inline]
    pub fn remove(&mut self, i: u32) -> T {
        let value = self.entries[i as usize].take().expect("slab index in use");
        self.free.push(i);
        value
    }

    /// Entries in use.
    pub fn len(&self) -> usize {
        self.entries.len() - self.free.len()
    }

    /// Whether no entry is in use.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_and_grows() {
        let mut s = Slab::with_capacity(2);
        let a = s.insert(1);
        let b = s.insert(2);
        let c = s.insert(3);
        assert_eq!((*s.get(a), *s.get(b), *s.get(c)), (1, 2, 3));
        assert_eq!(s.remove(b), 2);
        let d = s.insert(4);
        assert_eq!(d, b);
        assert_eq!(s.len(), 3);
        *s.get_mut(d) += 1;
        assert_eq!(*s.get(d), 5);
    }
}
