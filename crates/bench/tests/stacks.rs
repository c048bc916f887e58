//! Stacks under load: degraded arrays under --verify, fault and delay devices, flush
//! batching and hand-off dispatch, checked end to end through bench jobs.

use std::sync::Arc;

use cairn_bench::{run, JobSpec, Pattern};
use cairn_config::StackFile;
use cairn_core::{Device, DispatchMode, FlushMode, Switches};

fn open(text: &str, name: &str) -> Arc<dyn Device> {
    StackFile::parse(text).unwrap().open(name).unwrap()
}

fn members(n: usize, size: &str) -> String {
    (0..n)
        .map(|i| format!("[device.m{i}]\ntype = \"mem\"\nsize = \"{size}\"\n"))
        .collect()
}

fn verify_job(ios: u64) -> JobSpec {
    JobSpec {
        rw: Pattern::RandRw,
        verify: true,
        iodepth: 16,
        size: Some(8 << 20),
        io_size: Some(ios * 4096),
        fsync: 8,
        ..JobSpec::default()
    }
}

/// raid10 or mirror with member 1 behind a fault device that starts failing `fail` after
/// `after` requests.
fn degraded_stack(kind: &str, fail: &str, after: u64) -> String {
    let n = if kind == "mirror" { 2 } else { 4 };
    let list: Vec<String> = (0..n)
        .map(|i| {
            if i == 1 {
                "\"f1\"".into()
            } else {
                format!("\"m{i}\"")
            }
        })
        .collect();
    format!(
        "{}[device.f1]\ntype = \"fault\"\nbase = \"m1\"\nafter_ios = {after}\nfail = {fail}\n\
         [device.top]\ntype = \"{kind}\"\nmembers = [{}]\n",
        members(n, "16M"),
        list.join(", ")
    )
}

#[test]
fn member_failing_mid_run_is_invisible_to_the_client() {
    for kind in ["raid10", "mirror"] {
        for fail in [
            "[\"read\", \"write\", \"flush\"]",
            "[\"read\"]",
            "[\"write\"]",
        ] {
            let device = open(&degraded_stack(kind, fail, 3000), "top");
            let report = run(
                &verify_job(20_000),
                device.clone(),
                Switches::default(),
                false,
            )
            .unwrap();
            assert!(
                report.failure.is_none(),
                "{kind} {fail}: {:?}",
                report.failure
            );
            assert!(
                report.verified_blocks > 0,
                "{kind} {fail}: nothing verified"
            );
            let failed = cairn_core::array::failed_members(&device);
            if fail.contains("write") {
                // A lost write takes the member out; reads alone only get retried.
                assert_eq!(failed, ["f1"], "{kind} {fail}");
            } else {
                assert!(failed.is_empty(), "{kind} {fail}: {failed:?}");
            }
        }
    }
}

#[test]
fn array_fails_only_when_data_has_no_copy_left() {
    // Members 0 and 1 hold the same chunks in a 4-member, 2-copy raid10: lose both.
    let text = format!(
        "{}[device.f0]\ntype = \"fault\"\nbase = \"m0\"\nafter_ios = 100\n\
         [device.f1]\ntype = \"fault\"\nbase = \"m1\"\nafter_ios = 100\n\
         [device.top]\ntype = \"raid10\"\nmembers = [\"f0\", \"f1\", \"m2\", \"m3\"]\n",
        members(4, "16M")
    );
    let device = open(&text, "top");
    let report = run(
        &verify_job(20_000),
        device.clone(),
        Switches::default(),
        false,
    )
    .unwrap();
    assert!(
        report.failure.is_some(),
        "both copies of half the chunks are gone"
    );
    assert_eq!(cairn_core::array::failed_members(&device).len(), 2);
}

#[test]
fn fault_device_fails_what_it_is_told_to() {
    let text = format!(
        "{}[device.f]\ntype = \"fault\"\nbase = \"m0\"\nfail = [\"write\"]\nerrno = \"ENOSPC\"\n",
        members(1, "16M")
    );
    let job = JobSpec {
        rw: Pattern::RandWrite,
        size: Some(1 << 20),
        ..JobSpec::default()
    };
    let report = run(&job, open(&text, "f"), Switches::default(), false).unwrap();
    match report.failure {
        Some(cairn_bench::Failure::Io { errno, .. }) => assert_eq!(errno, libc::ENOSPC),
        other => panic!("expected ENOSPC, got {other:?}"),
    }
    // Reads pass through untouched.
    let job = JobSpec {
        rw: Pattern::RandRead,
        size: Some(1 << 20),
        ..JobSpec::default()
    };
    let report = run(&job, open(&text, "f"), Switches::default(), false).unwrap();
    assert!(report.failure.is_none());
    // A sector range: only requests touching it fail.
    let text = format!(
        "{}[device.f]\ntype = \"fault\"\nbase = \"m0\"\nsectors = [8, 16]\n",
        members(1, "16M")
    );
    let job = JobSpec {
        rw: Pattern::Read,
        bs: 4096,
        size: Some(4096),
        io_size: Some(4096),
        ..JobSpec::default()
    };
    assert!(run(&job, open(&text, "f"), Switches::default(), false)
        .unwrap()
        .failure
        .is_none());
    let job = JobSpec {
        offset: 4096,
        ..job
    };
    assert!(run(&job, open(&text, "f"), Switches::default(), false)
        .unwrap()
        .failure
        .is_some());
}

#[test]
fn delay_device_keeps_data_and_adds_latency() {
    let text = format!(
        "{}[device.d]\ntype = \"delay\"\nbase = \"m0\"\nread = \"200us\"\nwrite = \"100us\"\nflush = \"1ms\"\n",
        members(1, "16M")
    );
    let report = run(
        &verify_job(2000),
        open(&text, "d"),
        Switches::default(),
        false,
    )
    .unwrap();
    assert!(report.failure.is_none(), "{:?}", report.failure);
    assert!(report.verified_blocks > 0);
    // Every completion waited at least its delay (a lower bound, not a timing target). The
    // histogram keeps three significant digits, so its minimum may sit up to 0.1% under.
    for (dir, ns) in [(0, 200_000u64), (1, 100_000), (2, 1_000_000)] {
        let min = report.dirs[dir].clat.min();
        assert!(min >= ns - ns / 1000, "direction {dir}: min {min} < {ns}");
    }
}

#[test]
fn every_flush_request_completes_in_both_modes() {
    let text = format!(
        "{}{}[device.top]\ntype = \"raid10\"\nmembers = [\"d0\", \"d1\", \"d2\", \"d3\"]\n",
        members(4, "16M"),
        (0..4)
            .map(|i| format!(
                "[device.d{i}]\ntype = \"delay\"\nbase = \"m{i}\"\nflush = \"100us\"\n"
            ))
            .collect::<String>()
    );
    for flush in [FlushMode::Batched, FlushMode::Serial] {
        let job = JobSpec {
            rw: Pattern::RandWrite,
            iodepth: 32,
            fsync: 1,
            size: Some(8 << 20),
            io_size: Some(2000 * 4096),
            verify: true,
            ..JobSpec::default()
        };
        let switches = Switches {
            flush,
            ..Switches::default()
        };
        let report = run(&job, open(&text, "top"), switches, false).unwrap();
        assert!(report.failure.is_none(), "{flush:?}: {:?}", report.failure);
        // fsync 1: one flush request per write, each answered.
        assert_eq!(report.dirs[2].ios, report.dirs[1].ios, "{flush:?}");
    }
}

#[test]
fn handoff_dispatch_gives_the_same_bytes() {
    let text = format!(
        "{}[device.top]\ntype = \"raid10\"\nmembers = [\"m0\", \"m1\", \"m2\", \"m3\"]\n",
        members(4, "16M")
    );
    let switches = Switches {
        dispatch: DispatchMode::Handoff,
        ..Switches::default()
    };
    let report = run(&verify_job(5000), open(&text, "top"), switches, false).unwrap();
    assert!(report.failure.is_none(), "{:?}", report.failure);
    assert!(report.verified_blocks > 0);
}
