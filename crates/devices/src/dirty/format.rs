//! A bitmap store's directory on disk: which bitmaps there are, and where their bits lie.
//!
//! The store is a file of its own (`bitmaps = "PATH"` in a device's table). Layout:
//!
//! ```text
//! 0          directory copy A   (SLOT bytes)
//! SLOT       directory copy B   (SLOT bytes)
//! 2 * SLOT   bit areas, each a whole number of 4 KiB pages, wherever the directory says
//! ```
//!
//! A directory is written to the copy its sequence number picks (even: A, odd: B), then
//! synced; the copy with the highest sequence number and a good checksum is the current
//! one. A torn directory write leaves the other copy, the state before it. A new bitmap
//! gets an area the current directory does not name, so that state still finds its bits.
//!
//! Bits are written in place and not checksummed: a write of a page only ever sets bits
//! (the hot path) or clears a whole bitmap (`bitmap clear`); a torn page is a mix of two
//! states, each bit either as before or as after, which is never a change forgotten.

use crate::array::superblock::{get32, get64, put32, put64};

/// The directory's magic.
pub const MAGIC: &[u8; 8] = b"CAIRNDBM";
/// The format's version.
pub const VERSION: u32 = 1;
/// Bytes of each directory copy.
pub const SLOT: u64 = 256 << 10;
/// Where bit areas start.
pub const AREAS: u64 = 2 * SLOT;
/// Bit areas are whole pages of this many bytes.
pub const PAGE: u64 = 4096;
/// Most bitmaps one store holds.
pub const BITMAPS_MAX: usize = 256;
/// Longest bitmap name, in bytes.
pub const NAME_MAX: usize = 64;
/// Smallest and largest granularity (bytes per bit).
pub const GRANULARITY_MIN: u64 = 4096;
/// Largest granularity.
pub const GRANULARITY_MAX: u64 = 1 << 30;
/// Most bytes of bits one bitmap may take (in memory and in its area).
pub const AREA_MAX: u64 = 256 << 20;

/// Entry flag: writes do not set this bitmap (it is kept as it is).
pub const DISABLED: u32 = 1;
/// Entry flag: the bitmap may miss changes (a mark could not be written, or the device
/// grew past it); a backup must not trust it.
pub const INCONSISTENT: u32 = 2;
/// Entry flag: made by a checkpoint (the volume's current one, while enabled).
pub const CHECKPOINT: u32 = 4;
/// Entry flag: its checkpoint's snapshot may not exist yet. Found at open, the checkpoint
/// is finished when the snapshot exists and undone when it does not.
pub const PENDING: u32 = 8;
const KNOWN_FLAGS: u32 = DISABLED | INCONSISTENT | CHECKPOINT | PENDING;

mod at {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const CRC: usize = 12;
    pub const LEN: usize = 16;
    pub const COUNT: usize = 20;
    pub const SEQ: usize = 24;
    pub const DEVICE_BYTES: usize = 32;
    pub const NAME: usize = 40;
    pub const ENTRIES: usize = 104;
}

/// One bitmap as the directory records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its name (unique in the store).
    pub name: String,
    /// Empty for a bitmap of the device itself; else the snapshot it is attached to (a
    /// checkpoint's: the changes between the previous checkpoint and that snapshot).
    pub owner: String,
    /// log2 of its granularity.
    pub shift: u32,
    /// Bits it holds (the device's size when it was made, in granules).
    pub bits: u64,
    /// [`DISABLED`], [`INCONSISTENT`].
    pub flags: u32,
    /// Where its bits start in the store.
    pub area: u64,
}

impl Entry {
    /// Bytes of its area: its bits, in whole pages.
    pub fn area_bytes(&self) -> u64 {
        area_bytes(self.bits)
    }

    fn encoded_len(&self) -> usize {
        1 + self.name.len() + 1 + self.owner.len() + 1 + 3 + 4 + 8 + 8
    }
}

/// Bytes an area of `bits` bits takes.
pub fn area_bytes(bits: u64) -> u64 {
    bits.div_ceil(8).div_ceil(PAGE).max(1) * PAGE
}

/// A directory: the state of a store at one sequence number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Directory {
    /// Bumped by every write of the directory.
    pub seq: u64,
    /// The device the store belongs to (its name in the stack file).
    pub device: String,
    /// Its size when the directory was written.
    pub device_bytes: u64,
    /// The bitmaps, in the order they were added.
    pub entries: Vec<Entry>,
}

impl Directory {
    /// Which copy this directory goes to.
    pub fn slot_offset(&self) -> u64 {
        (self.seq % 2) * SLOT
    }

    /// The directory as written: a whole number of pages.
    pub fn encode(&self) -> Vec<u8> {
        let len = at::ENTRIES + self.entries.iter().map(Entry::encoded_len).sum::<usize>();
        let mut b = vec![0u8; (len as u64).div_ceil(PAGE) as usize * PAGE as usize];
        b[at::MAGIC..at::MAGIC + 8].copy_from_slice(MAGIC);
        put32(&mut b, at::VERSION, VERSION);
        put32(&mut b, at::LEN, len as u32);
        put32(&mut b, at::COUNT, self.entries.len() as u32);
        put64(&mut b, at::SEQ, self.seq);
        put64(&mut b, at::DEVICE_BYTES, self.device_bytes);
        let tag = device_tag(&self.device);
        b[at::NAME] = tag.len() as u8;
        b[at::NAME + 1..at::NAME + 1 + tag.len()].copy_from_slice(tag.as_bytes());
        let mut p = at::ENTRIES;
        for e in &self.entries {
            for text in [&e.name, &e.owner] {
                b[p] = text.len() as u8;
                b[p + 1..p + 1 + text.len()].copy_from_slice(text.as_bytes());
                p += 1 + text.len();
            }
            b[p] = e.shift as u8;
            p += 4;
            put32(&mut b, p, e.flags);
            put64(&mut b, p + 4, e.bits);
            put64(&mut b, p + 12, e.area);
            p += 20;
        }
        let crc = crc32c::crc32c(&b[at::LEN..len]);
        put32(&mut b, at::CRC, crc);
        b
    }

    /// A directory copy read back, or why it is not one.
    pub fn decode(b: &[u8]) -> Result<Directory, String> {
        if b.len() < at::ENTRIES || &b[at::MAGIC..at::MAGIC + 8] != MAGIC {
            return Err("no directory (bad magic)".into());
        }
        let version = get32(b, at::VERSION);
        if version != VERSION {
            return Err(format!(
                "directory version {version}; this cairn reads version {VERSION}"
            ));
        }
        let len = get32(b, at::LEN) as usize;
        if len < at::ENTRIES || len > b.len() {
            return Err(format!("directory length {len} out of range"));
        }
        if get32(b, at::CRC) != crc32c::crc32c(&b[at::LEN..len]) {
            return Err("directory checksum mismatch".into());
        }
        let count = get32(b, at::COUNT) as usize;
        if count > BITMAPS_MAX {
            return Err(format!("{count} bitmaps; at most {BITMAPS_MAX}"));
        }
        let name_len = b[at::NAME] as usize;
        let device =
            std::str::from_utf8(b.get(at::NAME + 1..at::NAME + 1 + name_len).unwrap_or(&[]))
                .map_err(|_| "device name is not UTF-8".to_string())?
                .to_string();
        let mut entries = Vec::with_capacity(count);
        let mut p = at::ENTRIES;
        let short = || "directory entries run past its length".to_string();
        let text = |p: &mut usize| -> Result<String, String> {
            let n = *b.get(*p).filter(|_| *p < len).ok_or_else(short)? as usize;
            if *p + 1 + n > len {
                return Err(short());
            }
            let t = std::str::from_utf8(&b[*p + 1..*p + 1 + n])
                .map_err(|_| "a bitmap or owner name is not UTF-8".to_string())?
                .to_string();
            *p += 1 + n;
            Ok(t)
        };
        for _ in 0..count {
            let name = text(&mut p)?;
            let owner = text(&mut p)?;
            if p + 24 > len {
                return Err(short());
            }
            let e = Entry {
                name,
                owner,
                shift: u32::from(b[p]),
                flags: get32(b, p + 4),
                bits: get64(b, p + 8),
                area: get64(b, p + 16),
            };
            p += 24;
            check_entry(&e)?;
            if entries.iter().any(|o: &Entry| o.name == e.name) {
                return Err(format!("bitmap '{}' is listed twice", e.name));
            }
            if let Some(o) = entries.iter().find(|o: &&Entry| overlaps(o, &e)) {
                return Err(format!("bitmaps '{}' and '{}' share bits", o.name, e.name));
            }
            entries.push(e);
        }
        Ok(Directory {
            seq: get64(b, at::SEQ),
            device,
            device_bytes: get64(b, at::DEVICE_BYTES),
            entries,
        })
    }
}

/// The part of a device's name a directory keeps: its first 63 bytes.
pub fn device_tag(name: &str) -> &str {
    let mut end = name.len().min(at::ENTRIES - at::NAME - 1);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

fn check_entry(e: &Entry) -> Result<(), String> {
    check_name(&e.name)?;
    if !e.owner.is_empty() {
        check_name(&e.owner)?;
    }
    let g = 1u64.checked_shl(e.shift).unwrap_or(0);
    if !(GRANULARITY_MIN..=GRANULARITY_MAX).contains(&g) {
        return Err(format!(
            "bitmap '{}': granularity 2^{} out of range",
            e.name, e.shift
        ));
    }
    if e.flags & !KNOWN_FLAGS != 0 {
        return Err(format!("bitmap '{}': unknown flags {:#x}", e.name, e.flags));
    }
    if e.bits == 0 || e.area_bytes() > AREA_MAX || e.area < AREAS || !e.area.is_multiple_of(PAGE) {
        return Err(format!("bitmap '{}': bits or area out of range", e.name));
    }
    Ok(())
}

fn overlaps(a: &Entry, b: &Entry) -> bool {
    a.area < b.area + b.area_bytes() && b.area < a.area + a.area_bytes()
}

/// Whether `name` can name a bitmap: 1 to [`NAME_MAX`] bytes of letters, digits and
/// `.`, `_`, `-`, `+`, `@` (what backup tools use; no `:` or spaces, which NBD context
/// names and the admin socket's words would trip on).
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty()
        || name.len() > NAME_MAX
        || !name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-+@".contains(&c))
    {
        return Err(format!(
            "'{}' is not a bitmap name (1 to {NAME_MAX} letters, digits or . _ - + @)",
            name.escape_default()
        ));
    }
    Ok(())
}

/// The first place at or after [`AREAS`] where `bytes` fit without touching any area of
/// `used` (offset, bytes).
pub fn place(used: &[(u64, u64)], bytes: u64) -> u64 {
    let mut v: Vec<(u64, u64)> = used.to_vec();
    v.sort_unstable();
    let mut at = AREAS;
    for (o, n) in v {
        if o >= at + bytes {
            break;
        }
        at = at.max(o + n);
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> Directory {
        Directory {
            seq: 7,
            device: "vm1".into(),
            device_bytes: 1 << 30,
            entries: vec![
                Entry {
                    name: "b0".into(),
                    owner: String::new(),
                    shift: 16,
                    bits: 16384,
                    flags: 0,
                    area: AREAS,
                },
                Entry {
                    name: "backup.1".into(),
                    owner: "snap-2".into(),
                    shift: 12,
                    bits: 1 << 18,
                    flags: DISABLED | INCONSISTENT,
                    area: AREAS + PAGE,
                },
            ],
        }
    }

    #[test]
    fn a_directory_reads_back_and_a_torn_one_is_refused() {
        let d = dir();
        let b = d.encode();
        assert_eq!(b.len() as u64 % PAGE, 0);
        assert_eq!(Directory::decode(&b).unwrap(), d);
        // Any byte changed inside the directory is caught.
        for i in [12usize, 20, 30, 41, 110, 130] {
            let mut t = b.clone();
            t[i] ^= 0x40;
            assert!(Directory::decode(&t).is_err(), "byte {i}");
        }
        assert!(Directory::decode(&vec![0u8; 4096]).is_err());
    }

    #[test]
    fn entries_that_share_bits_or_break_bounds_are_refused() {
        let mut d = dir();
        d.entries[1].area = AREAS;
        assert!(Directory::decode(&d.encode())
            .unwrap_err()
            .contains("share"));
        let mut d = dir();
        d.entries[0].shift = 11;
        assert!(Directory::decode(&d.encode()).is_err());
        let mut d = dir();
        d.entries[1].name = "b0".into();
        assert!(Directory::decode(&d.encode())
            .unwrap_err()
            .contains("twice"));
    }

    #[test]
    fn names_and_places() {
        assert!(check_name("virtnbdbackup.3").is_ok());
        for bad in ["", "a b", "a:b", "x/y", &"n".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
        assert_eq!(place(&[], PAGE), AREAS);
        let used = [(AREAS + PAGE, PAGE), (AREAS, PAGE)];
        assert_eq!(place(&used, PAGE), AREAS + 2 * PAGE);
        // A hole that fits is taken.
        let used = [(AREAS, PAGE), (AREAS + 3 * PAGE, PAGE)];
        assert_eq!(place(&used, 2 * PAGE), AREAS + PAGE);
        assert_eq!(place(&used, 3 * PAGE), AREAS + 4 * PAGE);
    }
}
