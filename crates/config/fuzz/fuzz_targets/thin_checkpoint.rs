//! The thin pool's checkpoints: pages loaded into a pool state, whose own checkpoint must load back the same.
//!
//! The body is `cairn_config::fuzz::thin::checkpoint`, shared with the stable test `tests/decoders_fuzz.rs`; its
//! documentation gives the input's layout. A broken rule panics, which libFuzzer reports
//! as a crash.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cairn_config::fuzz::thin::checkpoint(data);
});
