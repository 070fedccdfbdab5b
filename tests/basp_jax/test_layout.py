"""Layout planning, mesh placement and every validation error (raised before anything compiles)."""

import jax
import jax.numpy as jnp
import pytest

from basp_jax import Layout, LayoutError, attention, make_mesh, mesh_groups
from basp_jax.layout import kv_replication


def plan(**overrides):
    args = dict(num_devices=8, batch=2, seq_len=4096, num_heads=32, num_kv_heads=8, devices_per_host=4)
    args.update(overrides)
    return Layout.plan(**args)


def test_basp_takes_one_group_per_sequence_when_batch_divides_devices():
    layout = plan(mode="basp")
    assert (layout.groups, layout.sp) == (2, 4)
    assert layout.group_within_host and layout.tokens_per_device == 2 * 4096 // 8
    assert (plan(batch=4).groups, plan(batch=8).groups, plan(batch=1).groups) == (4, 8, 1)


def test_ulysses_is_one_group_over_all_devices():
    layout = plan(mode="ulysses")
    assert (layout.groups, layout.sp) == (1, 8)
    assert not layout.group_within_host
    assert layout.tokens_per_device == plan(mode="basp").tokens_per_device  # same memory


def test_batch_that_does_not_divide_devices_uses_the_gcd():
    assert (plan(batch=6).groups, plan(batch=6).sp) == (2, 4)
    assert (plan(batch=12).groups, plan(batch=3).groups) == (4, 1)


def test_kv_replication_is_the_fewest_copies():
    assert kv_replication(32, 8, 4) == 1
    assert kv_replication(32, 8, 16) == 2
    assert kv_replication(8, 2, 8) == 4
    assert kv_replication(8, 1, 8) == 8
    assert kv_replication(12, 6, 4) == 2  # 6 heads -> 12 copies, divisible by 4


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (dict(seq_len=1001, batch=1), "seq_len=1001 is not divisible by sp=8; use a multiple of 8 (e.g. 1001 -> 1008"),
        (dict(num_heads=28, num_kv_heads=4, batch=1), "num_heads=28 is not divisible by the all-to-all degree 8 (sp=8, ring=1)"),
        (dict(num_heads=32, num_kv_heads=6), "num_heads=32 is not a multiple of num_kv_heads=6"),
        (dict(batch=3, groups=2), "batch=3 is not divisible by groups=2"),
        (dict(groups=3), "groups=3 does not divide num_devices=8"),
        (dict(devices_per_host=3), "devices_per_host=3 does not divide num_devices=8"),
        (dict(batch=0), "batch must be a positive integer, got 0"),
        (dict(num_devices=-8), "num_devices must be a positive integer, got -8"),
        (dict(seq_len=2.5), "seq_len must be a positive integer, got 2.5"),
        (dict(mode="ring"), "unknown parallel mode 'ring'"),
        (dict(mode="ulysses", groups=2), "mode='ulysses' means groups=1"),
        (dict(ring=0), "ring must be a positive integer, got 0"),
        (dict(seq_len=1000, ring=2, zigzag=True, num_heads=4, num_kv_heads=4, batch=1),
         "zig-zag ring attention needs seq_len divisible by 2 * sp = 16"),
        (dict(pad_rows=-1), "pad_rows must be a non-negative integer, got -1"),
    ],
)
def test_plan_rejects_impossible_layouts_with_one_line(overrides, fragment):
    with pytest.raises(LayoutError) as err:
        plan(**overrides)
    message = str(err.value)
    assert fragment in message and "\n" not in message


def test_head_padding_is_opt_in_and_recorded():
    with pytest.raises(LayoutError, match=r"or pad_heads=True to compute 32 heads \(4 of them zero padding\)"):
        plan(num_heads=28, num_kv_heads=4, batch=1)
    layout = plan(num_heads=28, num_kv_heads=4, batch=1, pad_heads=True)
    assert (layout.sp, layout.pad_heads, layout.padded_heads, layout.kv_replication) == (8, True, 32, 2)
    assert not plan(pad_heads=True).pad_heads  # nothing to pad


def test_ring_splits_sp_so_it_may_exceed_the_heads():
    layout = plan(num_heads=4, num_kv_heads=4, batch=1, ring=2)
    assert (layout.sp, layout.ring, layout.a2a, layout.pad_heads) == (8, 2, 4, False)
    with pytest.raises(LayoutError, match=r"ring=2 \(ring attention across runs of 4\)"):
        plan(num_heads=4, num_kv_heads=4, batch=1)
    with pytest.raises(LayoutError, match=r"ring=3 does not divide sp=8; use ring in \[1, 2, 4, 8\]"):
        plan(batch=1, ring=3)


def test_the_layout_knows_its_token_order_runs_hops_and_pad_rows():
    """zigzag only with a ring; the runs and hops the ring attention and the cost model ask for."""
    assert plan(zigzag=True).token_order is None and not plan(zigzag=True).zigzag  # no ring
    layout = plan(num_heads=4, num_kv_heads=4, batch=1, ring=2, zigzag=True)
    assert layout.zigzag and list(layout.token_order[:128]) == list(range(128))
    assert list(layout.token_order[1024:1152]) == list(range(3072, 3200))  # halves 0, 3, 1, 2
    assert layout.a2a_runs == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.ring_hops == [(i, (i + 4) % 8) for i in range(8)]
    assert layout.replan(zigzag=False).token_order is None
    padded = plan(batch=3, pad_rows=1)
    assert (padded.batch, padded.pad_rows, padded.groups) == (4, 1, 4)
    assert padded.replan(ring=2) == plan(batch=3, pad_rows=1, ring=2)
    gqa = plan(num_heads=28, num_kv_heads=4, batch=1, pad_heads=True)
    assert gqa.head_groups == (4, 8) and gqa.exchanged_heads == (32, 8)


def test_attention_refuses_a_layout_of_another_mesh():
    x = jax.ShapeDtypeStruct((8, 64, 8, 16), jnp.float32)
    layout = Layout.plan(8, batch=8, seq_len=64, num_heads=8, groups=2)
    with pytest.raises(LayoutError, match="the layout splits groups=2 x sp=4 but the mesh is 1 x 8"):
        jax.jit(lambda x: attention(x, x, x, mesh=_mesh(1), layout=layout)).trace(x)


def test_errors_suggest_what_would_work():
    with pytest.raises(LayoutError, match=r"sp in \[1, 2, 4\]"):
        plan(seq_len=1004, batch=1)  # 1004 = 4 * 251
    with pytest.raises(LayoutError, match=r"sp in \[1, 2, 4\]"):
        plan(num_heads=28, num_kv_heads=4, batch=1)


def test_mesh_places_each_group_on_consecutive_devices():
    mesh = make_mesh(plan(mode="basp"))
    assert mesh.axis_names == ("group", "seq") and mesh.devices.shape == (2, 4)
    assert mesh_groups(mesh) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh_groups(make_mesh(plan(mode="ulysses"))) == [list(range(8))]
    assert mesh_groups(make_mesh(plan(batch=4))) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_mesh_orders_devices_by_host_then_id():
    shuffled = list(reversed(jax.devices()))
    assert mesh_groups(make_mesh(plan(), devices=shuffled)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_mesh_rejects_a_layout_for_another_device_count():
    with pytest.raises(LayoutError, match="the layout is for 8 devices but 4 were given"):
        make_mesh(plan(), devices=jax.devices()[:4])


def _mesh(groups):
    return make_mesh(Layout.plan(8, batch=8, seq_len=64, num_heads=8, groups=groups))


@pytest.mark.parametrize(
    "shape,kwargs,fragment",
    [
        ((8, 64, 8, 16), dict(k_shape=(8, 64, 3, 16)), "num_heads=8 is not a multiple of num_kv_heads=3"),
        ((8, 60, 8, 16), dict(), "seq_len=60 is not divisible by sp=8"),
        ((6, 64, 8, 16), dict(groups=4), "batch=6 is not divisible by groups=4"),
        ((8, 64, 8), dict(), "attention takes q, k, v of rank 4"),
        ((8, 64, 8, 16), dict(seg_shape=(8, 32)), "segment_ids must have shape (8, 64)"),
        ((8, 64, 8, 16), dict(seg_dtype=jnp.float32), "segment_ids must be integers"),
    ],
)
def test_attention_rejects_bad_inputs_before_compiling(shape, kwargs, fragment):
    mesh = _mesh(kwargs.get("groups", 1))
    q = jax.ShapeDtypeStruct(shape, jnp.float32)
    k = jax.ShapeDtypeStruct(kwargs.get("k_shape", shape), jnp.float32)
    seg = None
    if "seg_shape" in kwargs or "seg_dtype" in kwargs:
        seg = jax.ShapeDtypeStruct(kwargs.get("seg_shape", shape[:2]), kwargs.get("seg_dtype", jnp.int32))
    fn = jax.jit(lambda q, k, v, s: attention(q, k, v, mesh=mesh, segment_ids=s))
    with pytest.raises(LayoutError) as err:
        fn.trace(q, k, k, seg)  # tracing only: the error comes before lowering or compiling
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_unknown_or_unavailable_kernels_are_refused():
    mesh = _mesh(1)
    x = jnp.zeros((8, 64, 8, 16))
    with pytest.raises(ValueError, match="unknown attention impl 'flash'"):
        attention(x, x, x, mesh=mesh, impl="flash")
    with pytest.raises(ValueError, match="impl='cudnn' needs a GPU but the mesh is on cpu"):
        attention(x, x, x, mesh=mesh, impl="cudnn")


