"""The compiled train step's collectives (basp_jax.compiled.comm), on an emulated 2-host x 4-device cluster.

At a realistic activation/weight ratio (S=2048 against d=128) so XLA partitions like it would at
scale: weights are gathered, activations stay sharded.
"""

import pytest

from basp_jax.compiled import comm

from tests.helpers.flags import WHOLE_MATRIX


HOST = 4  # devices per emulated host


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compile_cache")]  # tests/conftest.py


def _cross_group_only(c, sp):
    """An all-reduce whose groups pair devices across seq groups only ({i, i+sp, ...})."""
    return c.kind == "all-reduce" and bool(c.groups) and all(
        len(g) > 1 and len({d % sp for d in g}) == 1 for g in c.groups
    )


def test_compiled_step_all_to_alls_equal_the_closed_form():
    """The trainer's step for a small Llama shape on 2 emulated hosts of 4: the attention
    all-to-alls are exactly the closed form of basp_jax.planner.cost (BENCHMARKS.md section 1),
    inside a host under BASP and across them under Ulysses, there are no others, every
    collective names its device groups, no full gradient is reduced across the seq groups
    alone (fsdp), and under HSDP no parameter gather leaves a host. A change that adds a
    collective to the step fails here."""
    import dataclasses

    import models
    from basp_jax.planner import cost
    from basp_jax.planner.hardware import HARDWARE
    from basp_jax.planner.precisions import Precisions
    from train.tools.collectives import step_collectives

    mcfg = dataclasses.replace(models.ModelConfig.preset("tiny"), num_layers=2)
    shape = mcfg.shape
    for mode, strategy in [("ulysses", "fsdp"), ("basp", "fsdp"), ("basp", "hsdp")]:
        layout, found = step_collectives(mcfg, mode=mode, strategy=strategy, batch=2, seq_len=2048)
        a2a = [c for c in found if c.kind == "all-to-all"]
        closed = cost.predict(shape, layout, strategy, hw=HARDWARE["a100-40gb"],
                              precisions=Precisions(act=4))
        assert len(a2a) == 8 * mcfg.num_layers, (mode, len(a2a))
        assert sum(c.wire_bytes for c in a2a) == pytest.approx(closed.all_to_all.intra + closed.all_to_all.inter)
        assert sum(comm.inter_host_wire_bytes(c, HOST) for c in a2a) == pytest.approx(closed.all_to_all.inter)
        assert {c.kind for c in found} <= {"all-to-all", "all-gather", "all-reduce", "reduce-scatter"}
        assert all(c.groups for c in found), [c.kind for c in found if not c.groups]
        # BASP's all-to-alls inside a host (its group of 4), Ulysses's across both (8)
        assert {c.group_size for c in a2a} == {4 if mode == "basp" else 8}, mode
        assert all(comm.crosses_hosts(c, HOST) == (mode == "ulysses") for c in a2a), mode
        if (mode, strategy) == ("basp", "fsdp"):
            big = [c for c in found if _cross_group_only(c, sp=4) and c.bytes > 16 * 1024]
            assert not big, [(c.kind, c.bytes, c.groups[:2]) for c in big]
        if strategy == "hsdp":
            gathers = [c for c in found if c.kind == "all-gather"]
            assert gathers and not any(comm.crosses_hosts(c, HOST) for c in gathers)


@pytest.mark.parametrize("remat,scan_layers", [  # the scanned one under every jaxlib
    pytest.param("full", False, marks=WHOLE_MATRIX),
    pytest.param("dots", False, marks=WHOLE_MATRIX),
    ("full", True)])
def test_rematerialised_step_repeats_no_all_to_all(remat, scan_layers):
    """full and dots keep the all-to-all outputs (basp_jax.remat): the backward pass recomputes
    none, so the step has exactly 8 per layer per microbatch (4 forward, 4 backward), as without
    remat and as basp_jax.planner.cost counts. Plain full remat (model.remat=inputs) has 12 (24
    for these 2 layers: tests/train/test_long_context.py).
    With the layers under a scan the program holds one layer's 8, run once per layer."""
    import dataclasses

    import models
    from train.tools.collectives import step_collectives

    mcfg = dataclasses.replace(models.ModelConfig.preset("tiny"), num_layers=2)
    _, found = step_collectives(mcfg, mode="basp", strategy="fsdp", batch=2, seq_len=2048,
                                remat=remat, grad_accum=2, scan_layers=scan_layers)
    per_program = 8 if scan_layers else 8 * mcfg.num_layers
    assert sum(c.kind == "all-to-all" for c in found) == per_program
