#!/usr/bin/env bash
# Builds release binaries here and stages them in .device/ (git-ignored) for a device call
# with carry [".device"]:
#   .device/arbor, .device/arbor-launch        the CLI and the launcher
#   .device/tests/kernels-gpu                   arbor-kernels unit tests (GPU kernel invariance)
#   .device/tests/model-gpu                     tests/gpu_model.rs (CPU vs GPU, prefill == decode)
#   .device/py/arbor                            the Python package with its native core
#                                               (scripts/gpu/torch-parity.py imports it)
# Then run scripts/gpu/gpu-check.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
# .gitignore lists /.device/ already; the exclude line keeps older checkouts right too.
info=$(git rev-parse --git-dir)/info
mkdir -p "$info"
grep -qx '/.device/' "$info/exclude" 2>/dev/null || echo '/.device/' >>"$info/exclude"

cargo build --release --bins
# Test executables: cargo prints their paths in its JSON messages.
test_exes() {
    cargo test --release --no-run --message-format=json "$@" 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])
'
}
kernels_exe=$(test_exes -p arbor-kernels --lib | tail -n 1)
model_exe=$(test_exes -p arbor --test gpu_model | tail -n 1)
if [[ -z "$kernels_exe" || -z "$model_exe" ]]; then
    echo "build-device: could not find the test executables (kernels: '$kernels_exe', model: '$model_exe')" >&2
    exit 1
fi

# The Python package (arbor.torch) with its native core, importable from .device/py.
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}" cargo build --release --manifest-path python/Cargo.toml
native="${CARGO_TARGET_DIR:-$PWD/target}/release/lib_native.so"

rm -rf .device/tests .device/py
mkdir -p .device/tests .device/py
cp -r python/arbor .device/py/
find .device/py -name __pycache__ -prune -exec rm -rf {} +
cp "$native" .device/py/arbor/_native.abi3.so
cp target/release/arbor target/release/arbor-launch .device/
cp "$kernels_exe" .device/tests/kernels-gpu
cp "$model_exe" .device/tests/model-gpu
du -sh .device
ls -l .device .device/tests
