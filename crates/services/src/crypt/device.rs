//! `type = "crypt"`: a device whose data is encrypted on its base, in LUKS format.
//!
//! Opening reads the base's LUKS header (either version) and opens a key slot with the
//! passphrase, or checks a raw volume key against the header's digest; `create = true`
//! formats a blank base first (zeros over the whole header and key slot area and the
//! start of the data: a volume with a wiped header is opened from its secondary copy or
//! refused, never formatted over). Requests then run on the reactor that submits them: a
//! read goes to the base into the caller's buffer and is decrypted there when it
//! completes; a write is encrypted into a bounce buffer of the queue's own (the caller's
//! buffer is never changed) and sent from it. Write-zeroes and discard write encrypted
//! zeros, a chunk at a time: zeros on the base would read back as noise, and a trimmed
//! base would show which blocks are unused.

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use cairn_core::blocking::BlockingQueue;
use cairn_core::{Core, Device, Error, Geometry, IoFlags, Offer, Queue, Switches, Want};

use super::counters::{CryptCounts, CryptStats, Ledger, SlotEvent, Tally};
use super::error::CryptError;
use super::queue::CryptQueue;
use super::volume::{probe, Format, Luks, Probe, BLANK_BYTES};
use super::xts::{Xts, KEY_BYTES};
use super::{Kdf, Secret, Segment, SlotInfo, SlotKey};

/// Largest passphrase file read (cryptsetup's limit for key files).
pub const PASSPHRASE_BYTES_MAX: u64 = 8 << 20;

/// What a `crypt` table says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CryptOptions {
    /// A file whose bytes, exactly, are the passphrase of a key slot.
    pub passphrase_file: Option<PathBuf>,
    /// A file holding the raw volume key (32 or 64 bytes).
    pub key_file: Option<PathBuf>,
    /// Format a blank base (zeros over the first [`BLANK_BYTES`]).
    pub create: bool,
    /// The version to make with `create`; when opening, the version expected.
    pub format: Option<Format>,
    /// Bytes per encryption sector for `create` (LUKS2: 4096 by default; LUKS1: 512).
    pub sector_bytes: Option<u32>,
    /// How new key slots derive their key (`create` and the admin's `add`).
    pub kdf: Option<Kdf>,
    /// Bytes of a new volume key: 64 (AES-256-XTS, the default) or 32 (AES-128-XTS).
    pub key_bytes: usize,
}

impl Default for CryptOptions {
    fn default() -> CryptOptions {
        CryptOptions {
            passphrase_file: None,
            key_file: None,
            create: false,
            format: None,
            sector_bytes: None,
            kdf: None,
            key_bytes: 64,
        }
    }
}

impl CryptOptions {
    /// The key derivation new slots of a `format` header get.
    pub fn kdf_for(&self, format: Format) -> Kdf {
        self.kdf.unwrap_or(match format {
            Format::Luks1 => Kdf::DEFAULT_PBKDF2,
            Format::Luks2 => Kdf::DEFAULT_ARGON2ID,
        })
    }
}

/// Reads a secret file: the passphrase or a raw key. Only a regular file is read: a FIFO
/// (or a device, a socket) could block the reader forever or never end, so it is refused
/// before a byte is read; opening does not block either (`O_NONBLOCK`, so a FIFO with no
/// writer opens at once to be refused). At most [`PASSPHRASE_BYTES_MAX`] bytes are read,
/// whatever the file's size says while it is read.
pub fn read_secret(key: &str, path: &Path) -> Result<Secret, CryptError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source: std::io::Error| CryptError::SecretIo {
        key: key.to_string(),
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.file_type().is_file() {
        return Err(CryptError::SecretNotAFile {
            key: key.to_string(),
            path: path.to_path_buf(),
            kind: file_kind(meta.file_type()),
        });
    }
    let too_big = || CryptError::SecretTooLarge {
        key: key.to_string(),
        path: path.to_path_buf(),
    };
    if meta.len() > PASSPHRASE_BYTES_MAX {
        return Err(too_big());
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(PASSPHRASE_BYTES_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    let s = Secret(bytes);
    if s.0.len() as u64 > PASSPHRASE_BYTES_MAX {
        return Err(too_big());
    }
    if s.0.is_empty() {
        return Err(CryptError::SecretEmpty {
            key: key.to_string(),
            path: path.to_path_buf(),
        });
    }
    Ok(s)
}

/// What a file that is not a regular one is, for a refusal.
fn file_kind(kind: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Keys a check before opening (`serve` and `bench` check the whole stack first) found
/// with a passphrase, for the open right after it: a slot's key derivation (seconds of
/// argon2id) is paid once per start, not twice. Taken by the open that uses it; each
/// entry holds the header's UUID, a hash of the passphrase, the slot and the key.
type Unlocked = (String, Secret, usize, Secret);
static UNLOCKED: Mutex<Vec<Unlocked>> = Mutex::new(Vec::new());

fn passphrase_hash(passphrase: &[u8]) -> Secret {
    use sha2::Digest;
    Secret(sha2::Sha256::digest(passphrase).to_vec())
}

/// Remembers what a check unlocked (see [`UNLOCKED`]).
fn remember_unlock(luks: &Luks, passphrase: &[u8], slot: usize, key: &Secret) {
    let mut u = UNLOCKED.lock().unwrap_or_else(|p| p.into_inner());
    let h = passphrase_hash(passphrase);
    u.retain(|(uuid, ph, _, _)| !(uuid == luks.uuid() && ph.0 == h.0));
    u.push((luks.uuid().to_string(), h, slot, Secret(key.0.clone())));
}

/// The slot and key a check found for this header and passphrase, taken, if the key is
/// still this header's volume key.
fn unlocked_before(luks: &Luks, passphrase: &[u8]) -> Option<(usize, Secret)> {
    let mut u = UNLOCKED.lock().unwrap_or_else(|p| p.into_inner());
    let h = passphrase_hash(passphrase);
    let i = u
        .iter()
        .position(|(uuid, ph, _, _)| uuid == luks.uuid() && ph.0 == h.0)?;
    let (_, _, slot, key) = u.swap_remove(i);
    let still = luks.slots().iter().any(|s| s.index == slot) && luks.check(&key.0);
    still.then_some((slot, key))
}

/// Header I/O on the base through a blocking queue of its own: any offset and length
/// (read-modify-write around the base's blocks), each write flushed before the next.
pub struct HeaderIo {
    q: BlockingQueue,
    block: u64,
}

impl HeaderIo {
    /// A blocking queue on `base`.
    pub fn open(base: &Arc<dyn Device>) -> Result<HeaderIo, CryptError> {
        let q = BlockingQueue::open(base, Switches::default())?;
        let block = u64::from(q.geometry().block_bytes);
        Ok(HeaderIo { q, block })
    }

    fn span(&self, at: u64, len: usize) -> Result<(u64, usize), CryptError> {
        let start = at - at % self.block;
        let end = (at + len as u64).next_multiple_of(self.block);
        if end > self.q.geometry().size_bytes {
            return Err(CryptError::HeaderPastEnd {
                size: self.q.geometry().size_bytes,
            });
        }
        Ok((start, (end - start) as usize))
    }

    /// Reads `buf.len()` bytes at `at`.
    pub fn read(&self, at: u64, buf: &mut [u8]) -> Result<(), CryptError> {
        let (start, len) = self.span(at, buf.len())?;
        let mut b = vec![0u8; len];
        self.q
            .read(start, &mut b)
            .map_err(|source| CryptError::Io {
                doing: "reading the base",
                source,
            })?;
        let from = (at - start) as usize;
        buf.copy_from_slice(&b[from..from + buf.len()]);
        Ok(())
    }

    /// Writes `data` at `at` and flushes.
    pub fn write(&self, at: u64, data: &[u8]) -> Result<(), CryptError> {
        let (start, len) = self.span(at, data.len())?;
        let mut b = vec![0u8; len];
        if start != at || len != data.len() {
            self.read(start, &mut b)?;
        }
        let from = (at - start) as usize;
        b[from..from + data.len()].copy_from_slice(data);
        self.q
            .write(start, &b, IoFlags::NONE)
            .and_then(|()| self.q.flush())
            .map_err(|source| CryptError::Io {
                doing: "writing the base",
                source,
            })
    }
}

/// The header and the volume key, for changes to the key slots.
struct Keys {
    luks: Luks,
    key: Secret,
}

/// A crypt device's key slots, as the admin sees them (`cairn admin crypt`): the
/// capability a crypt device offers. No key or passphrase ever comes out of it.
pub trait KeySlots: Send + Sync {
    /// Its LUKS version.
    fn format(&self) -> Format;

    /// The key slots in use.
    fn slots(&self) -> Vec<SlotInfo>;

    /// The slot that opened it (`None`: a raw key).
    fn opened_by(&self) -> Option<usize>;

    /// Where its data lies on the base.
    fn segment(&self) -> Segment;

    /// What a new key slot asking for `kdf` (or the device's default) derives its key
    /// with, checked against the header, and the key's length: the slow part of adding a
    /// slot, [`SlotKey::derive`], needs nothing more, and no device.
    fn new_slot_kdf(&self, kdf: Option<Kdf>) -> Result<(Kdf, usize), CryptError>;

    /// Adds a key slot whose key was derived already: its material, then the header.
    fn add_derived_slot(&self, slot_key: &SlotKey) -> Result<usize, CryptError>;

    /// Removes key slot `slot` (never the last one).
    fn remove_slot(&self, slot: usize) -> Result<(), CryptError>;
}

/// An open crypt device.
pub struct CryptDevice {
    name: String,
    base: Arc<dyn Device>,
    xts: Arc<Xts>,
    segment: Segment,
    size: u64,
    block: u32,
    format: Format,
    uuid: String,
    /// The slot that opened it (`None`: a raw key did).
    opened_by: Option<usize>,
    keys: Mutex<Keys>,
    kdf_default: Kdf,
    /// What its queues ciphered, and its key slots' events.
    ledger: Ledger,
    /// A stand-in for `cairn check`: the header `create` would write, in memory only.
    stand_in: bool,
}

impl CryptDevice {
    /// Opens (and with `create`, formats) the crypt device `name` over `base`. With
    /// `write` false nothing is written: a base `create` would format gives a stand-in of
    /// the size it would have.
    pub fn open(
        name: &str,
        base: Arc<dyn Device>,
        opts: &CryptOptions,
        write: bool,
    ) -> Result<CryptDevice, Error> {
        Self::open_inner(name, base, opts, write).map_err(|e| match e {
            CryptError::Device(e) => e,
            other => Error::Invalid(other.to_string()),
        })
    }

    fn open_inner(
        name: &str,
        base: Arc<dyn Device>,
        opts: &CryptOptions,
        write: bool,
    ) -> Result<CryptDevice, CryptError> {
        let secrets = Secrets::read(opts)?;
        let io = HeaderIo::open(&base)?;
        let base_name = base.name().to_string();
        let size = base.geometry().size_bytes;
        let found = probe(&mut |at, b| io.read(at, b), size, opts.create)?;
        let mut stand_in = false;
        let (luks, key, slot) = match found {
            Probe::Luks(found) => secrets.open(found, opts, &io, &base_name, write)?,
            Probe::Blank if opts.create => {
                let (luks, key) = secrets.format(name, &base, opts, &io, write)?;
                stand_in = !write;
                (luks, key, Some(0))
            }
            Probe::Blank | Probe::Other => {
                return Err(CryptError::NotLuks {
                    base: base_name,
                    blank: found == Probe::Blank,
                    create: opts.create,
                })
            }
            Probe::NotBlank(at) => {
                return Err(CryptError::NotBlank {
                    base: base_name,
                    at,
                    blank_bytes: BLANK_BYTES,
                })
            }
        };
        let segment = luks.segment();
        let (size, block) = data_size(&base, segment)?;
        let ledger = Ledger::default();
        if slot.is_some() && !stand_in {
            ledger.slot_event(SlotEvent::Opened);
        }
        Ok(CryptDevice {
            name: name.into(),
            base,
            xts: Arc::new(Xts::new(&key.0)?),
            segment,
            size,
            block,
            format: luks.format(),
            uuid: luks.uuid().to_string(),
            opened_by: slot,
            kdf_default: opts.kdf_for(luks.format()),
            keys: Mutex::new(Keys { luks, key }),
            ledger,
            stand_in,
        })
    }

    /// Adds a key slot opened by `passphrase` (with `kdf`, or the device's default).
    pub fn add_slot(&self, passphrase: &Secret, kdf: Option<Kdf>) -> Result<usize, CryptError> {
        let (kdf, len) = self.new_slot_kdf(kdf)?;
        let slot_key = SlotKey::derive(kdf, &passphrase.0, len)?;
        self.add_derived_slot(&slot_key)
    }
}

/// The passphrase and the raw volume key a crypt table names, read.
struct Secrets {
    passphrase: Option<Secret>,
    raw: Option<Secret>,
}

impl Secrets {
    fn read(opts: &CryptOptions) -> Result<Secrets, CryptError> {
        let passphrase = match &opts.passphrase_file {
            Some(p) => Some(read_secret("passphrase_file", p)?),
            None => None,
        };
        let raw = match &opts.key_file {
            Some(p) => {
                let k = read_secret("key_file", p)?;
                if !KEY_BYTES.contains(&k.0.len()) {
                    return Err(CryptError::Invalid(format!(
                        "key_file '{}' holds {} bytes: an aes-xts volume key is 32 or 64",
                        p.display(),
                        k.0.len()
                    )));
                }
                Some(k)
            }
            None => None,
        };
        Ok(Secrets { passphrase, raw })
    }

    /// Opens the `found` header on the base: the raw key checked against its digest, or
    /// a key slot opened with the passphrase. Returns the header, the key and the slot.
    fn open(
        &self,
        found: Format,
        opts: &CryptOptions,
        io: &HeaderIo,
        base_name: &str,
        write: bool,
    ) -> Result<(Luks, Secret, Option<usize>), CryptError> {
        if let Some(want) = opts.format.filter(|&w| w != found) {
            return Err(CryptError::Invalid(format!(
                "base '{base_name}' holds a {} header, not {} as format says",
                found.name(),
                want.name()
            )));
        }
        let luks =
            Luks::read(found, &mut |at, b| io.read(at, b)).map_err(|e| e.of_base(base_name))?;
        match (&self.raw, &self.passphrase) {
            (Some(k), _) => {
                if !luks.check(&k.0) {
                    return Err(CryptError::WrongKeyFile {
                        base: base_name.to_string(),
                    });
                }
                Ok((luks, Secret(k.0.clone()), None))
            }
            (None, Some(p)) => {
                let (slot, key) = match unlocked_before(&luks, &p.0) {
                    Some(found) => found,
                    None => luks
                        .unlock(&p.0, &mut |at, b| io.read(at, b))
                        .map_err(|e| e.of_base(base_name))?,
                };
                if !write {
                    remember_unlock(&luks, &p.0, slot, &key);
                }
                Ok((luks, key, Some(slot)))
            }
            (None, None) => Err(CryptError::Invalid(
                "passphrase_file or key_file is needed".into(),
            )),
        }
    }

    /// Formats the blank `base` (with `write` false: a stand-in header in memory, nothing
    /// written). Returns the header and the volume key.
    fn format(
        &self,
        name: &str,
        base: &Arc<dyn Device>,
        opts: &CryptOptions,
        io: &HeaderIo,
        write: bool,
    ) -> Result<(Luks, Secret), CryptError> {
        let base_name = base.name();
        let format = opts.format.unwrap_or(Format::Luks2);
        let Some(p) = &self.passphrase else {
            return Err(CryptError::Invalid(
                "create needs passphrase_file (the passphrase of key slot 0)".into(),
            ));
        };
        let key = match &self.raw {
            Some(k) => Secret(k.0.clone()),
            None => {
                let mut k = Secret(vec![0u8; opts.key_bytes]);
                super::random(&mut k.0)?;
                k
            }
        };
        let sector = opts.sector_bytes.unwrap_or(match format {
            Format::Luks1 => 512,
            Format::Luks2 => 4096,
        });
        // The headers take 2 MiB (LUKS1) or 16 MiB (LUKS2): refused before any byte is
        // written.
        let headers: u64 = match format {
            Format::Luks1 => 2 << 20,
            Format::Luks2 => 16 << 20,
        };
        if base.geometry().size_bytes < headers + u64::from(sector) {
            return Err(CryptError::Invalid(format!(
                "base '{base_name}' ({} bytes) is too small: a {} header takes {} and the data at least a sector",
                base.geometry().size_bytes,
                format.name(),
                cairn_core::size::format_bytes(headers)
            )));
        }
        let failed = |e: CryptError| CryptError::Formatting {
            base: base_name.to_string(),
            source: Box::new(e),
        };
        if !write {
            // A stand-in in memory, quick to make: nothing reaches the base.
            let mut image = vec![0u8; headers as usize];
            let quick = Kdf::Pbkdf2 {
                hash: super::Hash::Sha256,
                iterations: 1,
            };
            let mut to_memory = |at: u64, b: &[u8]| {
                let (at, end) = (at as usize, at as usize + b.len());
                if image.len() < end {
                    image.resize(end, 0);
                }
                image[at..end].copy_from_slice(b);
                Ok(())
            };
            let luks =
                Luks::create(format, &mut to_memory, &key, b"", quick, sector).map_err(failed)?;
            return Ok((luks, key));
        }
        let kdf = opts.kdf_for(format);
        let luks = Luks::create(
            format,
            &mut |at, b| io.write(at, b),
            &key,
            &p.0,
            kdf,
            sector,
        )
        .map_err(failed)?;
        log::info!(
            "cairn: crypt {name}: formatted base '{base_name}' as {} ({}, key slot 0: {kdf})",
            format.name(),
            luks.uuid()
        );
        Ok((luks, key))
    }
}

/// The bytes of data a device over `base` with `segment` holds, and its block size.
fn data_size(base: &Arc<dyn Device>, segment: Segment) -> Result<(u64, u32), CryptError> {
    let geo = base.geometry();
    let base_name = base.name();
    let block = geo.block_bytes.max(segment.sector_bytes);
    let end = match segment.size {
        Some(s) => segment.offset.checked_add(s),
        None => Some(geo.size_bytes),
    };
    let size = match end {
        Some(end) if end <= geo.size_bytes && end > segment.offset => end - segment.offset,
        _ => {
            return Err(CryptError::Invalid(format!(
                "base '{base_name}' ({} bytes) is too small for its data segment (from byte {})",
                geo.size_bytes, segment.offset
            )))
        }
    };
    let size = size - size % u64::from(block);
    if size == 0 || !segment.offset.is_multiple_of(u64::from(geo.block_bytes)) {
        return Err(CryptError::Invalid(format!(
            "base '{base_name}': the data segment (at {}, {} bytes) does not fit its {}-byte blocks",
            segment.offset, size, geo.block_bytes
        )));
    }
    Ok((size, block))
}

impl Device for CryptDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn describe(&self) -> String {
        format!(
            "crypt over {}: {} aes-xts-plain64, {}-bit key, {}-byte sectors, data at {} ({})",
            self.base.name(),
            self.format.name(),
            self.xts.key_bits(),
            self.segment.sector_bytes,
            cairn_core::size::format_bytes(self.segment.offset),
            if self.stand_in {
                "to be formatted by serve or bench".to_string()
            } else {
                format!("UUID {}", self.uuid)
            }
        )
    }
    fn geometry(&self) -> Geometry {
        let base = self.base.geometry();
        Geometry {
            size_bytes: self.size,
            block_bytes: self.block,
            caps: cairn_core::Caps {
                discard: true,
                write_zeroes: true,
                ..base.caps
            },
        }
    }
    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        let base = cairn_core::handoff::open_member(core, &self.base)?;
        let cipher = {
            let keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            super::evp::Cipher::new(self.xts.clone(), &keys.key.0, true)
        };
        Ok(CryptQueue::open(
            core,
            self.name(),
            base,
            cipher,
            Tally::new(self.ledger.open_queue()),
            self.segment,
        ))
    }
    fn base(&self) -> Option<&Arc<dyn Device>> {
        Some(&self.base)
    }
    fn offer(self: Arc<Self>, want: Want) -> Option<Offer> {
        want.offer::<dyn KeySlots>(|| self.clone())
            .or_else(|| want.offer::<dyn CryptStats>(|| self))
    }
}

impl KeySlots for CryptDevice {
    fn format(&self) -> Format {
        self.format
    }

    fn slots(&self) -> Vec<SlotInfo> {
        self.keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .luks
            .slots()
    }

    fn opened_by(&self) -> Option<usize> {
        self.opened_by
    }

    fn segment(&self) -> Segment {
        self.segment
    }

    fn new_slot_kdf(&self, kdf: Option<Kdf>) -> Result<(Kdf, usize), CryptError> {
        let keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        let kdf = keys.luks.slot_kdf(kdf.unwrap_or(self.kdf_default))?;
        Ok((kdf, keys.luks.key_bytes()))
    }

    fn add_derived_slot(&self, slot_key: &SlotKey) -> Result<usize, CryptError> {
        let io = HeaderIo::open(&self.base)?;
        // The volume key is checked against the header's digest before the keys are
        // locked: the check is a PBKDF2 of its own (an eighth of a second in a header
        // cryptsetup made, and a header may ask for much more), and while the keys are
        // locked `crypt list`, other key slot changes and the queues that new clients
        // open wait. Neither the key nor the digest changes while the device is open.
        let (header, checked) = {
            let keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            (keys.luks.clone(), Secret(keys.key.0.clone()))
        };
        if !header.check(&checked.0) {
            return Err(CryptError::WrongKey { what: "volume" });
        }
        drop(header);
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        let Keys { luks, key } = &mut *keys;
        debug_assert!(key.0 == checked.0, "the volume key changed");
        let slot = luks.add_checked_slot(&mut |at, b| io.write(at, b), key, slot_key)?;
        self.ledger.slot_event(SlotEvent::Added);
        Ok(slot)
    }

    fn remove_slot(&self, slot: usize) -> Result<(), CryptError> {
        let io = HeaderIo::open(&self.base)?;
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        keys.luks.remove_slot(&mut |at, b| io.write(at, b), slot)?;
        self.ledger.slot_event(SlotEvent::Removed);
        Ok(())
    }
}

impl CryptStats for CryptDevice {
    fn counts(&self) -> CryptCounts {
        self.ledger.counts()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a regular file of at most 8 MiB is read: a FIFO nobody writes (which would
    /// block the reader forever), a directory or a larger file is refused at once.
    #[test]
    fn a_secret_is_read_from_a_regular_file_only() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'x'; PASSPHRASE_BYTES_MAX as usize + 1]).unwrap();
        let fine = dir.path().join("fine");
        std::fs::write(&fine, b"pass\n").unwrap();
        for (path, why) in [
            (&fifo, "is a FIFO"),
            (&dir.path().to_path_buf(), "is a directory"),
            (&big, "is larger than 8388608 bytes"),
        ] {
            let e = read_secret("passphrase_file", path)
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{e}");
        }
        let e = read_secret("passphrase_file", &fifo).unwrap_err();
        assert!(
            matches!(&e, CryptError::SecretNotAFile { key, path, kind: "a FIFO" } if key == "passphrase_file" && path == &fifo),
            "{e:?}"
        );
        let e = read_secret("key_file", &big).unwrap_err();
        assert!(matches!(e, CryptError::SecretTooLarge { .. }), "{e:?}");
        assert_eq!(read_secret("passphrase_file", &fine).unwrap().0, b"pass\n");
    }
}
