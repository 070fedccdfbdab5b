"""Place a Layout on devices: a Mesh with axes ('group', 'seq') whose seq groups stay inside a host."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from .layout import Layout, LayoutError

GROUP, SEQ = "group", "seq"
AXES = (GROUP, SEQ)


def _host_major(devices: Sequence[jax.Device]) -> list[jax.Device]:
    """Devices ordered by process (host), then by local id, so consecutive runs share a host."""
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def make_mesh(layout: Layout, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh of shape (layout.groups, layout.sp) with axes ('group', 'seq').

    Each seq group is a run of `sp` consecutive devices in host-major order, so when sp divides the
    devices per host the group's all-to-all never leaves its host; groups span hosts. Axis types are
    Auto, so jit resharding and shard_map specs agree without explicit-sharding annotations.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != layout.num_devices:
        raise LayoutError(
            f"the layout is for {layout.num_devices} devices but {len(devices)} were given; "
            f"plan it with num_devices={len(devices)}"
        )
    ordered = _host_major(devices)
    per_host = _devices_per_process(ordered)
    if per_host is not None and per_host != layout.devices_per_host and jax.process_count() > 1:
        raise LayoutError(
            f"the layout assumes devices_per_host={layout.devices_per_host} but each process has "
            f"{per_host} devices; plan it with devices_per_host={per_host}"
        )
    grid = np.asarray(ordered, dtype=object).reshape(layout.groups, layout.sp)
    auto = (jax.sharding.AxisType.Auto,) * 2
    return Mesh(grid, AXES, axis_types=auto)


# Set while a caller maps the model over the 'group' axis itself (groups_mapped).
_GROUPS_MAPPED = contextvars.ContextVar("groups_mapped", default=False)


@contextlib.contextmanager
def groups_mapped():
    """Trace the model for one group's rows, under jax.vmap(..., spmd_axis_name='group') over
    the groups: activation specs leave the rows whole (the vmap puts them on 'group') and
    row_groups is 1: how a train step that keeps each group's gradient apart over its
    microbatches traces the model."""
    token = _GROUPS_MAPPED.set(True)
    try:
        yield
    finally:
        _GROUPS_MAPPED.reset(token)


def groups_are_mapped() -> bool:
    """Whether the model is being traced under groups_mapped."""
    return _GROUPS_MAPPED.get()


def unmapped_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's axes, less 'group' under groups_mapped (the caller's vmap holds it): those a
    shard_map inside the model may vary a value over or sum it over."""
    return tuple(a for a in mesh.axis_names if not (_GROUPS_MAPPED.get() and a == GROUP))


def checks_varying_axes() -> bool:
    """Whether a shard_map inside the model checks which axes its values vary over
    (check_vma): not under groups_mapped, where the weights vary over the groups already and
    jax's check does not follow them through the map."""
    return not _GROUPS_MAPPED.get()


def device_varying(w: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """A weight made device-varying over `axes` inside a shard_map, so that its cotangent adds
    up on the device and is summed over `axes` once, after a loop over chunks. Under
    groups_mapped, where such shard_maps run unchecked (checks_varying_axes), w itself: the
    map's transpose sums its cotangent over `axes` all the same."""
    return jax.lax.pcast(w, axes, to="varying") if checks_varying_axes() else w


def row_groups(mesh: Mesh) -> int:
    """How many groups the rows of an activation are split over: the mesh's 'group' size, or
    1 under groups_mapped."""
    return 1 if _GROUPS_MAPPED.get() else mesh.shape[GROUP]


def layout_on(mesh: Mesh, batch: int, seq_len: int, num_heads: int, num_kv_heads: int,
              like: Layout | None = None) -> Layout:
    """The Layout that runs arrays of these sizes on `mesh`: `like`'s split (ring, token order)
    or, without one, the mesh's plain split (no ring, natural order), query heads zero-padded
    where the all-to-all degree needs it. Raises LayoutError for sizes the mesh cannot split or
    a `like` planned for another mesh shape."""
    groups, sp = mesh.shape[GROUP], mesh.shape[SEQ]
    if groups_are_mapped():  # `batch` rows of each group
        batch *= groups
    sizes = dict(batch=batch, seq_len=seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads)
    if like is None:
        per_host = _devices_per_process(list(mesh.devices.flat)) or mesh.size
        return Layout.plan(mesh.size, **sizes, devices_per_host=per_host, groups=groups,
                           pad_heads=True)
    if (like.groups, like.sp) != (groups, sp):
        raise LayoutError(
            f"the layout splits groups={like.groups} x sp={like.sp} but the mesh is "
            f"{groups} x {sp}; build the mesh with basp_jax.make_mesh(layout)"
        )
    if all(getattr(like, name) == value for name, value in sizes.items()):
        return like
    return like.replan(**sizes, pad_heads=True, pad_rows=0)


def _devices_per_process(devices: Sequence[jax.Device]) -> int | None:
    counts: dict[int, int] = {}
    for d in devices:
        counts[d.process_index] = counts.get(d.process_index, 0) + 1
    sizes = set(counts.values())
    return sizes.pop() if len(sizes) == 1 else None


def mesh_groups(mesh: Mesh) -> list[list[int]]:
    """The device ids of each seq group (one list per group), for inspection and tests."""
    return [[d.id for d in row] for row in mesh.devices]
