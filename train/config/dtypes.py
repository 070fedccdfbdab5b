"""The floating-point dtypes the config names, defined once; no JAX import (train/config/schema.py reads
this before JAX starts).

    DTYPES["bfloat16"].bytes    # 2
    COMPUTE                     # model.dtype (with "auto") and checkpoint.export_dtype
    STORAGE                     # model.param_dtype and optimizer.mu_dtype: float32, bfloat16
    jnp_dtype("bfloat16")       # jnp.bfloat16 (imports JAX)
"""

from __future__ import annotations

import dataclasses
import math
import struct


@dataclasses.dataclass(frozen=True)
class Dtype:
    """bytes: per value; storage: whether parameters and Adam's moments may be kept in it (float16
    only computes, with dynamic loss scaling: its range is too narrow for the weights' updates)."""

    bytes: int
    storage: bool = True


DTYPES = {
    "float32": Dtype(4),
    "bfloat16": Dtype(2),
    "float16": Dtype(2, storage=False),
}
COMPUTE = tuple(DTYPES)
STORAGE = tuple(name for name, d in DTYPES.items() if d.storage)


def float32(value: float) -> float:
    """value as float32 holds it: rounded, 0.0 below its smallest subnormal (~1.4e-45), inf
    beyond its largest (~3.4e38). The optimizer computes in float32, so a setting finite only in
    Python's float64 (1e39) is inf there. (models.config has the same for the model's fields.)"""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def nbytes(name: str) -> int:
    return DTYPES[name].bytes


def jnp_dtype(name: str):
    """The JAX dtype of a name of DTYPES (jnp.bfloat16, ...)."""
    import jax.numpy as jnp

    DTYPES[name]  # only the listed ones (a KeyError names it)
    return getattr(jnp, name)
