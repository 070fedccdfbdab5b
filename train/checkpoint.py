"""Orbax checkpoints of (params, optimizer state, step, data position, rng) in run.dir/checkpoints.

Saves are asynchronous and atomic (orbax writes to a temporary directory and renames); the manager
keeps the last n. Restore takes abstract arrays that carry the *target* shardings, so a checkpoint
written under one layout or device count lands directly on another mesh.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from .config import CheckpointConfig


class Checkpointer:
    def __init__(self, run_dir: str, cfg: CheckpointConfig, total_steps: int):
        self.cfg = cfg
        self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        self.total_steps = total_steps
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=cfg.every if cfg.every > 0 else total_steps + 1,
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("params", "opt_state", "meta")
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Save after `step` completed steps when the interval says so (or `force`)."""
        if step in self.manager.all_steps():
            return False
        return self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=force,
        )

    def restore(self, step: int, abstract_params, abstract_opt_state):
        """(params, opt_state, meta) of `step`, placed as the abstract trees' shardings say."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_params),
                opt_state=ocp.args.StandardRestore(abstract_opt_state),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return restored["params"], restored["opt_state"], dict(restored["meta"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_tree(tree, shardings):
    """ShapeDtypeStructs of `tree` carrying `shardings` (the restore target)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
