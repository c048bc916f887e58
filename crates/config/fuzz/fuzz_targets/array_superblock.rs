//! The array superblock: two slots picked, each decoded, what decodes encoded and decoded again.
//!
//! The body is `cairn_config::fuzz::array::superblock`, shared with the stable test `tests/decoders_fuzz.rs`; its
//! documentation gives the input's layout. A broken rule panics, which libFuzzer reports
//! as a crash.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cairn_config::fuzz::array::superblock(data);
});
