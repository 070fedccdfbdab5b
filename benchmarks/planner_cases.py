"""The planner on (B, N, heads) cases beyond the paper: chosen layout and predicted all-to-all
traffic against plain Ulysses on the same devices (2 hosts x N/2 devices, a100-40gb preset).

    python benchmarks/planner_cases.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from basp_jax.planner import cost  # noqa: E402
from basp_jax.planner.hardware import HARDWARE  # noqa: E402
from basp_jax.planner.shape import ModelShape  # noqa: E402
from models.config import MODEL_SHAPES  # noqa: E402

GB = 1e9
OVERLAP = 1.0  # parameter collectives hidden behind compute (ZeRO-3 prefetch), for both sides
SHAPES = {
    "llama-3.1-8b (32/8 heads)": MODEL_SHAPES["llama-3.1-8b"],
    "qwen2.5-3b (16/2 heads)": MODEL_SHAPES["qwen2.5-3b"],
    "qwen2.5-7b-like (28/4 heads)": ModelShape(28, 3584, 18944, 28, 4, 128, 152064),
    "small (4/4 heads)": ModelShape(12, 512, 2048, 4, 4, 128, 32000),
}
CASES = [  # (shape, batch, devices)
    ("llama-3.1-8b (32/8 heads)", 2, 8),
    ("qwen2.5-3b (16/2 heads)", 3, 8),
    ("qwen2.5-3b (16/2 heads)", 6, 8),
    ("qwen2.5-3b (16/2 heads)", 12, 8),
    ("qwen2.5-7b-like (28/4 heads)", 1, 8),
    ("qwen2.5-7b-like (28/4 heads)", 2, 8),
    ("small (4/4 heads)", 1, 8),
    ("small (4/4 heads)", 2, 16),
]


def ulysses(shape, batch, devices, hw, seq):
    """Plain Ulysses on all devices: pad heads if it must (the only way it can run)."""
    layout = cost.plan_layout(shape, num_devices=devices, batch=batch, seq_len=seq, groups=1,
                              devices_per_host=hw.devices_per_host, pad_heads=True)
    return cost.predict(shape, layout, "fsdp", hw=hw, overlap=OVERLAP)


def main(seq: int = 16384) -> None:
    print("| model | B | N | chosen layout | a2a GB (inter) | Ulysses a2a GB (inter) | predicted step vs Ulysses |")
    print("|---|---|---|---|---|---|---|")
    for name, batch, devices in CASES:
        shape = SHAPES[name]
        hw = HARDWARE["a100-40gb"]
        layout, best = cost.auto_layout(shape, batch=batch, seq_len=seq, num_devices=devices, hw=hw,
                                        devices_per_host=devices // 2, overlap=OVERLAP)
        base = ulysses(shape, batch, devices, dataclasses.replace(hw, devices_per_host=devices // 2), seq)
        a, u = best.all_to_all, base.all_to_all
        print(f"| {name} | {batch} | {devices} | {best.name} "
              f"| {(a.intra + a.inter) / GB:.2f} ({a.inter / GB:.2f}) | {(u.intra + u.inter) / GB:.2f} "
              f"({u.inter / GB:.2f}) | {base.step_s / best.step_s:.2f}x |")


if __name__ == "__main__":
    main()
