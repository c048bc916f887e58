//! The thin pool's log: blocks decoded and encoded again, replayed, the records packed and replayed again, applied to a pool whose checkpoint must load back the same.
//!
//! The body is `cairn_config::fuzz::thin::log`, shared with the stable test `tests/decoders_fuzz.rs`; its
//! documentation gives the input's layout. A broken rule panics, which libFuzzer reports
//! as a crash.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cairn_config::fuzz::thin::log(data);
});
