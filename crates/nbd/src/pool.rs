//! Per-connection data buffers: reused by size class, with a hard cap on the bytes a
//! connection may hold (its requests in flight and its replies not yet sent).

use cairn_core::AlignedBuf;

/// Smallest buffer handed out (one page: O_DIRECT devices need page alignment anyway).
const MIN_SHIFT: u32 = 12;
/// Size classes: 4 KiB, 8 KiB, ..., 2 GiB.
const CLASSES: usize = 20;

/// Buffers of one connection.
pub struct BufPool {
    free: [Vec<AlignedBuf>; CLASSES],
    /// Bytes handed out and not yet returned.
    out: usize,
    /// Bytes kept in the free lists.
    cached: usize,
    limit: usize,
}

fn class(len: usize) -> usize {
    let len = len.max(1 << MIN_SHIFT).next_power_of_two();
    (len.trailing_zeros() - MIN_SHIFT) as usize
}

impl BufPool {
    /// A pool that hands out at most `limit` bytes at a time.
    pub fn new(limit: usize) -> BufPool {
        BufPool {
            free: std::array::from_fn(|_| Vec::new()),
            out: 0,
            cached: 0,
            limit,
        }
    }

    /// A buffer of at least `len` bytes, or `None` while the connection holds its limit.
    /// The first request is always served, so one maximal request can make progress.
    pub fn get(&mut self, len: usize) -> Option<AlignedBuf> {
        let c = class(len);
        if c >= CLASSES {
            return None;
        }
        let size = 1usize << (c as u32 + MIN_SHIFT);
        if self.out > 0 && self.out + size > self.limit {
            return None;
        }
        self.out += size;
        match self.free[c].pop() {
            Some(b) => {
                self.cached -= size;
                Some(b)
            }
            None => Some(AlignedBuf::new(size)),
        }
    }

    /// A buffer of at least `len` bytes even over the limit (for bounded replies).
    pub fn get_always(&mut self, len: usize) -> AlignedBuf {
        let c = class(len).min(CLASSES - 1);
        let size = 1usize << (c as u32 + MIN_SHIFT);
        self.out += size;
        match self.free[c].pop() {
            Some(b) => {
                self.cached -= size;
                b
            }
            None => AlignedBuf::new(size),
        }
    }

    /// Returns a buffer from [`BufPool::get`]. Up to the limit's worth stays cached.
    pub fn put(&mut self, buf: AlignedBuf) {
        let size = buf.len();
        self.out = self.out.saturating_sub(size);
        if self.cached + size <= self.limit {
            self.cached += size;
            self.free[class(size)].push(buf);
        }
    }

    /// Bytes handed out.
    pub fn outstanding(&self) -> usize {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_round_up_and_the_limit_holds() {
        let mut p = BufPool::new(64 << 10);
        let a = p.get(1).unwrap();
        assert_eq!(a.len(), 4096);
        let b = p.get(5000).unwrap();
        assert_eq!(b.len(), 8192);
        let c = p.get(32 << 10).unwrap();
        assert_eq!(p.outstanding(), 44 << 10);
        assert!(p.get(32 << 10).is_none());
        p.put(c);
        assert!(p.get(32 << 10).is_some());
        // Alone, even an oversized request is served.
        let mut q = BufPool::new(4096);
        assert_eq!(q.get(1 << 20).unwrap().len(), 1 << 20);
        assert!(q.get(4096).is_none());
        p.put(a);
        p.put(b);
    }
}
