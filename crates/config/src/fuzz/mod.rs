//! Every fuzz target of cairn's on-disk formats, in one list. Each body lives beside the
//! format it decodes (`cairn_stacks::fuzz` for the array superblock, `cairn_services::fuzz`
//! for the thin pool, the bitmap store and LUKS); the pieces they share are
//! `cairn_core::fuzzing`'s. Not part of cairn's interface: it is public only so that the
//! cargo-fuzz targets (`crates/config/fuzz/`) and the stable test that runs the same
//! bodies (`tests/decoders_fuzz.rs`) can reach it, and hidden from the documentation.
//!
//! Each body takes arbitrary bytes and panics when a rule breaks: whatever decodes must
//! encode to bytes that decode to the same value (or reopen to the same state), and
//! nothing may panic, hang or allocate without bound on the way. It returns whether the
//! input decoded, so that the stable test can tell that the seeds still reach past the
//! decoders' first checks.
//!
//! Every input starts with a byte of flags. [`RESEAL`] makes the checksums again before
//! decoding: a mutated field then reaches the checks behind the checksum, as damaged
//! metadata written with a valid checksum would.

pub use cairn_core::fuzzing::{Target, RESEAL};
pub use cairn_services::fuzz::{dirty, luks, thin};
pub use cairn_stacks::fuzz as array;

/// Every target.
pub const TARGETS: &[Target] = &[
    Target {
        name: "array_superblock",
        run: array::superblock,
        seeds: array::seeds,
    },
    Target {
        name: "thin_superblock",
        run: thin::superblock,
        seeds: thin::superblock_seeds,
    },
    Target {
        name: "thin_log",
        run: thin::log,
        seeds: thin::log_seeds,
    },
    Target {
        name: "thin_checkpoint",
        run: thin::checkpoint,
        seeds: thin::checkpoint_seeds,
    },
    Target {
        name: "dirty_directory",
        run: dirty::directory,
        seeds: dirty::seeds,
    },
    Target {
        name: "luks1_header",
        run: luks::luks1,
        seeds: luks::luks1_seeds,
    },
    Target {
        name: "luks2_header",
        run: luks::luks2_header,
        seeds: luks::luks2_seeds,
    },
];
