"""float16 compute: dynamic loss scaling in the train step (train.program.step.LossScale). An overflowing
step is skipped and halves the scale, growth_interval finite steps in a row double it, and the
scale is part of the optimizer state, so a resume goes on with the scale the run had reached."""

import json

import jax
import numpy as np
import pytest

from train.program import state as program
from train.loop import run
from train.program.step import LossScale, LossScaleState, loss_scaling, make_optimizer
from tests.helpers.trainer import tiny_config

pytestmark = pytest.mark.usefixtures("compile_cache")  # this run's (tests/conftest.py)

# 2**24 times the mean loss overflows float16 (largest finite: 65504) in the tiny model's
# backward pass (it trains from about 2**21 down): the first steps must halve it until gradients
# fit, then every 2 finite steps double it (until it overflows again).
START = LossScale(initial=2.0**24, growth_interval=2)


def _expected(records, ls=START):
    """The scale each step should use, from the previous steps' skips (the rule, replayed)."""
    scale, good, out = ls.initial, 0, []
    for r in records:
        out.append(scale)
        if r["skipped"]:
            scale, good = max(scale / ls.factor, ls.min_scale), 0
        elif good + 1 >= ls.growth_interval:
            scale, good = scale * ls.factor, 0
        else:
            good += 1
    return out, scale


def test_only_float16_scales_and_the_scale_lives_in_the_optimizer_state():
    from train.config.schema import OptimizerConfig

    assert loss_scaling("float16") == LossScale() and loss_scaling("bfloat16") is None
    tx, _ = make_optimizer(OptimizerConfig(lr=1e-3), 10, START)
    state = tx.init({"w": np.zeros((2, 2), np.float32)})
    assert isinstance(state[0], LossScaleState) and float(state[0].scale) == 2.0**24
    plain, _ = make_optimizer(OptimizerConfig(lr=1e-3), 10)
    assert not any(isinstance(s, LossScaleState) for s in plain.init({"w": np.zeros(2)}))


@pytest.mark.slow
def test_overflow_halves_finite_steps_grow_and_resume_keeps_the_scale(tmp_path, monkeypatch):
    monkeypatch.setattr(program, "loss_scaling",
                        lambda dtype: START if dtype == "float16" else None)
    run_dir = tmp_path / "run"
    common = ("model.dtype=float16", "checkpoint.every=10", "checkpoint.async_save=false")
    first = run(tiny_config(run_dir, *common, "train.steps=10"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scales = [r["loss_scale"] for r in records]
    expected, after = _expected(records)
    assert scales == expected
    assert records[0]["skipped"] and not all(r["skipped"] for r in records)  # overflow, then fits
    assert any(b > a for a, b in zip(scales, scales[1:]))  # and it grew again
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(first["params"]))
    assert all(np.isfinite(r["loss"]) for r in records)
    # resumed from step 10's checkpoint: the scale it had reached, not LossScale.initial
    again = run(tiny_config(run_dir, *common, "train.steps=11",
                            "checkpoint.allow_changed=train.steps"))
    assert again["start_step"] == 10
    resumed = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert resumed["step"] == 11 and resumed["loss_scale"] == after
