"""What a run prints and leaves: a progress bar on a terminal, plain lines every N steps in a log
file (no carriage returns), one config line on stdout (the resolved config is in
{run.dir}/config.yaml), and nothing written by a run that has nothing to do."""

import io
import os
import sys

import pytest

from tests.helpers.trainer import tiny_config
from train.config.schema import MetricsConfig
from train.observe.metrics import MetricsLogger


def _record(step):
    return {"step": step, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0,
            "step_time_s": 0.5, "mfu": None}


class Terminal(io.StringIO):
    def isatty(self):
        return True


def _log(tmp_path, monkeypatch, stream, steps=40, **cfg):
    monkeypatch.setattr(sys, "stderr", stream)
    logger = MetricsLogger(str(tmp_path), MetricsConfig(**cfg), total_steps=steps, start_step=0,
                           is_writer=True)
    for step in range(1, steps + 1):
        logger.log(_record(step))
    logger.message("a message")
    logger.close()
    return logger, stream.getvalue()


def test_a_log_file_gets_a_line_every_n_steps_and_no_carriage_returns(tmp_path, monkeypatch):
    logger, out = _log(tmp_path, monkeypatch, io.StringIO())
    assert logger.bar is None and "\r" not in out
    lines = out.splitlines()
    assert len(lines) == 21 and lines[-1] == "a message"  # 0: about 20 lines a run
    assert lines[0].startswith("step 2/40  loss 2.0000  grad_norm 1  lr 0.001  1,000 tok/s")
    assert lines[0].endswith("eta 19s") and lines[-2].startswith("step 40/40")
    _, out = _log(tmp_path, monkeypatch, io.StringIO(), steps=25, log_every=10)
    assert [line.split()[1] for line in out.splitlines()[:-1]] == ["10/25", "20/25", "25/25"]
    _, out = _log(tmp_path, monkeypatch, io.StringIO(), progress=False)
    assert out == "a message\n"


def test_a_terminal_gets_the_progress_bar(tmp_path, monkeypatch):
    logger, out = _log(tmp_path, monkeypatch, Terminal())
    assert logger.bar is not None and "\r" in out and "40/40" in out
    assert "step 2/40" not in out


@pytest.mark.usefixtures("compile_cache")  # its runs share one compile
def test_one_config_line_and_nothing_written_when_there_is_nothing_to_do(tmp_path, capsys):
    from train.loop import run

    run_dir = tmp_path / "r"
    run(tiny_config(run_dir))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"config: {run_dir}/config.yaml (model preset tiny, data.source=synthetic "
                      "seq_len=64, train.steps=5, parallel.mode=basp)")
    assert len(out) == 2 and out[1].startswith("done: steps 1-5 of 5")
    assert "train:\n  steps: 5" in (run_dir / "config.yaml").read_text()
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.rglob("*")
              if p.is_file() and p.name != ".lock"}
    run(tiny_config(run_dir))  # the checkpoint holds step 5 of 5 already
    assert capsys.readouterr().out == f"done: {run_dir} already holds step 5 of 5\n"
    after = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.rglob("*")
             if p.is_file() and p.name != ".lock"}
    assert after == before  # no config.yaml, metrics.jsonl or event file rewritten or added
    assert len(os.listdir(run_dir / "tb")) == 1


def test_the_done_line_gives_the_median_step_and_the_rate_counting_stalls():
    """A checkpoint save stalls the step after it (8 s against 0.67 s for the 1B model on one
    GPU): the done line's rate is the median step's, and the rate over all steps beside it when
    stalls cost more than 5%."""
    from types import SimpleNamespace

    from train.observe.report import StepReport

    run = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(steps=6)), run_dir="/r",
                          tokens_per_step=1000, peak=1000.0, flops_per_token=1.0,
                          devices=[None], layout=None)
    report = StepReport(run, SimpleNamespace(start=0), logger=None, writer=None, evaluator=None)
    report.losses = [2.0, 1.9, 1.8, 1.7, 1.6, 1.5]
    report.step_times = [9.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # the first step compiles: left out
    assert report.done_line(12.0) == ("done: steps 1-6 of 6 in 12.0s, loss 2.0000 -> 1.5000, "
                                      "1,000 tokens/s, mfu 100.0%; outputs in /r")
    report.step_times = [9.0, 1.0, 1.0, 5.0, 1.0, 1.0]  # a stall of 4 s
    line = report.done_line(16.0)
    assert "1,000 tokens/s, mfu 100.0% at the median step (556 tokens/s counting stalls)" in line
