"""Write a GPU kind's calibration (basp_jax.planner.calibration) from what the GPU check measured.

    python benchmarks/calibrate.py bench/gpu_check/h200/gpu_check.json \\
        --sweep bench/gpu_check/h200/step_sweep.txt --target h200-141gb [--write]
    python benchmarks/calibrate.py gpu_check.json --target h100-80gb    # the check's step alone

Reads the check's JSON (scripts/gpu_check.sh: each attention kernel's forward + backward at
16,384 tokens, the 1B train step with and without FP8 projections) and the remat/kernel step
sweep (benchmarks/gpu_step_sweep.sh: one line per setting, `NAME rc 0 step S s ... [OVERRIDES]`),
fits the rates and prints, for every measured step, the step the planner predicts from them
beside the measurement. --write stores the calibration as basp_jax/planner/calibrations/
TARGET.json, which the planner then reads for that GPU kind. Without --sweep the check's own step
(remat=dots) is all there is: the dense rate then includes dots' recomputation, and dots is the
one remat factor (1.0; the planner gives an unmeasured policy the largest measured factor). The
GPU check writes that fit of its own results into its JSON as a candidate.

What is fitted, and so agrees by construction: the dense rate (the step without remat on the
kernel `auto` ran, cuDNN on these GPUs), the remat factors (the other such steps over it) and the
FP8 dense rate (the FP8 step). What is not: every step with another kernel (its attention at the
kernel's own measured rate), which is the check on the model.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from basp_jax.planner.calibration import FOLDER, Calibration  # noqa: E402

TIMED_SEQ = 16384
# the check's attention shape (benchmarks/gpu_check.py Shapes): Llama-3.2-1B's heads
TIMED_HEADS, TIMED_HEAD_DIM = 32, 64
SWEEP_LINE = re.compile(r"^(\S+)\s+rc 0\s+step ([0-9.]+) s.*\[(.*)\]$")


def read_sweep(path: Path) -> list[dict]:
    """[{remat, attn_impl, step_s}] of the sweep's lines that ran."""
    rows = []
    for line in path.read_text().splitlines():
        match = SWEEP_LINE.match(line.strip())
        if not match:
            continue
        overrides = dict(o.split("=", 1) for o in match.group(3).split())
        rows.append({"remat": overrides.get("model.remat", "dots"),
                     "attn_impl": overrides.get("model.attn_impl", "auto"),
                     "step_s": float(match.group(2))})
    return rows


def attention_rates(check: dict, seq_len: int = TIMED_SEQ) -> dict[str, float]:
    """kernel -> FLOP/s of one causal sequence's forward + backward at seq_len (unpacked, the
    check's first head shape: the rows named 'KERNEL, N tokens'), counted as the planner counts
    attention (6 x heads x head_dim x S^2 per layer, ModelShape.attention_flops_per_token)."""
    rates = {}
    for name, row in check["timing"].items():
        kernel, _, tokens = name.partition(", ")
        if row.get("status") == "ok" and tokens == f"{seq_len} tokens" and " " not in kernel:
            heads, head_dim = row.get("heads", TIMED_HEADS), row.get("head_dim", TIMED_HEAD_DIM)
            rates[kernel] = 6 * heads * head_dim * seq_len**2 / row["median_s"]
    return rates


def timed_seq(check: dict) -> int:
    """The length the attention rates are read at: 16,384 tokens where the check timed it, else
    (--cpu-smoke's tiny shapes) the train step's."""
    if attention_rates(check, TIMED_SEQ):
        return TIMED_SEQ
    return check["train"]["seq_len"]


def step_work(preset: str, seq_len: int) -> tuple[float, float, float]:
    """(dense, attention, FP8 projection) FLOPs of one sequence's train step."""
    from models import ModelConfig

    shape = ModelConfig.preset(preset).shape
    return (shape.dense_flops_per_token() * seq_len,
            shape.attention_flops_per_token(seq_len) * seq_len,
            shape.fp8_flops_per_token() * seq_len)


def _auto_steps(check: dict, sweep: list[dict] | None) -> tuple[dict[str, float], str]:
    """(remat -> step s with the kernel auto runs, the policy the others are over): the sweep's
    steps over remat=none, or without a sweep the check's own step alone."""
    if not sweep:
        return {check["train"]["remat"]: check["train"]["step_s"]}, check["train"]["remat"]
    steps = {row["remat"]: row["step_s"] for row in sweep if row["attn_impl"] == "auto"}
    if "none" not in steps:
        raise SystemExit("error: the sweep has no remat=none step with attn_impl=auto to fit to")
    return steps, "none"


def fit(check: dict, sweep: list[dict] | None, target: str, source: str) -> Calibration:
    """The calibration from the check (and the remat sweep; None or [] without one)."""
    seq_len = timed_seq(check)
    rates = attention_rates(check, seq_len)
    preset = check["train"]["model"].split()[0]
    dense, attention, fp8 = step_work(preset, check["train"]["seq_len"])
    kernel = check["train"].get("attn_kernel", "cudnn")  # what auto ran (cuDNN on the H200)
    if kernel not in rates:
        raise SystemExit(f"error: the check timed no {kernel} attention at {seq_len} tokens, the "
                         "kernel its train step ran")
    steps, base = _auto_steps(check, sweep)
    if steps[base] <= attention / rates[kernel]:
        raise SystemExit(f"error: the remat={base} step ({steps[base]:.4g} s) is not longer than "
                         f"its attention at the timed rate ({attention / rates[kernel]:.4g} s)")
    dense_rate = dense / (steps[base] - attention / rates[kernel])
    factors = {remat: step / steps[base] for remat, step in steps.items()}
    fp8_rate = None
    train_fp8 = check.get("train_fp8", {})
    if train_fp8.get("status") == "ok" and train_fp8["remat"] in factors:
        dense_fp8_s = (train_fp8["step_s"] / factors[train_fp8["remat"]]
                       - attention / rates[kernel])
        fp8_s = dense_fp8_s - (dense - fp8) / dense_rate
        fp8_rate = fp8 / fp8_s if fp8_s > 0 else None  # not faster than bf16 allows: no rate
    return Calibration(target=target, source=source, dense_flops_per_s=dense_rate,
                       attention_flops_per_s=rates, remat_factor=factors,
                       fp8_dense_flops_per_s=fp8_rate)


def compare(calibration: Calibration, check: dict, sweep: list[dict]) -> list[dict]:
    """Every measured step beside the planner's prediction from the calibration (one device: no
    communication, so the prediction is the compute)."""
    from basp_jax.planner import cost
    from basp_jax.planner.hardware import Hardware
    from models import ModelConfig

    preset, seq_len = check["train"]["model"].split()[0], check["train"]["seq_len"]
    shape = ModelConfig.preset(preset).shape
    layout = cost.plan_layout(shape, num_devices=1, batch=1, seq_len=seq_len, groups=1)
    hw = Hardware("calibrated", 1.0, 1.0, 1.0, devices_per_host=1, calibration=calibration)
    measured = [dict(row, fp8=False) for row in sweep]
    if not sweep:  # the check's own step
        measured.append({"remat": check["train"]["remat"], "fp8": False,
                         "step_s": check["train"]["step_s"],
                         "attn_impl": check["train"]["attn_impl"]})
    if check.get("train_fp8", {}).get("status") == "ok":
        measured.append({"remat": check["train_fp8"]["remat"], "fp8": True, "step_s":
                         check["train_fp8"]["step_s"],
                         "attn_impl": check["train_fp8"]["attn_impl"]})
    for row in measured:
        row["predicted_s"] = cost.predict(shape, layout, "fsdp", hw=hw, remat=row["remat"],
                                          attn_impl=row["attn_impl"], fp8=row["fp8"]).step_s
    return measured


def _shown(path: Path) -> Path:
    """The path from the checkout's root where it lies inside it."""
    return path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", type=Path, help="the GPU check's JSON")
    p.add_argument("--sweep", type=Path,
                   help="benchmarks/gpu_step_sweep.sh's lines (without: the check's step alone)")
    p.add_argument("--target", required=True, help="the basp_jax.gpus target, e.g. h200-141gb")
    p.add_argument("--write", action="store_true", help="store it as the planner's calibration")
    args = p.parse_args(argv)
    check = json.loads(args.check.read_text())
    sweep = read_sweep(args.sweep) if args.sweep else []
    source = f"{check['environment'].get('device_kind', args.target)}: {_shown(args.check)}, " + (
        _shown(args.sweep) if args.sweep else "no remat sweep (remat=dots only)")
    calibration = fit(check, sweep, args.target, source)
    print(calibration.to_json(), end="")
    print(f"\n{'remat':<7}{'attention':<11}{'fp8':<6}{'measured s':>11}{'predicted s':>13}{'error':>8}")
    for row in compare(calibration, check, sweep):
        error = row["predicted_s"] / row["step_s"] - 1
        print(f"{row['remat']:<7}{row['attn_impl']:<11}{str(row['fp8']).lower():<6}"
              f"{row['step_s']:>11.3f}{row['predicted_s']:>13.3f}{error:>+8.1%}")
    if args.write:
        path = FOLDER / f"{args.target}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(calibration.to_json())
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
