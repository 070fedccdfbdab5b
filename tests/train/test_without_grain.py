"""Without grain installed (a GPU image may lack it): synthetic data trains, and token files say
in one line how to get it. grain is blocked with sys.modules["grain"] = None, which makes every
`import grain` raise ImportError, as on a machine without it."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.trainer import ROOT, tiny_overrides, train_env

pytestmark = pytest.mark.usefixtures("compile_cache")  # this run's (tests/conftest.py)

# `python train.py ARGS` with grain blocked before anything is imported
BLOCKED_TRAIN = ("import runpy, sys; sys.modules['grain'] = None; sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.slow
def test_synthetic_training_never_imports_grain(tmp_path):
    run_dir = tmp_path / "r"
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKED_TRAIN, str(ROOT / "train.py"),
         *tiny_overrides(run_dir, "train.steps=2", "metrics.tensorboard=false")],
        cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]


def test_token_files_without_grain_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    from train import cli

    path = tmp_path / "ids.bin"
    (np.arange(2000, dtype=np.uint16) % 255 + 1).tofile(path)  # ids below the tiny vocab's 256
    monkeypatch.setitem(sys.modules, "grain", None)
    capsys.readouterr()
    code = cli.main(tiny_overrides(tmp_path / "r", "train.microbatch_size=2",
                                   "data.source=tokens", f"data.path={path}"))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: data: data.source=tokens reads its rows through grain")
    assert lines[0].endswith("pip install grain"), lines[0]
    assert not (tmp_path / "r").exists()
