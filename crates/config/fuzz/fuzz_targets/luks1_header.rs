//! LUKS1 headers: decoded, encoded and decoded again, and opened when cheap.
//!
//! The body is `cairn_config::fuzz::luks::luks1`, shared with the stable test `tests/decoders_fuzz.rs`; its
//! documentation gives the input's layout. A broken rule panics, which libFuzzer reports
//! as a crash.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cairn_config::fuzz::luks::luks1(data);
});
