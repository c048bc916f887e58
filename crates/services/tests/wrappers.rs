//! Every single-child wrapper (fault, delay, throttle, write-back cache, crypt, the dirty
//! layer) answers what a wrapper passes on as its base does: read-only, coherent across
//! queues, lost writes; and passes power cuts (plain and torn, with their seed) and a
//! loss made up for down to it. The base is a probe whose answers no default gives. And
//! each offers its own capabilities, not its base's (but for the dirty layer, which
//! stands in for its base).

use std::sync::Arc;

use cairn_core::{Device, DirtyBitmaps, LostWrites, Switches, WriteBackCache};
use cairn_services::crypt::device::{CryptDevice, CryptOptions, KeySlots};
use cairn_services::crypt::{Hash, Kdf};
use cairn_services::dirty::device::TrackedDevice;
use cairn_services::dirty::store::Store;
use cairn_services::throttle::{Limits, Throttle, ThrottleAdmin, ThrottlePolicy};
use cairn_stacks::cache::writeback::{Budget, Writeback};
use cairn_stacks::cache::CacheDevice;
use cairn_stacks::wrap::{Delay, Delays, FaultRule, Faults, WrapDevice};
use cairn_testkit::probe::{Call, Probe};

const BYTES: u64 = 32 << 20;

/// Each wrapper over a probe of its own, by name.
fn wrappers(dir: &std::path::Path) -> Vec<(&'static str, Arc<Probe>, Arc<dyn Device>)> {
    let mut out: Vec<(&'static str, Arc<Probe>, Arc<dyn Device>)> = Vec::new();
    let mut add = |name: &'static str, wrap: &dyn Fn(Arc<dyn Device>) -> Arc<dyn Device>| {
        let probe = Arc::new(Probe::new("p", BYTES));
        let w = wrap(probe.clone());
        out.push((name, probe, w));
    };
    add("fault", &|b| {
        let rule = FaultRule {
            ops: [false; cairn_core::Op::COUNT],
            after_ios: None,
            after: None,
            probability: None,
            sectors: None,
            times: None,
            errno: libc::EIO,
            power_cut: false,
            torn: false,
        };
        Arc::new(WrapDevice::new("w", b, Arc::new(Faults::new(rule))))
    });
    add("delay", &|b| {
        let delay = Arc::new(Delay::new(Delays::default()));
        Arc::new(WrapDevice::new("w", b, delay))
    });
    add("throttle", &|b| {
        let throttle = Arc::new(Throttle::new(Limits::default()));
        let policy = Arc::new(ThrottlePolicy::new(throttle, None));
        Arc::new(WrapDevice::new("w", b, policy))
    });
    add("cache", &|b| {
        let budget = Arc::new(Budget::new(&Writeback::default(), 1 << 20).unwrap());
        Arc::new(CacheDevice::new("w", b, 1 << 20, budget, Switches::default()).unwrap())
    });
    add("crypt", &|b| {
        let passphrase = dir.join("passphrase");
        std::fs::write(&passphrase, b"probe").unwrap();
        let opts = CryptOptions {
            passphrase_file: Some(passphrase),
            create: true,
            kdf: Some(Kdf::Pbkdf2 {
                hash: Hash::Sha256,
                iterations: 1000,
            }),
            ..CryptOptions::default()
        };
        // Examined only (nothing written): a stand-in of the size it would have.
        Arc::new(CryptDevice::open("w", b, &opts, false).unwrap())
    });
    add("dirty", &|b| {
        let store = Store::open(&dir.join("bitmaps"), "p", BYTES, false).unwrap();
        Arc::new(TrackedDevice::new(b, store).unwrap())
    });
    out
}

/// Every wrapper is checked, and every answer that differs from its base's is listed.
#[test]
fn a_wrapper_answers_and_passes_on_as_its_base_does() {
    let dir = tempfile::tempdir().unwrap();
    let mut wrong = Vec::new();
    for (name, probe, w) in wrappers(dir.path()) {
        let mut check = |what: &str, same: bool| {
            if !same {
                wrong.push(format!("{name}: {what}"));
            }
        };
        check("read_only", w.read_only());
        check("coherent_across_queues", !w.coherent_across_queues());
        check("lost_writes", w.lost_writes() == LostWrites::Lost);
        probe.take_calls();
        w.lost_writes_made_up();
        check(
            "lost_writes_made_up",
            probe.take_calls() == [Call::LostWritesMadeUp],
        );
        w.power_cut();
        check("power_cut", probe.take_calls() == [Call::PowerCut]);
        w.power_cut_torn(42);
        check(
            "power_cut_torn",
            probe.take_calls() == [Call::PowerCutTorn(42)],
        );
        let children: Vec<String> = w.children().iter().map(|c| c.name().to_string()).collect();
        // The dirty layer stands in for its base under the same name: its children are
        // the base's (none here); every other wrapper shows its base below it.
        let expected: &[&str] = if name == "dirty" { &[] } else { &["p"] };
        check("children", children == expected);
    }
    assert!(wrong.is_empty(), "answered unlike the base: {wrong:?}");
}

/// A wrapper offers its own capabilities (a throttle's admin, a crypt device's key slots,
/// a cache's counters, the dirty layer's bitmaps and store), and its base's only when it
/// stands in for its base under the same name (the dirty layer).
#[test]
fn a_wrapper_offers_its_own_capabilities_and_only_a_stand_in_its_base_s() {
    let dir = tempfile::tempdir().unwrap();
    for (name, _, w) in wrappers(dir.path()) {
        let offered = [
            ("throttle", w.capability::<dyn ThrottleAdmin>().is_some()),
            ("crypt", w.capability::<dyn KeySlots>().is_some()),
            ("cache", w.capability::<dyn WriteBackCache>().is_some()),
            ("dirty", w.capability::<dyn DirtyBitmaps>().is_some()),
            ("dirty", w.capability::<Store>().is_some()),
        ];
        for (owner, found) in offered {
            assert_eq!(found, owner == name, "{name} offering {owner}'s capability");
        }
    }
    let budget = Arc::new(Budget::new(&Writeback::default(), 1 << 20).unwrap());
    let cache: Arc<dyn Device> = Arc::new(
        CacheDevice::new(
            "c",
            Arc::new(Probe::new("p", BYTES)),
            1 << 20,
            budget,
            Switches::default(),
        )
        .unwrap(),
    );
    let delay: Arc<dyn Device> = Arc::new(WrapDevice::new(
        "w",
        cache.clone(),
        Arc::new(Delay::new(Delays::default())),
    ));
    assert!(delay.capability::<dyn WriteBackCache>().is_none());
    let store = Store::open(&dir.path().join("c-bitmaps"), "c", BYTES, false).unwrap();
    let tracked: Arc<dyn Device> = Arc::new(TrackedDevice::new(cache, store).unwrap());
    assert!(tracked.capability::<dyn WriteBackCache>().is_some());
}
