#!/bin/bash
# Regenerate the figures in docs/figures/ (about a minute on 2 CPU cores, no accelerator needed):
#   scripts/make_figures.sh            # PYTHON=.venv/bin/python scripts/make_figures.sh for a venv
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=docs/figures
RUNS=${RUNS:-/tmp/basp_figure_runs}
mkdir -p "$RUNS"

# 1. The two layouts of the paper's testbed: 8 GPUs, 4 per host, microbatch B=2.
$PY -m train.plot layouts --devices 8 --devices-per-host 4 --batch 2 -o $OUT/layouts.png

# 2. Loss of the CPU demo under BASP and Ulysses: same data, same seed, so the curves coincide.
#    devices_per_host=4 plans for two emulated hosts (it changes the layout description, not the math).
for mode in basp ulysses; do
    rm -rf "$RUNS/demo_$mode"  # a fresh run, not a resume of an older one
    $PY train.py --config configs/demo_cpu.yaml run.dir="$RUNS/demo_$mode" parallel.mode=$mode \
        train.steps=120 parallel.devices_per_host=4 metrics.progress=false > "$RUNS/demo_$mode.log"
done
$PY -m train.plot losses "$RUNS/demo_basp" "$RUNS/demo_ulysses" --metric loss --metric grad_norm \
    -o $OUT/demo_losses.png

# 3. The emulated two-host cluster benchmark (B=2, S=2048; measured by benchmarks/emulated_cluster.py).
$PY -m train.plot bench bench/emulated_b2/results.json -o $OUT/emulated_cluster_b2.png
