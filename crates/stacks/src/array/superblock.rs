//! The superblock an array keeps on each of its members: format version 1.
//!
//! Pure encode and decode, no I/O: the array code reads and writes the bytes. The format
//! is documented in the README ("On-disk format"); this module is its reference.
//!
//! Each member starts with a metadata area of [`DATA_OFFSET_MIN`] bytes or more; data
//! starts after it. The superblock is written in two slots of [`SLOT_BYTES`], at offsets
//! 0 and [`SLOT_BYTES`], alternately: a write goes to the slot *not* holding the newest
//! valid copy, with a generation one higher. A write torn by a power cut leaves a slot
//! whose checksum fails, and the other slot, the last good copy, is used. A slot is valid
//! when its magic, version, length and CRC-32C agree; a member with no valid slot and a
//! metadata area that is not all zeros is foreign, never data. The framing (magic,
//! version, checksum) and the pick of a slot are those every record format of cairn's
//! own shares ([`cairn_core::ondisk::record`]).
//!
//! All integers are little-endian.

use cairn_core::ondisk::{get32, get64, put32, put64, Frame, Invalid, Picked};

/// Bytes of one superblock slot.
pub const SLOT_BYTES: usize = 8192;
/// Slots per member (a generation pair).
pub const SLOTS: usize = 2;
/// The smallest metadata area (the two slots, then room to grow).
pub const DATA_OFFSET_MIN: u64 = 1 << 20;
/// Where the write-intent bitmap's bits start in a slot (after a role table of
/// [`MEMBERS_MAX`] entries).
pub const BITMAP_AT: usize = at::ROLES + MEMBERS_MAX * at::ROLE_BYTES;
/// Most bytes of bitmap a slot holds (up to the checksum).
pub const BITMAP_BYTES_MAX: usize = at::CRC - BITMAP_AT;
/// Most regions a bitmap covers: a larger array gets larger regions.
pub const REGIONS_MAX: u64 = BITMAP_BYTES_MAX as u64 * 8;
/// The smallest bitmap region.
pub const REGION_MIN: u64 = 64 << 10;
/// Most members an array records (as many as a stripe or linear may have).
pub const MEMBERS_MAX: usize = 256;
/// The format's magic: the first 8 bytes of a slot.
pub const MAGIC: [u8; 8] = *b"CAIRNSB\0";
/// The format version this code writes and reads.
pub const VERSION: u32 = 1;
/// The record framing ([`cairn_core::ondisk::record`]): the magic, the version, and the
/// CRC-32C in the slot's last 4 bytes over all before them.
pub const FRAME: Frame = Frame::new("superblock", MAGIC, VERSION, VERSION, SLOT_BYTES);

/// Where the fields are in a slot (the magic at 0, the version at 8 and the checksum at
/// [`at::CRC`] are [`FRAME`]'s).
mod at {
    pub const SLOT_BYTES: usize = 12;
    pub const GENERATION: usize = 16;
    pub const ARRAY_UUID: usize = 24;
    pub const MEMBER_UUID: usize = 40;
    pub const LEVEL: usize = 56;
    pub const MEMBERS: usize = 60;
    pub const COPIES: usize = 64;
    pub const ROLE: usize = 68;
    pub const CHUNK: usize = 72;
    pub const DATA_OFFSET: usize = 80;
    pub const MEMBER_DATA: usize = 88;
    pub const ARRAY_BYTES: usize = 96;
    pub const EVENTS: usize = 104;
    pub const FLAGS: usize = 112;
    pub const REGION: usize = 120;
    pub const BITMAP_OFFSET: usize = 128;
    pub const BITMAP_BYTES: usize = 136;
    pub const CREATED: usize = 144;
    pub const UPDATED: usize = 152;
    pub const NAME: usize = 160;
    pub const NAME_BYTES: usize = 64;
    pub const EVENTS_CLEARED: usize = 224;
    /// With [`super::FLAG_RETIRED`]: the member that took this one's place (zeros: none,
    /// it was removed).
    pub const RETIRED_BY: usize = 232;
    /// With the clean flag off: the array offset below which the copies agree (a stop
    /// during a resync records how far it got; 0 otherwise).
    pub const RESYNC_OFFSET: usize = 248;
    pub const ROLES: usize = 256;
    /// Per member: state (1 byte), flags (1 byte), 6 reserved, recovery offset (8).
    pub const ROLE_BYTES: usize = 16;
    pub const CRC: usize = super::SLOT_BYTES - 4;
}

/// How an array lays its data on its members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Members end to end.
    Linear = 1,
    /// RAID0.
    Stripe = 2,
    /// RAID1.
    Mirror = 3,
    /// RAID10, md's near layout.
    Raid10 = 4,
}

impl Level {
    fn from_u32(v: u32) -> Option<Level> {
        Some(match v {
            1 => Level::Linear,
            2 => Level::Stripe,
            3 => Level::Mirror,
            4 => Level::Raid10,
            _ => return None,
        })
    }

    /// The stack-file type name.
    pub fn name(self) -> &'static str {
        match self {
            Level::Linear => "linear",
            Level::Stripe => "stripe",
            Level::Mirror => "mirror",
            Level::Raid10 => "raid10",
        }
    }
}

/// What the array knows of one member, as recorded in every member's superblock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberState {
    /// Holds current data everywhere.
    Active = 1,
    /// Being rebuilt: current below its recovery offset, and written to throughout.
    Rebuilding = 2,
    /// Failed: not read, not written.
    Failed = 3,
    /// Absent (named `missing`, or removed): the array runs without it.
    Missing = 4,
}

impl MemberState {
    fn from_u8(v: u8) -> Option<MemberState> {
        Some(match v {
            1 => MemberState::Active,
            2 => MemberState::Rebuilding,
            3 => MemberState::Failed,
            4 => MemberState::Missing,
            _ => return None,
        })
    }

    /// As `status` prints it.
    pub fn name(self) -> &'static str {
        match self {
            MemberState::Active => "active",
            MemberState::Rebuilding => "rebuilding",
            MemberState::Failed => "failed",
            MemberState::Missing => "missing",
        }
    }
}

/// One member's entry in the role table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Role {
    /// Its state.
    pub state: MemberState,
    /// For a rebuilding member: bytes of its data area in sync, from the start (the
    /// rebuild's checkpoint). Equal to the member data size for an active member.
    pub recovery_offset: u64,
    /// For a rebuilding member: only the regions the bitmap marks dirty need copying (it
    /// was away briefly, and holds current data everywhere else).
    pub partial: bool,
}

/// Role flag bit: [`Role::partial`].
pub const ROLE_PARTIAL: u8 = 1;

/// Flag bit: no write was in flight when the array last stopped.
pub const FLAG_CLEAN: u32 = 1;
/// Flag bit: this member was taken out of the array (`replace`, `remove`) at `events`,
/// and its data is out of date from then on: it is never assembled as current again.
pub const FLAG_RETIRED: u32 = 2;
/// Flag bit: a spare of the array, holding no data of it (role [`ROLE_SPARE`]): it takes
/// the place of the next member that fails, and is rebuilt whole then.
pub const FLAG_SPARE: u32 = 4;
/// The role of a spare ([`FLAG_SPARE`]): no position in the member list.
pub const ROLE_SPARE: u32 = u32::MAX;

/// A superblock's contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// Bumped on every write of the superblock; the newer valid slot wins.
    pub generation: u64,
    /// The array's identity, the same on every member.
    pub array_uuid: [u8; 16],
    /// This member's identity.
    pub member_uuid: [u8; 16],
    /// Layout.
    pub level: Level,
    /// Chunk of stripe and raid10 (0 otherwise).
    pub chunk_bytes: u64,
    /// Copies of each chunk (1 for linear and stripe; members for a mirror).
    pub copies: u32,
    /// This member's position in the array's member list.
    pub role: u32,
    /// Where data starts on every member.
    pub data_offset: u64,
    /// Bytes of data on each member (after `data_offset`).
    pub member_data_bytes: u64,
    /// The array's size.
    pub array_bytes: u64,
    /// Bumped on every state change (a member failed, added, rebuilt; clean or dirty).
    pub events: u64,
    /// [`FLAG_CLEAN`], [`FLAG_RETIRED`].
    pub flags: u32,
    /// With [`FLAG_RETIRED`]: the identity of the member that took this one's place
    /// (zeros when it was removed, or for a member in use).
    pub retired_by: [u8; 16],
    /// With the clean flag off: the copies agree below this array offset, so a resync
    /// resumes there. Written only by a stop during a resync (no write is in flight
    /// then); 0 in every other superblock, as writes in flight may land anywhere.
    pub resync_offset: u64,
    /// Bytes of array data one bitmap bit covers (0: no bitmap).
    pub region_bytes: u64,
    /// The write-intent bitmap, bit `r % 8` of byte `r / 8` for region `r` (set: the
    /// copies of the region may differ); [`bitmap_bytes`] long, empty without a bitmap.
    pub bitmap: Vec<u8>,
    /// The event count when bits were last cleared: a member that left the array at or
    /// after it missed only the writes the bitmap marks.
    pub events_cleared: u64,
    /// Unix seconds when the array was created.
    pub created_secs: u64,
    /// Unix seconds of this write.
    pub updated_secs: u64,
    /// The array's name (the stack file's device name when created), at most 64 bytes.
    pub name: String,
    /// Every member's entry, in member order.
    pub roles: Vec<Role>,
}

impl Superblock {
    /// The slot this superblock is written to: the generation's parity.
    pub fn slot(&self) -> usize {
        (self.generation % SLOTS as u64) as usize
    }

    /// Whether the array was stopped cleanly.
    pub fn clean(&self) -> bool {
        self.flags & FLAG_CLEAN != 0
    }

    /// Whether this member was taken out of the array ([`FLAG_RETIRED`]).
    pub fn retired(&self) -> bool {
        self.flags & FLAG_RETIRED != 0
    }

    /// Whether this is a spare's superblock ([`FLAG_SPARE`]).
    pub fn spare(&self) -> bool {
        self.flags & FLAG_SPARE != 0
    }

    /// The slot's bytes.
    pub fn encode(&self) -> Vec<u8> {
        assert!(
            self.roles.len() <= MEMBERS_MAX,
            "at most {MEMBERS_MAX} members"
        );
        assert!(
            self.name.len() <= at::NAME_BYTES,
            "a name of at most 64 bytes"
        );
        let mut b = vec![0u8; SLOT_BYTES];
        put32(&mut b, at::SLOT_BYTES, SLOT_BYTES as u32);
        put64(&mut b, at::GENERATION, self.generation);
        b[at::ARRAY_UUID..at::ARRAY_UUID + 16].copy_from_slice(&self.array_uuid);
        b[at::MEMBER_UUID..at::MEMBER_UUID + 16].copy_from_slice(&self.member_uuid);
        put32(&mut b, at::LEVEL, self.level as u32);
        put32(&mut b, at::MEMBERS, self.roles.len() as u32);
        put32(&mut b, at::COPIES, self.copies);
        put32(&mut b, at::ROLE, self.role);
        put64(&mut b, at::CHUNK, self.chunk_bytes);
        put64(&mut b, at::DATA_OFFSET, self.data_offset);
        put64(&mut b, at::MEMBER_DATA, self.member_data_bytes);
        put64(&mut b, at::ARRAY_BYTES, self.array_bytes);
        put64(&mut b, at::EVENTS, self.events);
        put32(&mut b, at::FLAGS, self.flags);
        assert_eq!(
            self.bitmap.len(),
            bitmap_bytes(self.array_bytes, self.region_bytes),
            "a bitmap as long as the array's regions need"
        );
        put64(&mut b, at::REGION, self.region_bytes);
        if self.region_bytes != 0 {
            put64(&mut b, at::BITMAP_OFFSET, BITMAP_AT as u64);
            put64(&mut b, at::BITMAP_BYTES, self.bitmap.len() as u64);
            b[BITMAP_AT..BITMAP_AT + self.bitmap.len()].copy_from_slice(&self.bitmap);
        }
        put64(&mut b, at::EVENTS_CLEARED, self.events_cleared);
        b[at::RETIRED_BY..at::RETIRED_BY + 16].copy_from_slice(&self.retired_by);
        put64(&mut b, at::RESYNC_OFFSET, self.resync_offset);
        put64(&mut b, at::CREATED, self.created_secs);
        put64(&mut b, at::UPDATED, self.updated_secs);
        b[at::NAME..at::NAME + self.name.len()].copy_from_slice(self.name.as_bytes());
        for (i, r) in self.roles.iter().enumerate() {
            let o = at::ROLES + i * at::ROLE_BYTES;
            b[o] = r.state as u8;
            b[o + 1] = if r.partial { ROLE_PARTIAL } else { 0 };
            put64(&mut b, o + 8, r.recovery_offset);
        }
        FRAME.seal(&mut b, VERSION);
        b
    }

    /// Reads one slot; every field is checked, so the result can be trusted as a value
    /// (not yet as agreeing with the other members: assembly checks that). The checks run
    /// in the order of the fields' dependencies, so a slot damaged in several places
    /// names the first.
    pub fn decode(b: &[u8]) -> Result<Superblock, Invalid> {
        FRAME.open(b)?;
        if get32(b, at::SLOT_BYTES) as usize != SLOT_BYTES {
            return Err(FRAME.field("slot_bytes"));
        }
        let shape = Shape::decode(b)?;
        let data_offset = get64(b, at::DATA_OFFSET);
        if data_offset < DATA_OFFSET_MIN || !data_offset.is_multiple_of(4096) {
            return Err(FRAME.field("data_offset"));
        }
        let member_data_bytes = get64(b, at::MEMBER_DATA);
        let array_bytes = get64(b, at::ARRAY_BYTES);
        if member_data_bytes == 0
            || array_bytes == 0
            || data_offset.checked_add(member_data_bytes).is_none()
        {
            return Err(FRAME.field("member_data_bytes"));
        }
        let (region_bytes, bitmap) = decode_bitmap(b, array_bytes)?;
        let resync_offset = get64(b, at::RESYNC_OFFSET);
        if resync_offset > array_bytes {
            return Err(FRAME.field("resync_offset"));
        }
        let events = get64(b, at::EVENTS);
        let events_cleared = get64(b, at::EVENTS_CLEARED);
        if events_cleared > events {
            return Err(FRAME.field("events_cleared"));
        }
        let name = decode_name(b)?;
        let roles = decode_roles(b, shape.members, member_data_bytes)?;
        Ok(Superblock {
            generation: get64(b, at::GENERATION),
            array_uuid: uuid_at(b, at::ARRAY_UUID),
            member_uuid: uuid_at(b, at::MEMBER_UUID),
            level: shape.level,
            chunk_bytes: shape.chunk_bytes,
            copies: shape.copies,
            role: shape.role,
            data_offset,
            member_data_bytes,
            array_bytes,
            events,
            flags: get32(b, at::FLAGS),
            retired_by: uuid_at(b, at::RETIRED_BY),
            resync_offset,
            region_bytes,
            bitmap,
            events_cleared,
            created_secs: get64(b, at::CREATED),
            updated_secs: get64(b, at::UPDATED),
            name,
            roles,
        })
    }
}

/// The array's shape as a slot records it: level, members, this member's role, copies,
/// chunk; each checked against the others.
struct Shape {
    level: Level,
    members: usize,
    role: u32,
    copies: u32,
    chunk_bytes: u64,
}

impl Shape {
    fn decode(b: &[u8]) -> Result<Shape, Invalid> {
        let level = Level::from_u32(get32(b, at::LEVEL)).ok_or(FRAME.field("level"))?;
        let members = get32(b, at::MEMBERS) as usize;
        if members == 0 || members > MEMBERS_MAX {
            return Err(FRAME.field("members"));
        }
        let role = get32(b, at::ROLE);
        let spare = get32(b, at::FLAGS) & FLAG_SPARE != 0;
        if spare != (role == ROLE_SPARE) || (!spare && role as usize >= members) {
            return Err(FRAME.field("role"));
        }
        let copies = get32(b, at::COPIES);
        let copies_ok = match level {
            Level::Linear | Level::Stripe => copies == 1,
            Level::Mirror => copies as usize == members,
            Level::Raid10 => copies >= 2 && copies as usize <= members,
        };
        if !copies_ok {
            return Err(FRAME.field("copies"));
        }
        let chunk_bytes = get64(b, at::CHUNK);
        let chunk_ok = match level {
            Level::Stripe | Level::Raid10 => chunk_bytes.is_power_of_two(),
            Level::Linear | Level::Mirror => chunk_bytes == 0,
        };
        if !chunk_ok {
            return Err(FRAME.field("chunk"));
        }
        Ok(Shape {
            level,
            members,
            role,
            copies,
            chunk_bytes,
        })
    }
}

/// The write-intent bitmap's region size and bits (none when the region size is 0),
/// checked against the array's size.
fn decode_bitmap(b: &[u8], array_bytes: u64) -> Result<(u64, Vec<u8>), Invalid> {
    let region_bytes = get64(b, at::REGION);
    let bitmap_offset = get64(b, at::BITMAP_OFFSET);
    let bitmap_len = get64(b, at::BITMAP_BYTES);
    if region_bytes == 0 {
        if bitmap_offset != 0 || bitmap_len != 0 {
            return Err(FRAME.field("bitmap"));
        }
        return Ok((0, Vec::new()));
    }
    if !region_bytes.is_power_of_two()
        || region_bytes < REGION_MIN
        || bitmap_offset != BITMAP_AT as u64
        || array_bytes.div_ceil(region_bytes) > REGIONS_MAX
        || bitmap_len != bitmap_bytes(array_bytes, region_bytes) as u64
    {
        return Err(FRAME.field("bitmap"));
    }
    Ok((
        region_bytes,
        b[BITMAP_AT..BITMAP_AT + bitmap_len as usize].to_vec(),
    ))
}

/// The array's name: UTF-8 up to the first zero byte of its field.
fn decode_name(b: &[u8]) -> Result<String, Invalid> {
    let field = &b[at::NAME..at::NAME + at::NAME_BYTES];
    let len = field.iter().position(|&c| c == 0).unwrap_or(at::NAME_BYTES);
    std::str::from_utf8(&field[..len])
        .map(str::to_string)
        .map_err(|_| FRAME.field("name"))
}

/// Every member's entry; a recovery offset past a member's data is refused.
fn decode_roles(b: &[u8], members: usize, member_data_bytes: u64) -> Result<Vec<Role>, Invalid> {
    let mut roles = Vec::with_capacity(members);
    for i in 0..members {
        let o = at::ROLES + i * at::ROLE_BYTES;
        let state = MemberState::from_u8(b[o]).ok_or(FRAME.field("roles"))?;
        if b[o + 1] & !ROLE_PARTIAL != 0 {
            return Err(FRAME.field("roles"));
        }
        let recovery_offset = get64(b, o + 8);
        if recovery_offset > member_data_bytes {
            return Err(FRAME.field("recovery_offset"));
        }
        roles.push(Role {
            state,
            recovery_offset,
            partial: b[o + 1] & ROLE_PARTIAL != 0,
        });
    }
    Ok(roles)
}

/// The 16 bytes of a UUID field at `at`.
fn uuid_at(b: &[u8], at: usize) -> [u8; 16] {
    let mut u = [0u8; 16];
    u.copy_from_slice(&b[at..at + 16]);
    u
}

/// Picks the newest valid slot of the metadata area's first `2 * SLOT_BYTES` bytes, by
/// generation: blank when both slots are all zeros (a blank member), foreign when neither
/// is valid and they are not blank (not ours to use).
pub fn pick(area: &[u8]) -> Picked<Superblock> {
    FRAME.pick(area, Superblock::decode, |sb| sb.generation)
}

/// Bytes of bitmap an array of `array_bytes` needs with regions of `region_bytes` (0
/// without a bitmap).
pub fn bitmap_bytes(array_bytes: u64, region_bytes: u64) -> usize {
    if region_bytes == 0 {
        0
    } else {
        array_bytes.div_ceil(region_bytes).div_ceil(8) as usize
    }
}

/// The region an array of `array_bytes` gets when `wanted` is asked: `wanted` (a power of
/// two, at least [`REGION_MIN`]), doubled until the bitmap fits in a slot.
pub fn region_for(array_bytes: u64, wanted: u64) -> u64 {
    let mut r = wanted.max(REGION_MIN).next_power_of_two();
    while array_bytes.div_ceil(r) > REGIONS_MAX {
        r *= 2;
    }
    r
}

/// A UUID as people read it: `8-4-4-4-12` hex digits.
pub fn uuid_text(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample(generation: u64) -> Superblock {
        Superblock {
            generation,
            array_uuid: [7; 16],
            member_uuid: [9; 16],
            level: Level::Raid10,
            chunk_bytes: 64 << 10,
            copies: 2,
            role: 1,
            data_offset: DATA_OFFSET_MIN,
            member_data_bytes: 1 << 30,
            array_bytes: 2 << 30,
            events: 42,
            flags: FLAG_CLEAN,
            retired_by: [0; 16],
            resync_offset: 3 << 20,
            region_bytes: 64 << 20,
            bitmap: vec![0b1010_0001, 0x80, 0, 0],
            events_cleared: 40,
            created_secs: 1_700_000_000,
            updated_secs: 1_700_000_100,
            name: "r10 диск".into(),
            roles: (0..4)
                .map(|i| Role {
                    state: if i == 2 {
                        MemberState::Rebuilding
                    } else {
                        MemberState::Active
                    },
                    recovery_offset: if i == 2 { 12345 } else { 1 << 30 },
                    partial: i == 2,
                })
                .collect(),
        }
    }

    #[test]
    fn round_trips() {
        let sb = sample(5);
        let b = sb.encode();
        assert_eq!(b.len(), SLOT_BYTES);
        assert_eq!(Superblock::decode(&b), Ok(sb));
    }

    #[test]
    fn fields_at_their_documented_offsets() {
        let b = sample(5).encode();
        assert_eq!(&b[0..8], b"CAIRNSB\0");
        assert_eq!(get32(&b, 8), 1);
        assert_eq!(get32(&b, 12), 8192);
        assert_eq!(get64(&b, 16), 5);
        assert_eq!(get32(&b, 56), Level::Raid10 as u32);
        assert_eq!(get32(&b, 60), 4);
        assert_eq!(get64(&b, 104), 42);
        assert_eq!(b[256 + 2 * 16], MemberState::Rebuilding as u8);
        assert_eq!(b[256 + 2 * 16 + 1], ROLE_PARTIAL);
        assert_eq!(get64(&b, 120), 64 << 20);
        assert_eq!(get64(&b, 128), 4352);
        assert_eq!(get64(&b, 136), 4);
        assert_eq!(&b[4352..4356], &[0b1010_0001, 0x80, 0, 0]);
        assert_eq!(get64(&b, 224), 40);
        assert_eq!(get64(&b, 248), 3 << 20);
        assert_eq!(get64(&b, 256 + 2 * 16 + 8), 12345);
        assert_eq!(get32(&b, 8188), crc32c::crc32c(&b[..8188]));
    }

    #[test]
    fn every_flipped_bit_is_caught() {
        let b = sample(5).encode();
        for byte in (0..SLOT_BYTES).step_by(7) {
            let mut c = b.clone();
            c[byte] ^= 0x10;
            assert!(Superblock::decode(&c).is_err(), "byte {byte}");
        }
    }

    #[test]
    fn the_newer_valid_slot_wins_and_a_torn_one_loses() {
        let old = sample(6);
        let new = Superblock {
            events: 43,
            ..sample(7)
        };
        let mut area = vec![0u8; 2 * SLOT_BYTES];
        area[..SLOT_BYTES].copy_from_slice(&old.encode());
        area[SLOT_BYTES..].copy_from_slice(&new.encode());
        assert_eq!(
            pick(&area),
            Picked::Valid {
                record: new.clone(),
                slot: 1,
                other: Some(old.clone()),
                damaged: None,
            }
        );
        // The new copy torn half way: only its first 4 KiB reached the disk. The old
        // copy is used, and the torn slot is named as damaged.
        area[SLOT_BYTES + 4096..].fill(0);
        assert_eq!(
            pick(&area),
            Picked::Valid {
                record: old.clone(),
                slot: 0,
                other: None,
                damaged: Some(Invalid::Checksum {
                    record: "superblock"
                }),
            }
        );
        // A slot never written is not damaged.
        area[SLOT_BYTES..].fill(0);
        assert_eq!(
            pick(&area),
            Picked::Valid {
                record: old,
                slot: 0,
                other: None,
                damaged: None,
            }
        );
    }

    #[test]
    fn blank_and_foreign() {
        assert_eq!(pick(&vec![0u8; 2 * SLOT_BYTES]), Picked::Blank);
        let mut area = vec![0u8; 2 * SLOT_BYTES];
        area[100] = 1;
        assert!(matches!(pick(&area), Picked::Foreign { .. }));
        // An ext4 or md superblock is not ours.
        let mut area = vec![0x53u8; 2 * SLOT_BYTES];
        area[0..4].copy_from_slice(&0xa92b4efcu32.to_le_bytes());
        assert!(matches!(
            pick(&area),
            Picked::Foreign {
                first: Invalid::Magic { .. },
                ..
            }
        ));
        assert!(matches!(pick(&[]), Picked::Foreign { .. }));
    }

    #[test]
    fn a_valid_checksum_over_bad_fields_is_still_refused() {
        for (field, value) in [
            (at::LEVEL, 9u32),
            (at::MEMBERS, 0),
            (at::MEMBERS, 257),
            (at::ROLE, 4),
            (at::COPIES, 5),
        ] {
            let mut b = sample(1).encode();
            put32(&mut b, field, value);
            FRAME.seal(&mut b, VERSION);
            assert!(
                matches!(Superblock::decode(&b), Err(Invalid::Field { .. })),
                "field at {field} = {value}"
            );
        }
    }

    #[test]
    fn a_spare_has_the_spare_role_and_only_a_spare_has_it() {
        let mut sb = sample(3);
        sb.flags = FLAG_SPARE;
        sb.role = ROLE_SPARE;
        let b = sb.encode();
        assert_eq!(Superblock::decode(&b), Ok(sb.clone()));
        assert!(Superblock::decode(&b).is_ok_and(|s| s.spare()));
        for (flags, role) in [(FLAG_SPARE, 0), (0, ROLE_SPARE)] {
            let mut bad = sb.clone();
            (bad.flags, bad.role) = (flags, role);
            assert_eq!(
                Superblock::decode(&bad.encode()),
                Err(FRAME.field("role")),
                "flags {flags} role {role}"
            );
        }
    }

    #[test]
    fn a_resync_offset_past_the_array_is_refused() {
        let mut b = sample(1).encode();
        put64(&mut b, at::RESYNC_OFFSET, (2 << 30) + 4096);
        FRAME.seal(&mut b, VERSION);
        assert_eq!(Superblock::decode(&b), Err(FRAME.field("resync_offset")));
    }

    #[test]
    fn bitmap_fields_are_checked() {
        let reseal = |b: &mut Vec<u8>| FRAME.seal(b, VERSION);
        for (field, value) in [
            (at::REGION, 3 << 20),
            (at::REGION, 4096),
            (at::REGION, 1 << 20),
            (at::BITMAP_OFFSET, 4096),
            (at::BITMAP_BYTES, 5),
            (at::EVENTS_CLEARED, 43),
        ] {
            let mut b = sample(1).encode();
            put64(&mut b, field, value);
            reseal(&mut b);
            assert!(
                matches!(Superblock::decode(&b), Err(Invalid::Field { .. })),
                "field at {field} = {value}"
            );
        }
        let mut b = sample(1).encode();
        b[at::ROLES + 1] = 2;
        reseal(&mut b);
        assert_eq!(Superblock::decode(&b), Err(FRAME.field("roles")));
        // No bitmap: no offset, no bytes.
        let none = Superblock {
            region_bytes: 0,
            bitmap: Vec::new(),
            ..sample(1)
        };
        let mut b = none.encode();
        assert_eq!(Superblock::decode(&b), Ok(none));
        put64(&mut b, at::BITMAP_BYTES, 4);
        reseal(&mut b);
        assert_eq!(Superblock::decode(&b), Err(FRAME.field("bitmap")));
    }

    #[test]
    fn regions_grow_until_the_bitmap_fits() {
        assert_eq!(region_for(1 << 30, 64 << 20), 64 << 20);
        assert_eq!(region_for(1 << 30, 1000), REGION_MIN);
        let huge = 1u64 << 50;
        let r = region_for(huge, 64 << 20);
        assert!(huge.div_ceil(r) <= REGIONS_MAX && huge.div_ceil(r / 2) > REGIONS_MAX);
        assert!(bitmap_bytes(huge, r) <= BITMAP_BYTES_MAX);
        assert_eq!(bitmap_bytes(1 << 30, 64 << 20), 2);
        assert_eq!(bitmap_bytes(1 << 30, 0), 0);
    }

    proptest::proptest! {
        /// Corrupted, truncated and random slots never panic, and a slot that decodes
        /// encodes back to the same bytes (nothing is read that is not checked).
        #[test]
        fn decode_never_panics(
            flips in proptest::collection::vec((0..SLOT_BYTES, proptest::num::u8::ANY), 0..8),
            cut in 0..=SLOT_BYTES * 2,
            random in proptest::collection::vec(proptest::num::u8::ANY, 0..64),
        ) {
            let mut b = sample(3).encode();
            for (i, x) in &flips {
                b[*i] ^= x;
            }
            if let Ok(sb) = Superblock::decode(&b) {
                proptest::prop_assert_eq!(sb.encode(), b.clone());
            }
            let mut area = b.clone();
            area.extend_from_slice(&sample(4).encode());
            area.truncate(cut);
            let _ = pick(&area);
            let mut r = b;
            r[..random.len()].copy_from_slice(&random);
            let _ = Superblock::decode(&r);
        }
    }

    #[test]
    fn uuid_text_is_8_4_4_4_12() {
        let u = [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ];
        assert_eq!(uuid_text(&u), "12345678-9abc-def0-0123-456789abcdef");
    }
}
