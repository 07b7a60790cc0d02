#!/usr/bin/env bash
# The mpirun and multi-host CI jobs, called from .ci/run (as root):
#   1. the MPI transport's own tests (a singleton world, 4 ranks under mpirun, a failing rank);
#   2. arbor built with `--features mpi` under `mpirun -np 4 --oversubscribe`: TP=4 output
#      bit-identical to TP=1, `arbor check` over TP 1/2/4/8 with mpirun as its launcher, and
#      a failing job that ends instead of hanging;
#   3. the multi-host test: ranks in network namespaces talking TCP (fails, not skips, when
#      namespaces cannot be made: ARBOR_REQUIRE_NETNS=1).
# Needs openmpi-bin, libopenmpi-dev and libclang-dev (see docs/multihost.md).
#
# It builds into the normal target dir (only the workspace crates are rebuilt with the
# feature, ~1-2 min on 2 cores), which leaves target/release/arbor built WITH the feature:
# run it after the default test suite, or set ARBOR_MPI_TARGET_DIR (e.g. target/mpi) to keep
# the two builds apart at the cost of building every dependency twice.
set -euo pipefail
cd "$(dirname "$0")/../.."

missing=()
command -v mpirun >/dev/null || missing+=("mpirun (openmpi-bin)")
command -v mpicc >/dev/null || missing+=("mpicc (libopenmpi-dev)")
command -v ip >/dev/null || missing+=("ip (iproute2)")
if ((${#missing[@]})); then
    echo "ci-mpi: missing: ${missing[*]}" >&2
    echo "ci-mpi: apt-get install -y --no-install-recommends openmpi-bin libopenmpi-dev libclang-dev iproute2" >&2
    exit 1
fi

if [[ -n "${ARBOR_MPI_TARGET_DIR:-}" ]]; then
    export CARGO_TARGET_DIR="$ARBOR_MPI_TARGET_DIR"
fi
export ARBOR_REQUIRE_NETNS=1

echo "== ci-mpi: MPI transport tests (arbor-collective --features mpi)"
cargo test --release -p arbor-collective --features mpi --lib mpi::

echo "== ci-mpi: arbor --features mpi under mpirun, and ranks across network namespaces"
cargo test --release --features mpi --test mpirun --test multihost

echo "== ci-mpi: all passed"
