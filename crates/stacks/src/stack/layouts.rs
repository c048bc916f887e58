//! The four layouts: where each logical byte lives.

use cairn_core::Error;

use super::Layout;

/// Most copies a mirror or raid10 may keep (a per-request bit mask tracks them).
pub const COPIES_MAX: usize = 32;

/// Members end to end.
pub struct Linear {
    /// Start of each member in the stacked device, plus the total size at the end.
    starts: Vec<u64>,
    /// The member holding the first byte of each `1 << granule`-byte granule of the
    /// stacked device: a look-up and at most a step or two forward finds any offset's
    /// member, where a binary search over `starts` cost a mispredicted branch per level.
    first: Vec<u32>,
    granule: u32,
}

/// Most entries of [`Linear`]'s granule table (members of very different sizes get
/// coarser granules, and a few more steps forward).
const GRANULES_MAX: u64 = 1 << 16;

impl Linear {
    /// Members of the given sizes, in order, each used in whole `block`-byte blocks (so a
    /// piece never straddles a block of the stacked device).
    pub fn new(sizes: &[u64], block: u64) -> Linear {
        let mut starts = Vec::with_capacity(sizes.len() + 1);
        let mut at = 0;
        for &s in sizes {
            starts.push(at);
            at += s / block * block;
        }
        starts.push(at);
        // Granules no larger than the smallest member hold at most one member's start.
        let smallest = starts
            .windows(2)
            .map(|w| w[1] - w[0])
            .filter(|&s| s > 0)
            .min();
        let mut granule = smallest.map_or(63, |s| 63 - s.leading_zeros());
        while at >> granule >= GRANULES_MAX {
            granule += 1;
        }
        let first = (0..=at >> granule)
            .map(|k| {
                let o = k << granule;
                (starts.partition_point(|&s| s <= o).max(1) - 1).min(sizes.len().saturating_sub(1))
                    as u32
            })
            .collect();
        Linear {
            starts,
            first,
            granule,
        }
    }

    /// The member holding `offset` (below the size; the last one otherwise).
    #[inline(always)]
    fn member(&self, offset: u64) -> usize {
        let last = self.starts.len().saturating_sub(2);
        let mut m = self
            .first
            .get((offset >> self.granule) as usize)
            .map_or(last, |&m| m as usize);
        // Forward past members that end at or before it (zero-sized ones too). The end
        // is tested first: it is almost always past the offset, so the branch predicts
        // well whichever member the table named (`m < last` alone would not).
        while self.starts[m + 1] <= offset && m < last {
            m += 1;
        }
        m
    }
}

impl Layout for Linear {
    fn kind(&self) -> &'static str {
        "linear"
    }
    fn size_bytes(&self) -> u64 {
        *self.starts.last().unwrap_or(&0)
    }
    fn copies(&self) -> usize {
        1
    }
    #[inline]
    fn piece_len(&self, offset: u64, len: u64) -> u64 {
        let m = self.member(offset);
        len.min(self.starts[m + 1] - offset)
    }
    #[inline]
    fn locate(&self, offset: u64, _copy: usize) -> (usize, u64) {
        let m = self.member(offset);
        (m, offset - self.starts[m])
    }
    #[inline(always)]
    fn place(&self, offset: u64, len: u64, _copy: usize) -> Option<(usize, u64)> {
        let m = self.member(offset);
        (offset + len <= self.starts[m + 1]).then(|| (m, offset - self.starts[m]))
    }
    fn describe(&self) -> String {
        String::from("members end to end")
    }
}

/// A member count to divide by: shifts when it is a power of two (the usual case),
/// decided once when the layout is built rather than per request.
#[derive(Clone, Copy)]
struct Members {
    n: u64,
    /// log2(n) when n is a power of two.
    shift: Option<u32>,
}

impl Members {
    fn new(n: usize) -> Members {
        let n = n as u64;
        Members {
            n,
            shift: n.is_power_of_two().then(|| n.trailing_zeros()),
        }
    }

    /// `(x % n, x / n)`.
    #[inline(always)]
    fn div(self, x: u64) -> (u64, u64) {
        match self.shift {
            Some(shift) => (x & (self.n - 1), x >> shift),
            None => (x % self.n, x / self.n),
        }
    }
}

fn check_chunk(kind: &str, chunk: u64, block: u64) -> Result<(), Error> {
    if !chunk.is_power_of_two() || chunk < block {
        return Err(Error::Invalid(format!(
            "{kind}: chunk {chunk} must be a power of two of at least the {block}-byte block size"
        )));
    }
    Ok(())
}

/// RAID0: chunk `i` on member `i % n`.
pub struct Stripe {
    chunk: u64,
    chunk_shift: u32,
    members: Members,
    size: u64,
}

impl Stripe {
    /// `members` devices of at least `member_size` bytes, in `chunk`-byte chunks.
    pub fn new(members: usize, chunk: u64, member_size: u64, block: u64) -> Result<Stripe, Error> {
        check_chunk("stripe", chunk, block)?;
        let rows = member_size / chunk;
        if rows == 0 {
            return Err(Error::Invalid(format!(
                "stripe: members ({member_size} bytes) are smaller than one chunk ({chunk})"
            )));
        }
        Ok(Stripe {
            chunk,
            chunk_shift: chunk.trailing_zeros(),
            members: Members::new(members),
            size: rows * chunk * members as u64,
        })
    }
}

impl Layout for Stripe {
    fn kind(&self) -> &'static str {
        "stripe"
    }
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn copies(&self) -> usize {
        1
    }
    #[inline]
    fn piece_len(&self, offset: u64, len: u64) -> u64 {
        len.min(self.chunk - (offset & (self.chunk - 1)))
    }
    #[inline]
    fn locate(&self, offset: u64, _copy: usize) -> (usize, u64) {
        let i = offset >> self.chunk_shift;
        let (member, row) = self.members.div(i);
        (
            member as usize,
            (row << self.chunk_shift) | (offset & (self.chunk - 1)),
        )
    }
    fn describe(&self) -> String {
        format!("chunk={}", self.chunk)
    }
}

/// RAID1: every member holds everything.
pub struct Mirror {
    members: usize,
    size: u64,
}

impl Mirror {
    /// `members` devices, the smallest of which has `member_size` bytes.
    pub fn new(members: usize, member_size: u64) -> Result<Mirror, Error> {
        if members < 2 {
            return Err(Error::Invalid("mirror: needs at least two members".into()));
        }
        if members > COPIES_MAX {
            return Err(Error::Invalid(format!(
                "mirror: at most {COPIES_MAX} members, not {members}"
            )));
        }
        Ok(Mirror {
            members,
            size: member_size,
        })
    }
}

impl Layout for Mirror {
    fn kind(&self) -> &'static str {
        "mirror"
    }
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn copies(&self) -> usize {
        self.members
    }
    #[inline]
    fn piece_len(&self, _offset: u64, len: u64) -> u64 {
        len
    }
    #[inline]
    fn locate(&self, offset: u64, copy: usize) -> (usize, u64) {
        (copy, offset)
    }
    fn describe(&self) -> String {
        format!("copies={}", self.members)
    }
}

/// RAID10 in md's "near" layout.
///
/// Logical chunk `i` has `copies` copies at positions `i*copies .. i*copies+copies` of a
/// grid `members` wide: copy `k` lives on member `(i*copies + k) % members`, in chunk row
/// `(i*copies + k) / members`. With 4 members and 2 copies, chunk 0 is on members 0 and 1,
/// chunk 1 on 2 and 3, chunk 2 on 0 and 1 one row down, and so on; with 3 members and 2
/// copies, chunk 1 is on member 2 (row 0) and member 0 (row 1).
pub struct Raid10 {
    chunk: u64,
    chunk_shift: u32,
    members: Members,
    copies: u64,
    size: u64,
}

impl Raid10 {
    /// Bytes at the start of every member that hold only copies of logical bytes below
    /// `at` (whole chunk rows), for a rebuild that has copied everything below `at`.
    pub fn member_rows_below(&self, at: u64) -> u64 {
        let chunks_done = at / self.chunk;
        chunks_done * self.copies / self.members.n * self.chunk
    }

    /// The logical offset below which every copy lies in the first `member_offset` bytes
    /// of the members (where a rebuild checkpointed there resumes).
    pub fn logical_below_rows(&self, member_offset: u64) -> u64 {
        let rows = member_offset / self.chunk;
        rows * self.members.n / self.copies * self.chunk
    }

    /// `members` devices of at least `member_size` bytes, `copies` copies, `chunk` bytes.
    pub fn new(
        members: usize,
        copies: usize,
        chunk: u64,
        member_size: u64,
        block: u64,
    ) -> Result<Raid10, Error> {
        check_chunk("raid10", chunk, block)?;
        if copies < 2 || copies > members || copies > COPIES_MAX {
            return Err(Error::Invalid(format!(
                "raid10: copies {copies} must be from 2 to the number of members ({members}), at most {COPIES_MAX}"
            )));
        }
        let rows = member_size / chunk;
        let chunks = rows * members as u64 / copies as u64;
        if chunks == 0 {
            return Err(Error::Invalid(format!(
                "raid10: members ({member_size} bytes) are smaller than one chunk ({chunk})"
            )));
        }
        Ok(Raid10 {
            chunk,
            chunk_shift: chunk.trailing_zeros(),
            members: Members::new(members),
            copies: copies as u64,
            size: chunks * chunk,
        })
    }
}

impl Layout for Raid10 {
    fn kind(&self) -> &'static str {
        "raid10"
    }
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn copies(&self) -> usize {
        self.copies as usize
    }
    #[inline]
    fn piece_len(&self, offset: u64, len: u64) -> u64 {
        len.min(self.chunk - (offset & (self.chunk - 1)))
    }
    #[inline]
    fn locate(&self, offset: u64, copy: usize) -> (usize, u64) {
        let position = (offset >> self.chunk_shift) * self.copies + copy as u64;
        let (member, row) = self.members.div(position);
        (
            member as usize,
            (row << self.chunk_shift) | (offset & (self.chunk - 1)),
        )
    }
    fn describe(&self) -> String {
        format!("chunk={} copies={} layout=near", self.chunk, self.copies)
    }
}

/// Any of the four layouts, dispatched statically (the hot path inlines through it).
pub enum AnyLayout {
    /// Members end to end.
    Linear(Linear),
    /// RAID0.
    Stripe(Stripe),
    /// RAID1.
    Mirror(Mirror),
    /// RAID10.
    Raid10(Raid10),
}

macro_rules! each {
    ($self:ident, $l:ident => $e:expr) => {
        match $self {
            AnyLayout::Linear($l) => $e,
            AnyLayout::Stripe($l) => $e,
            AnyLayout::Mirror($l) => $e,
            AnyLayout::Raid10($l) => $e,
        }
    };
}

impl Layout for AnyLayout {
    fn kind(&self) -> &'static str {
        each!(self, l => l.kind())
    }
    fn size_bytes(&self) -> u64 {
        each!(self, l => l.size_bytes())
    }
    #[inline]
    fn copies(&self) -> usize {
        each!(self, l => l.copies())
    }
    #[inline(always)]
    fn piece_len(&self, offset: u64, len: u64) -> u64 {
        each!(self, l => l.piece_len(offset, len))
    }
    #[inline(always)]
    fn locate(&self, offset: u64, copy: usize) -> (usize, u64) {
        each!(self, l => l.locate(offset, copy))
    }
    #[inline(always)]
    fn place(&self, offset: u64, len: u64, copy: usize) -> Option<(usize, u64)> {
        each!(self, l => l.place(offset, len, copy))
    }
    fn describe(&self) -> String {
        each!(self, l => l.describe())
    }
}

impl From<Stripe> for AnyLayout {
    fn from(l: Stripe) -> AnyLayout {
        AnyLayout::Stripe(l)
    }
}

impl From<Mirror> for AnyLayout {
    fn from(l: Mirror) -> AnyLayout {
        AnyLayout::Mirror(l)
    }
}

impl From<Raid10> for AnyLayout {
    fn from(l: Raid10) -> AnyLayout {
        AnyLayout::Raid10(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::Just;
    use proptest::strategy::Strategy;

    const K: u64 = 64 << 10;

    #[test]
    fn linear_places_members_end_to_end() {
        let l = Linear::new(&[1000 * 512, 24 * 512, 4096], 512);
        assert_eq!(l.size_bytes(), 1024 * 512 + 4096);
        assert_eq!(l.locate(0, 0), (0, 0));
        assert_eq!(l.locate(1000 * 512, 0), (1, 0));
        assert_eq!(l.locate(1024 * 512 + 512, 0), (2, 512));
        assert_eq!(l.piece_len(999 * 512, 4096), 512);
        // With 4 KiB blocks, a 1.5 KiB member contributes nothing and 6 KiB gives 4 KiB.
        let l = Linear::new(&[1536, 6144, 8192], 4096);
        assert_eq!(l.size_bytes(), 12288);
        assert_eq!(l.locate(4096, 0), (2, 0));
    }

    proptest::proptest! {
        /// The granule table finds the same member as a search of the starts, for members
        /// of any sizes (zero-sized, tiny beside huge: coarse granules), at every offset
        /// near a boundary and at random ones.
        #[test]
        fn linear_granules_find_the_member_a_search_finds(
            sizes in proptest::collection::vec(
                proptest::prop_oneof![
                    Just(0u64),
                    1u64..20_000,
                    (1u64..1 << 20).prop_map(|s| s << 12),
                    (1u64..1 << 10).prop_map(|s| s << 40),
                ],
                1..12,
            ),
            block in proptest::prop_oneof![Just(512u64), Just(4096)],
            picks in proptest::collection::vec(0u64..u64::MAX, 32),
        ) {
            let l = Linear::new(&sizes, block);
            let size = l.size_bytes();
            let mut offsets: Vec<u64> = picks.iter().filter(|_| size > 0).map(|p| p % size).collect();
            for &s in &l.starts {
                offsets.extend([s.saturating_sub(1), s, s + 1].into_iter().filter(|&o| o < size));
            }
            for o in offsets {
                let searched = l.starts.partition_point(|&s| s <= o) - 1;
                proptest::prop_assert_eq!(l.member(o), searched, "offset {}", o);
            }
            proptest::prop_assert!(l.first.len() as u64 <= GRANULES_MAX + 1);
        }
    }

    #[test]
    fn stripe_round_robins_chunks() {
        let s = Stripe::new(3, K, 10 * K, 512).unwrap();
        assert_eq!(s.size_bytes(), 30 * K);
        assert_eq!(s.locate(0, 0), (0, 0));
        assert_eq!(s.locate(K, 0), (1, 0));
        assert_eq!(s.locate(2 * K + 512, 0), (2, 512));
        assert_eq!(s.locate(3 * K, 0), (0, K));
        assert_eq!(s.locate(7 * K + 4096, 0), (1, 2 * K + 4096));
        assert_eq!(s.piece_len(K - 512, 8192), 512);
        assert!(Stripe::new(2, 3000, K, 512).is_err());
        assert!(Stripe::new(2, K, K - 1, 512).is_err());
    }

    #[test]
    fn raid10_near_layout_four_members_two_copies() {
        let r = Raid10::new(4, 2, K, 8 * K, 512).unwrap();
        assert_eq!(r.size_bytes(), 16 * K);
        assert_eq!((r.locate(0, 0), r.locate(0, 1)), ((0, 0), (1, 0)));
        assert_eq!((r.locate(K, 0), r.locate(K, 1)), ((2, 0), (3, 0)));
        assert_eq!((r.locate(2 * K, 0), r.locate(2 * K, 1)), ((0, K), (1, K)));
        assert_eq!(r.locate(5 * K + 100 * 512, 1), (3, 2 * K + 100 * 512));
    }

    #[test]
    fn raid10_near_layout_odd_members() {
        let r = Raid10::new(3, 2, K, 4 * K, 512).unwrap();
        // 4 rows x 3 members = 12 positions = 6 chunks of 2 copies.
        assert_eq!(r.size_bytes(), 6 * K);
        assert_eq!((r.locate(0, 0), r.locate(0, 1)), ((0, 0), (1, 0)));
        assert_eq!((r.locate(K, 0), r.locate(K, 1)), ((2, 0), (0, K)));
        assert_eq!((r.locate(2 * K, 0), r.locate(2 * K, 1)), ((1, K), (2, K)));
        assert!(Raid10::new(3, 4, K, 4 * K, 512).is_err());
        assert!(Raid10::new(3, 1, K, 4 * K, 512).is_err());
    }

    #[test]
    fn mirror_copies_everything() {
        let m = Mirror::new(3, 1 << 20).unwrap();
        assert_eq!(m.copies(), 3);
        assert_eq!(m.locate(4096, 2), (2, 4096));
        assert!(Mirror::new(1, 1 << 20).is_err());
    }

    /// `place` (the one-look-up fast path) agrees with `piece_len` and `locate` on every
    /// layout, including odd member counts (no shift) and linear's uneven members.
    #[test]
    fn place_agrees_with_piece_len_and_locate() {
        let layouts: Vec<AnyLayout> = vec![
            AnyLayout::Linear(Linear::new(&[3 * K + 512, K, 5 * K], 512)),
            Stripe::new(3, K, 4 * K, 512).unwrap().into(),
            Stripe::new(4, K, 4 * K, 512).unwrap().into(),
            Mirror::new(2, 8 * K).unwrap().into(),
            Raid10::new(3, 2, K, 4 * K, 512).unwrap().into(),
            Raid10::new(4, 2, K, 4 * K, 512).unwrap().into(),
        ];
        for l in &layouts {
            let size = l.size_bytes();
            for offset in (0..size).step_by(512) {
                for len in [512, 4096, K - 512, K, K + 512, 3 * K] {
                    let len = len.min(size - offset);
                    for copy in 0..l.copies() {
                        let want =
                            (l.piece_len(offset, len) == len).then(|| l.locate(offset, copy));
                        assert_eq!(
                            l.place(offset, len, copy),
                            want,
                            "{} offset {offset} len {len} copy {copy}",
                            l.kind()
                        );
                    }
                }
            }
        }
    }
}
