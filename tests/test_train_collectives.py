"""The compiled train step's collectives (basp_jax.comm), on an emulated 2-host x 4-device cluster.

At a realistic activation/weight ratio (S=2048 against d=128) so XLA partitions like it would at
scale: weights are gathered, activations stay sharded.
"""

import pytest

from basp_jax import comm
from train.loop import run

from train_helpers import enable_compile_cache, tiny_config

HOST = 4  # devices per emulated host


@pytest.fixture(autouse=True, scope="module")
def _compile_cache(tmp_path_factory):
    enable_compile_cache(tmp_path_factory.mktemp("jax_cache"))


def _collectives(tmp_path, name, *extra):
    cfg = tiny_config(tmp_path / name, "train.steps=1", "train.microbatch_size=2",
                      "data.seq_len=2048", f"parallel.devices_per_host={HOST}", *extra)
    return run(cfg)["collectives"]


def _cross_group_only(c, sp):
    """An all-reduce whose groups pair devices across seq groups only ({i, i+sp, ...})."""
    return c.kind == "all-reduce" and bool(c.groups) and all(
        len(g) > 1 and len({d % sp for d in g}) == 1 for g in c.groups
    )


def test_all_to_all_stays_inside_a_host_under_basp(tmp_path):
    basp = _collectives(tmp_path, "basp")
    ulysses = _collectives(tmp_path, "ulysses", "parallel.mode=ulysses")
    a2a = [c for c in basp if c.kind == "all-to-all"]
    assert a2a and not any(comm.crosses_hosts(c, HOST) for c in a2a)
    attention = [c for c in ulysses if c.kind == "all-to-all" and c.group_size == 8]
    assert attention and all(comm.crosses_hosts(c, HOST) for c in attention)


def test_only_attention_all_to_alls_under_ulysses(tmp_path):
    ulysses = _collectives(tmp_path, "ulysses", "parallel.mode=ulysses")
    extra = [c for c in ulysses if c.kind == "all-to-all" and c.group_size != 8]
    assert not extra, [(c.bytes, c.groups) for c in extra]


def test_no_full_gradient_crosses_groups_alone(tmp_path):
    collectives = _collectives(tmp_path, "fsdp", "parallel.param_sharding=fsdp")
    big = [c for c in collectives if _cross_group_only(c, sp=4) and c.bytes > 16 * 1024]
    assert not big, [(c.kind, c.bytes, c.groups[:2]) for c in big]


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_every_collective_has_device_groups(tmp_path, strategy):
    collectives = _collectives(tmp_path, strategy, f"parallel.param_sharding={strategy}")
    assert all(c.groups for c in collectives), [c.kind for c in collectives if not c.groups]
