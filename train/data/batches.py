"""The batch of each step and the layout it runs on: (index into the run's programs, arrays).

    batches = for_run(run.data, run.state.programs)
    index, batch = batches.get(step, prefetch=True)   # batch on programs[index].batch_sharding

A static run has one program and takes train.data.Pipeline's batches as they are (index 0).
Under parallel.mode=adaptive every process takes all the step's documents as the start-up
packing placed them in the static rows (Pipeline.row_pieces), packs them once with
basp_jax.packing.pack_microbatches into the layout with the most groups that holds them, and
keeps the part its devices hold: every process then picks the same layout, because the choice
is a pure function of the step's documents, and a resumed run repeats it. Reading documents a
process does not hold costs host time only (B * grad_accum rows a step); the next step's batch
is built on a background thread while a step runs.
"""

from __future__ import annotations

import concurrent.futures

import jax
import numpy as np

from basp_jax.packing import PackedStep, pack_microbatches

from .pipeline import Pipeline


class StaticBatches:
    """The pipeline's batches on the one program's sharding."""

    def __init__(self, data: Pipeline, sharding):
        self.data, self.sharding = data, sharding

    def get(self, step: int, prefetch: bool = False) -> tuple[int, dict]:
        return 0, self.data.global_batch(step, self.sharding, prefetch=prefetch)

    def close(self) -> None:
        """Nothing of its own: the pipeline's prefetch thread is the run's (train.loop closes it)."""


class AdaptiveBatches:
    """Each step's documents packed for the layout with the most groups that holds them."""

    def __init__(self, data: Pipeline, programs):
        if data.pad_rows or data.seq_order is not None:  # (prepare builds it without either)
            raise ValueError("adaptive batches pack natural-order rows without pad rows")
        self.data = data
        self.layouts = [p.plan.layout for p in programs]
        self.shardings = [p.batch_sharding for p in programs]
        self._ahead = None  # (step, future) of the batch built in the background
        self._pool = None

    def get(self, step: int, prefetch: bool = False) -> tuple[int, dict]:
        ahead, self._ahead = self._ahead, None
        out = ahead[1].result() if ahead and ahead[0] == step else self.build(step)
        if prefetch:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, "basp-adaptive")
            self._ahead = (step + 1, self._pool.submit(self.build, step + 1))
        return out

    def packed(self, step: int) -> PackedStep:
        """The step's documents, all of them, packed for its layout (numpy, [accum, rows, S'])."""
        data = self.data
        rows = data.row_pieces(step, np.arange(data.num_rows))
        micro = [rows[a * data.batch:(a + 1) * data.batch] for a in range(data.accum)]
        return pack_microbatches(micro, self.layouts)

    def build(self, step: int) -> tuple[int, dict]:
        packed = self.packed(step)
        sharding = self.shardings[packed.index]
        return packed.index, {
            name: jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index])
            for name, x in packed.arrays().items()}

    def close(self) -> None:
        """Ends the prefetch thread (a batch being built is dropped); the pipeline is the run's."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool, self._ahead = None, None


def for_run(data: Pipeline, programs) -> StaticBatches | AdaptiveBatches:
    """The batches of a run with these programs (train.state.layout_programs)."""
    if len(programs) == 1:
        return StaticBatches(data, programs[0].batch_sharding)
    return AdaptiveBatches(data, programs)
