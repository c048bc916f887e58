//! The hot path allocates nothing per I/O: a run of 16x more requests makes no more
//! allocations than a short one (setup allocates; the steady state must not).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use cairn_bench::{JobSpec, Pattern};
use cairn_core::Switches;
use cairn_leaves::LeafSpec;

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made by one run of `ios` requests.
fn allocations(spec_text: &str, ios: u64) -> u64 {
    let spec = LeafSpec::parse(spec_text).unwrap();
    let device = cairn_leaves::open(&spec, "dev").unwrap();
    let job = JobSpec {
        rw: Pattern::RandRw,
        iodepth: 16,
        io_size: Some(ios * 4096),
        size: Some(8 << 20),
        fsync: 8,
        ..JobSpec::default()
    };
    let before = ALLOCATIONS.load(Relaxed);
    let report = cairn_bench::run(&job, device, Switches::default(), false).unwrap();
    assert!(report.failure.is_none(), "{:?}", report.failure);
    assert_eq!(report.dirs[0].ios + report.dirs[1].ios, ios);
    ALLOCATIONS.load(Relaxed) - before
}

#[test]
fn steady_state_allocates_nothing() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let file = dir.path().join("f");
    let specs = [
        "null:16M".to_string(),
        format!("file:{},size=16M,engine=io_uring", file.display()),
        format!("file:{},size=16M,engine=aio", file.display()),
    ];
    for spec in &specs {
        // Warm up once (lazily created statics, thread-locals), then compare.
        allocations(spec, 1024);
        let short = allocations(spec, 1024);
        let long = allocations(spec, 16 * 1024);
        // Setup allocations are the same for both; allow a little for thread start-up
        // jitter, far below one allocation per request (15360 more requests).
        assert!(
            long <= short + 16,
            "{spec}: {short} allocations for 1024 I/Os, {long} for 16384"
        );
    }
}
