//! `cairn admin SOCKET crypt ...`: each crypt device's LUKS header and key slots, and
//! adding and removing key slots online (key rotation: add the new passphrase, then
//! remove the old slot). Passphrases come from files the server reads (regular files
//! only, of at most cryptsetup's 8 MiB); no key or passphrase is ever printed or logged.
//!
//! Adding a slot pays its key derivation, seconds by design: a derivation estimated to
//! take longer than a minute is refused before it starts, and while one runs the command
//! holds no device, so that the server's stop never waits for it.

use std::path::Path;
use std::sync::Arc;

use cairn_core::size::format_bytes;
use cairn_core::Device;
use cairn_services::crypt::counters::{CryptCounts, CryptStats};
use cairn_services::crypt::device::{read_secret, KeySlots};
use cairn_services::crypt::kdf::check_cost;
use cairn_services::crypt::{Kdf, SlotKey};

use crate::admin_error::AdminError;
use crate::admin_threads::Ticket;
use crate::view::{all_devices, View};

const USAGE: &str = "crypt list [--json] | add DEVICE PASSPHRASE_FILE [KEY=VALUE...] (kdf, kdf_iterations, kdf_memory, kdf_parallel, kdf_hash) | remove DEVICE SLOT";

/// A crypt device served, and its key slots.
struct Crypt {
    device: Arc<dyn Device>,
    slots: Arc<dyn KeySlots>,
}

/// The crypt devices served.
fn crypts(roots: &[Arc<dyn Device>]) -> Vec<Crypt> {
    all_devices(roots)
        .into_iter()
        .filter_map(|(_, device)| {
            let slots = device.capability::<dyn KeySlots>()?;
            Some(Crypt { device, slots })
        })
        .collect()
}

/// The key slots of crypt device `name` of `view`: the device is held for as long as
/// the caller keeps them.
fn find(view: &View, name: &str) -> Result<Arc<dyn KeySlots>, AdminError> {
    crypts(&view.roots())
        .into_iter()
        .find(|c| c.device.name() == name)
        .map(|c| c.slots)
        .ok_or_else(|| AdminError::NoCrypt(name.to_string()))
}

/// `crypt ACTION ...`. `ticket` lets go of the devices while a key slot's key is derived.
pub(crate) fn command(args: &[&str], view: &View, ticket: &Ticket) -> Result<String, AdminError> {
    let what = match args {
        ["list"] => return Ok(format!("ok\n{}", list_text(&crypts(&view.roots())))),
        ["list", "--json"] => return Ok(format!("ok\n{}\n", list_json(&crypts(&view.roots())))),
        ["add", device, file, words @ ..] => add(device, Path::new(file), words, view, ticket)?,
        ["remove", device, slot] => remove(device, slot, view)?,
        _ => return Err(AdminError::Usage(USAGE.into())),
    };
    log::info!("cairn: admin: {what}");
    Ok(format!("ok: {what}\n"))
}

/// `crypt add DEVICE FILE [KEY=VALUE...]`: what the new slot derives its key with and
/// the passphrase are checked first (an estimated cost over the bound, a file that is not
/// regular or too large: refused, nothing done); the key is derived holding no device;
/// then the slot is written, if the server is not stopping meanwhile.
fn add(
    device: &str,
    file: &Path,
    words: &[&str],
    view: &View,
    ticket: &Ticket,
) -> Result<String, AdminError> {
    let (kdf, len) = slot_kdf(device, words, view)?;
    let passphrase = read_secret("passphrase file", file).map_err(AdminError::Passphrase)?;
    let seconds = check_cost(kdf, len).map_err(|e| AdminError::crypt(device, e))?;
    log::info!(
        "cairn: admin: crypt {device}: deriving a new key slot's key ({kdf}, about {seconds:.0} s)"
    );
    ticket.let_go();
    let slot_key = SlotKey::derive(kdf, &passphrase.0, len);
    drop(passphrase);
    ticket
        .take_again()
        .map_err(|e| AdminError::NotTaken(format!("crypt {device}: {e}: no key slot was added")))?;
    let slot_key = slot_key.map_err(|e| AdminError::crypt(device, e))?;
    let slot = find(view, device)?
        .add_derived_slot(&slot_key)
        .map_err(|e| AdminError::crypt(device, e))?;
    Ok(format!("crypt {device}: key slot {slot} added"))
}

/// The key derivation `words` ask of a new slot of crypt device `device` (its default
/// without them), checked against its header, and the key's length. The device is held
/// only here.
fn slot_kdf(device: &str, words: &[&str], view: &View) -> Result<(Kdf, usize), AdminError> {
    let c = find(view, device)?;
    let kdf = cairn_config::crypt_kdf(device, c.format(), words)?;
    c.new_slot_kdf(kdf)
        .map_err(|e| AdminError::crypt(device, e))
}

/// `crypt remove DEVICE SLOT`.
fn remove(device: &str, slot: &str, view: &View) -> Result<String, AdminError> {
    let c = find(view, device)?;
    let Ok(slot) = slot.parse::<usize>() else {
        return Err(AdminError::BadSlot(slot.to_string()));
    };
    c.remove_slot(slot)
        .map_err(|e| AdminError::crypt(device, e))?;
    Ok(format!("crypt {device}: key slot {slot} removed"))
}

/// Each crypt device served: its name, what it counted, and its key slots in use.
pub(crate) fn counted(roots: &[Arc<dyn Device>]) -> Vec<(String, CryptCounts, usize)> {
    all_devices(roots)
        .into_iter()
        .filter_map(|(_, d)| {
            let counts = d.capability::<dyn CryptStats>()?.counts();
            let slots = d
                .capability::<dyn KeySlots>()
                .map_or(0, |k| k.slots().len());
            Some((d.name().to_string(), counts, slots))
        })
        .collect()
}

/// `status`'s lines of the crypt devices: a line each.
pub(crate) fn status_text(roots: &[Arc<dyn Device>]) -> String {
    let mut out = String::new();
    for (name, c, slots) in counted(roots) {
        out += &format!(
            "crypt {name}: encrypted {} requests ({}), decrypted {} requests ({}), {:.3} s in \
             the cipher (estimated); {slots} key slots in use, {} opened, {} added, {} \
             removed since the start\n",
            c.encrypted_requests,
            format_bytes(c.encrypted_bytes),
            c.decrypted_requests,
            format_bytes(c.decrypted_bytes),
            c.cipher_ns as f64 / 1e9,
            c.key_slot_opens,
            c.key_slots_added,
            c.key_slots_removed,
        );
    }
    out
}

/// `status --json`'s `crypt`: an object per crypt device.
pub(crate) fn status_json(roots: &[Arc<dyn Device>]) -> serde_json::Value {
    counted(roots)
        .into_iter()
        .map(|(name, c, slots)| {
            serde_json::json!({
                "device": name,
                "encrypted_requests": c.encrypted_requests,
                "encrypted_bytes": c.encrypted_bytes,
                "decrypted_requests": c.decrypted_requests,
                "decrypted_bytes": c.decrypted_bytes,
                "cipher_seconds": c.cipher_ns as f64 / 1e9,
                "key_slots": slots,
                "key_slot_opens": c.key_slot_opens,
                "key_slots_added": c.key_slots_added,
                "key_slots_removed": c.key_slots_removed,
            })
        })
        .collect::<Vec<_>>()
        .into()
}

/// `crypt list`: a line per device.
fn list_text(all: &[Crypt]) -> String {
    if all.is_empty() {
        return "no crypt devices\n".into();
    }
    let mut text = String::new();
    for Crypt {
        device: d,
        slots: c,
    } in all
    {
        text += &format!(
            "{}: {}; opened by {}; key slots: {}\n",
            d.name(),
            d.describe(),
            match c.opened_by() {
                Some(s) => format!("key slot {s}"),
                None => "its volume key (key_file)".into(),
            },
            c.slots()
                .iter()
                .map(|s| format!("{} {}", s.index, s.kdf))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    text
}

/// `crypt list --json`.
fn list_json(all: &[Crypt]) -> serde_json::Value {
    all.iter()
        .map(
            |Crypt {
                 device: d,
                 slots: c,
             }| {
                let seg = c.segment();
                serde_json::json!({
                    "device": d.name(),
                    "format": c.format().name(),
                    "sector_size": seg.sector_bytes,
                    "data_offset": seg.offset,
                    "opened_by_slot": c.opened_by(),
                    "slots": c.slots().iter().map(|s| serde_json::json!({
                        "slot": s.index,
                        "kdf": s.kdf.to_string(),
                    })).collect::<Vec<_>>(),
                })
            },
        )
        .collect::<Vec<_>>()
        .into()
}
