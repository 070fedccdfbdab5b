#!/bin/bash
# Check one GPU machine in under 8 minutes, downloading nothing: versions and device, every
# attention kernel (xla, cudnn, pallas, blockwise) against a float32 reference (forward and
# gradients, packed and not), fwd+bwd attention time per kernel at 16K tokens, and a few train
# steps of a Llama-3.2-1B-shaped model at 16K: step time, tokens/s, MFU, peak memory against the
# compiled program's prediction, and the same steps with FP8 projections on sm89+ (their step
# time against bf16's). The work is benchmarks/gpu_check.py; this wraps it.
#
#   bash scripts/gpu_check.sh [OUT.json] [--steps N] [--repeats N]    # default OUT: gpu_check.json
#
# Needs JAX with its CUDA plugin, flax, optax, orbax-checkpoint, safetensors and tokenizers
# installed already (e.g. pip install -e ".[cuda13]" once; not grain: the check trains on synthetic
# data); the check installs only this checkout. PYTHON: the interpreter (default python3). Exit
# status: 0 all passed, 1 a check failed (the JSON says which), 2 no GPU or bad input, 124 the
# 8-minute limit was hit (the JSON holds the sections that finished). Without a GPU, --cpu-smoke
# runs the same code on tiny shapes.
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
# setuptools the check still runs, from the checkout (benchmarks/gpu_check.py puts it on the path).
if ! "$PYTHON" -m pip install --quiet --no-deps --no-index --no-build-isolation -e . 2>/dev/null; then
    echo "note: pip could not install this checkout here (no setuptools?); running it from $PWD"
fi

status=0
timeout 480 "$PYTHON" -m benchmarks.gpu_check --out "$OUT" "$@" || status=$?
if [[ $status -eq 124 ]]; then
    echo "gpu check: stopped at the 8-minute limit; $OUT holds the sections that finished" >&2
fi
exit $status
