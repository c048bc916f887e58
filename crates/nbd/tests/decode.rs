//! Robustness of the NBD decoders and the handshake state machine.
//!
//! - `parse_request` on any bytes: Incomplete, BadMagic, or a request that re-encodes to
//!   the header it came from.
//! - `parse_info_request` / `parse_meta_request` on any bytes (raw, and valid encodings
//!   cut, extended, bit-flipped or with a lying length): whatever they accept re-encodes
//!   to exactly the input, and valid encodings within the limits are accepted.
//! - Random option sequences through a `Negotiator` under every TLS mode and catalog:
//!   the rules of `driver::Checker` (well-formed replies echoing the option, Go only
//!   after an ACK to GO or for EXPORT_NAME, nothing acknowledged before TLS when TLS is
//!   required, `base_allocation` only with structured replies, ...).
//! - The fuzz target's driver (`driver::drive`, shared with `fuzz/`) on a few thousand
//!   random inputs, so CI runs it on stable.
//! - Fixed edge cases: names ending exactly at the data end, 4096- and 4097-byte names,
//!   zero queries.

use cairn_nbd::proto::{
    self, cmd, info, opt, parse_info_request, parse_meta_request, parse_request, rep, Decoded,
    InfoRequest, MetaRequest, OptionHeader, Request,
};
use cairn_nbd::server::handshake::{Catalog, Negotiator, Step, TlsMode};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};

mod driver;
use driver::{Checker, MAX_META_QUERIES};

fn config(cases: u32) -> Config {
    Config {
        cases,
        // Failures are printed with their minimal case; nothing is written to the tree.
        failure_persistence: None,
        ..Config::default()
    }
}

// ---------------------------------------------------------------------------------
// Encoders (the inverse of the decoders under test).

fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
}

/// INFO/GO data from raw parts (names need not be UTF-8 or short enough).
fn info_data(name: &[u8], items: &[u16]) -> Vec<u8> {
    let mut d = Vec::new();
    put_string(&mut d, name);
    d.extend_from_slice(&(items.len() as u16).to_be_bytes());
    for i in items {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

fn encode_info(r: &InfoRequest<'_>) -> Vec<u8> {
    info_data(r.name.as_bytes(), &r.items)
}

/// LIST_META_CONTEXT/SET_META_CONTEXT data from raw parts.
fn meta_data(name: &[u8], queries: &[Vec<u8>]) -> Vec<u8> {
    let mut d = Vec::new();
    put_string(&mut d, name);
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        put_string(&mut d, q);
    }
    d
}

fn encode_meta(r: &MetaRequest<'_>) -> Vec<u8> {
    let q: Vec<Vec<u8>> = r.queries.iter().map(|q| q.as_bytes().to_vec()).collect();
    meta_data(r.name.as_bytes(), &q)
}

fn header(option: u32, data: &[u8]) -> OptionHeader {
    OptionHeader {
        option,
        len: data.len() as u32,
    }
}

// ---------------------------------------------------------------------------------
// Strategies.

/// Names: every catalog's, unknown ones, the longest allowed, one byte too long, not
/// UTF-8, multi-byte UTF-8.
fn name() -> impl Strategy<Value = Vec<u8>> {
    let mut pool: Vec<Vec<u8>> = driver::catalog_names()
        .into_iter()
        .map(String::into_bytes)
        .collect();
    pool.extend([
        b"".to_vec(),
        b"nope".to_vec(),
        "x".repeat(4095).into_bytes(),
        "x".repeat(4097).into_bytes(),
        vec![0xff, 0xfe],
        "é".as_bytes().to_vec(),
        b"a\0".to_vec(),
    ]);
    prop_oneof![
        8 => proptest::sample::select(pool),
        1 => vec(any::<u8>(), 0..6),
    ]
}

fn query() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => Just(proto::BASE_ALLOCATION.as_bytes().to_vec()),
        2 => Just(b"base:".to_vec()),
        1 => Just(b"base:other".to_vec()),
        1 => Just(b"qemu:dirty-bitmap:x".to_vec()),
        1 => Just(Vec::new()),
        1 => Just("q".repeat(4097).into_bytes()),
        1 => vec(any::<u8>(), 0..8),
    ]
}

fn queries() -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop_oneof![
        8 => vec(query(), 0..4),
        // Just over the negotiator's limit.
        1 => Just(vec![proto::BASE_ALLOCATION.as_bytes().to_vec(); MAX_META_QUERIES + 1]),
    ]
}

fn items() -> impl Strategy<Value = Vec<u16>> {
    vec(
        prop_oneof![
            4 => 0u16..4,
            1 => any::<u16>(),
        ],
        0..5,
    )
}

/// Data options that take none usually get none.
fn garbage() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![4 => Just(Vec::new()), 1 => vec(any::<u8>(), 1..8)]
}

/// One option request: an option code and its data.
#[derive(Debug, Clone)]
enum Op {
    Option(u32, Vec<u8>),
    /// The server starts shutting down before the next option.
    ShutDown,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u32..=12, vec(any::<u8>(), 0..24)).prop_map(|(o, d)| Op::Option(o, d)),
        4 => (name(), items()).prop_map(|(n, i)| Op::Option(opt::GO, info_data(&n, &i))),
        2 => (name(), items()).prop_map(|(n, i)| Op::Option(opt::INFO, info_data(&n, &i))),
        1 => garbage().prop_map(|d| Op::Option(opt::LIST, d)),
        3 => garbage().prop_map(|d| Op::Option(opt::STRUCTURED_REPLY, d)),
        2 => garbage().prop_map(|d| Op::Option(opt::EXTENDED_HEADERS, d)),
        3 => (name(), queries())
            .prop_map(|(n, q)| Op::Option(opt::SET_META_CONTEXT, meta_data(&n, &q))),
        1 => (name(), queries())
            .prop_map(|(n, q)| Op::Option(opt::LIST_META_CONTEXT, meta_data(&n, &q))),
        2 => garbage().prop_map(|d| Op::Option(opt::STARTTLS, d)),
        1 => garbage().prop_map(|d| Op::Option(opt::ABORT, d)),
        1 => prop_oneof![known_name(), name()].prop_map(|n| Op::Option(opt::EXPORT_NAME, n)),
        1 => Just(Op::ShutDown),
    ]
}

/// Known export names only.
fn known_name() -> impl Strategy<Value = Vec<u8>> {
    let mut pool: Vec<Vec<u8>> = driver::catalog_names()
        .into_iter()
        .map(String::into_bytes)
        .collect();
    pool.push(Vec::new());
    proptest::sample::select(pool)
}

/// A sequence of options: single random ones, and the recipe that selects
/// `base:allocation` (STRUCTURED_REPLY, SET_META_CONTEXT, GO) with random slips.
fn ops(max: usize) -> impl Strategy<Value = Vec<Op>> {
    let recipe = (
        known_name(),
        known_name(),
        queries(),
        items(),
        any::<bool>(),
    )
        .prop_map(|(set, go, mut q, i, base)| {
            if base {
                q.push(proto::BASE_ALLOCATION.as_bytes().to_vec());
            }
            vec![
                Op::Option(opt::STRUCTURED_REPLY, Vec::new()),
                Op::Option(opt::SET_META_CONTEXT, meta_data(&set, &q)),
                Op::Option(opt::GO, info_data(&go, &i)),
            ]
        });
    vec(
        prop_oneof![
            6 => op().prop_map(|o| vec![o]),
            1 => recipe,
        ],
        0..max,
    )
    .prop_map(|v| v.concat())
}

fn tls_mode() -> impl Strategy<Value = TlsMode> {
    prop_oneof![
        Just(TlsMode::Off),
        Just(TlsMode::Optional),
        Just(TlsMode::Required)
    ]
}

/// Changes to a valid encoding that mostly make it invalid.
#[derive(Debug, Clone)]
enum Mutation {
    None,
    Truncate(prop::sample::Index),
    Append(u8),
    Flip(prop::sample::Index, u8),
    /// Overwrite the leading name length.
    NameLen(u32),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        2 => Just(Mutation::None),
        1 => any::<prop::sample::Index>().prop_map(Mutation::Truncate),
        1 => any::<u8>().prop_map(Mutation::Append),
        2 => (any::<prop::sample::Index>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        1 => prop_oneof![Just(0), Just(4096), Just(4097), Just(u32::MAX), 0u32..32]
            .prop_map(Mutation::NameLen),
    ]
}

fn mutate(mut d: Vec<u8>, m: &Mutation) -> Vec<u8> {
    match m {
        Mutation::None => {}
        Mutation::Truncate(i) => d.truncate(i.index(d.len() + 1)),
        Mutation::Append(b) => d.push(*b),
        Mutation::Flip(i, bit) => {
            if !d.is_empty() {
                let i = i.index(d.len());
                d[i] ^= 1 << bit;
            }
        }
        Mutation::NameLen(n) => {
            if d.len() >= 4 {
                d[..4].copy_from_slice(&n.to_be_bytes());
            }
        }
    }
    d
}

fn request_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 0..64),
        vec(any::<u8>(), 0..60).prop_map(|v| {
            let mut b = proto::REQUEST_MAGIC.to_be_bytes().to_vec();
            b.extend(v);
            b
        }),
    ]
}

fn any_request() -> impl Strategy<Value = Request> {
    (
        any::<u16>(),
        any::<u16>(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
    )
        .prop_map(|(flags, command, cookie, offset, len)| Request {
            flags,
            command,
            cookie,
            offset,
            len: u64::from(len),
        })
}

// ---------------------------------------------------------------------------------
// (a) and (b): the pure decoders.

fn check_info(d: &[u8]) -> Result<(), TestCaseError> {
    if let Some(r) = parse_info_request(d) {
        prop_assert!(r.name.len() <= 4096);
        prop_assert_eq!(encode_info(&r), d);
    }
    Ok(())
}

fn check_meta(d: &[u8], max: usize) -> Result<(), TestCaseError> {
    if let Some(r) = parse_meta_request(d, max) {
        prop_assert!(r.queries.len() <= max);
        prop_assert!(r.name.len() <= 4096 && r.queries.iter().all(|q| q.len() <= 4096));
        prop_assert_eq!(encode_meta(&r), d);
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(2048))]

    #[test]
    fn parse_request_is_incomplete_bad_magic_or_round_trips(b in request_bytes()) {
        match parse_request(&b) {
            Decoded::Incomplete => prop_assert!(b.len() < proto::REQUEST_HEADER),
            Decoded::BadMagic(m) => {
                prop_assert!(b.len() >= proto::REQUEST_HEADER);
                prop_assert_eq!(&m.to_be_bytes()[..], &b[..4]);
                prop_assert_ne!(m, proto::REQUEST_MAGIC);
            }
            Decoded::Request(r) => {
                prop_assert!(b.len() >= proto::REQUEST_HEADER);
                let mut enc = Vec::new();
                proto::put_request(&mut enc, &r);
                prop_assert_eq!(&enc[..], &b[..proto::REQUEST_HEADER]);
            }
        }
    }

    #[test]
    fn every_request_round_trips(r in any_request(), tail in vec(any::<u8>(), 0..8)) {
        let mut b = Vec::new();
        proto::put_request(&mut b, &r);
        prop_assert_eq!(b.len(), proto::REQUEST_HEADER);
        b.extend(tail);
        prop_assert_eq!(parse_request(&b), Decoded::Request(r));
    }

    #[test]
    fn info_request_on_raw_bytes(d in vec(any::<u8>(), 0..96)) {
        check_info(&d)?;
    }

    #[test]
    fn info_request_on_mutated_encodings(n in name(), i in items(), m in mutation()) {
        let valid = info_data(&n, &i);
        if std::str::from_utf8(&n).is_ok() {
            // Unmutated, it is accepted exactly when the name is short enough.
            let parsed = parse_info_request(&valid);
            prop_assert_eq!(parsed.is_some(), n.len() <= 4096);
            if let Some(r) = parsed {
                prop_assert_eq!(r.name.as_bytes(), &n[..]);
                prop_assert_eq!(&r.items, &i);
            }
        } else {
            prop_assert!(parse_info_request(&valid).is_none());
        }
        check_info(&mutate(valid, &m))?;
    }

    #[test]
    fn meta_request_on_raw_bytes(d in vec(any::<u8>(), 0..96), max in 0usize..=70) {
        check_meta(&d, max)?;
    }

    #[test]
    fn meta_request_on_mutated_encodings(
        n in name(),
        q in queries(),
        max in 0usize..=70,
        m in mutation(),
    ) {
        let valid = meta_data(&n, &q);
        let ok = |s: &[u8]| s.len() <= 4096 && std::str::from_utf8(s).is_ok();
        let parsed = parse_meta_request(&valid, max);
        prop_assert_eq!(
            parsed.is_some(),
            ok(&n) && q.len() <= max && q.iter().all(|q| ok(q))
        );
        if let Some(r) = parsed {
            prop_assert_eq!(r.name.as_bytes(), &n[..]);
            let got: Vec<&[u8]> = r.queries.iter().map(|q| q.as_bytes()).collect();
            let want: Vec<&[u8]> = q.iter().map(|q| &q[..]).collect();
            prop_assert_eq!(got, want);
        }
        check_meta(&mutate(valid, &m), max)?;
    }
}

// ---------------------------------------------------------------------------------
// (c) the handshake state machine.

/// Drives `ops` through a negotiator with every rule checked; returns the last step and
/// the option that gave it.
fn negotiate(catalog: &Catalog, tls: TlsMode, client_flags: u32, ops: &[Op]) -> (Step, u32) {
    let mut neg = Negotiator::new(catalog, tls, client_flags);
    let mut checker = Checker::new(catalog, tls, client_flags);
    // Replies accumulate over the whole negotiation, as they would in a send buffer.
    let mut out = Vec::new();
    let (mut step, mut last) = (Step::Continue, 0);
    for op in ops {
        match op {
            Op::ShutDown => checker.shut_down(&mut neg),
            Op::Option(o, data) => {
                step = checker.option(&mut neg, header(*o, data), data, &mut out);
                last = *o;
                match step {
                    Step::Continue => {}
                    Step::StartTls => checker.tls_started(&mut neg),
                    Step::Go(_) | Step::Close => break,
                }
            }
        }
    }
    (step, last)
}

proptest! {
    #![proptest_config(config(2048))]

    #[test]
    fn negotiation_keeps_the_rules(
        cat in 0u8..4,
        tls in tls_mode(),
        client_flags in 0u32..4,
        ops in ops(16),
    ) {
        negotiate(&driver::catalog(cat), tls, client_flags, &ops);
    }
}

/// The generator reaches the interesting outcomes (so the property is not vacuous).
#[test]
fn negotiation_sequences_reach_go_with_base_allocation() {
    let mut runner = TestRunner::new(config(2048));
    let strategy = (0u8..4, tls_mode(), 0u32..4, ops(16));
    let (mut go, mut base, mut tls_go, mut export_name) = (0, 0, 0, 0);
    for _ in 0..2048 {
        let (cat, tls, flags, ops) = strategy
            .new_tree(&mut runner)
            .expect("value tree")
            .current();
        if let (Step::Go(s), last) = negotiate(&driver::catalog(cat), tls, flags, &ops) {
            go += 1;
            base += usize::from(s.base_allocation);
            tls_go += usize::from(tls == TlsMode::Required);
            export_name += usize::from(last == opt::EXPORT_NAME);
        }
    }
    // About 420, 35, 35 and 50 of 2048.
    assert!(go > 150, "only {go} sessions");
    assert!(base > 10, "only {base} sessions with base:allocation");
    assert!(tls_go > 8, "only {tls_go} sessions after STARTTLS");
    assert!(
        export_name > 15,
        "only {export_name} sessions by EXPORT_NAME"
    );
}

// ---------------------------------------------------------------------------------
// The fuzz target's driver on stable.

/// A request header, possibly followed by a write payload of its length.
fn tx_request() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![4 => 0u16..=8, 1 => any::<u16>()],
        prop_oneof![4 => Just(0u16), 1 => 0u16..32],
        any::<u64>(),
        any::<u64>(),
        prop_oneof![3 => 0u32..64, 1 => any::<u32>()],
        prop_oneof![8 => Just(false), 1 => Just(true)],
    )
        .prop_map(|(command, flags, cookie, offset, len, lie)| {
            let r = Request {
                flags,
                command,
                cookie,
                offset,
                len: u64::from(len),
            };
            let mut b = Vec::new();
            proto::put_request(&mut b, &r);
            if command == cmd::WRITE && len < 64 {
                // A payload that looks like requests: it must be skipped, not decoded.
                let mut p = Vec::new();
                while p.len() < len as usize {
                    proto::put_request(&mut p, &r);
                }
                p.truncate(len as usize - usize::from(lie && len > 0));
                b.extend(p);
            }
            b
        })
}

/// One handshake option: header and data, sometimes with a lying length, a bad magic or
/// data over the server's limit.
fn hs_option() -> impl Strategy<Value = Vec<u8>> {
    let framed = (ops(4), prop_oneof![16 => Just(0i64), 1 => -2i64..3]).prop_map(|(ops, lie)| {
        let mut b = Vec::new();
        for op in ops {
            let (o, data) = match op {
                Op::Option(o, d) => (o, d),
                Op::ShutDown => (opt::LIST, Vec::new()),
            };
            b.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
            b.extend_from_slice(&o.to_be_bytes());
            b.extend_from_slice(&((data.len() as i64 + lie).max(0) as u32).to_be_bytes());
            b.extend(data);
        }
        b
    });
    prop_oneof![
        40 => framed,
        1 => vec(any::<u8>(), 16..17),
        1 => Just({
            let mut b = proto::IHAVEOPT.to_be_bytes().to_vec();
            b.extend_from_slice(&opt::GO.to_be_bytes());
            b.extend_from_slice(&(driver::OPTION_DATA_MAX + 1).to_be_bytes());
            b.resize(16 + driver::OPTION_DATA_MAX as usize + 1, 0);
            b
        }),
    ]
}

fn fuzz_input() -> impl Strategy<Value = Vec<u8>> {
    let structured = (
        // TLS mode, client flags, catalog; a shutdown one time in eight.
        (0u8..0x40, prop::bool::weighted(0.125))
            .prop_map(|(c, shut)| c | if shut { 0x40 } else { 0 }),
        0u8..8,
        vec(hs_option(), 0..10),
        vec(tx_request(), 0..12),
        vec(any::<u8>(), 0..4),
        // Sometimes a corrupted byte anywhere.
        prop_oneof![
            3 => Just(Vec::new()),
            1 => vec((any::<prop::sample::Index>(), 1..=u8::MAX), 1..3),
        ],
    )
        .prop_map(|(cfg, shutdown_at, hs, tx, tail, flips)| {
            let hs = hs.concat();
            let mut b = vec![cfg, shutdown_at];
            b.extend_from_slice(&(hs.len() as u32).to_be_bytes());
            b.extend(hs);
            b.extend(tx.concat());
            b.extend(tail);
            for (i, x) in flips {
                let i = i.index(b.len());
                b[i] ^= x;
            }
            b
        });
    prop_oneof![
        8 => structured,
        1 => vec(any::<u8>(), 0..256),
    ]
}

#[test]
fn fuzz_driver_on_random_inputs() {
    use std::cell::Cell;
    let (sessions, requests, writes, runs) =
        (Cell::new(0), Cell::new(0), Cell::new(0), Cell::new(0));
    let mut runner = TestRunner::new(config(4096));
    let result = runner.run(&fuzz_input(), |bytes| {
        let r = driver::drive(&bytes);
        runs.set(runs.get() + 1);
        sessions.set(sessions.get() + usize::from(r.session.is_some()));
        requests.set(requests.get() + r.requests);
        writes.set(writes.get() + r.writes);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let runs = runs.get();
    // About 11% of runs reach a session, 3.5 requests and 0.23 skipped writes per run.
    assert!(
        sessions.get() * 20 > runs,
        "{} sessions in {runs} runs",
        sessions.get()
    );
    assert!(
        requests.get() > runs * 2,
        "{} requests in {runs} runs",
        requests.get()
    );
    assert!(
        writes.get() * 8 > runs,
        "{} writes in {runs} runs",
        writes.get()
    );
}

#[test]
fn fuzz_driver_on_short_and_empty_inputs() {
    for n in 0..64 {
        for fill in [0u8, 0xff, 0x41] {
            driver::drive(&vec![fill; n]);
        }
    }
}

// ---------------------------------------------------------------------------------
// Fixed edge cases.

#[test]
fn info_name_ending_exactly_at_the_data_end() {
    // The name fills the data: no room for the item count.
    let mut d = Vec::new();
    put_string(&mut d, b"abc");
    assert!(parse_info_request(&d).is_none());
    // One byte of the count: still refused.
    d.push(0);
    assert!(parse_info_request(&d).is_none());
    d.push(0);
    let r = parse_info_request(&d).unwrap();
    assert_eq!((r.name, r.items.len()), ("abc", 0));
    // A name length one past the end.
    let mut d = 4u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"abc");
    assert!(parse_info_request(&d).is_none());
    // A length that would overflow anything but is refused by the 4096 limit first.
    let mut d = u32::MAX.to_be_bytes().to_vec();
    d.extend_from_slice(&[0; 8]);
    assert!(parse_info_request(&d).is_none());
}

#[test]
fn info_items_count_past_the_data() {
    let mut d = Vec::new();
    put_string(&mut d, b"a");
    d.extend_from_slice(&u16::MAX.to_be_bytes());
    d.extend_from_slice(&info::NAME.to_be_bytes());
    assert!(parse_info_request(&d).is_none());
    // Every one of 65535 items present: accepted.
    let items: Vec<u16> = (0..u16::MAX).collect();
    let d = info_data(b"a", &items);
    assert_eq!(parse_info_request(&d).unwrap().items, items);
}

#[test]
fn meta_name_ending_exactly_at_the_data_end() {
    let mut d = Vec::new();
    put_string(&mut d, b"a");
    assert!(parse_meta_request(&d, 8).is_none());
    d.extend_from_slice(&0u32.to_be_bytes());
    let r = parse_meta_request(&d, 8).unwrap();
    assert_eq!((r.name, r.queries.len()), ("a", 0));
    // A query whose length runs exactly to the end, and one byte past it.
    let d = meta_data(b"a", &[b"base:allocation".to_vec()]);
    assert!(parse_meta_request(&d, 8).is_some());
    assert!(parse_meta_request(&d[..d.len() - 1], 8).is_none());
}

#[test]
fn zero_queries() {
    let d = meta_data(b"", &[]);
    // Zero queries are within any limit, even zero.
    let r = parse_meta_request(&d, 0).unwrap();
    assert_eq!((r.name, r.queries.len()), ("", 0));
    // A count of one with nothing after it.
    let mut d = meta_data(b"", &[]);
    d[7] = 1;
    assert!(parse_meta_request(&d, 8).is_none());

    // LIST with zero queries lists base:allocation; SET with zero selects nothing.
    let c = driver::catalog(0);
    let mut neg = Negotiator::new(&c, TlsMode::Off, 3);
    let mut chk = Checker::new(&c, TlsMode::Off, 3);
    let mut out = Vec::new();
    chk.option(&mut neg, header(opt::STRUCTURED_REPLY, &[]), &[], &mut out);
    let d = meta_data(b"a", &[]);
    out.clear();
    chk.option(&mut neg, header(opt::LIST_META_CONTEXT, &d), &d, &mut out);
    let r = driver::split_replies(&out, opt::LIST_META_CONTEXT);
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].0, rep::META_CONTEXT);
    assert_eq!(&r[0].1[4..], proto::BASE_ALLOCATION.as_bytes());
    out.clear();
    chk.option(&mut neg, header(opt::SET_META_CONTEXT, &d), &d, &mut out);
    let r = driver::split_replies(&out, opt::SET_META_CONTEXT);
    assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), [rep::ACK]);
    let g = info_data(b"a", &[]);
    out.clear();
    let Step::Go(s) = chk.option(&mut neg, header(opt::GO, &g), &g, &mut out) else {
        panic!("GO refused")
    };
    assert!(s.structured && !s.base_allocation);
}

#[test]
fn names_of_4096_bytes_pass_and_of_4097_are_refused() {
    let long = "x".repeat(4096);
    let d = info_data(long.as_bytes(), &[info::NAME]);
    assert_eq!(parse_info_request(&d).unwrap().name, long);
    let d = meta_data(long.as_bytes(), &[long.clone().into_bytes()]);
    let r = parse_meta_request(&d, 1).unwrap();
    assert_eq!((r.name, r.queries[0]), (&long[..], &long[..]));

    let longer = "x".repeat(4097);
    let d = info_data(longer.as_bytes(), &[]);
    assert!(parse_info_request(&d).is_none());
    let d = meta_data(longer.as_bytes(), &[]);
    assert!(parse_meta_request(&d, 1).is_none());
    let d = meta_data(b"a", &[longer.clone().into_bytes()]);
    assert!(parse_meta_request(&d, 1).is_none());

    // Through the negotiator: the 4096-byte export (catalog 2) is found and named back;
    // 4097 bytes is malformed, not unknown.
    let c = driver::catalog(2);
    let mut neg = Negotiator::new(&c, TlsMode::Off, 3);
    let mut chk = Checker::new(&c, TlsMode::Off, 3);
    let mut out = Vec::new();
    let d = info_data(longer.as_bytes(), &[]);
    chk.option(&mut neg, header(opt::INFO, &d), &d, &mut out);
    let r = driver::split_replies(&out, opt::INFO);
    assert_eq!(r[0].0, rep::ERR_INVALID);
    out.clear();
    let d = info_data(long.as_bytes(), &[info::NAME]);
    let Step::Go(s) = chk.option(&mut neg, header(opt::GO, &d), &d, &mut out) else {
        panic!("GO refused")
    };
    assert_eq!(s.export, 1);
    let r = driver::split_replies(&out, opt::GO);
    let name = r
        .iter()
        .find(|x| x.0 == rep::INFO && x.1[..2] == info::NAME.to_be_bytes())
        .unwrap();
    assert_eq!(&name.1[2..], long.as_bytes());
}

#[test]
fn tls_required_acknowledges_only_starttls_and_abort() {
    let c = driver::catalog(0);
    for o in 0..=12u32 {
        let mut neg = Negotiator::new(&c, TlsMode::Required, 1);
        let mut chk = Checker::new(&c, TlsMode::Required, 1);
        let mut out = Vec::new();
        let d = match o {
            opt::GO | opt::INFO => info_data(b"a", &[]),
            opt::EXPORT_NAME => b"a".to_vec(),
            opt::SET_META_CONTEXT | opt::LIST_META_CONTEXT => meta_data(b"a", &[]),
            _ => Vec::new(),
        };
        let step = chk.option(&mut neg, header(o, &d), &d, &mut out);
        match o {
            opt::STARTTLS => assert_eq!(step, Step::StartTls),
            opt::ABORT | opt::EXPORT_NAME => assert_eq!(step, Step::Close),
            _ => {
                assert_eq!(step, Step::Continue);
                let r = driver::split_replies(&out, o);
                assert_eq!(
                    r.iter().map(|x| x.0).collect::<Vec<_>>(),
                    [rep::ERR_TLS_REQD]
                );
            }
        }
    }
}

#[test]
fn write_payloads_are_skipped_not_decoded() {
    let w = Request {
        flags: 0,
        command: cmd::WRITE,
        cookie: 1,
        offset: 0,
        len: 2 * proto::REQUEST_HEADER as u64,
    };
    let mut tx = Vec::new();
    proto::put_request(&mut tx, &w);
    // The payload is two well-formed requests: they must not count.
    proto::put_request(&mut tx, &w);
    proto::put_request(&mut tx, &w);
    let mut input = vec![0, 0];
    input.extend_from_slice(&0u32.to_be_bytes());
    input.extend_from_slice(&tx);
    let r = driver::drive(&input);
    assert_eq!((r.options, r.requests, r.writes), (0, 1, 1));
    // Short by one byte: the write is decoded but its payload has not arrived.
    input.pop();
    let r = driver::drive(&input);
    assert_eq!((r.requests, r.writes), (1, 0));
}

// Replies as a client decodes them: every header the encoders make decodes to what was
// encoded, at every split point it is incomplete, and any other bytes never panic.
proptest! {
    #[test]
    fn reply_headers_round_trip(
        error in any::<u32>(),
        cookie in any::<u64>(),
        flags in any::<u16>(),
        kind in any::<u16>(),
        offset in any::<u64>(),
        len in any::<u64>(),
        cut in 0usize..32,
    ) {
        use cairn_nbd::proto::{
            chunk_header, parse_reply, simple_reply, DecodedReply, ReplyHeader,
            EXTENDED_HEADER, EXTENDED_REPLY_MAGIC,
        };
        let simple = simple_reply(error, cookie);
        prop_assert_eq!(
            parse_reply(&simple, false),
            DecodedReply::Header(ReplyHeader::Simple { error, cookie }, 16)
        );
        // Extended headers forbid simple replies.
        prop_assert!(matches!(parse_reply(&simple, true), DecodedReply::Bad(_)));
        let compact = chunk_header(flags, kind, cookie, len as u32);
        prop_assert_eq!(
            parse_reply(&compact, false),
            DecodedReply::Header(
                ReplyHeader::Chunk { flags, kind, cookie, offset: 0, len: u64::from(len as u32) },
                20
            )
        );
        let mut ext = Vec::with_capacity(EXTENDED_HEADER);
        ext.extend_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
        ext.extend_from_slice(&flags.to_be_bytes());
        ext.extend_from_slice(&kind.to_be_bytes());
        ext.extend_from_slice(&cookie.to_be_bytes());
        ext.extend_from_slice(&offset.to_be_bytes());
        ext.extend_from_slice(&len.to_be_bytes());
        prop_assert_eq!(
            parse_reply(&ext, true),
            DecodedReply::Header(ReplyHeader::Chunk { flags, kind, cookie, offset, len }, 32)
        );
        prop_assert!(matches!(parse_reply(&ext, false), DecodedReply::Bad(_)));
        prop_assert_eq!(parse_reply(&ext[..cut], true), DecodedReply::Incomplete);
        prop_assert_eq!(parse_reply(&simple[..cut.min(15)], false), DecodedReply::Incomplete);
    }

    #[test]
    fn reply_decoder_takes_any_bytes(b in proptest::collection::vec(any::<u8>(), 0..64), ext in any::<bool>()) {
        if let cairn_nbd::proto::DecodedReply::Header(_, n) = cairn_nbd::proto::parse_reply(&b, ext) {
            prop_assert!(n <= b.len());
        }
    }
}
