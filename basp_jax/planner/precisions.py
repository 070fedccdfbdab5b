"""Bytes per value of each kind of number a train step holds or sends: one value the traffic,
the memory and the prediction all read."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Precisions:
    """act: the compute dtype's (activations, the all-to-alls); param: the gathered weights' and
    their gradients' (None: act, as the layers compute in it); sum: the hosts' gradient sums'
    where they cross hosts once a step (None: param; 4 under float16 compute,
    train.program.per_group); master: the master weights' and Adam's second moment's; moments:
    Adam's first moment's (None: master)."""

    act: int = 2
    param: int | None = None
    sum: int | None = None
    master: int = 4
    moments: int | None = None

    @property
    def gathered(self) -> int:
        """Bytes of a gathered weight and of its gradient."""
        return self.act if self.param is None else self.param

    @property
    def summed(self) -> int:
        """Bytes of a host's gradient sum as it crosses hosts."""
        return self.gathered if self.sum is None else self.sum
