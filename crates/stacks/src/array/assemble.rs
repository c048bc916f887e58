//! Deciding what an array is from what its members hold: create it, assemble it, or refuse.
//!
//! Pure: the caller reads each member's superblock slots and passes what it found
//! ([`Seen`]); [`plan`] returns the array to run ([`Plan`]) or why not ([`Error`]).
//! The rules, after md's:
//!
//! - Every member blank (or named `missing`): a new array is created.
//! - Otherwise the members' superblocks must agree: one array UUID, the layout the stack
//!   file gives, each member at the position its superblock records, no member twice.
//!   A member that holds data (its metadata area is not all zeros, or what its
//!   allocation map shows allocated is not) and has no valid superblock is foreign and
//!   refused: it may be a raw array's member or another program's disk.
//! - The superblock with the highest event count is the array's record. A member is read
//!   only if that record has it active and its own superblock is as new; a member that is
//!   behind, marked failed or missing, or blank (a replacement) is written to but not
//!   read until it is rebuilt. The array runs degraded, and says so, while every piece of
//!   data still has a current copy; otherwise it does not start.
//! - A member that is behind, or marked failed or missing, but left the array when the
//!   write-intent bitmap was last cleared or later, and was current then, is recovered
//!   from the bitmap: only the regions written while it was away are copied to it.

use super::superblock::{uuid_text, Level, MemberState, Superblock};
use crate::error::Error;

/// What the stack file says the array is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expect {
    /// The device's name in the stack file.
    pub name: String,
    /// Layout.
    pub level: Level,
    /// Chunk of stripe and raid10 (0 otherwise).
    pub chunk_bytes: u64,
    /// Copies of each chunk (1 for linear and stripe, members for a mirror).
    pub copies: u32,
    /// Member names, in order (`missing` for an absent one).
    pub members: Vec<String>,
    /// The write-intent bitmap's region the stack file asks for (0: no bitmap).
    pub bitmap_region: u64,
}

/// What one member position holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Named `missing` in the stack file.
    Missing,
    /// Both superblock slots are all zeros.
    Blank,
    /// The newest valid superblock.
    Valid(Superblock),
    /// A spare's superblock, of the array with this UUID: no data of it, like a blank
    /// member (listed as a member now: it is rebuilt whole).
    Spare([u8; 16]),
    /// Not blank, and no valid superblock: why.
    Foreign(String),
}

/// How one member takes part in this run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// Its state.
    pub state: MemberState,
    /// For a rebuilding member: bytes in sync from the start.
    pub recovery_offset: u64,
    /// Its identity (new for a blank member).
    pub member_uuid: [u8; 16],
    /// Rebuilding from the bitmap: only the regions dirty in it are copied.
    pub partial: bool,
}

/// The array to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Created now (every member was blank).
    pub created: bool,
    /// The array's identity.
    pub array_uuid: [u8; 16],
    /// The event count of the array's record (0 when created).
    pub events: u64,
    /// Whether the record says the array stopped cleanly.
    pub clean: bool,
    /// Not clean: the array offset below which the copies agree (a stop during a resync
    /// recorded how far it got; 0: the resync starts over).
    pub resync_from: u64,
    /// Unix seconds of creation.
    pub created_secs: u64,
    /// Every member, in order.
    pub parts: Vec<Part>,
    /// Lines to log: members not read, and why.
    pub notes: Vec<String>,
}

/// Decides the array from what its members hold; `uuid` makes new identities.
pub fn plan(
    expect: &Expect,
    seen: &[Seen],
    now_secs: u64,
    mut uuid: impl FnMut() -> [u8; 16],
) -> Result<Plan, Error> {
    assert_eq!(seen.len(), expect.members.len(), "one entry per member");
    refuse_foreign(expect, seen)?;
    refuse_retired(expect, seen)?;
    let valid: Vec<(usize, &Superblock)> = seen
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match s {
            Seen::Valid(sb) => Some((i, sb)),
            _ => None,
        })
        .collect();
    let Some(&(_, record)) = valid.iter().max_by_key(|(_, sb)| sb.events) else {
        return create(expect, seen, now_secs, uuid);
    };
    // Every valid superblock must be of this array, as the stack file lays it out.
    for &(i, sb) in &valid {
        check_member(expect, &valid, record, i, sb)?;
    }
    refuse_other_spares(expect, seen, record)?;
    let mut notes = Vec::new();
    // Whether the record's bitmap can bring members back (this run keeps one too).
    let bitmap = record.region_bytes != 0 && expect.bitmap_region != 0;
    let mut parts = Vec::with_capacity(seen.len());
    for (i, s) in seen.iter().enumerate() {
        let (part, note) = part_of(expect, record, bitmap, i, s, &mut uuid);
        parts.push(part);
        notes.extend(note);
    }
    let plan = Plan {
        created: false,
        array_uuid: record.array_uuid,
        events: record.events,
        clean: record.clean(),
        resync_from: if record.clean() {
            0
        } else {
            record.resync_offset
        },
        created_secs: record.created_secs,
        parts,
        notes,
    };
    check_readable(expect, &plan)?;
    Ok(plan)
}

/// Refuses a member that holds data but no superblock.
fn refuse_foreign(expect: &Expect, seen: &[Seen]) -> Result<(), Error> {
    let name = &expect.name;
    for (i, s) in seen.iter().enumerate() {
        if let Seen::Foreign(why) = s {
            return Err(Error::Foreign {
                array: name.clone(),
                member: expect.members[i].clone(),
                why: why.clone(),
            });
        }
    }
    Ok(())
}

/// Refuses a member taken out of the array (replace, remove): it is out of date from
/// then on, and the stack file names the members from before the change.
fn refuse_retired(expect: &Expect, seen: &[Seen]) -> Result<(), Error> {
    let name = &expect.name;
    for (i, s) in seen.iter().enumerate() {
        if let Seen::Valid(sb) = s {
            if sb.retired() {
                return Err(Error::Retired {
                    array: name.clone(),
                    member: expect.members[i].clone(),
                    events: sb.events,
                    by: (sb.retired_by != [0; 16]).then(|| uuid_text(&sb.retired_by)),
                });
            }
        }
    }
    Ok(())
}

/// Checks that member `i`'s valid superblock `sb` is of the array `record` is of, laid
/// out as the stack file says, at its position, and not another member's copy.
fn check_member(
    expect: &Expect,
    valid: &[(usize, &Superblock)],
    record: &Superblock,
    i: usize,
    sb: &Superblock,
) -> Result<(), Error> {
    let (name, member) = (&expect.name, &expect.members[i]);
    if sb.array_uuid != record.array_uuid {
        let (j, _) = valid
            .iter()
            .find(|(_, r)| r.array_uuid == record.array_uuid)
            .copied()
            .unwrap_or((i, sb));
        return Err(Error::DifferentArrays {
            array: name.clone(),
            member: member.clone(),
            other: expect.members[j].clone(),
            uuid: uuid_text(&sb.array_uuid),
            other_uuid: uuid_text(&record.array_uuid),
        });
    }
    let layout = |s: &Superblock| {
        format!(
            "{} of {} members, chunk {}, copies {}",
            s.level.name(),
            s.roles.len(),
            s.chunk_bytes,
            s.copies
        )
    };
    let want = format!(
        "{} of {} members, chunk {}, copies {}",
        expect.level.name(),
        expect.members.len(),
        expect.chunk_bytes,
        expect.copies
    );
    if layout(sb) != want {
        return Err(Error::LayoutDiffers {
            array: name.clone(),
            member: member.clone(),
            found: layout(sb),
            want,
        });
    }
    if sb.role as usize != i {
        return Err(Error::OutOfOrder {
            array: name.clone(),
            member: member.clone(),
            recorded: u64::from(sb.role) + 1,
            listed: i + 1,
        });
    }
    if let Some(&(j, _)) = valid
        .iter()
        .find(|(j, other)| *j < i && other.member_uuid == sb.member_uuid)
    {
        return Err(Error::SameMember {
            array: name.clone(),
            first: expect.members[j].clone(),
            second: member.clone(),
        });
    }
    Ok(())
}

/// Refuses a spare of another array than `record`'s.
fn refuse_other_spares(expect: &Expect, seen: &[Seen], record: &Superblock) -> Result<(), Error> {
    let name = &expect.name;
    for (i, s) in seen.iter().enumerate() {
        if let Seen::Spare(of) = s {
            if *of != record.array_uuid {
                return Err(Error::OtherSpare {
                    array: name.clone(),
                    member: expect.members[i].clone(),
                    uuid: uuid_text(of),
                });
            }
        }
    }
    Ok(())
}

/// How member `i`, holding `s`, takes part in the array `record` describes (`bitmap`:
/// whether its bitmap can bring members back), and the line to log about it if any.
fn part_of(
    expect: &Expect,
    record: &Superblock,
    bitmap: bool,
    i: usize,
    s: &Seen,
    uuid: &mut impl FnMut() -> [u8; 16],
) -> (Part, Option<String>) {
    let member = &expect.members[i];
    let part = |state, recovery_offset, member_uuid, partial| Part {
        state,
        recovery_offset,
        member_uuid,
        partial,
    };
    match s {
        Seen::Missing => (part(MemberState::Missing, 0, [0; 16], false), None),
        Seen::Blank | Seen::Spare(_) => {
            let note = format!(
                "member '{member}' is {}: it is written to, and not read until rebuilt",
                if matches!(s, Seen::Blank) {
                    "blank"
                } else {
                    "a spare of this array"
                }
            );
            (part(MemberState::Rebuilding, 0, uuid(), false), Some(note))
        }
        Seen::Valid(sb) => valid_part(member, record, bitmap, i, sb),
        Seen::Foreign(_) => unreachable!("refused above"),
    }
}

/// How member `i` (named `member`), whose superblock is `sb`, takes part in the array
/// `record` describes, and the line to log about it if any: active if current, else
/// rebuilt (resumed, from the bitmap, or whole).
fn valid_part(
    member: &str,
    record: &Superblock,
    bitmap: bool,
    i: usize,
    sb: &Superblock,
) -> (Part, Option<String>) {
    let role = record.roles[i];
    let rebuilding = |recovery_offset, partial| Part {
        state: MemberState::Rebuilding,
        recovery_offset,
        member_uuid: sb.member_uuid,
        partial,
    };
    if sb.events == record.events && role.state == MemberState::Active {
        let part = Part {
            state: MemberState::Active,
            recovery_offset: role.recovery_offset,
            member_uuid: sb.member_uuid,
            partial: false,
        };
        return (part, None);
    }
    if sb.events == record.events && role.state == MemberState::Rebuilding {
        let partial = role.partial && bitmap;
        let offset = if role.partial && !partial {
            // Recovered from a bitmap this run does not keep: from the start.
            0
        } else {
            role.recovery_offset
        };
        let note = format!(
            "member '{member}' is being rebuilt{} ({offset} bytes done): not read beyond that",
            if partial { " from the bitmap" } else { "" }
        );
        return (rebuilding(offset, partial), Some(note));
    }
    if bitmap && sb.events >= record.events_cleared && current_when_left(sb, i) {
        let why = if sb.events < record.events {
            format!("events {} behind the array's {}", sb.events, record.events)
        } else {
            format!("marked {} by the array", role.state.name())
        };
        let note = format!(
            "member '{member}' is back ({why}): the regions the bitmap marks are copied to it; it is read elsewhere"
        );
        return (rebuilding(0, true), Some(note));
    }
    let why = if sb.events < record.events {
        format!(
            "stale: events {} behind the array's {}",
            sb.events, record.events
        )
    } else {
        format!("marked {} by the array", role.state.name())
    };
    let note = format!("member '{member}' is {why}: it is written to, and not read until rebuilt");
    (rebuilding(0, false), Some(note))
}

/// Whether member `i` was current when it left, by its own superblock `sb`: active, or
/// being recovered from the bitmap (then its regions are still dirty, since no bit is
/// cleared while a member is away).
fn current_when_left(sb: &Superblock, i: usize) -> bool {
    let own = sb.roles[i];
    own.state == MemberState::Active || (own.state == MemberState::Rebuilding && own.partial)
}

/// Every member blank or missing: a new array.
fn create(
    expect: &Expect,
    seen: &[Seen],
    now_secs: u64,
    mut uuid: impl FnMut() -> [u8; 16],
) -> Result<Plan, Error> {
    let parts = seen
        .iter()
        .map(|s| match s {
            Seen::Missing => Part {
                state: MemberState::Missing,
                recovery_offset: 0,
                member_uuid: [0; 16],
                partial: false,
            },
            _ => Part {
                state: MemberState::Active,
                recovery_offset: 0,
                member_uuid: uuid(),
                partial: false,
            },
        })
        .collect();
    let plan = Plan {
        created: true,
        array_uuid: uuid(),
        events: 0,
        clean: true,
        resync_from: 0,
        created_secs: now_secs,
        parts,
        notes: Vec::new(),
    };
    check_readable(expect, &plan)?;
    Ok(plan)
}

/// Every piece of data has an active copy.
fn check_readable(expect: &Expect, plan: &Plan) -> Result<(), Error> {
    let active: Vec<bool> = plan
        .parts
        .iter()
        .map(|p| p.state == MemberState::Active)
        .collect();
    if let Some(set) = uncovered(expect.level, expect.copies as usize, &active) {
        let holders = set
            .iter()
            .map(|&m| (expect.members[m].clone(), plan.parts[m].state.name()))
            .collect();
        return Err(Error::NoCurrentCopy {
            array: expect.name.clone(),
            holders,
            created: plan.created,
        });
    }
    Ok(())
}

/// A set of members holding every copy of some data, none of them active; `None` when
/// every piece has an active copy.
pub fn uncovered(level: Level, copies: usize, active: &[bool]) -> Option<Vec<usize>> {
    let n = active.len();
    match level {
        Level::Linear | Level::Stripe => (0..n).find(|&m| !active[m]).map(|m| vec![m]),
        Level::Mirror => (!active.iter().any(|&a| a)).then(|| (0..n).collect()),
        Level::Raid10 => {
            // Copy k of chunk i is on member (i * copies + k) % n; the pattern of copy
            // sets repeats within n chunks.
            (0..n).find_map(|i| {
                let set: Vec<usize> = (0..copies).map(|k| (i * copies + k) % n).collect();
                (!set.iter().any(|&m| active[m])).then_some(set)
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::superblock::{Role, DATA_OFFSET_MIN, FLAG_CLEAN};
    use super::*;

    fn expect(level: Level, members: &[&str]) -> Expect {
        let n = members.len() as u32;
        Expect {
            name: "r".into(),
            level,
            chunk_bytes: if matches!(level, Level::Stripe | Level::Raid10) {
                65536
            } else {
                0
            },
            copies: match level {
                Level::Mirror => n,
                Level::Raid10 => 2,
                _ => 1,
            },
            members: members.iter().map(|s| s.to_string()).collect(),
            bitmap_region: 0,
        }
    }

    fn counter() -> impl FnMut() -> [u8; 16] {
        let mut n = 0u8;
        move || {
            n += 1;
            [n; 16]
        }
    }

    /// The superblock member `role` of a plan would carry at `events`.
    fn sb(e: &Expect, plan: &Plan, role: usize, events: u64) -> Superblock {
        Superblock {
            generation: 1,
            array_uuid: plan.array_uuid,
            member_uuid: plan.parts[role].member_uuid,
            level: e.level,
            chunk_bytes: e.chunk_bytes,
            copies: e.copies,
            role: role as u32,
            data_offset: DATA_OFFSET_MIN,
            member_data_bytes: 1 << 20,
            array_bytes: 1 << 20,
            events,
            flags: FLAG_CLEAN,
            retired_by: [0; 16],
            resync_offset: 0,
            region_bytes: 0,
            bitmap: Vec::new(),
            events_cleared: 0,
            created_secs: 1,
            updated_secs: 2,
            name: "r".into(),
            roles: plan
                .parts
                .iter()
                .map(|p| Role {
                    state: p.state,
                    recovery_offset: p.recovery_offset,
                    partial: p.partial,
                })
                .collect(),
        }
    }

    #[test]
    fn blank_members_make_a_new_array() {
        let e = expect(Level::Mirror, &["a", "b"]);
        let p = plan(&e, &[Seen::Blank, Seen::Blank], 5, counter()).unwrap();
        assert!(p.created);
        assert!(p.parts.iter().all(|x| x.state == MemberState::Active));
        assert_ne!(p.parts[0].member_uuid, p.parts[1].member_uuid);
    }

    #[test]
    fn missing_members_start_degraded_only_with_a_copy_left() {
        let e = expect(Level::Mirror, &["a", "missing"]);
        let p = plan(&e, &[Seen::Blank, Seen::Missing], 5, counter()).unwrap();
        assert_eq!(p.parts[1].state, MemberState::Missing);
        let e = expect(Level::Stripe, &["a", "missing"]);
        let err = plan(&e, &[Seen::Blank, Seen::Missing], 5, counter()).unwrap_err();
        assert!(
            matches!(&err, Error::NoCurrentCopy { holders, created: true, .. }
                if holders == &[("missing".to_string(), "missing")]),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("cannot start") && err.to_string().contains("'missing'"),
            "{err}"
        );
        // raid10 of 4, copies 2: members 0 and 1 hold the same data.
        let e = expect(Level::Raid10, &["a", "b", "c", "d"]);
        let seen = [Seen::Blank, Seen::Missing, Seen::Blank, Seen::Missing];
        assert!(plan(&e, &seen, 5, counter()).is_ok());
        let seen = [Seen::Missing, Seen::Missing, Seen::Blank, Seen::Blank];
        let err = plan(&e, &seen, 5, counter()).unwrap_err();
        assert!(
            err.to_string().contains("'a'") && err.to_string().contains("'b'"),
            "{err}"
        );
    }

    #[test]
    fn a_member_behind_is_not_read() {
        let e = expect(Level::Mirror, &["a", "b"]);
        let p = plan(&e, &[Seen::Blank, Seen::Blank], 5, counter()).unwrap();
        let seen = [Seen::Valid(sb(&e, &p, 0, 9)), Seen::Valid(sb(&e, &p, 1, 7))];
        let q = plan(&e, &seen, 6, counter()).unwrap();
        assert!(!q.created);
        assert_eq!(q.events, 9);
        assert_eq!(q.parts[0].state, MemberState::Active);
        assert_eq!(q.parts[1].state, MemberState::Rebuilding);
        assert!(
            q.notes[0].contains("'b'") && q.notes[0].contains("stale"),
            "{:?}",
            q.notes
        );
    }

    #[test]
    fn a_member_the_record_marks_failed_is_not_read() {
        let e = expect(Level::Mirror, &["a", "b"]);
        let mut p = plan(&e, &[Seen::Blank, Seen::Blank], 5, counter()).unwrap();
        p.parts[1].state = MemberState::Failed;
        // The failed member's own superblock is as new as the record: the record alone
        // says it failed.
        let seen = [Seen::Valid(sb(&e, &p, 0, 9)), Seen::Valid(sb(&e, &p, 1, 9))];
        let q = plan(&e, &seen, 6, counter()).unwrap();
        assert_eq!(q.parts[1].state, MemberState::Rebuilding);
        assert!(q.notes[0].contains("marked failed"), "{:?}", q.notes);
    }

    #[test]
    fn a_spare_listed_as_a_member_is_rebuilt_whole_and_another_arrays_is_refused() {
        let e = expect(Level::Mirror, &["a", "s"]);
        let p = plan(&e, &[Seen::Blank, Seen::Blank], 5, counter()).unwrap();
        let seen = [Seen::Valid(sb(&e, &p, 0, 3)), Seen::Spare(p.array_uuid)];
        let q = plan(&e, &seen, 6, counter()).unwrap();
        assert_eq!(q.parts[1].state, MemberState::Rebuilding);
        assert!(!q.parts[1].partial);
        assert!(
            q.notes[0].contains("a spare of this array"),
            "{:?}",
            q.notes
        );
        let seen = [Seen::Valid(sb(&e, &p, 0, 3)), Seen::Spare([0xaa; 16])];
        let err = plan(&e, &seen, 6, counter()).unwrap_err();
        assert!(
            matches!(&err, Error::OtherSpare { member, .. } if member == "s"),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("'s' is a spare of another array"),
            "{err}"
        );
    }

    #[test]
    fn a_blank_replacement_is_written_not_read() {
        let e = expect(Level::Mirror, &["a", "b"]);
        let p = plan(&e, &[Seen::Blank, Seen::Blank], 5, counter()).unwrap();
        let seen = [Seen::Valid(sb(&e, &p, 0, 3)), Seen::Blank];
        let q = plan(&e, &seen, 6, counter()).unwrap();
        assert_eq!(q.parts[1].state, MemberState::Rebuilding);
        assert_ne!(q.parts[1].member_uuid, [0; 16]);
        let seen = [Seen::Blank, Seen::Valid(sb(&e, &p, 1, 3))];
        let q = plan(&e, &seen, 6, counter()).unwrap();
        assert_eq!(q.parts[0].state, MemberState::Rebuilding);
        let e1 = expect(Level::Stripe, &["a", "b"]);
        let p1 = plan(&e1, &[Seen::Blank, Seen::Blank], 5, counter()).unwrap();
        let seen = [Seen::Valid(sb(&e1, &p1, 0, 3)), Seen::Blank];
        let err = plan(&e1, &seen, 6, counter()).unwrap_err();
        assert!(
            err.to_string().contains("cannot start") && err.to_string().contains("'b'"),
            "{err}"
        );
    }

    #[test]
    fn foreign_reordered_duplicated_and_other_layouts_are_refused() {
        let e = expect(Level::Mirror, &["a", "b"]);
        let p = plan(&e, &[Seen::Blank, Seen::Blank], 5, counter()).unwrap();
        let err = plan(
            &e,
            &[Seen::Blank, Seen::Foreign("checksum".into())],
            6,
            counter(),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("'b'")
                && err
                    .to_string()
                    .contains("holds data but no cairn superblock"),
            "{err}"
        );
        // Swapped.
        let seen = [Seen::Valid(sb(&e, &p, 1, 3)), Seen::Valid(sb(&e, &p, 0, 3))];
        let err = plan(&e, &seen, 6, counter()).unwrap_err();
        assert!(
            matches!(&err, Error::OutOfOrder { member, recorded: 2, listed: 1, .. } if member == "a"),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "device 'r': member 'a' is member 2 of the array, but listed as member 1; \
             list the members in their order"
        );
        // One image twice.
        let mut twin = sb(&e, &p, 0, 3);
        twin.role = 1;
        let seen = [Seen::Valid(sb(&e, &p, 0, 3)), Seen::Valid(twin)];
        let err = plan(&e, &seen, 6, counter()).unwrap_err();
        assert!(matches!(err, Error::SameMember { .. }), "{err:?}");
        assert!(err.to_string().contains("same member"), "{err}");
        // Another array's member.
        let mut other = sb(&e, &p, 1, 3);
        other.array_uuid = [0xee; 16];
        let seen = [Seen::Valid(sb(&e, &p, 0, 3)), Seen::Valid(other)];
        let err = plan(&e, &seen, 6, counter()).unwrap_err();
        assert!(matches!(err, Error::DifferentArrays { .. }), "{err:?}");
        assert!(err.to_string().contains("different arrays"), "{err}");
        // Another layout.
        let e3 = expect(Level::Mirror, &["a", "b", "c"]);
        let seen = [
            Seen::Valid(sb(&e, &p, 0, 3)),
            Seen::Valid(sb(&e, &p, 1, 3)),
            Seen::Blank,
        ];
        let err = plan(&e3, &seen, 6, counter()).unwrap_err();
        assert!(
            err.to_string().contains("mirror of 2 members")
                && err.to_string().contains("mirror of 3"),
            "{err}"
        );
    }

    /// With a bitmap on both sides, a member behind the record but current when the bits
    /// were last cleared is recovered from the bitmap; one that left earlier, or was
    /// itself only part way through a full rebuild, is rebuilt whole.
    #[test]
    fn a_member_back_after_the_last_clearing_is_recovered_from_the_bitmap() {
        let mut e = expect(Level::Mirror, &["a", "b"]);
        e.bitmap_region = 1 << 20;
        let p = plan(&e, &[Seen::Blank, Seen::Blank], 5, counter()).unwrap();
        let with_bitmap = |role: usize, events: u64, cleared: u64| {
            let mut s = sb(&e, &p, role, events);
            s.region_bytes = 1 << 20;
            s.bitmap = vec![0];
            s.events_cleared = cleared;
            s
        };
        let seen = [
            Seen::Valid(with_bitmap(0, 12, 8)),
            Seen::Valid(with_bitmap(1, 9, 8)),
        ];
        let q = plan(&e, &seen, 6, counter()).unwrap();
        assert_eq!(q.parts[1].state, MemberState::Rebuilding);
        assert!(q.parts[1].partial, "{:?}", q.notes);
        assert!(q.notes[0].contains("bitmap"), "{:?}", q.notes);
        // Left before the last clearing: whole.
        let seen = [
            Seen::Valid(with_bitmap(0, 12, 10)),
            Seen::Valid(with_bitmap(1, 9, 8)),
        ];
        assert!(!plan(&e, &seen, 6, counter()).unwrap().parts[1].partial);
        // Was part way through a full rebuild when it left: whole.
        let mut mid = with_bitmap(1, 9, 8);
        mid.roles[1].state = MemberState::Rebuilding;
        let seen = [Seen::Valid(with_bitmap(0, 12, 8)), Seen::Valid(mid)];
        assert!(!plan(&e, &seen, 6, counter()).unwrap().parts[1].partial);
        // This run keeps no bitmap: whole.
        let mut none = e.clone();
        none.bitmap_region = 0;
        let seen = [
            Seen::Valid(with_bitmap(0, 12, 8)),
            Seen::Valid(with_bitmap(1, 9, 8)),
        ];
        assert!(!plan(&none, &seen, 6, counter()).unwrap().parts[1].partial);
    }

    #[test]
    fn raid10_copy_sets() {
        // 4 members, 2 copies: sets {0,1} and {2,3}.
        assert_eq!(
            uncovered(Level::Raid10, 2, &[true, false, false, true]),
            None
        );
        assert_eq!(
            uncovered(Level::Raid10, 2, &[false, false, true, true]),
            Some(vec![0, 1])
        );
        // 3 members, 2 copies: sets {0,1}, {2,0}, {1,2}.
        assert_eq!(
            uncovered(Level::Raid10, 2, &[false, true, false]),
            Some(vec![2, 0])
        );
        assert_eq!(uncovered(Level::Raid10, 2, &[true, true, false]), None);
    }
}
