"""Train steps of the trainer's own compiled program on one device, on a fixed random batch:
step time, tokens/s, MFU, peak memory against the compiled prediction, a profile of a few more
steps; and the step after an asynchronous checkpoint save against the median step."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from .common import GiB, ROOT, Shapes, skip


def step_config(shapes: Shapes, steps: int, run_dir: str, seq: int | None = None,
                fp8: bool = False, preset: str | None = None, layers: int | None = None):
    """configs/gpu/llama-3.2-1b_basp.yaml on one device, synthetic data (nothing to download);
    fp8: the layers' projections as FP8 GEMMs (model.fp8); preset/layers: another model's
    shape, cut to its first `layers` layers (model.shape)."""
    from train.config.schema import load_config

    overrides = [
        f"run.dir={run_dir}", f"model.preset={preset or shapes.preset}",
        f"model.dtype={shapes.dtype}", "data.source=synthetic", "data.path=null",
        "data.pack=false", "data.eos_id=null", f"data.seq_len={seq or shapes.step_seq}",
        f"train.steps={steps}", "train.microbatch_size=1", "train.grad_accum=1",
        "parallel.devices_per_host=1", "runtime.devices=1", "runtime.platform=auto",
        "runtime.cpu_devices=1", "metrics.progress=false", f"model.fp8={str(fp8).lower()}"]
    if layers:
        overrides.append(f"model.shape={{num_layers: {layers}}}")
    return load_config(str(ROOT / "configs" / "gpu" / "llama-3.2-1b_basp.yaml"), overrides)


class Run:
    """A compiled train step with its state and a fixed batch: step() runs one, advancing it."""

    def __init__(self, cfg, mcfg, program, compiled, params, opt_state, compile_s: float):
        import jax
        import numpy as np

        self.cfg, self.mcfg, self.program, self.compiled = cfg, mcfg, program, compiled
        self.params, self.opt_state, self.compile_s = params, opt_state, compile_s
        self.steps_run = 0
        tokens = np.random.default_rng(0).integers(0, mcfg.vocab_size, size=program.batch_shape,
                                                   dtype=np.int32)
        self.batch = {"tokens": jax.device_put(tokens, program.batch_sharding),
                      "targets": jax.device_put(np.roll(tokens, -1, axis=-1),
                                                program.batch_sharding)}

    def step(self, after_dispatch=None) -> tuple[float, float]:
        """(seconds, loss) of one step, waited for; `after_dispatch` runs once it is dispatched
        (as the train loop saves a copy of the state while the next step runs)."""
        import jax

        t = time.perf_counter()
        self.params, self.opt_state, metrics = self.compiled(
            self.params, self.opt_state, self.batch, self.program.step_index(self.steps_run))
        if after_dispatch is not None:
            after_dispatch()
        loss = float(jax.device_get(metrics["loss"]))
        self.steps_run += 1
        return time.perf_counter() - t, loss


def _fitting_config(shapes: Shapes, steps: int, on_gpu: bool, run_dir: str, seq, fp8, preset,
                    layers):
    """The config at `seq`, or at the largest of shapes.step_seq and its halves that fits."""
    from train.loop import model_config, select_devices
    from train.program import planning

    cfg = step_config(shapes, steps, run_dir, seq, fp8, preset, layers)
    mcfg = model_config(cfg)
    devices = select_devices(cfg)
    limit = planning.device_memory(devices[0]) if on_gpu and seq is None else None
    while limit and cfg.data.seq_len > 2048 and planning.memory_estimate(
            cfg, mcfg, *planning.plan(cfg, mcfg, 1, 1))[0] > 0.9 * limit:
        # one GPU holds all 1.24B parameters and their Adam state: 16K tokens need ~40 GB
        cfg = step_config(shapes, steps, run_dir, cfg.data.seq_len // 2, fp8, preset, layers)
        print(f"  {devices[0].device_kind}: {limit / GiB:.0f} GiB usable, so "
              f"{cfg.data.seq_len} tokens instead of {shapes.step_seq}", flush=True)
    return planning.resolve_offload(cfg, mcfg, 1, 1), mcfg, devices  # offload=auto decided


def compile_run(shapes: Shapes, steps: int, on_gpu: bool, fp8: bool = False,
                seq: int | None = None, preset: str | None = None,
                layers: int | None = None) -> Run:
    """Compile the trainer's step (train.program.state) for one device; nothing is written."""
    from train.program import compile_fallback
    from train.program.state import build_program, model_factory, plan_run
    from train.program.step import build_model, init_opt_state

    run_dir = os.path.join(tempfile.gettempdir(), "gpu-check-run")  # required; never written
    cfg, mcfg, devices = _fitting_config(shapes, steps, on_gpu, run_dir, seq, fp8, preset, layers)
    plan = plan_run(cfg, mcfg, devices, 1)
    parts = build_model(model_factory(cfg, mcfg, plan), plan.rules, init_params=True)
    program = build_program(cfg, plan, parts)
    params = parts.params
    opt_state = init_opt_state(program.tx, params, program.opt_shardings)
    t0 = time.perf_counter()
    # a cuDNN refusal at compile time: the trainer's fallback, noted (_attention_kernel says so)
    program, compiled = compile_fallback.compile_step(program, params, opt_state, print)
    return Run(cfg, mcfg, program, compiled, params, opt_state, time.perf_counter() - t0)


def _attention_kernel(run: Run, on_gpu: bool) -> str:
    """The kernel model.attn_impl runs in this step (auto resolved as the trainer resolves it)."""
    import jax
    import jax.numpy as jnp

    from basp_jax import cudnn_call
    from basp_jax.kernels import resolve_impl

    from .common import capability

    s, seq = run.mcfg.shape, run.cfg.data.seq_len
    q = jax.ShapeDtypeStruct((1, seq, s.num_heads, s.head_dim), jnp.dtype(run.cfg.model.dtype))
    impl = resolve_impl(run.cfg.model.attn_impl, q, seq, "gpu" if on_gpu else "cpu",
                        bool(run.cfg.data.pack), capability(on_gpu))
    if impl == "cudnn" and cudnn_call.compile_refusal():  # train.program.compile_fallback
        return f"pallas (XLA could not compile cuDNN's: {cudnn_call.compile_refusal()})"
    return impl


def _memory(run: Run, on_gpu: bool, out: dict) -> None:
    """The compiled program's peak prediction beside the device's measured peak."""
    import jax

    mem = run.compiled.memory_analysis()
    predicted = (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
                 - mem.alias_size_in_bytes) if mem is not None else None
    stats = jax.devices()[0].memory_stats() if on_gpu else None
    measured = stats.get("peak_bytes_in_use") if stats else None
    out.update(predicted_peak_bytes=predicted, measured_peak_bytes=measured)
    if predicted is not None:
        print(f"  memory: compiled prediction {predicted / GiB:.2f} GiB", end="", flush=True)
    if measured is not None:
        print(f", measured peak {measured / GiB:.2f} GiB (device.memory_stats)", flush=True)
        return
    print("", flush=True)
    out["measured_peak_reason"] = skip(
        "--cpu-smoke: CPU devices keep no memory statistics" if not on_gpu
        else "this device reports no peak_bytes_in_use")["reason"]


def measure(run: Run, steps: int, on_gpu: bool, label: str) -> dict:
    """`steps` steps: the median of all but the first (which also transfers and warms up)."""
    import jax
    import numpy as np

    from train.observe.metrics import peak_flops

    times, losses = zip(*(run.step() for _ in range(steps)))
    step_s = statistics.median(times[1:] or times)
    tokens_per_s = float(np.prod(run.program.batch_shape) / step_s)
    kind = jax.devices()[0].device_kind
    peak, _ = peak_flops(run.cfg.metrics, kind)  # (FLOP/s or None, log line)
    seq = run.cfg.data.seq_len
    mfu = run.mcfg.shape.train_flops_per_token(seq) * tokens_per_s / peak if peak else None
    out = {"status": "ok" if all(np.isfinite(losses)) else "failed", "fp8": run.cfg.model.fp8,
           "model": f"{label} ({_count(run.mcfg.num_params())} params)",
           "num_layers": run.mcfg.num_layers, "seq_len": seq,
           "attn_impl": run.cfg.model.attn_impl, "attn_kernel": _attention_kernel(run, on_gpu),
           "remat": run.cfg.model.remat, "compile_s": run.compile_s, "step_times_s": list(times),
           "step_s": step_s, "tokens_per_s": tokens_per_s, "peak_flops": peak, "mfu": mfu,
           "losses": list(losses)}
    print(f"  {out['model']}, {seq} tokens: compiled in {run.compile_s:.1f} s; step "
          f"{step_s:.3f} s, {tokens_per_s:,.0f} tokens/s, MFU "
          + (f"{mfu:.1%}" if mfu is not None else f"unknown (no peak FLOP/s for {kind!r})")
          + f"; loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    _memory(run, on_gpu, out)
    return out


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def with_profile(run: Run, out: dict, steps: int, on_gpu: bool) -> None:
    """`steps` more steps under jax.profiler, summarised into out["profile"]; a trace that
    fails is recorded there, not as the steps' failure."""
    from .common import failed
    from .profiling import profile_steps

    try:
        out["profile"] = profile_steps(run.step, steps, on_gpu)
    except Exception as e:  # noqa: BLE001
        out["profile"] = failed(e)


def train_steps(shapes: Shapes, steps: int, on_gpu: bool, keep: list | None = None, *,
                fp8: bool = False, seq: int | None = None, preset: str | None = None,
                layers: int | None = None, profile: bool = True) -> dict:
    """Compile, run `steps` timed steps and profile a few more; keep: a list the Run is
    appended to, for a later section (the checkpoint's) to go on from."""
    run = compile_run(shapes, steps, on_gpu, fp8, seq, preset, layers)
    label = (preset or shapes.preset) + (f", {layers} layers" if layers else "")
    out = measure(run, steps, on_gpu, label)
    if profile:
        with_profile(run, out, shapes.profile_steps, on_gpu)
    if keep is not None:
        keep.append(run)
    return out


def train_steps_fp8(shapes: Shapes, steps: int, on_gpu: bool, bf16: dict) -> dict:
    """The same steps with FP8 projections (model.fp8=true), at the bf16 run's length: the step
    time against it, and the FP8 GEMMs in the compiled program (basp_jax.compiled.hlo, as
    train.tools.gpu_compile counts them), which must not be zero on an FP8 GPU. Before sm89
    skipped; on the CPU (--cpu-smoke) XLA emulates FP8, which checks the path, not its speed."""
    import jax

    from basp_jax.compiled import hlo

    from .common import capability

    if bf16.get("status") != "ok":
        return skip("the bf16 train steps did not run")
    cap = capability(on_gpu)
    if on_gpu and (cap is None or cap < (8, 9)):
        return skip(f"{jax.devices()[0].device_kind} has no FP8 tensor cores (sm89+)")
    run = compile_run(shapes, steps, on_gpu, fp8=True, seq=bf16["seq_len"])
    gemms = hlo.fp8_gemms(run.compiled.as_text())
    out = measure(run, steps, on_gpu, shapes.preset)
    out["fp8_gemms"] = gemms
    out["speedup_vs_bf16"] = bf16["step_s"] / out["step_s"]
    drift = abs(out["losses"][-1] - bf16["losses"][-1]) / abs(bf16["losses"][-1])
    out["final_loss_drift"] = drift
    print(f"  FP8 step {out['step_s']:.3f} s against bf16's {bf16['step_s']:.3f} s: "
          f"{out['speedup_vs_bf16']:.2f}x; final loss {drift:.2%} from bf16's; FP8 GEMMs per "
          f"step: {gemms['total']} ({gemms['cublaslt']} cuBLASLt, {gemms['fusion']} fusions)",
          flush=True)
    if on_gpu and gemms["total"] == 0:
        out["status"] = "failed"
        out["error"] = "model.fp8=true compiled to no FP8 GEMM on a GPU with FP8 tensor cores"
        print(f"  FAILED: {out['error']}", flush=True)
    return out


def step_after_save(runs: list, median_s: float | None, more_steps: int = 2) -> dict:
    """Save the state with the trainer's Checkpointer (train/checkpoint/store.py) after the
    steps run so far, both ways the loop can (checkpoint.copy_on_device), and time the next step
    against the median step: what a save stalls a run by.
    - "host": orbax's save of the state itself; it returns once the state is in host memory,
      and only then can the next step, which donates that state, be dispatched.
    - "device": the state copied on the device (train.checkpoint.snapshot), the next step
      dispatched, then the copy saved in a thread while that step runs.
    The `more_steps` steps after run while the write goes on; then it is waited for and
    deleted."""
    if not runs or median_s is None:
        return skip("the bf16 train steps did not run")
    out = {"status": "ok", "median_step_s": median_s}
    for way in ("host", "device"):
        out[way] = _one_save(runs[0], median_s, way, more_steps)
    return out


def _one_save(run, median_s: float, way: str, more_steps: int) -> dict:
    import shutil

    import jax

    from train.checkpoint import snapshot
    from train.checkpoint.store import Checkpointer
    from train.config.schema import CheckpointConfig

    k = run.steps_run
    directory = tempfile.mkdtemp(prefix="gpu-check-ckpt-")
    try:
        ckpt = Checkpointer(directory, CheckpointConfig(every=0, keep=1, async_save=True),
                            total_steps=k + 1 + more_steps)
        t0 = time.perf_counter()
        if way == "host":
            ckpt.save(k, run.params, run.opt_state, {"step": k}, force=True)
            save_call = time.perf_counter() - t0
            after, _ = run.step()
        else:
            copy = snapshot.copy_state(run.params, run.opt_state)
            jax.block_until_ready(copy)  # (the first call compiles the copy)
            copy_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            after, _ = run.step(after_dispatch=lambda: ckpt.save(
                k, *copy, {"step": k}, force=True, background=True))
            save_call = copy_s
            del copy
        later = [run.step()[0] for _ in range(more_steps)]
        t0 = time.perf_counter()
        ckpt.close()  # waits for the write
        wait = time.perf_counter() - t0
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory)
                   for f in files)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out = {"saved_after_step": k, "save_call_s": save_call, "step_after_save_s": after,
           "ratio": after / median_s, "later_steps_s": later, "wait_for_write_s": wait,
           "checkpoint_bytes": size}
    what = "save() returned" if way == "host" else "the copy on the device took"
    print(f"  {way}: {what} {save_call:.2f} s; the next step took {after:.3f} s against the "
          f"median {median_s:.3f} s ({after / median_s:.2f}x), the two after it "
          + ", ".join(f"{t:.3f}" for t in later) + f" s; the write ({size / GiB:.2f} GiB) "
          f"finished {wait:.1f} s later", flush=True)
    return out
