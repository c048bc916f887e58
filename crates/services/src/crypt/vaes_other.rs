//! Where the target is not x86-64 there is no VAES cipher: [`Vaes::new`] says so, and
//! the callers keep the portable or AWS-LC path.

/// Never made: the stand-in for x86-64's VAES cipher on other targets.
pub(super) enum Vaes {}

impl Vaes {
    /// Never: no VAES on this target.
    pub(super) fn new(_key: &[u8]) -> Option<Vaes> {
        None
    }

    /// As on x86-64, so the callers read the same.
    pub(super) fn takes(_sector: usize) -> bool {
        false
    }

    /// Unreachable: no `Vaes` is ever made.
    pub(super) fn run(
        &self,
        _dst: &mut [u8],
        _src: Option<&[u8]>,
        _sector: usize,
        _iv: u64,
        _step: u64,
        _encrypt: bool,
    ) {
        match *self {}
    }
}
