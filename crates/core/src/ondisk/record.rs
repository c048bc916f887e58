//! The record framing cairn's own on-disk formats share: the array superblock, the thin
//! pool superblock and the bitmap store's directory are each a record kept in two slots,
//! framed alike and picked alike.
//!
//! A record starts with an 8-byte magic at offset 0 and a little-endian `u32` version at
//! offset 8, and carries a CRC-32C (Castagnoli) of its bytes: either in its slot's last 4
//! bytes over every byte before them ([`Frame::new`]: a record that fills its slot), or at
//! a place of its own over the bytes from its length field to the length that field gives
//! ([`Frame::sized`]: a record shorter than its slot). [`Frame::open`] checks a slot's
//! frame, in this order: its length, its magic (an all-zero slot is [`Invalid::Blank`],
//! never written), its version, the length it gives itself, its checksum. [`Frame::seal`]
//! writes the magic, the version and the checksum around a body. Of the two slots,
//! [`pick`] takes the valid one with the higher sequence number.
//!
//! What a record holds besides its frame, and how its slots are written (one at a time,
//! alternately, or both in turn), is each format's own.

use std::fmt;

use super::{get32, put32};

/// Where every record's magic starts.
pub const MAGIC_AT: usize = 0;
/// Where every record's version is (a `u32`).
pub const VERSION_AT: usize = 8;
/// Bytes of the magic.
pub const MAGIC_BYTES: usize = 8;

/// Where a record's CRC-32C is, and which bytes it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checksum {
    /// In the slot's last 4 bytes, over every byte before them.
    Tail,
    /// At `at`, over the bytes from `len_at` up to the record's length, the `u32` at
    /// `len_at` (the length field is covered, the checksum is not).
    Length {
        /// Where the checksum is.
        at: usize,
        /// Where the record's length is, and where the covered bytes start.
        len_at: usize,
    },
}

/// The frame of one record format: what its slots hold besides the record's own fields.
/// Made by [`Frame::new`] or [`Frame::sized`], whose checks run when a `const` is made of
/// them, at compile time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    record: &'static str,
    magic: [u8; MAGIC_BYTES],
    oldest: u32,
    newest: u32,
    slot_bytes: usize,
    header_bytes: usize,
    checksum: Checksum,
}

/// A slot whose frame is good: the version it was written in, and the record's bytes
/// (the whole slot, or as many as its length field gives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened<'a> {
    /// Its version, within the frame's range.
    pub version: u32,
    /// The bytes its checksum covers the rest of.
    pub bytes: &'a [u8],
}

/// Why a slot does not hold a valid record. `record` is what the format calls its
/// record in messages ("superblock", "directory"); the Display text is the one line
/// logs and refusals quote.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Invalid {
    /// The slot holds `bytes` bytes, not `least` to `most` (it was cut short).
    Length {
        /// The record's name.
        record: &'static str,
        /// Bytes the slot holds.
        bytes: usize,
        /// The fewest it may hold.
        least: usize,
        /// The most: a whole slot.
        most: usize,
    },
    /// Every byte is zero: nothing was ever written here.
    Blank,
    /// Another magic: not this format.
    Magic {
        /// The record's name.
        record: &'static str,
    },
    /// A version this code does not read.
    Version {
        /// The record's name.
        record: &'static str,
        /// The version found.
        version: u32,
        /// The oldest version read.
        oldest: u32,
        /// The newest version read.
        newest: u32,
    },
    /// The length the record gives itself is shorter than its header or longer than its
    /// slot.
    Extent {
        /// The record's name.
        record: &'static str,
        /// The length it gives.
        bytes: usize,
    },
    /// The checksum does not match (a torn or corrupted write).
    Checksum {
        /// The record's name.
        record: &'static str,
    },
    /// A field is out of its range.
    Field {
        /// The record's name.
        record: &'static str,
        /// The field's name.
        field: &'static str,
    },
    /// Anything else, in words: a rule of the record's contents it breaks, or why its
    /// slot could not be read.
    Other(String),
}

/// What two slots hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Picked<T> {
    /// Both are blank: nothing was ever written.
    Blank,
    /// The newest valid record, and in which slot it is.
    Valid {
        /// The record.
        record: T,
        /// Its slot (0 or 1).
        slot: usize,
        /// The other slot's record, when that is valid too (as new or older).
        other: Option<T>,
        /// Why the other slot is damaged, when it is neither valid nor blank: a torn or
        /// corrupted write that this record covers, to be logged.
        damaged: Option<Invalid>,
    },
    /// Neither slot is valid, and they are not both blank: not ours to use.
    Foreign {
        /// Why slot 0 is not valid.
        first: Invalid,
        /// Why slot 1 is not valid.
        second: Invalid,
    },
}

impl Frame {
    /// The frame of a record that fills its slot of `slot_bytes`, with the checksum in
    /// the slot's last 4 bytes; `oldest` to `newest` are the versions read.
    pub const fn new(
        record: &'static str,
        magic: [u8; MAGIC_BYTES],
        oldest: u32,
        newest: u32,
        slot_bytes: usize,
    ) -> Frame {
        assert!(oldest <= newest, "a range of versions");
        assert!(
            slot_bytes >= VERSION_AT + 4 + 4,
            "a slot holds the magic, the version and the checksum"
        );
        Frame {
            record,
            magic,
            oldest,
            newest,
            slot_bytes,
            header_bytes: slot_bytes,
            checksum: Checksum::Tail,
        }
    }

    /// This frame for a record as long as the `u32` at `len_at` says, at least
    /// `header_bytes`, its checksum at `crc_at` over the bytes from `len_at` to its
    /// length. Its slot may be read cut short, down to `header_bytes`.
    pub const fn sized(self, crc_at: usize, len_at: usize, header_bytes: usize) -> Frame {
        assert!(
            crc_at >= VERSION_AT + 4 && crc_at + 4 <= len_at,
            "the checksum after the version, before the bytes it covers"
        );
        assert!(
            len_at + 4 <= header_bytes && header_bytes <= self.slot_bytes,
            "the length field in the header, the header in the slot"
        );
        Frame {
            header_bytes,
            checksum: Checksum::Length { at: crc_at, len_at },
            ..self
        }
    }

    /// What messages call the record.
    pub const fn record(&self) -> &'static str {
        self.record
    }

    /// Bytes of one slot.
    pub const fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Where the checksum is and what it covers.
    pub const fn checksum(&self) -> Checksum {
        self.checksum
    }

    /// Checks the frame of one slot's bytes (`b`: the slot, or for a sized record as
    /// much of it as could be read): its length, magic, version, the length it gives
    /// itself, and checksum, in that order. A pure function of `b`; the record's own
    /// fields are its format's to check.
    pub fn open<'a>(&self, b: &'a [u8]) -> Result<Opened<'a>, Invalid> {
        let record = self.record;
        if b.len() < self.header_bytes || b.len() > self.slot_bytes {
            return Err(Invalid::Length {
                record,
                bytes: b.len(),
                least: self.header_bytes,
                most: self.slot_bytes,
            });
        }
        if b[MAGIC_AT..MAGIC_AT + MAGIC_BYTES] != self.magic {
            return Err(if b.iter().all(|&x| x == 0) {
                Invalid::Blank
            } else {
                Invalid::Magic { record }
            });
        }
        let version = get32(b, VERSION_AT);
        if !(self.oldest..=self.newest).contains(&version) {
            return Err(Invalid::Version {
                record,
                version,
                oldest: self.oldest,
                newest: self.newest,
            });
        }
        let (crc_at, len) = self.extent(b)?;
        if get32(b, crc_at) != self.crc(b, len) {
            return Err(Invalid::Checksum { record });
        }
        Ok(Opened {
            version,
            bytes: &b[..len],
        })
    }

    /// Writes the frame around a record's fields in `b`: the magic, `version`, and last
    /// the checksum. `b` is a whole slot, or for a sized record at least its length
    /// (which its length field must already hold).
    pub fn seal(&self, b: &mut [u8], version: u32) {
        assert!(
            (self.oldest..=self.newest).contains(&version),
            "a version of the format"
        );
        assert!(
            b.len() >= self.header_bytes && b.len() <= self.slot_bytes,
            "a {} slot of {} bytes",
            self.record,
            b.len()
        );
        b[MAGIC_AT..MAGIC_AT + MAGIC_BYTES].copy_from_slice(&self.magic);
        put32(b, VERSION_AT, version);
        let (crc_at, len) = self
            .extent(b)
            .unwrap_or_else(|e| panic!("a record sealed whole: {e}"));
        let crc = self.crc(b, len);
        put32(b, crc_at, crc);
        debug_assert!(self.open(b).is_ok(), "a sealed record opens");
    }

    /// A field of this record out of its range.
    pub const fn field(&self, field: &'static str) -> Invalid {
        Invalid::Field {
            record: self.record,
            field,
        }
    }

    /// Slot `i` of `area` (two slots, or fewer bytes): a whole slot, or the bytes the
    /// area has of it (none past its end).
    pub fn slot<'a>(&self, area: &'a [u8], i: usize) -> &'a [u8] {
        let start = i.saturating_mul(self.slot_bytes).min(area.len());
        let end = start.saturating_add(self.slot_bytes).min(area.len());
        &area[start..end]
    }

    /// The two slots at the start of `area`, each read by `decode`, picked by `seq`
    /// ([`pick`]).
    pub fn pick<T>(
        &self,
        area: &[u8],
        decode: impl Fn(&[u8]) -> Result<T, Invalid>,
        seq: impl Fn(&T) -> u64,
    ) -> Picked<T> {
        pick(decode(self.slot(area, 0)), decode(self.slot(area, 1)), seq)
    }

    /// Where the checksum is in `b` and the record's length, checked against the slot.
    fn extent(&self, b: &[u8]) -> Result<(usize, usize), Invalid> {
        match self.checksum {
            Checksum::Tail => Ok((b.len() - 4, b.len())),
            Checksum::Length { at, len_at } => {
                let len = get32(b, len_at) as usize;
                if len < self.header_bytes || len > b.len() {
                    return Err(Invalid::Extent {
                        record: self.record,
                        bytes: len,
                    });
                }
                Ok((at, len))
            }
        }
    }

    /// The CRC-32C of a record of `len` bytes in `b`.
    fn crc(&self, b: &[u8], len: usize) -> u32 {
        match self.checksum {
            Checksum::Tail => crc32c::crc32c(&b[..len - 4]),
            Checksum::Length { len_at, .. } => crc32c::crc32c(&b[len_at..len]),
        }
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Invalid::Length {
                record,
                bytes,
                least,
                most,
            } if least == most => write!(f, "a {record} slot of {bytes} bytes, not {most}"),
            Invalid::Length {
                record,
                bytes,
                least,
                most,
            } => write!(f, "a {record} slot of {bytes} bytes, not {least} to {most}"),
            Invalid::Blank => f.write_str("blank"),
            Invalid::Magic { record } => write!(f, "no cairn {record} magic"),
            Invalid::Version {
                record,
                version,
                oldest,
                newest,
            } if oldest == newest => {
                write!(f, "{record} version {version}, this cairn reads {newest}")
            }
            Invalid::Version {
                record,
                version,
                oldest,
                newest,
            } => write!(
                f,
                "{record} version {version}, this cairn reads versions {oldest} to {newest}"
            ),
            Invalid::Extent { record, bytes } => write!(f, "{record} length {bytes} out of range"),
            Invalid::Checksum { record } => write!(f, "{record} checksum mismatch"),
            Invalid::Field { record, field } => {
                write!(f, "{record} field '{field}' out of range")
            }
            Invalid::Other(why) => f.write_str(why),
        }
    }
}

impl<T> Picked<T> {
    /// The newest valid record, if there is one.
    pub fn newest(self) -> Option<T> {
        match self {
            Picked::Valid { record, .. } => Some(record),
            Picked::Blank | Picked::Foreign { .. } => None,
        }
    }
}

/// Of two slots as they decoded, the valid one with the higher `seq` (the first on a
/// tie); why the other is damaged unless it is valid or blank; blank only when both are;
/// foreign when neither is valid and they are not both blank.
pub fn pick<T>(
    first: Result<T, Invalid>,
    second: Result<T, Invalid>,
    seq: impl Fn(&T) -> u64,
) -> Picked<T> {
    let valid = |record, slot, other, why: Option<Invalid>| Picked::Valid {
        record,
        slot,
        other,
        damaged: why.filter(|e| *e != Invalid::Blank),
    };
    match (first, second) {
        (Ok(a), Ok(b)) if seq(&b) > seq(&a) => valid(b, 1, Some(a), None),
        (Ok(a), Ok(b)) => valid(a, 0, Some(b), None),
        (Ok(a), Err(e)) => valid(a, 0, None, Some(e)),
        (Err(e), Ok(b)) => valid(b, 1, None, Some(e)),
        (Err(Invalid::Blank), Err(Invalid::Blank)) => Picked::Blank,
        (Err(first), Err(second)) => Picked::Foreign { first, second },
    }
}

#[cfg(test)]
mod tests {
    use super::super::{get64, put64};
    use super::*;

    /// A record of 64 bytes filling its slot: a sequence number at 16.
    const FILLS: Frame = Frame::new("superblock", *b"TESTREC\0", 1, 1, 64);
    /// A record of its own length in a slot of 256 bytes: checksum at 12, length at 16,
    /// a header of 32 bytes, a sequence number at 24; versions 1 and 2.
    const SIZED: Frame = Frame::new("directory", *b"TESTDIR\0", 1, 2, 256).sized(12, 16, 32);

    fn filling(seq: u64) -> Vec<u8> {
        let mut b = vec![0u8; 64];
        put64(&mut b, 16, seq);
        b[40] = 0xa5;
        FILLS.seal(&mut b, 1);
        b
    }

    fn sized(seq: u64, len: u32, version: u32) -> Vec<u8> {
        let mut b = vec![0u8; 128];
        put32(&mut b, 16, len);
        put64(&mut b, 24, seq);
        b[32..len as usize].fill(0x5a);
        SIZED.seal(&mut b, version);
        b
    }

    /// The sequence number of a [`FILLS`] record.
    fn decode(b: &[u8]) -> Result<u64, Invalid> {
        FILLS.open(b).map(|o| get64(o.bytes, 16))
    }

    #[test]
    fn a_sealed_record_opens_and_every_flipped_byte_it_covers_is_caught() {
        let b = filling(7);
        assert_eq!(&b[..8], b"TESTREC\0");
        assert_eq!(get32(&b, 8), 1);
        assert_eq!(get32(&b, 60), crc32c::crc32c(&b[..60]));
        assert_eq!(
            FILLS.open(&b).map(|o| (o.version, o.bytes.len())),
            Ok((1, 64))
        );
        for i in 0..64 {
            let mut c = b.clone();
            c[i] ^= 0x10;
            assert!(FILLS.open(&c).is_err(), "byte {i}");
        }
        let b = sized(9, 40, 2);
        assert_eq!(get32(&b, 12), crc32c::crc32c(&b[16..40]));
        assert_eq!(
            SIZED.open(&b).map(|o| (o.version, o.bytes.len())),
            Ok((2, 40))
        );
        // Covered: the magic, the version, the length and on; past the length, nothing.
        for i in (0..12).chain(16..40) {
            let mut c = b.clone();
            c[i] ^= 0x10;
            assert!(SIZED.open(&c).is_err(), "byte {i}");
        }
        let mut c = b.clone();
        c[100] ^= 0x10;
        assert!(SIZED.open(&c).is_ok());
        // A sized record read cut short, down to its length, opens.
        assert!(SIZED.open(&b[..40]).is_ok());
    }

    #[test]
    fn a_frame_is_checked_in_order_and_says_why_in_one_line() {
        let cases: Vec<(Frame, Vec<u8>, Invalid, &str)> = vec![
            (
                FILLS,
                filling(1)[..63].to_vec(),
                Invalid::Length {
                    record: "superblock",
                    bytes: 63,
                    least: 64,
                    most: 64,
                },
                "a superblock slot of 63 bytes, not 64",
            ),
            (
                SIZED,
                vec![0x11; 31],
                Invalid::Length {
                    record: "directory",
                    bytes: 31,
                    least: 32,
                    most: 256,
                },
                "a directory slot of 31 bytes, not 32 to 256",
            ),
            (
                SIZED,
                vec![0; 257],
                Invalid::Length {
                    record: "directory",
                    bytes: 257,
                    least: 32,
                    most: 256,
                },
                "a directory slot of 257 bytes, not 32 to 256",
            ),
            (FILLS, vec![0; 64], Invalid::Blank, "blank"),
            (
                FILLS,
                {
                    let mut b = vec![0; 64];
                    b[63] = 1;
                    b
                },
                Invalid::Magic {
                    record: "superblock",
                },
                "no cairn superblock magic",
            ),
            (
                FILLS,
                {
                    let mut b = filling(1);
                    put32(&mut b, 8, 2);
                    b
                },
                Invalid::Version {
                    record: "superblock",
                    version: 2,
                    oldest: 1,
                    newest: 1,
                },
                "superblock version 2, this cairn reads 1",
            ),
            (
                SIZED,
                {
                    let mut b = sized(1, 40, 1);
                    put32(&mut b, 8, 3);
                    b
                },
                Invalid::Version {
                    record: "directory",
                    version: 3,
                    oldest: 1,
                    newest: 2,
                },
                "directory version 3, this cairn reads versions 1 to 2",
            ),
            (
                SIZED,
                {
                    let mut b = sized(1, 40, 1);
                    put32(&mut b, 16, 129);
                    b
                },
                Invalid::Extent {
                    record: "directory",
                    bytes: 129,
                },
                "directory length 129 out of range",
            ),
            (
                SIZED,
                {
                    let mut b = sized(1, 40, 1);
                    put32(&mut b, 16, 31);
                    b
                },
                Invalid::Extent {
                    record: "directory",
                    bytes: 31,
                },
                "directory length 31 out of range",
            ),
            (
                FILLS,
                {
                    let mut b = filling(1);
                    b[20] ^= 1;
                    b
                },
                Invalid::Checksum {
                    record: "superblock",
                },
                "superblock checksum mismatch",
            ),
        ];
        for (frame, b, want, text) in cases {
            let got = frame.open(&b).unwrap_err();
            assert_eq!(got, want, "{text}");
            assert_eq!(got.to_string(), text);
        }
        assert_eq!(
            FILLS.field("level").to_string(),
            "superblock field 'level' out of range"
        );
        assert_eq!(
            Invalid::Other("bitmap 'b' is listed twice".into()).to_string(),
            "bitmap 'b' is listed twice"
        );
    }

    #[test]
    fn the_newest_valid_slot_wins_and_the_other_is_named_unless_blank() {
        let pair = |a: &[u8], b: &[u8]| [a, b].concat();
        let pick = |area: &[u8]| FILLS.pick(area, decode, |&s| s);
        let (old, new) = (filling(6), filling(7));
        assert_eq!(
            pick(&pair(&old, &new)),
            Picked::Valid {
                record: 7,
                slot: 1,
                other: Some(6),
                damaged: None
            }
        );
        // A tie goes to the first slot.
        assert_eq!(
            pick(&pair(&new, &new)),
            Picked::Valid {
                record: 7,
                slot: 0,
                other: Some(7),
                damaged: None
            }
        );
        // The new copy torn: the old one is used, the torn one named.
        let mut torn = new.clone();
        torn[32..].fill(0);
        assert_eq!(
            pick(&pair(&old, &torn)),
            Picked::Valid {
                record: 6,
                slot: 0,
                other: None,
                damaged: Some(Invalid::Checksum {
                    record: "superblock"
                })
            }
        );
        // A slot never written is not damaged; nor is one the area does not reach named
        // as anything but cut short.
        assert_eq!(
            pick(&pair(&[0; 64], &new)),
            Picked::Valid {
                record: 7,
                slot: 1,
                other: None,
                damaged: None
            }
        );
        assert!(matches!(
            pick(&new[..]),
            Picked::Valid {
                record: 7,
                slot: 0,
                damaged: Some(Invalid::Length { bytes: 0, .. }),
                ..
            }
        ));
        assert_eq!(pick(&[0; 128]), Picked::Blank);
        assert_eq!(pick(&[0; 128]).newest(), None);
        assert!(matches!(
            pick(&pair(&[0x53; 64], &[0; 64])),
            Picked::Foreign {
                first: Invalid::Magic { .. },
                second: Invalid::Blank
            }
        ));
        assert!(matches!(pick(&[]), Picked::Foreign { .. }));
        assert_eq!(pick(&pair(&old, &torn)).newest(), Some(6));
    }

    #[test]
    fn slots_of_an_area_cut_short_are_what_it_holds() {
        let area = vec![1u8; 100];
        assert_eq!(FILLS.slot(&area, 0).len(), 64);
        assert_eq!(FILLS.slot(&area, 1).len(), 36);
        assert_eq!(FILLS.slot(&area, 2).len(), 0);
        assert_eq!(FILLS.slot(&area, usize::MAX).len(), 0);
    }

    proptest::proptest! {
        /// Random and damaged slots never panic a frame's checks.
        #[test]
        fn open_never_panics(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..300),
            flips in proptest::collection::vec((0..128usize, proptest::num::u8::ANY), 0..6),
            len in 0u32..300,
        ) {
            let _ = FILLS.open(&bytes);
            let _ = SIZED.open(&bytes);
            let mut b = sized(3, 64, 2);
            put32(&mut b, 16, len);
            for (i, x) in flips {
                b[i] ^= x;
            }
            let _ = SIZED.open(&b);
        }
    }
}
