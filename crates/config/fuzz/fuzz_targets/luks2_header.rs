//! LUKS2 headers: both copies read, written again and read back, and opened when cheap.
//!
//! The body is `cairn_config::fuzz::luks::luks2_header` (`crypt::luks2::fuzz` in
//! cairn-services), shared with the stable test `tests/decoders_fuzz.rs`; its
//! documentation gives the input's layout. A broken rule panics, which libFuzzer reports
//! as a crash.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cairn_config::fuzz::luks::luks2_header(data);
});
