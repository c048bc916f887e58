//! What the admin does to a running array that keeps state on its members (`fail`,
//! `remove`, `re-add`, `add`, `replace`), as a capability: the device offers
//! [`ArrayAdmin`], and the admin asks for it with `device.capability::<dyn ArrayAdmin>()`.
//! A refusal is a [`crate::Error`], so that the admin's reply can be built from what
//! went wrong; what an array reports of itself is core's [`cairn_core::Array`].

use crate::Error;

/// An array whose members the admin can change while it runs.
pub trait ArrayAdmin: Send + Sync {
    /// Does `action`: what was done, one or more lines, or why not (then nothing was).
    fn act(&self, action: &ArrayAction) -> Result<String, Error>;
}

/// What the admin does to an array that keeps state on its members.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArrayAction {
    /// Mark `member` failed (never the last current copy of any data).
    Fail {
        /// The member's name.
        member: String,
    },
    /// Record failed `member` as missing, and close it.
    Remove {
        /// The member's name.
        member: String,
    },
    /// Take failed `member` back once its device answers again.
    ReAdd {
        /// The member's name.
        member: String,
    },
    /// A new device, opened from `spec`, in place of a missing or failed member (a spare
    /// when none is).
    Add {
        /// The device's spec (`file:PATH[,size=N]`).
        spec: String,
    },
    /// Build a new device, opened from `spec`, from the array while `old` keeps working,
    /// then swap it in for `old`.
    Replace {
        /// The member replaced.
        old: String,
        /// The new device's spec.
        spec: String,
    },
}

impl ArrayAction {
    /// Its name, as the admin types it.
    pub fn name(&self) -> &'static str {
        match self {
            ArrayAction::Fail { .. } => "fail",
            ArrayAction::Remove { .. } => "remove",
            ArrayAction::ReAdd { .. } => "re-add",
            ArrayAction::Add { .. } => "add",
            ArrayAction::Replace { .. } => "replace",
        }
    }
}
