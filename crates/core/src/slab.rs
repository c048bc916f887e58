//! A slab: per-queue storage for in-flight request state, indexed by a `u32` token.
//!
//! Values are plain `Copy` data kept in one vector and reused through a free list, so the
//! steady state allocates nothing and taking a value out is a copy, with no tag to write.
//! The vector grows to the high-water mark of requests in flight (bounded by the caller's
//! queue depth) within the capacity reserved up front. Debug builds track which indices
//! are live and assert on misuse.

/// Fixed storage with a free list.
pub struct Slab<T: Copy> {
    entries: Vec<T>,
    free: Vec<u32>,
    #[cfg(debug_assertions)]
    live: Vec<bool>,
}

impl<T: Copy> Slab<T> {
    /// A slab with room for `capacity` entries before it reallocates.
    pub fn with_capacity(capacity: usize) -> Slab<T> {
        Slab {
            entries: Vec::with_capacity(capacity),
            free: Vec::with_capacity(capacity),
            #[cfg(debug_assertions)]
            live: Vec::with_capacity(capacity),
        }
    }

    /// Stores `value`; returns its index.
    #[inline]
    pub fn insert(&mut self, value: T) -> u32 {
        let i = match self.free.pop() {
            Some(i) => {
                self.entries[i as usize] = value;
                i
            }
            None => {
                self.entries.push(value);
                #[cfg(debug_assertions)]
                self.live.push(false);
                (self.entries.len() - 1) as u32
            }
        };
        #[cfg(debug_assertions)]
        {
            assert!(!self.live[i as usize], "slab index {i} handed out twice");
            self.live[i as usize] = true;
        }
        i
    }

    #[inline]
    fn check(&self, _i: u32) {
        #[cfg(debug_assertions)]
        assert!(
            self.live.get(_i as usize).copied().unwrap_or(false),
            "slab index {_i} not in use"
        );
    }

    /// The entry at `i` (an index from `insert`, not yet removed).
    #[inline]
    pub fn get(&self, i: u32) -> &T {
        self.check(i);
        &self.entries[i as usize]
    }

    /// The entry at `i`, mutably (same contract as [`Slab::get`]).
    #[inline]
    pub fn get_mut(&mut self, i: u32) -> &mut T {
        self.check(i);
        &mut self.entries[i as usize]
    }

    /// The value at `i` whether it is in use or was freed (the last value stored there),
    /// or `None` past every index handed out: for tokens that may outlive their request,
    /// such as a timer that cannot be cancelled, whose owner tells from the value itself
    /// whether the token still means anything.
    #[inline]
    pub fn peek(&self, i: u32) -> Option<&T> {
        self.entries.get(i as usize)
    }

    /// One more than the highest index handed out so far (every index [`Slab::peek`]
    /// may find a value at).
    pub fn slots(&self) -> u32 {
        self.entries.len() as u32
    }

    /// Takes the entry at `i` out and frees its index.
    #[inline]
    pub fn remove(&mut self, i: u32) -> T {
        self.check(i);
        #[cfg(debug_assertions)]
        {
            self.live[i as usize] = false;
        }
        self.free.push(i);
        self.entries[i as usize]
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
        // A freed index keeps its last value for `peek`; none past the end.
        s.remove(c);
        assert_eq!(s.peek(c), Some(&3));
        assert_eq!(s.peek(s.slots()), None);
    }

    #[test]
    #[should_panic(expected = "not in use")]
    fn stale_index_is_caught_in_debug_builds() {
        let mut s = Slab::with_capacity(1);
        let a = s.insert(1);
        s.remove(a);
        s.get(a);
    }
}
