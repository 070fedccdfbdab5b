"""A checkpoint whose layers are laid out otherwise than this run's model restores into this run's
layout: a list of layers (model.scan_layers=false, or written before a hybrid's layers were
stacked) against a scanned stack, alike layers' or by period (models.layer_stack). The
checkpoint's arrays are read onto the devices in its own layout (each with this run's sharding
of the same values), then restacked there by one compiled program into this run's shardings.

A layout is named by parameter paths: `None` for a list ('layers', i, ...), the period of a
stack otherwise (1: ('layers', <name>, ...); p: ('layers', 'blocks', j, ...)).
"""

from __future__ import annotations

import re

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from models import layer_stack
from models.transformer import PERIOD_BLOCKS

_LIST = re.compile(r"(^|\.)layers\.(\d+)\.")
_PERIOD = re.compile(rf"(^|\.)layers\.{PERIOD_BLOCKS}\.(\d+)\.")
_STACK = re.compile(r"(^|\.)layers\.")


def layout_of(names) -> int | None | str:
    """The layers' layout of flat parameter names ('layers.0.x', 'layers.blocks.1.x',
    'layers.x'): None (a list), the period of a stack, or "" where no name has layers."""
    names = list(names)
    if any(_LIST.search(n) for n in names):
        return None
    periods = [int(m.group(2)) for n in names if (m := _PERIOD.search(n))]
    if periods:
        return 1 + max(periods)
    return 1 if any(_STACK.search(n) for n in names) else ""


def shapes_in_layout(shapes: dict[str, tuple], period: int | None) -> dict[str, tuple]:
    """Flat {name: shape} (train.checkpoint.store's) of one layout as `period`'s would be."""
    listed = {}
    source = layout_of(shapes)
    for name, shape in shapes.items():
        if source is None or source == "" or not _STACK.search(name):
            listed[name] = shape
            continue
        m = _PERIOD.search(name)
        head = name[:_STACK.search(name).end()]
        rest = name[m.end():] if m else name[_STACK.search(name).end():]
        j, step = (int(m.group(2)), source) if m else (0, 1)
        for r in range(shape[0]):
            listed[f"{head}{r * step + j}.{rest}"] = shape[1:]
    if period is None:
        return listed
    out = {}
    for name, shape in listed.items():
        m = _LIST.search(name)
        if not m:
            out[name] = shape
            continue
        i, head, rest = int(m.group(2)), name[:m.start(2)], name[m.end():]
        block = f"{PERIOD_BLOCKS}.{i % period}." if period > 1 else ""
        key = f"{head}{block}{rest}"
        out[key] = (out[key][0] + 1, *shape) if key in out else (1, *shape)
    return out


def _with_spec(sharding, spec):
    """A NamedSharding like `sharding` (its mesh and memory kind: pinned host memory where the
    state is offloaded) placing by `spec`; another sharding kept as it is."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    return NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)


def _drop_layer_axis(s: jax.ShapeDtypeStruct, _r) -> jax.ShapeDtypeStruct:
    spec = tuple(getattr(s.sharding, "spec", ()))
    return jax.ShapeDtypeStruct(s.shape[1:], s.dtype,
                                sharding=_with_spec(s.sharding, P(*spec[1:])))


def _add_layer_axis(*xs: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    s = xs[0]
    spec = tuple(getattr(s.sharding, "spec", ()))
    return jax.ShapeDtypeStruct((len(xs), *s.shape), s.dtype,
                                sharding=_with_spec(s.sharding, P(None, *spec)))


def abstract_in_layout(abstract, period: int | None):
    """An abstract tree (ShapeDtypeStructs with this run's shardings) in another layers'
    layout: each layer's slice sharded as the stack's rest (the layer axis is never split)."""
    return layer_stack.restack(abstract, period, combine=_add_layer_axis,
                               take=_drop_layer_axis)


def restack_on_devices(tree, period: int | None, abstract):
    """`tree` (restored in another layout) in `period`'s, placed as `abstract`'s shardings, by
    one compiled program; its input is donated, but no buffer can be reused (every shape
    changes), so the devices hold both layouts at once: twice the tree for the moment."""
    shardings = jax.tree.map(lambda s: s.sharding, abstract)
    return jax.jit(lambda t: layer_stack.restack(t, period), out_shardings=shardings,
                   donate_argnums=0)(tree)
