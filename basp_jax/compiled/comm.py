"""Collectives read from a compiled program: kind, bytes per device, and the device groups.

    report = compiled_collectives(jax.jit(step), *args)     # or parse_collectives(hlo_text)
    for c in report: print(c.kind, c.bytes, c.groups)

The groups are logical device ids of the program (the order of the mesh's devices, flattened).
Every printing of replica groups seen from jax 0.10 to 0.12 is understood: explicit lists
`{{0,1,2,3},{4,5,6,7}}`, the iota form `[2,4]<=[8]` / `[4,2]<=[2,4]T(1,0)`, mesh axes
`mesh['group'=2,'seq'=4] {'seq'}`, and mesh axes over permuted devices
`mesh['axis_0'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}`.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Callable, Iterable, Sequence

import numpy as np

from . import hlo

KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}
_OP_RE = re.compile(r"^(all-to-all|all-gather|reduce-scatter|all-reduce|collective-permute)(-start)?$")
_ARRAY_RE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program."""

    kind: str  # one of KINDS
    dtype: str
    bytes: int  # the full (unsharded-within-group) buffer each device handles, see below
    groups: tuple[tuple[int, ...], ...]  # logical device ids, one tuple per group
    executions: int = 1  # times it runs per program execution (inside loops: the trip count)
    op_name: str = ""  # the instruction's op_name metadata: the scopes of the code that made it

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 1

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends, for a bandwidth-optimal algorithm on its group.

        all-to-all, all-gather, reduce-scatter: (n-1)/n of the buffer; all-reduce: 2(n-1)/n;
        collective-permute: the whole buffer.
        """
        n = self.group_size
        if self.kind == "collective-permute":
            return float(self.bytes)
        factor = 2.0 if self.kind == "all-reduce" else 1.0
        return factor * self.bytes * (n - 1) / n


def _array_sizes(shape_text: str) -> list[tuple[str, int]]:
    out = []
    for dtype, dims in _ARRAY_RE.findall(shape_text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        out.append((dtype, n * _DTYPE_BYTES[dtype]))
    return out


def _iota_groups(text: str) -> list[list[int]]:
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    out_shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(out_shape).tolist()


def _mesh_groups(text: str) -> list[list[int]]:
    """`mesh['a'=2,'b'=4] {'b'}`: groups vary the named axes with the others fixed. A
    `device_ids=([2,4]T(1,0))` part gives the device at each mesh position (an iota reshaped and
    transposed, or an explicit list); without it the devices are in order."""
    m = re.match(r"mesh\[(.*?)\](?:,\s*device_ids=\((.*?)\))?\s*\{(.*?)\}", text)
    axes = re.findall(r"'?(\w+)'?\s*=\s*(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    total = int(np.prod(sizes))
    ids = np.arange(total)
    if m.group(2):
        spec = m.group(2).strip()
        iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
        if iota:
            ids = ids.reshape([int(x) for x in iota.group(1).split(",")])
            if iota.group(2):
                ids = ids.transpose([int(x) for x in iota.group(2).split(",")])
        else:
            ids = np.array([int(x) for x in re.findall(r"\d+", spec)])
    ids = ids.reshape(sizes)
    # Varying axes are 'name' or a sub-axis 'name':(pre)size: the factor of `size` devices that
    # follows factors of `pre` devices in the axis (several sub-axes of one axis may vary, in any
    # order). Each axis is cut into factors at every boundary named, major first.
    varying = re.findall(r"'?(\w+)'?(?::\((\d+)\)(\d+))?", m.group(3))
    bounds = {name: {1, size} for name, size in zip(names, sizes)}
    for name, pre, size in varying:
        if pre:
            bounds[name] |= {int(pre), int(pre) * int(size)}
    factors, shape = [], []  # (axis, devices before it in the axis, through it), its size
    for name in names:
        cuts = sorted(bounds[name])
        for lo, hi in zip(cuts, cuts[1:]):
            factors.append((name, lo, hi))
            shape.append(hi // lo)
    ids = ids.reshape(shape)
    chosen = []
    for name, pre, size in varying:
        lo, hi = (int(pre), int(pre) * int(size)) if pre else (1, sizes[names.index(name)])
        chosen += [i for i, (n, a, b) in enumerate(factors) if n == name and a >= lo and b <= hi]
    order = [i for i in range(len(factors)) if i not in chosen] + chosen
    group_size = int(np.prod([shape[i] for i in chosen])) if chosen else 1
    return ids.transpose(order).reshape(-1, group_size).tolist()


def _parse_groups(line: str, num_devices: int | None) -> list[list[int]]:
    if "source_target_pairs=" in line:
        pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line).group(1)
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs)]
    m = re.search(r"replica_groups=(mesh\[.*?\](?:,\s*device_ids=\(.*?\))?\s*\{.*?\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|\{.*?\}\})", line)
    if m is None:
        m_empty = re.search(r"replica_groups=\{\}", line)
        if m_empty is None or num_devices is None:
            return []
        return [list(range(num_devices))]
    text = m.group(1)
    if text.startswith("mesh["):
        return _mesh_groups(text)
    if text.startswith("["):
        return _iota_groups(text)
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", text[1:-1])]


def _top_level(shape_text: str, keep_layouts: bool = False) -> list[str]:
    """The elements of a tuple shape `(a, (b, c), d)`; [shape] if not a tuple. Layouts are
    dropped unless keep_layouts (a layout says which memory space an array is in: {...:S(5)} is
    pinned host memory)."""
    text = (shape_text if keep_layouts else re.sub(r"\{[^{}]*\}", "", shape_text)).strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                parts.append(text[start:i])
                break
        elif ch == "," and depth == 1:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in parts if p.strip()]


def _buffers(kind: str, async_start: bool, shape: str) -> tuple[list[tuple[str, int]], bool]:
    """(arrays of the buffer that counts, whether those are the operands) of one collective.

    Synchronous ops (CPU programs) print their result. Async starts (GPU programs) print a tuple:
    all-to-all, all-gather and reduce-scatter starts hold (operands, results[, context]);
    collective-permute starts (operand, result, contexts...). All-reduce starts hold only the
    results under jax 0.10's XLA (`(f32[8], f32[4])` when combined), but (operands, results) under
    newer ones, the operands always a tuple: `((bf16[2048]), bf16[2048])`.
    The counted buffer is the results, except for reduce-scatter: its operands (the full buffer).
    """
    if not async_start:
        return _array_sizes(shape), False
    parts = _top_level(shape)
    if kind == "all-reduce":
        operands_first = len(parts) == 2 and parts[0].startswith("(")
        return _array_sizes(parts[1] if operands_first else shape), False
    if len(parts) < 2:
        return _array_sizes(shape), False
    if kind == "reduce-scatter":
        return _array_sizes(parts[0]), True
    return _array_sizes(parts[1]), False


def parse_collectives(hlo_text: str, num_devices: int | None = None) -> list[Collective]:
    """Every collective in an HLO module's text, CPU (synchronous) or GPU (async start/done pairs,
    counted once at the start), each with how often it runs per program execution (loop bodies
    with a known trip count run that many times, see basp_jax.compiled.hlo)."""
    found = []
    for inst in hlo.instructions(hlo_text):
        m = _OP_RE.match(inst.op)
        if m is None:
            continue
        kind, async_start = m.group(1), bool(m.group(2))
        sizes, operands = _buffers(kind, async_start, inst.shape)
        if not sizes:
            continue
        groups = _parse_groups(inst.line, num_devices)
        n = len(groups[0]) if groups else 1
        total = sum(b for _, b in sizes)
        if kind == "reduce-scatter" and not operands:
            total *= n  # the result is one shard of the reduced buffer
        # XLA's combiners may merge arrays of several dtypes into one collective (with the GPU
        # defaults of train.process.gpu_defaults, a layer's s32 positions ride with its bf16 weights):
        # it is named by the dtype that carries most of its bytes
        by_dtype: dict[str, int] = defaultdict(int)
        for dtype, b in sizes:
            by_dtype[dtype] += b
        dtype = max(by_dtype, key=lambda d: (by_dtype[d], d == sizes[0][0]))
        op_name = re.search(r'op_name="([^"]*)"', inst.line)
        found.append(Collective(kind, dtype, total, tuple(tuple(g) for g in groups),
                                inst.executions, op_name.group(1) if op_name else ""))
    return found


def in_unknown_loops(hlo_text: str) -> int:
    """How many collective instructions sit in a loop whose trip count XLA did not record
    (parse_collectives counts them once per run of their loop's caller)."""
    return sum(1 for inst in hlo.instructions(hlo_text)
               if inst.loop_unknown and _OP_RE.match(inst.op))


def compiled_collectives(fn: Callable, *args, **kwargs) -> list[Collective]:
    """Lower and compile a jitted function for these arguments (arrays or ShapeDtypeStructs)."""
    compiled = fn.lower(*args, **kwargs).compile()
    return parse_collectives(compiled.as_text())


def host_of(device_id: int, devices_per_host: int) -> int:
    return device_id // devices_per_host


def crosses_hosts(collective: Collective, devices_per_host: int) -> bool:
    return any(len({host_of(d, devices_per_host) for d in g}) > 1 for g in collective.groups)


def inter_host_wire_bytes(collective: Collective, devices_per_host: int) -> float:
    """The part of a device's wire bytes that goes to peers on other hosts (direct exchange).

    Each device sends an equal share to every peer of its group (all-to-all exactly; ring and tree
    algorithms move the same total), so the remote share is (remote peers) / (peers). Averaged over
    the devices of the program.
    """
    if collective.kind == "collective-permute":
        pairs = collective.groups
        remote = sum(host_of(a, devices_per_host) != host_of(b, devices_per_host) for a, b in pairs)
        return collective.bytes * remote / max(len({a for a, _ in pairs}), 1)
    shares = []
    for g in collective.groups:
        for d in g:
            remote = sum(host_of(p, devices_per_host) != host_of(d, devices_per_host) for p in g)
            shares.append(remote / max(len(g) - 1, 1))
    return collective.wire_bytes * (float(np.mean(shares)) if shares else 0.0)


def summarize(collectives: Iterable[Collective], devices_per_host: int | None = None) -> dict:
    """Per kind: count, bytes per device, wire bytes per device, inter-host wire bytes per device."""
    table: dict[str, dict[str, float]] = defaultdict(
        lambda: {"count": 0, "bytes": 0, "wire_bytes": 0.0, "inter_host_wire_bytes": 0.0}
    )
    for c in collectives:
        row = table[c.kind]
        row["count"] += c.executions
        row["bytes"] += c.bytes * c.executions
        row["wire_bytes"] += c.wire_bytes * c.executions
        if devices_per_host is not None:
            row["inter_host_wire_bytes"] += inter_host_wire_bytes(c, devices_per_host) * c.executions
    return dict(table)


def format_table(collectives: Sequence[Collective], devices_per_host: int | None = None) -> str:
    """A plain-text table of the collectives, one row per kind."""
    rows = summarize(collectives, devices_per_host)
    lines = [f"{'kind':<20}{'count':>6}{'MiB/device':>12}{'wire MiB':>10}{'inter-host MiB':>16}"]
    for kind in KINDS:
        if kind in rows:
            r = rows[kind]
            lines.append(
                f"{kind:<20}{r['count']:>6}{r['bytes'] / 2**20:>12.3f}{r['wire_bytes'] / 2**20:>10.3f}"
                f"{r['inter_host_wire_bytes'] / 2**20:>16.3f}"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- host transfers

HOST_MEMORY_SPACE = "S(5)"  # how XLA marks an array in pinned host memory in a layout: {...:S(5)}
_LAYOUT_ARRAY_RE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\](\{[^}]*\})?")


def _arrays(shape_text: str) -> list[tuple[int, bool]]:
    """(bytes, in host memory) of every array in a shape text."""
    out = []
    for dtype, dims, layout in _LAYOUT_ARRAY_RE.findall(shape_text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        out.append((n * _DTYPE_BYTES[dtype], HOST_MEMORY_SPACE in (layout or "")))
    return out


def host_transfers(hlo_text: str) -> dict[str, float]:
    """Bytes one device copies to and from pinned host memory per program execution (an
    offload policy's residuals: basp_jax.remat), from a compiled GPU program's async copies
    between memory spaces: dynamic-update-slices into host buffers (to host), dynamic-slices out
    of them and copies (from host), each counted as often as it runs."""
    out = {"to_host_bytes": 0.0, "from_host_bytes": 0.0, "to_host_count": 0, "from_host_count": 0}
    for inst in hlo.instructions(hlo_text):
        if inst.op not in ("fusion-start", "copy-start") or HOST_MEMORY_SPACE not in inst.shape:
            continue
        parts = _top_level(inst.shape, keep_layouts=True)
        if len(parts) < 2:
            continue
        # fusion-start: ((operands...), result, context); copy-start: (result, operand, context)
        result, operands = (parts[1], parts[0]) if inst.op == "fusion-start" else \
            (parts[0], parts[1])
        result_arrays = _arrays(result)
        if not result_arrays:
            continue
        result_bytes, result_on_host = result_arrays[0]
        if result_on_host:  # written into a host buffer: the device-side operand moves
            moved = max((b for b, on_host in _arrays(operands) if not on_host), default=0)
            direction = "to_host"
        else:
            if not any(on_host for _, on_host in _arrays(operands)):
                continue
            moved, direction = result_bytes, "from_host"
        out[f"{direction}_bytes"] += moved * inst.executions
        out[f"{direction}_count"] += inst.executions
    return out
