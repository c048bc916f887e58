//! Reading the fields of LUKS2's JSON, each checked and named in the error, and base64,
//! as LUKS2 stores binary values.

use serde_json::{Map, Value};

use super::json::{damaged, refused, Parsed};
use super::MAX_SLOTS;
use crate::crypt::Hash;

// JSON fields, each read with the place it belongs to (`at`) for the error.

fn member<'a>(o: &'a Map<String, Value>, key: &str, at: &str) -> Parsed<&'a Value> {
    match o.get(key) {
        Some(v) => Ok(v),
        None => damaged(format!("{at} has no \"{key}\"")),
    }
}

pub(super) fn object<'a>(
    o: &'a Map<String, Value>,
    key: &str,
    at: &str,
) -> Parsed<&'a Map<String, Value>> {
    match member(o, key, at)?.as_object() {
        Some(v) => Ok(v),
        None => damaged(format!("{at}: \"{key}\" is not an object")),
    }
}

pub(super) fn text<'a>(o: &'a Map<String, Value>, key: &str, at: &str) -> Parsed<&'a str> {
    match member(o, key, at)?.as_str() {
        Some(v) => Ok(v),
        None => damaged(format!("{at}: \"{key}\" is not a string")),
    }
}

/// A JSON number that is an unsigned integer.
pub(super) fn number(o: &Map<String, Value>, key: &str, at: &str) -> Parsed<u64> {
    match member(o, key, at)?.as_u64() {
        Some(v) => Ok(v),
        None => damaged(format!("{at}: \"{key}\" is not an unsigned integer")),
    }
}

/// A JSON number from 1 to `u32::MAX` (iterations, argon2's time).
pub(super) fn count(o: &Map<String, Value>, key: &str, at: &str) -> Parsed<u32> {
    match u32::try_from(number(o, key, at)?) {
        Ok(v) if v > 0 => Ok(v),
        _ => damaged(format!("{at}: \"{key}\" is out of range")),
    }
}

/// A u64 written as a string of decimal digits (LUKS2's offsets and sizes).
pub(super) fn decimal(o: &Map<String, Value>, key: &str, at: &str) -> Parsed<u64> {
    let s = text(o, key, at)?;
    match s.parse::<u64>() {
        Ok(v) if s.bytes().all(|c| c.is_ascii_digit()) => Ok(v),
        _ => damaged(format!("{at}: \"{key}\" is not a decimal string")),
    }
}

/// Base64 bytes.
pub(super) fn bytes(o: &Map<String, Value>, key: &str, at: &str) -> Parsed<Vec<u8>> {
    match base64_decode(text(o, key, at)?) {
        Some(v) => Ok(v),
        None => damaged(format!("{at}: \"{key}\" is not base64")),
    }
}

/// An array of strings (key slot and segment names).
pub(super) fn names(o: &Map<String, Value>, key: &str, at: &str) -> Parsed<Vec<String>> {
    let Some(list) = member(o, key, at)?.as_array() else {
        return damaged(format!("{at}: \"{key}\" is not an array"));
    };
    list.iter()
        .map(|v| match v.as_str() {
            Some(s) => Ok(s.to_string()),
            None => damaged(format!("{at}: \"{key}\" holds a non-string")),
        })
        .collect()
}

pub(super) fn hash(o: &Map<String, Value>, key: &str, at: &str) -> Parsed<Hash> {
    let name = text(o, key, at)?;
    match Hash::parse(name) {
        Some(h) => Ok(h),
        None => refused(format!(
            "{at}: hash {name} is not supported (sha1, sha256, sha512 are)"
        )),
    }
}

/// A key slot's number from its name: decimal digits, below [`MAX_SLOTS`].
pub(super) fn slot_number(name: &str) -> Parsed<usize> {
    match name.parse::<usize>() {
        Ok(n) if n < MAX_SLOTS && name.bytes().all(|c| c.is_ascii_digit()) => Ok(n),
        _ => damaged(format!("a key slot named '{name}'")),
    }
}

// Base64, standard alphabet with padding, as LUKS2 stores salts and digests.

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

pub(super) fn base64_encode(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len().div_ceil(3) * 4);
    for c in b.chunks(3) {
        let n = c
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &x)| n | u32::from(x) << (16 - 8 * i));
        for i in 0..4 {
            if i <= c.len() {
                s.push(BASE64[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

pub(super) fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    if !b.len().is_multiple_of(4) {
        return None;
    }
    let quads = b.len() / 4;
    let mut out = Vec::with_capacity(quads * 3);
    for (i, q) in b.chunks(4).enumerate() {
        let pad = q.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && i + 1 != quads) {
            return None;
        }
        let mut n = 0u32;
        for &c in &q[..4 - pad] {
            n = n << 6 | base64_value(c)?;
        }
        n <<= 6 * pad;
        out.extend_from_slice(&n.to_be_bytes()[1..4 - pad]);
    }
    Some(out)
}

fn base64_value(c: u8) -> Option<u32> {
    let v = match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => return None,
    };
    Some(u32::from(v))
}
