//! The bodies of the fuzz targets of cairn's on-disk formats, and the seeds they start
//! from. Not part of cairn's interface: it is public only so that the cargo-fuzz
//! targets (`crates/devices/fuzz/`) and the stable test that runs the same bodies
//! (`tests/decoders_fuzz.rs`) can reach it, and hidden from the documentation.
//!
//! Each body takes arbitrary bytes and panics when a rule breaks: whatever decodes must
//! encode to bytes that decode to the same value (or reopen to the same state), and
//! nothing may panic, hang or allocate without bound on the way. It returns whether the
//! input decoded, so that the stable test can tell that the seeds still reach past the
//! decoders' first checks.
//!
//! Every input starts with a byte of flags. [`RESEAL`] makes the checksums again before
//! decoding: a mutated field then reaches the checks behind the checksum, as damaged
//! metadata written with a valid checksum would.

pub mod array;
pub mod dirty;
pub mod luks;
pub mod thin;

/// Flag: the input's checksums are made again before it is decoded.
pub const RESEAL: u8 = 1;

/// One target: its name (the cargo-fuzz binary's, and its seed directory's), its body,
/// and its seeds (each named; names starting with `valid` decode).
pub struct Target {
    /// The name.
    pub name: &'static str,
    /// The body: panics when a rule breaks; returns whether the input decoded.
    pub run: fn(&[u8]) -> bool,
    /// The seeds, made by the formats' own encoders (a few damaged).
    pub seeds: fn() -> Vec<(String, Vec<u8>)>,
}

/// Every target.
pub const TARGETS: &[Target] = &[
    Target {
        name: "array_superblock",
        run: array::superblock,
        seeds: array::seeds,
    },
    Target {
        name: "thin_superblock",
        run: thin::superblock,
        seeds: thin::superblock_seeds,
    },
    Target {
        name: "thin_log",
        run: thin::log,
        seeds: thin::log_seeds,
    },
    Target {
        name: "thin_checkpoint",
        run: thin::checkpoint,
        seeds: thin::checkpoint_seeds,
    },
    Target {
        name: "dirty_directory",
        run: dirty::directory,
        seeds: dirty::seeds,
    },
    Target {
        name: "luks1_header",
        run: luks::luks1,
        seeds: luks::luks1_seeds,
    },
    Target {
        name: "luks2_header",
        run: crate::crypt::luks2::fuzz::header,
        seeds: crate::crypt::luks2::fuzz::seeds,
    },
];

/// Reads an input's fields from its front; past its end, fields are zero and slices
/// short.
pub(crate) struct Input<'a> {
    b: &'a [u8],
}

impl<'a> Input<'a> {
    pub(crate) fn new(b: &'a [u8]) -> Input<'a> {
        Input { b }
    }

    pub(crate) fn u8(&mut self) -> u8 {
        self.take(1).first().copied().unwrap_or(0)
    }

    pub(crate) fn u16(&mut self) -> u16 {
        let b = self.take(2);
        u16::from_le_bytes([
            b.first().copied().unwrap_or(0),
            b.get(1).copied().unwrap_or(0),
        ])
    }

    /// The next `n` bytes, or as many as are left.
    pub(crate) fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, tail) = self.b.split_at(n.min(self.b.len()));
        self.b = tail;
        head
    }

    pub(crate) fn rest(&mut self) -> &'a [u8] {
        self.take(self.b.len())
    }
}

/// `b` cut or zero-padded to `n` bytes.
pub(crate) fn padded(b: &[u8], n: usize) -> Vec<u8> {
    let mut v = b[..b.len().min(n)].to_vec();
    v.resize(n, 0);
    v
}

/// `b` without its trailing zeros (a seed's pieces are padded back when read).
pub(crate) fn trimmed(b: &[u8]) -> &[u8] {
    &b[..b.iter().rposition(|&x| x != 0).map_or(0, |i| i + 1)]
}

/// Pieces as an input: the flags, a count, each piece's length (u16), then the pieces.
pub(crate) fn pieces_input(flags: u8, head: &[u8], pieces: &[&[u8]]) -> Vec<u8> {
    let mut out = vec![flags];
    out.extend_from_slice(head);
    out.push(pieces.len() as u8);
    for p in pieces {
        out.extend_from_slice(&(p.len() as u16).to_le_bytes());
    }
    for p in pieces {
        out.extend_from_slice(p);
    }
    out
}

/// The pieces of an input made by [`pieces_input`] (after its flags and head), each
/// zero-padded to `size`; at most `max` of them.
pub(crate) fn pieces(input: &mut Input<'_>, size: usize, max: usize) -> Vec<Vec<u8>> {
    let count = usize::from(input.u8()).min(max);
    let lens: Vec<usize> = (0..count).map(|_| usize::from(input.u16())).collect();
    lens.into_iter()
        .map(|n| padded(input.take(n), size))
        .collect()
}

/// Reads `buf.len()` bytes at `at` of `image`, failing past its end as a device does.
pub(crate) fn read_image(image: &[u8], at: u64, buf: &mut [u8]) -> Result<(), String> {
    let start = usize::try_from(at).map_err(|_| "past the end".to_string())?;
    let end = start
        .checked_add(buf.len())
        .filter(|&e| e <= image.len())
        .ok_or("past the end")?;
    buf.copy_from_slice(&image[start..end]);
    Ok(())
}

/// Writes `b` at `at` of `image`, growing it up to `limit` bytes.
pub(crate) fn write_image(
    image: &mut Vec<u8>,
    limit: usize,
    at: u64,
    b: &[u8],
) -> Result<(), String> {
    let start = usize::try_from(at).map_err(|_| "past the end".to_string())?;
    let end = start
        .checked_add(b.len())
        .filter(|&e| e <= limit)
        .ok_or("past the end")?;
    if image.len() < end {
        image.resize(end, 0);
    }
    image[start..end].copy_from_slice(b);
    Ok(())
}
