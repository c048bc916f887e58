//! What the fuzz targets of cairn's on-disk formats share: reading an input's fields,
//! the pieces of an input, an image in memory standing for a device, and the target's
//! shape. Not part of cairn's interface: public so that the crates holding the formats
//! (each keeps its targets' bodies beside the private parts they use), the cargo-fuzz
//! crate and the stable tests can reach it, and hidden from the documentation.

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

/// Reads an input's fields from its front; past its end, fields are zero and slices
/// short.
pub struct Input<'a> {
    b: &'a [u8],
}

impl<'a> Input<'a> {
    /// Reads `b` from its front.
    pub fn new(b: &'a [u8]) -> Input<'a> {
        Input { b }
    }

    /// The next byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        self.take(1).first().copied().unwrap_or(0)
    }

    /// The next two bytes, little-endian (0 past the end).
    pub fn u16(&mut self) -> u16 {
        let b = self.take(2);
        u16::from_le_bytes([
            b.first().copied().unwrap_or(0),
            b.get(1).copied().unwrap_or(0),
        ])
    }

    /// The next `n` bytes, or as many as are left.
    pub fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, tail) = self.b.split_at(n.min(self.b.len()));
        self.b = tail;
        head
    }

    /// The bytes left.
    pub fn rest(&mut self) -> &'a [u8] {
        self.take(self.b.len())
    }
}

/// `b` cut or zero-padded to `n` bytes.
pub fn padded(b: &[u8], n: usize) -> Vec<u8> {
    let mut v = b[..b.len().min(n)].to_vec();
    v.resize(n, 0);
    v
}

/// `b` without its trailing zeros (a seed's pieces are padded back when read).
pub fn trimmed(b: &[u8]) -> &[u8] {
    &b[..b.iter().rposition(|&x| x != 0).map_or(0, |i| i + 1)]
}

/// Pieces as an input: the flags, a count, each piece's length (u16), then the pieces.
pub fn pieces_input(flags: u8, head: &[u8], pieces: &[&[u8]]) -> Vec<u8> {
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
pub fn pieces(input: &mut Input<'_>, size: usize, max: usize) -> Vec<Vec<u8>> {
    let count = usize::from(input.u8()).min(max);
    let lens: Vec<usize> = (0..count).map(|_| usize::from(input.u16())).collect();
    lens.into_iter()
        .map(|n| padded(input.take(n), size))
        .collect()
}

/// Reads `buf.len()` bytes at `at` of `image`, failing past its end as a device does.
pub fn read_image(image: &[u8], at: u64, buf: &mut [u8]) -> Result<(), String> {
    let start = usize::try_from(at).map_err(|_| "past the end".to_string())?;
    let end = start
        .checked_add(buf.len())
        .filter(|&e| e <= image.len())
        .ok_or("past the end")?;
    buf.copy_from_slice(&image[start..end]);
    Ok(())
}

/// Writes `b` at `at` of `image`, growing it up to `limit` bytes.
pub fn write_image(image: &mut Vec<u8>, limit: usize, at: u64, b: &[u8]) -> Result<(), String> {
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
