#!/usr/bin/env bash
# cairn's whole test suite, as CI runs it: installs what the tests need (as root, when
# missing), then formatting, lints, and every unit, property and integration test.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the integration tests drive (peers and real clients).
PACKAGES=(fio nbdkit libnbd-bin python3-libnbd qemu-utils fuse3 dbench nbd-server)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        echo "test.sh: installing ${missing[*]}"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } \
            || echo "test.sh: warning: could not install ${missing[*]}; tests that need them say so"
    else
        echo "test.sh: not root, not installing ${missing[*]}; tests that need them say so"
    fi
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace 2>&1 | tee "$log"
# One closing line over every test binary (cargo prints one per binary, doc tests last).
awk '/^test result:/ { p += $4; f += $6; s += $8 }
     END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, s; exit (f > 0 || p == 0) }' "$log"
