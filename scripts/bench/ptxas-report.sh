#!/usr/bin/env bash
# Registers, shared memory and spills of every kernel of the ops program, without a GPU:
# NVRTC compiles the program (the same options as at run time) and ptxas assembles it for
# sm_90a. Needs libnvrtc and ptxas, e.g. from PyPI:
#   python3 -m pip download --no-deps nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88
#   unzip both into DIR; NVRTC_LIB=DIR/nvidia/cu13/lib PTXAS=DIR/nvidia/cu13/bin/ptxas
# Usage: scripts/bench/ptxas-report.sh [kernel-name-filter]
# PROGRAM=gemm reports the tree GEMM's program (gemm_tree.cu, gemm_sm90*.cu) instead.
# ARCH=sm_80 compiles and assembles the ops program for Ampere (default sm_90a).
set -euo pipefail
cd "$(dirname "$0")/../.."
lib=${NVRTC_LIB:-/opt/cuda13/nvidia/cu13/lib}
ptxas=${PTXAS:-/opt/cuda13/nvidia/cu13/bin/ptxas}
out=$(mktemp -d)
[[ -e $lib/libnvrtc.so ]] || ln -sf "$lib/libnvrtc.so.13" "$lib/libnvrtc.so" 2>/dev/null || true
if [[ ${PROGRAM:-ops} == gemm ]]; then
    # The GEMM's own program (kernels/src/cuda/gemm/program.rs).
    ARBOR_GEMM_PTX_OUT=$out/ops.ptx LD_LIBRARY_PATH=$lib cargo test --release -q -p arbor-kernels source_compiles_for_sm_90a >/dev/null
else
    ARBOR_PTX_ARCH=${ARCH:-sm_90a} ARBOR_PTX_OUT=$out/ops.ptx LD_LIBRARY_PATH=$lib cargo test --release -q -p arbor-kernels write_ptx_when_asked >/dev/null
fi
"$ptxas" -arch="${ARCH:-sm_90a}" -v "$out/ops.ptx" -o "$out/ops.cubin" 2>&1 |
    awk -v f="${1:-}" '/Compiling entry function/ { name = $0; sub(/.*entry function ./, "", name); sub(/. for .*/, "", name) }
        /Used [0-9]+ registers/ && (f == "" || index(name, f)) { sub(/^ptxas info *: */, ""); printf "%-32s %s\n", name, $0 }
        /bytes stack frame/ && (f == "" || index(name, f)) { sub(/^ptxas info *: */, ""); printf "%-32s   %s\n", name, $0 }'
rm -rf "$out"
