"""A mixture of experts' grouped matmuls alone (basp_jax.grouped_matmul): our Pallas kernels and
XLA's ragged_dot, each checked against a float32 reference (forward and both gradients) and
timed, forward and forward+backward, at Qwen3-30B-A3B's shapes on one GPU of a BASP group of 8
(16 local experts; 32,768 routed rows, 4,096 tokens x top-8). The FLOP/s count the routed rows'
work only, so a kernel that computes every expert over every row (XLA's GPU lowering) shows it."""

from __future__ import annotations

import statistics

from .common import Shapes, timed


def expert_cases(shapes: Shapes):
    """(name, impl, K, N) of every case: gate/up's [d -> moe_inter] and down's [moe_inter -> d]."""
    d, f = (64, 32) if shapes.smoke else (2048, 768)
    for impl in ("pallas", "xla"):
        for proj, k, n in (("gate/up", d, f), ("down", f, d)):
            yield f"{impl} {proj}", impl, k, n


def _operands(shapes: Shapes, k: int, n: int):
    import jax.numpy as jnp
    import numpy as np

    rows, groups = (256, 4) if shapes.smoke else (32768, 16)
    rng = np.random.default_rng(0)
    # tokens' experts drawn unevenly (a router's load is never flat), sorted as models.moe sorts
    sizes = np.bincount(rng.choice(groups, rows, p=rng.dirichlet(np.ones(groups))),
                        minlength=groups).astype(np.int32)
    dtype = jnp.dtype(shapes.dtype)
    lhs = jnp.asarray(rng.normal(size=(rows, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(groups, k, n)) / np.sqrt(k), dtype)
    weights = jnp.asarray(rng.normal(size=(rows, n)), jnp.float32)
    return lhs, rhs, jnp.asarray(sizes), weights


def check_and_time(impl: str, k: int, n: int, shapes: Shapes, on_gpu: bool,
                   repeats: int) -> dict:
    """Errors against float32 ragged_dot (forward, d lhs, d rhs: max |diff| / max |reference|)
    and the median seconds and TFLOP/s of the forward and of forward+backward."""
    import jax
    import jax.numpy as jnp

    from basp_jax import grouped_matmul as gmm

    lhs, rhs, sizes, weights = _operands(shapes, k, n)
    matmul = gmm.grouped_matmul_fn(impl, "gpu" if on_gpu else "cpu")
    if impl == "pallas" and not on_gpu:  # interpret mode takes tiles of any size >= 16
        matmul = lambda a, b, s: gmm.grouped_matmul(a, b, s, tiles=gmm.Tiles(16, 32, 16),  # noqa
                                                    interpret=True)

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b, sizes).astype(jnp.float32) * weights)

    forward = jax.jit(lambda a, b: matmul(a, b, sizes))
    both = jax.jit(jax.value_and_grad(loss(matmul), argnums=(0, 1)))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    reference = jax.jit(jax.value_and_grad(loss(jax.lax.ragged_dot), argnums=(0, 1)))
    want_out = jax.lax.ragged_dot(f32(lhs), f32(rhs), sizes)
    _, want_grads = reference(f32(lhs), f32(rhs))
    got_out = forward(lhs, rhs)
    _, got_grads = both(lhs, rhs)

    def err(got, want):
        return float(jnp.max(jnp.abs(f32(got) - want)) / jnp.max(jnp.abs(want)))

    errors = {"out": err(got_out, want_out), "d_lhs": err(got_grads[0], want_grads[0]),
              "d_rhs": err(got_grads[1], want_grads[1])}
    flops = 2.0 * lhs.shape[0] * k * n  # the routed rows' forward
    out = {"status": "ok", "impl": impl, "rows": lhs.shape[0], "k": k, "n": n,
           "groups": rhs.shape[0], "dtype": shapes.dtype, "errors": errors}
    for name, fn, work in (("fwd", forward, flops), ("fwd_bwd", both, 3 * flops)):
        first, times = timed(fn, (lhs, rhs), repeats)
        median = statistics.median(times)
        out[name] = {"median_s": median, "first_call_s": first, "tflops": work / median / 1e12}
    limit = 2e-2 if shapes.dtype == "bfloat16" else 1e-4
    bad = {k: v for k, v in errors.items() if not v <= limit}
    print(f"  {impl} [{lhs.shape[0]} x {k}] x {rhs.shape[0]} x [{k} x {n}]: fwd "
          f"{out['fwd']['median_s'] * 1e3:.3f} ms ({out['fwd']['tflops']:.1f} TFLOP/s), fwd+bwd "
          f"{out['fwd_bwd']['median_s'] * 1e3:.3f} ms; errors "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
    if bad:
        out["status"] = "failed"
        out["error"] = f"errors over {limit:g} against float32 ragged_dot: {bad}"
    return out
