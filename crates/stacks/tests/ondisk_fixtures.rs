//! The array superblock as cairn wrote it, kept as bytes: whatever the code that reads and
//! writes it becomes, a member written before must read as it did, and what it reads must
//! write back to the same bytes.
//!
//! `fixtures/array-raid10-member-superblocks.bin` is the first 16 KiB (both slots) of
//! member 1 of a raid10 of four 8 MiB file members (`chunk = "64K"`, `metadata = "1"`,
//! the default bitmap), named `fixture-r10`, taken while it ran after a write and a
//! flush: slot 1 holds the superblock its creation wrote (generation 1), slot 0 the one
//! its start wrote (generation 2, the bitmap's one region dirty). Made by cairn at commit
//! 5a79663, before the three record formats shared their framing.

use cairn_stacks::array::superblock::{
    Level, MemberState, Role, Superblock, DATA_OFFSET_MIN, SLOT_BYTES,
};

const AREA: &[u8] = include_bytes!("fixtures/array-raid10-member-superblocks.bin");

/// 16 bytes from 32 hex digits.
fn uuid(hex: &str) -> [u8; 16] {
    let mut u = [0u8; 16];
    for (i, b) in u.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex");
    }
    u
}

/// What slot 0 holds.
fn newest() -> Superblock {
    Superblock {
        generation: 2,
        array_uuid: uuid("8430d30bbd9c45b08cb836cb504c2a72"),
        member_uuid: uuid("6c2693480b014d2bbf633eb0ad1d8a56"),
        level: Level::Raid10,
        chunk_bytes: 64 << 10,
        copies: 2,
        role: 1,
        data_offset: DATA_OFFSET_MIN,
        member_data_bytes: 7 << 20,
        array_bytes: 14 << 20,
        events: 1,
        flags: 0,
        retired_by: [0; 16],
        resync_offset: 0,
        region_bytes: 64 << 20,
        bitmap: vec![1],
        events_cleared: 1,
        created_secs: 1_795_933_233,
        updated_secs: 1_795_933_233,
        name: "fixture-r10".into(),
        roles: vec![
            Role {
                state: MemberState::Active,
                recovery_offset: 7 << 20,
                partial: false,
            };
            4
        ],
    }
}

#[test]
fn a_member_written_before_reads_the_same_and_writes_back_byte_for_byte() {
    assert_eq!(AREA.len(), 2 * SLOT_BYTES);
    let (first, second) = AREA.split_at(SLOT_BYTES);
    let sb = Superblock::decode(first).expect("slot 0 decodes");
    assert_eq!(sb, newest());
    assert_eq!(sb.slot(), 0);
    let older = Superblock::decode(second).expect("slot 1 decodes");
    assert_eq!(
        older,
        Superblock {
            generation: 1,
            bitmap: vec![0],
            ..newest()
        }
    );
    assert_eq!(older.slot(), 1);
    assert!(sb.encode() == first, "slot 0 encodes to other bytes");
    assert!(older.encode() == second, "slot 1 encodes to other bytes");
}
