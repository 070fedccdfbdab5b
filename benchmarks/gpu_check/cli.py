"""The command line: the sections in order of what a short GPU run most needs, each saved to the
JSON as it finishes, inside the time budget."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from . import __doc__ as DOC
from .common import Budget, Shapes, environment, section

# About how long each part takes on one H100, from BENCHMARKS.md section 12's H200 run (189 s
# in all: the 1B compile 11 s, the FP8 one 91 s, a kernel check ~3 s with its reference): what
# the budget holds back before starting one. Cases: per case. In all about 415 s.
ESTIMATE_S = {
    "train": 25,          # compile 11 s, 6 + 2 profiled steps of ~0.75 s, the trace's parse
    "checkpoint": 45,     # ~15 GB of state, twice: the save's copy (8 s there), 3 steps, the write
    "kernel case": 2,     # a fwd+bwd compile at 2,048 tokens; 4 and 64 documents share it
    "ring case": 4,       # the hop kernels of 2 ranks, forward and backward
    "short timing case": 3,
    "gemm case": 1,
    "expert case": 4,     # a grouped matmul's compile, its check and timing, fwd and fwd+bwd
    "train_8b": 35,       # 2 layers of the 8B (1.49B parameters with the embeddings)
    "train_fp8": 105,     # its compile took 91 s on the H200
    "long timing case": 5,
    "tile case": 8,       # our Pallas kernel's fwd+bwd compile at 16K, head_dim 128 or 256
    "calibration": 1,
}


def _cases(report: dict, part: str, cases, fn, budget: Budget, needs_s: float, save) -> None:
    """Each case of a part as its own row, saved as it finishes."""
    rows = report.setdefault(part, {})
    for name, *args in cases:
        rows[name] = section(f"{part} {name}", fn, *args, budget=budget, needs_s=needs_s)
        save()


def _failures(report: dict) -> list[str]:
    failed = []
    for part, value in report.items():
        if not isinstance(value, dict):
            continue
        if value.get("status") == "failed":
            failed.append(part)
        elif isinstance(value.get("profile"), dict) and value["profile"].get("status") == "failed":
            failed.append(f"{part}: profile")
        failed += [f"{part}: {name}" for name, row in value.items()
                   if isinstance(row, dict) and row.get("status") == "failed"]
    return failed


def _skipped(report: dict) -> int:
    rows = [v for v in report.values() if isinstance(v, dict)]
    rows += [r for v in rows for r in v.values() if isinstance(r, dict)]
    return sum(r.get("status") == "skipped" for r in rows)


def run_sections(report: dict, shapes: Shapes, args, on_gpu: bool, budget: Budget, save) -> None:
    """Most valuable first: a run cut short keeps those."""
    from . import attention_check as ac
    from . import attention_time as at
    from . import candidate, experts, gemm, steps

    est, runs = ESTIMATE_S, []
    # the 1B steps first: device.memory_stats()'s peak then is theirs, not a later section's
    report["train"] = section(f"train steps: {shapes.preset} at {shapes.step_seq} tokens",
                              steps.train_steps, shapes, args.steps, on_gpu, runs,
                              budget=budget, needs_s=est["train"])
    save()
    report["checkpoint"] = section("the step after an asynchronous checkpoint save",
                                   steps.step_after_save, runs, report["train"].get("step_s"),
                                   budget=budget, needs_s=est["checkpoint"])
    runs.clear()  # the 1B state leaves the device
    save()
    _cases(report, "kernels", ac.kernel_cases(shapes),
           functools.partial(_check, ac.check_kernel, shapes, on_gpu), budget,
           est["kernel case"], save)
    _cases(report, "ring", ac.ring_cases(shapes),
           functools.partial(_check, ac.check_ring, shapes, on_gpu), budget, est["ring case"],
           save)
    timing = functools.partial(_time, at.time_kernel, shapes, on_gpu, args.repeats)
    _cases(report, "timing", at.timing_cases(shapes, shapes.short_seq), timing, budget,
           est["short timing case"], save)
    ring_timing = functools.partial(_time, at.time_ring, shapes, on_gpu, args.repeats)
    _cases(report, "ring timing", at.ring_timing_cases(shapes, shapes.short_seq), ring_timing,
           budget, est["short timing case"], save)
    peak = gemm.device_peak(on_gpu)
    _cases(report, "gemm", ((name, k, n, which) for name, _, _, k, n, which in
                            gemm.gemm_cases(shapes)),
           lambda k, n, which: gemm.time_gemm(k, n, which, shapes, peak), budget,
           est["gemm case"], save)
    _cases(report, "experts", experts.expert_cases(shapes),
           lambda impl, k, n: experts.check_and_time(impl, k, n, shapes, on_gpu, args.repeats),
           budget, est["expert case"], save)
    report["train_8b"] = section(
        f"train steps: {shapes.big_preset}'s first 2 layers at {shapes.step_seq} tokens",
        functools.partial(steps.train_steps, preset=shapes.big_preset, layers=2),
        shapes, args.steps, on_gpu, budget=budget, needs_s=est["train_8b"])
    if report["train_8b"].get("measured_peak_bytes"):  # memory_stats() has no reset
        report["train_8b"]["measured_peak_note"] = "the process's peak: the 1B steps' if larger"
    save()
    report["train_fp8"] = section("train steps with FP8 projections (model.fp8=true)",
                                  steps.train_steps_fp8, shapes, args.steps, on_gpu,
                                  report["train"], budget=budget, needs_s=est["train_fp8"])
    save()
    _cases(report, "timing", at.timing_cases(shapes, shapes.long_seq), timing, budget,
           est["long timing case"], save)
    _cases(report, "pallas tiles", at.tile_cases(shapes, shapes.short_seq),
           lambda seq, heads, blocks: at.time_tiles(seq, heads, blocks, shapes, on_gpu,
                                                    args.repeats),
           budget, est["tile case"], save)
    report["calibration"] = section("calibration candidate (benchmarks/calibrate.py's fit)",
                                    candidate.calibration_candidate, report, args.out,
                                    budget=budget, needs_s=est["calibration"])


def _check(fn, shapes, on_gpu, *case):
    return fn(*case, shapes, on_gpu)


def _time(fn, shapes, on_gpu, repeats, impl, seq, heads, docs):
    return fn(impl, seq, heads, docs, shapes, on_gpu, repeats)


def _arguments(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check",
                                description=DOC.splitlines()[0])
    p.add_argument("--out", default="gpu_check.json", help="the JSON report")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: tiny shapes on the CPU, GPU-only parts skipped (tests)")
    p.add_argument("--steps", type=int, default=6, help="timed train steps per model (>= 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed attention calls per kernel")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no section or case that would end past this many seconds "
                        "(scripts/gpu_check.sh stops the check at 480)")
    args = p.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        return None, "--steps must be >= 2 and --repeats >= 1"
    folder = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.access(folder, os.W_OK):
        return None, f"cannot write the report to {args.out!r}; give a file in a writable folder"
    return args, None


def _platform(smoke: bool) -> str | None:
    """Set up JAX for the mode; why not where it cannot run."""
    from train.process import gpu_defaults

    if smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        gpu_defaults.apply_env(os.environ)  # the XLA flags and memory fraction a run uses
    import jax

    if smoke:
        return None
    if jax.devices()[0].platform != "gpu":
        return (f"no GPU visible to JAX {jax.__version__} (devices: {jax.devices()[0].platform}); "
                "run on a GPU host, or pass --cpu-smoke")
    gpu_defaults.enable_compilation_cache()
    return None


def main(argv: list[str] | None = None) -> int:
    args, error = _arguments(argv)
    if error is None:
        error = _platform(args.cpu_smoke)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    budget = Budget(args.budget_s)
    shapes = Shapes(args.cpu_smoke)
    report = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu", "environment": environment(),
              "budget": {"limit_s": args.budget_s, "estimates_s": ESTIMATE_S}}

    def save():  # after every case: a run cut short (scripts/gpu_check.sh's limit) keeps them
        report["wall_s"] = budget.elapsed()
        partial = f"{args.out}.partial"
        with open(partial, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(partial, args.out)  # whole: a kill mid-write leaves the last complete one

    save()
    run_sections(report, shapes, args, not args.cpu_smoke, budget, save)
    report["failed"] = failed = _failures(report)
    save()
    print(f"done in {report['wall_s']:.0f} s: {len(failed)} failed, {_skipped(report)} skipped"
          + (f" ({'; '.join(failed)})" if failed else "") + f"; wrote {args.out}", flush=True)
    return 1 if failed else 0

