//! Errors of arrays and stacks: why an admin's action on an array was refused, why a
//! device cannot become a member or a spare, why the members' superblocks do not make an
//! array to start, and what failed while cairn wrote them.
//!
//! Opening devices and queues fails with [`cairn_core::Error`], carried as
//! [`Error::Core`]; the request path keeps [`cairn_core::IoError`]. Every message is one
//! line a user can act on, and the variants carry its facts so that a caller (the admin's
//! reply) can tell the cases apart without reading the text.

use cairn_core::blocking::BlockingError;

/// What a user does to a device that may hold someone's data, to make it a member.
const WIPE: &str = "zero it first to use it (a new file, or blkdiscard -z for a disk)";

/// Everything an array refuses or fails at, outside the request path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The array keeps no superblocks (`metadata = "none"`), so it takes no admin action.
    #[error(
        "'{array}' keeps no metadata (metadata = \"none\" in its stack file): it has no '{action}'"
    )]
    NoMetadata {
        /// The array's name.
        array: String,
        /// The action, as the admin types it (`fail`, `add`...).
        action: &'static str,
    },
    /// A linear or stripe array: it cannot run without any of its members.
    #[error("'{array}' is a {level}: it has no redundancy to run without a member")]
    NotRedundant {
        /// The array's name.
        array: String,
        /// `linear` or `stripe`.
        level: &'static str,
    },
    /// The admin named a member the array does not have.
    #[error("'{array}' has no member '{member}' (its members: {})", members.join(", "))]
    NoSuchMember {
        /// The array's name.
        array: String,
        /// The name given.
        member: String,
        /// The members it has.
        members: Vec<String>,
    },
    /// The member is not in a state the action takes (in use, not failed, being
    /// replaced...).
    #[error("member '{member}' of '{array}' {state}{}", add_hint(*state, array))]
    MemberState {
        /// The array's name.
        array: String,
        /// The member's name.
        member: String,
        /// What it is.
        state: MemberIs,
    },
    /// Failing the member would leave some data with no current copy.
    #[error(
        "failing '{member}' would leave data of '{array}' with no current copy (it lives on {}); let a rebuild finish first",
        quoted(holders)
    )]
    LastCopy {
        /// The array's name.
        array: String,
        /// The member the admin would fail.
        member: String,
        /// The members holding every copy of that data, none of them current but this one.
        holders: Vec<String>,
    },
    /// A new member would have the name of one the array has.
    #[error("'{array}' already has a member named '{name}': give the new one another file name")]
    NameTaken {
        /// The array's name.
        array: String,
        /// The new member's name (its file name).
        name: String,
    },
    /// The spec of a new device does not parse.
    #[error("'{spec}': {source}")]
    Spec {
        /// The spec as the admin gave it.
        spec: String,
        /// Why it does not parse.
        source: cairn_leaves::Error,
    },
    /// An action on one member was refused by the array's records, or recording it failed;
    /// `source` says why. Nothing was changed.
    #[error("{}: {source}", refused(action, member, array))]
    Refused {
        /// The action, as the admin types it (`remove`, `add`, `re-add`).
        action: &'static str,
        /// The member (for `add`: the new device).
        member: String,
        /// The array's name.
        array: String,
        /// Why.
        source: Box<Error>,
    },

    /// A new member or spare is smaller than a member's data.
    #[error(
        "'{device}' has {size_bytes} bytes; a member of '{array}' needs at least {need_bytes} (add size= to create or grow a file)"
    )]
    TooSmall {
        /// The new device.
        device: String,
        /// The array's name.
        array: String,
        /// Its size.
        size_bytes: u64,
        /// What a member needs: its metadata area and its share of the data.
        need_bytes: u64,
    },
    /// A new member or spare has larger blocks than the array.
    #[error(
        "'{device}' has {block_bytes}-byte blocks; '{array}' uses {array_block_bytes}-byte blocks"
    )]
    BlocksTooLarge {
        /// The new device.
        device: String,
        /// The array's name.
        array: String,
        /// Its logical block size.
        block_bytes: u64,
        /// The array's.
        array_block_bytes: u64,
    },
    /// A new member lacks an operation the array offers its clients.
    #[error("'{device}' cannot {}, which '{array}' offers its clients", lacks.join(" or "))]
    LacksCaps {
        /// The new device.
        device: String,
        /// The array's name.
        array: String,
        /// What it cannot do (`flush`, `fua`, `discard`, `write-zeroes`).
        lacks: Vec<&'static str>,
    },
    /// A new member or spare holds data and no superblock of this array: it may be
    /// someone's data, so nothing is written to it.
    #[error(
        "'{device}' holds data but no superblock of this array ({}it may be someone's data): {}",
        found.as_ref().map(|f| format!("{f}; ")).unwrap_or_default(),
        WIPE
    )]
    HoldsData {
        /// The device.
        device: String,
        /// Where data was found, when cairn looked.
        found: Option<String>,
    },
    /// A new member or spare carries the superblock of another array.
    #[error(
        "'{device}' is a {} of another array ('{other}', {uuid}): {}",
        if *spare { "spare" } else { "member" },
        WIPE
    )]
    OtherArray {
        /// The device.
        device: String,
        /// It is that array's spare (else its member).
        spare: bool,
        /// That array's name.
        other: String,
        /// That array's UUID.
        uuid: String,
    },
    /// A new member reads back something else than was written (a null device).
    #[error("'{device}' does not keep what is written to it (a null device?)")]
    KeepsNoWrites {
        /// The device.
        device: String,
    },
    /// A device offered as a spare is a member of this array in use.
    #[error("'{device}' is member '{member}' of this array, in use: a spare is another device")]
    SpareInUse {
        /// The device.
        device: String,
        /// The member it is.
        member: String,
    },

    /// The array was only examined (a dry run): it changes nothing.
    #[error("examined only")]
    ExaminedOnly,
    /// A member position is not in a state the change of members takes, as the array's
    /// records have it (the caller names the member: see [`Error::Refused`]).
    #[error("it {0}")]
    Member(MemberIs),
    /// There is no member at this position.
    #[error("no such member")]
    NoPosition(usize),
    /// A device that was this member ran on without the array's other members: it holds
    /// writes the array never saw.
    #[error(
        "it ran on without the array's other members (events {member_events} ahead of the array's {array_events}): it holds writes this array never saw; clear its first 16 KiB to rebuild it from this array, or stop and assemble from it"
    )]
    RanOn {
        /// The event count of its superblock.
        member_events: u64,
        /// The array's.
        array_events: u64,
    },
    /// The member re-added did not take its own superblock (it is failed again).
    #[error("its superblock could not be written")]
    SuperblockNotTaken,
    /// The member was taken back by someone else meanwhile (the admin, or another try).
    #[error("taken back meanwhile")]
    TakenBack,
    /// A failed member could not be taken back: it stays failed.
    #[error("{0}: it stays failed")]
    StaysFailed(Box<Error>),

    /// A member's superblock I/O failed.
    #[error(
        "{}{doing} failed: {source}",
        device.as_ref().map(|d| format!("'{d}': ")).unwrap_or_default()
    )]
    Io {
        /// The device, when the message names it.
        device: Option<String>,
        /// What cairn was doing (`reading its superblocks`...).
        doing: &'static str,
        /// What the device answered.
        source: BlockingError,
    },

    /// A member holds data but no superblock, so the array does not start.
    #[error(
        "device '{array}': member '{member}' holds data but no cairn superblock ({why}); nothing was written. \
         If it is raw data meant to be used as it is (an array made before superblocks were the default, \
         or by another program), add metadata = \"none\" to [device.{array}]; to make a new array of it instead, \
         zero it first (a new file, or blkdiscard -z for a disk)"
    )]
    Foreign {
        /// The array's name.
        array: String,
        /// The member's name.
        member: String,
        /// What was found on it.
        why: String,
    },
    /// A member was taken out of the array (`remove`, `replace`): its data is out of date.
    #[error(
        "device '{array}': member '{member}' was taken out of the array at event {events} ({}): its data is out of date. \
         List the array's current members in the stack file (cairn serve updates it on a change when it can write it), \
         or name this position 'missing' to run without it",
        by.as_ref().map_or("removed".to_string(), |u| format!("replaced by member {u}"))
    )]
    Retired {
        /// The array's name.
        array: String,
        /// The member's name.
        member: String,
        /// The event at which it was taken out.
        events: u64,
        /// The UUID of the member that replaced it (`None`: removed).
        by: Option<String>,
    },
    /// Two members carry superblocks of different arrays.
    #[error("device '{array}': members '{member}' and '{other}' belong to different arrays ({uuid} and {other_uuid})")]
    DifferentArrays {
        /// The array's name.
        array: String,
        /// The member of the other array.
        member: String,
        /// A member of the array the newest superblock is of.
        other: String,
        /// The UUID of `member`'s array.
        uuid: String,
        /// The UUID of `other`'s.
        other_uuid: String,
    },
    /// A member's superblock records another layout than the stack file gives.
    #[error("device '{array}': member '{member}' belongs to a {found}, but the stack file makes a {want}")]
    LayoutDiffers {
        /// The array's name.
        array: String,
        /// The member's name.
        member: String,
        /// The layout its superblock records.
        found: String,
        /// The stack file's.
        want: String,
    },
    /// A member is listed at another position than its superblock records.
    #[error(
        "device '{array}': member '{member}' is member {recorded} of the array, but listed as member {listed}; \
         list the members in their order"
    )]
    OutOfOrder {
        /// The array's name.
        array: String,
        /// The member's name.
        member: String,
        /// Its position as recorded, from 1.
        recorded: u64,
        /// Its position in the stack file, from 1.
        listed: usize,
    },
    /// Two members carry the same member's superblock (a copy of one image).
    #[error("device '{array}': members '{first}' and '{second}' are the same member (a copy of one image?)")]
    SameMember {
        /// The array's name.
        array: String,
        /// The first of the two in the stack file.
        first: String,
        /// The second.
        second: String,
    },
    /// A member is a spare of another array.
    #[error(
        "device '{array}': member '{member}' is a spare of another array ({uuid}): zero it first to use it \
         (a new file, or blkdiscard -z for a disk)"
    )]
    OtherSpare {
        /// The array's name.
        array: String,
        /// The member's name.
        member: String,
        /// The other array's UUID.
        uuid: String,
    },
    /// Some data has no current copy on the members there are: too few members, or the
    /// ones holding it are stale, missing or failed.
    #[error(
        "device '{array}': cannot start: no current copy of some data (it lives on {}){}",
        holders.iter().map(|(m, s)| format!("'{m}' ({s})")).collect::<Vec<_>>().join(", "),
        if *created { "" } else { "; the members that hold it are stale, missing or failed" }
    )]
    NoCurrentCopy {
        /// The array's name.
        array: String,
        /// The members holding every copy of that data, and their states.
        holders: Vec<(String, &'static str)>,
        /// The array would be created now (every member blank or missing).
        created: bool,
    },

    /// Opening a device or a queue, or writing superblocks, failed as core reports it.
    #[error(transparent)]
    Core(#[from] cairn_core::Error),
}

/// What a member is, when that is why an action on it is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemberIs {
    /// Failed or missing already (`fail`).
    #[error("has failed already or is missing")]
    FailedAlready,
    /// Failed or missing, so it cannot be replaced: add a device in its place instead.
    #[error("has failed or is missing: add a new device in its place instead")]
    FailedOrMissing,
    /// Missing (removed) already (`remove`).
    #[error("is missing already")]
    MissingAlready,
    /// Missing (removed): add a device in its place (`re-add`).
    #[error("is missing (removed): add a device in its place")]
    Removed,
    /// In use and working: fail it first (`remove`).
    #[error("is in use: fail it first")]
    InUse,
    /// Working, so there is nothing to take back (`re-add`).
    #[error("has not failed")]
    NotFailed,
    /// A replacement is being built for it: wait for the replace to end.
    #[error("is being replaced: wait for the replace to end")]
    BeingReplaced,
    /// A replacement is being built for it already (`replace`).
    #[error("is being replaced already")]
    ReplacedAlready,
    /// Its device no longer holds its superblock of this array (`re-add`).
    #[error(
        "no longer holds its superblock of this array: it stays failed (add a new device in its place to rebuild it whole)"
    )]
    NotItsSuperblock,
}

impl Error {
    /// Whether the message begins with the device's name (`'NAME' has...`): a caller that
    /// names the device itself only when the message does not.
    pub fn names_device(&self) -> bool {
        matches!(
            self,
            Error::TooSmall { .. }
                | Error::BlocksTooLarge { .. }
                | Error::LacksCaps { .. }
                | Error::HoldsData { .. }
                | Error::OtherArray { .. }
                | Error::KeepsNoWrites { .. }
                | Error::SpareInUse { .. }
                | Error::Io {
                    device: Some(_),
                    ..
                }
        )
    }

    /// The error under the contexts ([`Error::Refused`], [`Error::StaysFailed`]) that wrap
    /// it: what a caller matches on to tell why an action was refused.
    pub fn cause(&self) -> &Error {
        match self {
            Error::Refused { source, .. } => source.cause(),
            Error::StaysFailed(e) => e.cause(),
            e => e,
        }
    }
}

impl From<Error> for cairn_core::Error {
    fn from(e: Error) -> cairn_core::Error {
        match e {
            Error::Core(e) => e,
            e => cairn_core::Error::Invalid(e.to_string()),
        }
    }
}

/// The hint a refusal of a failed or missing member ends with: the command to use instead.
fn add_hint(state: MemberIs, array: &str) -> String {
    match state {
        MemberIs::FailedOrMissing => format!(" (add {array} SPEC)"),
        _ => String::new(),
    }
}

/// The words an action refused on `member` of `array` begins with.
fn refused(action: &str, member: &str, array: &str) -> String {
    match action {
        "remove" => format!("cannot remove member '{member}' of '{array}'"),
        _ => format!("cannot {action} '{member}' to '{array}'"),
    }
}

/// Names, quoted and listed.
fn quoted(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
    quoted.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The words of a refusal wrapped by the action it refused are the admin's, and the
    /// kind under them is found by [`Error::cause`].
    #[test]
    fn a_refusal_names_the_action_and_keeps_its_cause() {
        let e = Error::Refused {
            action: "re-add",
            member: "a".into(),
            array: "m".into(),
            source: Box::new(Error::StaysFailed(Box::new(Error::SuperblockNotTaken))),
        };
        assert_eq!(
            e.to_string(),
            "cannot re-add 'a' to 'm': its superblock could not be written: it stays failed"
        );
        assert!(matches!(e.cause(), Error::SuperblockNotTaken));
        let e = Error::Refused {
            action: "remove",
            member: "a".into(),
            array: "m".into(),
            source: Box::new(Error::Member(MemberIs::MissingAlready)),
        };
        assert_eq!(
            e.to_string(),
            "cannot remove member 'a' of 'm': it is missing already"
        );
    }

    /// A device that may hold someone's data is refused with what was found, when cairn
    /// looked, and what to do; the message begins with its name.
    #[test]
    fn a_device_holding_data_is_refused_by_name() {
        let found = Error::HoldsData {
            device: "t".into(),
            found: Some("no superblock, and non-zero bytes at offset 0".into()),
        };
        assert_eq!(
            found.to_string(),
            "'t' holds data but no superblock of this array (no superblock, and non-zero bytes at offset 0; \
             it may be someone's data): zero it first to use it (a new file, or blkdiscard -z for a disk)"
        );
        let foreign = Error::HoldsData {
            device: "t".into(),
            found: None,
        };
        assert_eq!(
            foreign.to_string(),
            "'t' holds data but no superblock of this array (it may be someone's data): \
             zero it first to use it (a new file, or blkdiscard -z for a disk)"
        );
        assert!(found.names_device() && foreign.names_device());
        assert!(!Error::ExaminedOnly.names_device());
    }
}
