//! The array superblock's fuzz target (the list of every target is `cairn_config::fuzz`'s):
//! two slots through `pick`, each through `decode`, and every superblock decoded encoded
//! and decoded again.
//!
//! Input: flags, the first slot's length (u16), the first slot, the second slot; each
//! slot zero-padded to [`SLOT_BYTES`]. The flag [`CUT`] ends the area inside the second
//! slot, so that a missing slot is seen too.

use crate::array::superblock::{
    bitmap_bytes, pick, Level, MemberState, Role, Superblock, FLAG_CLEAN, FLAG_SPARE, FRAME,
    ROLE_SPARE, SLOT_BYTES,
};
use cairn_core::fuzzing::{padded, trimmed, Input, RESEAL};
use cairn_core::ondisk::{put32, Invalid, Picked};

/// Flag: the area ends inside the second slot.
const CUT: u8 = 2;
/// Where a slot's checksum is (its last 4 bytes, over all before them).
const CRC_AT: usize = SLOT_BYTES - 4;

/// The target's body.
pub fn superblock(data: &[u8]) -> bool {
    let mut input = Input::new(data);
    let flags = input.u8();
    let first = usize::from(input.u16());
    let mut area = padded(input.take(first), SLOT_BYTES);
    area.extend_from_slice(&padded(input.rest(), SLOT_BYTES));
    if flags & RESEAL != 0 {
        for slot in area.chunks_mut(SLOT_BYTES) {
            let crc = crc32c::crc32c(&slot[..CRC_AT]);
            put32(slot, CRC_AT, crc);
        }
    }
    if flags & CUT != 0 {
        area.truncate(SLOT_BYTES + first % SLOT_BYTES);
    }
    let decoded: Vec<Result<Superblock, Invalid>> = (0..2)
        .map(|i| Superblock::decode(FRAME.slot(&area, i)))
        .collect();
    for sb in decoded.iter().flatten() {
        // What decodes is a value encode takes (it asserts its invariants), and reads
        // back the same.
        assert_eq!(Superblock::decode(&sb.encode()).as_ref(), Ok(sb));
    }
    check_pick(&area, &decoded);
    decoded.iter().any(Result::is_ok)
}

/// `pick` chose as the slots decode: the newer valid slot (the first on a tie), the
/// other's fault unless blank, blank only when both are.
fn check_pick(area: &[u8], decoded: &[Result<Superblock, Invalid>]) {
    match pick(area) {
        Picked::Valid {
            record: sb,
            slot,
            other,
            damaged,
        } => {
            assert_eq!(decoded[slot].as_ref(), Ok(&sb));
            match &decoded[1 - slot] {
                Ok(o) => {
                    assert!(damaged.is_none());
                    assert_eq!(other.as_ref(), Some(o));
                    assert!(
                        o.generation < sb.generation
                            || (o.generation == sb.generation && slot == 0)
                    );
                }
                Err(e) => {
                    assert!(other.is_none());
                    assert_eq!(damaged, (*e != Invalid::Blank).then(|| e.clone()));
                }
            }
        }
        Picked::Blank => {
            assert!(decoded.iter().all(|d| *d == Err(Invalid::Blank)));
        }
        Picked::Foreign { first, second } => {
            assert_eq!(
                [Err(first), Err(second)],
                [decoded[0].clone(), decoded[1].clone()]
            );
        }
    }
}

/// A superblock of an array of `level` over `members` members, as member `role`.
fn made(level: Level, members: usize, role: u32, generation: u64) -> Superblock {
    let (copies, chunk_bytes, array_bytes) = match level {
        Level::Linear => (1, 0, members as u64 * (64 << 20)),
        Level::Stripe => (1, 64 << 10, members as u64 * (64 << 20)),
        Level::Mirror => (members as u32, 0, 64 << 20),
        Level::Raid10 => (2, 512 << 10, members as u64 * (32 << 20)),
    };
    let region_bytes = if matches!(level, Level::Mirror | Level::Raid10) {
        1 << 20
    } else {
        0
    };
    let mut bitmap = vec![0u8; bitmap_bytes(array_bytes, region_bytes)];
    if let Some(b) = bitmap.first_mut() {
        *b = 0b1001;
    }
    Superblock {
        generation,
        array_uuid: [0xa7; 16],
        member_uuid: [role as u8; 16],
        level,
        chunk_bytes,
        copies,
        role,
        data_offset: 1 << 20,
        member_data_bytes: 64 << 20,
        array_bytes,
        events: 10 + generation,
        flags: FLAG_CLEAN,
        retired_by: [0; 16],
        resync_offset: 0,
        region_bytes,
        bitmap,
        events_cleared: 9,
        created_secs: 1_800_000_000,
        updated_secs: 1_800_000_000 + generation,
        name: format!("{}-array", level.name()),
        roles: (0..members)
            .map(|i| Role {
                state: if i == 1 && members > 2 {
                    MemberState::Rebuilding
                } else {
                    MemberState::Active
                },
                recovery_offset: if i == 1 && members > 2 {
                    12 << 20
                } else {
                    64 << 20
                },
                partial: false,
            })
            .collect(),
    }
}

/// An input of two slots: resealed ones are trimmed (their checksum is made again).
fn input(flags: u8, a: &[u8], b: &[u8]) -> Vec<u8> {
    let (a, b) = if flags & RESEAL != 0 {
        let strip = |s: &[u8]| {
            let mut s = s.to_vec();
            if s.len() == SLOT_BYTES {
                s[CRC_AT..].fill(0);
            }
            trimmed(&s).to_vec()
        };
        (strip(a), strip(b))
    } else {
        (a.to_vec(), b.to_vec())
    };
    let mut out = vec![flags];
    out.extend_from_slice(&(a.len() as u16).to_le_bytes());
    out.extend_from_slice(&a);
    out.extend_from_slice(&b);
    out
}

/// Seeds: every level, a spare, both slots valid, one blank, one torn, neither valid.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for level in [Level::Linear, Level::Stripe, Level::Mirror, Level::Raid10] {
        let older = made(level, 4, 2, 6).encode();
        let newer = made(level, 4, 2, 7).encode();
        out.push((
            format!("valid-{}-pair", level.name()),
            input(0, &older, &newer),
        ));
        out.push((
            format!("valid-{}-resealed", level.name()),
            input(RESEAL, &newer, &[]),
        ));
    }
    let mut spare = made(Level::Mirror, 2, ROLE_SPARE, 3);
    spare.flags |= FLAG_SPARE;
    out.push(("valid-spare".into(), input(RESEAL, &spare.encode(), &[])));
    let good = made(Level::Raid10, 8, 5, 12).encode();
    let mut torn = made(Level::Raid10, 8, 5, 13).encode();
    torn[SLOT_BYTES / 2..].fill(0);
    out.push(("valid-torn-newer".into(), input(0, &good, &torn)));
    out.push(("valid-cut".into(), input(CUT, &good, &good[..100])));
    out.push(("damaged-both-torn".into(), input(0, &torn, &torn)));
    out.push(("damaged-blank".into(), input(0, &[], &[])));
    let mut members = made(Level::Stripe, 3, 1, 2).encode();
    members[60] = 0xff;
    out.push(("damaged-members".into(), input(RESEAL, &members, &[])));
    out
}
