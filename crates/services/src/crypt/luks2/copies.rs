//! The binary header copies of LUKS2: reading and checking each, choosing between the
//! two, and encoding one.

use serde_json::Value;

use super::json::{Fault, Meta};
use super::{Header, BINARY_BYTES, HEADER_BYTES, MAGIC, MAGIC_SECONDARY};
use crate::crypt::{CryptError, Hash, ReadAt};

// Fields of the binary header: (offset, bytes).
const VERSION_AT: usize = 6;
const SIZE_AT: usize = 8;
pub(super) const SEQID_AT: usize = 16;
const LABEL_AT: usize = 24;
const CSUM_ALG_AT: usize = 72;
const SALT_AT: usize = 104;
const UUID_AT: usize = 168;
const SUBSYSTEM_AT: usize = 208;
const OFFSET_AT: usize = 256;
const CSUM_AT: usize = 448;
pub(super) const LABEL_BYTES: usize = 48;

// Reading header copies.

/// One header copy, checked as cryptsetup checks it.
pub(super) struct Copy {
    seqid: u64,
    pub(super) header_bytes: u64,
    label: [u8; LABEL_BYTES],
    subsystem: [u8; LABEL_BYTES],
    uuid: String,
    json: Value,
}

/// Why a header copy was not taken.
pub(super) enum CopyFault {
    /// No magic where the copy should be.
    Missing(String),
    /// A copy, but not a valid one.
    Damaged(String),
}

/// The copy at `at` (0: the primary). Its size is checked before the JSON area is read.
pub(super) fn read_copy(read: &mut ReadAt<'_>, at: u64) -> Result<Copy, CopyFault> {
    let mut binary = vec![0u8; BINARY_BYTES as usize];
    read(at, &mut binary).map_err(|e| CopyFault::Missing(format!("unreadable: {e}")))?;
    let size = be64(&binary, SIZE_AT);
    if !HEADER_BYTES.contains(&size) {
        // decode_copy says what is wrong: the magic, version or size.
        return decode_copy(&binary, at);
    }
    let mut b = vec![0u8; size as usize];
    read(at, &mut b).map_err(|e| CopyFault::Damaged(format!("unreadable: {e}")))?;
    decode_copy(&b, at)
}

/// The secondary copy at the first standard offset that holds a valid one.
pub(super) fn scan_secondary(read: &mut ReadAt<'_>) -> Result<Copy, CopyFault> {
    let mut first_fault = None;
    for at in HEADER_BYTES {
        match read_copy(read, at) {
            Ok(c) => return Ok(c),
            Err(CopyFault::Missing(_)) => {}
            Err(e) => {
                first_fault.get_or_insert(e);
            }
        }
    }
    Err(first_fault.unwrap_or(CopyFault::Missing(
        "no header at any of the standard offsets".into(),
    )))
}

/// The header copy `b` (its whole size) found at `at`.
pub(super) fn decode_copy(b: &[u8], at: u64) -> Result<Copy, CopyFault> {
    let magic = if at == 0 { MAGIC } else { MAGIC_SECONDARY };
    if b.len() < BINARY_BYTES as usize || b[..6] != magic {
        return Err(CopyFault::Missing(format!("no header at {at} (bad magic)")));
    }
    let bad = |e: String| Err(CopyFault::Damaged(format!("the copy at {at}: {e}")));
    let version = u16::from_be_bytes([b[VERSION_AT], b[VERSION_AT + 1]]);
    if version != 2 {
        return bad(format!("version {version}"));
    }
    let size = be64(b, SIZE_AT);
    if !HEADER_BYTES.contains(&size) || b.len() as u64 != size {
        return bad(format!("a header size of {size}"));
    }
    let offset = be64(b, OFFSET_AT);
    if offset != at || (at != 0 && at != size) {
        return bad(format!("it says it is at {offset}"));
    }
    let alg = cstr(&b[CSUM_ALG_AT..SALT_AT]);
    let Some(hash) = Hash::parse(&alg) else {
        return bad(format!("checksum algorithm '{alg}' is not supported"));
    };
    let mut binary = b[..BINARY_BYTES as usize].to_vec();
    binary[CSUM_AT..CSUM_AT + 64].fill(0);
    let mut csum = vec![0u8; hash.len()];
    hash.digest(&[&binary[..], &b[BINARY_BYTES as usize..]], &mut csum);
    if csum[..] != b[CSUM_AT..CSUM_AT + csum.len()] {
        return bad("checksum mismatch".into());
    }
    let area = &b[BINARY_BYTES as usize..];
    let Some(end) = area.iter().position(|&c| c == 0) else {
        return bad("the JSON text has no end".into());
    };
    if area.first() != Some(&b'{') || area[end..].iter().any(|&c| c != 0) {
        return bad("bytes outside the JSON text".into());
    }
    let json: Value = match serde_json::from_slice(&area[..end]) {
        Ok(v) => v,
        Err(e) => return bad(format!("JSON: {e}")),
    };
    // The string fields end with a terminator, whatever their last byte holds (as
    // cryptsetup reads them): what is read is what a rewrite writes back.
    let uuid = &b[UUID_AT..SUBSYSTEM_AT - 1];
    let uuid = &uuid[..uuid.iter().position(|&c| c == 0).unwrap_or(uuid.len())];
    let Ok(uuid) = std::str::from_utf8(uuid) else {
        return bad("the UUID is not text".into());
    };
    Ok(Copy {
        seqid: be64(b, SEQID_AT),
        header_bytes: size,
        label: terminated(&b[LABEL_AT..LABEL_AT + LABEL_BYTES]),
        subsystem: terminated(&b[SUBSYSTEM_AT..SUBSYSTEM_AT + LABEL_BYTES]),
        uuid: uuid.to_string(),
        json,
    })
}

/// A label field with its last byte the terminator.
fn terminated(field: &[u8]) -> [u8; LABEL_BYTES] {
    let mut out = [0u8; LABEL_BYTES];
    out[..LABEL_BYTES - 1].copy_from_slice(&field[..LABEL_BYTES - 1]);
    out
}

/// The header from the two copies: the valid one with the higher sequence number (the
/// primary on a tie).
pub(super) fn choose(
    primary: Result<Copy, CopyFault>,
    secondary: Result<Copy, CopyFault>,
) -> Result<Header, CryptError> {
    let mut good = Vec::new();
    let mut faults = Vec::new();
    let mut missing = 0;
    for (which, copy) in [("primary", primary), ("secondary", secondary)] {
        let copy = match copy {
            Ok(c) => c,
            Err(CopyFault::Missing(e)) => {
                missing += 1;
                faults.push(format!("{which}: {e}"));
                continue;
            }
            Err(CopyFault::Damaged(e)) => {
                faults.push(format!("{which}: {e}"));
                continue;
            }
        };
        match Meta::parse(&copy.json, copy.header_bytes) {
            Ok(meta) => good.push((copy, Ok(meta))),
            Err(Fault::Refused(e)) => good.push((copy, Err(CryptError::Unsupported(e)))),
            Err(Fault::Damaged(e)) => faults.push(format!("{which}: {e}")),
        }
    }
    if missing == 2 {
        return Err(CryptError::NoHeader);
    }
    let mut best: Option<(Copy, Result<Meta, CryptError>)> = None;
    for (copy, meta) in good {
        if best.as_ref().is_none_or(|(b, _)| copy.seqid > b.seqid) {
            best = Some((copy, meta));
        }
    }
    let Some((copy, meta)) = best else {
        return Err(CryptError::Damaged(format!(
            "both LUKS2 header copies are damaged ({})",
            faults.join("; ")
        )));
    };
    Ok(Header {
        seqid: copy.seqid,
        header_bytes: copy.header_bytes,
        label: copy.label,
        subsystem: copy.subsystem,
        uuid: copy.uuid,
        json: copy.json,
        meta: meta?,
    })
}

// Writing header copies.

impl Header {
    /// The header copy at `at` (0: primary; else secondary): binary header, JSON text,
    /// zeros to the end of the JSON area, SHA-256 checksum.
    pub(super) fn encode(&self, at: u64) -> Result<Vec<u8>, CryptError> {
        let text =
            serde_json::to_vec(&self.json).map_err(|e| CryptError::Invalid(e.to_string()))?;
        let size = self.header_bytes as usize;
        let json_bytes = size - BINARY_BYTES as usize;
        if text.len() >= json_bytes {
            return Err(CryptError::Invalid(format!(
                "the JSON metadata ({} bytes) does not fit its {json_bytes}-byte area",
                text.len()
            )));
        }
        let mut b = vec![0u8; size];
        b[..6].copy_from_slice(if at == 0 { &MAGIC } else { &MAGIC_SECONDARY });
        b[VERSION_AT..VERSION_AT + 2].copy_from_slice(&2u16.to_be_bytes());
        b[SIZE_AT..SIZE_AT + 8].copy_from_slice(&self.header_bytes.to_be_bytes());
        b[SEQID_AT..SEQID_AT + 8].copy_from_slice(&self.seqid.to_be_bytes());
        b[LABEL_AT..LABEL_AT + LABEL_BYTES - 1].copy_from_slice(&self.label[..LABEL_BYTES - 1]);
        b[CSUM_ALG_AT..CSUM_ALG_AT + 6].copy_from_slice(b"sha256");
        crate::crypt::random(&mut b[SALT_AT..SALT_AT + 64])?;
        let uuid = self.uuid.as_bytes();
        let n = uuid.len().min(39);
        b[UUID_AT..UUID_AT + n].copy_from_slice(&uuid[..n]);
        b[SUBSYSTEM_AT..SUBSYSTEM_AT + LABEL_BYTES - 1]
            .copy_from_slice(&self.subsystem[..LABEL_BYTES - 1]);
        b[OFFSET_AT..OFFSET_AT + 8].copy_from_slice(&at.to_be_bytes());
        let json_at = BINARY_BYTES as usize;
        b[json_at..json_at + text.len()].copy_from_slice(&text);
        let mut csum = [0u8; 32];
        Hash::Sha256.digest(&[&b[..]], &mut csum);
        b[CSUM_AT..CSUM_AT + 32].copy_from_slice(&csum);
        Ok(b)
    }
}

pub(super) fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A NUL-terminated string field (bytes that are not UTF-8 replaced).
fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}
