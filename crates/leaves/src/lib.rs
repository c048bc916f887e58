//! cairn's leaf devices: the ones that hold the data themselves, one module per backend.
//!
//! - [`null`]: completes at once; reads return zeros (like Linux's null_blk).
//! - [`mem`]: a sparse RAM disk; memory grows with the data written.
//! - [`file`]: a regular file or block device through io_uring, linux-aio or plain
//!   syscalls.
//! - `nbd` ([`cairn_nbd::client`]): an export of an NBD server.
//! - [`rbd`]: a Ceph RBD image through librbd (loaded when the first one opens).
//!
//! [`spec`] turns the command-line form (`file:/dev/shm/a,engine=aio,size=1G`) into a
//! typed [`LeafSpec`] once, at the edge; [`open`] turns that into a device. [`error`]:
//! why a spec or one of its values is refused, or librbd cannot be loaded ([`Error`]);
//! opening a device fails with [`cairn_core::Error`].
#![warn(missing_docs)]

pub mod error;
pub mod file;
pub mod mem;
pub mod null;
pub mod rbd;
pub mod spec;

use std::sync::Arc;

use cairn_core::Device;

pub use error::{Error, SpecError};
pub use spec::{Engine, LeafSpec};

/// Default logical block size of null and mem devices.
pub const DEFAULT_BLOCK_BYTES: u32 = 512;

/// Opens the device a spec describes, under `name`.
pub fn open(spec: &LeafSpec, name: &str) -> Result<Arc<dyn Device>, cairn_core::Error> {
    Ok(match spec {
        LeafSpec::Null {
            size_bytes,
            block_bytes,
        } => Arc::new(null::NullDevice::new(name, *size_bytes, *block_bytes)?),
        LeafSpec::Mem {
            size_bytes,
            block_bytes,
            volatile,
        } => {
            let mut d = mem::MemDevice::new(name, *size_bytes, *block_bytes)?;
            if *volatile {
                d = d.volatile();
            }
            Arc::new(d)
        }
        LeafSpec::File {
            path,
            engine,
            direct,
            size_bytes,
            sparse,
        } => Arc::new(file::FileDevice::open(
            name,
            path,
            *engine,
            *direct,
            size_bytes.map(|s| (s, *sparse)),
        )?),
        LeafSpec::Nbd {
            uri,
            connections,
            timeout,
        } => Arc::new(cairn_nbd::client::NbdDevice::open(
            name,
            uri,
            cairn_nbd::client::Options {
                connections: *connections,
                timeout: *timeout,
            },
        )?),
        LeafSpec::Rbd(target) => Arc::new(rbd::RbdDevice::open(name, target)?),
    })
}

/// Checks size and block size shared by null and mem devices.
pub(crate) fn check_size(
    kind: &str,
    size_bytes: u64,
    block_bytes: u32,
) -> Result<(), cairn_core::Error> {
    if !block_bytes.is_power_of_two() || !(512..=65536).contains(&block_bytes) {
        return Err(cairn_core::Error::Invalid(format!(
            "{kind}: block size {block_bytes} must be a power of two from 512 to 65536"
        )));
    }
    if size_bytes == 0 || !size_bytes.is_multiple_of(u64::from(block_bytes)) {
        return Err(cairn_core::Error::Invalid(format!(
            "{kind}: size {size_bytes} must be a non-zero multiple of the {block_bytes}-byte block size"
        )));
    }
    Ok(())
}
