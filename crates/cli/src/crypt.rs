//! `cairn admin SOCKET crypt ...`: each crypt device's LUKS header and key slots, and
//! adding and removing key slots online (key rotation: add the new passphrase, then
//! remove the old slot). Passphrases come from files the server reads; no key or
//! passphrase is ever printed or logged.

use std::sync::Arc;

use cairn_core::Device;
use cairn_devices::crypt::device::{read_secret, CryptDevice};

use crate::view::all_devices;

const USAGE: &str = "usage: crypt list [--json] | add DEVICE PASSPHRASE_FILE [KEY=VALUE...] (kdf, kdf_iterations, kdf_memory, kdf_parallel, kdf_hash) | remove DEVICE SLOT";

/// The crypt devices served.
fn crypts(roots: &[Arc<dyn Device>]) -> Vec<(String, Arc<dyn Device>)> {
    all_devices(roots)
        .into_iter()
        .filter(|(_, d)| crypt_of(d).is_some())
        .map(|(_, d)| (d.name().to_string(), d))
        .collect()
}

fn crypt_of(d: &Arc<dyn Device>) -> Option<&CryptDevice> {
    d.as_any()?.downcast_ref::<CryptDevice>()
}

/// `crypt ACTION ...`.
pub(crate) fn command(args: &[&str], roots: &[Arc<dyn Device>]) -> String {
    let all = crypts(roots);
    let find = |name: &str| {
        all.iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, d)| crypt_of(d))
            .ok_or_else(|| format!("error: no crypt device '{name}' is served\n"))
    };
    match args {
        ["list"] | ["list", "--json"] => {
            let mut text = String::new();
            let mut items = Vec::new();
            for (name, d) in &all {
                let c = crypt_of(d).expect("a crypt device");
                let slots = c.slots();
                let seg = c.segment();
                text += &format!(
                    "{name}: {}; opened by {}; key slots: {}\n",
                    d.describe(),
                    match c.opened_by() {
                        Some(s) => format!("key slot {s}"),
                        None => "its volume key (key_file)".into(),
                    },
                    slots
                        .iter()
                        .map(|s| format!("{} {}", s.index, s.kdf))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                items.push(serde_json::json!({
                    "device": name,
                    "format": c.format().name(),
                    "sector_size": seg.sector_bytes,
                    "data_offset": seg.offset,
                    "opened_by_slot": c.opened_by(),
                    "slots": slots.iter().map(|s| serde_json::json!({
                        "slot": s.index,
                        "kdf": s.kdf.to_string(),
                    })).collect::<Vec<_>>(),
                }));
            }
            if args.len() == 2 {
                format!("ok\n{}\n", serde_json::Value::from(items))
            } else if text.is_empty() {
                "ok\nno crypt devices\n".into()
            } else {
                format!("ok\n{text}")
            }
        }
        ["add", device, file, words @ ..] => {
            let c = match find(device) {
                Ok(c) => c,
                Err(e) => return e,
            };
            let kdf = match cairn_devices::config::crypt_kdf(device, c.format(), words) {
                Ok(k) => k,
                Err(e) => return format!("error: {e}\n"),
            };
            let passphrase = match read_secret("passphrase file", std::path::Path::new(file)) {
                Ok(p) => p,
                Err(e) => return format!("error: {e}\n"),
            };
            match c.add_slot(&passphrase, kdf) {
                Ok(slot) => {
                    log::info!("cairn: admin: crypt {device}: key slot {slot} added");
                    format!("ok: crypt {device}: key slot {slot} added\n")
                }
                Err(e) => format!("error: crypt {device}: {e}\n"),
            }
        }
        ["remove", device, slot] => {
            let c = match find(device) {
                Ok(c) => c,
                Err(e) => return e,
            };
            let Ok(slot) = slot.parse::<usize>() else {
                return format!("error: '{slot}' is not a key slot number\n");
            };
            match c.remove_slot(slot) {
                Ok(()) => {
                    log::info!("cairn: admin: crypt {device}: key slot {slot} removed");
                    format!("ok: crypt {device}: key slot {slot} removed\n")
                }
                Err(e) => format!("error: crypt {device}: {e}\n"),
            }
        }
        _ => format!("error: {USAGE}\n"),
    }
}
