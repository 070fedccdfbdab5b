"""The planner's mixture-of-experts terms (basp_jax.planner): a sparse layer's parameters, the
FLOPs of a token's top-k experts only, the routed tokens' exchanges inside the seq group that
splits the experts, and the routed rows' memory."""

import dataclasses

import pytest

import models
from basp_jax import Layout
from basp_jax.planner import cost, traffic
from basp_jax.planner.hardware import HARDWARE
from basp_jax.remat import REMAT_POLICIES

SHAPE = models.ModelConfig.preset("qwen3-30b-a3b").shape


def _layout(mode: str) -> Layout:
    return Layout.plan(16, 2, 32768, SHAPE.num_heads, SHAPE.num_kv_heads, mode=mode,
                       devices_per_host=8)


def test_parameters_and_flops_count_every_expert_and_a_tokens_top_k():
    """Qwen3-30B-A3B's published sizes: 30.5B parameters, 3.3B active per token."""
    assert SHAPE.sparse_layers == 48
    assert SHAPE.num_params == pytest.approx(30.53e9, rel=1e-3)
    active = SHAPE.num_params - SHAPE.inactive_expert_params
    assert active == pytest.approx(3.35e9, rel=1e-2)
    untied_input = SHAPE.vocab_size * SHAPE.hidden_size
    assert SHAPE.dense_flops_per_token() == 6 * (active - untied_input)
    dense = dataclasses.replace(SHAPE, sparse_layers=0)  # a dense MLP in every layer instead
    assert dense.num_params < SHAPE.num_params / 9
    # the experts stay in the compute dtype under model.fp8
    assert SHAPE.fp8_params == dense.fp8_params - 48 * 3 * SHAPE.hidden_size * \
        SHAPE.intermediate_size


def test_the_experts_split_over_a_host_or_a_seq_group_that_divides_them():
    assert SHAPE.expert_split(8) == 8 and SHAPE.expert_split(1) == 1
    # seq groups smaller than a host: over the host; a seq group across hosts: over the group
    assert SHAPE.expert_split(2, 8) == 8 and SHAPE.expert_split(1, 8) == 8
    assert SHAPE.expert_split(16, 8) == 16 and SHAPE.expert_split(2, 3) == 2
    assert dataclasses.replace(SHAPE, num_experts=12).expert_split(2, 8) == 2  # 8 ∤ 12
    # as model.expert_parallel asks: the seq group only, or whole
    assert SHAPE.expert_split(2, 8, "seq") == 2 and SHAPE.expert_split(8, 8, "none") == 1
    assert dataclasses.replace(SHAPE, num_experts=12).expert_split(8) == 1  # whole: 8 ∤ 12
    assert dataclasses.replace(SHAPE, sparse_layers=0).expert_split(8) == 1


@pytest.mark.parametrize("mode,crosses", [("basp", False), ("ulysses", True)])
def test_routed_tokens_cross_hosts_only_where_the_group_does(mode, crosses):
    layout = _layout(mode)
    full, none = REMAT_POLICIES.get("full"), REMAT_POLICIES.get("none")
    moved = traffic.expert_dispatch_traffic(SHAPE, layout, full, 2)
    assert (moved.inter > 0) == crosses and moved.intra > 0
    # the group's tokens of hidden width: gathered and scattered forward and backward, gathered
    # again where the layer is recomputed (as compiled: tests/e2e/test_gpu_compile.py)
    kept = traffic.expert_dispatch_traffic(SHAPE, layout, none, 2)
    split = layout.sp
    hidden = split * layout.tokens_per_device * SHAPE.hidden_size * 2 * (split - 1) / split
    assert kept.intra + kept.inter == pytest.approx(4 * hidden, rel=0.02)
    assert moved.intra + moved.inter == pytest.approx(5 * hidden, rel=0.02)


def test_the_routed_rows_grow_with_the_group_that_splits_the_experts():
    hw = HARDWARE["h100-80gb"]
    basp, ulysses = (cost.predict(SHAPE, _layout(m), "staged_keep", hw=hw)
                     for m in ("basp", "ulysses"))
    # 2 x the rows per device under Ulysses (a group of 16, not 8): ~10 GiB more, as compiled
    assert 8 * 2**30 < ulysses.memory_bytes - basp.memory_bytes < 12 * 2**30
    assert basp.all_to_all.inter < ulysses.all_to_all.inter / 10
    # whole experts (expert_parallel=none): no routed exchange, and every expert's weights
    whole = cost.predict(SHAPE, _layout("basp"), "staged_keep", hw=hw, expert_parallel="none")
    assert whole.all_to_all.intra < basp.all_to_all.intra
    assert traffic.expert_dispatch_traffic(SHAPE, _layout("basp"), REMAT_POLICIES.get("full"),
                                           2, "none") == traffic.Traffic()
