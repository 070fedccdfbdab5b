"""basp_jax.planner.calibration: the measured rates of a GPU kind in the planner's step time.

The H200's calibration comes from the GPU check's results kept in bench/gpu_check/h200/ by
benchmarks/calibrate.py; the planner must predict every measured 1B step there within 15%."""

import json
import sys
from pathlib import Path

import pytest

from basp_jax.planner import calibration, cost
from basp_jax.planner.hardware import HARDWARE, Hardware
from models import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "bench/gpu_check/h200"
sys.path.insert(0, str(ROOT))

from benchmarks import calibrate  # noqa: E402


def _measured():
    check = json.loads((H200 / "gpu_check.json").read_text())
    return check, calibrate.read_sweep(H200 / "step_sweep.txt")


def test_the_shipped_calibration_is_what_the_measurements_give():
    check, sweep = _measured()
    shipped = calibration.for_target("h200-141gb")
    fitted = calibrate.fit(check, sweep, "h200-141gb", shipped.source)
    assert fitted == shipped
    assert HARDWARE["h200-141gb"].calibration == shipped


def test_the_planner_predicts_every_measured_1b_step_on_one_h200_within_15_percent():
    """The remat/kernel sweep's steps (none, dots, full with cuDNN; none, dots with our Pallas
    kernel), the check's own step (dots, cuDNN, 0.671 s) and its FP8 step. The Pallas rows are
    not fitted: their attention runs at the kernel's own measured rate."""
    check, sweep = _measured()
    rows = sweep + [{"remat": check["train"]["remat"], "attn_impl": "auto",
                     "step_s": check["train"]["step_s"]}]
    shape = ModelConfig.preset("llama-3.2-1b").shape
    layout = cost.plan_layout(shape, num_devices=1, batch=1, seq_len=16384, groups=1)
    hw = HARDWARE["h200-141gb"]
    assert len(rows) == 6 and {r["attn_impl"] for r in rows} == {"auto", "pallas"}
    for row in rows:
        predicted = cost.predict(shape, layout, "fsdp", hw=hw, remat=row["remat"],
                                 attn_impl=row["attn_impl"]).step_s
        assert abs(predicted / row["step_s"] - 1) <= 0.15, (row, predicted)
    fp8 = cost.predict(shape, layout, "fsdp", hw=hw, remat="dots", fp8=True).step_s
    assert abs(fp8 / check["train_fp8"]["step_s"] - 1) <= 0.15
    # the uncalibrated model predicted the dots step 34% fast
    plain = cost.predict(shape, layout, "fsdp", remat="dots",
                         hw=Hardware(**{**hw.__dict__, "calibration": None})).step_s
    assert plain / check["train"]["step_s"] < 0.7


def test_kinds_without_a_calibration_keep_one_efficiency_and_say_so():
    hw = HARDWARE["h100-80gb"]
    assert hw.calibration is None and "no calibration" in hw.describe_compute()
    shape = ModelConfig.preset("llama-3.2-1b").shape
    layout = cost.plan_layout(shape, num_devices=1, batch=1, seq_len=16384, groups=1)
    predicted = cost.predict(shape, layout, "fsdp", hw=hw, remat="dots")
    flops = shape.train_flops_per_token(16384) * 16384 - shape.linear_attention_flops_per_token()
    assert predicted.compute_s == pytest.approx(flops / (hw.peak_flops * hw.efficiency))
    assert "h200-141gb calibration" in HARDWARE["h200-141gb"].describe_compute()


def test_an_unmeasured_remat_policy_takes_the_largest_factor_and_an_unmeasured_kernel_is_refused():
    c = calibration.Calibration("x", "test", 1e14, {"cudnn": 2e14}, {"none": 1.0, "full": 1.2})
    assert c.compute_seconds(1e14, 2e14, attn_impl="auto", remat="offload") == pytest.approx(2.4)
    with pytest.raises(ValueError, match="no rate for attention kernel 'pallas'"):
        c.compute_seconds(1e14, 2e14, attn_impl="pallas", remat="none")


def test_the_plan_command_names_its_compute_model(capsys):
    from train.tools import plan

    assert plan.main(["--model", "llama-3.2-1b", "--seq", "16384", "--batch", "1", "--devices",
                      "1", "--hardware", "h200-141gb", "--remat", "dots"]) == 0
    out = capsys.readouterr().out
    assert "compute from the h200-141gb calibration" in out
    assert "predicted 0.680 s/step" in out
