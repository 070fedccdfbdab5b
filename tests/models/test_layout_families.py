"""The fast tier's guard of every layout family: one tiny Transformer, its loss and every gradient
on 8 emulated devices equal to one device's, for BASP, Ulysses, a ring (contiguous and zig-zag),
an adaptive layout of the set and each parameter-sharding strategy whose gradient reduction is
written by hand or placed per host (host, hsdp; staged_keep's is in test_staged_sharding.py).
The zig-zag ring and hsdp cases are in the slow tier (the contiguous ring of 4 is the one a
wrong hop order fails; hsdp's reduction is XLA's own).

Deliberately small (1 layer, 64 tokens) so the whole file compiles in well under a minute: a
wrong exchange (a ring hop's chunk order, an all-to-all's split) or a wrong gradient reduction
changes the loss or the gradients far beyond the tolerances, which are those of
tests/models/test_parallel.py (float32: loss rtol 1e-6, gradients atol 1e-6 + rtol 1e-4)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import basp_jax
import models
from basp_jax import adaptive, packing

N, HOST = 8, 4  # devices, devices per emulated host
SEQ = 64
HEADS, KV = 8, 2


def _config() -> models.ModelConfig:
    return dataclasses.replace(models.ModelConfig.preset("tiny"), vocab_size=128, hidden_size=64,
                               intermediate_size=128, head_dim=8, num_layers=1,
                               num_heads=HEADS, num_kv_heads=KV)


def _packed_rows(batch: int, seed: int):
    """[batch, SEQ] tokens, next-token targets and segment ids of documents of uneven lengths
    (each row: 3 documents), with a masked prediction at every document's end."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 128, (batch, SEQ)).astype(np.int32)
    cuts = [(0, 11, 40, SEQ), (0, 27, 33, SEQ)]
    segments = np.zeros((batch, SEQ), np.int32)
    targets = np.roll(tokens, -1, axis=1)
    for row in range(batch):
        bounds = cuts[row % len(cuts)]
        for doc, (start, end) in enumerate(zip(bounds, bounds[1:])):
            segments[row, start:end] = doc
            targets[row, end - 1] = -100  # no prediction across a document boundary
    return tokens, targets, segments


def _value_and_grads(model, tokens, targets, segments):
    """(loss sum, token count, gradients of the sum) as flat numpy dicts."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def total(params):
        s, n = nnx.merge(graphdef, params, rest).loss(tokens, targets, segment_ids=segments)
        return s, n

    (s, n), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(params)
    flat = {k: np.asarray(v[...] if isinstance(v, nnx.Variable) else v)
            for k, v in nnx.to_flat_state(grads)}
    return float(s), float(n), flat


def _check_equal(got, want, label):
    (s, n, grads), (s_1, n_1, grads_1) = got, want
    assert n == n_1, label
    np.testing.assert_allclose(s, s_1, rtol=1e-6, err_msg=label)
    assert grads.keys() == grads_1.keys()
    assert max(np.abs(g).max() for g in grads_1.values()) > 1e-3  # the comparison can fail
    for key, g in grads_1.items():
        np.testing.assert_allclose(grads[key] / n, g / n_1, atol=1e-6, rtol=1e-4,
                                   err_msg=f"{label}: {key}")


@pytest.fixture(scope="module")
def one_device():
    """The batch (2 rows) and its one-device loss and gradients."""
    batch = [jnp.asarray(x) for x in _packed_rows(2, seed=5)]
    return batch, _value_and_grads(models.init_model(_config(), seed=3), *batch)


# (label, Layout.plan keywords, parameter sharding)
LAYOUTS = [
    pytest.param("basp (2,4)", dict(groups=2), "fsdp", id="basp (2,4)"),
    pytest.param("ulysses (1,8)", dict(groups=1), "fsdp", id="ulysses (1,8)"),
    pytest.param("ring 4 (1,8), contiguous", dict(groups=1, ring=4), "fsdp", id="ring 4 (1,8)"),
    pytest.param("ring 2 (2,4), zig-zag", dict(groups=2, ring=2, zigzag=True), "fsdp",
                 id="zig-zag ring 2 (2,4)", marks=pytest.mark.slow),
    pytest.param("host sharding (2,4)", dict(groups=2), "host", id="host sharding (2,4)"),
    pytest.param("hsdp (1,8)", dict(groups=1), "hsdp", id="hsdp (1,8)", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("label,plan,param_sharding", LAYOUTS)
def test_loss_and_gradients_equal_one_device(one_device, label, plan, param_sharding):
    batch, want = one_device
    config = _config()
    layout = basp_jax.Layout.plan(N, 2, SEQ, HEADS, KV, devices_per_host=HOST, **plan)
    assert (layout.groups, layout.ring, layout.zigzag) == (
        plan["groups"], plan.get("ring", 1), plan.get("zigzag", False))
    model = models.init_model(config, seed=3, mesh=basp_jax.make_mesh(layout), layout=layout,
                              param_sharding=param_sharding)
    if layout.zigzag:  # the model takes the tokens in the layout's order (the data pipeline's)
        order = layout.token_order
        assert not np.array_equal(order, np.arange(SEQ))
        batch = [x[:, order] for x in batch]
    _check_equal(_value_and_grads(model, *batch), want, label)


def test_an_adaptive_layout_equals_one_device():
    """The documents of one (1, 8) row repacked by the adaptive packer for (4, 2): four rows of a
    quarter of the tokens, the static layout's parameters relabelled (not moved) onto its mesh;
    the loss sum, the count and the gradients are one device's on the static row."""
    config = _config()
    layouts = adaptive.layout_set(N, 1, SEQ, HEADS, KV, devices_per_host=HOST)
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 128, width + 1).astype(np.int32) for width in (15, 14, 16, 12)]
    pieces = packing.pieces_of_documents(docs, SEQ)
    target = next(i for i, lay in enumerate(layouts) if lay.groups == 4)
    static = packing.pack(pieces, layouts[0], 0)
    packed = packing.pack(pieces, layouts[target], target)
    assert packed is not None and packed.tokens.shape == (4, SEQ // 4)

    def rows(p):
        return [jnp.asarray(x) for x in (p.tokens, p.targets, p.segment_ids)]

    want = _value_and_grads(models.init_model(config, seed=3), *rows(static))
    base = models.init_model(config, seed=3, mesh=basp_jax.make_mesh(layouts[0]),
                             layout=layouts[0], attn_impl="xla")
    here = models.init_model(config, seed=3, mesh=basp_jax.make_mesh(layouts[target]),
                             layout=layouts[target], attn_impl="xla")
    graphdef, params, rest = nnx.split(here, nnx.Param, ...)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    switched = adaptive.relabel(nnx.state(base, nnx.Param), shardings)
    got = _value_and_grads(nnx.merge(graphdef, switched, rest), *rows(packed))
    assert got[1] == sum((15, 14, 16, 12))
    _check_equal(got, want, "adaptive (4,2)")
