"""Whether adaptive layouts pay: the cost model's expected step time of the static layout and of
the adaptive choice, over steps of given document lengths.

    gain = predicted_gain(shape, layout_set(...), [[doc lengths of step 0], ...], hw=hw)
    gain.gain, gain.share(index)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..adaptive import check_param_sharding
from ..layout import Layout
from ..packing import choose_layout
from . import cost


@dataclasses.dataclass(frozen=True)
class Gain:
    """The cost model's expected step time of the static layout and of the adaptive choice over
    sampled steps; `chosen` holds each step's index in the set, `step_s` each layout's
    prediction (basp_jax.planner.cost.predict's step_s)."""

    static_s: float
    adaptive_s: float
    chosen: tuple[int, ...]
    step_s: tuple[float, ...]

    @property
    def gain(self) -> float:
        """Static over adaptive expected step time: > 1 when adapting pays."""
        return self.static_s / self.adaptive_s

    def share(self, index: int) -> float:
        """The fraction of steps that run layout `index` of the set."""
        return self.chosen.count(index) / len(self.chosen)


def predicted_gain(shape, layouts: Sequence[Layout], steps: Sequence[Sequence[int]], *, hw,
                   param_sharding: str = "fsdp", **predict_kwargs) -> Gain:
    """The expected step time of the adaptive choice against the static layout (layouts[0]) for
    sampled steps, each a list of document lengths (tokens, eos included, as choose_layout takes
    them): the mean of basp_jax.planner.cost.predict's step_s of each step's chosen layout, the same
    prediction the planner ranks static layouts by. `shape` is a basp_jax.planner.shape.ModelShape;
    predict_kwargs go to predict (grad_accum, remat, overlap, ...). Since every layout of the set
    holds the same tokens per device, what differs is the all-to-alls' width and whether they
    cross hosts, and the attention FLOPs of shorter rows."""
    if not steps:
        raise ValueError("predicted_gain needs at least one sampled step")
    check_param_sharding(param_sharding)
    step_s = tuple(cost.predict(shape, layout, param_sharding, hw=hw, **predict_kwargs).step_s
                   for layout in layouts)
    chosen = tuple(choose_layout(lengths, layouts) for lengths in steps)
    adaptive = float(np.mean([step_s[i] for i in chosen]))
    return Gain(step_s[0], adaptive, chosen, step_s)
