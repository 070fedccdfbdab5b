"""The models' matrix multiplies alone, at the trainer's length: each projection's forward GEMM
and its two backward ones (the input's gradient and the weight's), achieved TFLOP/s per shape.
What the calibration's one dense rate averages over, by shape."""

from __future__ import annotations

import statistics
import time

from .common import Shapes

PASSES = ("fwd", "dx", "dw")  # y = x w; dx = dy w^T; dw = x^T dy


def projections(preset: str) -> list[tuple[str, int, int]]:
    """(name, in features, out features) of one layer's matmuls and the LM head."""
    from models import ModelConfig

    s = ModelConfig.preset(preset).shape
    d, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return [("q_proj", d, q), ("k_proj/v_proj", d, kv), ("o_proj", q, d),
            ("gate_proj/up_proj", d, s.intermediate_size), ("down_proj", s.intermediate_size, d),
            ("lm_head", d, s.vocab_size)]


def gemm_cases(shapes: Shapes):
    """(name, preset, projection, K, N, pass) of every GEMM timed."""
    for preset in shapes.gemm_presets:
        for proj, k, n in projections(preset):
            for which in PASSES:
                yield f"{preset} {proj} {which}", preset, proj, k, n, which


def _operands(m: int, k: int, n: int, which: str, dtype):
    import jax
    from jax import lax

    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    dims = {"fwd": (((1,), (0,)), ((), ())),  # [m, k] x [k, n]
            "dx": (((1,), (1,)), ((), ())),   # dy [m, n] x w [k, n]
            "dw": (((0,), (0,)), ((), ()))}[which]  # x [m, k] x dy [m, n]
    shapes = {"fwd": ((m, k), (k, n)), "dx": ((m, n), (k, n)), "dw": ((m, k), (m, n))}[which]
    a = jax.random.normal(ka, shapes[0], dtype)
    b = jax.random.normal(kb, shapes[1], dtype)
    return jax.jit(lambda a, b: lax.dot_general(a, b, dims)), a, b


def time_gemm(k: int, n: int, which: str, shapes: Shapes, peak: float | None,
              calls: int = 5, rounds: int = 3) -> dict:
    """Seconds per GEMM: `calls` calls queued back to back, then waited for (so the host's
    dispatch hides behind the device's work, as in a step), median over `rounds`."""
    import jax
    import jax.numpy as jnp

    m = shapes.step_seq
    fn, a, b = _operands(m, k, n, which, jnp.dtype(shapes.dtype))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(a, b))
    first = time.perf_counter() - t0
    per_call = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            out = fn(a, b)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t) / calls)
    median = statistics.median(per_call)
    flops = 2.0 * m * k * n
    out = {"status": "ok", "m": m, "k": k, "n": n, "pass": which, "dtype": shapes.dtype,
           "median_s": median, "times_s": per_call, "tflops": flops / median / 1e12,
           "first_call_s": first}
    if peak:
        out["of_peak"] = flops / median / peak
    print(f"  [{m} x {k}] x [{k} x {n}] ({which}): {median * 1e3:8.3f} ms, "
          f"{out['tflops']:.1f} TFLOP/s" + (f" ({out['of_peak']:.0%} of peak)" if peak else ""),
          flush=True)
    return out


def device_peak(on_gpu: bool) -> float | None:
    """The GPU's dense bf16 peak FLOP/s (basp_jax.gpus), None off a GPU or for an unknown one."""
    import jax

    from basp_jax import gpus

    gpu = gpus.by_device_kind(jax.devices()[0].device_kind) if on_gpu else None
    return gpu.peak_flops if gpu else None

