//! The decoder driver shared by `tests/decode.rs` and the cargo-fuzz target
//! (`fuzz/fuzz_targets/decoder.rs` includes this file with `#[path]`), so CI runs on
//! stable exactly the code the fuzzer runs.
//!
//! [`drive`] reads its input as
//!
//! ```text
//! [config: u8] [shutdown at: u8] [handshake length: u32 BE] [handshake] [transmission]
//! ```
//!
//! (every part may be cut short). `config` picks the TLS mode (bits 0-1), the client flags
//! (bits 2-3), the catalog (bits 4-5) and whether the server starts shutting down before
//! option number `shutdown at` (bit 6). The handshake part is a sequence of option
//! headers and their data, run through a [`Negotiator`] the way `server::negotiate` does;
//! the transmission part is decoded with [`proto::parse_request`] (or, with extended
//! headers, [`proto::parse_extended_request`]) the way the connection loop does, each
//! request checked with [`command::check`] against the session's terms when the
//! handshake reached one, skipping each payload by its length. Every reply and every decoded
//! request is checked by a [`Checker`]; a broken rule panics.

#![allow(dead_code)]

use cairn_core::{Caps, Geometry, Op};
use cairn_nbd::proto::command::{self, Command, Terms};
use cairn_nbd::proto::{self, cmd, info, opt, rep, tflags, Decoded, OptionHeader};
use cairn_nbd::server::handshake::{Catalog, ExportInfo, Negotiator, Session, Step, TlsMode};

/// As `server.rs`: larger option data is skipped and answered with ERR_TOO_BIG...
pub const OPTION_DATA_MAX: u32 = 64 << 10;
/// ...up to this much; beyond it the server hangs up.
pub const OPTION_SKIP_MAX: u32 = 1 << 20;
/// As `server/conn.rs`: a write payload beyond this is not skipped, the connection is dropped.
pub const SKIP_MAX: u64 = 64 << 20;
/// As `handshake.rs`: most queries of one metadata context request.
pub const MAX_META_QUERIES: usize = 64;

/// What one run got through (for tests that check the inputs reach deep enough).
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// Option headers with a good magic.
    pub options: usize,
    /// The session, if the handshake reached transmission.
    pub session: Option<Session>,
    /// Transmission requests decoded.
    pub requests: usize,
    /// Of which writes whose payload was skipped.
    pub writes: usize,
}

fn export(name: &str, description: &str, size: u64, flags: u16, default: bool) -> ExportInfo {
    ExportInfo {
        name: name.into(),
        description: description.into(),
        size,
        flags,
        min_block: 512,
        preferred_block: 4096,
        max_payload: 32 << 20,
        default,
    }
}

/// Small catalogs: two exports with a default, one export (the empty name finds it),
/// three exports without a default (one named with the longest string allowed), none.
pub fn catalog(which: u8) -> Catalog {
    let exports = match which & 3 {
        0 => vec![
            export("a", "first", 1 << 20, tflags::SEND_FLUSH, false),
            export("b", "", 2 << 20, tflags::READ_ONLY, true),
        ],
        1 => vec![export(
            "only",
            "the one",
            4 << 20,
            tflags::SEND_FLUSH | tflags::SEND_FUA | tflags::SEND_TRIM,
            false,
        )],
        2 => vec![
            export("a", "", 1 << 20, 0, false),
            export(
                &"x".repeat(4096),
                "long",
                1 << 20,
                tflags::ROTATIONAL,
                false,
            ),
            export(
                "c",
                "é",
                8 << 20,
                tflags::SEND_WRITE_ZEROES | tflags::SEND_FAST_ZERO,
                false,
            ),
        ],
        _ => vec![],
    };
    Catalog { exports }
}

/// Every name any catalog offers.
pub fn catalog_names() -> Vec<String> {
    (0..4)
        .flat_map(|c| catalog(c).exports.into_iter().map(|e| e.name))
        .collect()
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

fn is_error(reply: u32) -> bool {
    reply & (1 << 31) != 0
}

/// Splits the option replies appended for option `option` into (type, data); panics
/// unless they are exactly a sequence of well-formed replies echoing the option.
pub fn split_replies(mut b: &[u8], option: u32) -> Vec<(u32, &[u8])> {
    let mut v = Vec::new();
    while !b.is_empty() {
        assert!(b.len() >= 20, "option {option}: short reply header {b:?}");
        assert_eq!(be64(&b[0..8]), proto::REPLY_MAGIC, "option {option}: magic");
        assert_eq!(
            be32(&b[8..12]),
            option,
            "reply does not echo option {option}"
        );
        let t = be32(&b[12..16]);
        let n = be32(&b[16..20]) as usize;
        assert!(
            b.len() - 20 >= n,
            "option {option}: reply {t:#x} claims {n} bytes, {} follow",
            b.len() - 20
        );
        v.push((t, &b[20..20 + n]));
        b = &b[20 + n..];
    }
    v
}

/// The rules every negotiation must keep, checked option by option against a model of
/// what was negotiated.
pub struct Checker<'a> {
    catalog: &'a Catalog,
    tls: TlsMode,
    no_zeroes: bool,
    tls_active: bool,
    shutting_down: bool,
    /// STRUCTURED_REPLY or EXTENDED_HEADERS was acknowledged (since TLS started).
    structured: bool,
    /// EXTENDED_HEADERS was acknowledged (since TLS started).
    extended: bool,
    /// The export the last SET_META_CONTEXT selected `base:allocation` for.
    meta: Option<usize>,
}

impl<'a> Checker<'a> {
    /// A checker for a negotiator made with the same arguments.
    pub fn new(catalog: &'a Catalog, tls: TlsMode, client_flags: u32) -> Checker<'a> {
        Checker {
            catalog,
            tls,
            no_zeroes: client_flags & proto::FLAG_C_NO_ZEROES != 0,
            tls_active: false,
            shutting_down: false,
            structured: false,
            extended: false,
            meta: None,
        }
    }

    /// `neg.shut_down()`, remembered.
    pub fn shut_down(&mut self, neg: &mut Negotiator<'_>) {
        neg.shut_down();
        self.shutting_down = true;
    }

    /// `neg.tls_started()` after a `Step::StartTls`, remembered.
    pub fn tls_started(&mut self, neg: &mut Negotiator<'_>) {
        neg.tls_started();
        self.tls_active = true;
        self.structured = false;
        self.extended = false;
        self.meta = None;
    }

    /// Runs one option through `neg`, checks what it appended to `out` and the step.
    pub fn option(
        &mut self,
        neg: &mut Negotiator<'_>,
        h: OptionHeader,
        data: &[u8],
        out: &mut Vec<u8>,
    ) -> Step {
        let before = out.len();
        let step = neg.option(h, data, out);
        self.check(h.option, data, &out[before..], &step);
        step
    }

    fn tls_pending(&self) -> bool {
        self.tls == TlsMode::Required && !self.tls_active
    }

    fn check(&mut self, o: u32, data: &[u8], appended: &[u8], step: &Step) {
        if o == opt::EXPORT_NAME {
            return self.check_export_name(data, appended, step);
        }
        let replies = split_replies(appended, o);
        assert!(!replies.is_empty(), "option {o}: no reply");
        let (last, _) = *replies.last().unwrap();
        let acked = last == rep::ACK;
        assert!(
            acked || is_error(last),
            "option {o}: ends with reply {last:#x}, neither ACK nor an error"
        );
        for &(t, d) in &replies[..replies.len() - 1] {
            assert!(
                t != rep::ACK && !is_error(t),
                "option {o}: reply {t:#x} before the last"
            );
            match (o, t) {
                (opt::LIST, rep::SERVER) => {
                    assert!(d.len() >= 4, "LIST: short SERVER reply");
                    let n = be32(d) as usize;
                    assert!(n <= d.len() - 4, "LIST: name runs past the reply");
                    let name = std::str::from_utf8(&d[4..4 + n]).expect("LIST: name UTF-8");
                    assert!(self.catalog.exports.iter().any(|e| e.name == name));
                }
                (opt::INFO | opt::GO, rep::INFO) => {
                    assert!(d.len() >= 2, "INFO: short reply");
                    let want = match be16(d) {
                        info::EXPORT => Some(12),
                        info::BLOCK_SIZE => Some(14),
                        info::NAME | info::DESCRIPTION => None,
                        other => panic!("INFO: item {other} never asked for"),
                    };
                    if let Some(want) = want {
                        assert_eq!(d.len(), want, "INFO: item {} length", be16(d));
                    }
                }
                (opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT, rep::META_CONTEXT) => {
                    assert!(d.len() > 4, "META_CONTEXT: short reply");
                    std::str::from_utf8(&d[4..]).expect("META_CONTEXT: name UTF-8");
                }
                _ => panic!("option {o}: unexpected reply {t:#x}"),
            }
        }
        if is_error(last) {
            assert_eq!(replies.len(), 1, "option {o}: replies before an error");
            std::str::from_utf8(replies[0].1).expect("error message UTF-8");
        }
        if self.tls_pending() && o != opt::STARTTLS && o != opt::ABORT {
            assert!(
                replies.iter().all(|&(t, _)| is_error(t)),
                "option {o} answered before TLS although TLS is required"
            );
        }
        if self.shutting_down && o != opt::ABORT {
            assert!(
                is_error(last),
                "option {o} acknowledged while shutting down"
            );
        }
        if acked && matches!(o, opt::INFO | opt::GO) {
            assert!(
                replies
                    .iter()
                    .any(|&(t, d)| t == rep::INFO && be16(d) == info::EXPORT),
                "option {o}: ACK without NBD_INFO_EXPORT"
            );
            self.check_info_items(o, data, &replies);
        }
        if acked && o == opt::LIST {
            let listed: Vec<&[u8]> = replies[..replies.len() - 1].iter().map(|r| r.1).collect();
            let want: Vec<Vec<u8>> = self
                .catalog
                .exports
                .iter()
                .map(|e| {
                    let mut d = (e.name.len() as u32).to_be_bytes().to_vec();
                    d.extend_from_slice(e.name.as_bytes());
                    d.extend_from_slice(e.description.as_bytes());
                    d
                })
                .collect();
            assert_eq!(listed, want, "LIST does not list the catalog");
        }
        if acked && matches!(o, opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT) {
            assert!(
                self.structured,
                "meta context ACK without structured replies"
            );
        }
        match step {
            Step::Continue => {
                assert_ne!(o, opt::ABORT, "ABORT did not close");
                assert!(
                    !(acked && matches!(o, opt::GO | opt::STARTTLS)),
                    "option {o} acknowledged but the step is Continue"
                );
            }
            Step::Close => {
                assert_eq!(o, opt::ABORT, "Close after option {o}");
                assert!(acked && replies.len() == 1);
            }
            Step::StartTls => {
                assert_eq!(o, opt::STARTTLS, "StartTls after option {o}");
                assert!(acked && replies.len() == 1 && replies[0].1.is_empty());
                assert!(data.is_empty() && self.tls != TlsMode::Off && !self.tls_active);
            }
            Step::Go(s) => {
                assert_eq!(o, opt::GO, "Go after option {o}");
                assert!(acked, "Go without an ACK");
                let (_, export) = *replies
                    .iter()
                    .find(|&&(t, d)| t == rep::INFO && be16(d) == info::EXPORT)
                    .unwrap();
                assert_eq!(be64(&export[2..]), self.catalog.exports[s.export].size);
                assert_eq!(be16(&export[10..]), s.flags, "GO: flags sent != session");
                let req = proto::parse_info_request(data).expect("GO acknowledged");
                assert_eq!(self.catalog.find(req.name), Some(s.export));
                assert_eq!(s.block_sizes_agreed, req.items.contains(&info::BLOCK_SIZE));
                self.check_session(s);
            }
        }
        if o == opt::STRUCTURED_REPLY {
            // Never a step back from extended headers.
            assert!(
                !(acked && self.extended),
                "STRUCTURED_REPLY acknowledged after EXTENDED_HEADERS"
            );
            if acked {
                self.structured = true;
            }
        }
        if o == opt::EXTENDED_HEADERS && acked {
            assert!(data.is_empty(), "EXTENDED_HEADERS acknowledged with data");
            self.structured = true;
            self.extended = true;
        }
        if o == opt::SET_META_CONTEXT {
            self.meta = None;
            if acked && replies.iter().any(|&(t, _)| t == rep::META_CONTEXT) {
                let req = proto::parse_meta_request(data, MAX_META_QUERIES).expect("acked");
                let i = self.catalog.find(req.name);
                assert!(
                    i.is_some(),
                    "SET_META_CONTEXT acknowledged for an unknown export"
                );
                self.meta = i;
            }
        }
    }

    /// The items an acknowledged INFO or GO sent describe the export asked for.
    fn check_info_items(&self, o: u32, data: &[u8], replies: &[(u32, &[u8])]) {
        let req = proto::parse_info_request(data).expect("INFO/GO acknowledged");
        let i = self.catalog.find(req.name).expect("INFO/GO acknowledged");
        let e = &self.catalog.exports[i];
        for &(t, d) in replies {
            if t != rep::INFO {
                continue;
            }
            let v = &d[2..];
            match be16(d) {
                info::EXPORT => {
                    assert_eq!(be64(v), e.size, "option {o}: size");
                    assert_eq!(be16(&v[8..]), self.flags(i), "option {o}: flags");
                }
                info::BLOCK_SIZE => {
                    let sizes = [be32(v), be32(&v[4..]), be32(&v[8..])];
                    assert_eq!(sizes, [e.min_block, e.preferred_block, e.max_payload]);
                }
                info::NAME => {
                    assert!(req.items.contains(&info::NAME), "NAME not asked for");
                    assert_eq!(v, e.name.as_bytes(), "option {o}: NBD_INFO_NAME");
                }
                info::DESCRIPTION => {
                    assert!(req.items.contains(&info::DESCRIPTION), "not asked for");
                    assert_eq!(v, e.description.as_bytes(), "option {o}: description");
                }
                _ => unreachable!("checked above"),
            }
        }
    }

    /// The transmission flags export `i` must be offered with now.
    fn flags(&self, i: usize) -> u16 {
        let mut flags = self.catalog.exports[i].flags | tflags::HAS_FLAGS;
        if self.structured {
            flags |= tflags::SEND_DF;
        }
        flags
    }

    fn check_export_name(&mut self, data: &[u8], appended: &[u8], step: &Step) {
        match step {
            Step::Go(s) => {
                assert!(!self.tls_pending(), "EXPORT_NAME went ahead before TLS");
                assert!(
                    !self.shutting_down,
                    "EXPORT_NAME went ahead while shutting down"
                );
                let name = std::str::from_utf8(data).expect("EXPORT_NAME accepted bad UTF-8");
                assert_eq!(self.catalog.find(name), Some(s.export));
                let want = 10 + if self.no_zeroes { 0 } else { 124 };
                assert_eq!(appended.len(), want, "EXPORT_NAME reply length");
                assert_eq!(be64(appended), self.catalog.exports[s.export].size);
                assert_eq!(be16(&appended[8..]), s.flags);
                assert!(appended[10..].iter().all(|&z| z == 0));
                assert!(!s.block_sizes_agreed);
                self.check_session(s);
            }
            Step::Close => assert!(appended.is_empty(), "EXPORT_NAME refusals send nothing"),
            _ if self.extended => panic!("EXPORT_NAME went ahead after EXTENDED_HEADERS"),
            other => panic!("EXPORT_NAME gave {other:?}"),
        }
    }

    fn check_session(&self, s: &Session) {
        assert!(
            s.export < self.catalog.exports.len(),
            "session export in the catalog"
        );
        assert_eq!(s.structured, self.structured, "session.structured");
        assert_eq!(s.extended, self.extended, "session.extended");
        assert!(
            !s.base_allocation || self.structured,
            "base_allocation without structured replies"
        );
        assert_eq!(
            s.base_allocation,
            self.structured && self.meta == Some(s.export),
            "base_allocation does not match the last SET_META_CONTEXT"
        );
        assert_eq!(s.flags, self.flags(s.export), "session flags");
    }
}

/// A cursor that hands out whole pieces or nothing.
struct Take<'a>(&'a [u8]);

impl<'a> Take<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
}

/// Runs one fuzz input (see the module documentation); panics if a rule is broken.
pub fn drive(bytes: &[u8]) -> Report {
    let mut report = Report::default();
    let mut input = Take(bytes);
    let cfg = input.take(1).map_or(0, |b| b[0]);
    let shutdown_at = input.take(1).map_or(0, |b| b[0]);
    let shutdown_at = (cfg & 0x40 != 0).then_some(usize::from(shutdown_at));
    let hs_len = input.take(4).map_or(0, be32) as usize;
    let (hs, tx) = input.0.split_at(hs_len.min(input.0.len()));

    let tls = match cfg & 3 {
        0 => TlsMode::Off,
        1 => TlsMode::Optional,
        _ => TlsMode::Required,
    };
    let client_flags = u32::from((cfg >> 2) & 3);
    let catalog = catalog(cfg >> 4);
    handshake(&catalog, tls, client_flags, shutdown_at, hs, &mut report);
    let terms = report.session.as_ref().map(|s| terms(&catalog, s));
    transmission(tx, terms.as_ref(), &mut report);
    report
}

/// What the server checks the requests of `session` against (as `server::conn` builds
/// them: every export here is served by a device with every capability).
fn terms(catalog: &Catalog, session: &Session) -> Terms {
    let e = &catalog.exports[session.export];
    Terms {
        flags: session.flags,
        structured: session.structured,
        extended: session.extended,
        block_status: session.base_allocation || !session.bitmaps.is_empty(),
        relaxed: !session.block_sizes_agreed,
        fast_zero: e.flags & tflags::SEND_FAST_ZERO != 0,
        max_payload: e.max_payload,
        geometry: Geometry {
            size_bytes: e.size,
            block_bytes: e.min_block,
            caps: Caps::ALL,
        },
    }
}

/// The rules every request [`command::check`] accepts must keep: the range inside the
/// export, whole blocks unless widened (only on relaxed terms), at most the maximum
/// payload, no write to a read-only export.
fn check_command(r: &proto::Request, t: &Terms) {
    let g = t.geometry;
    let read_only = t.flags & tflags::READ_ONLY != 0;
    let Ok(c) = command::check(r, t, false) else {
        return;
    };
    match c {
        Command::Disconnect => assert_eq!(r.command, cmd::DISC),
        Command::Cache | Command::BlockStatus => {
            assert!(
                r.len > 0 && r.offset + r.len <= g.size_bytes,
                "{r:?}: out of range"
            );
        }
        Command::Io { op, .. } => {
            assert!(
                !(read_only && op.is_write()),
                "{r:?}: a write to a read-only export"
            );
            if op != Op::Flush {
                assert!(
                    g.check(op, r.offset, r.len).is_ok(),
                    "{r:?}: accepted as {op:?}"
                );
            }
            if op.has_data() {
                assert!(r.len <= u64::from(t.max_payload), "{r:?}: over the maximum");
            }
        }
        Command::Unaligned { op, wide } => {
            assert!(t.relaxed && !(read_only && op.is_write()), "{r:?}: widened");
            assert!(
                g.check(op, wide.offset, wide.len).is_ok(),
                "{r:?}: widened out of range"
            );
        }
    }
}

fn handshake(
    catalog: &Catalog,
    tls: TlsMode,
    client_flags: u32,
    shutdown_at: Option<usize>,
    hs: &[u8],
    report: &mut Report,
) {
    let mut neg = Negotiator::new(catalog, tls, client_flags);
    let mut checker = Checker::new(catalog, tls, client_flags);
    let mut input = Take(hs);
    let mut out = Vec::new();
    loop {
        if shutdown_at == Some(report.options) {
            checker.shut_down(&mut neg);
        }
        let Some(hb) = input.take(proto::OPTION_HEADER) else {
            return;
        };
        let Some(h) = proto::parse_option_header(hb.try_into().unwrap()) else {
            return; // not NBD: the server hangs up
        };
        report.options += 1;
        out.clear();
        if h.len > OPTION_DATA_MAX {
            // The server skips the data and answers ERR_TOO_BIG itself.
            if h.len > OPTION_SKIP_MAX || input.take(h.len as usize).is_none() {
                return;
            }
            continue;
        }
        let Some(data) = input.take(h.len as usize) else {
            return; // the client left mid-option
        };
        match checker.option(&mut neg, h, data, &mut out) {
            Step::Continue => {}
            Step::Close => return,
            Step::StartTls => checker.tls_started(&mut neg),
            Step::Go(s) => {
                report.session = Some(s);
                return;
            }
        }
    }
}

fn transmission(tx: &[u8], terms: Option<&Terms>, report: &mut Report) {
    let extended = terms.is_some_and(|t| t.extended);
    let header = if extended {
        proto::EXTENDED_HEADER
    } else {
        proto::REQUEST_HEADER
    };
    let mut pos = 0;
    loop {
        let rest = &tx[pos..];
        let decoded = if extended {
            proto::parse_extended_request(rest)
        } else {
            proto::parse_request(rest)
        };
        match decoded {
            Decoded::Incomplete => {
                assert!(rest.len() < header, "Incomplete with a header");
                return;
            }
            Decoded::BadMagic(m) => {
                assert!(rest.len() >= header);
                assert_eq!(m, be32(rest), "BadMagic reports another magic");
                let good = if extended {
                    proto::EXTENDED_REQUEST_MAGIC
                } else {
                    proto::REQUEST_MAGIC
                };
                assert_ne!(m, good, "BadMagic for the good magic");
                return;
            }
            Decoded::Request(r) => {
                if !extended {
                    let mut enc = Vec::with_capacity(proto::REQUEST_HEADER);
                    proto::put_request(&mut enc, &r);
                    assert_eq!(enc, &rest[..proto::REQUEST_HEADER], "request re-encoding");
                }
                pos += header;
                report.requests += 1;
                if let Some(t) = terms {
                    check_command(&r, t);
                }
                if r.command == cmd::DISC && r.flags == 0 {
                    return;
                }
                // The payload follows the header whether the request is served or
                // refused; it is never decoded as requests.
                let n = command::payload_len(&r, extended);
                if n > 0 {
                    if n > SKIP_MAX || ((tx.len() - pos) as u64) < n {
                        return;
                    }
                    pos += n as usize;
                    report.writes += 1;
                }
            }
        }
    }
}
