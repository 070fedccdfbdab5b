"""A copy of the train state on the devices, so a checkpoint is written while the next step runs.

Orbax's asynchronous save still copies the state to host memory before it returns, and the next
step cannot be dispatched before that: it donates the very buffers the copy reads. For a 1.24B
model's state on one GPU that copy stalled the step after a save about 12x. A copy on the device
takes milliseconds (device memory bandwidth); the loop dispatches the next step right after it
and hands the copy to orbax, whose host transfer then overlaps that step (in a thread where one
process runs, so the loop goes on dispatching: train.checkpoint.store). The price is one more
copy of the state in device memory while it is saved, so `checkpoint.copy_on_device=auto` takes
it only where the compiled step's own memory plus the copy fits the device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

HEADROOM = 0.95  # of a device's memory: the allocator's fragmentation keeps the rest


def device_bytes(tree) -> int:
    """Bytes the tree's leaves hold in the first device's memory (host-resident leaves are not
    counted: their copy is host memory)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if getattr(leaf.sharding, "memory_kind", None) not in (None, "device"):
            continue
        shard = leaf.addressable_shards[0]
        total += shard.data.nbytes
    return total


def copy_fits(compiled_steps, limit: float | None, state, on_cpu: bool) -> tuple[bool, str]:
    """Whether the largest compiled step plus one copy of `state` fits a device of `limit` bytes,
    and why (one line for the run's log). A state partly in host memory (optimizer.offload)
    is not copied: a compiled copy between host buffers is untried on a GPU."""
    if any(getattr(leaf.sharding, "memory_kind", None) not in (None, "device")
           for leaf in jax.tree.leaves(state)):
        return False, "the state is partly in host memory"
    extra = device_bytes(state)
    try:
        peak = max(float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                         - m.alias_size_in_bytes)
                   for m in (c.memory_analysis() for c in compiled_steps))
    except Exception:  # noqa: BLE001 (not every backend reports it)
        peak = None
    if peak is None or limit is None:
        # CPU devices share host memory, which the run's own check already sized
        return on_cpu, "the step's memory is unknown"
    need = peak + extra
    fits = need <= HEADROOM * limit
    return fits, (f"the step's {peak / 1e9:.3g} GB and a {extra / 1e9:.3g} GB copy of the state "
                  f"{'fit' if fits else 'do not fit'} a device's {limit / 1e9:.3g} GB")


@functools.cache
def _copier(treedef, shardings: tuple):
    return jax.jit(lambda tree: jax.tree.map(jnp.copy, tree),
                   out_shardings=jax.tree.unflatten(treedef, shardings))


def copy_state(params, opt_state):
    """(params, opt_state) copied on their devices, placed as they are (one compiled program,
    dispatched asynchronously after the step that made them)."""
    tree = (params, opt_state)
    leaves, treedef = jax.tree.flatten(tree)
    return _copier(treedef, tuple(leaf.sharding for leaf in leaves))(tree)
