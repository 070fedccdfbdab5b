"""The command line: bad configs exit 2 with one line and no traceback; the demo config runs."""

import json

import pytest

from tests.helpers.trainer import tiny_overrides, train_cmd as _train

pytestmark = pytest.mark.usefixtures("compile_cache")  # this run's (tests/conftest.py)


def _one_error_line(code, stderr, fragment):
    assert code == 2, stderr
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1, stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in stderr


# As `python train.py` in a shell: two errors found before JAX starts, and the one that needs a
# device count of its own (the process's, set before JAX starts)
@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["train.stepz=3"], "error: config: unknown config key 'train.stepz'"),
        (["train.microbatch_size=two"], "error: config: train.microbatch_size: expected an integer"),
        (["runtime.cpu_devices=6", "train.microbatch_size=4", "data.seq_len=48"],
         "error: layout: num_heads=8 is not divisible by the all-to-all degree 3"),
    ],
)
def test_bad_config_exits_2_with_one_line(tmp_path, extra, fragment):
    proc = _train(*tiny_overrides(tmp_path / "r", "train.microbatch_size=2", *extra))
    _one_error_line(proc.returncode, proc.stderr, fragment)


# The same command's other errors, in this process (train.cli.main: the same code, without a
# second Python start and JAX import per case)
@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["parallel.mode=ulysses", "parallel.groups=2"], "means groups=1, got groups=2"),
        (["data.source=tokens", "data.path=/nonexistent.bin"], "error: data: token file"),
        (["model.preset=gpt-9"], "error: model: unknown preset 'gpt-9'"),
        (["model.shape.hidden_sise=3"], "error: config: unknown config key 'model.shape.hidden_sise'"),
        (["data.seq_len=66"], "error: layout: seq_len=66 is not divisible by sp=4"),
    ],
)
def test_bad_config_in_process_returns_2_with_one_line(tmp_path, capsys, extra, fragment):
    from train import cli

    capsys.readouterr()
    code = cli.main(tiny_overrides(tmp_path / "r", "train.microbatch_size=2", *extra))
    _one_error_line(code, capsys.readouterr().err, fragment)
    assert not (tmp_path / "r").exists()


def test_no_arguments_asks_for_a_config_file():
    proc = _train()
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert "--config" in lines[0] and "run.dir" not in lines[0], lines[0]


@pytest.mark.parametrize("tool", ["aot", "config_doc", "plan", "plot"])
def test_tool_help_description_is_a_whole_sentence(tool):
    """These commands' --help shows the first line of their module docstring."""
    import importlib

    first = importlib.import_module(f"train.tools.{tool}").__doc__.splitlines()[0].rstrip()
    assert first.endswith("."), first


def test_missing_config_file(tmp_path):
    proc = _train("--config", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: config: config file")


@pytest.mark.slow
def test_demo_config_runs_shortened(tmp_path):
    run_dir = tmp_path / "demo"
    proc = _train("--config", "configs/demo_cpu.yaml", f"run.dir={run_dir}", "train.steps=12",
                  "optimizer.warmup_steps=2", "checkpoint.every=5",
                  f"checkpoint.export_hf={tmp_path / 'hf'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == list(range(1, 13))
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.3
    assert "done: steps 1-12 of 12" in proc.stdout
    assert (run_dir / "config.yaml").exists()
    table = json.loads((run_dir / "collectives.json").read_text())["per_kind"]
    assert table["all-to-all"]["count"] > 0
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["10", "12"]  # keep: 2
    assert (tmp_path / "hf" / "config.json").exists()
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "hf").iterdir())
