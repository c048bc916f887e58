//! A bitmap store's layout on disk: its directory (which bitmaps there are, and where
//! their bits lie) and its pages of bits. Every decoder here is a pure function of bytes.
//!
//! The store is a file of its own (`bitmaps = "PATH"` in a device's table). Layout:
//!
//! ```text
//! 0          directory copy A   (SLOT bytes)
//! SLOT       directory copy B   (SLOT bytes)
//! 2 * SLOT   bit areas, each a whole number of 4 KiB pages, wherever the directory says
//! ```
//!
//! Version 2 writes every directory to both copies, one after the other, each synced: a
//! write torn in the first leaves the second as it was, one torn in the second leaves
//! the first done, and damage to one copy at rest leaves the other with the same
//! directory. The valid copy with the highest sequence number is the current one.
//! Version 1 (read, and upgraded at open) wrote each directory to one copy only, by the
//! parity of its sequence number. A directory's framing (magic, version, its checksum
//! over its own length) and the pick of a copy are those every record format of cairn's
//! own shares ([`cairn_core::ondisk::record`]); the copy logic is `open`'s and `store`'s.
//!
//! A page of bits ends in a trailer: a CRC-32C over the store's identity, the area's
//! offset and the page's index, then the bits; and a magic, so that a zeroed page never
//! verifies. A page that fails its check is found at open ([`check_page`]).

use cairn_core::ondisk::{get32, get64, put32, put64, Frame, Invalid};

use super::error::{DirtyError, PageDamage};

/// The directory's magic.
pub const MAGIC: &[u8; 8] = b"CAIRNDBM";
/// The format's version (written).
pub const VERSION: u32 = 2;
/// The oldest version read (and upgraded).
pub const VERSION_OLDEST: u32 = 1;
/// Bytes of each directory copy.
pub const SLOT: u64 = 256 << 10;
/// The directory's record framing ([`cairn_core::ondisk::record`]): the magic, the
/// version, and the CRC-32C at 12 over the bytes from the length field (at 16) to the
/// length it gives; a copy may be read cut short, down to version 1's header.
pub const FRAME: Frame = Frame::new("directory", *MAGIC, VERSION_OLDEST, VERSION, SLOT as usize)
    .sized(at::CRC, at::LEN, at::ENTRIES_1);
/// Where bit areas start.
pub const AREAS: u64 = 2 * SLOT;
/// Bit areas are whole pages of this many bytes.
pub const PAGE: u64 = 4096;
/// Bytes of a page's trailer (version 2): its CRC-32C, then [`PAGE_MAGIC`].
pub const TRAILER: u64 = 8;
/// The last 4 bytes of every page of bits (version 2).
pub const PAGE_MAGIC: &[u8; 4] = b"CDBP";
/// 64-bit words of bits in a page (version 2).
pub const PAGE_WORDS: usize = ((PAGE - TRAILER) / 8) as usize;
/// Bits in a page (version 2).
pub const PAGE_BITS: u64 = PAGE_WORDS as u64 * 64;
/// Most bitmaps one store holds.
pub const BITMAPS_MAX: usize = 256;
/// Longest bitmap name, in bytes.
pub const NAME_MAX: usize = 64;
/// Smallest and largest granularity (bytes per bit).
pub const GRANULARITY_MIN: u64 = 4096;
/// Largest granularity.
pub const GRANULARITY_MAX: u64 = 1 << 30;
/// Most bits one bitmap holds (256 MiB of them in memory: 8 TiB of 4 KiB granules).
pub const BITS_MAX: u64 = 1 << 31;

/// Entry flag: writes do not set this bitmap (it is kept as it is).
pub const DISABLED: u32 = 1;
/// Entry flag: the bitmap may miss changes (a mark could not be written, a page of its
/// bits failed its check, or the device grew past it); a backup must not trust it.
pub const INCONSISTENT: u32 = 2;
/// Entry flag: made by a checkpoint (the volume's current one, while enabled).
pub const CHECKPOINT: u32 = 4;
/// Entry flag: its checkpoint's snapshot may not exist yet. Found at open, the checkpoint
/// is finished when the snapshot exists and undone when it does not.
pub const PENDING: u32 = 8;
const KNOWN_FLAGS: u32 = DISABLED | INCONSISTENT | CHECKPOINT | PENDING;

/// Where the fields are in a directory (the magic at 0, the version at 8 and the
/// checksum are [`FRAME`]'s).
mod at {
    pub const CRC: usize = 12;
    pub const LEN: usize = 16;
    pub const COUNT: usize = 20;
    pub const SEQ: usize = 24;
    pub const DEVICE_BYTES: usize = 32;
    pub const NAME: usize = 40;
    /// Version 2: the store's identity; version 1's entries start here.
    pub const IDENTITY: usize = 104;
    pub const ENTRIES_1: usize = 104;
    pub const ENTRIES: usize = 112;
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
    /// [`DISABLED`], [`INCONSISTENT`], [`CHECKPOINT`], [`PENDING`].
    pub flags: u32,
    /// Where its bits start in the store.
    pub area: u64,
}

impl Entry {
    /// Bytes of its area in the current version: its bits, in whole pages.
    pub fn area_bytes(&self) -> u64 {
        area_bytes(VERSION, self.bits)
    }

    fn encoded_len(&self) -> usize {
        1 + self.name.len() + 1 + self.owner.len() + 1 + 3 + 4 + 8 + 8
    }
}

/// Bytes an area of `bits` bits takes in a store of `version`: whole pages, of 8 bits a
/// byte (version 1) or of [`PAGE_BITS`] bits and a trailer (version 2).
pub fn area_bytes(version: u32, bits: u64) -> u64 {
    let pages = if version == 1 {
        bits.div_ceil(8).div_ceil(PAGE)
    } else {
        bits.div_ceil(PAGE_BITS)
    };
    pages.max(1) * PAGE
}

/// A directory: the state of a store at one sequence number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Directory {
    /// Its format's version: how its areas are laid out.
    pub version: u32,
    /// Bumped by every write of the directory.
    pub seq: u64,
    /// Drawn at random when the store was made (version 2; 0 in version 1): every page
    /// of bits is checksummed with it.
    pub identity: u64,
    /// The device the store belongs to (its name in the stack file).
    pub device: String,
    /// Its size when the directory was written.
    pub device_bytes: u64,
    /// The bitmaps, in the order they were added.
    pub entries: Vec<Entry>,
}

impl Directory {
    /// Where entries start in a directory of this version.
    fn entries_at(version: u32) -> usize {
        if version == 1 {
            at::ENTRIES_1
        } else {
            at::ENTRIES
        }
    }

    /// The directory as written in its version: a whole number of pages.
    pub fn encode(&self) -> Vec<u8> {
        let first = Self::entries_at(self.version);
        let len = first + self.entries.iter().map(Entry::encoded_len).sum::<usize>();
        let mut b = vec![0u8; (len as u64).div_ceil(PAGE) as usize * PAGE as usize];
        put32(&mut b, at::LEN, len as u32);
        put32(&mut b, at::COUNT, self.entries.len() as u32);
        put64(&mut b, at::SEQ, self.seq);
        put64(&mut b, at::DEVICE_BYTES, self.device_bytes);
        let tag = device_tag(&self.device);
        b[at::NAME] = tag.len() as u8;
        b[at::NAME + 1..at::NAME + 1 + tag.len()].copy_from_slice(tag.as_bytes());
        if self.version != 1 {
            put64(&mut b, at::IDENTITY, self.identity);
        }
        let mut p = first;
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
        debug_assert_eq!(p, len);
        FRAME.seal(&mut b, self.version);
        b
    }

    /// A directory copy read back (`b`: the bytes of its slot, or fewer), or why it is
    /// not one. A pure function of `b`: every length and count is checked before use.
    pub fn decode(b: &[u8]) -> Result<Directory, Invalid> {
        let opened = FRAME.open(b)?;
        // From here on, `b` is the directory's own bytes: its length is checked.
        let (version, b) = (opened.version, opened.bytes);
        let first = Self::entries_at(version);
        if b.len() < first {
            return Err(Invalid::Extent {
                record: FRAME.record(),
                bytes: b.len(),
            });
        }
        let count = get32(b, at::COUNT) as usize;
        if count > BITMAPS_MAX {
            return Err(Invalid::Other(format!(
                "{count} bitmaps; at most {BITMAPS_MAX}"
            )));
        }
        let name_len = b[at::NAME] as usize;
        if name_len > at::ENTRIES_1 - at::NAME - 1 {
            return Err(Invalid::Other(format!(
                "device name of {name_len} bytes; at most 63"
            )));
        }
        let device = std::str::from_utf8(&b[at::NAME + 1..at::NAME + 1 + name_len])
            .map_err(|_| Invalid::Other("device name is not UTF-8".into()))?
            .to_string();
        let entries = decode_entries(b, first, count, version)?;
        Ok(Directory {
            version,
            seq: get64(b, at::SEQ),
            identity: if version == 1 {
                0
            } else {
                get64(b, at::IDENTITY)
            },
            device,
            device_bytes: get64(b, at::DEVICE_BYTES),
            entries,
        })
    }
}

/// `count` entries from `p` on in `b` (the directory's checked length), each checked.
fn decode_entries(
    b: &[u8],
    mut p: usize,
    count: usize,
    version: u32,
) -> Result<Vec<Entry>, Invalid> {
    let len = b.len();
    let mut entries: Vec<Entry> = Vec::with_capacity(count);
    let short = || Invalid::Other("directory entries run past its length".to_string());
    let text = |p: &mut usize| -> Result<String, Invalid> {
        let n = *b.get(*p).ok_or_else(short)? as usize;
        let end = (*p + 1)
            .checked_add(n)
            .filter(|&e| e <= len)
            .ok_or_else(short)?;
        let t = std::str::from_utf8(&b[*p + 1..end])
            .map_err(|_| Invalid::Other("a bitmap or owner name is not UTF-8".to_string()))?
            .to_string();
        *p = end;
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
        if entries.iter().any(|o| o.name == e.name) {
            return Err(Invalid::Other(format!(
                "bitmap '{}' is listed twice",
                e.name
            )));
        }
        if let Some(o) = entries.iter().find(|o| overlaps(version, o, &e)) {
            return Err(Invalid::Other(format!(
                "bitmaps '{}' and '{}' share bits",
                o.name, e.name
            )));
        }
        entries.push(e);
    }
    Ok(entries)
}

/// The CRC-32C of page `index` of the area at `area` in store `identity`: over those
/// three, then the page's bits. An all-zero page fails on its magic whatever this is.
fn page_crc(page: &[u8], identity: u64, area: u64, index: u64) -> u32 {
    let mut seed = [0u8; 24];
    seed[..8].copy_from_slice(&identity.to_le_bytes());
    seed[8..16].copy_from_slice(&area.to_le_bytes());
    seed[16..].copy_from_slice(&index.to_le_bytes());
    crc32c::crc32c_append(crc32c::crc32c(&seed), &page[..(PAGE - TRAILER) as usize])
}

/// Writes the trailer of `page` (a whole page, its bits filled in): page `index` of the
/// area at `area` in store `identity`.
pub fn seal_page(page: &mut [u8], identity: u64, area: u64, index: u64) {
    assert_eq!(page.len() as u64, PAGE, "a page of bits is sealed whole");
    let crc = page_crc(page, identity, area, index);
    let t = (PAGE - TRAILER) as usize;
    put32(page, t, crc);
    page[t + 4..].copy_from_slice(PAGE_MAGIC);
}

/// Whether `page` is a good page `index` of the area at `area` in store `identity` (its
/// bits are then its first [`PAGE_WORDS`] words, little-endian), or why not. A pure
/// function of its arguments.
pub fn check_page(page: &[u8], identity: u64, area: u64, index: u64) -> Result<(), PageDamage> {
    if page.len() as u64 != PAGE {
        return Err(PageDamage::Length(page.len()));
    }
    let t = (PAGE - TRAILER) as usize;
    if &page[t + 4..] != PAGE_MAGIC {
        return Err(if page.iter().all(|&b| b == 0) {
            PageDamage::Zeroed
        } else {
            PageDamage::Magic
        });
    }
    if get32(page, t) != page_crc(page, identity, area, index) {
        return Err(PageDamage::Checksum);
    }
    Ok(())
}

/// The part of a device's name a directory keeps: its first 63 bytes.
pub fn device_tag(name: &str) -> &str {
    let mut end = name.len().min(at::ENTRIES_1 - at::NAME - 1);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// Checks directory entry `e` as decoded: what is wrong is the directory's damage.
fn check_entry(e: &Entry) -> Result<(), Invalid> {
    check_name(&e.name).map_err(|err| Invalid::Other(err.to_string()))?;
    if !e.owner.is_empty() {
        check_name(&e.owner).map_err(|err| Invalid::Other(err.to_string()))?;
    }
    let g = 1u64.checked_shl(e.shift).unwrap_or(0);
    if !(GRANULARITY_MIN..=GRANULARITY_MAX).contains(&g) {
        return Err(Invalid::Other(format!(
            "bitmap '{}': granularity 2^{} out of range",
            e.name, e.shift
        )));
    }
    if e.flags & !KNOWN_FLAGS != 0 {
        return Err(Invalid::Other(format!(
            "bitmap '{}': unknown flags {:#x}",
            e.name, e.flags
        )));
    }
    if e.bits == 0 || e.bits > BITS_MAX || e.area < AREAS || !e.area.is_multiple_of(PAGE) {
        return Err(Invalid::Other(format!(
            "bitmap '{}': bits or area out of range",
            e.name
        )));
    }
    // With the bits bounded, an area's end cannot overflow unless its start is huge.
    if e.area.checked_add(area_bytes(VERSION, e.bits)).is_none() {
        return Err(Invalid::Other(format!(
            "bitmap '{}': area out of range",
            e.name
        )));
    }
    Ok(())
}

fn overlaps(version: u32, a: &Entry, b: &Entry) -> bool {
    a.area < b.area + area_bytes(version, b.bits) && b.area < a.area + area_bytes(version, a.bits)
}

/// Whether `name` can name a bitmap: 1 to [`NAME_MAX`] bytes of letters, digits and
/// `.`, `_`, `-`, `+`, `@` (what backup tools use; no `:` or spaces, which NBD context
/// names and the admin socket's words would trip on).
pub fn check_name(name: &str) -> Result<(), DirtyError> {
    if name.is_empty()
        || name.len() > NAME_MAX
        || !name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-+@".contains(&c))
    {
        return Err(DirtyError::BadName {
            name: name.to_string(),
        });
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
            version: VERSION,
            seq: 7,
            identity: 0x0123_4567_89ab_cdef,
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
        // Cut short anywhere before its end, it is refused, never read past.
        for n in 0..get32(&b, at::LEN) as usize {
            assert!(Directory::decode(&b[..n]).is_err(), "{n} bytes");
        }
    }

    #[test]
    fn version_1_directories_still_read() {
        let mut d = dir();
        d.version = 1;
        d.identity = 0;
        let b = d.encode();
        assert_eq!(&b[104..106], &[2, b'b']);
        assert_eq!(Directory::decode(&b).unwrap(), d);
        // Areas that overlap in version 1's sizes are refused there.
        d.entries[1].area = AREAS;
        assert!(Directory::decode(&d.encode())
            .unwrap_err()
            .to_string()
            .contains("share"));
        let mut v3 = dir().encode();
        v3[8] = 3;
        assert!(Directory::decode(&v3)
            .unwrap_err()
            .to_string()
            .contains("version 3"));
    }

    #[test]
    fn areas_are_whole_pages_with_room_for_their_trailers() {
        assert_eq!(PAGE_WORDS, 511);
        assert_eq!(area_bytes(1, 1), PAGE);
        assert_eq!(area_bytes(1, 32768), PAGE);
        assert_eq!(area_bytes(1, 32769), 2 * PAGE);
        assert_eq!(area_bytes(2, 1), PAGE);
        assert_eq!(area_bytes(2, PAGE_BITS), PAGE);
        assert_eq!(area_bytes(2, PAGE_BITS + 1), 2 * PAGE);
        // 8 TiB of 4 KiB granules fit.
        assert_eq!(area_bytes(2, BITS_MAX), BITS_MAX.div_ceil(PAGE_BITS) * PAGE);
        let mut d = dir();
        d.entries[0].bits = BITS_MAX + 1;
        assert!(Directory::decode(&d.encode()).is_err());
        let mut d = dir();
        d.entries[0].area = u64::MAX - PAGE + 1;
        assert!(Directory::decode(&d.encode()).is_err());
    }

    fn sealed(identity: u64, area: u64, index: u64) -> Vec<u8> {
        let mut p = vec![0u8; PAGE as usize];
        for (i, b) in p[..4088].iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        seal_page(&mut p, identity, area, index);
        p
    }

    #[test]
    fn a_page_verifies_only_whole_and_in_its_place() {
        let p = sealed(9, AREAS, 3);
        assert_eq!(check_page(&p, 9, AREAS, 3), Ok(()));
        // An empty page verifies once sealed; zeroed, it never does.
        let mut empty = vec![0u8; PAGE as usize];
        seal_page(&mut empty, 9, AREAS, 0);
        assert_eq!(check_page(&empty, 9, AREAS, 0), Ok(()));
        for (id, area, index) in [(0, 0, 0), (9, AREAS, 0), (u64::MAX, 1 << 40, 77)] {
            assert_eq!(
                check_page(&vec![0u8; PAGE as usize], id, area, index),
                Err(PageDamage::Zeroed)
            );
        }
        // Every byte counts.
        for i in (0..PAGE as usize)
            .step_by(97)
            .chain([4087, 4088, 4091, 4092, 4095])
        {
            let mut t = p.clone();
            t[i] ^= 0x01;
            assert!(check_page(&t, 9, AREAS, 3).is_err(), "byte {i}");
        }
        // Another store's page, another area's, another index's.
        assert!(check_page(&p, 8, AREAS, 3).is_err());
        assert!(check_page(&p, 9, AREAS + PAGE, 3).is_err());
        assert!(check_page(&p, 9, AREAS, 2).is_err());
        // Torn: the first sectors new, the rest as before.
        let older = {
            let mut o = p.clone();
            o[100] ^= 0xff;
            o[3000] ^= 0xff;
            seal_page(&mut o, 9, AREAS, 3);
            o
        };
        for cut in (512..PAGE as usize).step_by(512) {
            let mut t = p.clone();
            t[cut..].copy_from_slice(&older[cut..]);
            assert!(check_page(&t, 9, AREAS, 3).is_err(), "torn at {cut}");
        }
        assert!(check_page(&p[..4095], 9, AREAS, 3).is_err());
    }

    #[test]
    fn entries_that_share_bits_or_break_bounds_are_refused() {
        let mut d = dir();
        d.entries[1].area = AREAS;
        assert!(Directory::decode(&d.encode())
            .unwrap_err()
            .to_string()
            .contains("share"));
        let mut d = dir();
        d.entries[0].shift = 11;
        assert!(Directory::decode(&d.encode()).is_err());
        let mut d = dir();
        d.entries[1].name = "b0".into();
        assert!(Directory::decode(&d.encode())
            .unwrap_err()
            .to_string()
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
