"""The GPU program, seen without a GPU: the trainer's real step compiled for 2 hosts x 4
A100-40GB (python -m train.tools.aot), its memory, kernels and collectives.

Compiling needs JAX's CUDA plugin, installed once per environment by the README's test command
(`python -m train.tools.aot --install-if-supported`, before pytest). The compiles run in
subprocesses, so this test process (and every CPU test) never loads the plugin.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from basp_jax import gpus
from basp_jax.compiled import comm, hlo
from basp_jax.planner import cost, memory, traffic
from basp_jax.planner.hardware import HARDWARE
from basp_jax.planner.precisions import Precisions
import models
from models.config import MODEL_SHAPES
from train.config import load_config
from train.program import planning
from train.tools import aot_report
from tests.helpers.flags import TEST_XLA_FLAGS, jaxlib_minor

COMPILE_CACHE = False  # tests/conftest.py: its GPU programs compile in subprocesses

ROOT = Path(__file__).resolve().parents[2]
LINUX_X86 = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not LINUX_X86, reason="JAX's CUDA plugin (needed to compile for a GPU) "
                       "exists for Linux x86_64 only; CI compiles these programs"),
]
CONFIG_8B = "configs/gpu/llama-3.1-8b_basp.yaml"


# CI runs this suite twice, under jaxlib 0.10 (Python 3.11) and the newest (Python 3.12): see
# .ci/run. Under jaxlib >= 0.11 every GPU compile takes about twice as long (XLA links each
# kernel with nvJitLink, and its kernel cache no longer skips the LLVM work), which would
# double the suite's longest file. So the whole tier compiles under the older jaxlib, and under
# a newer one only the shipped 8B step (basp_8b) and the checks that stop before compiling: the
# newest compiler still builds the shipped program and its report, once per run.
WHOLE_TIER = pytest.mark.skipif(
    jaxlib_minor() >= (0, 11), reason="the whole GPU-compile tier runs under jaxlib < 0.11 (CI's "
    "Python 3.11 pass); under a newer one it compiles the shipped 8B step only")
CONFIG_LONG = "configs/gpu/llama-3.1-8b_long.yaml"
CONFIG_8B_FSDP = f"{CONFIG_8B},parallel.param_sharding=fsdp"  # the paper's ZeRO-3
CONFIG_ADAPTIVE = "configs/gpu/llama-3.1-8b_adaptive.yaml"  # 4 layouts, each compiled
# The mixture of experts on its own cluster (2 x 8 H100), with its own test.
CONFIG_MOE = "configs/gpu/qwen3-30b-a3b_basp.yaml"
CONFIG_MOE_HYBRID = "configs/gpu/qwen3.5-35b-a3b_basp.yaml"  # Qwen3.5-MoE: the hybrid's experts
MOE_CONFIGS = (CONFIG_MOE, "configs/gpu/qwen3-30b-a3b_ulysses.yaml", CONFIG_MOE_HYBRID,
               "configs/gpu/qwen3.5-35b-a3b_ulysses.yaml")
GiB = 2**30


def _kernel_cache_flag() -> str:
    """XLA's GPU kernel cache for this pytest run (one file per xdist worker: compiles append to
    it). A kernel compiled to PTX and cubin for one program is read back for the next program
    that has it, not compiled again: the shipped configs share most of their kernels, and the
    backend (PTX and cubin, not the HLO passes) is most of a GPU compile. The programs are the
    same (HLO, buffers, the whole report); the 9 compiles of the `reports` fixture take 30% less
    CPU time (215 -> 151 s), the whole file 16% (773 -> 649 s)."""
    run = os.environ.get("BASP_TEST_COMPILE_CACHE")  # tests/conftest.py: this run's folder
    folder = Path(run).parent if run else Path(tempfile.gettempdir())
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    return f"--xla_gpu_kernel_cache_file={folder / f'gpu-kernels-{worker}.bin'}"


def _run(*args, timeout=1200, env=None):
    """A subprocess without the tests' CPU-only compile flag (tests/helpers/flags.py): the GPU
    programs compiled here are the ones a user gets (compiled faster: _kernel_cache_flag)."""
    env = dict(os.environ if env is None else env)
    flags = env.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "").strip()
    env["XLA_FLAGS"] = f"{flags} {_kernel_cache_flag()}".strip()
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="session")
def cuda_plugin():
    """JAX's CUDA plugin for this environment: a missing one fails every test here (never a skip
    on Linux x86_64), naming the command that installs it."""
    probe = ("from train.tools import cuda_plugin; import sys; "
             "sys.exit(0 if cuda_plugin.plugin_ready() else 1)")
    if _run("-c", probe).returncode:
        pytest.fail("JAX's CUDA plugin is not installed: run `python -m train.tools.aot "
                    "--install-if-supported` first (the README's test command does)")


@pytest.fixture(scope="session")
def basp_8b(cuda_plugin, tmp_path_factory):
    """docs/gpu.md's command for the paper's testbed: report, JSON and HLO of the shipped 8B config."""
    out = tmp_path_factory.mktemp("aot")
    done = _run("-m", "train.tools.aot", "--config", CONFIG_8B, "--target", "a100-40gb", "--hosts", "2",
                "--gpus-per-host", "4", "--json", str(out / "r.json"), "--hlo", str(out / "s.hlo"))
    assert done.returncode == 0, done.stderr[-3000:]
    return {"stdout": done.stdout, "stderr": done.stderr,
            "report": json.loads((out / "r.json").read_text()),
            "hlo": (out / "s.hlo").read_text()}


@WHOLE_TIER
def test_packed_documents_run_cudnn_packed_layout_on_hopper(cuda_plugin, tmp_path):
    """The shipped packed 8B config on one host of 8 H100s, attention as configured (auto):
    every layer's attention is cuDNN's fused kernel on its packed layout (basp_jax.cudnn;
    forward, recomputed forward and backward: 3 per layer), no [S, S] buffer anywhere; our
    Pallas kernel is compiled only as the fallback of a step whose rows hold more documents
    than the layout's bound."""
    done = _run("-m", "train.tools.aot", "--config", CONFIG_8B, "--target", "h100-80gb",
                "--hosts", "1", "--gpus-per-host", "8", "parallel.devices_per_host=8",
                "runtime.devices=8", "parallel.hardware=h100-80gb",
                "--json", str(tmp_path / "r.json"), "--hlo", str(tmp_path / "s.hlo"))
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    kernels, layers = r["attention_kernels"], r["model"]["num_layers"]
    assert set(kernels) == {"cudnn", hlo.KERNEL_TRITON_FALLBACK}, kernels
    assert kernels["cudnn"]["count"] == 3 * layers, kernels
    assert set(kernels["cudnn"]["targets"]) == {"__cudnn$fmhaSoftmax",
                                                "__cudnn$fmhaSoftmaxBackward"}, kernels
    seq = r["layout"]["seq_len"]
    assert r["layout"]["batch"] == 2 and seq == 16384
    text = (tmp_path / "s.hlo").read_text()
    assert f"{seq},{seq}]" not in text.replace(" ", ""), "an S x S buffer"
    assert "cuDNN's document bound" in done.stdout


@WHOLE_TIER
def test_cudnn_runs_in_the_per_group_step_with_parameters_on_a_per_host_mesh(cuda_plugin,
                                                                            tmp_path):
    """Two hosts of 8 H100s, host parameters (a second, per-host mesh) and 2 microbatches (the
    step mapped over the groups with jax.vmap, train.program.per_group): cuDNN's kernels bound
    below JAX's wrapper (basp_jax.cudnn_call), whose batching rule and one-mesh rule these
    programs break, run every layer's packed attention."""
    done = _run("-m", "train.tools.aot", "--config", "configs/gpu/llama-3.2-1b_basp.yaml",
                "--target", "h100-80gb", "--hosts", "2", "--gpus-per-host", "8",
                "parallel.devices_per_host=8", "runtime.devices=16",
                "parallel.hardware=h100-80gb", "parallel.param_sharding=host",
                "train.grad_accum=2", "--json", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    kernels, layers = r["attention_kernels"], r["model"]["num_layers"]
    assert r["param_sharding"] == "host" and r["grad_accum"] == 2, r["param_sharding"]
    assert set(kernels) == {"cudnn", hlo.KERNEL_TRITON_FALLBACK}, kernels
    assert kernels["cudnn"]["count"] == 3 * layers * 2, kernels  # per microbatch


@pytest.mark.skipif(jaxlib_minor() < (0, 12), reason="jaxlib < 0.12 compiles cuDNN attention "
                    "without a GPU (the tests above): no refusal to fall back from here; "
                    "tests/train/test_compile_fallback.py checks the fallback on every jaxlib")
def test_a_cudnn_refusal_at_compile_time_compiles_the_step_with_pallas_and_one_note(
        cuda_plugin, tmp_path):
    """jaxlib 0.12's XLA refuses to compile cuDNN's custom calls without a GPU ("deviceless
    cuDNN compilation is not enabled"): a real refusal at compile time. The packed 1B config's
    step with the tiny model (2 layers) for one host of H100s (cuDNN's packed layout while
    traced) then compiles again with our Pallas kernel in every layer, exit 0, the refusal named once on stderr and in the report."""
    done = _run("-m", "train.tools.aot", "--config", "configs/gpu/llama-3.2-1b_basp.yaml",
                "--target", "h100-80gb", "--hosts", "1", "--gpus-per-host", "8",
                "parallel.devices_per_host=8", "runtime.devices=8", "parallel.hardware=h100-80gb",
                "data.seq_len=4096", "model.preset=tiny",
                "--json", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert "deviceless cuDNN" in r["cudnn_refused"], r["cudnn_refused"]
    kernels, layers = r["attention_kernels"], r["model"]["num_layers"]
    assert set(kernels) == {hlo.KERNEL_TRITON}, kernels
    notes = [line for line in done.stderr.splitlines() if "could not compile cuDNN" in line]
    assert len(notes) == 1 and "Pallas" in notes[0], done.stderr[-3000:]
    assert "XLA could not compile cuDNN attention" in done.stdout  # the report's line
    assert layers == 2 and kernels[hlo.KERNEL_TRITON]["count"] >= 3 * layers, kernels


# XLA as it refuses cuDNN attention at compile time, in a jaxlib that compiles it without a GPU:
# every program that calls cuDNN's kernels fails to compile with the words jaxlib 0.12 uses
_REFUSING_XLA = """
import sys
from train.tools import aot, cuda_plugin
cuda_plugin.use_plugin()  # before jax is imported
import jax.stages
compile = jax.stages.Lowered.compile
def refusing(self, *args, **kwargs):
    if "__cudnn$fmha" in self.as_text():
        raise RuntimeError("INVALID_ARGUMENT: StreamExecutor is null and deviceless cuDNN "
                           "compilation is not enabled.")
    return compile(self, *args, **kwargs)
jax.stages.Lowered.compile = refusing
sys.exit(aot.main(sys.argv[1:]))
"""


@WHOLE_TIER
def test_the_trainers_programs_fall_back_from_a_cudnn_refusal_at_compile_time(cuda_plugin,
                                                                               tmp_path):
    """The refusal above, met by every jaxlib: jaxlib 0.10's XLA made to refuse cuDNN's custom
    calls as 0.12's does (_REFUSING_XLA). The tiny model with a ring of 2 on one host of H100s
    (cuDNN for attention and the ring's hops while traced) compiles again with Pallas
    everywhere: the program rebuilt (train.program.state.TrainProgram.rebuild), the report's
    field and line, one note."""
    done = _run("-c", _REFUSING_XLA, "--config", "configs/gpu/llama-3.2-1b_basp.yaml",
                "--target", "h100-80gb", "--hosts", "1", "--gpus-per-host", "8",
                "parallel.devices_per_host=8", "runtime.devices=8", "parallel.hardware=h100-80gb",
                "data.seq_len=4096", "model.preset=tiny", "parallel.ring=2",
                "--json", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["cudnn_refused"] == ("INVALID_ARGUMENT: StreamExecutor is null and deviceless "
                                  "cuDNN compilation is not enabled"), r["cudnn_refused"]
    assert set(r["attention_kernels"]) == {hlo.KERNEL_TRITON}, r["attention_kernels"]
    assert r["layout"]["ring"] == 2 and r["ring_hop_kernels"], r["layout"]
    assert all(set(kinds) == {hlo.KERNEL_TRITON} for kinds in r["ring_hop_kernels"].values()), \
        r["ring_hop_kernels"]
    notes = [line for line in done.stderr.splitlines() if "could not compile cuDNN" in line]
    assert len(notes) == 1, done.stderr[-3000:]
    assert "(XLA could not compile cuDNN attention: INVALID_ARGUMENT" in done.stdout


def _twin(path: str) -> str:
    return path.replace("_ulysses.yaml", "_basp.yaml")


# The GPU defaults' overlap flags, switched off the way a user would (XLA_FLAGS wins over
# train.process.gpu_defaults): the program the planner's memory formula (basp_jax.planner.cost) was fitted to.
# With them on, the latency-hiding scheduler spends spare device memory on prefetching
# collectives: +20% on a 4-layer Llama-3.2-1B step, +2.5 GiB (+11%) on the 8B one (basp_8b).
NO_OVERLAP = " ".join(f"--{name}=false" for name in (
    "xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_enable_pipelined_all_gather",
    "xla_gpu_enable_pipelined_reduce_scatter", "xla_gpu_enable_pipelined_all_reduce",
    "xla_gpu_enable_while_loop_double_buffering"))


@pytest.fixture(scope="session")
def reports(cuda_plugin, tmp_path_factory):
    """The shipped BASP configs, the 8B Ulysses one and the 8B one with FSDP, compiled in one
    process, without the overlap flags (NO_OVERLAP; basp_8b is the 8B BASP step with them).
    The other Ulysses configs equal their BASP twins but for parallel.mode
    (test_ulysses_configs_are_their_basp_twins), and the layout leaves the memory unchanged."""
    configs = sorted(glob.glob(str(ROOT / "configs/gpu/*_basp.yaml")))
    cases = [os.path.relpath(c, ROOT) for c in configs]
    cases = [c for c in cases if c not in MOE_CONFIGS]
    cases += ["configs/gpu/llama-3.1-8b_ulysses.yaml", CONFIG_8B_FSDP, CONFIG_ADAPTIVE]
    out = tmp_path_factory.mktemp("aot") / "reports.json"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {NO_OVERLAP}".strip())
    done = _run("tests/e2e/aot_worker.py", str(out), *cases, timeout=3000, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["case"]: r for r in json.loads(out.read_text())}


def _rows(report, kind):
    return [c for c in report["collectives"] if c["kind"] == kind]


@pytest.mark.slow
def test_the_command_prints_the_report_and_writes_json_and_hlo(basp_8b):
    out, r = basp_8b["stdout"], basp_8b["report"]
    assert "NVIDIA A100-SXM4-40GB x 8 (2 host(s) x 4)" in out
    assert "peak" in out and "attention kernel:" in out and "all-to-all" in out
    assert basp_8b["stderr"] == ""  # the plugin's no-driver notices are filtered
    for key in ("peak_bytes_per_device", "device_memory_bytes", "fits", "attention_kernels",
                "compile_s"):
        assert key in r
    assert r["device_memory_bytes"] == gpus.GPUS["a100-40gb"].memory_bytes
    mem = r["memory"]
    assert r["peak_bytes_per_device"] == (mem["argument_bytes"] + mem["temp_bytes"]
                                          + mem["output_bytes"] - mem["alias_bytes"])
    # fp32 parameters and second moment, bf16 first moment (optimizer.mu_dtype), sharded over
    # all 8 (staged_keep, as fsdp): 10 B x 8.03e9 / 8 = 9.35 GiB
    assert r["param_sharding"] == "staged_keep"
    assert 9 * GiB < mem["argument_bytes"] < 9.7 * GiB
    assert r["fits"] and r["peak_bytes_per_device"] < gpus.usable_memory_bytes(
        gpus.GPUS["a100-40gb"])
    # fsdp's peak (17.97 GiB) plus the kept host-local bf16 copies of the layers (3.25 GiB)
    assert r["peak_bytes_per_device"] <= 22 * GiB
    assert r["attention_kernels"], "no attention kernel recognised"
    # the HLO written is the program reported
    assert comm.summarize(comm.parse_collectives(basp_8b["hlo"], 8), 4)["all-to-all"]["count"] \
        == sum(c["count"] for c in _rows(r, "all-to-all"))


def test_the_gpu_defaults_reach_the_compiler(basp_8b):
    """train.tools.aot compiles with the XLA flags a GPU run sets (train.process.gpu_defaults), and their effect
    is in the program. Without them XLA puts most async dones right after their starts (a 4-layer
    Llama-3.2-1B step, same command: 3 of 31 pairs enclose compute) and loops once per layer."""
    import re

    from train.process import gpu_defaults

    r = basp_8b["report"]
    for name, value in gpu_defaults.XLA_FLAGS:
        assert f"--{name}={value}" in r["xla_flags"].split(), name
    assert r["memory_fraction"] == float(gpu_defaults.MEM_FRACTION)
    # the latency-hiding scheduler: compute between nearly every start and its done
    overlap = r["overlapped_collectives"]
    pairs = sum(v["pairs"] for v in overlap.values())
    assert sum(v["overlapped"] for v in overlap.values()) >= 0.85 * pairs, overlap
    assert overlap["all-to-all"]["overlapped"] >= 0.9 * overlap["all-to-all"]["pairs"], overlap
    # while-loop double buffering: the layer loop runs two layers per iteration
    trips = [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"', basp_8b["hlo"])]
    assert trips and max(trips) <= r["model"]["num_layers"] // 2, trips
    assert "async collectives overlapping compute:" in basp_8b["stdout"]


def test_basp_all_to_alls_stay_inside_hosts(basp_8b):
    a2a = [c for c in comm.parse_collectives(basp_8b["hlo"], 8) if c.kind == "all-to-all"]
    assert a2a and all(c.dtype == "bf16" for c in a2a)
    assert {c.groups for c in a2a} == {((0, 1, 2, 3), (4, 5, 6, 7))}
    assert sum(c["inter_host_wire_bytes"] for c in _rows(basp_8b["report"], "all-to-all")) == 0


@WHOLE_TIER
@pytest.mark.slow
def test_ulysses_inter_host_all_to_all_bytes_equal_the_closed_form(reports):
    r = reports["configs/gpu/llama-3.1-8b_ulysses.yaml"]
    assert (r["layout"]["groups"], r["layout"]["sp"]) == (1, 8)
    shape = MODEL_SHAPES["llama-3.1-8b"]
    hw = HARDWARE["a100-40gb"]
    layout = cost.plan_layout(shape, num_devices=8, batch=2, seq_len=16384, groups=1,
                              devices_per_host=hw.devices_per_host)
    predicted = cost.predict(shape, layout, "fsdp", hw=hw)
    measured = sum(c["inter_host_wire_bytes"] for c in _rows(r, "all-to-all"))
    assert measured == pytest.approx(predicted.all_to_all.inter, rel=1e-9)


@WHOLE_TIER
def test_the_hybrid_compiles_scanned_by_period_with_the_planners_exchanges(reports):
    """Qwen3.5-9B (24 Gated DeltaNet and 8 attention layers scanned as 8 periods of 4): one
    period's program, compiled in about a minute on 2 CPU cores; attention's and the Gated
    DeltaNet's all-to-alls are the planner's to the byte, none across hosts, none recomputed;
    the staged parameters cross hosts, as the other configs'."""
    case = "configs/gpu/qwen3.5-9b_basp.yaml"
    r = reports[case]
    assert r["param_sharding"] == "staged_keep" and r["compile_s"] < 180
    cfg = load_config(str(ROOT / case))
    mcfg = models.ModelConfig.preset(cfg.model.preset)
    layout, strategy = planning.plan(cfg, mcfg, cfg.runtime.devices, cfg.parallel.devices_per_host)
    pred = cost.predict(planning.model_shape(mcfg), layout, strategy,
                        hw=planning.hardware(cfg, layout.devices_per_host), remat=cfg.model.remat)
    rows = _rows(r, "all-to-all")
    assert pred.all_to_all.intra == pytest.approx(sum(c["wire_bytes"] for c in rows), rel=1e-3)
    assert pred.all_to_all.inter == 0 == sum(c["inter_host_wire_bytes"] for c in rows)
    assert pred.all_to_all.launches == sum(c["count"] for c in rows)
    crossing = [c for c in r["collectives"] if c["inter_host_wire_bytes"] > 2**20]
    assert crossing and all(c["group_size"] == 2 for c in crossing)


@WHOLE_TIER
def test_staged_parameters_cross_hosts_once_as_eighths(basp_8b, reports):
    """The shipped 8B step (staged_keep): each layer and vocabulary table crosses hosts once
    forward as the 1/8 pieces a host lacks and its gradient once as a reduce-scatter of 1/4
    shards between the 2 hosts, so the bytes between hosts per GPU per step are the closed-form
    minimum for every bf16 parameter (fsdp's: 5x more), the planner counts them to 5%, and no
    all-to-all byte crosses."""
    r, fsdp = basp_8b["report"], reports[CONFIG_8B_FSDP]
    inter = sum(c["inter_host_wire_bytes"] for c in r["collectives"])
    assert inter <= 4.5 * GiB and sum(c["inter_host_wire_bytes"] for c in fsdp["collectives"]) \
        > 4 * inter
    a2a = _rows(r, "all-to-all")
    assert sum(c["per_layer"] for c in a2a) == 8 and not any(
        c["inter_host_wire_bytes"] for c in a2a)
    crossing = [c for c in r["collectives"] if c["inter_host_wire_bytes"] > 64 * 2**20]
    layers = [c for c in crossing if c["group_size"] == 2]  # the layers': between the hosts
    assert {c["kind"] for c in layers} == {"all-gather", "reduce-scatter"}, crossing
    shape = MODEL_SHAPES["llama-3.1-8b"]
    hw = dataclasses.replace(HARDWARE["a100-40gb"], devices_per_host=4)
    layout = cost.plan_layout(shape, num_devices=8, batch=2, seq_len=16384, groups=2,
                              devices_per_host=4)
    pred = cost.predict(shape, layout, "staged_keep", hw=hw,
                        precisions=Precisions(moments=2))
    assert pred.params.inter + pred.all_to_all.inter == pytest.approx(inter, rel=0.05)
    minimum = traffic.min_inter_host_gradient_bytes(2 * shape.num_params, 8, 4)
    assert inter <= 1.02 * minimum, (inter / GiB, minimum / GiB)


@WHOLE_TIER
def test_fsdp_gradients_leave_through_reduce_scatter_and_gathers_are_bf16(reports):
    r = reports[CONFIG_8B_FSDP]
    params = r["model"]["params"]
    # The embedding and the LM head (vocab-sharded: basp_jax.vocab) get their gradient
    # where it is stored, so nothing of theirs is reduce-scattered or gathered whole.
    shape = MODEL_SHAPES["llama-3.1-8b"]
    tables = 2 * shape.vocab_size * shape.hidden_size
    scattered = sum(c["bytes"] for c in _rows(r, "reduce-scatter"))
    assert 2 * (params - tables) <= scattered < 2 * params  # the layers', at least in bf16
    # only scalars and the vocab-parallel loss's per-token maxima and sums (4 B per token each)
    assert sum(c["bytes"] for c in _rows(r, "all-reduce")) < 4 * 2**20
    gathers = _rows(r, "all-gather")
    big = [c for c in gathers if c["bytes"] > 64 * 2**20]
    assert big and {c["dtype"] for c in big} == {"bf16"}  # parameters gathered in compute dtype
    assert sum(c["bytes"] for c in big) >= 2 * params  # each parameter at least once forward


HOST_1B = ("configs/gpu/llama-3.2-1b_basp.yaml,model.shape={num_layers: 2},"
           "parallel.param_sharding=host,data.seq_len=4096")




def _staged_1b(strategy: str) -> str:
    """HOST_1B with a small vocabulary under a staged strategy: the layers' copies, not the
    tables', are what sets one strategy's memory apart from the other's."""
    return HOST_1B.replace("parallel.param_sharding=host",
                           f"parallel.param_sharding={strategy},model.shape.vocab_size=8192")


@pytest.fixture(scope="session")
def host_1b(cuda_plugin, tmp_path_factory):
    """Llama-3.2-1B with 2 layers at 4K tokens under host sharding, compiled with the GPU
    defaults (BENCHMARKS.md's host-sharded program on 2 x 4 A100-40GB, smaller), and with a
    small vocabulary under staged_offload and staged_keep, in one process."""
    out = tmp_path_factory.mktemp("aot") / "host.json"
    done = _run("tests/e2e/aot_worker.py", str(out), HOST_1B, _staged_1b("staged_offload"),
                _staged_1b("staged_keep"))
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(("host", "staged_offload", "staged_keep"), json.loads(out.read_text())))


def _inter_host(rows, dtype=None):
    return sum(c["inter_host_wire_bytes"] for c in rows
               if c["kind"] in ("all-reduce", "reduce-scatter") and dtype in (None, c["dtype"]))


@WHOLE_TIER
@pytest.mark.slow
def test_host_sharding_gradients_cross_hosts_once_as_shards_on_gpu(host_1b):
    """Every gradient element crosses hosts once, as a 1/4 shard between the two devices of the
    same rank on each host: traffic.min_inter_host_gradient_bytes of the gradient in the dtype XLA
    reduces it in. Under bf16 compute that is bf16 for every matmul and norm weight (their
    gradients are dots of bf16 operands, reduced before the convert to the fp32 parameter) and
    fp32 for the tied embedding (the lookup reads the fp32 table; its scatter-add and the tied
    projection's gradient are fp32): 0.84 x the all-fp32 closed form here. (Under fp32 compute it
    is the all-fp32 closed form: the CPU program's, tests/models/test_host_sharding.py.)"""
    shape = dataclasses.replace(MODEL_SHAPES["llama-3.2-1b"], num_layers=2)
    n, table = shape.num_params, shape.embedding_params
    assert host_1b["host"]["model"]["params"] == n
    minimum = functools.partial(traffic.min_inter_host_gradient_bytes, num_devices=8,
                                devices_per_host=4)
    scalars = 64  # the loss sum and token count, all-reduced over the 8 devices
    rows = host_1b["host"]["collectives"]
    assert minimum(4 * table) <= _inter_host(rows, "f32") <= minimum(4 * table) + scalars
    assert _inter_host(rows, "bf16") == minimum(2 * (n - table))
    total = _inter_host(rows)
    assert minimum(4 * table + 2 * (n - table)) <= total <= minimum(4 * table + 2 * (n - table)) \
        + scalars
    assert total < 0.85 * minimum(4 * n)
    for r in rows:
        if r["inter_host_wire_bytes"] and r["group_size"] > 2:  # over more than one per host
            assert r["bytes"] <= scalars, r
    assert not any(r["inter_host_wire_bytes"] for r in rows if r["kind"] == "all-gather")


@WHOLE_TIER
@pytest.mark.slow
def test_staged_offload_keeps_the_layers_copies_in_host_memory(host_1b):
    """staged_offload: each layer's host-local copy (1/4 of the layers in bf16 per GPU) is copied
    to pinned host memory in the forward pass and back in the backward, as the planner counts it,
    and most of it leaves the device (staged_keep holds it there); the bytes between hosts are
    staged_keep's and the planner's to 5%: each layer crosses once, not again for the
    recomputed backward. (The 8B step, beside fsdp's: BENCHMARKS.md section 10.)"""
    r, keep = host_1b["staged_offload"], host_1b["staged_keep"]
    shape = dataclasses.replace(MODEL_SHAPES["llama-3.2-1b"], num_layers=2, vocab_size=8192)
    layout = cost.plan_layout(shape, num_devices=8, batch=2, seq_len=4096, groups=2,
                              devices_per_host=4)
    copy = memory.host_copy_bytes(shape, layout, "staged_offload")
    assert copy == pytest.approx(2 * (shape.num_params - shape.embedding_params
                                      - shape.hidden_size) / 4)
    assert r["host_peak_bytes_per_device"] == pytest.approx(copy, rel=0.05)
    assert r["host_transfers"]["to_host_bytes"] == pytest.approx(copy, rel=0.05), r["host_transfers"]
    assert keep["host_peak_bytes_per_device"] == 0
    # XLA reuses some of the space at the peak: 0.81 x the copy leaves under jax 0.10, 0.59 under 0.12
    assert keep["peak_bytes_per_device"] - r["peak_bytes_per_device"] > 0.4 * copy
    hw = dataclasses.replace(HARDWARE["a100-40gb"], devices_per_host=4)
    pred = cost.predict(shape, layout, "staged_offload", hw=hw,
                        precisions=Precisions(moments=2))
    inter = {name: sum(c["inter_host_wire_bytes"] for c in host_1b[name]["collectives"])
             for name in ("staged_offload", "staged_keep")}
    assert inter["staged_offload"] == pytest.approx(inter["staged_keep"], rel=0.01), inter
    assert pred.params.inter + pred.all_to_all.inter == pytest.approx(inter["staged_offload"],
                                                                      rel=0.05)
    assert pred.host_memory_bytes == pytest.approx(copy)


def test_ulysses_configs_are_their_basp_twins():
    from train.config.schema import load_config, to_dict

    for path in glob.glob(str(ROOT / "configs/gpu/*_ulysses.yaml")):
        ulysses = to_dict(load_config(path))
        basp = to_dict(load_config(_twin(path), ["parallel.mode=ulysses"]))
        basp["run"]["dir"] = ulysses["run"]["dir"]
        assert ulysses == basp, path


@WHOLE_TIER
def test_every_gpu_config_names_its_cluster_and_fits_it(reports):
    every = reports
    pair = every["configs/gpu/llama-3.1-8b_ulysses.yaml"], every[CONFIG_8B]
    assert pair[0]["peak_bytes_per_device"] == pytest.approx(pair[1]["peak_bytes_per_device"],
                                                             rel=0.02)  # layout-independent
    for path in glob.glob(str(ROOT / "configs/gpu/[!_]*.yaml")):  # _base.yaml: included by them
        case = os.path.relpath(path, ROOT)
        if case == CONFIG_LONG or case in MOE_CONFIGS:  # on H100s, each with its own test
            continue
        r = every.get(case) or every[_twin(case)]
        assert (r["target"]["name"], r["hosts"], r["gpus_per_host"]) == ("a100-40gb", 2, 4), case
        assert r["fits"], f"{case}: {r['peak_bytes_per_device'] / GiB:.1f} GiB per device"
        assert r["attention_kernels"] == {"triton": r["attention_kernels"]["triton"]}, case
        # none recomputed: 4 forward, 4 backward per layer; a hybrid's Gated DeltaNet layers
        # exchange their two float32 gates besides (2 forward, 2 backward)
        rows = _rows(r, "all-to-all")
        assert all(c["per_layer"] == 8 for c in rows if c["dtype"] != "f32"), case
        linear = models.ModelConfig.preset(Path(case).stem.rsplit("_", 1)[0]).linear_layers
        assert sum(c["count"] for c in rows if c["dtype"] == "f32") == 4 * linear, case
        if case in every:
            mode = "ulysses" if case.endswith("_ulysses.yaml") else "basp"  # adaptive: basp's
            assert r["layout"]["mode"] == mode, case


def _aot_commands(tmp_path, *argvs):
    """`python -m train.tools.aot ARGV` for each argument list, all in one process (the CUDA
    plugin loads once): [{"rc", "stdout", "stderr"}], in order."""
    out = tmp_path / "commands.json"
    done = _run("tests/e2e/aot_worker.py", "--cli", str(out), *map(json.dumps, argvs), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _one_line_exit_2(results, cases):
    for result, (extra, message) in zip(results, cases, strict=True):
        assert result["rc"] == 2 and result["stdout"] == "", (extra, result)
        assert result["stderr"].count("\n") == 1 and message in result["stderr"], (extra, result)


@pytest.mark.slow
def test_bad_input_is_one_line(cuda_plugin, tmp_path):
    cases = [
        (["--target", "b200"], "unknown target 'b200'"),
        (["--hosts", "3", "runtime.devices=8"], "runtime.devices=8 disagrees with the cluster of 3 x 4"),
        (["--gpus-per-host", "8", "parallel.devices_per_host=4"], "make them agree"),
        (["--hosts", "3"], "not divisible by sp=6"),  # the flags' cluster: 12 GPUs
        (["--json", str(tmp_path)], "is a directory"),
        (["--hlo", str(tmp_path / "none" / "s.hlo")], "is not a writable folder"),
    ]
    results = _aot_commands(tmp_path, *(["--config", CONFIG_8B, *extra] for extra, _ in cases))
    _one_line_exit_2(results, cases)
    env = dict(os.environ, BASP_GPU_COMPILE_DIR=str(tmp_path / "none"))
    probe = _run("-c", "import importlib.util as u; "
                 "print(any(u.find_spec(f'jax_{c}_plugin') for c in ('cuda12', 'cuda13')))")
    if probe.stdout.strip() == "False":  # the plugin comes from the install folder: hide it
        done = _run("-m", "train.tools.aot", "--config", CONFIG_8B, env=env, timeout=300)
        assert done.returncode == 2 and "python -m train.tools.aot --install" in done.stderr
        assert done.stderr.count("\n") == 1


@WHOLE_TIER
def test_the_planners_memory_formula_is_within_15_percent_of_the_compiled(reports):
    """The paper's five models and the Qwen3.5 hybrid at 16K (the shipped configs, and the 8B
    one under HSDP), compiled without the scheduler's overlap (NO_OVERLAP)."""
    every = reports
    off = {case: r["formula_memory_bytes"] / r["peak_bytes_per_device"] - 1
           for case, r in every.items()}
    assert all(abs(x) <= 0.15 for x in off.values()), {c: f"{x:+.0%}" for c, x in off.items()}


@WHOLE_TIER
@pytest.mark.slow
def test_plan_compiles_every_candidate_and_picks_one_that_fits(cuda_plugin, tmp_path):
    out = tmp_path / "plan.json"
    # A small model of the same head counts at 4K tokens, its parameter sharding fixed to the
    # shipped multi-host one (staged_keep): the layouts of the shipped 16K config, 3 compiles of
    # seconds each. (Each sharding strategy's compiled bytes have tests of their own above.)
    done = _run("-m", "train.tools.aot", "--config", "configs/gpu/llama-3.2-1b_basp.yaml",
                "model.shape={num_layers: 1, hidden_size: 512, intermediate_size: 1024, "
                "head_dim: 16, vocab_size: 8192}", "data.seq_len=4096",
                "parallel.param_sharding=staged_keep", "--plan", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    names = [row["name"] for row in rows]
    # Ulysses's group spans both hosts, so it also comes with the ring that keeps its
    # all-to-alls inside them
    assert sorted(names) == sorted(["basp (2,4) staged_keep", "ulysses (1,8) staged_keep",
                                    "ulysses (1,8) staged_keep [ring 2]"])
    fitting = [row for row in rows if row["report"]["fits"]]
    best = min(fitting, key=lambda row: row["predicted_step_s"])
    assert f"pick: {best['name']}" in done.stdout
    for row in rows:  # each row is the layout it names, compiled
        lay = row["report"]["layout"]
        assert row["name"].startswith(f"{lay['mode']} ({lay['groups']},{lay['sp']}) "
                                      f"{row['report']['param_sharding']}")
    from train.tools import aot_report

    inter = {row["name"]: aot_report.inter_host_bytes(row["report"]) for row in rows}
    assert inter["basp (2,4) staged_keep"] < inter["ulysses (1,8) staged_keep"], inter
    for row in rows:  # the ring's all-to-alls stay inside the hosts, as BASP's do
        a2a = sum(c["inter_host_wire_bytes"] for c in _rows(row["report"], "all-to-all"))
        crosses = row["name"].startswith("ulysses") and "[ring" not in row["name"]
        assert (a2a > 0) == crosses, (row["name"], a2a)
    assert "inter-host MiB" in done.stdout


@pytest.fixture(scope="session")
def long_8b(cuda_plugin, tmp_path_factory):
    """The long-context config as shipped (4M tokens, B=1, 8 x H100-80GB; GPU defaults on) and
    512K tokens on one GPU, compiled in one process. (B=4 on 4 hosts is the shipped step with a
    group axis, and one 16M sequence on 4 hosts the same per-device work with its seq group
    across them: BENCHMARKS.md section 8 has their figures, tests/train/test_long_context.py
    checks the planner against the 16M one; that BASP's all-to-alls stay inside hosts is
    test_basp_all_to_alls_stay_inside_hosts'.)"""
    out = tmp_path_factory.mktemp("aot") / "long.json"
    cases = [CONFIG_LONG, ONE_GPU_512K]
    done = _run("tests/e2e/aot_worker.py", str(out), *cases, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


# 512K tokens on one GPU (beyond ALST's 500K on one H100): optimizer.offload=auto (the
# shipped GPU configs') puts the state in host memory because nothing else fits
ONE_GPU_512K = (f"{CONFIG_8B},data.seq_len=524288,train.microbatch_size=1,"
                "parallel.devices_per_host=1,runtime.devices=1,parallel.hardware=h100-80gb")


@WHOLE_TIER
@pytest.mark.slow
def test_long_context_config_fits_with_its_layer_inputs_in_host_memory(long_8b):
    """Llama-3.1-8B with 4,194,304 tokens on one 8 x H100 node (262,144 fitted with
    the 16K settings): device memory within what JAX may take, every layer's input (4 GiB per
    layer per GPU) in pinned host memory within the host's share, copied there once and back
    once per step, the all-to-alls repeated backward (12 per layer), the planner's device and
    host memory within 15%."""
    r = long_8b[0]
    assert r["fits"], f"{r['case']}: {r['peak_bytes_per_device'] / GiB:.1f} GiB"
    tokens = r["layout"]["batch"] * r["layout"]["seq_len"] / (r["hosts"] * r["gpus_per_host"])
    assert tokens == 524288
    host = r["host_peak_bytes_per_device"]
    assert host == pytest.approx(32 * tokens * 4096 * 2, rel=0.01)  # layers x tokens x d, bf16
    assert host <= r["host_budget_bytes"]
    assert r["formula_host_memory_bytes"] == pytest.approx(host, rel=0.01)
    moved = r["host_transfers"]
    per_layer = tokens * 4096 * 2
    assert moved["to_host_bytes"] == pytest.approx(host, rel=0.01)
    assert moved["to_host_count"] == 32  # every layer's input, once
    # back once per layer; jax >= 0.11's XLA hands the last layer's input from the forward
    # pass's final write straight to the backward's first read (31 copies back, not 32)
    assert moved["from_host_count"] in (31, 32)
    assert moved["from_host_bytes"] == pytest.approx(moved["from_host_count"] * per_layer,
                                                     rel=0.01)
    assert all(c["per_layer"] == 12 for c in _rows(r, "all-to-all")), r["case"]
    assert abs(r["formula_memory_bytes"] / r["peak_bytes_per_device"] - 1) <= 0.15, \
        (r["case"], r["formula_memory_bytes"] / GiB, r["peak_bytes_per_device"] / GiB)
    assert (r["target"]["name"], r["hosts"], r["gpus_per_host"]) == ("h100-80gb", 1, 8)
    assert r["layout"]["seq_len"] == 4194304


@WHOLE_TIER
def test_one_gpu_holds_512k_tokens_with_the_state_in_host_memory(long_8b):
    """Llama-3.1-8B, one 524,288-token sequence on one H100-80GB (optimizer.offload=auto picks
    the streamed step, train.program.streamed): its float32 master weights and Adam moments (75 GiB: more than the device
    may take beside any activation) and every layer's input (4 GiB each) in pinned host memory
    within one GPU's share of a DGX H100's; the device holds the layers' bf16 gradient and one
    layer's work. The planner's device and host memory within 15%."""
    r = long_8b[1]
    assert (r["target"]["name"], r["hosts"], r["gpus_per_host"]) == ("h100-80gb", 1, 1)
    assert r["fits"], f"{r['peak_bytes_per_device'] / GiB:.1f} GiB"
    assert r["layout"]["seq_len"] == 524288 and r["remat"] == "offload" and r["offload_state"]
    params = 8_030_261_248  # Llama-3.1-8B
    state = params * (4 + 4 + 2)  # fp32 master and second moment, bf16 first moment
    inputs = 32 * 524288 * 4096 * 2
    host = r["host_peak_bytes_per_device"]
    assert host == pytest.approx(state + inputs, rel=0.01)
    assert host <= r["host_budget_bytes"]
    assert r["peak_bytes_per_device"] < state  # the state alone would not fit beside anything
    for formula, compiled in ((r["formula_memory_bytes"], r["peak_bytes_per_device"]),
                              (r["formula_host_memory_bytes"], host)):
        assert abs(formula / compiled - 1) <= 0.15, (formula / GiB, compiled / GiB)


COLAB = "configs/colab.yaml"


@pytest.fixture(scope="session")
def colab_t4(cuda_plugin, tmp_path_factory):
    """The Colab config for a free Colab GPU, by docs/gpu.md's command."""
    out = tmp_path_factory.mktemp("aot") / "t4.json"
    done = _run("-m", "train.tools.aot", "--config", COLAB, "--target", "t4-16gb", "--hosts", "1",
                "--gpus-per-host", "1", "--json", str(out))
    return {"done": done, "report": json.loads(out.read_text()) if out.exists() else None}


@pytest.fixture(scope="session")
def colab_others(cuda_plugin, tmp_path_factory):
    """The Colab config for the smaller paid Colab GPU (L4; an A100-40GB runs the same bf16
    program with more room), and for a T4 at four times its length (which does not fit),
    compiled in one process."""
    out = tmp_path_factory.mktemp("aot") / "colab.json"
    cases = [f"{COLAB},parallel.hardware=l4-24gb", f"{COLAB},data.seq_len=262144"]
    done = _run("tests/e2e/aot_worker.py", str(out), *cases)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(("l4-24gb", "t4-16gb x4"), json.loads(out.read_text())))


@WHOLE_TIER
@pytest.mark.slow
def test_the_colab_config_fits_a_t4_in_float16_with_a_kernel_a_t4_runs(colab_t4):
    done, r = colab_t4["done"], colab_t4["report"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""  # no traceback, no notice
    assert "Tesla T4 x 1 (1 host(s) x 1)" in done.stdout and ": fits" in done.stdout
    assert r["fits"] and r["layout"]["seq_len"] == 65536
    assert r["compute_dtype"] == "float16"  # model.dtype=auto: fp16 tensor cores, no bf16 ones
    assert "float16 compute with dynamic loss scaling" in done.stdout
    # the blockwise kernel: no Triton (refused below sm80) and no cuDNN flash attention
    assert set(r["attention_kernels"]) == {"pure-JAX loop"}, r["attention_kernels"]
    assert r["peak_bytes_per_device"] <= gpus.usable_memory_bytes(gpus.GPUS["t4-16gb"])


@WHOLE_TIER
@pytest.mark.slow
def test_the_colab_config_fits_an_l4_with_cudnn_in_bf16(colab_others):
    r = colab_others["l4-24gb"]
    assert r["target"]["name"] == "l4-24gb" and (r["hosts"], r["gpus_per_host"]) == (1, 1)
    assert r["fits"], f"{r['peak_bytes_per_device'] / GiB:.1f} GiB"
    assert r["compute_dtype"] == "bfloat16"
    assert set(r["attention_kernels"]) == {"cudnn"}, r["attention_kernels"]


@WHOLE_TIER
def test_a_step_that_does_not_fit_a_t4_says_what_would_in_one_line(colab_others):
    from train.tools import aot_report

    r = colab_others["t4-16gb x4"]
    assert not r["fits"] and r["would_fit"] == "data.seq_len=131072 or --hosts 2 (2 GPUs)"
    last = aot_report.format_report(r).splitlines()[-1]
    assert last.startswith("does not fit: ") and last.endswith(r["would_fit"])


@pytest.mark.slow
def test_a_kernel_a_t4_cannot_run_is_one_line_before_compiling(cuda_plugin, tmp_path):
    cases = [
        (["model.attn_impl=pallas"], "model.attn_impl=pallas on Tesla T4: attn_impl='pallas' needs "
                                     "a GPU of compute capability 8.0 (Ampere) or newer"),
        (["model.attn_impl=cudnn"], "this one is sm75; use 'auto', 'blockwise' or 'xla'"),
        (["model.attn_impl=xla", "model.dtype=bfloat16"], "does not compile for sm75"),
    ]
    results = _aot_commands(tmp_path, *(["--config", COLAB, "--target", "t4-16gb", "--hosts", "1",
                                          "--gpus-per-host", "1", *extra] for extra, _ in cases))
    _one_line_exit_2(results, cases)


@WHOLE_TIER
@pytest.mark.slow
def test_adaptive_layouts_each_compile_for_the_gpus_and_fit(reports):
    """The shipped adaptive config (the 8B at 16K, B=1): every layout of its set compiled for
    2 x 4 A100-40GB and fitting, the all-to-alls of (1,8) across the hosts and of every other
    layout inside one (none at all for (8,1)), the same tokens per device in each."""
    r = reports[CONFIG_ADAPTIVE]
    rows = r["adaptive_layouts"]
    assert [(x["groups"], x["sp"], x["batch"], x["seq_len"]) for x in rows] == \
        [(1, 8, 1, 16384), (2, 4, 2, 8192), (4, 2, 4, 4096), (8, 1, 8, 2048)]
    assert r["fits"] and all(x["fits"] for x in rows)
    assert rows[0]["a2a_inter_host_bytes"] > 0
    assert all(x["a2a_inter_host_bytes"] == 0 for x in rows[1:])
    assert rows[1]["a2a_bytes"] >= rows[2]["a2a_bytes"] > 0 == rows[3]["a2a_bytes"]
    # the memory bound is the static layout's: the same tokens per device
    assert max(x["peak_bytes_per_device"] for x in rows) <= 1.05 * rows[0]["peak_bytes_per_device"]
    assert "adaptive layouts (parallel.mode=adaptive), each compiled:" in aot_report.format_report(r)


# model.fp8 on a small model of Llama-3.2-1B's head counts (2 layers, 4K tokens) for 8 H100s:
# the projections' FP8 GEMMs (the 8B's are counted in BENCHMARKS.md section 11)
FP8_SMALL = ["--config", "configs/gpu/llama-3.2-1b_basp.yaml", "model.fp8=true",
             "model.shape={num_layers: 2, hidden_size: 512, intermediate_size: 1024, head_dim: 64, "
             "vocab_size: 8192}", "data.seq_len=4096", "parallel.devices_per_host=8",
             "--hosts", "1", "--gpus-per-host", "8"]


@WHOLE_TIER
@pytest.mark.slow
def test_fp8_projections_compile_to_fp8_gemms_forward_and_backward(cuda_plugin, tmp_path):
    """7 projections per layer, each an FP8 GEMM forward and two backward (remat=dots keeps the
    forward's): 21 per layer. Compiled without a GPU XLA cannot autotune and picks its Triton GEMM
    fusions. (With those off, `--xla_gpu_enable_triton_gemm=false` as MaxText's GPU recipes set,
    the same dots become cuBLASLt's FP8 matmul: BENCHMARKS.md section 11 counts both.)"""
    done = _run("-m", "train.tools.aot", *FP8_SMALL, "--target", "h100-80gb", "--json",
                str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    gemms, layers = r["fp8_gemms"], r["model"]["num_layers"]
    assert r["fp8"] and gemms["total"] >= 21 * layers, gemms
    assert gemms["fusion"] >= 21 * layers, gemms
    assert "FP8 GEMMs" in done.stdout


@pytest.mark.slow
def test_the_default_step_runs_no_fp8_gemm(basp_8b):
    assert basp_8b["report"]["fp8"] is False and basp_8b["report"]["fp8_gemms"]["total"] == 0


@pytest.mark.slow
def test_fp8_without_fp8_tensor_cores_is_one_line_before_compiling(cuda_plugin, tmp_path):
    cases = [(["--target", target], "model.fp8") for target in ("a100-40gb", "t4-16gb")]
    results = _aot_commands(tmp_path, *([*FP8_SMALL, *extra] for extra, _ in cases))
    _one_line_exit_2(results, cases)


@WHOLE_TIER
@pytest.mark.parametrize("target,ring,order", [("a100-40gb", 2, "contiguous"),
                                                ("h100-80gb", 4, "zigzag")])
def test_every_ring_hop_runs_a_fused_kernel(cuda_plugin, target, ring, order):
    """Ring attention on packed documents compiled for a GPU: every hop off the diagonal runs
    cuDNN's kernels (forward and backward; basp_jax.ring_hops), the diagonal with documents our
    Pallas/Triton kernel (the packed layout's statistics are [rows x bound, heads, S], not per query), and no
    attention runs as an XLA while-loop."""
    done = _run("tests/e2e/flash_gpu_worker.py", target, str(ring), order, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    kernels, hops = found["kernels"], found["hops"]
    assert set(kernels) == {"cudnn", "triton"}, kernels
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= \
        set(kernels["cudnn"]["targets"]), kernels
    assert {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"} <= \
        set(kernels["triton"]["targets"]), kernels
    assert set(hops) == {"diagonal", "off_diagonal"}, hops
    assert set(hops["diagonal"]) == {"triton"} and set(hops["off_diagonal"]) == {"cudnn"}, hops


@pytest.fixture(scope="session")
def moe_steps(cuda_plugin, tmp_path_factory):
    """Qwen3-30B-A3B's and Qwen3.5-35B-A3B's BASP steps on 2 x 8 H100 (the shipped configs),
    with the GPU defaults, compiled in one process: {config: report}."""
    out = tmp_path_factory.mktemp("aot") / "moe.json"
    done = _run("tests/e2e/aot_worker.py", str(out), CONFIG_MOE, CONFIG_MOE_HYBRID)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["case"]: r for r in json.loads(out.read_text())}


@WHOLE_TIER
# (config, the parameters' bytes that cross hosts per GPU per step at most, the planner's
# memory against the compiled peak at most: the hybrid's under-counts, docs/limitations.md)
@pytest.mark.parametrize("case,crossing_gib,formula_off", [
    (CONFIG_MOE, 8, 0.15), (CONFIG_MOE_HYBRID, 9, 0.25)])
def test_the_moe_step_fits_with_experts_and_all_to_alls_inside_the_hosts(
        moe_steps, case, crossing_gib, formula_off):
    """One BASP group per host: the experts split over its 8 GPUs (16 or 32 each), the routed
    tokens' gathers and scatters and the attention (and the Gated DeltaNet's) all-to-alls run
    inside the host; only the staged parameters and their gradients cross, under 8-9 GiB per
    GPU per step (BENCHMARKS.md section 6: Ulysses sends about 124 GiB for the 30B). The
    experts run as our grouped-matmul kernels, forward and backward (12 per layer,
    recomputed forward included), no ragged_dot's dense loop."""
    r = moe_steps[case]
    assert r["fits"], r["peak_bytes_per_device"] / GiB
    assert r["expert_kernels"] == {"triton": {
        "count": 12 * r["model"]["num_layers"],
        "targets": ["grouped_matmul", "grouped_matmul_rhs_grad"]}}, r["expert_kernels"]
    # attention (head_dim 128 and 256) on cuDNN's packed layout, our kernel its fallback only
    assert set(r["attention_kernels"]) == {"cudnn", hlo.KERNEL_TRITON_FALLBACK}, \
        r["attention_kernels"]
    # the experts' token exchanges, listed apart: inside the host, 3 all-gathers (forward,
    # recomputed, backward) and 2 reduce-scatters per layer, as the planner prices them
    experts = {c["kind"]: c for c in r["expert_collectives"]}
    assert set(experts) == {"all-gather", "reduce-scatter"}, r["expert_collectives"]
    assert (experts["all-gather"]["per_layer"], experts["reduce-scatter"]["per_layer"]) == (3, 2)
    assert all(c["group_size"] == 8 and c["inter_host_wire_bytes"] == 0
               for c in experts.values())
    # the planner's MoE terms (the routed rows, the experts split over the group)
    assert abs(r["formula_memory_bytes"] / r["peak_bytes_per_device"] - 1) <= formula_off
    assert (r["layout"]["groups"], r["layout"]["sp"], r["hosts"]) == (2, 8, 2)
    rows = r["collectives"]
    assert sum(c["count"] for c in rows if c["kind"] == "all-to-all") > 0
    assert all(c["inter_host_wire_bytes"] == 0 for c in rows
               if c["kind"] in ("all-to-all", "collective-permute") and c["bytes"] > 2**20), rows
    crossing = sum(c["inter_host_wire_bytes"] for c in rows)
    assert 0 < crossing <= crossing_gib * GiB, crossing / GiB
    # the gathers that cross hosts are the staged layers' (groups of 2: one GPU per host); the
    # others that do are small parameters' gradient sums (the Gated DeltaNet's conv weights are
    # replicated: 3 per period in one all-reduce of 192 KiB)
    assert all(c["group_size"] == 2 for c in rows
               if c["inter_host_wire_bytes"] / c["count"] > 2**20), rows
