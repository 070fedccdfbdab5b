"""basp-jax: batch-aware sequence parallelism (BASP) for JAX.

    layout = Layout.plan(num_devices=8, batch=2, seq_len=4096, num_heads=32, num_kv_heads=8,
                         devices_per_host=4, mode="basp")
    mesh = make_mesh(layout)
    out = attention(q, k, v, mesh=mesh, causal=True)
"""

from .attention import attention
from .layout import Layout, LayoutError
from .mesh import AXES, make_mesh, mesh_groups
from .positions import position_ids, shard_positions
from .sharding import ACTIVATION_SPEC, activation_sharding

__all__ = [
    "ACTIVATION_SPEC",
    "AXES",
    "Layout",
    "LayoutError",
    "activation_sharding",
    "attention",
    "make_mesh",
    "mesh_groups",
    "position_ids",
    "shard_positions",
]
