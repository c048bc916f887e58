//! Option haggling (the fixed newstyle handshake), as a pure state machine.
//!
//! [`Negotiator::option`] takes one option request and appends the server's replies; the
//! caller moves the bytes. Keeping the I/O out makes every rule here testable (and
//! fuzzable) without a socket, and lets the same code run before and after STARTTLS.

use crate::proto::{self, info, opt, rep, tflags, OptionHeader};

/// What a client may see of one export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// Name clients ask for.
    pub name: String,
    /// Free text shown by `NBD_OPT_LIST` and `NBD_INFO_DESCRIPTION`.
    pub description: String,
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags (without the ones that depend on negotiation, such as DF).
    pub flags: u16,
    /// Smallest request granularity (the device's block size).
    pub min_block: u32,
    /// Preferred request granularity.
    pub preferred_block: u32,
    /// Largest payload of a read or write.
    pub max_payload: u32,
    /// Chosen by the empty name.
    pub default: bool,
}

/// The exports a server offers.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    /// In the order they are listed.
    pub exports: Vec<ExportInfo>,
}

impl Catalog {
    /// The export `name` stands for: itself, or the default for the empty name.
    pub fn find(&self, name: &str) -> Option<usize> {
        if let Some(i) = self.exports.iter().position(|e| e.name == name) {
            return Some(i);
        }
        if name.is_empty() {
            if let Some(i) = self.exports.iter().position(|e| e.default) {
                return Some(i);
            }
            if self.exports.len() == 1 {
                return Some(0);
            }
        }
        None
    }
}

/// Whether TLS is offered or required.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// No certificate configured: STARTTLS is refused.
    Off,
    /// STARTTLS is offered; clients may also go without.
    Optional,
    /// Everything but STARTTLS and ABORT is refused until TLS is up.
    Required,
}

/// The result of one option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Keep haggling.
    Continue,
    /// Send the replies, then start transmission with this session.
    Go(Session),
    /// Send the replies, then upgrade the connection to TLS and keep haggling.
    StartTls,
    /// Send the replies (if any), then close the connection.
    Close,
}

/// What was agreed for the transmission phase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// Index into the catalog.
    pub export: usize,
    /// Transmission flags sent to the client.
    pub flags: u16,
    /// Structured replies are in use.
    pub structured: bool,
    /// Extended headers are in use (32-byte requests with 64-bit lengths; every reply an
    /// extended chunk). They imply `structured`.
    pub extended: bool,
    /// `base:allocation` was selected for this export.
    pub base_allocation: bool,
    /// Dirty bitmaps selected for this export (`qemu:dirty-bitmap:NAME`), as (context
    /// id, bitmap name). With `base_allocation`, any makes BLOCK_STATUS allowed.
    pub bitmaps: Vec<(u32, String)>,
    /// The client promised to honour the block sizes (GO with NBD_INFO_BLOCK_SIZE).
    pub block_sizes_agreed: bool,
}

/// Negotiation state of one connection.
pub struct Negotiator<'a> {
    catalog: &'a Catalog,
    tls: TlsMode,
    tls_active: bool,
    structured: bool,
    extended: bool,
    /// After SET_META_CONTEXT: what was selected.
    meta: Option<Selected>,
    /// The names of export `i`'s dirty bitmaps, asked when a client asks for contexts.
    bitmaps: &'a dyn Fn(usize) -> Vec<String>,
    no_zeroes: bool,
    shutting_down: bool,
}

/// What a SET_META_CONTEXT selected: the export name, whether base:allocation was
/// selected, and the bitmaps selected with their context ids.
type Selected = (String, bool, Vec<(u32, String)>);

/// Most queries one LIST or SET_META_CONTEXT may carry.
const MAX_META_QUERIES: usize = 64;

impl<'a> Negotiator<'a> {
    /// A negotiation over `catalog`; `client_flags` are the 32 bits the client sent.
    pub fn new(catalog: &'a Catalog, tls: TlsMode, client_flags: u32) -> Negotiator<'a> {
        Negotiator {
            catalog,
            tls,
            tls_active: false,
            structured: false,
            extended: false,
            meta: None,
            bitmaps: &|_| Vec::new(),
            no_zeroes: client_flags & proto::FLAG_C_NO_ZEROES != 0,
            shutting_down: false,
        }
    }

    /// Offers each export's dirty bitmaps as `qemu:dirty-bitmap:NAME` contexts: `names(i)`
    /// lists export `i`'s.
    pub fn with_bitmaps(mut self, names: &'a dyn Fn(usize) -> Vec<String>) -> Negotiator<'a> {
        self.bitmaps = names;
        self
    }

    /// From now on every option is refused with `NBD_REP_ERR_SHUTDOWN`.
    pub fn shut_down(&mut self) {
        self.shutting_down = true;
    }

    /// TLS is now up (after a STARTTLS): forget what was negotiated before it.
    pub fn tls_started(&mut self) {
        self.tls_active = true;
        self.structured = false;
        self.extended = false;
        self.meta = None;
    }

    /// Handles one option request; appends the replies to `out`.
    pub fn option(&mut self, h: OptionHeader, data: &[u8], out: &mut Vec<u8>) -> Step {
        let o = h.option;
        let error = |out: &mut Vec<u8>, code: u32, msg: &str| {
            proto::put_option_reply(out, o, code, msg.as_bytes());
            Step::Continue
        };
        if o == opt::ABORT {
            proto::put_option_reply(out, o, rep::ACK, &[]);
            return Step::Close;
        }
        if self.tls == TlsMode::Required && !self.tls_active && o != opt::STARTTLS {
            if o == opt::EXPORT_NAME {
                return Step::Close;
            }
            return error(
                out,
                rep::ERR_TLS_REQD,
                "this server requires TLS: use STARTTLS",
            );
        }
        if self.shutting_down {
            if o == opt::EXPORT_NAME {
                return Step::Close;
            }
            return error(out, rep::ERR_SHUTDOWN, "the server is shutting down");
        }
        match o {
            // A client with extended headers must finish with GO.
            opt::EXPORT_NAME if self.extended => Step::Close,
            opt::EXPORT_NAME => self.export_name(data, out),
            opt::LIST => self.list(data, out),
            opt::STARTTLS => self.starttls(data, out),
            opt::INFO | opt::GO => self.info_or_go(o, data, out),
            opt::STRUCTURED_REPLY => {
                if !data.is_empty() {
                    return error(out, rep::ERR_INVALID, "STRUCTURED_REPLY takes no data");
                }
                if self.extended {
                    return error(
                        out,
                        rep::ERR_EXT_HEADER_REQD,
                        "extended headers are already on; they include structured replies",
                    );
                }
                self.structured = true;
                proto::put_option_reply(out, o, rep::ACK, &[]);
                Step::Continue
            }
            opt::EXTENDED_HEADERS => {
                if !data.is_empty() {
                    return error(out, rep::ERR_INVALID, "EXTENDED_HEADERS takes no data");
                }
                self.extended = true;
                self.structured = true;
                proto::put_option_reply(out, o, rep::ACK, &[]);
                Step::Continue
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => self.meta_context(o, data, out),
            _ => error(
                out,
                rep::ERR_UNSUP,
                &format!("option {o} ({}) is not supported", opt::name(o)),
            ),
        }
    }

    /// `NBD_OPT_LIST`: one `NBD_REP_SERVER` per export, then the ACK.
    fn list(&self, data: &[u8], out: &mut Vec<u8>) -> Step {
        let o = opt::LIST;
        if !data.is_empty() {
            proto::put_option_reply(out, o, rep::ERR_INVALID, b"LIST takes no data");
            return Step::Continue;
        }
        for e in &self.catalog.exports {
            let mut d = Vec::with_capacity(4 + e.name.len() + e.description.len());
            d.extend_from_slice(&(e.name.len() as u32).to_be_bytes());
            d.extend_from_slice(e.name.as_bytes());
            d.extend_from_slice(e.description.as_bytes());
            proto::put_option_reply(out, o, rep::SERVER, &d);
        }
        proto::put_option_reply(out, o, rep::ACK, &[]);
        Step::Continue
    }

    /// `NBD_OPT_STARTTLS`: acknowledged (then the TLS handshake) if TLS is configured
    /// and not active yet.
    fn starttls(&self, data: &[u8], out: &mut Vec<u8>) -> Step {
        let refusal = if !data.is_empty() {
            Some((rep::ERR_INVALID, "STARTTLS takes no data"))
        } else if self.tls_active {
            Some((rep::ERR_INVALID, "TLS is already active"))
        } else if self.tls == TlsMode::Off {
            Some((
                rep::ERR_POLICY,
                "TLS is not configured on this server (see --tls-certificates)",
            ))
        } else {
            None
        };
        if let Some((code, msg)) = refusal {
            proto::put_option_reply(out, opt::STARTTLS, code, msg.as_bytes());
            return Step::Continue;
        }
        proto::put_option_reply(out, opt::STARTTLS, rep::ACK, &[]);
        Step::StartTls
    }

    /// Transmission flags of export `i` for this connection.
    fn flags(&self, i: usize) -> u16 {
        let mut f = self.catalog.exports[i].flags | tflags::HAS_FLAGS;
        if self.structured {
            f |= tflags::SEND_DF;
        }
        f
    }

    fn session(&self, i: usize, block_sizes_agreed: bool) -> Session {
        let name = &self.catalog.exports[i].name;
        // Contexts count for the export they were set for.
        let (base_allocation, bitmaps) = match &self.meta {
            Some((n, base, bitmaps))
                if self.structured && (self.catalog.find(n) == Some(i) || n == name) =>
            {
                (*base, bitmaps.clone())
            }
            _ => (false, Vec::new()),
        };
        Session {
            export: i,
            flags: self.flags(i),
            structured: self.structured,
            extended: self.extended,
            base_allocation,
            bitmaps,
            block_sizes_agreed,
        }
    }

    fn export_name(&self, data: &[u8], out: &mut Vec<u8>) -> Step {
        let Ok(name) = std::str::from_utf8(data) else {
            return Step::Close;
        };
        let Some(i) = self.catalog.find(name) else {
            // No error replies exist for EXPORT_NAME: the session ends.
            return Step::Close;
        };
        out.extend_from_slice(&self.catalog.exports[i].size.to_be_bytes());
        out.extend_from_slice(&self.flags(i).to_be_bytes());
        if !self.no_zeroes {
            out.extend_from_slice(&[0u8; 124]);
        }
        Step::Go(self.session(i, false))
    }

    fn info_or_go(&self, o: u32, data: &[u8], out: &mut Vec<u8>) -> Step {
        let Some(req) = proto::parse_info_request(data) else {
            proto::put_option_reply(out, o, rep::ERR_INVALID, b"malformed INFO/GO request");
            return Step::Continue;
        };
        let Some(i) = self.catalog.find(req.name) else {
            let msg = format!("no export named '{}'", req.name);
            proto::put_option_reply(out, o, rep::ERR_UNKNOWN, msg.as_bytes());
            return Step::Continue;
        };
        let e = &self.catalog.exports[i];
        let mut d = Vec::with_capacity(16);
        d.extend_from_slice(&info::EXPORT.to_be_bytes());
        d.extend_from_slice(&e.size.to_be_bytes());
        d.extend_from_slice(&self.flags(i).to_be_bytes());
        proto::put_option_reply(out, o, rep::INFO, &d);
        // Block sizes always: the minimum is 1 unless the export is strict (any byte is
        // served, by read-modify-write), the preferred size the device's block (at least
        // 4 KiB). Only a client that asked for them (in GO) must honour them.
        let mut d = Vec::with_capacity(14);
        d.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&e.min_block.to_be_bytes());
        d.extend_from_slice(&e.preferred_block.to_be_bytes());
        d.extend_from_slice(&e.max_payload.to_be_bytes());
        proto::put_option_reply(out, o, rep::INFO, &d);
        if req.items.contains(&info::NAME) {
            let mut d = info::NAME.to_be_bytes().to_vec();
            d.extend_from_slice(e.name.as_bytes());
            proto::put_option_reply(out, o, rep::INFO, &d);
        }
        if req.items.contains(&info::DESCRIPTION) && !e.description.is_empty() {
            let mut d = info::DESCRIPTION.to_be_bytes().to_vec();
            d.extend_from_slice(e.description.as_bytes());
            proto::put_option_reply(out, o, rep::INFO, &d);
        }
        proto::put_option_reply(out, o, rep::ACK, &[]);
        if o == opt::GO {
            Step::Go(self.session(i, req.items.contains(&info::BLOCK_SIZE)))
        } else {
            Step::Continue
        }
    }

    fn meta_context(&mut self, o: u32, data: &[u8], out: &mut Vec<u8>) -> Step {
        if o == opt::SET_META_CONTEXT {
            // A SET replaces the previous selection even when it fails.
            self.meta = None;
        }
        if !self.structured {
            proto::put_option_reply(
                out,
                o,
                rep::ERR_INVALID,
                b"negotiate structured replies first",
            );
            return Step::Continue;
        }
        let Some(req) = proto::parse_meta_request(data, MAX_META_QUERIES) else {
            proto::put_option_reply(out, o, rep::ERR_INVALID, b"malformed metadata request");
            return Step::Continue;
        };
        let Some(export) = self.catalog.find(req.name) else {
            let msg = format!("no export named '{}'", req.name);
            proto::put_option_reply(out, o, rep::ERR_UNKNOWN, msg.as_bytes());
            return Step::Continue;
        };
        let set = o == opt::SET_META_CONTEXT;
        let names = (self.bitmaps)(export);
        let contexts = select_contexts(&req.queries, &names, set);
        let mut base = false;
        let mut bitmaps = Vec::new();
        for (k, c) in contexts.iter().enumerate() {
            // Ids in a SET: base:allocation's own, then one per bitmap in query order.
            let id = match (set, c) {
                (false, _) => 0,
                (true, None) => proto::BASE_ALLOCATION_ID,
                (true, Some(_)) => proto::BASE_ALLOCATION_ID + 1 + k as u32,
            };
            let text = match c {
                None => {
                    base = true;
                    proto::BASE_ALLOCATION.to_string()
                }
                Some(b) => {
                    bitmaps.push((id, b.clone()));
                    format!("{}{b}", proto::DIRTY_BITMAP)
                }
            };
            let mut d = id.to_be_bytes().to_vec();
            d.extend_from_slice(text.as_bytes());
            proto::put_option_reply(out, o, rep::META_CONTEXT, &d);
        }
        if set {
            self.meta = Some((req.name.to_string(), base, bitmaps));
        }
        proto::put_option_reply(out, o, rep::ACK, &[]);
        Step::Continue
    }
}

/// The contexts `queries` ask for, in order and each once: `None` for base:allocation,
/// a bitmap's name for its context. A LIST with no query lists every context; in a LIST
/// a namespace (`base:`, `qemu:`) or `qemu:dirty-bitmap:` with no name lists all of its
/// kind. A SET takes whole names only. Queries for anything else are left out, as the
/// protocol asks (the client sees the context was not selected).
fn select_contexts(queries: &[&str], bitmaps: &[String], set: bool) -> Vec<Option<String>> {
    let mut out: Vec<Option<String>> = Vec::new();
    let mut add = |c: Option<String>| {
        if !out.contains(&c) {
            out.push(c);
        }
    };
    let every = |add: &mut dyn FnMut(Option<String>)| {
        for b in bitmaps {
            add(Some(b.clone()));
        }
    };
    if !set && queries.is_empty() {
        add(None);
        every(&mut add);
        return out;
    }
    for q in queries {
        if *q == proto::BASE_ALLOCATION || (!set && *q == "base:") {
            add(None);
        } else if !set && (*q == "qemu:" || *q == proto::DIRTY_BITMAP) {
            every(&mut add);
        } else if let Some(name) = q.strip_prefix(proto::DIRTY_BITMAP) {
            if bitmaps.iter().any(|b| b == name) {
                add(Some(name.to_string()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog() -> Catalog {
        Catalog {
            exports: vec![
                ExportInfo {
                    name: "a".into(),
                    description: "first".into(),
                    size: 1 << 20,
                    flags: tflags::SEND_FLUSH,
                    min_block: 512,
                    preferred_block: 4096,
                    max_payload: 32 << 20,
                    default: false,
                },
                ExportInfo {
                    name: "b".into(),
                    description: String::new(),
                    size: 2 << 20,
                    flags: tflags::READ_ONLY,
                    min_block: 512,
                    preferred_block: 4096,
                    max_payload: 32 << 20,
                    default: true,
                },
            ],
        }
    }

    fn h(option: u32, len: usize) -> OptionHeader {
        OptionHeader {
            option,
            len: len as u32,
        }
    }

    /// Splits option replies into (option, type, data).
    fn replies(mut b: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
        let mut v = Vec::new();
        while !b.is_empty() {
            assert_eq!(&b[0..8], &proto::REPLY_MAGIC.to_be_bytes());
            let o = u32::from_be_bytes(b[8..12].try_into().unwrap());
            let t = u32::from_be_bytes(b[12..16].try_into().unwrap());
            let n = u32::from_be_bytes(b[16..20].try_into().unwrap()) as usize;
            v.push((o, t, b[20..20 + n].to_vec()));
            b = &b[20 + n..];
        }
        v
    }

    fn go_data(name: &str, items: &[u16]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(items.len() as u16).to_be_bytes());
        for i in items {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    }

    fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q.as_bytes());
        }
        d
    }

    #[test]
    fn list_names_every_export() {
        let c = catalog();
        let mut n = Negotiator::new(&c, TlsMode::Off, 3);
        let mut out = Vec::new();
        assert_eq!(n.option(h(opt::LIST, 0), &[], &mut out), Step::Continue);
        let r = replies(&out);
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].1, rep::SERVER);
        assert_eq!(&r[0].2[4..], b"afirst");
        assert_eq!(r[2].1, rep::ACK);
        out.clear();
        n.option(h(opt::LIST, 1), &[0], &mut out);
        assert_eq!(replies(&out)[0].1, rep::ERR_INVALID);
    }

    #[test]
    fn go_on_the_default_export() {
        let c = catalog();
        let mut n = Negotiator::new(&c, TlsMode::Off, 3);
        let mut out = Vec::new();
        let d = go_data("", &[info::BLOCK_SIZE]);
        let step = n.option(h(opt::GO, d.len()), &d, &mut out);
        let Step::Go(s) = step else {
            panic!("{step:?}")
        };
        assert_eq!(s.export, 1);
        assert!(s.block_sizes_agreed);
        assert_eq!(s.flags, tflags::READ_ONLY | tflags::HAS_FLAGS);
        let r = replies(&out);
        assert_eq!(r.last().unwrap().1, rep::ACK);
        let export = r
            .iter()
            .find(|x| x.2[..2] == info::EXPORT.to_be_bytes())
            .unwrap();
        assert_eq!(
            u64::from_be_bytes(export.2[2..10].try_into().unwrap()),
            2 << 20
        );
    }

    #[test]
    fn unknown_export_and_malformed_go_keep_haggling() {
        let c = catalog();
        let mut n = Negotiator::new(&c, TlsMode::Off, 3);
        let mut out = Vec::new();
        let d = go_data("nope", &[]);
        assert_eq!(n.option(h(opt::GO, d.len()), &d, &mut out), Step::Continue);
        assert_eq!(replies(&out)[0].1, rep::ERR_UNKNOWN);
        out.clear();
        assert_eq!(
            n.option(h(opt::GO, 3), &[0, 0, 9], &mut out),
            Step::Continue
        );
        assert_eq!(replies(&out)[0].1, rep::ERR_INVALID);
        out.clear();
        assert_eq!(n.option(h(99, 0), &[], &mut out), Step::Continue);
        assert_eq!(replies(&out)[0].1, rep::ERR_UNSUP);
    }

    #[test]
    fn export_name_sends_size_flags_and_zeroes() {
        let c = catalog();
        let mut out = Vec::new();
        let n = Negotiator::new(&c, TlsMode::Off, 1);
        let Step::Go(s) = n.export_name(b"a", &mut out) else {
            panic!()
        };
        assert_eq!(s.export, 0);
        assert_eq!(out.len(), 8 + 2 + 124);
        out.clear();
        let n = Negotiator::new(&c, TlsMode::Off, 3);
        assert!(matches!(n.export_name(b"a", &mut out), Step::Go(_)));
        assert_eq!(out.len(), 10);
        out.clear();
        assert_eq!(n.export_name(b"zzz", &mut out), Step::Close);
        assert!(out.is_empty());
    }

    #[test]
    fn meta_context_needs_structured_replies_and_selects_base_allocation() {
        let c = catalog();
        let mut n = Negotiator::new(&c, TlsMode::Off, 3);
        let mut out = Vec::new();
        let d = meta_data("a", &[proto::BASE_ALLOCATION]);
        n.option(h(opt::SET_META_CONTEXT, d.len()), &d, &mut out);
        assert_eq!(replies(&out)[0].1, rep::ERR_INVALID);
        out.clear();
        n.option(h(opt::STRUCTURED_REPLY, 0), &[], &mut out);
        out.clear();
        n.option(h(opt::SET_META_CONTEXT, d.len()), &d, &mut out);
        let r = replies(&out);
        assert_eq!(r[0].1, rep::META_CONTEXT);
        assert_eq!(&r[0].2[4..], proto::BASE_ALLOCATION.as_bytes());
        out.clear();
        let g = go_data("a", &[]);
        let Step::Go(s) = n.option(h(opt::GO, g.len()), &g, &mut out) else {
            panic!()
        };
        assert!(s.structured && s.base_allocation);
        assert_ne!(s.flags & tflags::SEND_DF, 0);
        // Selected for "a", so not for "b".
        let mut n2 = Negotiator::new(&c, TlsMode::Off, 3);
        n2.option(h(opt::STRUCTURED_REPLY, 0), &[], &mut out);
        n2.option(h(opt::SET_META_CONTEXT, d.len()), &d, &mut out);
        let g = go_data("b", &[]);
        let Step::Go(s) = n2.option(h(opt::GO, g.len()), &g, &mut out) else {
            panic!()
        };
        assert!(!s.base_allocation);
    }

    #[test]
    fn dirty_bitmaps_are_contexts_listed_and_set_beside_base_allocation() {
        let c = catalog();
        let names = |i: usize| {
            if i == 0 {
                vec!["b0".to_string(), "c1".to_string()]
            } else {
                Vec::new()
            }
        };
        let mut n = Negotiator::new(&c, TlsMode::Off, 3).with_bitmaps(&names);
        let mut out = Vec::new();
        n.option(h(opt::STRUCTURED_REPLY, 0), &[], &mut out);
        let contexts = |n: &mut Negotiator, o: u32, queries: &[&str]| {
            let d = meta_data("a", queries);
            let mut out = Vec::new();
            n.option(h(o, d.len()), &d, &mut out);
            let r = replies(&out);
            assert_eq!(r.last().unwrap().1, rep::ACK);
            r[..r.len() - 1]
                .iter()
                .map(|(_, t, d)| {
                    assert_eq!(*t, rep::META_CONTEXT);
                    let id = u32::from_be_bytes(d[..4].try_into().unwrap());
                    (id, String::from_utf8(d[4..].to_vec()).unwrap())
                })
                .collect::<Vec<_>>()
        };
        let l = opt::LIST_META_CONTEXT;
        let all = [
            (0, "base:allocation".to_string()),
            (0, "qemu:dirty-bitmap:b0".to_string()),
            (0, "qemu:dirty-bitmap:c1".to_string()),
        ];
        assert_eq!(contexts(&mut n, l, &[]), all);
        assert_eq!(contexts(&mut n, l, &["qemu:"]), all[1..]);
        assert_eq!(contexts(&mut n, l, &["qemu:dirty-bitmap:"]), all[1..]);
        assert_eq!(
            contexts(&mut n, l, &["qemu:dirty-bitmap:c1", "x:y"]),
            all[2..]
        );
        // A SET takes whole names, each once; unknown ones are left out.
        let set = contexts(
            &mut n,
            opt::SET_META_CONTEXT,
            &[
                "qemu:dirty-bitmap:c1",
                "qemu:dirty-bitmap:nope",
                "qemu:",
                "base:allocation",
                "qemu:dirty-bitmap:c1",
            ],
        );
        assert_eq!(
            set,
            [
                (2, "qemu:dirty-bitmap:c1".to_string()),
                (1, "base:allocation".to_string())
            ]
        );
        let g = go_data("a", &[]);
        let Step::Go(s) = n.option(h(opt::GO, g.len()), &g, &mut out) else {
            panic!()
        };
        assert!(s.base_allocation);
        assert_eq!(s.bitmaps, [(2, "c1".to_string())]);
        // Export "b" has no bitmaps: nothing to select there.
        let mut n = Negotiator::new(&c, TlsMode::Off, 3).with_bitmaps(&names);
        n.option(h(opt::STRUCTURED_REPLY, 0), &[], &mut out);
        let d = meta_data("b", &["qemu:dirty-bitmap:b0"]);
        out.clear();
        n.option(h(opt::SET_META_CONTEXT, d.len()), &d, &mut out);
        assert_eq!(replies(&out).len(), 1);
    }

    #[test]
    fn tls_required_refuses_everything_but_starttls() {
        let c = catalog();
        let mut n = Negotiator::new(&c, TlsMode::Required, 3);
        let mut out = Vec::new();
        n.option(h(opt::LIST, 0), &[], &mut out);
        assert_eq!(replies(&out)[0].1, rep::ERR_TLS_REQD);
        out.clear();
        let g = go_data("a", &[]);
        assert_eq!(n.option(h(opt::GO, g.len()), &g, &mut out), Step::Continue);
        assert_eq!(replies(&out)[0].1, rep::ERR_TLS_REQD);
        assert_eq!(
            n.option(h(opt::EXPORT_NAME, 1), b"a", &mut out),
            Step::Close
        );
        out.clear();
        assert_eq!(n.option(h(opt::STARTTLS, 0), &[], &mut out), Step::StartTls);
        n.tls_started();
        out.clear();
        assert!(matches!(
            n.option(h(opt::GO, g.len()), &g, &mut out),
            Step::Go(_)
        ));
        // Off: STARTTLS is refused by policy.
        let mut n = Negotiator::new(&c, TlsMode::Off, 3);
        out.clear();
        assert_eq!(n.option(h(opt::STARTTLS, 0), &[], &mut out), Step::Continue);
        assert_eq!(replies(&out)[0].1, rep::ERR_POLICY);
    }

    #[test]
    fn abort_acks_and_closes() {
        let c = catalog();
        let mut n = Negotiator::new(&c, TlsMode::Off, 3);
        let mut out = Vec::new();
        assert_eq!(n.option(h(opt::ABORT, 0), &[], &mut out), Step::Close);
        assert_eq!(replies(&out)[0].1, rep::ACK);
    }
}
