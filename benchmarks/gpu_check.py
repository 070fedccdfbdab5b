"""Check one GPU in a few minutes: versions and device, a few train steps of a Llama-3.2-1B-shaped
model at 16K tokens (step time, tokens/s, MFU, peak memory measured against the compiled
program's prediction), the same steps with FP8 projections where the GPU has FP8 tensor cores
(their step time against bf16's), every attention kernel against a float32 reference (forward and
gradients, packed and not), and fwd+bwd attention time per kernel at 16K and 64K tokens, with
JAX's own Pallas flash attention (jax.experimental.pallas.ops.gpu.attention) beside ours. Writes
everything as JSON, after each section.

    python -m benchmarks.gpu_check --out gpu_check.json          # on a GPU (scripts/gpu_check.sh)
    python -m benchmarks.gpu_check --cpu-smoke --out smoke.json  # the same code on the CPU with
                                                                 # tiny shapes (tests)

--cpu-smoke is the only way to run without a GPU: it shrinks every shape and skips what only a
GPU has (the cuDNN kernel, device memory statistics), and says so in the output and the JSON.
Without it and without a GPU the check stops at once. Exit status: 0 when every check ran and
passed, 1 when one failed (the JSON says which), 2 on bad input.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax",
            "orbax-checkpoint", "safetensors", "tokenizers", "numpy")
GiB = 2**30


class Shapes:
    """The sizes one mode uses: a GPU gets the real ones, --cpu-smoke tiny ones."""

    def __init__(self, smoke: bool):
        # attention as in Llama-3.2-1B: 32 query heads, 8 kv heads, head_dim 64
        self.heads, self.kv_heads, self.head_dim = (4, 2, 16) if smoke else (32, 8, 64)
        self.check_seq = 128 if smoke else 2048  # against the S x S float32 reference
        # forward + backward timed at each length (64K: where the S x S xla kernel cannot go)
        self.time_seqs = (256,) if smoke else (16384, 65536)
        self.step_seq = 256 if smoke else 16384
        self.preset = "tiny" if smoke else "llama-3.2-1b"
        self.dtype = "float32" if smoke else "bfloat16"  # CPU computes bf16 in f32 anyway
        # relative error bound: bf16 kernels against the float32 reference (as
        # tests/basp_jax/test_attention.py bounds the bf16 blockwise kernel), f32 ones on the CPU
        self.tolerance = 1e-4 if smoke else 3e-2


def _skip(reason: str) -> dict:
    print(f"  skipped: {reason}", flush=True)
    return {"status": "skipped", "reason": reason}


def _failed(e: BaseException) -> dict:
    line = " ".join(str(e).split())[:400] or type(e).__name__
    print(f"  FAILED: {type(e).__name__}: {line}", flush=True)
    return {"status": "failed", "error": f"{type(e).__name__}: {line}",
            "traceback": traceback.format_exc(limit=6)}


# ---------------------------------------------------------------------------- environment

def environment() -> dict:
    import jax

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    dev = jax.devices()[0]
    info = {
        "python": platform.python_version(),
        "versions": versions,
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "compute_capability": getattr(dev, "compute_capability", None),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "mem_fraction": os.environ.get("XLA_CLIENT_MEM_FRACTION")
        or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
    }
    print(f"python {info['python']}; " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"device: {info['device_kind']} ({dev.platform}, {info['device_count']} visible"
          + (f", compute capability {info['compute_capability']}" if info["compute_capability"]
             else "") + ")", flush=True)
    return info


# ---------------------------------------------------------------------------- attention kernels

def reference_attention(q, k, v, segment_ids):
    """Causal softmax attention in float32 with an explicit mask: the independent reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    s, group = q.shape[1], q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))
    # precision="highest": full float32 on GPUs too (their default f32 matmul is TF32)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k,
                        precision="highest") / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((s, s), bool))[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision="highest")


def _inputs(shapes: Shapes, seq: int, packed: bool, dtype, seed: int = 0):
    import jax
    import jax.numpy as jnp

    kq, kk, kv, kc, ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(kq, (1, seq, shapes.heads, shapes.head_dim), dtype)
    k = jax.random.normal(kk, (1, seq, shapes.kv_heads, shapes.head_dim), dtype)
    v = jax.random.normal(kv, (1, seq, shapes.kv_heads, shapes.head_dim), dtype)
    ct = jax.random.normal(kc, (1, seq, shapes.heads, shapes.head_dim), dtype)
    seg = None
    if packed:  # 4 documents of random lengths, back to back
        seg = jnp.sort(jax.random.randint(ks, (1, seq), 0, 4), axis=1).astype(jnp.int32)
    return q, k, v, ct, seg


def _single_device_attention(impl: str, shapes: Shapes, seq: int):
    """basp_jax.attention on a one-device mesh: the trainer's path (shard_map, kernel choice)."""
    import jax

    from basp_jax import Layout, attention, make_mesh

    layout = Layout.plan(num_devices=1, batch=1, seq_len=seq, num_heads=shapes.heads,
                         num_kv_heads=shapes.kv_heads, mode="basp")
    mesh = make_mesh(layout, jax.devices()[:1])

    def fn(q, k, v, seg):
        return attention(q, k, v, mesh=mesh, causal=True, segment_ids=seg, impl=impl)

    return fn


def _loss_and_grads(fn):
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, ct, seg):
        out = fn(q, k, v, seg)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _off_gpu(impl: str, on_gpu: bool) -> str | None:
    """Why `impl` is skipped here: off a GPU, what the kernel's registry entry says of the CPU."""
    from basp_jax.kernels import KERNELS

    why = None if on_gpu else KERNELS.get(impl).supports("cpu", None, None)
    return None if why is None else f"--cpu-smoke: {why}"


def check_kernel(impl: str, packed: bool, shapes: Shapes, on_gpu: bool) -> dict:
    """Relative errors (max |x - ref| / max |ref|) of the output and dq, dk, dv."""
    import jax.numpy as jnp

    if skip := _off_gpu(impl, on_gpu):
        return _skip(skip)
    dtype = jnp.dtype(shapes.dtype)
    q, k, v, ct, seg = _inputs(shapes, shapes.check_seq, packed, dtype)
    (_, out), grads = _loss_and_grads(_single_device_attention(impl, shapes, shapes.check_seq))(
        q, k, v, ct, seg)
    (_, ref), ref_grads = _loss_and_grads(lambda q, k, v, s: reference_attention(q, k, v, s))(
        *(x.astype(jnp.float32) for x in (q, k, v, ct)), seg)

    def rel(x, r):
        return float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))

    errors = {"out": rel(out, ref)}
    errors.update({f"d{n}": rel(g, r) for n, g, r in zip("qkv", grads, ref_grads)})
    ok = max(errors.values()) <= shapes.tolerance
    print(f"  {'ok' if ok else 'FAILED'}: " + "  ".join(f"{n} {e:.1e}" for n, e in errors.items())
          + f"  (bound {shapes.tolerance:.0e})", flush=True)
    return {"status": "ok" if ok else "failed", "errors": errors, "tolerance": shapes.tolerance,
            "seq_len": shapes.check_seq, "dtype": shapes.dtype}


def _timed(fn, args, repeats: int) -> list[float]:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def _upstream_pallas_attention(shapes: Shapes, interpret: bool):
    """JAX's own Pallas/Triton flash attention (jax.experimental.pallas.ops.gpu.attention.mha),
    what our `pallas` kernel (basp_jax.flash) is timed against: it takes as many k/v heads as
    query heads, so k and v are repeated to them (the copy our kernel avoids), default blocks."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention as upstream

    group = shapes.heads // shapes.kv_heads

    def fn(q, k, v, seg):
        k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
        return upstream.mha(q, k, v, None, sm_scale=shapes.head_dim ** -0.5, causal=True,
                            interpret=interpret)

    return fn


UPSTREAM = "upstream pallas"  # the timing rows' name for _upstream_pallas_attention


def _upstream_missing() -> str | None:
    """Why JAX's own kernel cannot be timed here: jax 0.12.1 dropped its Triton Pallas examples."""
    import importlib.util

    import jax

    if importlib.util.find_spec("jax.experimental.pallas.ops.gpu.attention") is None:
        return f"jax {jax.__version__} ships no jax.experimental.pallas.ops.gpu.attention"
    return None


def time_kernel(impl: str, seq: int, shapes: Shapes, on_gpu: bool, repeats: int) -> dict:
    """Median seconds of one forward + backward pass of causal attention (unpacked) at `seq`."""
    import jax.numpy as jnp

    if impl == UPSTREAM and (missing := _upstream_missing()):
        return _skip(missing)
    if impl == UPSTREAM:
        fn = _upstream_pallas_attention(shapes, interpret=not on_gpu)
    elif skip := _off_gpu(impl, on_gpu):
        return _skip(skip)
    else:
        fn = _single_device_attention(impl, shapes, seq)
    q, k, v, ct, seg = _inputs(shapes, seq, False, jnp.dtype(shapes.dtype))
    t0 = time.perf_counter()
    try:
        times = _timed(_loss_and_grads(fn), (q, k, v, ct, seg), repeats)
    except Exception as e:  # noqa: BLE001
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        # expected of the xla kernel, which holds the S x S scores: a finding, not a failure
        print(f"  out of memory at {seq} tokens", flush=True)
        return {"status": "out of memory", "seq_len": seq, "error": " ".join(str(e).split())[:300]}
    first = time.perf_counter() - t0 - sum(times)
    median = statistics.median(times)
    # causal attention: 4 * S^2/2 * H * Dh forward (QK^T, PV), 2.5x that backward (5 matmuls)
    flops = 3.5 * 4 * seq * seq / 2 * shapes.heads * shapes.head_dim
    print(f"  {median * 1e3:9.2f} ms  ({flops / median / 1e12:.1f} TFLOP/s causal; compile + "
          f"first run {first:.1f} s)", flush=True)
    return {"status": "ok", "seq_len": seq, "median_s": median, "times_s": times,
            "tflops": flops / median / 1e12, "first_call_s": first}


# ---------------------------------------------------------------------------- train steps

def step_config(shapes: Shapes, steps: int, run_dir: str, seq: int | None = None,
                fp8: bool = False):
    """configs/gpu/llama-3.2-1b_basp.yaml on one device, synthetic data (nothing to download);
    fp8: the layers' projections as FP8 GEMMs (model.fp8)."""
    from train.config.schema import load_config

    return load_config(str(ROOT / "configs" / "gpu" / "llama-3.2-1b_basp.yaml"), [
        f"run.dir={run_dir}", f"model.preset={shapes.preset}", f"model.dtype={shapes.dtype}",
        "data.source=synthetic", "data.path=null", "data.pack=false", "data.eos_id=null",
        f"data.seq_len={seq or shapes.step_seq}", f"train.steps={steps}", "train.microbatch_size=1",
        "train.grad_accum=1", "parallel.devices_per_host=1", "runtime.devices=1",
        "runtime.platform=auto", "runtime.cpu_devices=1", "metrics.progress=false",
        f"model.fp8={str(fp8).lower()}",
    ])


def train_steps(shapes: Shapes, steps: int, on_gpu: bool, fp8: bool = False,
                seq: int | None = None) -> dict:
    """Compile the trainer's step (train.program.state) for one device and run it `steps` times on a
    fixed random batch; nothing is written anywhere. fp8: with FP8 projections; seq: this
    sequence length (else the largest of shapes.step_seq and its halves that fits)."""
    import jax
    import numpy as np

    from train.program import planning
    from train.loop import model_config, select_devices
    from train.observe.metrics import peak_flops
    from train.program.state import build_program, model_factory, plan_run
    from train.program.step import build_model, init_opt_state

    run_dir = os.path.join(tempfile.gettempdir(), "gpu-check-run")  # required; never written
    cfg = step_config(shapes, steps, run_dir, seq, fp8)
    mcfg = model_config(cfg)
    devices = select_devices(cfg)
    limit = planning.device_memory(devices[0]) if on_gpu and seq is None else None
    while limit and cfg.data.seq_len > 2048 and planning.memory_estimate(
            cfg, mcfg, *planning.plan(cfg, mcfg, 1, 1))[0] > 0.9 * limit:
        # one GPU holds all 1.24B parameters and their Adam state: 16K tokens need ~40 GB
        cfg = step_config(shapes, steps, run_dir, cfg.data.seq_len // 2, fp8)
        print(f"  {devices[0].device_kind}: {limit / 2**30:.0f} GiB usable, so "
              f"{cfg.data.seq_len} tokens instead of {shapes.step_seq}", flush=True)
    cfg = planning.resolve_offload(cfg, mcfg, 1, 1)  # optimizer.offload=auto decided
    plan = plan_run(cfg, mcfg, devices, 1)
    parts = build_model(model_factory(cfg, mcfg, plan), plan.rules, init_params=True)
    program = build_program(cfg, plan, parts)
    params, opt_state = parts.params, init_opt_state(program.tx, parts.params, program.opt_shardings)
    t0 = time.perf_counter()
    compiled = program.lower(params, opt_state).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    predicted = (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
                 - mem.alias_size_in_bytes) if mem is not None else None

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, mcfg.vocab_size, size=program.batch_shape, dtype=np.int32)
    batch = {"tokens": jax.device_put(tokens, program.batch_sharding),
             "targets": jax.device_put(np.roll(tokens, -1, axis=-1), program.batch_sharding)}
    times, losses = [], []
    for step in range(steps):
        t = time.perf_counter()
        params, opt_state, metrics = compiled(params, opt_state, batch, program.step_index(step))
        losses.append(float(jax.device_get(metrics["loss"])))
        times.append(time.perf_counter() - t)
    steady = times[1:] or times  # the first step also transfers and warms up
    step_s = statistics.median(steady)
    tokens_per_s = np.prod(program.batch_shape) / step_s
    peak, _ = peak_flops(cfg.metrics, devices[0].device_kind)  # (FLOP/s or None, log line)
    mfu = (mcfg.shape.train_flops_per_token(cfg.data.seq_len) * tokens_per_s / peak
           if peak else None)
    stats = devices[0].memory_stats() if on_gpu else None
    measured = stats.get("peak_bytes_in_use") if stats else None
    out = {
        "status": "ok" if all(np.isfinite(losses)) else "failed", "fp8": fp8,
        "model": f"{shapes.preset} ({_count(mcfg.num_params())} params)",
        "seq_len": cfg.data.seq_len, "attn_impl": cfg.model.attn_impl, "remat": cfg.model.remat,
        "compile_s": compile_s, "step_times_s": times, "step_s": step_s,
        "tokens_per_s": float(tokens_per_s), "peak_flops": peak, "mfu": mfu, "losses": losses,
        "predicted_peak_bytes": predicted, "measured_peak_bytes": measured,
    }
    print(f"  {out['model']}, {cfg.data.seq_len} tokens: compiled in {compile_s:.1f} s; step "
          f"{step_s:.3f} s, {tokens_per_s:,.0f} tokens/s, MFU "
          + (f"{mfu:.1%}" if mfu is not None else f"unknown (no peak FLOP/s for "
             f"{devices[0].device_kind!r})")
          + f"; loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    if predicted is not None:
        print(f"  memory: compiled prediction {predicted / GiB:.2f} GiB", end="", flush=True)
    if measured is not None:
        print(f", measured peak {measured / GiB:.2f} GiB (device.memory_stats)", flush=True)
    else:
        print("", flush=True)
        out["measured_peak_reason"] = _skip(
            "--cpu-smoke: CPU devices keep no memory statistics" if not on_gpu
            else "this device reports no peak_bytes_in_use")["reason"]
    return out


def train_steps_fp8(shapes: Shapes, steps: int, on_gpu: bool, bf16: dict) -> dict:
    """The same steps with FP8 projections (model.fp8=true), at the bf16 run's length: the step
    time against it. On a GPU without FP8 tensor cores (before sm89) skipped; on the CPU
    (--cpu-smoke) XLA emulates FP8, which checks the path, not its speed."""
    import jax

    from basp_jax.kernels import device_capability

    if bf16.get("status") != "ok":
        return _skip("the bf16 train steps did not run")
    capability = device_capability(jax.devices()[0]) if on_gpu else None
    if on_gpu and (capability is None or capability < (8, 9)):
        return _skip(f"{jax.devices()[0].device_kind} has no FP8 tensor cores (sm89+)")
    out = train_steps(shapes, steps, on_gpu, fp8=True, seq=bf16["seq_len"])
    out["speedup_vs_bf16"] = bf16["step_s"] / out["step_s"]
    drift = abs(out["losses"][-1] - bf16["losses"][-1]) / abs(bf16["losses"][-1])
    out["final_loss_drift"] = drift
    print(f"  FP8 step {out['step_s']:.3f} s against bf16's {bf16['step_s']:.3f} s: "
          f"{out['speedup_vs_bf16']:.2f}x; final loss {drift:.2%} from bf16's", flush=True)
    return out


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


# ---------------------------------------------------------------------------- command line

def _section(title: str, fn, *args) -> dict:
    print(title, flush=True)
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001: one failing check must not hide the others
        return _failed(e)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check.json", help="the JSON report")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: tiny shapes on the CPU, GPU-only parts skipped (tests)")
    p.add_argument("--steps", type=int, default=6, help="train steps of the 1B model (>= 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed attention calls per kernel")
    args = p.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        print("error: --steps must be >= 2 and --repeats >= 1", file=sys.stderr)
        return 2
    folder = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.access(folder, os.W_OK):
        print(f"error: cannot write the report to {args.out!r}; give a file in a writable folder",
              file=sys.stderr)
        return 2
    smoke = args.cpu_smoke
    from train.process import gpu_defaults

    if smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        gpu_defaults.apply_env(os.environ)  # the XLA flags and memory fraction a run uses
    import jax

    if not smoke:
        if jax.devices()[0].platform != "gpu":
            print(f"error: no GPU visible to JAX {jax.__version__} (devices: "
                  f"{jax.devices()[0].platform}); run on a GPU host, or pass --cpu-smoke",
                  file=sys.stderr)
            return 2
        gpu_defaults.enable_compilation_cache()
    on_gpu = not smoke
    shapes = Shapes(smoke)
    t0 = time.perf_counter()
    report = {"mode": "cpu-smoke" if smoke else "gpu", "environment": environment(),
              "kernels": {}, "timing": {}}

    def save():  # after every section: a run cut short (scripts/gpu_check.sh's limit) keeps them
        report["wall_s"] = time.perf_counter() - t0
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    # the train steps first: device.memory_stats()'s peak then is theirs, not the kernels' below
    report["train"] = _section(f"train steps: {shapes.preset} at {shapes.step_seq} tokens",
                               train_steps, shapes, args.steps, on_gpu)
    save()
    report["train_fp8"] = _section("train steps with FP8 projections (model.fp8=true)",
                                   train_steps_fp8, shapes, args.steps, on_gpu, report["train"])
    save()
    from basp_jax.kernels import KERNELS

    for impl in KERNELS:
        for packed in (False, True):
            name = f"{impl}, {'packed' if packed else 'unpacked'}"
            report["kernels"][name] = _section(
                f"attention {name}: against the float32 reference at {shapes.check_seq} tokens",
                check_kernel, impl, packed, shapes, on_gpu)
            save()
    for seq in shapes.time_seqs:
        for impl in (*KERNELS, UPSTREAM):
            report["timing"][f"{impl}, {seq} tokens"] = _section(
                f"attention {impl}: forward + backward at {seq} tokens",
                time_kernel, impl, seq, shapes, on_gpu, args.repeats)
            save()
    failed = [f"kernels: {k}" for k, v in report["kernels"].items() if v["status"] == "failed"]
    failed += [f"timing: {k}" for k, v in report["timing"].items() if v["status"] == "failed"]
    failed += [part for part in ("train", "train_fp8") if report[part]["status"] == "failed"]
    report["failed"] = failed
    save()
    skipped = sum(v["status"] == "skipped" for part in ("kernels", "timing")
                  for v in report[part].values())
    print(f"done in {report['wall_s']:.0f} s: {len(failed)} failed, {skipped} skipped"
          + (f" ({'; '.join(failed)})" if failed else "") + f"; wrote {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
