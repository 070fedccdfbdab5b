"""Communication of the trainer's compiled step, read from the program: Ulysses vs BASP.

Compiles (never runs) the real train step (forward, backward, AdamW update, parameter sharding) for
the paper's model shapes with a few layers (float32), on 8 emulated CPU devices treated as 2 hosts x 4, and
prints per-device bytes per step of each collective kind, total and inter-host, next to the
closed-form all-to-all count of basp_jax.planner.cost.

    python benchmarks/comm_table.py --models llama-3.2-1b,llama-3.1-8b --batches 1,2,4,8
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


import models  # noqa: E402
from basp_jax.compiled import comm  # noqa: E402
from basp_jax.planner import cost  # noqa: E402
from basp_jax.planner.hardware import HARDWARE  # noqa: E402
from basp_jax.planner.precisions import Precisions  # noqa: E402
from models.config import MODEL_SHAPES  # noqa: E402
from train.tools.collectives import step_collectives  # noqa: E402

DEVICES, PER_HOST = 8, 4
MiB = 2**20


def row(name, batch, mode, strategy, layout, collectives, shape, seq_len) -> str:
    table = comm.summarize(collectives, PER_HOST)

    def cell(kind):
        r = table.get(kind, {"wire_bytes": 0.0, "inter_host_wire_bytes": 0.0})
        return f"{r['wire_bytes'] / MiB:.1f} / {r['inter_host_wire_bytes'] / MiB:.1f}"

    hw = HARDWARE["a100-40gb"]
    closed = cost.predict(shape, layout, strategy, hw=hw, precisions=Precisions(act=4, param=4))
    a2a_closed = (closed.all_to_all.intra + closed.all_to_all.inter) / MiB
    return (f"| {name} | {batch} | {mode} ({layout.groups},{layout.sp}) {strategy} | {cell('all-to-all')} "
            f"| {a2a_closed:.1f} | {cell('all-gather')} | {cell('reduce-scatter')} | {cell('all-reduce')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODEL_SHAPES))
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    # float32: XLA's CPU backend computes bf16 in f32 and moves the converts across collectives,
    # so a bf16 program compiled here would show f32 traffic anyway; on GPU bf16 halves it all.
    print(f"per device per step, wire MiB total / inter-host; {args.layers} layers, "
          f"{args.seq_len} tokens, float32, 2 hosts x 4 devices")
    print("| model | B | layout | all-to-all | all-to-all closed form | all-gather | reduce-scatter | all-reduce |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        import dataclasses

        mcfg = dataclasses.replace(models.ModelConfig.preset(name), num_layers=args.layers)
        shape = mcfg.shape
        for batch in (int(b) for b in args.batches.split(",")):
            setups = [("ulysses", "fsdp")] + ([("basp", "fsdp"), ("basp", "hsdp")] if batch > 1 else [])
            for mode, strategy in setups:
                layout, found = step_collectives(mcfg, mode=mode, strategy=strategy, batch=batch,
                                                 seq_len=args.seq_len)
                print(row(name, batch, mode, strategy, layout, found, shape, args.seq_len), flush=True)


if __name__ == "__main__":
    main()
