"""The step loop keeps the devices busy: step k's metrics are read after step k+1 is dispatched,
the step counter stays on the devices, step_time_s includes the host's time, MFU counts causal
attention."""

import json
import os

import jax
import pytest

from train.observe import metrics as metrics_module
from train.program import state as program
from train.loop import model_config, run

from tests.helpers.trainer import tiny_config

pytestmark = pytest.mark.slow  # every test here takes seconds

SLOW_HOST_S = 0.15  # what each metrics line costs the host in the run below


def test_metrics_are_read_one_step_late_and_step_time_includes_host_time(tmp_path, monkeypatch):
    events = []  # ("dispatch", None) and ("read", None) in the order they happened
    placed = []  # program.step_index calls: one per run, not one per step

    lower = program.TrainProgram.lower

    def recording_lower(self, *args, **kwargs):
        lowered = lower(self, *args, **kwargs)

        class Lowered:
            def compile(self_):
                compiled = lowered.compile()

                class Step:
                    def __getattr__(self__, name):
                        return getattr(compiled, name)

                    def __call__(self__, *a):
                        events.append("dispatch")
                        return compiled(*a)

                return Step()

            def __getattr__(self_, name):
                return getattr(lowered, name)

        return Lowered()

    device_get = jax.device_get

    def recording_get(x):
        out = device_get(x)
        if isinstance(out, dict) and "loss" in out:
            events.append("read")
        return out

    step_index = program.TrainProgram.step_index

    def counting_step_index(self, step):
        placed.append(step)
        return step_index(self, step)

    log = metrics_module.MetricsLogger.log

    def slow_log(self, record):
        import time

        time.sleep(SLOW_HOST_S)  # a host that is slow to log: the devices wait for it
        log(self, record)

    monkeypatch.setattr(program.TrainProgram, "lower", recording_lower)
    monkeypatch.setattr(program.TrainProgram, "step_index", counting_step_index)
    monkeypatch.setattr(jax, "device_get", recording_get)
    monkeypatch.setattr(metrics_module.MetricsLogger, "log", slow_log)

    steps = 6
    cfg = tiny_config(tmp_path / "run", f"train.steps={steps}", "checkpoint.save_final=false",
                      "metrics.peak_flops=1e11")
    summary = run(cfg)
    assert len(summary["losses"]) == steps and placed == [0]

    # the k-th read is step k's; nothing is saved (checkpoint.every=0, save_final=false), so
    # every step's metrics are read after the next dispatch (the last step's after the loop)
    dispatched = [i for i, e in enumerate(events) if e == "dispatch"]
    read = [i for i, e in enumerate(events) if e == "read"]
    assert len(dispatched) == len(read) == steps, events
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(
        tmp_path / "run" / "checkpoints")
    for k in range(1, steps):  # steps 1 .. steps-1 (1-based)
        assert read[k - 1] > dispatched[k], (k, events)

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    # from step end to step end: the host's logging is in every step after the first
    assert all(r["step_time_s"] >= SLOW_HOST_S for r in records[1:]), records
    assert sum(r["step_time_s"] for r in records) <= summary["wall_s"]

    # MFU: 6N plus the causal half of the attention scores, against the configured peak
    mcfg = model_config(cfg)
    per_token = mcfg.shape.train_flops_per_token(cfg.data.seq_len)
    assert per_token < mcfg.shape.train_flops_per_token(cfg.data.seq_len, causal=False)
    for r in records:
        assert r["mfu"] == pytest.approx(per_token * r["tokens_per_s"] / (1e11 * 8), rel=1e-9)
