#!/bin/bash
# One GPU: the Llama-3.2-1B step at 16K tokens (configs/gpu/llama-3.2-1b_basp.yaml, synthetic
# data, microbatch 1) under each remat policy and attention kernel listed below, one train.py
# run of 10 steps each, side by side; prints one line per setting with the median step time of
# steps 3-10 and MFU, read from the run's metrics.jsonl.
#
#   bash benchmarks/gpu_step_sweep.sh OUT_DIR
#
# OUT_DIR gets each run's log (sweepN.log), its run directory (runN/) and the table (sweep.txt).
# PYTHON: the interpreter (default python3); EXTRA: overrides added to every run (e.g.
# EXTRA="data.seq_len=8192"). Needs what train.py needs (the project installed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash benchmarks/gpu_step_sweep.sh OUT_DIR}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
COMMON="data.source=synthetic data.path=null data.pack=false data.eos_id=null data.seq_len=16384
train.microbatch_size=1 train.grad_accum=1 train.steps=10 parallel.devices_per_host=1
runtime.devices=1 metrics.progress=false metrics.tensorboard=false"
i=0
while read -r label overrides; do
    i=$((i + 1))
    start=$(date +%s)
    # shellcheck disable=SC2086 (the overrides are separate words)
    timeout 300 "$PYTHON" train.py --config configs/gpu/llama-3.2-1b_basp.yaml \
        run.dir="$OUT/run$i" $COMMON $overrides ${EXTRA:-} </dev/null >"$OUT/sweep$i.log" 2>&1
    rc=$?
    "$PYTHON" - "$label" "$OUT/run$i/metrics.jsonl" "$rc" "$(($(date +%s) - start))" \
        "$overrides" <<'PY' | tee -a "$OUT/sweep.txt"
import json, statistics, sys
label, path, rc, wall, overrides = sys.argv[1:]
try:
    rows = [json.loads(line) for line in open(path)][2:]  # steps 1-2 warm up
    step = statistics.median(r["step_time_s"] for r in rows)
    mfu = statistics.median((r.get("mfu") or 0) for r in rows)
    print(f"{label:12s} rc {rc} step {step:.4f} s  mfu {mfu:.3f}  loss {rows[-1]['loss']:.4f}"
          f"  wall {wall}s  [{overrides}]")
except (OSError, ValueError, KeyError, statistics.StatisticsError) as e:
    print(f"{label:12s} rc {rc} no metrics ({e}); see the log  wall {wall}s  [{overrides}]")
PY
done <<'LIST'
dots_auto model.remat=dots
dots_pallas model.remat=dots model.attn_impl=pallas
none_auto model.remat=none
none_pallas model.remat=none model.attn_impl=pallas
full_auto model.remat=full
LIST
