"""Packing, gradients under sequence parallelism, rematerialisation and the loss.

Tolerances (float32): logits atol 1e-4 (as against transformers); gradients atol 1e-6 + rtol 1e-4
between one device and the (2, 4) mesh (observed max difference ~1e-8 on gradients ~1e-2).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch")
pytest.importorskip("transformers")

import basp_jax  # noqa: E402
import models  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.trees import flat_state

ATOL = 1e-4
BATCH, SEQ = 4, 32
DOC_LENGTHS = [(12, 20), (32,), (5, 11, 16), (8, 8, 16)]  # each row sums to SEQ


def mesh_for(groups, batch=BATCH, seq=SEQ):
    layout = basp_jax.Layout.plan(8, batch, seq, 8, 2, groups=groups)
    return basp_jax.make_mesh(layout)


@nnx.jit
def forward(model, tokens, segment_ids):
    return model(tokens, segment_ids=segment_ids)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    torch_model = hf_tiny.save("llama", directory)
    return str(directory), torch_model


def packed_batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, hf_tiny.VOCAB, (BATCH, SEQ)).astype(np.int32)
    segments = np.zeros((BATCH, SEQ), np.int32)
    for row, lengths in enumerate(DOC_LENGTHS):
        segments[row] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    return tokens, segments


@pytest.mark.slow
def test_packed_documents_equal_each_document_alone(llama_dir):
    directory, torch_model = llama_dir
    tokens, segments = packed_batch()
    single = models.from_pretrained(directory)
    results = {"1 device": np.asarray(forward(single, jnp.asarray(tokens), jnp.asarray(segments)))}
    for groups in (1, 2, 4):
        model = models.from_pretrained(directory, mesh=mesh_for(groups))
        results[f"groups={groups}"] = np.asarray(
            forward(model, jnp.asarray(tokens), jnp.asarray(segments)))
    for row, lengths in enumerate(DOC_LENGTHS):
        start = 0
        for length in lengths:
            doc = tokens[row:row + 1, start:start + length]
            alone_ours = np.asarray(forward(single, jnp.asarray(doc), None))
            alone_torch = hf_tiny.torch_logits(torch_model, doc)
            np.testing.assert_allclose(alone_ours, alone_torch, atol=ATOL, rtol=0)
            for where, logits in results.items():
                np.testing.assert_allclose(
                    logits[row:row + 1, start:start + length], alone_torch, atol=ATOL, rtol=0,
                    err_msg=f"row {row}, document at {start}, {where}")
            start += length


def test_explicit_positions_override_the_default(llama_dir):
    directory, torch_model = llama_dir
    tokens, _ = packed_batch(1)
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32) + 7, (BATCH, SEQ))
    model = models.from_pretrained(directory)
    ours = nnx.jit(lambda m, t, p: m(t, positions=p))(model, jnp.asarray(tokens),
                                                     jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(ours), hf_tiny.torch_logits(torch_model, tokens, positions),
                               atol=ATOL, rtol=0)


def _loss(model, tokens, targets, mask, segments):
    total, count = models.causal_lm_loss(model(tokens, segment_ids=segments), targets, mask)
    return total / count


@nnx.jit
def grads(model, tokens, targets, mask, segments):
    return nnx.value_and_grad(_loss)(model, tokens, targets, mask, segments)


@pytest.mark.slow
def test_gradients_on_mesh_equal_single_device(tmp_path):
    hf_tiny.save("qwen2", tmp_path)  # q/k/v biases and an untied head get gradients too
    tokens, segments = packed_batch(2)
    targets = np.roll(tokens, -1, axis=1)
    targets[:, -1] = -100
    targets[0, :3] = -100
    mask = np.ones_like(tokens)
    mask[1, 10:] = 0
    args = [jnp.asarray(x) for x in (tokens, targets, mask, segments)]

    loss_1, grads_1 = grads(models.from_pretrained(str(tmp_path)), *args)
    reference = flat_state(grads_1)
    assert max(np.abs(g).max() for g in reference.values()) > 1e-3
    mesh = mesh_for(2)
    for remat in ("none", "full", "dots"):
        model = models.from_pretrained(str(tmp_path), mesh=mesh, param_sharding="fsdp", remat=remat)
        loss_m, grads_m = grads(model, *args)
        np.testing.assert_allclose(float(loss_m), float(loss_1), rtol=1e-6)
        flat = flat_state(grads_m)
        assert flat.keys() == reference.keys()
        for key, g in reference.items():
            np.testing.assert_allclose(flat[key], g, atol=1e-6, rtol=1e-4,
                                       err_msg=f"{key} remat={remat}")


def test_sequence_parallel_forward_uses_all_to_all(llama_dir):
    directory, _ = llama_dir
    model = models.from_pretrained(directory, mesh=mesh_for(2))
    graphdef, state = nnx.split(model)
    tokens, segments = packed_batch()
    fn = jax.jit(lambda s, t, seg: nnx.merge(graphdef, s)(t, segment_ids=seg))
    hlo = fn.lower(state, jnp.asarray(tokens), jnp.asarray(segments)).compile().as_text()
    assert "all-to-all" in hlo


def test_loss_matches_torch_cross_entropy_and_ignores_masked():
    import torch

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 6, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (2, 6)).astype(np.int32)
    targets[0, 0] = -100
    targets[1, 5] = -1
    mask = np.ones((2, 6), np.int32)
    mask[1, 2] = 0
    total, count = models.causal_lm_loss(jnp.asarray(logits), jnp.asarray(targets),
                                         jnp.asarray(mask))
    assert total.dtype == jnp.float32 and count.dtype == jnp.float32
    torch_targets = np.where((targets >= 0) & (mask != 0), targets, -100)
    expected = torch.nn.functional.cross_entropy(
        torch.from_numpy(logits).reshape(-1, 11), torch.from_numpy(torch_targets).long().reshape(-1),
        ignore_index=-100, reduction="sum")
    assert float(count) == 9.0
    np.testing.assert_allclose(float(total), expected.item(), rtol=1e-6)
    empty = models.causal_lm_loss(jnp.asarray(logits), jnp.full((2, 6), -100))
    assert float(empty[0]) == 0.0 and float(empty[1]) == 0.0


@pytest.mark.slow
def test_init_model_creates_sharded_parameters_equal_to_eager_init():
    config = models.ModelConfig.preset("tiny")
    mesh = mesh_for(2)
    sharded = models.init_model(config, mesh=mesh, seed=3, param_sharding="hsdp")
    eager = models.Transformer(config, rngs=nnx.Rngs(3))
    kernel = sharded.layers.mlp.gate_proj.kernel[...]  # [layers, in, out], the layers stacked
    # [layers, 128, 256]: gate_proj split on its input, the major axis (basp_jax.sharding.RULES)
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "seq", None)
    # Same random stream; jit and eager sampling differ in the last ulp only.
    np.testing.assert_allclose(np.asarray(kernel),
                               np.asarray(eager.layers.mlp.gate_proj.kernel[...]),
                               rtol=1e-6, atol=1e-9)
    tokens = jnp.zeros((BATCH, SEQ), jnp.int32)
    np.testing.assert_allclose(np.asarray(forward(sharded, tokens, None)),
                               np.asarray(forward(eager, tokens, None)), atol=ATOL, rtol=0)


def test_blockwise_kernel_matches_xla_on_mesh_with_packing(llama_dir):
    directory, _ = llama_dir
    tokens, segments = packed_batch(3)
    mesh = mesh_for(2)
    outputs = [np.asarray(forward(models.from_pretrained(directory, mesh=mesh, attn_impl=impl),
                                  jnp.asarray(tokens), jnp.asarray(segments)))
               for impl in ("xla", "blockwise")]
    np.testing.assert_allclose(outputs[1], outputs[0], atol=ATOL, rtol=0)


def test_model_arguments_are_checked_with_one_line_errors():
    config = models.ModelConfig.preset("tiny")
    for kwargs, match in [({"remat": "some"}, "remat"), ({"attn_impl": "flash"}, "attn_impl")]:
        with pytest.raises(models.ModelError, match=match):
            models.Transformer(config, rngs=nnx.Rngs(0), **kwargs)
    mesh = basp_jax.make_mesh(basp_jax.Layout.plan(8, 8, SEQ, 8, 2, groups=2))  # sp=4
    other = basp_jax.Layout.plan(8, 8, SEQ, 8, 2, groups=1)  # a layout of another mesh
    with pytest.raises(basp_jax.LayoutError, match="groups=1 x sp=8 but the mesh is 2 x 4") as info:
        models.Transformer(config, rngs=nnx.Rngs(0), mesh=mesh, layout=other)
    assert "\n" not in str(info.value)
    with pytest.raises(models.ModelError, match="a layout needs its mesh"):
        models.Transformer(config, rngs=nnx.Rngs(0), layout=other)


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv_heads,groups,ring", [(6, 2, 2, 1), (4, 2, 1, 2)])
def test_head_counts_that_sp_does_not_divide_run_exactly(heads, kv_heads, groups, ring):
    """6 heads on sp=4 (zero heads padded) and 4 heads on sp=8 (ring of 2 x all-to-all of 4)."""
    import dataclasses

    config = dataclasses.replace(models.ModelConfig.preset("tiny"), num_heads=heads,
                                 num_kv_heads=kv_heads, head_dim=16)
    tokens, segments = packed_batch(5)
    single = models.init_model(config, seed=3)
    want = forward(single, jnp.asarray(tokens), jnp.asarray(segments))
    layout = basp_jax.Layout.plan(8, BATCH, SEQ, heads, kv_heads, groups=groups, ring=ring,
                                  pad_heads=True)
    model = models.init_model(config, mesh=basp_jax.make_mesh(layout), seed=3, layout=layout,
                              attn_impl="blockwise")
    got = forward(model, jnp.asarray(tokens), jnp.asarray(segments))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_an_eager_call_on_a_mesh_runs_as_one_compiled_program():
    """`logits = model(tokens)` outside jit on a multi-device mesh (the package docstring's usage)
    compiles the whole forward once. Op by op, a 30-layer 135M model with padded heads on a (2, 4)
    CPU mesh aborted the process: XLA's CPU rendezvous gave up on an all-reduce after 40 s."""
    import dataclasses

    config = dataclasses.replace(models.ModelConfig.preset("tiny"), num_heads=6, num_kv_heads=2,
                                 head_dim=16)
    layout = basp_jax.Layout.plan(8, 2, SEQ, 6, 2, groups=2, pad_heads=True)
    model = models.init_model(config, mesh=basp_jax.make_mesh(layout), seed=3)
    tokens = jnp.asarray(packed_batch(2)[0][:2])
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None)
    jax.clear_caches()
    eager = model(tokens)
    assert len(compiles) <= 2, compiles  # op by op: a program per operation (hundreds here)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(forward(model, tokens, None)),
                               atol=1e-6, rtol=0)

