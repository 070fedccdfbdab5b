"""How the work of one microbatch is split over devices: the one object everything else asks.

A layout splits N devices into `groups` disjoint groups of `sp` devices (groups * sp == N). The
microbatch [B, S] is sharded over groups by rows and over the devices of a group by sequence, so
every device holds B*S/N tokens. Attention exchanges heads for sequence inside a group only.

    ulysses: groups = 1, sp = N          (one N-way all-to-all per projection)
    basp:    groups = gcd(B, N), sp = N / groups   (B | N gives the paper's groups = B)

The layout also knows what follows from the split: the query-head padding and kv-head
replication of the all-to-all, the ring's runs and hops, the masked pad rows, and the token
order along the sequence (zig-zag under a causal ring). Every constraint is checked here, before
anything compiles, and a violation raises a LayoutError whose single line names the numbers and
what would work.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .registry import Registry


@dataclasses.dataclass(frozen=True)
class Mode:
    """A way to choose the split: `groups` fixes the group count (None: any that divides both the
    batch and the devices, gcd(batch, devices) by default); auto: whether the planner
    (basp_jax.planner.cost, parallel.mode=auto) may plan layouts under it; doc: what the config reference
    says of it."""

    groups: int | None
    doc: str
    auto: bool = True

    def allows(self, groups: int) -> bool:
        return self.groups is None or groups == self.groups


# Layout.plan's `mode`, parallel.mode (which adds "auto": the planner picks among the modes it may)
MODES: Registry[Mode] = Registry("parallel mode")
MODES.register("basp", Mode(None, "one group per sequence where the batch allows: groups = "
                                  "gcd(microbatch, devices), each all-to-all inside its group"))
MODES.register("ulysses", Mode(1, "one group: every all-to-all spans all devices"))


def mode_of(groups: int) -> str:
    """The mode a split into `groups` groups reads as: the one that fixes that count (1:
    ulysses), else the first that takes any."""
    fixed = [name for name, m in MODES.items() if m.groups == groups]
    return fixed[0] if fixed else _free_mode()


def auto_mode(groups: int) -> str | None:
    """The mode the planner plans a split into `groups` groups under: the first it may pick
    (Mode.auto) that allows the count; None: the planner does not try that split."""
    return next((name for name, m in MODES.items() if m.auto and m.allows(groups)), None)


def _free_mode() -> str:
    """The first mode that takes any group count (basp)."""
    return next(name for name, m in MODES.items() if m.groups is None)


class LayoutError(ValueError):
    """A layout that cannot work; the message says why and what would."""


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending: pairs (d, n // d) up to sqrt(n), so a device count of 1e11
    answers at once (trying every integer up to n never did)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _require_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise LayoutError(f"{name} must be a positive integer, got {value!r}")


def kv_replication(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """How many copies of each kv head make the kv heads divisible by sp (1 when they already are).

    The fewest copies r with (num_kv_heads * r) % sp == 0; since both num_kv_heads and sp divide
    num_heads, num_kv_heads * r = lcm(num_kv_heads, sp) also divides num_heads, so the grouped
    query-to-kv mapping stays intact after replication.
    """
    return sp // math.gcd(num_kv_heads, sp)


def head_padding(num_heads: int, num_kv_heads: int, sp: int) -> tuple[int, int]:
    """(kv heads, query heads per kv head) after padding, so that the query heads divide sp.

    Zero heads are added per kv group (more query heads per kv head) and/or as whole extra kv
    groups, choosing the fewest padded query heads: 28 heads / 4 kv on sp=8 -> 4 x 8 = 32, and
    28 heads of plain MHA on sp=8 -> 32 x 1. Padded heads have zero queries, keys and values and
    their outputs are dropped, so results and gradients are exact. (num_kv_heads, group) when no
    padding is needed.
    """
    group = num_heads // num_kv_heads
    best = None
    for kv in range(num_kv_heads, num_kv_heads + sp + 1):
        if best is not None and kv * group > best[0][0]:
            break  # this and every later kv pad to more query heads than the best
        step = sp // math.gcd(kv, sp)  # kv * g is a multiple of sp exactly when step divides g
        g = -(-group // step) * step  # the fewest query heads per kv head, >= group
        key = (kv * g, kv_replication(kv * g, kv, sp) * kv)
        if best is None or key < best[0]:
            best = (key, (kv, g))
    return best[1]


def zigzag_order(seq_len: int, ring: int) -> np.ndarray:
    """The zig-zag sequence permutation of a causal ring: positions in the order devices hold them.

    The sequence is cut into 2 x ring halves and run r of the ring holds halves r and
    2*ring-1-r, so every run does the same causal work at every ring step. Feed
    `x[:, zigzag_order(S, ring)]` (tokens, targets, positions, segment ids alike); undo it with
    `np.argsort` of the same order. Layout.token_order is this for a layout with zigzag.
    """
    if seq_len % (2 * ring):
        raise LayoutError(f"seq_len={seq_len} must be divisible by 2 * ring = {2 * ring} for zigzag")
    half = seq_len // (2 * ring)
    halves = [j for r in range(ring) for j in (r, 2 * ring - 1 - r)]
    return np.concatenate([np.arange(j * half, (j + 1) * half) for j in halves])


def _groups(num_devices: int, batch: int, devices_per_host: int, mode: str,
            groups: int | None) -> int:
    """The group count Layout.plan takes: `groups` checked, or the mode's (MODES: gcd(batch,
    devices) for basp, 1 for ulysses)."""
    if mode not in MODES:
        raise LayoutError(MODES.unknown(mode))
    fixed = MODES.get(mode).groups
    if num_devices % devices_per_host:
        raise LayoutError(
            f"devices_per_host={devices_per_host} does not divide num_devices={num_devices}; "
            f"every host must hold the same number of devices (one of {divisors(num_devices)})"
        )
    if groups is None:
        return math.gcd(batch, num_devices) if fixed is None else fixed
    if fixed is not None and groups != fixed:
        raise LayoutError(f"mode={mode!r} means groups={fixed}, got groups={groups}; use "
                          f"mode={_free_mode()!r}")
    if num_devices % groups:
        raise LayoutError(
            f"groups={groups} does not divide num_devices={num_devices}; "
            f"use groups in {divisors(num_devices)}"
        )
    if batch % groups:
        raise LayoutError(
            f"batch={batch} is not divisible by groups={groups}; use a batch that is a "
            f"multiple of {groups} or groups in "
            f"{[g for g in divisors(num_devices) if batch % g == 0]}"
        )
    return groups


def _check_sequence(seq_len: int, sp: int, ring: int, num_devices: int) -> None:
    """Each device of a group holds seq_len / sp tokens; a ring splits the group evenly."""
    if seq_len % sp:
        padded = -(-seq_len // sp) * sp
        fitting_sp = [d for d in divisors(num_devices) if seq_len % d == 0]
        raise LayoutError(
            f"seq_len={seq_len} is not divisible by sp={sp}; use a multiple of {sp} "
            f"(e.g. {seq_len} -> {padded} with padding) or a layout with sp in {fitting_sp}"
        )
    if sp % ring:
        raise LayoutError(f"ring={ring} does not divide sp={sp}; use ring in {divisors(sp)}")


def _check_heads(num_heads: int, num_kv_heads: int, sp: int, ring: int, pad_heads: bool,
                 num_devices: int) -> None:
    """Grouped-query heads, and whole query heads per device after the all-to-all (or padding)."""
    if num_heads % num_kv_heads:
        raise LayoutError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
            f"grouped-query attention needs kv heads in {divisors(num_heads)}"
        )
    a2a = sp // ring
    if num_heads % a2a and not pad_heads:
        fitting_sp = [d for d in divisors(num_devices) if num_heads % d == 0]
        kv, g = head_padding(num_heads, num_kv_heads, a2a)
        ring_fit = sp // math.gcd(num_heads, sp)
        raise LayoutError(
            f"num_heads={num_heads} is not divisible by the all-to-all degree {a2a} (sp={sp}, "
            f"ring={ring}): each device needs whole query heads; use a layout with sp in "
            f"{fitting_sp} (more groups, e.g. a larger batch), ring={ring_fit} (ring attention "
            f"across runs of {sp // ring_fit}), or pad_heads=True to compute {kv * g} heads "
            f"({kv * g - num_heads} of them zero padding)"
        )


@dataclasses.dataclass(frozen=True)
class Layout:
    """An immutable, validated split of a microbatch over devices. Build it with Layout.plan.

    `batch` counts the rows of a microbatch with the `pad_rows` masked rows included.
    """

    num_devices: int
    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    groups: int
    sp: int
    devices_per_host: int
    mode: str
    pad_heads: bool = False
    ring: int = 1
    zigzag: bool = False  # the sequence axis is in token_order (zigzag_order), not natural order
    pad_rows: int = 0  # masked rows added to the microbatch to make the split possible

    @classmethod
    def plan(
        cls,
        num_devices: int,
        batch: int,
        seq_len: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        devices_per_host: int | None = None,
        mode: str = "basp",
        groups: int | None = None,
        pad_heads: bool = False,
        ring: int = 1,
        zigzag: bool = False,
        pad_rows: int = 0,
    ) -> "Layout":
        """Choose and validate a layout.

        mode="basp" takes groups = gcd(batch, num_devices) (= batch when batch divides the device
        count, the paper's case); mode="ulysses" takes groups = 1. `groups` forces a group count
        (it must divide both batch and num_devices). `pad_rows` masked rows are added to the
        `batch` rows first (the layout's batch counts them). zigzag=True puts the sequence in
        zig-zag order when a ring splits it (ring > 1), balancing the causal work; it has no
        effect without a ring.
        """
        if not isinstance(pad_rows, int) or isinstance(pad_rows, bool) or pad_rows < 0:
            raise LayoutError(f"pad_rows must be a non-negative integer, got {pad_rows!r}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        devices_per_host = num_devices if devices_per_host is None else devices_per_host
        _require_positive(
            num_devices=num_devices,
            batch=batch,
            seq_len=seq_len,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            devices_per_host=devices_per_host,
            groups=groups,
            ring=ring,
        )
        batch += pad_rows  # the rows the devices hold
        groups = _groups(num_devices, batch, devices_per_host, mode, groups)
        sp = num_devices // groups
        _check_sequence(seq_len, sp, ring, num_devices)
        _check_heads(num_heads, num_kv_heads, sp, ring, pad_heads, num_devices)
        zigzag = bool(zigzag) and ring > 1
        if zigzag and seq_len % (2 * sp):
            raise LayoutError(
                f"zig-zag ring attention needs seq_len divisible by 2 * sp = {2 * sp}, got "
                f"seq_len={seq_len}; use a multiple of {2 * sp} or zigzag=False"
            )
        a2a = sp // ring
        return cls(
            num_devices=num_devices,
            batch=batch,
            seq_len=seq_len,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            groups=groups,
            sp=sp,
            devices_per_host=devices_per_host,
            mode=mode,
            pad_heads=bool(num_heads % a2a),
            ring=ring,
            zigzag=zigzag,
            pad_rows=pad_rows,
        )

    def replan(self, **changes) -> "Layout":
        """This layout planned again with some of Layout.plan's arguments changed (validated):
        `layout.replan(zigzag=False)`, or the same split for arrays of other sizes."""
        args = dict(num_devices=self.num_devices, batch=self.batch - self.pad_rows,
                    seq_len=self.seq_len, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, devices_per_host=self.devices_per_host,
                    mode=self.mode, groups=self.groups, pad_heads=self.pad_heads, ring=self.ring,
                    zigzag=self.zigzag, pad_rows=self.pad_rows)
        return Layout.plan(**{**args, **changes})

    @property
    def a2a(self) -> int:
        """Devices that exchange sequence for heads in one all-to-all (sp / ring)."""
        return self.sp // self.ring

    @property
    def head_groups(self) -> tuple[int, int]:
        """(kv heads, query heads per kv head) after zero-padding (head_padding): the unpadded
        (num_kv_heads, num_heads // num_kv_heads) unless the all-to-all degree needs padding."""
        return head_padding(self.num_heads, self.num_kv_heads, self.a2a)

    @property
    def padded_heads(self) -> int:
        """Query heads computed per layer, zero padding included (num_heads unless padded)."""
        kv, g = self.head_groups
        return kv * g

    @property
    def kv_replication(self) -> int:
        """Copies of each kv head sent through the all-to-all (1 unless the kv heads, padded
        ones included, are not divisible by sp)."""
        kv, g = self.head_groups
        return kv_replication(kv * g, kv, self.a2a)

    @property
    def exchanged_heads(self) -> tuple[int, int]:
        """(query heads, kv heads) each all-to-all exchanges: padded and replicated."""
        return self.padded_heads, self.head_groups[0] * self.kv_replication

    @property
    def a2a_runs(self) -> list[list[int]]:
        """`seq` axis indices of each all-to-all run: `ring` runs of a2a consecutive devices."""
        return [[r * self.a2a + i for i in range(self.a2a)] for r in range(self.ring)]

    @property
    def ring_hops(self) -> list[tuple[int, int]]:
        """(from, to) `seq` indices of one ring step: each device passes its k/v chunk to the
        same position of the next run."""
        inner, ring = self.a2a, self.ring
        return [(r * inner + i, ((r + 1) % ring) * inner + i)
                for r in range(ring) for i in range(inner)]

    @property
    def token_order(self) -> np.ndarray | None:
        """The order of the sequence axis: None (natural), or the zig-zag permutation
        (zigzag_order) that the data, positions and segment ids must follow."""
        return zigzag_order(self.seq_len, self.ring) if self.zigzag else None

    @property
    def rows_per_group(self) -> int:
        return self.batch // self.groups

    @property
    def tokens_per_device(self) -> int:
        return self.batch * self.seq_len // self.num_devices

    @property
    def num_hosts(self) -> int:
        return self.num_devices // self.devices_per_host

    @property
    def group_within_host(self) -> bool:
        """True when every seq group lies inside one host, so its all-to-all never leaves it."""
        return self.sp <= self.devices_per_host and self.devices_per_host % self.sp == 0

    @property
    def short_name(self) -> str:
        """(groups, sp) as the trainer's metrics and logs name it: "2x4", "1x8/ring2"."""
        return f"{self.groups}x{self.sp}" + (f"/ring{self.ring}" if self.ring > 1 else "")

    def describe(self) -> str:
        where = "inside one host" if self.group_within_host else "across hosts"
        ring = f" (ring {self.ring} x all-to-all {self.a2a})" if self.ring > 1 else ""
        return (
            f"{self.mode}: {self.groups} group(s) x sp={self.sp}{ring} on {self.num_devices} devices "
            f"({self.num_hosts} host(s)); {self.rows_per_group} row(s) per group, "
            f"{self.tokens_per_device} tokens per device; all-to-all {where}"
        )
