//! The NBD wire format: constants, and pure encoders and decoders (bytes in, values out).
//!
//! Everything here follows the protocol document (`doc/proto.md` of the
//! NetworkBlockDevice/nbd repository). Nothing here does I/O or keeps state beyond its
//! arguments, so the decoders can be fuzzed on their own.

pub mod command;

/// "NBDMAGIC", the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": newstyle negotiation, and the magic of every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every option reply.
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Magic of a request with extended headers (64-bit lengths).
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Magic of a reply chunk with extended headers.
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;
/// Bytes of an extended request header, and of an extended reply header.
pub const EXTENDED_HEADER: usize = 32;

/// Handshake flags (server).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// The server will not send the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// The client does not want the 124 zero bytes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flags.
pub mod tflags {
    /// Always set.
    pub const HAS_FLAGS: u16 = 1 << 0;
    /// The export is read-only.
    pub const READ_ONLY: u16 = 1 << 1;
    /// `NBD_CMD_FLUSH` is supported.
    pub const SEND_FLUSH: u16 = 1 << 2;
    /// `NBD_CMD_FLAG_FUA` is supported.
    pub const SEND_FUA: u16 = 1 << 3;
    /// The export is rotational (a hint for the client's elevator).
    pub const ROTATIONAL: u16 = 1 << 4;
    /// `NBD_CMD_TRIM` is supported.
    pub const SEND_TRIM: u16 = 1 << 5;
    /// `NBD_CMD_WRITE_ZEROES` is supported.
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    /// `NBD_CMD_FLAG_DF` is supported.
    pub const SEND_DF: u16 = 1 << 7;
    /// Several connections see one coherent export.
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    /// `NBD_CMD_CACHE` is supported.
    pub const SEND_CACHE: u16 = 1 << 10;
    /// `NBD_CMD_FLAG_FAST_ZERO` is supported.
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Option codes.
pub mod opt {
    /// Choose an export and start transmission (no error replies).
    pub const EXPORT_NAME: u32 = 1;
    /// End the session.
    pub const ABORT: u32 = 2;
    /// List exports.
    pub const LIST: u32 = 3;
    /// Upgrade the connection to TLS.
    pub const STARTTLS: u32 = 5;
    /// Describe an export.
    pub const INFO: u32 = 6;
    /// Describe an export and start transmission.
    pub const GO: u32 = 7;
    /// Use structured replies.
    pub const STRUCTURED_REPLY: u32 = 8;
    /// List metadata contexts.
    pub const LIST_META_CONTEXT: u32 = 9;
    /// Select metadata contexts.
    pub const SET_META_CONTEXT: u32 = 10;
    /// 64-bit headers (an experimental extension this server does not offer).
    pub const EXTENDED_HEADERS: u32 = 11;

    /// Name for logs.
    pub fn name(option: u32) -> &'static str {
        match option {
            EXPORT_NAME => "EXPORT_NAME",
            ABORT => "ABORT",
            LIST => "LIST",
            STARTTLS => "STARTTLS",
            INFO => "INFO",
            GO => "GO",
            STRUCTURED_REPLY => "STRUCTURED_REPLY",
            LIST_META_CONTEXT => "LIST_META_CONTEXT",
            SET_META_CONTEXT => "SET_META_CONTEXT",
            EXTENDED_HEADERS => "EXTENDED_HEADERS",
            _ => "unknown",
        }
    }
}

/// Option reply types.
pub mod rep {
    /// Done.
    pub const ACK: u32 = 1;
    /// An export, in reply to LIST.
    pub const SERVER: u32 = 2;
    /// Information about an export, in reply to INFO or GO.
    pub const INFO: u32 = 3;
    /// A metadata context.
    pub const META_CONTEXT: u32 = 4;
    const ERR: u32 = 1 << 31;
    /// Unknown option.
    pub const ERR_UNSUP: u32 = ERR + 1;
    /// Forbidden by policy.
    pub const ERR_POLICY: u32 = ERR + 2;
    /// Syntactically or semantically invalid.
    pub const ERR_INVALID: u32 = ERR + 3;
    /// Not supported on this platform (e.g. TLS not configured).
    pub const ERR_PLATFORM: u32 = ERR + 4;
    /// TLS must come first.
    pub const ERR_TLS_REQD: u32 = ERR + 5;
    /// No such export.
    pub const ERR_UNKNOWN: u32 = ERR + 6;
    /// The server is shutting down.
    pub const ERR_SHUTDOWN: u32 = ERR + 7;
    /// Block sizes must be requested.
    pub const ERR_BLOCK_SIZE_REQD: u32 = ERR + 8;
    /// Too large.
    pub const ERR_TOO_BIG: u32 = ERR + 9;
    /// Extended headers are on (or required) and the option would go back on them.
    pub const ERR_EXT_HEADER_REQD: u32 = ERR + 10;
}

/// `NBD_INFO_*` types.
pub mod info {
    /// Size and transmission flags.
    pub const EXPORT: u16 = 0;
    /// Canonical name.
    pub const NAME: u16 = 1;
    /// Description.
    pub const DESCRIPTION: u16 = 2;
    /// Minimum, preferred and maximum block sizes.
    pub const BLOCK_SIZE: u16 = 3;
}

/// Command types.
pub mod cmd {
    /// Read.
    pub const READ: u16 = 0;
    /// Write.
    pub const WRITE: u16 = 1;
    /// Disconnect.
    pub const DISC: u16 = 2;
    /// Flush.
    pub const FLUSH: u16 = 3;
    /// Trim (discard).
    pub const TRIM: u16 = 4;
    /// Prefetch hint.
    pub const CACHE: u16 = 5;
    /// Write zeroes.
    pub const WRITE_ZEROES: u16 = 6;
    /// Block status.
    pub const BLOCK_STATUS: u16 = 7;

    /// Name for logs.
    pub fn name(command: u16) -> &'static str {
        match command {
            READ => "READ",
            WRITE => "WRITE",
            DISC => "DISC",
            FLUSH => "FLUSH",
            TRIM => "TRIM",
            CACHE => "CACHE",
            WRITE_ZEROES => "WRITE_ZEROES",
            BLOCK_STATUS => "BLOCK_STATUS",
            _ => "unknown",
        }
    }
}

/// Command flags.
pub mod cflags {
    /// Force unit access.
    pub const FUA: u16 = 1 << 0;
    /// Write zeroes must not punch a hole.
    pub const NO_HOLE: u16 = 1 << 1;
    /// Read replies in one chunk.
    pub const DF: u16 = 1 << 2;
    /// One extent per block status reply.
    pub const REQ_ONE: u16 = 1 << 3;
    /// Fail write zeroes that would not be fast.
    pub const FAST_ZERO: u16 = 1 << 4;
    /// (Extended headers) the length is the payload's.
    pub const PAYLOAD_LEN: u16 = 1 << 5;
}

/// Structured reply chunk types and flags.
pub mod chunk {
    /// Last chunk of a reply.
    pub const FLAG_DONE: u16 = 1 << 0;
    /// No payload.
    pub const NONE: u16 = 0;
    /// Offset and data.
    pub const OFFSET_DATA: u16 = 1;
    /// Offset and hole length.
    pub const OFFSET_HOLE: u16 = 2;
    /// Context id and extents.
    pub const BLOCK_STATUS: u16 = 5;
    /// (Extended headers) context id and 64-bit extents.
    pub const BLOCK_STATUS_EXT: u16 = 6;
    /// Error, message.
    pub const ERROR: u16 = (1 << 15) + 1;
    /// Error at an offset, message.
    pub const ERROR_OFFSET: u16 = (1 << 15) + 2;
}

/// Errors of the transmission phase (sent as numbers, independent of the platform).
pub mod errno {
    /// Operation not permitted (a write to a read-only export).
    pub const EPERM: u32 = 1;
    /// I/O error.
    pub const EIO: u32 = 5;
    /// Out of memory.
    pub const ENOMEM: u32 = 12;
    /// Invalid argument.
    pub const EINVAL: u32 = 22;
    /// No space (a write past the end).
    pub const ENOSPC: u32 = 28;
    /// Value too large.
    pub const EOVERFLOW: u32 = 75;
    /// Not supported (a fast zero that would not be fast).
    pub const ENOTSUP: u32 = 95;
    /// The server is shutting down.
    pub const ESHUTDOWN: u32 = 108;

    /// The NBD error for a local errno: the few the protocol names, else EIO.
    pub fn from_local(e: i32) -> u32 {
        match e {
            libc::EPERM | libc::EROFS => EPERM,
            libc::ENOMEM => ENOMEM,
            libc::EINVAL => EINVAL,
            libc::ENOSPC | libc::EDQUOT | libc::EFBIG => ENOSPC,
            libc::EOVERFLOW => EOVERFLOW,
            libc::EOPNOTSUPP => ENOTSUP,
            libc::ESHUTDOWN => ESHUTDOWN,
            _ => EIO,
        }
    }

    /// The local errno for an NBD error a server sent: the ones the protocol names, else
    /// EIO (a server may send anything).
    pub fn to_local(e: u32) -> i32 {
        match e {
            EPERM => libc::EPERM,
            ENOMEM => libc::ENOMEM,
            EINVAL => libc::EINVAL,
            ENOSPC => libc::ENOSPC,
            EOVERFLOW => libc::EOVERFLOW,
            ENOTSUP => libc::EOPNOTSUPP,
            ESHUTDOWN => libc::ESHUTDOWN,
            _ => libc::EIO,
        }
    }
}

/// `base:allocation` status flags.
pub mod state {
    /// Unallocated.
    pub const HOLE: u32 = 1 << 0;
    /// Reads as zeroes.
    pub const ZERO: u32 = 1 << 1;
    /// `qemu:dirty-bitmap:NAME`: changed since the bitmap started.
    pub const DIRTY: u32 = 1 << 0;
}

/// The allocation context.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Its id in this server's replies.
pub const BASE_ALLOCATION_ID: u32 = 1;
/// The prefix of a dirty bitmap's context (qemu's namespace); the bitmap's name follows.
pub const DIRTY_BITMAP: &str = "qemu:dirty-bitmap:";

/// Bytes in an option request header (magic, option, length).
pub const OPTION_HEADER: usize = 16;
/// Bytes in a transmission request header.
pub const REQUEST_HEADER: usize = 28;
/// Bytes in a simple reply.
pub const SIMPLE_REPLY: usize = 16;
/// Bytes in a structured reply chunk header.
pub const CHUNK_HEADER: usize = 20;

pub(crate) fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
pub(crate) fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
pub(crate) fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// An option request's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// `NBD_OPT_*`.
    pub option: u32,
    /// Bytes of data that follow.
    pub len: u32,
}

/// Decodes an option header; `None` if the magic is wrong (the client is not speaking
/// NBD: the server hangs up).
pub fn parse_option_header(b: &[u8; OPTION_HEADER]) -> Option<OptionHeader> {
    (be64(&b[0..8]) == IHAVEOPT).then(|| OptionHeader {
        option: be32(&b[8..12]),
        len: be32(&b[12..16]),
    })
}

/// Appends an option reply.
pub fn put_option_reply(out: &mut Vec<u8>, option: u32, reply: u32, data: &[u8]) {
    out.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// A reader over option data that never reads past its end.
pub struct Fields<'a> {
    data: &'a [u8],
}

impl<'a> Fields<'a> {
    /// Reads `data`.
    pub fn new(data: &'a [u8]) -> Fields<'a> {
        Fields { data }
    }
    /// Next 16-bit field.
    pub fn u16(&mut self) -> Option<u16> {
        let v = self.data.get(..2).map(be16)?;
        self.data = &self.data[2..];
        Some(v)
    }
    /// Next 32-bit field.
    pub fn u32(&mut self) -> Option<u32> {
        let v = self.data.get(..4).map(be32)?;
        self.data = &self.data[4..];
        Some(v)
    }
    /// Next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let v = self.data.get(..n)?;
        self.data = &self.data[n..];
        Some(v)
    }
    /// A 32-bit length followed by that many bytes of UTF-8 (at most 4096 bytes, as the
    /// protocol limits strings).
    pub fn string(&mut self) -> Option<&'a str> {
        let n = self.u32()? as usize;
        if n > 4096 {
            return None;
        }
        std::str::from_utf8(self.bytes(n)?).ok()
    }
    /// Whether everything was read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// The data of an `NBD_OPT_INFO` or `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest<'a> {
    /// Export name.
    pub name: &'a str,
    /// `NBD_INFO_*` items asked for.
    pub items: Vec<u16>,
}

/// Decodes the data of INFO or GO; `None` if it is malformed.
pub fn parse_info_request(data: &[u8]) -> Option<InfoRequest<'_>> {
    let mut f = Fields::new(data);
    let name = f.string()?;
    let n = f.u16()? as usize;
    let mut items = Vec::with_capacity(n.min(16));
    for _ in 0..n {
        items.push(f.u16()?);
    }
    f.is_empty().then_some(InfoRequest { name, items })
}

/// The data of `NBD_OPT_LIST_META_CONTEXT` or `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRequest<'a> {
    /// Export name.
    pub name: &'a str,
    /// Queries, each `namespace:leaf`.
    pub queries: Vec<&'a str>,
}

/// Decodes a metadata context request; `None` if it is malformed. `max_queries` bounds
/// the work one request can cause.
pub fn parse_meta_request(data: &[u8], max_queries: usize) -> Option<MetaRequest<'_>> {
    let mut f = Fields::new(data);
    let name = f.string()?;
    let n = f.u32()? as usize;
    if n > max_queries {
        return None;
    }
    let mut queries = Vec::with_capacity(n);
    for _ in 0..n {
        queries.push(f.string()?);
    }
    f.is_empty().then_some(MetaRequest { name, queries })
}

/// A transmission request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// `NBD_CMD_FLAG_*`.
    pub flags: u16,
    /// `NBD_CMD_*`.
    pub command: u16,
    /// Echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Byte length (of the payload, for a write); 32 bits in a compact header, 64 in an
    /// extended one.
    pub len: u64,
}

/// What the request decoder found at the start of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoded {
    /// Not enough bytes for a header yet.
    Incomplete,
    /// A header; its payload (for a write) follows in the stream.
    Request(Request),
    /// Not a request: the stream cannot be trusted any more and the server hangs up.
    BadMagic(u32),
}

/// Decodes one request header from the start of `b`.
pub fn parse_request(b: &[u8]) -> Decoded {
    if b.len() < REQUEST_HEADER {
        return Decoded::Incomplete;
    }
    let magic = be32(&b[0..4]);
    if magic != REQUEST_MAGIC {
        return Decoded::BadMagic(magic);
    }
    Decoded::Request(Request {
        flags: be16(&b[4..6]),
        command: be16(&b[6..8]),
        cookie: be64(&b[8..16]),
        offset: be64(&b[16..24]),
        len: u64::from(be32(&b[24..28])),
    })
}

/// Decodes one extended request header (32 bytes, 64-bit length) from the start of `b`.
pub fn parse_extended_request(b: &[u8]) -> Decoded {
    if b.len() < EXTENDED_HEADER {
        return Decoded::Incomplete;
    }
    let magic = be32(&b[0..4]);
    if magic != EXTENDED_REQUEST_MAGIC {
        return Decoded::BadMagic(magic);
    }
    Decoded::Request(Request {
        flags: be16(&b[4..6]),
        command: be16(&b[6..8]),
        cookie: be64(&b[8..16]),
        offset: be64(&b[16..24]),
        len: be64(&b[24..32]),
    })
}

/// An extended reply chunk header: `offset` echoes the request's, `len` payload bytes
/// follow.
pub fn extended_chunk_header(
    flags: u16,
    kind: u16,
    cookie: u64,
    offset: u64,
    len: u64,
) -> [u8; EXTENDED_HEADER] {
    let mut h = [0u8; EXTENDED_HEADER];
    h[0..4].copy_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&flags.to_be_bytes());
    h[6..8].copy_from_slice(&kind.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..24].copy_from_slice(&offset.to_be_bytes());
    h[24..32].copy_from_slice(&len.to_be_bytes());
    h
}

/// Encodes a request header (for tests and clients).
pub fn put_request(out: &mut Vec<u8>, r: &Request) {
    out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out.extend_from_slice(&r.flags.to_be_bytes());
    out.extend_from_slice(&r.command.to_be_bytes());
    out.extend_from_slice(&r.cookie.to_be_bytes());
    out.extend_from_slice(&r.offset.to_be_bytes());
    out.extend_from_slice(&(r.len as u32).to_be_bytes());
}

/// A reply header as a client reads it: a simple reply, or one chunk of a structured
/// reply (compact or extended).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHeader {
    /// A simple reply: its error (0: success) and cookie; a successful read's data
    /// follows.
    Simple {
        /// `NBD_E*`, 0 for success.
        error: u32,
        /// The request's cookie.
        cookie: u64,
    },
    /// A structured reply chunk; `len` payload bytes follow.
    Chunk {
        /// `chunk::FLAG_*`.
        flags: u16,
        /// `chunk::*` type.
        kind: u16,
        /// The request's cookie.
        cookie: u64,
        /// (Extended headers) the request's offset; 0 otherwise.
        offset: u64,
        /// Payload bytes that follow.
        len: u64,
    },
}

/// What the reply decoder found at the start of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodedReply {
    /// Not enough bytes for a header yet.
    Incomplete,
    /// A header of `size` bytes.
    Header(ReplyHeader, usize),
    /// Not a reply this connection can carry (bad magic, or a simple reply where extended
    /// headers forbid them): the stream cannot be trusted any more.
    Bad(u32),
}

/// Decodes one reply header from the start of `b`; `extended`: extended headers were
/// negotiated (then every reply is an extended chunk).
pub fn parse_reply(b: &[u8], extended: bool) -> DecodedReply {
    if b.len() < 4 {
        return DecodedReply::Incomplete;
    }
    let magic = be32(&b[0..4]);
    match magic {
        SIMPLE_REPLY_MAGIC if !extended => {
            if b.len() < SIMPLE_REPLY {
                return DecodedReply::Incomplete;
            }
            DecodedReply::Header(
                ReplyHeader::Simple {
                    error: be32(&b[4..8]),
                    cookie: be64(&b[8..16]),
                },
                SIMPLE_REPLY,
            )
        }
        STRUCTURED_REPLY_MAGIC if !extended => {
            if b.len() < CHUNK_HEADER {
                return DecodedReply::Incomplete;
            }
            DecodedReply::Header(
                ReplyHeader::Chunk {
                    flags: be16(&b[4..6]),
                    kind: be16(&b[6..8]),
                    cookie: be64(&b[8..16]),
                    offset: 0,
                    len: u64::from(be32(&b[16..20])),
                },
                CHUNK_HEADER,
            )
        }
        EXTENDED_REPLY_MAGIC if extended => {
            if b.len() < EXTENDED_HEADER {
                return DecodedReply::Incomplete;
            }
            DecodedReply::Header(
                ReplyHeader::Chunk {
                    flags: be16(&b[4..6]),
                    kind: be16(&b[6..8]),
                    cookie: be64(&b[8..16]),
                    offset: be64(&b[16..24]),
                    len: be64(&b[24..32]),
                },
                EXTENDED_HEADER,
            )
        }
        m => DecodedReply::Bad(m),
    }
}

/// Encodes an extended request header: `len` is the range, or the payload's length for
/// a write (which then carries `cflags::PAYLOAD_LEN`).
pub fn put_extended_request(
    out: &mut Vec<u8>,
    flags: u16,
    command: u16,
    cookie: u64,
    offset: u64,
    len: u64,
) {
    out.extend_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&command.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// A simple reply header.
pub fn simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY] {
    let mut h = [0u8; SIMPLE_REPLY];
    h[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    h[4..8].copy_from_slice(&error.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h
}

/// A structured reply chunk header for `len` bytes of payload.
pub fn chunk_header(flags: u16, kind: u16, cookie: u64, len: u32) -> [u8; CHUNK_HEADER] {
    let mut h = [0u8; CHUNK_HEADER];
    h[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&flags.to_be_bytes());
    h[6..8].copy_from_slice(&kind.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..20].copy_from_slice(&len.to_be_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trip() {
        let r = Request {
            flags: cflags::FUA,
            command: cmd::WRITE,
            cookie: 0x0102_0304_0506_0708,
            offset: 1 << 40,
            len: 4096,
        };
        let mut b = Vec::new();
        put_request(&mut b, &r);
        assert_eq!(b.len(), REQUEST_HEADER);
        assert_eq!(parse_request(&b), Decoded::Request(r));
        assert_eq!(parse_request(&b[..27]), Decoded::Incomplete);
        b[0] ^= 1;
        assert!(matches!(parse_request(&b), Decoded::BadMagic(_)));
    }

    #[test]
    fn info_request_bounds() {
        let mut d = Vec::new();
        d.extend_from_slice(&3u32.to_be_bytes());
        d.extend_from_slice(b"abc");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&info::NAME.to_be_bytes());
        let r = parse_info_request(&d).unwrap();
        assert_eq!(r.name, "abc");
        assert_eq!(r.items, vec![info::BLOCK_SIZE, info::NAME]);
        // Truncated, trailing bytes, a name longer than the data: all refused.
        assert!(parse_info_request(&d[..d.len() - 1]).is_none());
        let mut long = d.clone();
        long.push(0);
        assert!(parse_info_request(&long).is_none());
        let mut lie = d.clone();
        lie[3] = 200;
        assert!(parse_info_request(&lie).is_none());
    }

    #[test]
    fn meta_request_bounds() {
        let mut d = Vec::new();
        d.extend_from_slice(&0u32.to_be_bytes());
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&(BASE_ALLOCATION.len() as u32).to_be_bytes());
        d.extend_from_slice(BASE_ALLOCATION.as_bytes());
        let r = parse_meta_request(&d, 16).unwrap();
        assert_eq!((r.name, r.queries), ("", vec![BASE_ALLOCATION]));
        assert!(parse_meta_request(&d, 0).is_none());
        assert!(parse_meta_request(&d[..d.len() - 2], 16).is_none());
    }
}
