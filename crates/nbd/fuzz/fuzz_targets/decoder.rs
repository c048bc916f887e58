//! Fuzzes the NBD decoders and the handshake state machine.
//!
//! The input is split into a handshake part (option headers and data, run through a
//! `Negotiator` over a small catalog) and a transmission part (request headers decoded
//! with `parse_request`, write payloads skipped by their length as the server does); see
//! `tests/driver/mod.rs`, which this target shares with `tests/decode.rs`, for the layout
//! and the rules checked. A broken rule panics, which libFuzzer reports as a crash.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/driver/mod.rs"]
mod driver;

fuzz_target!(|data: &[u8]| {
    driver::drive(data);
});
