//! AES-XTS (plain64) over many sectors per call with VAES on 256-bit registers, for
//! x86-64 CPUs that have VAES, VPCLMULQDQ and AVX2, with or without AVX-512.
//!
//! Each call ciphers a run of whole sectors. The sectors' first tweaks are encrypted 16
//! at a time (eight registers of two blocks); each sector is then ciphered 16 blocks at a
//! time, its tweaks held two to a register and carried to the next 16 blocks by a
//! multiplication by x^16 in GF(2^128) (shifts and one carry-less multiplication per
//! register), so 16 independent blocks are in the AES units at once and nothing is
//! written between the whitening and the rounds. This is the layout of Linux's
//! VAES-AVX2 XTS for one message, applied across the sectors of a request; the code here
//! is cairn's own. What it is not: a general block cipher (the key schedule is private to
//! XTS), nor used on CPUs without these features (see [`Vaes::new`]).
//!
//! `unsafe` here: the calls into the `#[target_feature]` functions (made only after the
//! features were detected at run time) and the unaligned 32-byte loads and stores, each
//! from a reference to exactly 32 bytes.

use std::arch::x86_64::*;

use zeroize::Zeroize;

/// Round keys of one AES key, 16 bytes each: 11 used for AES-128, 15 for AES-256.
type RoundKeys = [[u8; 16]; 15];

/// The same round keys, each in both halves of a 256-bit register.
type Wide = [__m256i; 15];

/// Blocks ciphered together, two per register in eight registers.
const GROUP_BYTES: usize = 256;
/// Sectors whose first tweaks are encrypted together (two per register).
const TWEAK_BATCH: usize = 16;

/// The three key schedules of one XTS key, zeroed when dropped.
struct Keys {
    /// The data key's encryption schedule.
    enc: RoundKeys,
    /// The data key's schedule for the equivalent inverse cipher (AESDEC).
    dec: RoundKeys,
    /// The tweak key's encryption schedule.
    tweak: RoundKeys,
}

impl Drop for Keys {
    fn drop(&mut self) {
        self.enc.zeroize();
        self.dec.zeroize();
        self.tweak.zeroize();
    }
}

/// AES-XTS under one key, on a CPU that has the instructions (checked by [`Vaes::new`]).
pub(super) struct Vaes {
    /// AES rounds: 10 (AES-128) or 14 (AES-256).
    rounds: usize,
    keys: Box<Keys>,
}

impl Vaes {
    /// Whether this CPU has what the code here runs on.
    pub(super) fn available() -> bool {
        is_x86_feature_detected!("aes")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("vaes")
            && is_x86_feature_detected!("vpclmulqdq")
    }

    /// The cipher for an XTS `key` (32 bytes: AES-128; 64: AES-256), or `None` when the
    /// CPU lacks VAES, VPCLMULQDQ, AVX2 or AES-NI, or the key is another length.
    pub(super) fn new(key: &[u8]) -> Option<Vaes> {
        if !Self::available() {
            return None;
        }
        let half = key.len() / 2;
        let (data, tweak) = key.split_at(half);
        let mut keys = Box::new(Keys {
            enc: [[0; 16]; 15],
            dec: [[0; 16]; 15],
            tweak: [[0; 16]; 15],
        });
        let rounds = match key.len() {
            32 => 10,
            64 => 14,
            _ => return None,
        };
        // SAFETY: `available` found AES-NI on this CPU, all the expansion uses.
        unsafe {
            expand(data, &mut keys.enc);
            expand(tweak, &mut keys.tweak);
            inverse(&keys.enc, rounds, &mut keys.dec);
        }
        Some(Vaes { rounds, keys })
    }

    /// Whether sectors of `sector` bytes go through here: any multiple of 32 bytes (two
    /// blocks, one register); sectors of an odd number of blocks do not.
    pub(super) fn takes(sector: usize) -> bool {
        sector >= 32 && sector.is_multiple_of(32)
    }

    /// Ciphers `dst` (whole `sector`-byte sectors, taken from `src` when given, else in
    /// place), the first sector's IV `iv` and each next one's `step` more, modulo 2^64.
    pub(super) fn run(
        &self,
        dst: &mut [u8],
        src: Option<&[u8]>,
        sector: usize,
        iv: u64,
        step: u64,
        encrypt: bool,
    ) {
        assert!(Self::takes(sector) && dst.len().is_multiple_of(sector));
        assert!(src.is_none_or(|s| s.len() == dst.len()));
        let k = &self.keys;
        // SAFETY: a `Vaes` exists only where `new` found AES-NI, AVX2, VAES and
        // VPCLMULQDQ on this CPU, all that these functions enable.
        unsafe {
            match (self.rounds, encrypt) {
                (10, true) => sectors::<10, true>(&k.enc, &k.tweak, dst, src, sector, iv, step),
                (10, false) => sectors::<10, false>(&k.dec, &k.tweak, dst, src, sector, iv, step),
                (_, true) => sectors::<14, true>(&k.enc, &k.tweak, dst, src, sector, iv, step),
                (_, false) => sectors::<14, false>(&k.dec, &k.tweak, dst, src, sector, iv, step),
            }
        }
    }
}

/// Ciphers whole sectors (see [`Vaes::run`]) with `NR` rounds, encrypting when `ENC`
/// (with the `data` schedule for that direction; the tweaks with `tweak`'s).
#[target_feature(enable = "aes,avx2,vaes,vpclmulqdq")]
fn sectors<const NR: usize, const ENC: bool>(
    data: &RoundKeys,
    tweak: &RoundKeys,
    dst: &mut [u8],
    src: Option<&[u8]>,
    sector: usize,
    mut iv: u64,
    step: u64,
) {
    let mut rk = widen::<NR>(data);
    let mut tk = widen::<NR>(tweak);
    let batch = TWEAK_BATCH * sector;
    for (i, d) in dst.chunks_mut(batch).enumerate() {
        let n = d.len() / sector;
        let first = first_tweaks::<NR>(&tk, iv, step);
        iv = iv.wrapping_add(step.wrapping_mul(n as u64));
        let s = src.map(|s| &s[i * batch..][..d.len()]);
        for (k, out) in d.chunks_exact_mut(sector).enumerate() {
            let from = s.map(|s| &s[k * sector..][..sector]);
            one_sector::<NR, ENC>(&rk, first[k], out, from);
        }
    }
    // The round keys' copies on the stack are key material too.
    rk.zeroize();
    tk.zeroize();
}

/// Ciphers one sector whose first tweak is `t0`: 16 blocks at a time, then the rest two
/// at a time.
#[target_feature(enable = "aes,avx2,vaes,vpclmulqdq")]
fn one_sector<const NR: usize, const ENC: bool>(
    rk: &Wide,
    t0: __m128i,
    out: &mut [u8],
    from: Option<&[u8]>,
) {
    let mut tw = first_group(t0);
    let (groups, tail) = out.as_chunks_mut::<GROUP_BYTES>();
    let tail_at = groups.len() * GROUP_BYTES;
    for (g, o) in groups.iter_mut().enumerate() {
        let blocks = match from {
            Some(s) => load8(&s[g * GROUP_BYTES..][..GROUP_BYTES]),
            None => load8(o),
        };
        store8(o, group::<NR, ENC>(rk, &tw, blocks));
        for t in &mut tw {
            *t = times_x(*t, 16);
        }
    }
    // A sector of fewer than 16 blocks left (only in sectors that are not a multiple of
    // 256 bytes): the tweaks of this group cover it, two blocks to a register.
    let (pairs, rest) = tail.as_chunks_mut::<32>();
    debug_assert!(rest.is_empty() && pairs.len() < tw.len());
    let from_pairs = from.map(|s| s[tail_at..].as_chunks::<32>().0);
    for (j, o) in pairs.iter_mut().enumerate() {
        let b = match from_pairs {
            Some(s) => load(&s[j]),
            None => load(o),
        };
        store(o, one_pair::<NR, ENC>(rk, tw[j], b));
    }
}

/// The tweaks of a sector's first 16 blocks from its first, `t0`: register j holds
/// blocks 2j and 2j + 1 (the lower address in the lower half, as a load puts them).
#[target_feature(enable = "avx2,vpclmulqdq")]
fn first_group(t0: __m128i) -> [__m256i; 8] {
    let both = _mm256_broadcastsi128_si256(t0);
    let pair = _mm256_blend_epi32::<0xf0>(both, times_x(both, 1));
    [
        pair,
        times_x(pair, 2),
        times_x(pair, 4),
        times_x(pair, 6),
        times_x(pair, 8),
        times_x(pair, 10),
        times_x(pair, 12),
        times_x(pair, 14),
    ]
}

/// Each half of `v` (a tweak, as a little-endian 128-bit number) times x^k in
/// GF(2^128) mod x^128 + x^7 + x^2 + x + 1, for k in 1..64: a shift left by k, and the
/// k bits shifted out of the top folded back in as their carry-less product with 0x87.
#[target_feature(enable = "avx2,vpclmulqdq")]
fn times_x(v: __m256i, k: i32) -> __m256i {
    debug_assert!((1..64).contains(&k));
    let shifted = _mm256_sll_epi64(v, _mm_cvtsi32_si128(k));
    let carries = _mm256_srl_epi64(v, _mm_cvtsi32_si128(64 - k));
    // The low word's carry moves into the high word of the same half; the high word's
    // leaves the 128 bits and comes back reduced.
    let into_high = _mm256_slli_si256::<8>(carries);
    let out_top = _mm256_srli_si256::<8>(carries);
    let reduced = _mm256_clmulepi64_epi128::<0x00>(out_top, _mm256_set1_epi64x(0x87));
    _mm256_xor_si256(_mm256_xor_si256(shifted, into_high), reduced)
}

/// The first tweaks of 16 sectors whose IVs count from `iv` in steps of `step` (modulo
/// 2^64): their IVs (plain64: the number in the first 8 bytes, little-endian, zeros
/// after) encrypted under the tweak key, eight registers at once.
#[target_feature(enable = "aes,avx2,vaes,vpclmulqdq")]
fn first_tweaks<const NR: usize>(tk: &Wide, iv: u64, step: u64) -> [__m128i; TWEAK_BATCH] {
    let mut blocks = [_mm256_setzero_si256(); 8];
    for (j, b) in blocks.iter_mut().enumerate() {
        let a = iv.wrapping_add(step.wrapping_mul(2 * j as u64));
        let next = a.wrapping_add(step);
        *b = _mm256_set_epi64x(0, next as i64, 0, a as i64);
    }
    let zero = [_mm256_setzero_si256(); 8];
    let enc = group::<NR, true>(tk, &zero, blocks);
    let mut out = [_mm_setzero_si128(); TWEAK_BATCH];
    for (j, e) in enc.iter().enumerate() {
        out[2 * j] = _mm256_castsi256_si128(*e);
        out[2 * j + 1] = _mm256_extracti128_si256::<1>(*e);
    }
    out
}

/// Sixteen blocks through XTS: each whitened with its tweak, ciphered, whitened again.
/// The final whitening rides on the last round's key (the last round ends with the XOR
/// of its key, so XORing the tweak into that key is the same). Never inlined: inlined
/// into the sector loop, LLVM ran seven registers' rounds together and the eighth's
/// fourteen after them, one dependent chain; alone it interleaves all eight (a 512-byte
/// sector's writes 3424 -> 4544 MB/s in the example `xts_speed`).
#[inline(never)]
#[target_feature(enable = "aes,avx2,vaes")]
fn group<const NR: usize, const ENC: bool>(
    rk: &Wide,
    tw: &[__m256i; 8],
    blocks: [__m256i; 8],
) -> [__m256i; 8] {
    let mut b = blocks;
    for (x, t) in b.iter_mut().zip(tw) {
        *x = _mm256_xor_si256(*x, _mm256_xor_si256(*t, rk[0]));
    }
    for key in &rk[1..NR] {
        for x in &mut b {
            *x = if ENC {
                _mm256_aesenc_epi128(*x, *key)
            } else {
                _mm256_aesdec_epi128(*x, *key)
            };
        }
    }
    for (x, t) in b.iter_mut().zip(tw) {
        let last = _mm256_xor_si256(rk[NR], *t);
        *x = if ENC {
            _mm256_aesenclast_epi128(*x, last)
        } else {
            _mm256_aesdeclast_epi128(*x, last)
        };
    }
    b
}

/// Two blocks through XTS, as [`group`] does sixteen.
#[target_feature(enable = "aes,avx2,vaes")]
fn one_pair<const NR: usize, const ENC: bool>(rk: &Wide, tw: __m256i, b: __m256i) -> __m256i {
    let mut x = _mm256_xor_si256(b, _mm256_xor_si256(tw, rk[0]));
    for key in &rk[1..NR] {
        x = if ENC {
            _mm256_aesenc_epi128(x, *key)
        } else {
            _mm256_aesdec_epi128(x, *key)
        };
    }
    let last = _mm256_xor_si256(rk[NR], tw);
    if ENC {
        _mm256_aesenclast_epi128(x, last)
    } else {
        _mm256_aesdeclast_epi128(x, last)
    }
}

/// The first `NR + 1` round keys, each broadcast to both halves of a register.
#[target_feature(enable = "avx2")]
fn widen<const NR: usize>(keys: &RoundKeys) -> Wide {
    let mut w = [_mm256_setzero_si256(); 15];
    for (w, k) in w.iter_mut().zip(&keys[..=NR]) {
        *w = _mm256_broadcastsi128_si256(load16(k));
    }
    w
}

/// 32 bytes as a register.
#[target_feature(enable = "avx2")]
fn load(b: &[u8; 32]) -> __m256i {
    // SAFETY: `b` is 32 readable bytes; the load has no alignment requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// A register into 32 bytes.
#[target_feature(enable = "avx2")]
fn store(b: &mut [u8; 32], v: __m256i) {
    // SAFETY: `b` is 32 writable bytes; the store has no alignment requirement.
    unsafe { _mm256_storeu_si256(b.as_mut_ptr().cast(), v) }
}

/// 256 bytes (a slice of exactly that length) as eight registers.
#[target_feature(enable = "avx2")]
fn load8(b: &[u8]) -> [__m256i; 8] {
    let (pairs, _) = b.as_chunks::<32>();
    debug_assert_eq!(pairs.len(), 8);
    let mut v = [_mm256_setzero_si256(); 8];
    for (v, p) in v.iter_mut().zip(pairs) {
        *v = load(p);
    }
    v
}

/// Eight registers into 256 bytes.
#[target_feature(enable = "avx2")]
fn store8(b: &mut [u8; GROUP_BYTES], v: [__m256i; 8]) {
    let (pairs, _) = b.as_chunks_mut::<32>();
    for (p, v) in pairs.iter_mut().zip(v) {
        store(p, v);
    }
}

/// 16 bytes as a register.
fn load16(b: &[u8; 16]) -> __m128i {
    // SAFETY: `b` is 16 readable bytes; the load has no alignment requirement (and SSE2
    // is part of x86-64).
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

/// A register into 16 bytes.
fn store16(b: &mut [u8; 16], v: __m128i) {
    // SAFETY: `b` is 16 writable bytes; the store has no alignment requirement.
    unsafe { _mm_storeu_si128(b.as_mut_ptr().cast(), v) }
}

/// The encryption schedule of an AES key of 16 or 32 bytes into `out` (11 or 15 round
/// keys), with AES-NI's key generation assist.
#[target_feature(enable = "aes")]
fn expand(key: &[u8], out: &mut RoundKeys) {
    if let Ok(k) = <&[u8; 16]>::try_from(key) {
        expand128(k, out);
    } else if let Ok(k) = <&[u8; 32]>::try_from(key) {
        expand256(k, out);
    }
}

/// One step of the schedule: each word of `k` XORed with all the words before it, then
/// with `assist`'s word chosen by the caller's shuffle (in every lane).
#[target_feature(enable = "aes")]
fn schedule_step(k: __m128i, assist: __m128i) -> __m128i {
    let mut k = k;
    let mut s = _mm_slli_si128::<4>(k);
    k = _mm_xor_si128(k, s);
    s = _mm_slli_si128::<4>(s);
    k = _mm_xor_si128(k, s);
    s = _mm_slli_si128::<4>(s);
    k = _mm_xor_si128(k, s);
    _mm_xor_si128(k, assist)
}

/// AES-128's 11 round keys (FIPS 197 5.2: round constants 01 to 36).
#[target_feature(enable = "aes")]
fn expand128(key: &[u8; 16], out: &mut RoundKeys) {
    let mut k = load16(key);
    store16(&mut out[0], k);
    macro_rules! round {
        ($i:expr, $rcon:literal) => {
            let a = _mm_shuffle_epi32::<0xff>(_mm_aeskeygenassist_si128::<$rcon>(k));
            k = schedule_step(k, a);
            store16(&mut out[$i], k);
        };
    }
    round!(1, 0x01);
    round!(2, 0x02);
    round!(3, 0x04);
    round!(4, 0x08);
    round!(5, 0x10);
    round!(6, 0x20);
    round!(7, 0x40);
    round!(8, 0x80);
    round!(9, 0x1b);
    round!(10, 0x36);
}

/// AES-256's 15 round keys: each even one from the one two before and the rotated,
/// substituted last word of the one before (with a round constant); each odd one the
/// same without rotation or constant.
#[target_feature(enable = "aes")]
fn expand256(key: &[u8; 32], out: &mut RoundKeys) {
    let (lo, hi) = key.split_at(16);
    let mut even = load16(lo.try_into().expect("16 of 32 bytes"));
    let mut odd = load16(hi.try_into().expect("16 of 32 bytes"));
    store16(&mut out[0], even);
    store16(&mut out[1], odd);
    macro_rules! even {
        ($i:expr, $rcon:literal) => {
            let a = _mm_shuffle_epi32::<0xff>(_mm_aeskeygenassist_si128::<$rcon>(odd));
            even = schedule_step(even, a);
            store16(&mut out[$i], even);
        };
    }
    macro_rules! odd {
        ($i:expr) => {
            let b = _mm_shuffle_epi32::<0xaa>(_mm_aeskeygenassist_si128::<0>(even));
            odd = schedule_step(odd, b);
            store16(&mut out[$i], odd);
        };
    }
    even!(2, 0x01);
    odd!(3);
    even!(4, 0x02);
    odd!(5);
    even!(6, 0x04);
    odd!(7);
    even!(8, 0x08);
    odd!(9);
    even!(10, 0x10);
    odd!(11);
    even!(12, 0x20);
    odd!(13);
    even!(14, 0x40);
}

/// The schedule of the equivalent inverse cipher (FIPS 197 5.3.5) from the encryption
/// schedule `enc` of `rounds` rounds: the keys in reverse order, InvMixColumns applied to
/// all but the first and last.
#[target_feature(enable = "aes")]
fn inverse(enc: &RoundKeys, rounds: usize, out: &mut RoundKeys) {
    out[0] = enc[rounds];
    for i in 1..rounds {
        store16(&mut out[i], _mm_aesimc_si128(load16(&enc[rounds - i])));
    }
    out[rounds] = enc[0];
}
