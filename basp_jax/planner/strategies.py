"""How the planner weighs each parameter strategy: whether it tries it for a split, in which
order, and how it prices the gradient reduction the strategy adds. The strategies themselves
(where parameters are stored and used) are basp_jax.sharding.PARAM_SHARDINGS'; one registered
there without an entry here is never tried by the planner (a user names it in the config).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..sharding import PARAM_SHARDINGS


def _several_hosts(layout) -> bool:
    return layout.devices_per_host < layout.num_devices


@dataclasses.dataclass(frozen=True)
class Candidacy:
    """rank: the order the planner tries strategies in (fewest inter-host bytes first; on a
    fixed layout the last that applies is taken when none fits).
    applies(layout): whether it is tried for this split.
    same_as_another(layout): whether it shards exactly as another that applies (left out).
    sync: the gradient reduction per microbatch beyond the shard group's, as
        basp_jax.planner.traffic prices it: "groups" (the 1/sp shard all-reduced across
        groups), "hosts" (each element crosses hosts once), None."""

    rank: int
    applies: Callable[..., bool] = lambda layout: True
    same_as_another: Callable[..., bool] = lambda layout: False
    sync: str | None = None


# staged_keep ranks first: host's cross-host bytes (each gradient element crosses once, each
# device fetches the 1/N pieces its host lacks once) at FSDP's memory plus one host-local copy.
# staged_offload keeps that copy in host memory instead (FSDP's device memory; the copy crosses
# PCIe twice a microbatch), staged keeps none (gathered across hosts again for the backward).
CANDIDATES: dict[str, Candidacy] = {
    "staged_keep": Candidacy(0, _several_hosts),
    "host": Candidacy(1, _several_hosts, sync="hosts"),
    "staged_offload": Candidacy(2, _several_hosts),
    "staged": Candidacy(3, _several_hosts),
    "hsdp": Candidacy(
        4, lambda layout: layout.groups > 1,  # one group: it is fsdp
        # on hosts of one seq group each it shards as host does
        same_as_another=lambda layout: _several_hosts(layout)
        and layout.sp == layout.devices_per_host,
        sync="groups"),
    "fsdp": Candidacy(5),
}


def gradient_sync(param_sharding: str) -> str | None:
    """The gradient reduction a strategy adds beyond its shard group's (Candidacy.sync)."""
    PARAM_SHARDINGS.get(param_sharding)  # (a ValueError naming the choices)
    entry = CANDIDATES.get(param_sharding)
    return entry.sync if entry is not None else None


def ranked(layout, *, streamed: bool = False, distinct: bool = True,
           keep: Callable[[str], bool] = lambda name: True) -> list[str]:
    """The strategies the planner tries for `layout`, in rank order: those that apply, run in
    the streamed step where `streamed`, are not the same as another that applies where
    `distinct`, and pass `keep`."""
    chosen = [(c.rank, name) for name, c in CANDIDATES.items()
              if name in PARAM_SHARDINGS and c.applies(layout)
              and not (distinct and c.same_as_another(layout))
              and (not streamed or PARAM_SHARDINGS.get(name).streams) and keep(name)]
    return [name for _, name in sorted(chosen)]
