"""scripts/gpu_check.sh (benchmarks/gpu_check/) on the CPU: --cpu-smoke runs every section on
tiny shapes, and says which GPU-only parts it skipped and why; a run stopped at its time limit
keeps the sections that finished; without the flag and without a GPU it stops with one line
instead of checking nothing. And the profile summary's parser, on synthetic traces."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from basp_jax.planner import calibration
from benchmarks import calibrate
from benchmarks.gpu_check import attention_check, attention_time, gemm, profiling
from benchmarks.gpu_check import experts as gm_experts
from benchmarks.gpu_check.common import Shapes
from tests.helpers.flags import ONE_PASS, TEST_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[2]
SMOKE = Shapes(smoke=True)
CUDNN_OFF = "--cpu-smoke: impl='cudnn' needs a GPU but the mesh is on cpu; use 'auto'"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    # the suite's CPU code generation (tests/helpers/flags.py): tiny programs, compiled faster
    return {**env, "PYTHON": sys.executable, "XLA_FLAGS": TEST_XLA_FLAGS, **extra}


def _smoke(out, *extra, timeout=900, **env):
    return subprocess.run(["bash", "scripts/gpu_check.sh", str(out), "--cpu-smoke", "--steps", "2",
                           "--repeats", "1", *extra], cwd=ROOT, capture_output=True,
                          env=_env(**env), text=True, timeout=timeout)


def _check_kernels(r):
    kernels = r["kernels"]
    assert list(kernels) == [name for name, *_ in attention_check.kernel_cases(SMOKE)]
    for name, row in kernels.items():
        if name.endswith("float16"):  # skipped, visibly and with the reason
            assert row["status"] == "skipped" and "float16 is checked on a GPU" in row["reason"]
        elif name.startswith("cudnn"):
            assert row == {"status": "skipped", "reason": CUDNN_OFF}
        else:
            assert row["status"] == "ok", (name, row)
            assert set(row["errors"]) == {"out", "dq", "dk", "dv"}
            assert max(row["errors"].values()) <= row["tolerance"]
            assert row["documents"] in SMOKE.documents and row["head_dim"] == 16
    ring = r["ring"]  # a ring of 2 (its hops blockwise on the CPU) against the same reference
    assert list(ring) == [name for name, *_ in attention_check.ring_cases(SMOKE)]
    # the hops attention() runs ("auto": blockwise here) checked; all-Pallas hops on a GPU only
    assert {row["status"] for name, row in ring.items()
            if name.endswith("float32") and "auto hops" in name} == {"ok"}
    assert all(row["status"] == "skipped" and "Pallas hops in interpret mode" in row["reason"]
               for name, row in ring.items() if "pallas hops" in name and "float32" in name)
    assert all(row["hop_kernel"] == "blockwise" and max(row["errors"].values()) <= 1e-4
               for row in ring.values() if row["status"] == "ok")
    assert {row["documents"] for row in ring.values() if row["status"] == "ok"} == {0, 4}


def _check_timing(r):
    timing = r["timing"]  # ours against cuDNN and JAX's own Pallas kernel (interpreted here)
    names = [c[0] for seq in (256, 512) for c in attention_time.timing_cases(SMOKE, seq)]
    assert list(timing) == names and "xla, 256 tokens" in names
    upstream = importlib.util.find_spec("jax.experimental.pallas.ops.gpu.attention") is not None
    for name, row in timing.items():
        impl, docs = name.split(", ")[0], "documents" in name
        runs = (impl in ("pallas", "blockwise") if docs else impl != "cudnn") and not (
            impl == "upstream pallas" and not upstream)
        if not runs:
            assert row["status"] == "skipped" and row["reason"], (name, row)
            continue
        assert row["status"] == "ok" and row["median_s"] > 0, (name, row)
        seq = row["seq_len"]
        # packed: the documents' causal work only
        assert row["causal_pairs"] < seq * seq / 2 if docs else row["causal_pairs"] == seq**2 / 2
    assert timing["cudnn, 256 tokens"]["reason"] == CUDNN_OFF
    if not upstream:  # jax 0.12.1 dropped its Triton Pallas examples: skipped, saying so
        assert timing["upstream pallas, 256 tokens"]["reason"] == (
            f"jax {jax.__version__} ships no jax.experimental.pallas.ops.gpu.attention")
    rows = r["gemm"]
    assert list(rows) == [c[0] for c in gemm.gemm_cases(SMOKE)] and len(rows) == 18
    assert all(row["status"] == "ok" and row["tflops"] > 0 and row["m"] == 256
               for row in rows.values())
    tiles = r["pallas tiles"]  # our kernel's tiles, the GPU's first (interpreted here)
    assert list(tiles) == [c[0] for c in attention_time.tile_cases(SMOKE, 256)]
    assert len(tiles) == 2 and "this GPU's tiles" in next(iter(tiles))
    assert all(row["status"] == "ok" and row["median_s"] > 0 and row["head_dim"] == 16
               and row["tiles"].startswith("tiles ") for row in tiles.values()), tiles
    assert len({row["tiles"] for row in tiles.values()}) == 2
    experts = r["experts"]  # the grouped matmuls: ours (interpreted) and ragged_dot
    assert list(experts) == [c[0] for c in gm_experts.expert_cases(SMOKE)] and len(experts) == 4
    for row in experts.values():
        assert row["status"] == "ok" and max(row["errors"].values()) < 1e-4, row
        assert row["fwd"]["tflops"] > 0 and row["fwd_bwd"]["median_s"] > 0


def _check_profile(profile):
    assert profile["status"] == "ok" and profile["source"].startswith("host"), profile
    assert set(profile["by_category_s_per_step"]) == set(profiling.CATEGORIES)
    assert profile["busy_s_per_step"] > 0 and 0 < len(profile["top_ops"]) <= 10


def _check_steps(r):
    train = r["train"]
    assert train["status"] == "ok" and len(train["losses"]) == 2 and train["step_s"] > 0
    assert train["tokens_per_s"] > 0 and train["predicted_peak_bytes"] > 0
    assert train["mfu"] is None  # no peak FLOP/s for a CPU
    assert train["measured_peak_bytes"] is None and train["attn_kernel"] == "xla"
    assert "CPU devices keep no memory statistics" in train["measured_peak_reason"]
    _check_profile(train["profile"])
    ckpt = r["checkpoint"]
    assert ckpt["status"] == "ok"
    host, device = ckpt["host"], ckpt["device"]  # the state itself saved; a device copy
    assert host["saved_after_step"] == 4 and device["saved_after_step"] == 7  # 2 timed, 2
    # profiled; the host save's next step and 2 more
    for way in (host, device):
        assert way["step_after_save_s"] > 0 and way["checkpoint_bytes"] > 0 and way["ratio"] > 0
    assert abs(device["checkpoint_bytes"] / host["checkpoint_bytes"] - 1) < 0.05  # same state
    big = r["train_8b"]
    assert big["status"] == "ok" and big["num_layers"] == 2 and big["model"].startswith("tiny, 2")
    _check_profile(big["profile"])
    fp8 = r["train_fp8"]  # emulated by XLA on the CPU: the path runs, its speed means nothing
    assert fp8["status"] == "ok" and fp8["fp8"] and not train["fp8"], fp8
    assert fp8["seq_len"] == train["seq_len"] and fp8["speedup_vs_bf16"] > 0
    assert fp8["final_loss_drift"] < 0.05  # 2 steps of the tiny model: FP8 rounding only
    assert set(fp8["fp8_gemms"]) == {"cublaslt", "fusion", "total"}
    cal = r["calibration"]  # fitted to the check's own step: only remat=dots known
    assert cal["status"] == "ok" and cal["target"] == "cpu-smoke", cal
    assert cal["calibration"]["remat_factor"] == {"dots": 1.0}
    assert cal["calibration"]["dense_flops_per_s"] > 0
    assert {"xla", "pallas", "blockwise"} <= set(cal["calibration"]["attention_flops_per_s"])


@pytest.mark.slow
@ONE_PASS
def test_the_script_runs_every_section_and_names_what_it_skipped(tmp_path):
    out = tmp_path / "check.json"
    proc = _smoke(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["mode"] == "cpu-smoke" and r["failed"] == []
    env = r["environment"]
    assert env["platform"] == "cpu" and env["versions"]["jax"] and env["python"]
    _check_kernels(r)
    _check_timing(r)
    _check_steps(r)
    assert "0 failed" in proc.stdout and f"wrote {out}" in proc.stdout


@pytest.mark.slow
@ONE_PASS
def test_a_run_stopped_at_its_time_limit_keeps_the_sections_that_finished(tmp_path):
    out = tmp_path / "check.json"
    proc = _smoke(out, timeout=300, GPU_CHECK_TIMEOUT_S="15")
    assert proc.returncode == 124, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stopped at the 15 s limit" in proc.stderr
    r = json.loads(out.read_text())  # whole: replaced after each case, never written over
    assert r["environment"]["platform"] == "cpu" and "failed" not in r
    finished = [k for k in proc.stdout.splitlines() if not k.startswith(" ")]
    assert len(finished) >= 3, proc.stdout
    for part in ("train", "checkpoint"):
        assert part not in r or r[part]["status"] in ("ok", "skipped")


def test_sections_past_the_budget_are_skipped_saying_so(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--cpu-smoke",
                           "--budget-s", "0", "--out", str(out)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    rows = [r[k] for k in ("train", "checkpoint", "train_8b", "train_fp8", "calibration")]
    rows += [row for k in ("kernels", "ring", "timing", "gemm", "experts")
             for row in r[k].values()]
    assert all(row["status"] == "skipped" and row["reason"].startswith("out of time: 0 s of the "
                                                                        "check's 0 s left")
               for row in rows), rows
    assert r["failed"] == [] and r["budget"]["limit_s"] == 0


def test_without_a_gpu_and_without_the_flag_it_stops_with_one_line(tmp_path):
    env = {k: v for k, v in _env().items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out",
                           str(tmp_path / "x.json")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "no GPU visible to JAX" in lines[0] and "--cpu-smoke" in lines[0]
    assert not (tmp_path / "x.json").exists()


# ---------------------------------------------------------------------------- the trace parser

def _meta(pid, tid, kind, name):
    return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}


def _span(pid, tid, name, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def test_the_profile_summary_reads_a_gpus_stream_kernels_by_kind_of_work():
    gpu, host = 1, 2
    events = [_meta(gpu, None, "process_name", "/device:GPU:0"),
              _meta(host, None, "process_name", "/host:CPU"),
              _meta(gpu, 7, "thread_name", "Stream #7(Compute)"),
              _meta(gpu, 8, "thread_name", "Stream #8(Nccl)"),
              _meta(gpu, 9, "thread_name", "XLA Ops"),  # the same time again, by HLO op
              _meta(host, 1, "thread_name", "python")]
    kernels = [("nvjet_tst_128x256_64x4_2x1_v_bz_TNT", 400, {"hlo_op": "cublas-gemm.3"}),
               ("cudnn_generated_fort_native_sdpa_sm90_knob_7", 200, {}),
               ("flash_attention_fwd", 100, {"hlo_op": "custom-call.9"}),
               ("loop_multiply_fusion_2", 60, {"tf_op": "jit(step)/optimizer/mul"}),
               ("input_reduce_fusion", 50, {}),
               ("Memcpy DtoD", 30, {}),
               ("mystery_kernel", 10, {})]
    ts = 0
    for name, dur, args in kernels * 2:  # two steps
        events.append(_span(gpu, 7, name, ts, dur, **args))
        events.append(_span(gpu, 9, "fusion.1", ts, dur))
        ts += dur
    events.append(_span(gpu, 8, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 150))
    events.append(_span(host, 1, "PjitFunction(step)", 0, 5000))
    s = profiling.summarize({"traceEvents": events}, steps=2)
    assert s["source"] == "device streams" and s["steps"] == 2
    assert s["threads"] == ["Stream #7(Compute)", "Stream #8(Nccl)"]
    per_step = {k: round(v * 1e6, 3) for k, v in s["by_category_s_per_step"].items()}
    assert per_step == {"matmul": 400, "attention": 300, "fusion": 50, "collective": 75,
                        "copy": 30, "optimizer": 60, "other": 10}
    assert s["busy_s_per_step"] * 1e6 == pytest.approx(925)
    top = s["top_ops"]
    assert [t["name"] for t in top[:2]] == ["nvjet_tst_128x256_64x4_2x1_v_bz_TNT",
                                            "cudnn_generated_fort_native_sdpa_sm90_knob_7"]
    assert top[0]["calls_per_step"] == 1 and top[0]["share"] == pytest.approx(400 / 925)
    assert len(top) == 8 and s["sample_events"][0]["args"] == {"hlo_op": "cublas-gemm.3"}


def test_the_profile_summary_of_a_cpu_trace_counts_host_self_time_and_never_crashes():
    host = 3
    events = [_meta(host, None, "process_name", "/host:CPU"),
              _meta(host, 1, "thread_name", "python"),
              _meta(host, 2, "thread_name", "tf_XLAEigen/123"),
              _span(host, 1, "$train.py:10 step", 0, 1000),  # Python's frames: not counted
              _span(host, 2, "ThunkExecutor::Execute", 0, 100),
              _span(host, 2, "ynn_fusion", 10, 30),  # nested: the parent keeps its self time
              _span(host, 2, "dot.3", 50, 20),
              {"ph": "X", "pid": host, "tid": 2, "name": "no duration"}, "not an event"]
    s = profiling.summarize({"traceEvents": events}, steps=1)
    assert s["source"].startswith("host") and s["threads"] == ["tf_XLAEigen/123"]
    per_step = {k: round(v * 1e6, 3) for k, v in s["by_category_s_per_step"].items() if v}
    assert per_step == {"other": 50, "fusion": 30, "matmul": 20}
    for empty in ({}, {"traceEvents": []}, {"traceEvents": [{"ph": "X", "dur": "?"}]},
                  {"traceEvents": [{"ph": "X", "dur": 1, "ts": "late"},
                                   {"ph": "M", "name": "thread_name", "args": "?"}]}):
        s = profiling.summarize(empty, steps=0)
        assert s["status"] == "ok" and s["events"] == 0 and s["top_ops"] == []


# ---------------------------------------------------------------------------- the calibration

def test_the_calibration_fits_the_checks_own_step_without_a_remat_sweep(capsys):
    """What the check writes as its candidate: the H200's check alone, no sweep. Only remat=dots
    is measured, so the dense rate includes its recomputation (below the sweep's fit)."""
    path = ROOT / "bench/gpu_check/h200/gpu_check.json"
    check = json.loads(path.read_text())
    fitted = calibrate.fit(check, None, "h200-141gb", "test")
    shipped = calibration.for_target("h200-141gb")  # fitted with the sweep
    assert fitted.remat_factor == {"dots": 1.0}
    assert fitted.attention_flops_per_s == shipped.attention_flops_per_s
    dense, attention, _ = calibrate.step_work("llama-3.2-1b", 16384)
    assert fitted.dense_flops_per_s == pytest.approx(
        dense / (check["train"]["step_s"] - attention / shipped.attention_flops_per_s["cudnn"]))
    assert 0.95 * shipped.dense_flops_per_s < fitted.dense_flops_per_s < shipped.dense_flops_per_s
    assert fitted.fp8_dense_flops_per_s > fitted.dense_flops_per_s
    assert calibrate.main([str(path), "--target", "h200-141gb"]) == 0
    out = capsys.readouterr().out
    assert "no remat sweep (remat=dots only)" in out and "0.671" in out
