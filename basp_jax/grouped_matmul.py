"""Grouped matmul (jax.lax.ragged_dot's contract) as Pallas kernels: Triton on a GPU, interpret
mode on CPU (tests).

    out = grouped_matmul(lhs, rhs, group_sizes)     # lhs [M, K], rhs [G, K, N] -> [M, N]

Rows of lhs come sorted by group: the first group_sizes[0] rows are group 0's, and so on; row r
of group g is lhs[r] @ rhs[g]. Rows past sum(group_sizes) are zero (as ragged_dot's).

Why: XLA's GPU lowering of ragged_dot is a dense loop over the groups, each over all M rows (a
mixture of experts' 16 local experts over 262,144 routed rows: [16, 262144, 2048] buffers of 16
GiB, and 16x the FLOPs). JAX's own Pallas Triton lowering of ragged_dot
(`jax_ragged_dot_use_gpu_pallas_triton_lowering`) is a flag whose module the jax 0.10-0.12
wheels do not ship; the Mosaic GPU kernels under jax.experimental.pallas.ops.gpu are Hopper-only
and have no interpret mode for CPU tests. These kernels, after MegaBlocks' grouped GEMM: rows in
tiles of `tm`; the forward's program for a row tile loops over the groups its rows belong to
(the bounds worked out before the kernel), each a masked tile matmul, so the work is the routed
rows' (plus at most one partial tile per group), never M x G. The backward's dlhs is the same
kernel with each group's matrix transposed; drhs [G, K, N] loops, per group and output tile,
over the row tiles of that group.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .flash import block_scalar, triton_dot

_MIN_TILE = 16  # Triton's dot needs every side >= 16
# The named scope around a mixture of experts' token exchanges and grouped matmuls (models.moe):
# what a compiled instruction's op_name holds when the experts' layer made it
# (basp_jax.compiled.comm.Collective.op_name; train.tools.aot lists those collectives apart).
EXPERTS_SCOPE = "basp_experts"


class Tiles(NamedTuple):
    """Tile sizes: rows, the contracted axis, output columns; Triton warps and stages."""

    m: int = 64
    k: int = 64
    n: int = 128
    num_warps: int = 4
    num_stages: int = 2


def _tile(size: int, dim: int) -> int:
    """The largest power of two <= size that divides dim (at least 16; dim must allow it)."""
    tile = size
    while tile > _MIN_TILE and dim % tile:
        tile //= 2
    if dim % tile:
        raise ValueError(f"grouped_matmul needs dimensions divisible by {_MIN_TILE}, got {dim}; "
                         "pad the expert widths to a multiple of 16 or use impl='xla'")
    return tile


def _params(tiles: Tiles):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


class _Bounds(NamedTuple):
    """What the kernels read of the grouping: each row's group (G for rows past the groups),
    each row tile's groups [lo, hi), and each group's row tiles [lo, hi)."""

    row_group: jax.Array
    tile_lo: jax.Array
    tile_hi: jax.Array
    group_lo: jax.Array
    group_hi: jax.Array


def _bounds(group_sizes, m_pad: int, tm: int) -> _Bounds:
    g = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    row_group = jnp.searchsorted(ends, jnp.arange(m_pad, dtype=jnp.int32),
                                 side="right").astype(jnp.int32)
    firsts, lasts = row_group[::tm], row_group[tm - 1::tm]
    tile_lo = jnp.minimum(firsts, g)
    tile_hi = jnp.where(firsts >= g, firsts, jnp.minimum(lasts, g - 1) + 1)
    group_lo = jnp.minimum(starts // tm, m_pad // tm)
    # (clamped to the rows there are: sizes summing past M must not read past them on a GPU)
    group_hi = jnp.minimum(jnp.where(group_sizes > 0, -(-ends // tm), group_lo), m_pad // tm)
    return _Bounds(row_group, tile_lo, tile_hi, group_lo.astype(jnp.int32),
                   group_hi.astype(jnp.int32))


def _forward_kernel(lhs_ref, rhs_ref, rows_ref, lo_ref, hi_ref, out_ref, *, tk: int, k_dim: int):
    rows = rows_ref[...]
    tm, tn = out_ref.shape

    def group(g, acc):
        def step(kb, part):
            ks = pl.ds(kb * tk, tk)
            return part + triton_dot(lhs_ref[:, ks], rhs_ref[g, ks, :])

        part = lax.fori_loop(0, k_dim // tk, step, jnp.zeros((tm, tn), jnp.float32))
        return acc + jnp.where((rows == g)[:, None], part, 0.0)

    acc = lax.fori_loop(block_scalar(lo_ref), block_scalar(hi_ref), group, jnp.zeros((tm, tn), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _forward(lhs, rhs, bounds: _Bounds, tiles: Tiles, interpret: bool):
    m_pad, k_dim = lhs.shape
    g, _, n = rhs.shape
    tm, tk, tn = tiles.m, _tile(tiles.k, k_dim), _tile(tiles.n, n)
    kernel = functools.partial(_forward_kernel, tk=tk, k_dim=k_dim)
    return pl.pallas_call(
        kernel,
        grid=(m_pad // tm, n // tn),
        in_specs=[pl.BlockSpec((tm, k_dim), lambda i, j: (i, 0)),
                  pl.BlockSpec((g, k_dim, tn), lambda i, j: (0, 0, j)),
                  pl.BlockSpec((tm,), lambda i, j: (i,)),
                  pl.BlockSpec((1,), lambda i, j: (i,)),
                  pl.BlockSpec((1,), lambda i, j: (i,))],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n), lhs.dtype),
        compiler_params=_params(tiles),
        interpret=interpret,
        name="grouped_matmul",
    )(lhs, rhs, bounds.row_group, bounds.tile_lo, bounds.tile_hi)


def _rhs_grad_kernel(lhs_ref, dout_ref, rows_ref, lo_ref, hi_ref, drhs_ref, *, tm: int):
    g = pl.program_id(0)
    tk, tn = drhs_ref.shape

    def tile(t, acc):
        rs = pl.ds(t * tm, tm)
        mine = (rows_ref[rs] == g)[:, None]
        lhs = jnp.where(mine, lhs_ref[rs, :], 0).astype(lhs_ref.dtype)
        dout = jnp.where(mine, dout_ref[rs, :], 0).astype(dout_ref.dtype)  # (no 0 x inf)
        return acc + triton_dot(lhs, dout, trans_a=True)

    acc = lax.fori_loop(block_scalar(lo_ref), block_scalar(hi_ref), tile, jnp.zeros((tk, tn), jnp.float32))
    drhs_ref[...] = acc.astype(drhs_ref.dtype)


def _rhs_grad(lhs, dout, bounds: _Bounds, tiles: Tiles, interpret: bool, rhs_dtype):
    m_pad, k_dim = lhs.shape
    n = dout.shape[1]
    g = bounds.group_lo.shape[0]
    tm, tk, tn = tiles.m, _tile(tiles.k, k_dim), _tile(tiles.n, n)
    kernel = functools.partial(_rhs_grad_kernel, tm=tm)
    return pl.pallas_call(
        kernel,
        grid=(g, k_dim // tk, n // tn),
        in_specs=[pl.BlockSpec((m_pad, tk), lambda e, a, b: (0, a)),
                  pl.BlockSpec((m_pad, tn), lambda e, a, b: (0, b)),
                  pl.BlockSpec((m_pad,), lambda e, a, b: (0,)),
                  pl.BlockSpec((1,), lambda e, a, b: (e,)),
                  pl.BlockSpec((1,), lambda e, a, b: (e,))],
        out_specs=pl.BlockSpec((None, tk, tn), lambda e, a, b: (e, a, b)),
        out_shape=jax.ShapeDtypeStruct((g, k_dim, n), rhs_dtype),
        compiler_params=_params(tiles),
        interpret=interpret,
        name="grouped_matmul_rhs_grad",
    )(lhs, dout, bounds.row_group, bounds.group_lo, bounds.group_hi)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(lhs, rhs, group_sizes, tiles: Tiles, interpret: bool):
    m = lhs.shape[0]
    m_pad = -(-m // tiles.m) * tiles.m
    bounds = _bounds(group_sizes, m_pad, tiles.m)
    out = _forward(jnp.pad(lhs, ((0, m_pad - m), (0, 0))), rhs, bounds, tiles, interpret)
    return out[:m]


def _grouped_fwd(lhs, rhs, group_sizes, tiles, interpret):
    return _grouped(lhs, rhs, group_sizes, tiles, interpret), (lhs, rhs, group_sizes)


def _grouped_bwd(tiles, interpret, residuals, dout):
    lhs, rhs, group_sizes = residuals
    m = lhs.shape[0]
    m_pad = -(-m // tiles.m) * tiles.m
    bounds = _bounds(group_sizes, m_pad, tiles.m)
    dout = jnp.pad(dout.astype(lhs.dtype), ((0, m_pad - m), (0, 0)))
    dlhs = _forward(dout, jnp.swapaxes(rhs, 1, 2), bounds, tiles, interpret)[:m]
    drhs = _rhs_grad(jnp.pad(lhs, ((0, m_pad - m), (0, 0))), dout, bounds, tiles, interpret,
                     rhs.dtype)
    return dlhs, drhs, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   tiles: Tiles = Tiles(), interpret: bool = False) -> jax.Array:
    """ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N] in lhs's dtype (float32
    accumulation), differentiable in lhs and rhs. interpret: Pallas' interpreter (CPU)."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul takes lhs [M, K] and rhs [G, K, N], got {lhs.shape} "
                         f"and {rhs.shape}")
    return _grouped(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), tiles, interpret)


IMPLS = ("auto", "xla", "pallas")


def resolve_impl(impl: str, platform: str, dims: tuple[int, ...] = ()) -> str:
    """The grouped matmul `impl` names, on `platform`: "auto" is the Pallas kernel on a GPU
    (where XLA's ragged_dot is a dense loop over the groups) where the matrices' `dims` (K and
    N of each product) are multiples of 16, as its tiles need, and XLA's ragged_dot elsewhere
    (on CPU it masks to dense too, but the kernels would run interpreted)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown grouped matmul {impl!r}; use one of {', '.join(IMPLS)}")
    if impl == "auto":
        fits = all(d % _MIN_TILE == 0 for d in dims)
        return "pallas" if platform == "gpu" and fits else "xla"
    return impl


def grouped_matmul_fn(impl: str, platform: str):
    """fn(lhs, rhs, group_sizes) for `impl` on `platform` (resolve_impl): XLA's ragged_dot, or
    grouped_matmul (interpreted off a GPU)."""
    if resolve_impl(impl, platform) == "xla":
        return jax.lax.ragged_dot
    return functools.partial(grouped_matmul, interpret=platform != "gpu")
