"""Compile (never run) the trainer's step for a model shape and layout, and list its collectives.

Used by benchmarks/comm_table.py and the collective tests: the trainer's own step
(train.program.state: forward, backward, AdamW update, parameter sharding) with abstract parameters, so
even 8B shapes compile on a laptop.
"""

from __future__ import annotations

import jax

from basp_jax import Layout
from basp_jax.compiled import comm

from ..config.schema import from_dict
from ..program.state import compile_program


def step_collectives(mcfg, *, mode: str, strategy: str, batch: int, seq_len: int,
                     dtype: str = "float32", grad_accum: int = 1, devices: int = 8,
                     devices_per_host: int = 4, remat: str = "none",
                     scan_layers: bool = False, tile_tokens: int | None = None,
                     vocab_parallel: str = "auto") -> tuple[Layout, list]:
    """Compile the trainer's step for this layout and return its collectives (each with how
    often it runs: under scan_layers a layer's collectives sit once in the loop body)."""
    cfg = from_dict({
        "run": {"dir": "unused"},  # nothing is written
        "model": {"preset": "tiny", "dtype": dtype, "param_dtype": dtype,
                  "attn_impl": "blockwise", "remat": remat, "scan_layers": scan_layers,
                  "tile_tokens": tile_tokens, "vocab_parallel": vocab_parallel},
        # the model is mcfg; the preset only satisfies the schema
        "data": {"source": "synthetic", "seq_len": seq_len},
        "train": {"steps": 10, "microbatch_size": batch, "grad_accum": grad_accum},
        "optimizer": {"lr": 1e-4},
        "parallel": {"mode": mode, "param_sharding": strategy},
        "runtime": {"cpu_devices": devices},
    })
    compiled, run_plan, _, _ = compile_program(cfg, jax.devices()[:devices], devices_per_host,
                                               mcfg=mcfg)
    return run_plan.layout, comm.parse_collectives(compiled.as_text(), devices)
