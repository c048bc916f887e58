//! The crypt device's ciphers alone, on one core: MB/s (10^6 bytes) of writes (encrypted
//! from one buffer into another, as a write's bounce buffer is) and reads (decrypted in
//! place) of 4 KiB and 128 KiB requests, with 512- and 4096-byte sectors, through the
//! VAES cipher (where the CPU has it), AWS-LC's and the portable one. A measurement, not
//! a test: run it alone, `cargo run --release -p cairn-services --example xts_speed
//! [SECONDS_EACH]`, and compare with `openssl speed -evp aes-256-xts -bytes N`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_services::crypt::evp::Cipher;
use cairn_services::crypt::xts::Xts;

/// Bytes per second of `op` on `len`-byte requests, run for about `secs`.
fn rate(secs: f64, len: usize, mut op: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut done = 0u64;
    while start.elapsed() < Duration::from_secs_f64(secs) {
        for _ in 0..64 {
            op();
        }
        done += 64 * len as u64;
    }
    done as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
    let vaes = Arc::new(Xts::new(&key).expect("a 64-byte key"));
    let portable = Arc::new(Xts::portable(&key).expect("a 64-byte key"));
    let aws_lc = Cipher::new(portable.clone(), &key, true);
    let ciphers: [(&str, Cipher); 3] = [
        ("vaes", Cipher::new(vaes.clone(), &key, true)),
        ("aws-lc", aws_lc),
        ("portable", Cipher::new(portable, &key, false)),
    ];
    println!("vaes in use: {}", vaes.is_vaes());
    println!("| cipher | sector | request | write MB/s | read MB/s |");
    println!("|---|---|---|---|---|");
    for sector in [512usize, 4096] {
        for len in [4096usize, 128 << 10] {
            let plain = vec![0x5au8; len];
            let mut buf = vec![0u8; len];
            for (name, c) in &ciphers {
                let w = rate(secs, len, || c.encrypt_from(&plain, &mut buf, sector, 1000));
                let r = rate(secs, len, || c.run(&mut buf, sector, 1000, false));
                println!(
                    "| {name} | {sector} | {} KiB | {:.0} | {:.0} |",
                    len >> 10,
                    w / 1e6,
                    r / 1e6
                );
            }
        }
    }
}
