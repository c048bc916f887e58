//! The bodies of the fuzz targets of the services' on-disk formats, and their seeds (the
//! list of every target is `cairn_config::fuzz`'s). Hidden from the documentation.

pub mod dirty;
pub mod luks;
pub mod thin;
