"""A calibration candidate from the check's own results: benchmarks/calibrate.py's fit of the 1B
step and the attention timings (no remat sweep: remat=dots only), written into the JSON. The
calibration file itself is a person's to write: `python benchmarks/calibrate.py ... --write`."""

from __future__ import annotations

import dataclasses

from .common import skip


def _target(report: dict) -> str:
    """The basp_jax.gpus target of this device, or what it is where none matches."""
    from basp_jax import gpus

    kind = report["environment"]["device_kind"]
    gpu = gpus.by_device_kind(kind)
    if gpu is not None:
        return gpu.name
    return "cpu-smoke" if report["mode"] == "cpu-smoke" else kind


def calibration_candidate(report: dict, out_path: str) -> dict:
    from benchmarks import calibrate

    if report.get("train", {}).get("status") != "ok":
        return skip("the 1B train steps did not run")
    target = _target(report)
    source = f"{report['environment']['device_kind']}: {out_path}, no remat sweep (remat=dots only)"
    try:
        fitted = calibrate.fit(report, None, target, source)
    except SystemExit as e:  # what the fit lacks (a timing the budget skipped) or disagrees on
        return skip(f"cannot fit: {str(e).removeprefix('error: ')}")
    out = {"status": "ok", "target": target, "calibration": dataclasses.asdict(fitted),
           "write_with": f"python benchmarks/calibrate.py {out_path} --target {target} --write"}
    try:  # the planner's prediction of the measured steps from it
        out["predicted"] = calibrate.compare(fitted, report, [])
    except Exception as e:  # noqa: BLE001: the fit stands without it
        out["predicted_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    rates = ", ".join(f"{k} {v / 1e12:.0f}" for k, v in fitted.attention_flops_per_s.items())
    print(f"  {target}: dense {fitted.dense_flops_per_s / 1e12:.1f} TFLOP/s, attention {rates}"
          + (f", FP8 dense {fitted.fp8_dense_flops_per_s / 1e12:.1f}"
             if fitted.fp8_dense_flops_per_s else "") + f"; to keep it: {out['write_with']}",
          flush=True)
    return out
