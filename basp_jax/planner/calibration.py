"""Measured rates of one GPU kind, which the planner's step time reads in place of one efficiency.

Without a calibration the step's compute is its FLOPs at `Hardware.efficiency` x the peak, one
number for every kind of work. A calibration, measured by the GPU check on that GPU, splits it:

    compute s = (dense FLOPs / dense rate + attention FLOPs / the kernel's rate) x remat factor

- dense rate: the model's non-attention work (projections, MLP, LM head, the norms, the loss and
  the optimizer update around them), fitted to a measured train step without remat;
- attention rate per kernel (cudnn, pallas, blockwise, xla): forward and backward of one causal
  sequence, counted as the planner counts it (ModelShape.attention_flops_per_token);
- remat factor: the step under each rematerialisation policy over the step without one;
  a policy not measured takes the largest measured factor (a bound, not a guess below it);
- fp8 dense rate: the dense work with model.fp8's FP8 projections.

Calibrations are package data, basp_jax/planner/calibrations/<target>.json, named like the
targets of basp_jax.gpus; `benchmarks/calibrate.py` writes one from a GPU check's results."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "calibrations"


@dataclasses.dataclass(frozen=True)
class Calibration:
    target: str
    source: str  # what was measured, where the results are kept
    dense_flops_per_s: float
    attention_flops_per_s: dict[str, float]  # kernel -> rate
    remat_factor: dict[str, float]  # policy -> step over the step without remat
    fp8_dense_flops_per_s: float | None = None

    def kernel(self, attn_impl: str) -> str:
        """The measured kernel that attn_impl runs: auto runs cuDNN on unpacked input where the
        GPU has it (basp_jax.kernels), else our Pallas kernel."""
        if attn_impl != "auto":
            return attn_impl
        return next(k for k in ("cudnn", "pallas", "blockwise") if k in self.attention_flops_per_s)

    def compute_seconds(self, dense_flops: float, attention_flops: float, *, attn_impl: str,
                        remat: str, fp8_flops: float = 0.0) -> float:
        kernel = self.kernel(attn_impl)
        if kernel not in self.attention_flops_per_s:
            raise ValueError(f"the {self.target} calibration has no rate for attention kernel "
                             f"{kernel!r}; it has {', '.join(self.attention_flops_per_s)}")
        dense = dense_flops / self.dense_flops_per_s
        if fp8_flops and self.fp8_dense_flops_per_s:
            dense = ((dense_flops - fp8_flops) / self.dense_flops_per_s
                     + fp8_flops / self.fp8_dense_flops_per_s)
        attention = attention_flops / self.attention_flops_per_s[kernel]
        factor = self.remat_factor.get(remat, max(self.remat_factor.values()))
        return (dense + attention) * factor

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"


@cache
def for_target(target: str) -> Calibration | None:
    """The calibration of a GPU target (basp_jax.gpus name), or None where none was measured."""
    path = FOLDER / f"{target}.json"
    if not path.exists():
        return None
    return Calibration(**json.loads(path.read_text()))
