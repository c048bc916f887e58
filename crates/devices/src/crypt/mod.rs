//! Encryption at rest (issue 39, in progress): LUKS headers and AES-XTS. [`xts`] ciphers
//! sectors; [`luks1`] reads LUKS1 headers and opens key slots.

pub mod luks1;
pub mod xts;
