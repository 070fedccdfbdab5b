"""Compile (never run) the trainer's step for a model shape and layout, and list its collectives.

Used by benchmarks/comm_table.py and the collective tests: the real step (forward, backward, AdamW
update, parameter sharding) with abstract parameters, so even 8B shapes compile on a laptop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import models
from basp_jax import Layout, comm, make_mesh
from basp_jax.sharding import tree_shardings

from .checkpoint import abstract_tree
from .config import OptimizerConfig
from .step import build_model, make_optimizer, make_train_step, opt_state_shardings


def step_collectives(mcfg, *, mode: str, strategy: str, batch: int, seq_len: int,
                     dtype=jnp.float32, grad_accum: int = 1, devices: int = 8,
                     devices_per_host: int = 4, remat: str = "none",
                     scan_layers: bool = False) -> tuple[Layout, list]:
    """Compile the trainer's step for this layout and return its collectives.

    The layers are unrolled by default (scan_layers=False), so the program text holds every
    collective each time it runs: the list is the step's traffic. Under a scan a layer's
    collectives appear once, in the loop body."""
    layout = Layout.plan(devices, batch, seq_len, mcfg.num_heads, mcfg.num_kv_heads,
                         devices_per_host=devices_per_host, mode=mode)
    mesh = make_mesh(layout, jax.devices()[:devices])

    def make():
        return models.Transformer(mcfg, rngs=nnx.Rngs(0), mesh=mesh, dtype=dtype, param_dtype=dtype,
                                  attn_impl="blockwise", remat=remat, scan_layers=scan_layers)

    parts = build_model(make, mesh, strategy, init_params=False)
    tx, schedule = make_optimizer(OptimizerConfig(lr=1e-4), steps=10)
    param_sh = tree_shardings(parts.params, mesh, strategy)
    abs_opt, opt_sh = opt_state_shardings(tx, parts.params, mesh, strategy)
    step_fn, batch_sharding = make_train_step(parts, tx, schedule, mesh, param_sh, opt_sh,
                                              loss_fn=models.causal_lm_loss, packed=False)
    tokens = jax.ShapeDtypeStruct((grad_accum, batch, seq_len), jnp.int32, sharding=batch_sharding)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    compiled = step_fn.lower(parts.params, abstract_tree(abs_opt, opt_sh),
                             {"tokens": tokens, "targets": tokens}, step).compile()
    return layout, comm.parse_collectives(compiled.as_text(), devices)
