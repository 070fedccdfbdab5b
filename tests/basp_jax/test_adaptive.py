"""Adaptive layouts (basp_jax.adaptive): the set, the predicted gain, and on 8 CPU
devices a tiny Transformer whose packed step gives the same loss and gradients on every layout
of the set, and whose parameters switch layouts without moving.

Tolerances (float32): loss sums rtol 1e-6 (observed ~7e-8 between layouts); gradients of the
mean loss atol 1e-6 + rtol 1e-4, as tests/models/test_parallel.py.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from basp_jax import Layout, LayoutError, activation_sharding, adaptive, make_mesh, packing
from basp_jax.compiled import comm
from basp_jax.planner import gain
from basp_jax.planner.hardware import HARDWARE
from basp_jax.planner.shape import ModelShape
from basp_jax.sharding import host_mesh
from tests.helpers.documents import SET_WIDTHS, documents

N, HOST = 8, 4  # devices, devices per emulated host
S = 128  # the static layout's row: 1 row of 128 tokens on (1, 8)
HEADS, KV = 8, 2


def _set(**kwargs):
    return adaptive.layout_set(N, 1, S, HEADS, KV, devices_per_host=HOST, **kwargs)


# ------------------------------------------------------------------------------------ the set

def test_the_set_keeps_tokens_per_device_and_halves_the_groups_all_to_all():
    layouts = _set()
    assert [(lay.groups, lay.sp, lay.batch, lay.seq_len) for lay in layouts] == [
        (1, 8, 1, 128), (2, 4, 2, 64), (4, 2, 4, 32), (8, 1, 8, 16)]
    assert {lay.tokens_per_device for lay in layouts} == {S // N}
    assert [lay.group_within_host for lay in layouts] == [False, True, True, True]
    # host_rings: the static layout's group spans both hosts: all-to-all inside each, ring over
    ringed = _set(host_rings=True)
    assert [(lay.ring, lay.a2a) for lay in ringed] == [(2, 4), (1, 4), (1, 2), (1, 1)]
    # a batch of 2 starts at (2, 4); 6 devices: 4 groups do not divide them, so the set stops
    assert [lay.groups for lay in adaptive.layout_set(N, 2, S, HEADS, KV, HOST)] == [2, 4, 8]
    assert [lay.groups for lay in adaptive.layout_set(6, 1, 48, 6, 6, 6)] == [1, 2]
    # a ulysses base: the others are basp layouts
    assert [lay.mode for lay in _set(mode="ulysses")] == ["ulysses", "basp", "basp", "basp"]


def test_strategies_that_share_a_placement_and_hsdp_refused():
    assert [name for name in ("fsdp", "hsdp", "host", "replicated")
            if adaptive.shares_placement(name)] == ["fsdp", "host", "replicated"]
    with pytest.raises(LayoutError, match="param_sharding='hsdp'") as info:
        _set(param_sharding="hsdp")
    assert "\n" not in str(info.value)
    with pytest.raises(LayoutError, match="pad rows"):
        adaptive.expand(Layout.plan(N, 3, S, HEADS, KV, groups=4, pad_rows=1))


def test_every_layout_orders_the_devices_alike():
    """The reason fsdp and host placements coincide: make_mesh reshapes one host-major device
    list, so the flattened ('group', 'seq') order, and the ('host', 'local') mesh, are the
    same for every (g, sp); a split over 'seq' alone (hsdp) is not."""
    meshes = [make_mesh(lay) for lay in _set()]
    flat = [[d.id for d in m.devices.flat] for m in meshes]
    assert all(f == flat[0] for f in flat)
    hosts = [host_mesh(m, HOST).devices.tolist() for m in meshes]
    assert all(h == hosts[0] for h in hosts)
    for spec, shared in [(P(("group", "seq"), None), True), (P(None, ("group", "seq")), True),
                         (P(), True), (P("seq"), False)]:
        a = NamedSharding(meshes[0], spec)
        same = [NamedSharding(m, spec).is_equivalent_to(a, 2) for m in meshes[1:]]
        assert all(same) if shared else not any(same), spec


def test_layout_steps_builds_each_layout_once():
    built = []
    steps = adaptive.LayoutSteps(lambda lay: built.append(lay) or (lambda: lay.groups))
    layouts = _set()
    for lay in layouts + layouts[::-1]:
        assert steps(lay)() == lay.groups
    assert built == list(layouts) and len(steps) == len(layouts)


# ------------------------------------------------------------------------------ predicted gain

SHAPE = ModelShape(32, 4096, 14336, 32, 8, 128, 128256)  # Llama-3.1-8B's sizes
LONG = 16384


def _steps(rng, count, sample):
    """Steps of documents drawn from `sample` until the next would overflow one row of LONG."""
    steps = []
    for _ in range(count):
        step, used = [], 0
        while True:
            n = int(min(sample(rng), LONG + 1))
            if used + n - 1 > LONG:
                break
            step.append(n)
            used += n - 1
        steps.append(step or [LONG + 1])
    return steps


def test_predicted_gain_of_a_long_tail_across_hosts_and_none_at_full_context():
    hw = HARDWARE["a100-40gb"]  # 2 hosts of 4
    layouts = adaptive.layout_set(N, 1, LONG, 32, 8, devices_per_host=hw.devices_per_host)
    rng = np.random.default_rng(0)
    tail = _steps(rng, 64, lambda r: r.lognormal(6.5, 1.2) + 2)  # median ~670 tokens
    tail_gain = gain.predicted_gain(SHAPE, layouts, tail, hw=hw, remat="full")
    assert tail_gain.gain > 1.0, tail_gain
    assert tail_gain.share(0) < 1.0
    assert tail_gain.step_s[1] < tail_gain.step_s[0]  # (2, 4): all-to-alls inside one host
    full = gain.predicted_gain(SHAPE, layouts, [[LONG + 1]] * 8, hw=hw, remat="full")
    assert full.gain == pytest.approx(1.0, rel=0.03) and full.chosen == (0,) * 8
    with pytest.raises(LayoutError, match="hsdp"):
        gain.predicted_gain(SHAPE, layouts, tail, hw=hw, param_sharding="hsdp")


# ------------------------------------------------------------- a tiny Transformer on the set

def _tiny():
    import models

    return dataclasses.replace(models.ModelConfig.preset("tiny"), vocab_size=128, hidden_size=64,
                               intermediate_size=128, head_dim=8)


def _built(layout, param_sharding="fsdp"):
    """(graphdef, params, rest) of the tiny model initialised onto the layout's mesh."""
    import models
    from flax import nnx

    model = models.init_model(_tiny(), seed=0, mesh=make_mesh(layout), layout=layout,
                              param_sharding=param_sharding, attn_impl="xla")
    return nnx.split(model, nnx.Param, ...)


def _step(graphdef, rest, shardings=None):
    """jit of (params, tokens, targets, segment_ids) -> ((loss sum, count), grads of the sum),
    the gradients constrained to the parameters' shardings as the trainer's step does."""
    from flax import nnx

    def loss(params, tokens, targets, segment_ids):
        return nnx.merge(graphdef, params, rest).loss(tokens, targets, segment_ids)

    def step(params, *batch):
        out, grads = jax.value_and_grad(loss, has_aux=True)(params, *batch)
        if shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, shardings)
        return out, grads

    return jax.jit(step)


def _placed(layout, param_sharding):
    """The tiny model's parameters as ShapeDtypeStructs placed for the layout (nothing compiled:
    the placement is the rules', the values would not change it)."""
    from flax import nnx

    import models
    from models.options import RunOptions
    from models.transformer import build_sharded

    options = RunOptions.of(mesh=make_mesh(layout), layout=layout, param_sharding=param_sharding,
                            attn_impl="xla")
    make = lambda: models.Transformer(_tiny(), rngs=nnx.Rngs(0), options=options)  # noqa: E731
    return build_sharded(make, options.rules, init_params=False)[2]


def _shardings(params):
    return jax.tree.map(lambda x: x.sharding, params)


def _batch(packed):
    return [jnp.asarray(x) for x in (packed.tokens, packed.targets, packed.segment_ids)]


@pytest.mark.parametrize("param_sharding", ["fsdp", "host", "staged_keep", "hsdp"])
def test_model_parameters_sit_alike_on_every_layout(param_sharding):
    """Every parameter of the tiny model placed for each layout of the set is placed
    equivalently (same devices, same slices) under fsdp, host and staged; under hsdp it is not
    (which is why layout_set refuses it)."""
    layouts = _set()
    placed = [jax.tree.leaves(_placed(lay, param_sharding)) for lay in layouts]
    same = [all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in zip(placed[0], other))
            for other in placed[1:]]
    assert all(same) if adaptive.shares_placement(param_sharding) else not any(same), same


@pytest.fixture(scope="module")
def on_the_set():
    """Each layout of the set with its model, its step, and the step's packing of the same
    documents (SET_WIDTHS: every layout holds them)."""
    layouts = _set()
    docs = documents([w + 1 for w in SET_WIDTHS], vocab=_tiny().vocab_size)
    pieces = packing.pieces_of_documents(docs, S)
    out = []
    for i, lay in enumerate(layouts):
        graphdef, params, rest = _built(lay)
        packed = packing.pack(pieces, lay, i)
        assert packed is not None, lay
        out.append((lay, graphdef, params, rest, packed))
    return out


@pytest.mark.slow
def test_loss_and_gradients_equal_on_every_layout_of_the_set_and_one_device(on_the_set):
    """The same documents packed for (1, 8), (2, 4), (4, 2), (8, 1): one set of parameters
    (placed for the static layout, relabelled, never copied), the same loss sum and count and
    the same gradients, equal to one device's."""
    from flax import nnx
    import models

    _, _, base_params, _, base_packed = on_the_set[0]
    single = nnx.split(models.Transformer(_tiny(), rngs=nnx.Rngs(0), attn_impl="xla"),
                       nnx.Param, ...)
    host_params = jax.tree.map(np.asarray, base_params)
    (total_1, count_1), grads_1 = _step(single[0], single[2])(host_params, *_batch(base_packed))
    reference = jax.tree.map(lambda g: np.asarray(g) / float(count_1), grads_1)
    assert float(count_1) == sum(SET_WIDTHS)
    assert max(np.abs(g).max() for g in jax.tree.leaves(reference)) > 1e-3
    for lay, graphdef, params, rest, packed in on_the_set:
        shardings = _shardings(params)
        switched = adaptive.relabel(base_params, shardings)
        (total, count), grads = _step(graphdef, rest, shardings)(switched, *_batch(packed))
        assert float(count) == float(count_1), lay.groups
        np.testing.assert_allclose(float(total), float(total_1), rtol=1e-6)
        for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
            np.testing.assert_allclose(np.asarray(g) / float(count), ref, atol=1e-6, rtol=1e-4,
                                       err_msg=f"groups={lay.groups}")


def _program_text(hlo: str) -> str:
    """The compiled program without its source metadata (op_name, source lines and the stack
    frame tables, which name the Python files that compiled anything before in this process)
    and without jax 0.12's mesh names of replica groups (`mesh['group'=1,'seq'=8] {'seq'}` on
    A's mesh is `mesh['group'=8,'seq'=1] {'group'}` on B's: the same devices; the caller
    compares the device groups themselves with comm.parse_collectives)."""
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    hlo = re.sub(r"replica_groups=mesh\[[^\]]*\] \{[^}]*\}", "replica_groups=<mesh>", hlo)
    return re.sub(r"\nFileNames\n.*?\n(?=%|ENTRY)", "\n", hlo, flags=re.S)


@pytest.mark.slow
def test_switching_layouts_moves_no_parameter(on_the_set):
    """Layout B's step compiled for parameters placed for the static layout A is the program
    compiled for B's own placement, collectives and all (so the switch adds none), and placing
    A's parameters for B shares their buffers (no transfer). An hsdp placement is refused.
    (The programs are compared for (2, 4), whose groups and sp both differ from A's (1, 8); the
    buffers for every layout.)"""
    _, _, params_a, _, _ = on_the_set[0]
    for lay, graphdef, params_b, rest, packed in on_the_set[1:]:
        shardings = _shardings(params_b)
        if lay.groups == 2:
            step = _step(graphdef, rest, shardings)
            rows = activation_sharding(make_mesh(lay))
            abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows)
                        for x in _batch(packed)]
            hlo = {name: _program_text(step.lower(p, *abstract).compile().as_text())
                   for name, p in (("A", params_a), ("B", params_b))}
            found = comm.parse_collectives(hlo["B"], N)
            assert found and comm.parse_collectives(hlo["A"], N) == found
            assert hlo["A"] == hlo["B"], lay.groups
            # the check sees a placement that differs: replicated parameters compile to other
            # collectives
            whole = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(x.sharding.mesh, P())), params_a)
            assert comm.parse_collectives(step.lower(whole, *abstract).compile().as_text(),
                                          N) != found
        moved = adaptive.relabel(params_a, params_b)
        for a, b, target in zip(*(jax.tree.leaves(t) for t in (params_a, moved, shardings))):
            assert a.sharding.is_equivalent_to(target, a.ndim)
            assert b.sharding == target
            assert [s.data.unsafe_buffer_pointer() for s in a.addressable_shards] == \
                [s.data.unsafe_buffer_pointer() for s in b.addressable_shards]
    meshes = [make_mesh(lay) for lay, *_ in on_the_set[:2]]
    x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(meshes[0], P("seq")))
    with pytest.raises(LayoutError, match="switching would move it"):
        adaptive.relabel(x, NamedSharding(meshes[1], P("seq")))


@pytest.mark.slow
def test_a_ring_static_layout_and_its_sibling_give_the_same_loss_and_gradients():
    """host_rings: the static (1, 8) layout runs a zig-zag ring of 2 over the hosts; the same
    documents on (2, 4) (no ring, natural order) give its loss and gradients, the parameters
    relabelled from the ring layout's placement."""
    layouts = adaptive.layout_set(N, 1, S, HEADS, KV, HOST, host_rings=True, zigzag=True)
    assert (layouts[0].ring, layouts[0].zigzag) == (2, True) and layouts[1].ring == 1
    docs = documents([w + 1 for w in SET_WIDTHS], vocab=_tiny().vocab_size)
    pieces = packing.pieces_of_documents(docs, S)
    params_a, results = None, []
    for i, lay in enumerate(layouts[:2]):
        graphdef, params, rest = _built(lay)
        params_a = params if params_a is None else params_a
        shardings = _shardings(params)
        (total, count), grads = _step(graphdef, rest, shardings)(
            adaptive.relabel(params_a, shardings), *_batch(packing.pack(pieces, lay, i)))
        results.append((float(total), float(count), jax.tree.leaves(grads)))
    (total_a, count_a, grads_a), (total_b, count_b, grads_b) = results
    assert count_a == count_b == sum(SET_WIDTHS)
    np.testing.assert_allclose(total_b, total_a, rtol=1e-6)
    for a, b in zip(grads_a, grads_b):
        np.testing.assert_allclose(np.asarray(b) / count_b, np.asarray(a) / count_a, atol=1e-6,
                                   rtol=1e-4)
