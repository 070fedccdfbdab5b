"""Ring attention whose hops run cuDNN's kernels (basp_jax.ring_hops), on CPU: the kernels
computed by tests/helpers/cudnn_emulator from the operands they are given, so the hops' masks,
the reversed keys of a shared document, the statistics' layout, the merges and the backward from
the merged output and statistics are all checked against one device, forward and gradients, on
fresh random inputs. The diagonal hop with documents runs the Pallas kernel (interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from basp_jax import Layout, activation_sharding, attention, cudnn_call, kernels, make_mesh
from basp_jax.flash import FlashBlocks
from basp_jax.ring_hops import HopKernel

from tests.helpers import cudnn_emulator
from tests.helpers.flags import WHOLE_MATRIX
from tests.helpers.reference import random_documents, reference_attention


@pytest.fixture
def cudnn_hops(monkeypatch):
    calls = cudnn_emulator.install(monkeypatch, cudnn_call)
    monkeypatch.setattr(kernels, "ring_hop_kernel",
                        lambda *a, **k: HopKernel("cudnn", FlashBlocks.square(16), True))
    return calls


@pytest.mark.parametrize("ring,zigzag,packed", [
    (2, False, False), pytest.param(4, True, False, marks=WHOLE_MATRIX),
    (2, True, True), pytest.param(4, False, True, marks=WHOLE_MATRIX)])
def test_a_ring_of_cudnn_hops_matches_one_device(cudnn_hops, ring, zigzag, packed):
    seed = int(np.random.default_rng().integers(1 << 30))
    b, s, hq, hkv, d = 2, 64, 8, 2, 16
    layout = Layout.plan(8, batch=b, seq_len=s, num_heads=hq, num_kv_heads=hkv, groups=1,
                         ring=ring, zigzag=zigzag)
    assert layout.ring == ring
    mesh = make_mesh(layout)
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (b, s, hq, d))
    k, v = (jax.random.normal(x, (b, s, hkv, d)) for x in keys[1:3])
    d_out = jax.random.normal(keys[3], (b, s, hq, d))
    seg = jnp.asarray(random_documents(np.random.default_rng(seed), b, s, 5)) if packed else None
    order = np.asarray(layout.token_order) if zigzag else np.arange(s)
    perm = lambda x: None if x is None else x[:, order]  # noqa: E731
    sharding = activation_sharding(mesh)

    def run(q, k, v, d_out, seg):
        fn = lambda q, k, v: attention(q, k, v, mesh=mesh, layout=layout, causal=True,  # noqa
                                       segment_ids=seg, block_size=16)
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(d_out))

    args = [jax.device_put(perm(x), sharding) for x in (q, k, v, d_out)]
    args.append(None if seg is None else jax.device_put(perm(seg), sharding))
    got = jax.jit(run)(*args)
    _, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, causal=True, segment_ids=seg),
                     q, k, v)
    want = (reference_attention(q, k, v, causal=True, segment_ids=seg), *vjp(d_out))
    case = f"ring={ring} zigzag={zigzag} packed={packed} seed={seed}"
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(perm(w)), atol=5e-5, rtol=5e-5,
                                   err_msg=f"{name}: {case}")
    # the diagonal: cuDNN's causal mask, or with documents our kernel; every other hop one
    # padding-mask kernel (all queries or none, by the side its keys lie on)
    assert set(cudnn_hops) == ({"PADDING"} if packed else {"CAUSAL", "PADDING"}), cudnn_hops


def test_hop_routes():
    hop = HopKernel("cudnn")
    assert hop.route(causal=True, diagonal=True, documents=False) == "causal"
    assert hop.route(causal=True, diagonal=False, documents=False) == "off_diagonal"
    assert hop.route(causal=True, diagonal=False, documents=True) == "off_diagonal"
    assert hop.route(causal=True, diagonal=True, documents=True) == "pallas"
    assert hop.route(causal=False, diagonal=True, documents=False) == "full"
    assert hop.route(causal=False, diagonal=False, documents=True) == "pallas"
    assert HopKernel("pallas").route(causal=True, diagonal=True, documents=False) == "pallas"
    assert not hop.split and HopKernel("pallas").split


def test_a_hop_cudnn_refuses_while_traced_runs_the_pallas_kernel(cudnn_hops, monkeypatch,
                                                                caplog):
    from basp_jax import ring_hops

    def refuse(*args, **kwargs):
        raise RuntimeError("cuDNN is not detected.")

    monkeypatch.setattr(cudnn_call, "check", refuse)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(x, (1, 32, 2, 16)) for x in keys)
    kernel = HopKernel("cudnn", FlashBlocks.square(16), True)
    got = ring_hops.forward(kernel, q, k, v, causal=True, block_size=16, diagonal=False,
                            k_shift=-32)
    want = ring_hops.forward(HopKernel("pallas", FlashBlocks.square(16), True), q, k, v,
                             causal=True, block_size=16, diagonal=False, k_shift=-32)
    assert not cudnn_hops  # no cuDNN kernel bound
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w)
    assert any("its hops run the Pallas kernel" in r.getMessage() for r in caplog.records)
