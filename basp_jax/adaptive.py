"""Adaptive layouts: per step, the layout with the most groups whose rows hold the step's documents.

A static BASP run fixes B rows of S tokens on B groups of N/B devices. A step whose documents all
fit in S/k tokens can run k*B rows of S/k tokens on k*B groups of N/(kB) devices instead: the same
tokens (and so the same memory) per device, but every all-to-all inside k times fewer devices,
and often inside one host where the static layout's crossed hosts. This module makes the set
and moves the parameters between its layouts without copying them:

    layouts = layout_set(8, 1, 4096, 32, 8, devices_per_host=4)   # (1,8) (2,4) (4,2) (8,1)
    params = relabel(params, shardings_of_the_next_layout)          # no copy, no transfer

Which layout a step takes and its rows: basp_jax.packing (pack_microbatches); whether adapting
pays: basp_jax.planner.gain.

Why switching layouts moves no parameter: under 'fsdp' a parameter is split over the flattened
('group', 'seq') axes, i.e. over all N devices in the mesh's flattened device order, and
make_mesh lays every (g, sp) out as the same host-major device list reshaped, so that order is
the same for every layout of the set (and so is the fallback dimension ShardingRules picks when
N does not divide the split one: it depends on N only). 'host' places parameters on
('host', 'local'), the same list reshaped by devices per host, whatever (g, sp) is.
'replicated' is the same everywhere. 'hsdp' splits over 'seq' only, replicated over 'group':
its placement changes with sp, so a switch would move every parameter; it is refused.
Optimizer state follows the parameters' shardings, so it does not move either.

Nothing here imports models or train: a step is any function of a Layout (LayoutSteps caches
one compiled step per layout of the set).
"""

from __future__ import annotations

from typing import Callable

import jax

from .layout import Layout, LayoutError, mode_of
from .mesh import GROUP, SEQ
from .sharding import PARAM_SHARDINGS


# ------------------------------------------------------------------------------------ the set

def shares_placement(param_sharding: str) -> bool:
    """Whether parameters under this strategy (basp_jax.sharding.PARAM_SHARDINGS) sit on the same
    devices in every layout of a set: split over the whole flattened mesh, per host, or nowhere.
    A split over part of the ('group', 'seq') mesh (hsdp: 'seq') follows the layout's sp."""
    strategy = PARAM_SHARDINGS.get(param_sharding)  # (a ValueError naming the choices)
    return strategy.per_host or tuple(strategy.split_axes) in ((), (GROUP, SEQ))


def check_param_sharding(param_sharding: str) -> None:
    """Raise a one-line LayoutError for a strategy whose parameters would move between layouts."""
    if not shares_placement(param_sharding):
        ok = [name for name in PARAM_SHARDINGS.names() if shares_placement(name)]
        raise LayoutError(
            f"param_sharding={param_sharding!r} places parameters by the layout's sp, so switching "
            f"layouts would move every parameter; adaptive layouts need one of {', '.join(ok)}")


def host_ring(sp: int, devices_per_host: int) -> int:
    """The ring that keeps each all-to-all inside one host when a seq group spans hosts (1 when
    it does not, or when the hosts do not tile the group)."""
    if sp <= devices_per_host or sp % devices_per_host:
        return 1
    return sp // devices_per_host


def expand(base: Layout, *, param_sharding: str = "fsdp", host_rings: bool = False,
           zigzag: bool = False) -> tuple[Layout, ...]:
    """The adaptive set grown from a static layout: base, then for k = 2, 4, ... the layout of
    k*B rows of S/k tokens on k*groups groups, while k*groups divides the devices and k divides
    S. A k that Layout.plan refuses (S/k not divisible by the smaller sp or 2*sp under zig-zag,
    heads that need padding when base did not pad) is left out and the next k still tried: the
    set is whatever subset of the powers of two is valid, so the choice never compiles a layout
    that cannot run. host_rings: a layout whose seq group spans hosts runs its all-to-all inside
    each host and a ring across them (ring = sp / devices_per_host), as basp_jax.planner.cost offers,
    in zig-zag token order with zigzag (or when base has it; Layout.plan drops zigzag without a
    ring, so a ringless base cannot carry it).
    Base layouts with pad_rows are refused: which rows are masked has no meaning once the rows
    are repacked."""
    check_param_sharding(param_sharding)
    if base.pad_rows:
        raise LayoutError(f"an adaptive set needs a layout without pad rows, got "
                          f"pad_rows={base.pad_rows}; use a batch the groups divide")
    zigzag = zigzag or base.zigzag
    if host_rings:
        base = base.replan(ring=host_ring(base.sp, base.devices_per_host), zigzag=zigzag)
    found, k = [base], 2
    while base.groups * k <= base.num_devices:
        groups = base.groups * k
        if base.num_devices % groups == 0 and base.seq_len % k == 0:
            sp = base.num_devices // groups
            ring = host_ring(sp, base.devices_per_host) if host_rings else 1
            try:
                found.append(base.replan(batch=base.batch * k, seq_len=base.seq_len // k,
                                         groups=groups, mode=mode_of(groups), ring=ring,
                                         zigzag=zigzag))
            except LayoutError:
                pass
        k *= 2
    return tuple(found)


def layout_set(num_devices: int, batch: int, seq_len: int, num_heads: int,
               num_kv_heads: int | None = None, devices_per_host: int | None = None, *,
               mode: str = "basp", groups: int | None = None, param_sharding: str = "fsdp",
               pad_heads: bool = False, zigzag: bool = False, host_rings: bool = False
               ) -> tuple[Layout, ...]:
    """The static layout Layout.plan makes of these arguments, then its adaptive siblings
    (expand): every layout over the same devices in the same order, most groups last."""
    check_param_sharding(param_sharding)
    base = Layout.plan(num_devices, batch, seq_len, num_heads, num_kv_heads,
                       devices_per_host=devices_per_host, mode=mode, groups=groups,
                       pad_heads=pad_heads, zigzag=zigzag)
    return expand(base, param_sharding=param_sharding, host_rings=host_rings, zigzag=zigzag)


def relabel(tree, shardings):
    """`tree`'s arrays carrying `shardings` (a pytree like it, of Shardings or of arrays whose
    shardings to take): the step of another layout of the set takes parameters placed for this
    one only after this, and it copies nothing. A LayoutError when a leaf's placement differs
    (that would be a transfer, which an adaptive switch must never do).

    Why it is needed at all: jit accepts the other mesh's arrays as inputs (it compiles the same
    program: the placements are equivalent), but names the shardings of outputs it infers on the
    first argument's mesh, and an activation split over 'group' of another group count cannot
    be named there (jax's IndivisibleError); relabelled, the step's own mesh is the only one.
    Not jax.device_put: for an array that spans processes it runs an identity program, a copy
    of every parameter (jax._src.dispatch._different_device_order_reshard)."""
    def one(x, target):
        target = getattr(target, "sharding", target)
        if not x.sharding.is_equivalent_to(target, x.ndim):
            here, there = (getattr(s, "spec", s) for s in (x.sharding, target))
            raise LayoutError(f"an array of shape {tuple(x.shape)} is placed {here} here and "
                              f"{there} in the other layout: switching would move it; use a "
                              f"param_sharding that shares_placement")
        # The same per-device buffers under the new name: no copy, no program, no communication,
        # also where jax.device_put would run an identity program (arrays spanning processes).
        return jax.make_array_from_single_device_arrays(
            x.shape, target, [shard.data for shard in x.addressable_shards])

    return jax.tree.map(one, tree, shardings)


class LayoutSteps:
    """One compiled step per layout, built on first use: `steps(layout)(*args)`. `build(layout)`
    returns the (jitted) step for that layout's shapes and mesh; each is built once, so a run
    that visits every layout compiles len(set) programs, never one per step."""

    def __init__(self, build: Callable[[Layout], Callable]):
        self._build = build
        self._steps: dict[Layout, Callable] = {}

    def __call__(self, layout: Layout) -> Callable:
        if layout not in self._steps:
            self._steps[layout] = self._build(layout)
        return self._steps[layout]

    def __len__(self) -> int:
        return len(self._steps)
