"""Host parameter sharding (basp_jax.sharding 'host') on an emulated 2-host x 4-device cluster:
every gradient element crosses hosts once, as a 1/4 shard, whatever the batch; parameter gathers
stay inside a host; and the losses are the single-device run's."""

import dataclasses

import numpy as np
import pytest

import models
from basp_jax.compiled import comm
from basp_jax.planner import traffic
from train.tools.collectives import step_collectives
from train.loop import run

from tests.helpers.flags import WHOLE_MATRIX
from tests.helpers.trainer import tiny_config

HOST = 4  # devices per emulated host
SCALAR_SLACK = 64  # bytes: the loss, token count and gradient norm summed over the mesh


def _vector_bytes(mcfg):
    """fp32 bytes of the rank-1 parameters (the RMSNorm weights): XLA all-reduces their gradients
    whole over the mesh (2.5 KiB here, 0.0005% of an 8B model), not as host shards."""
    return 4 * mcfg.hidden_size * (2 * mcfg.num_layers + 1)


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compile_cache")]  # tests/conftest.py


def _inter_host(found, *kinds):
    return sum(comm.inter_host_wire_bytes(c, HOST) * c.executions for c in found if c.kind in kinds)


# groups across the hosts (1), inside one host (2: BASP (2,4), under every jaxlib), one device
# each (8)
@pytest.mark.parametrize("batch", [pytest.param(1, marks=WHOLE_MATRIX), 2,
                                   pytest.param(8, marks=WHOLE_MATRIX)])
def test_gradient_crosses_hosts_once_at_the_minimum(batch):
    """The compiled step's cross-host gradient bytes per device equal the closed form of
    basp_jax.planner.traffic (one all-reduce of a 1/4 shard between the hosts) for every seq
    group size, sp = 8 (groups across hosts) to sp = 1 (data parallel), the token embedding
    included; no parameter gather leaves a host."""
    mcfg = dataclasses.replace(models.ModelConfig.preset("tiny"), num_layers=2)
    layout, found = step_collectives(mcfg, mode="basp", strategy="host", batch=batch,
                                     seq_len=2048, devices_per_host=HOST)
    assert layout.groups == batch
    minimum = traffic.min_inter_host_gradient_bytes(4 * mcfg.shape.num_params, 8, HOST)
    sent = _inter_host(found, "all-reduce", "reduce-scatter")
    # The norms' gradients cross whole: their bytes instead of a quarter of them.
    extra = _vector_bytes(mcfg) * (1 - 1 / HOST) + SCALAR_SLACK
    assert minimum <= sent <= minimum + extra, (batch, sent, minimum)
    gathers = [c for c in found if c.kind == "all-gather" and c.bytes > SCALAR_SLACK]
    assert gathers and not any(comm.crosses_hosts(c, HOST) for c in gathers), batch


@pytest.mark.parametrize("tied", [True, False])
def test_the_head_is_gathered_and_reduced_once_per_step_not_once_per_loss_chunk(tied):
    """The loss runs over chunks of each device's tokens (4 here); the head (or the tied table)
    is gathered inside the host once before them and its gradient reduced once after them. It
    used to be gathered and its f32 gradient reduce-scattered once per chunk (the 8B at 256K
    tokens: 188 GiB per device per step)."""
    mcfg = dataclasses.replace(models.ModelConfig.preset("tiny"), num_layers=1, vocab_size=4096,
                               tie_word_embeddings=tied)
    _, found = step_collectives(mcfg, mode="basp", strategy="host", batch=1, seq_len=4096,
                                devices_per_host=HOST)
    head = 4 * mcfg.vocab_size * mcfg.hidden_size  # fp32 bytes of the [vocab, hidden] table
    big = [c for c in found if c.bytes >= head / HOST]
    assert big, found
    assert all(c.executions == 1 for c in big), [(c.kind, c.bytes, c.executions) for c in big]


def test_hsdp_at_b8_sends_devices_per_host_times_the_minimum():
    """The case host sharding fixes: at B=8 the seq groups are single devices, so hsdp
    replicates and every device pair across hosts carries the whole gradient."""
    mcfg = dataclasses.replace(models.ModelConfig.preset("tiny"), num_layers=2)
    _, found = step_collectives(mcfg, mode="basp", strategy="hsdp", batch=8, seq_len=2048,
                                devices_per_host=HOST)
    minimum = traffic.min_inter_host_gradient_bytes(4 * mcfg.shape.num_params, 8, HOST)
    assert _inter_host(found, "all-reduce", "reduce-scatter") >= HOST * minimum


@pytest.mark.parametrize("batch", [8])  # seq groups of one device: what hsdp could not shard
def test_host_sharding_trains_the_single_device_losses(tmp_path, batch):
    host = run(tiny_config(tmp_path / "host", "parallel.param_sharding=host", "train.steps=3",
                           f"train.microbatch_size={batch}", "parallel.devices_per_host=4"))
    single = run(tiny_config(tmp_path / "single", "runtime.cpu_devices=1", "train.steps=3",
                             f"train.microbatch_size={batch}"))
    assert host["layout"].groups == batch
    np.testing.assert_allclose(host["losses"], single["losses"], rtol=2e-5)
