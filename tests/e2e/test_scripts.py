"""scripts/: the launch scripts parse, and the train.py command lines they build are valid configs.

The scripts run for real with a stand-in for python (and for srun) that records its arguments,
which are then read with train.config.load_config like train.py would.
"""

import os
import subprocess
from pathlib import Path

import pytest

from train.config.schema import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh")) + sorted((ROOT / "scripts").glob("*.sbatch"))
CONFIG = "configs/gpu/llama-3.2-1b_basp.yaml"

RECORDER = """#!/bin/bash
printf '%s\\n' "$@" > "$RECORD/argv"
echo "${JAX_LOCAL_DEVICE_IDS-unset}" > "$RECORD/local_device_ids"
"""
FAKE_SRUN = """#!/bin/bash
# drop srun's own options, remember them, run the command once (as one task would)
while [[ $1 == -* ]]; do echo "$1" >> "$RECORD/srun_options"; shift; done
exec "$@"
"""


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _run(tmp_path, script, args, env):
    for name, text in (("python", RECORDER), ("srun", FAKE_SRUN)):
        tool = tmp_path / "bin" / name
        tool.parent.mkdir(exist_ok=True)
        tool.write_text(text)
        tool.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_"))}
    env = {**clean, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "RECORD": str(tmp_path),
           "PYTHON": str(tmp_path / "bin" / "python"), **env}
    result = subprocess.run(["bash", f"scripts/{script}", *args], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:3] == ["train.py", "--config", CONFIG]
    return argv[3:], (tmp_path / "local_device_ids").read_text().strip()


def test_multihost_command_is_a_valid_config(tmp_path):
    env = {"JAX_COORDINATOR_ADDRESS": "host0:12355", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    overrides, _ = _run(tmp_path, "multihost.sh", [CONFIG, "train.steps=100"], env)
    cfg = load_config(CONFIG, overrides)
    dist = cfg.runtime.distributed
    assert (dist.coordinator, dist.num_processes, dist.process_id) == ("host0:12355", 2, 1)
    assert cfg.train.steps == 100
    with pytest.raises(ConfigError, match="process_id=2 must lie in"):  # checked before any start
        load_config(CONFIG, [o.replace("process_id=1", "process_id=2") for o in overrides])


def test_multihost_needs_its_environment(tmp_path):
    result = subprocess.run(["bash", "scripts/multihost.sh", CONFIG], cwd=ROOT, capture_output=True,
                            text=True, env={"PATH": os.environ["PATH"]})
    assert result.returncode != 0 and "JAX_COORDINATOR_ADDRESS" in result.stderr


def test_slurm_command_is_a_valid_config(tmp_path):
    overrides, local_ids = _run(tmp_path, "slurm_train.sbatch", [CONFIG, "train.steps=100"],
                                {"SLURM_GPUS_ON_NODE": "4"})
    cfg = load_config(CONFIG, overrides)
    assert cfg.runtime.distributed.enabled is True and cfg.train.steps == 100
    assert local_ids == "0,1,2,3"  # every process drives all GPUs of its node
    assert "--ntasks-per-node=1" in (tmp_path / "srun_options").read_text().split()
    header = (ROOT / "scripts" / "slurm_train.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in header and "#SBATCH --gpus-per-node=4" in header
