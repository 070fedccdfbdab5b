"""A GPU user's first run, checked on a CPU: the CUDA extras, the platform check of the GPU
configs, and the GPU defaults (XLA flags, memory fraction, compilation cache) that train.process.runtime
and train.tools.aot share."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement

from train import cli
from train.process import gpu_defaults, runtime

from tests.helpers.trainer import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/gpu/llama-3.2-1b_basp.yaml"


def _env(**extra):
    drop = ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, **extra}


def test_cuda_extras_install_jax_cuda_on_linux_only():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("cuda12", "cuda13"):
        (req,) = [Requirement(r) for r in extras[name]]
        assert req.name == "jax" and req.extras == {name}, req
        on = lambda system, machine: req.marker.evaluate(  # noqa: E731
            {"sys_platform": system, "platform_machine": machine})
        assert on("linux", "x86_64") and on("linux", "aarch64")
        assert not on("darwin", "arm64") and not on("win32", "AMD64")  # `.[test]` on a Mac works
    readme = (ROOT / "README.md").read_text()
    assert '".[cuda12]"' in readme and '".[cuda13]"' in readme


def test_a_gpu_config_without_a_gpu_stops_with_one_line(tmp_path):
    """python train.py on a CPU-only JAX (the default `pip install -e .`): exit 2 before anything
    compiles or is written, naming the extra to install and the CPU alternative."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", "--config", CONFIG, f"run.dir={run_dir}"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: config: runtime.platform=gpu but JAX "), lines[0]
    assert '".[cuda13]"' in lines[0] and '".[cuda12]"' in lines[0], lines[0]  # no driver here
    assert "runtime.platform=cpu" in lines[0]
    assert proc.stdout == "" and not run_dir.exists()


def test_platform_gpu_is_refused_in_process_too(tmp_path, capsys):
    status = cli.main(tiny_overrides(tmp_path / "run", "runtime.platform=gpu"))
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and "runtime.platform=gpu but JAX" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("driver, advice", [
    ("550.54.15", 'NVIDIA driver 550.54.15 found: pip install -e ".[cuda12]"'),
    ("580.65.06", 'NVIDIA driver 580.65.06 found: pip install -e ".[cuda13]"'),
    ("470.82.01", "NVIDIA driver 470.82.01 is older than JAX's CUDA 12 build needs (525)"),
    (None, "this machine has no NVIDIA driver"),
])
def test_the_extra_named_follows_the_driver(tmp_path, driver, advice):
    path = tmp_path / "version"
    if driver:  # the first line of /proc/driver/nvidia/version, as the open and closed drivers write it
        path.write_text(f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {driver}  "
                        "Release Build  (dvs-builder@U16-I3-B03-4-3)  Thu Jun 27 2025\n")
        assert runtime.driver_version(str(path)) == driver
    message = runtime.no_gpu_message("0.10.2", driver_path=str(path))
    assert advice in message and "\n" not in message, message


def test_cpu_devices_are_needed_only_off_the_gpu():
    from train.config.schema import ConfigError, load_config

    cfg = load_config(CONFIG, ["run.dir=r"])
    assert (cfg.runtime.platform, cfg.runtime.cpu_devices) == ("gpu", None)  # unset: not needed
    with pytest.raises(ConfigError, match="runtime.cpu_devices is required"):
        load_config(CONFIG, ["run.dir=r", "runtime.platform=cpu"])
    assert load_config(CONFIG, ["run.dir=r", "runtime.platform=cpu",
                                "runtime.cpu_devices=8"]).runtime.cpu_devices == 8


# ---------------------------------------------------------------------------- GPU defaults

def test_the_users_flags_and_memory_fraction_win():
    user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/d"
    env = {"XLA_FLAGS": user, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    done, kept = gpu_defaults.apply_env(env)
    assert env["XLA_FLAGS"].startswith(user)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in env["XLA_FLAGS"]
    assert "--xla_gpu_enable_pipelined_all_gather=true" in env["XLA_FLAGS"]
    assert "XLA_CLIENT_MEM_FRACTION" not in env  # jaxlib refuses both names at once
    assert kept == ["--xla_gpu_enable_latency_hiding_scheduler", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5"]
    again = dict(env)
    assert gpu_defaults.apply_env(again)[0] == [] and again == env  # applying twice adds nothing

    line = gpu_defaults.describe(done, kept, "/c", False)
    assert line.startswith("gpu defaults: XLA_FLAGS += --xla_gpu_enable_pipelined_all_gather=true")
    assert line.endswith("(yours kept: --xla_gpu_enable_latency_hiding_scheduler, "
                         "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5, compilation cache /c)")

    fresh = {}
    done, kept = gpu_defaults.apply_env(fresh)
    assert fresh["XLA_CLIENT_MEM_FRACTION"] == "0.9" and kept == []
    assert fresh["XLA_FLAGS"].split() == [f"--{n}={v}" for n, v in gpu_defaults.XLA_FLAGS]
    line = gpu_defaults.describe(done, kept, "/c", True)
    assert "XLA_CLIENT_MEM_FRACTION=0.9; compilation cache /c" in line and "yours" not in line


def test_every_default_flag_is_known_to_this_jaxlib():
    """XLA aborts the process on a flag it does not know: a JAX upgrade that drops one fails here,
    not on a user's GPU."""
    flags, _, _ = gpu_defaults.xla_flags()
    proc = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(jnp.ones(2).sum())"],
                          env=_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "2.0", proc.stderr[-2000:]


def test_the_compilation_cache_keeps_a_directory_the_user_chose(tmp_path):
    code = ("from train.process import gpu_defaults; import jax; "
            "print(*gpu_defaults.enable_compilation_cache(), jax.config.jax_compilation_cache_dir)")
    mine = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=_env(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path)))
    assert mine.stdout.split() == [str(tmp_path), "False", str(tmp_path)], mine.stderr
    ours = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=_env(JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path)))
    path = str(tmp_path / "basp-jax" / "jax-compilation-cache")
    assert ours.stdout.split() == [path, "True", path], ours.stderr


@pytest.mark.parametrize("jaxlib, cache_dir, turned_off", [
    ("0.12.0.1", "/cache", False), ("0.12.1", "/cache", True), ("0.13.0", "/cache", True),
    ("0.12.1", None, False)])
def test_cpu_processes_compile_afresh_where_jaxlib_cannot_run_a_cached_program(
        monkeypatch, capsys, jaxlib, cache_dir, turned_off):
    """A multi-process CPU run under jaxlib 0.12.1 hangs on its first step when the program comes
    from the persistent cache (tests/e2e/test_multiprocess.py's resumed runs read it): there the
    trainer turns the cache off, with one line; elsewhere it leaves the user's cache alone."""
    updates = {}

    class Config:
        jax_compilation_cache_dir = cache_dir
        jax_enable_compilation_cache = True

        def update(self, name, value):
            updates[name] = value

    monkeypatch.setattr(runtime, "_jaxlib_version", lambda: jaxlib)
    runtime._compile_cpu_programs_afresh(SimpleNamespace(config=Config(), process_index=lambda: 0))
    assert updates == ({"jax_enable_compilation_cache": False} if turned_off else {})
    out = capsys.readouterr().out  # stdout, as the GPU defaults' line: stderr is for errors
    assert (out.count("\n") == 1 and "compilation cache off" in out) if turned_off else not out


def test_the_cuda_13_plugin_is_installed_where_jaxlibs_cuda_12_one_is_not_published(
        monkeypatch, tmp_path):
    """A jaxlib release can reach the registry before its CUDA 12 plugin: the GPU compile then
    installs the CUDA 13 plugin and its cuDNN; a failure of another kind stops at once."""
    from train.tools import aot_errors, cuda_plugin

    monkeypatch.setenv("BASP_GPU_COMPILE_DIR", str(tmp_path))
    monkeypatch.setattr(cuda_plugin, "_check_platform", lambda: None)
    calls = []

    def pip(cmd, **kwargs):
        calls.append([c for c in cmd if c.startswith(("jax-", "nvidia-"))])
        if "cuda12" in calls[-1][0]:
            return SimpleNamespace(returncode=1, stdout="", stderr="ERROR: No matching "
                                   "distribution found for jax-cuda12-plugin")
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    def full_disk(cmd, **kwargs):
        calls.append(cmd)
        return SimpleNamespace(returncode=1, stdout="", stderr="ERROR: No space left on device")

    monkeypatch.setattr(cuda_plugin.subprocess, "run", pip)
    assert cuda_plugin.install_plugin() == cuda_plugin.plugin_dir()
    assert [c[0].split("==")[0] for c in calls] == ["jax-cuda12-plugin", "jax-cuda13-plugin"]
    assert calls[1][2].startswith("nvidia-cudnn-cu13")
    calls.clear()
    monkeypatch.setattr(cuda_plugin.subprocess, "run", full_disk)
    with pytest.raises(aot_errors.AotError, match="pip could not install jax-cuda12-plugin"):
        cuda_plugin.install_plugin()
    assert len(calls) == 1


def test_the_test_setup_installs_the_cuda_plugin_only_where_jax_ships_it(monkeypatch, capsys):
    """`aot --install-if-supported` (the README's test command runs it before pytest): elsewhere
    than Linux x86_64 one line and exit 0; where the plugin is already there, no install."""
    from train.tools import aot

    def no_install():
        raise AssertionError("installed although it should not have")

    monkeypatch.setattr(aot, "install_plugin", no_install)
    monkeypatch.setattr(aot.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(aot.platform, "machine", lambda: "arm64")
    assert aot.main(["--install-if-supported"]) == 0
    assert "Darwin arm64" in capsys.readouterr().out
    monkeypatch.setattr(aot.platform, "system", lambda: "Linux")
    monkeypatch.setattr(aot.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(aot, "plugin_ready", lambda: True)
    assert aot.main(["--install-if-supported"]) == 0
    installed = []
    monkeypatch.setattr(aot, "plugin_ready", lambda: False)
    monkeypatch.setattr(aot, "install_plugin", lambda: installed.append(1))
    assert aot.main(["--install-if-supported"]) == 0 and installed == [1]
