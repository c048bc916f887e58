#!/usr/bin/env bash
# cairn's whole test suite, as CI runs it: installs what the tests need (as root, when
# missing), then formatting, lints, and every unit, property and integration test.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the integration tests drive (peers and real clients; prometheus for
# promtool, which checks the metrics endpoint's text; xfsprogs for the engine tests on xfs),
# and Ceph's monitor, OSD and client for the rbd tests' throw-away cluster
# (scripts/ceph-cluster), installed on their own so that a failure there costs only them.
install_missing() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -gt 0 ] || return 0
    if [ "$(id -u)" = 0 ]; then
        echo "test.sh: installing ${missing[*]}"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } \
            || echo "test.sh: warning: could not install ${missing[*]}; tests that need them say so"
    else
        echo "test.sh: not root, not installing ${missing[*]}; tests that need them say so"
    fi
}
install_missing fio nbdkit libnbd-bin python3-libnbd qemu-utils fuse3 dbench nbd-server openssl prometheus iproute2 xfsprogs cryptsetup-bin python3-cryptography
install_missing ceph-mon ceph-osd ceph-common

# FUSE over io_uring is off by default in the fuse module; the FUSE export's tests run
# with it and without (they record a skip for the io_uring half when it stays off).
if [ "$(id -u)" = 0 ] && [ -w /sys/module/fuse/parameters/enable_uring ]; then
    echo Y > /sys/module/fuse/parameters/enable_uring || true
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
# The fuzz crates (crates/*/fuzz) are workspaces of their own, so the commands above and
# below never build them: checked here on stable, so that they cannot fall behind the
# code they fuzz (running them needs nightly and cargo-fuzz; see their READMEs).
# libfuzzer-sys's build script compiles libFuzzer's C++ even for a check.
echo "== fuzz crates (cargo fmt --check, cargo check)"
if command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null; then
    for f in crates/*/fuzz/Cargo.toml; do
        cargo fmt --manifest-path "$f" -- --check
        CARGO_TARGET_DIR=target/fuzz-check cargo check --quiet --manifest-path "$f"
    done
else
    echo "SKIP fuzz crates: no C++ compiler (c++, g++ or clang++) for libfuzzer-sys's build script; they were not checked"
fi
echo "== cargo test"
log=$(mktemp)
skips=$(mktemp)
ceph_dir=""
cleanup() {
    rm -f "$log" "$skips"
    if [ -n "$ceph_dir" ]; then
        scripts/ceph-cluster stop "$ceph_dir/c" || true
        rm -rf "$ceph_dir"
    fi
}
trap cleanup EXIT
# Interrupted, it still stops the cluster (bash runs the EXIT trap on exit, not on a signal).
trap 'exit 130' INT
trap 'exit 143' TERM
# One Ceph cluster for the rbd tests that leave its daemons alone (each uses images of
# its own); tests that stop an OSD start their own. Without it they start their own too.
if [ "$(id -u)" = 0 ] && command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null; then
    ceph_dir=$(mktemp -d /dev/shm/cairn-test-ceph.XXXXXX)
    if conf=$(scripts/ceph-cluster start "$ceph_dir/c" | tail -n 1); then
        export CAIRN_TEST_CEPH_CONF="$conf"
        echo "test.sh: a Ceph cluster for the rbd tests: $conf"
    else
        echo "test.sh: warning: the shared Ceph cluster did not start; rbd tests start their own"
    fi
fi
# A test that cannot run here (a tool missing, not root) appends "SKIP <test>: <reason>" to
# $CAIRN_SKIP_LOG and returns, which cargo counts as passed.
status=0
# --no-fail-fast: every test binary runs, so one that fails does not hide the others.
CAIRN_SKIP_LOG="$skips" cargo test --workspace --no-fail-fast 2>&1 | tee "$log" || status=$?
if [ -s "$skips" ]; then
    echo "== skipped"
    cat "$skips"
fi
nskip=$(grep -c '^SKIP ' "$skips" || true)
# One closing line over every test binary (cargo prints one per binary, doc tests last);
# tests that skipped themselves move from passed to skipped.
awk -v k="$nskip" '/^test result:/ { p += $4; f += $6; s += $8 }
     END { printf "tests: %d passed, %d failed, %d skipped\n", p - k, f, s + k; exit (f > 0 || p == 0) }' "$log"
exit "$status"
