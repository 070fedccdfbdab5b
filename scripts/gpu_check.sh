#!/bin/bash
# Check one GPU machine in under 8 minutes, downloading nothing: versions and device; a few train
# steps of a Llama-3.2-1B-shaped model at 16K (step time, tokens/s, MFU, peak memory against the
# compiled prediction, a profile by kind of work) and the step after a checkpoint save; every
# attention kernel (xla, cudnn, pallas, blockwise) and a ring of 2 against a float32 reference
# (head_dim 128 and 256, packed and not, bf16 and fp16); fwd+bwd attention per kernel at 16K and
# 64K tokens, and our Pallas kernel's tiles at head_dim 128 and 256; the 1B's and 8B's GEMMs; the experts' grouped matmuls (ours and ragged_dot);
# 2 layers of the 8B's shape; the FP8 steps on sm89+ (their
# FP8 GEMMs counted); and a calibration candidate fitted to all of it. The work is
# benchmarks/gpu_check/ (BENCHMARKS.md section 12); this wraps it.
#
#   bash scripts/gpu_check.sh [OUT.json] [--steps N] [--repeats N] [--budget-s S]
#                                                   # default OUT: gpu_check.json, S: 420
#
# Needs JAX with its CUDA plugin, flax, optax, orbax-checkpoint, safetensors and tokenizers
# installed already (e.g. pip install -e ".[cuda13]" once; not grain: the check trains on synthetic
# data); the check installs only this checkout. PYTHON: the interpreter (default python3). Exit
# status: 0 all passed, 1 a check failed (the JSON says which), 2 no GPU or bad input, 124 the
# 8-minute limit was hit (the JSON holds the sections that finished: it is replaced whole after
# each one). GPU_CHECK_TIMEOUT_S: that limit in seconds (tests). Without a GPU, --cpu-smoke runs
# the same code on tiny shapes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=gpu_check.json
if [[ $# -gt 0 && $1 != --* ]]; then
    OUT=$1
    shift
fi

# This checkout only, over the installed packages: --no-deps --no-index fetch nothing, and
# --no-build-isolation builds with the installed setuptools instead of downloading one. Without
# setuptools the check still runs, from the checkout (benchmarks/gpu_check/ puts it on the path).
if ! "$PYTHON" -m pip install --quiet --no-deps --no-index --no-build-isolation -e . 2>/dev/null; then
    echo "note: pip could not install this checkout here (no setuptools?); running it from $PWD"
fi

status=0
LIMIT=${GPU_CHECK_TIMEOUT_S:-480}
timeout "$LIMIT" "$PYTHON" -m benchmarks.gpu_check --out "$OUT" "$@" || status=$?
if [[ $status -eq 124 ]]; then
    echo "gpu check: stopped at the ${LIMIT} s limit; $OUT holds the sections that finished" >&2
fi
exit $status
