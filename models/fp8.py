"""FP8 projections: x @ kernel, e4m3 inputs forward, an e5m2 gradient backward, current scaling.

    y = fp8_matmul(x, kernel)   # x [..., in], kernel [in, out], both in the compute dtype

Each operand is scaled per tensor by its own amax of this step (current scaling, torchtitan's
default; Transformer Engine's "delayed" scaling reads earlier steps' amax history instead): no
scale or history is state, so nothing enters the train state, checkpoints or the optimizer, and
scanned layers, remat and the streamed step need nothing extra. The price is one amax reduction
per operand, a pass over a tensor the matmul reads anyway.

The quantization is flax's (flax.linen.fp8_ops: quantize, compute_scale; the arithmetic of its
Fp8DirectDotGeneralOp): the dots take the FP8 arrays themselves (f8 x f8 -> the compute dtype,
then times both scales), which XLA's GPU compiler runs as FP8 GEMMs on sm89+ (cuBLASLt's
`__cublas$lt$matmul$f8`, or a Triton GEMM fusion of the f8 operands where it picks Triton). A
dequantize-then-dot (flax's older Fp8DotGeneralOp qdq) is not used: where XLA hands that dot to
Triton it drops the f8 round trip as excess precision, silently running in bf16. On the CPU XLA
runs the same f8 dots in software, so the numerics are FP8's on any backend.

The backward keeps the forward's FP8 operands (half the bytes of bf16 residuals) and quantizes
the incoming gradient to e5m2 with its own current scale: dx = g8 @ w8^T, dw = x8^T @ g8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

E4M3 = jnp.float8_e4m3fn  # forward operands: more mantissa
E5M2 = jnp.float8_e5m2  # gradients: more range


def current_scale(x: jax.Array, q_dtype) -> jax.Array:
    """x's per-tensor scale (float32 scalar): amax(x) / the format's largest value, so that
    x / scale fills the FP8 range; 1 where x is all zeros or not finite (flax's compute_scale)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    fp8_max = fp8_ops.get_fp8_max(q_dtype, jnp.float32)
    return jax.lax.stop_gradient(fp8_ops.compute_scale(amax, jnp.ones((), jnp.float32), fp8_max))


def quantize(x: jax.Array, q_dtype) -> tuple[jax.Array, jax.Array]:
    """(x / its current scale, clipped to the format's range, in q_dtype; the scale). Divided
    in x's dtype, except float16, where a scale (amax / 448, or / 57344) underflows below amax
    ~3e-3: there in float32."""
    scale = current_scale(x, q_dtype)
    compute = jnp.float32 if x.dtype == jnp.float16 else x.dtype
    return fp8_ops.quantize(x, q_dtype, scale, compute), scale


def _scaled_dot(a8, sa, b8, sb, contract, dtype):
    """(a8 . b8 over `contract` (dot_general's contracting dims)) * sa * sb, in dtype: the FP8
    GEMM (float32 accumulation inside) with its output and scales in the compute dtype, as a
    plain projection's. A float32 output would make every partial sum the partitioner reduces
    across devices float32: the weight gradients' reduce-scatters and all-reduces twice bf16's.
    float16 is the exception: an unscaled product of FP8 values (up to 448^2 per term) passes
    its 65504 at once, so it accumulates and scales in float32 before the cast."""
    acc = jnp.float32 if jnp.dtype(dtype) == jnp.float16 else dtype
    out = jax.lax.dot_general(a8, b8, (contract, ((), ())), preferred_element_type=acc)
    return (out * (sa * sb).astype(acc)).astype(dtype)


@jax.custom_vjp
def fp8_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., in] @ kernel [in, out], both in the compute dtype, in FP8 (module docstring); the
    output in that dtype."""
    return _fp8_matmul_fwd(x, kernel)[0]


def _fp8_matmul_fwd(x, kernel):
    x8, sx = quantize(x, E4M3)
    w8, sw = quantize(kernel, E4M3)
    y = _scaled_dot(x8, sx, w8, sw, ((x.ndim - 1,), (0,)), x.dtype)
    return y, (x8, sx, w8, sw)


def _fp8_matmul_bwd(res, g):
    x8, sx, w8, sw = res
    g8, sg = quantize(g, E5M2)
    lead = tuple(range(g.ndim - 1))  # the token dimensions, summed over for the kernel's
    dx = _scaled_dot(g8, sg, w8, sw, ((g.ndim - 1,), (1,)), g.dtype)
    dw = _scaled_dot(x8, sx, g8, sg, (lead, lead), g.dtype)
    return dx, dw


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


# -- where FP8 runs ---------------------------------------------------------------------------

# FP8 tensor cores: Ada (sm89: L4, RTX 4090), Hopper (sm90), Blackwell (sm100). model.fp8=auto
# turns FP8 on from Hopper only: Ada's FP8 peak is its bf16 one's double too, but those cards
# train small models whose per-tensor amax passes cost more than they save.
MIN_CC = (8, 9)
AUTO_MIN_CC = (9, 0)
SETTINGS = (False, True, "auto")


def unsupported(platform: str, capability: tuple[int, int] | None) -> str | None:
    """Why FP8 projections cannot run on this device (None: they can). The CPU runs them in
    software (for tests of the numerics); a GPU needs FP8 tensor cores (sm89+), else XLA would
    upcast every FP8 matmul to a slower one."""
    if platform == "gpu" and capability is not None and tuple(capability) < MIN_CC:
        return (f"sm{capability[0]}{capability[1]} has no FP8 tensor cores (they need sm89+: "
                "L4, RTX 4090, H100, H200, B200)")
    return None


def enabled_on_target(setting, target: str) -> bool:
    """`enabled` on the GPU basp_jax.gpus calls `target` (a planner's parallel.hardware; a name
    that is no GPU there: a CPU)."""
    from basp_jax import gpus

    if setting != "auto":
        return enabled(setting, "gpu", None)  # as given, whatever the target
    gpu = gpus.GPUS.get(target)
    return gpu is not None and tuple(gpu.compute_capability) >= AUTO_MIN_CC


def enabled(setting, platform: str, capability: tuple[int, int] | None) -> bool:
    """model.fp8 as a device runs it: True / False as given, "auto" on sm90+ GPUs only."""
    if setting not in SETTINGS:
        raise ValueError(f"fp8 must be one of false, true, auto; got {setting!r}")
    if setting == "auto":
        return platform == "gpu" and capability is not None and tuple(capability) >= AUTO_MIN_CC
    return bool(setting)
