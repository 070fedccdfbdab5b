"""What the compiled attention communicates: all-to-alls inside each seq group, nothing else big."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from basp_jax import Layout, activation_sharding, attention, make_mesh
from basp_jax.compiled import comm, hlo

B, S, HQ, HKV, D = 2, 64, 8, 2, 16


def _attention_collectives(groups, packed):
    layout = Layout.plan(num_devices=8, batch=B, seq_len=S, num_heads=HQ, num_kv_heads=HKV, groups=groups)
    mesh = make_mesh(layout)
    sharding = activation_sharding(mesh)
    q = jax.ShapeDtypeStruct((B, S, HQ, D), jnp.float32, sharding=sharding)
    kv = jax.ShapeDtypeStruct((B, S, HKV, D), jnp.float32, sharding=sharding)
    seg = jax.ShapeDtypeStruct((B, S), jnp.int32, sharding=sharding) if packed else None

    def forward_and_backward(q, k, v, seg):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, mesh=mesh, segment_ids=seg, impl="xla"), q, k, v)
        return out, vjp(out)

    step = jax.jit(forward_and_backward)
    return comm.compiled_collectives(step, q, kv, kv, seg)


@pytest.mark.parametrize("packed", [False, True])
def test_basp_all_to_alls_stay_inside_each_group(packed):
    found = _attention_collectives(groups=2, packed=packed)
    all_to_all = [c for c in found if c.kind == "all-to-all"]
    assert all_to_all, "no all-to-all compiled"
    for c in all_to_all:
        assert set(c.groups) == {(0, 1, 2, 3), (4, 5, 6, 7)}, c
    float_gathers = [c for c in found if c.kind == "all-gather" and c.dtype.startswith(("f", "bf"))]
    assert not float_gathers, f"activations were all-gathered: {float_gathers}"
    assert {c.kind for c in found} <= {"all-to-all", "all-gather"}, found
    # Host-local by construction: with 4 devices per host, nothing crosses.
    assert not any(comm.crosses_hosts(c, devices_per_host=4) for c in found)


def test_ulysses_all_to_all_spans_all_eight_devices():
    found = _attention_collectives(groups=1, packed=True)
    all_to_all = [c for c in found if c.kind == "all-to-all"]
    assert all_to_all
    for c in all_to_all:
        assert c.groups == (tuple(range(8)),), c
        assert comm.crosses_hosts(c, devices_per_host=4)
    assert not [c for c in found if c.kind == "all-gather" and c.dtype.startswith(("f", "bf"))]


@pytest.mark.slow
def test_all_to_all_bytes_per_device_match_the_closed_form():
    """Forward: q, k, v, out each move B*S/N tokens x heads x D floats per device (kv replicated
    to sp heads when HKV < sp); the backward pass moves the same four again."""
    for groups in (1, 2):
        sp = 8 // groups
        hkv_sent = max(HKV, sp) if HKV % sp else HKV
        per_token = (2 * HQ + 2 * hkv_sent) * D * 4  # q, out + k, v
        expected = 2 * (B * S // 8) * per_token  # forward + backward
        found = [c for c in _attention_collectives(groups, packed=False) if c.kind == "all-to-all"]
        assert sum(c.bytes for c in found) == expected, (groups, [c.bytes for c in found])


HLO_SAMPLES = """
%a = f32[4,8]{1,0} all-to-all(f32[4,8]{1,0} %x), channel_id=1, replica_groups=mesh['group'=2,'seq'=4] {'seq'}, dimensions={0}
%b = bf16[16]{0} all-reduce(bf16[16]{0} %y), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
%c = f32[8]{0} reduce-scatter(f32[32]{0} %z), replica_groups=[2,4]<=[8], dimensions={0}
%d = f32[8]{0} collective-permute(f32[8]{0} %z), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
%e = (f32[2]{0}, f32[8]{0}) all-gather-start(f32[2]{0} %z), replica_groups={{0,1,2,3}}, dimensions={0}
%f = f32[8]{0} all-reduce(f32[8]{0} %y), replica_groups=mesh['group'=2,'seq'=4] {'group'}, to_apply=%add
%g = f32[8]{0} add(f32[8]{0} %y, f32[8]{0} %y)
%h = (f32[8]{0}, f32[4]{0}) all-reduce(f32[8]{0} %y, f32[4]{0} %z), replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, to_apply=%add
%i = f32[8]{0} all-reduce(f32[8]{0} %y), replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_2'}, to_apply=%add
%j = f32[8]{0} all-to-all(f32[8]{0} %y), replica_groups=mesh['axis_0'=2,'axis_1'=4,'axis_2'=1], device_ids=([2,2,2]T(0,2,1)) {'axis_1':(2)2}, dimensions={0}
%k = f32[8]{0} all-gather(f32[1]{0} %y), replica_groups=mesh['group'=4,'seq'=2] {'group':(2)2,'seq','group':(1)2}, dimensions={0}
"""


def test_parser_understands_every_replica_group_printing():
    a, b, c, d, e, f, h, i, j, k = comm.parse_collectives(HLO_SAMPLES)
    # two sub-axes of one axis vary, minor first: group = 4 split [2, 2], device = 4 x major +
    # 2 x minor + seq, ordered (minor, seq, major): one group of all 8 (a staged gather of the
    # adaptive layouts, printed so by newer jax)
    assert k.groups == ((0, 4, 1, 5, 2, 6, 3, 7),)
    # device_ids = iota(8).reshape(2,2,2).transpose(0,2,1) = [0,2,1,3,4,6,5,7] on a (2,4,1) mesh;
    # axis_1 = 4 split as [pre 2, size 2, rest 1], the size-2 factor varying: within row
    # [0, 2, 1, 3] that pairs (0, 2) and (1, 3).
    assert j.groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert (h.bytes, h.groups) == (48, ((0, 1, 2, 3), (4, 5, 6, 7)))
    assert i.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert (a.kind, a.bytes, a.groups) == ("all-to-all", 128, ((0, 1, 2, 3), (4, 5, 6, 7)))
    assert (b.kind, b.dtype, b.bytes) == ("all-reduce", "bf16", 32)
    assert b.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert (c.kind, c.bytes, c.groups) == ("reduce-scatter", 128, ((0, 1, 2, 3), (4, 5, 6, 7)))
    assert (d.kind, d.groups) == ("collective-permute", ((0, 1), (1, 2), (2, 3), (3, 0)))
    assert (e.kind, e.bytes, e.groups) == ("all-gather", 32, ((0, 1, 2, 3),))
    assert f.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert comm.crosses_hosts(f, 4) and not comm.crosses_hosts(a, 4)
    assert comm.inter_host_wire_bytes(f, 4) == f.wire_bytes == 2 * 32 * 1 / 2
    assert comm.inter_host_wire_bytes(a, 4) == 0


def test_ring_hybrid_keeps_all_to_alls_in_runs_and_passes_kv_around_the_ring():
    layout = Layout.plan(num_devices=8, batch=2, seq_len=64, num_heads=4, num_kv_heads=4, groups=1, ring=2)
    mesh = make_mesh(layout)
    sharding = activation_sharding(mesh)
    q = jax.ShapeDtypeStruct((2, 64, 4, 16), jnp.float32, sharding=sharding)
    step = jax.jit(lambda q, k, v: attention(q, k, v, mesh=mesh, layout=layout))
    found = comm.compiled_collectives(step, q, q, q)
    all_to_all = [c for c in found if c.kind == "all-to-all"]
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert all_to_all and all(set(c.groups) == {(0, 1, 2, 3), (4, 5, 6, 7)} for c in all_to_all)
    assert len(permutes) == 2  # k and v, one hop (ring - 1)
    for c in permutes:
        assert sorted(c.groups) == [(i, (i + 4) % 8) for i in range(8)]


@pytest.mark.slow
def test_embedding_gradient_is_not_reduced_one_mesh_axis_at_a_time():
    """The token embedding's gradient (a scatter-add over tokens sharded on both mesh axes) must
    be reduced over the whole mesh at once, never as a full [vocab, d] all-reduce across groups."""
    from flax import nnx

    import models
    from basp_jax.sharding import ShardingRules
    from train.program.step import build_model

    config = models.ModelConfig.preset("tiny")
    layout = Layout.plan(8, 2, 2048, config.num_heads, config.num_kv_heads, devices_per_host=4)
    mesh = make_mesh(layout)
    rules = ShardingRules("fsdp", mesh)
    parts = build_model(lambda: models.Transformer(config, rngs=nnx.Rngs(0), mesh=mesh), rules,
                        init_params=False)
    params, shardings = parts.params, parts.shardings(rules)

    def loss(params, tokens):
        total, count = models.causal_lm_loss(parts.module(params)(tokens), tokens)
        return total / count

    grads = jax.jit(lambda p, t: jax.lax.with_sharding_constraint(jax.grad(loss)(p, t), shardings))
    tokens = jax.ShapeDtypeStruct((2, 2048), jnp.int32, sharding=activation_sharding(mesh))
    embedding_bytes = config.vocab_size * config.hidden_size * 4
    cross_group_only = [
        c for c in comm.compiled_collectives(grads, params, tokens)
        if c.kind == "all-reduce" and c.bytes >= embedding_bytes and all(len({d % 4 for d in g}) == 1 for g in c.groups)
    ]
    assert not cross_group_only, cross_group_only


def test_stored_gpu_hlo_is_read_with_async_pairs_tuples_and_loops():
    text = (Path(__file__).parents[1] / "data" / "gpu_collectives.hlo").read_text()
    found = comm.parse_collectives(text, 8)
    by_kind = {}
    for c in found:
        by_kind.setdefault(c.kind, []).append(c)
    # the start of each async pair counts once; the done is not a second collective
    a2a = sorted(by_kind["all-to-all"], key=lambda c: c.executions)
    assert [(c.bytes, c.executions) for c in a2a] == [(1 * 1024 * 8 * 128 * 2, 1),
                                                     (4096 * 32 * 128 * 2, 32)]
    assert a2a[0].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    (gather,) = by_kind["all-gather"]  # two operands gathered in one op: the two results count
    assert (gather.dtype, gather.bytes) == ("s32", 2 * 16384 * 4)
    (scatter,) = by_kind["reduce-scatter"]  # counted as its full (operand) buffer
    assert (scatter.bytes, scatter.group_size) == (32768 * 4096 * 4, 8)
    (reduce,) = by_kind["all-reduce"]
    assert (reduce.bytes, reduce.group_size) == (8, 8)
    (permute,) = by_kind["collective-permute"]
    assert permute.bytes == 4 and permute.groups[0] == (1, 0)
    summary = comm.summarize(found, 4)
    assert summary["all-to-all"]["count"] == 33
    assert summary["all-to-all"]["inter_host_wire_bytes"] == 0
    assert summary["reduce-scatter"]["inter_host_wire_bytes"] == pytest.approx(
        scatter.wire_bytes * 4 / 7)
    kernels = hlo.attention_kernels(text)
    assert kernels[hlo.KERNEL_CUDNN]["targets"] == ["__cudnn$fmhaSoftmax"]
    assert kernels[hlo.KERNEL_LOOP]["count"] == 1  # the while in the attention_kernel scope


def test_a_combined_collective_of_several_dtypes_is_named_by_its_bulk():
    """XLA's combiner (train.process.gpu_defaults' thresholds) can gather a layer's s32 positions with
    its bf16 weights in one op: the weights' dtype names it, all bytes count."""
    line = ("%g = ((s32[4]{0}, bf16[2,8]{1,0}), (s32[16]{0}, bf16[8,8]{1,0})) all-gather-start("
            "s32[4]{0} %p, bf16[2,8]{1,0} %w), replica_groups={{0,1,2,3}}, dimensions={0}")
    (c,) = comm.parse_collectives(line)
    assert (c.kind, c.dtype, c.bytes) == ("all-gather", "bf16", 16 * 4 + 64 * 2)


def test_an_all_reduce_start_counts_its_results_once_in_either_xla_printing():
    """jax 0.10's XLA prints an async all-reduce start with its results only; newer ones (jax
    >= 0.11) with (operands, results), the operands always a tuple: both read the same bytes."""
    lines = [
        "%a = bf16[2048]{0} all-reduce-start(bf16[2048]{0} %x), replica_groups={{0,4}}",
        "%b = (f32[8]{0}, f32[4]{0}) all-reduce-start(f32[8]{0} %x, f32[4]{0} %y), "
        "replica_groups={{0,4}}",
        "%c = ((bf16[2048]{0}), bf16[2048]{0}) all-reduce-start(%x), channel_id=1, "
        "replica_groups={{0,4}}, output_to_operand_aliasing={{1}: (0, {})}",
        "%d = ((f32[8]{0}, f32[4]{0}), (f32[8]{0}, f32[4]{0})) all-reduce-start(%x, %y), "
        "replica_groups={{0,4}}",
    ]
    a, b, c, d = comm.parse_collectives("\n".join(lines))
    assert [x.bytes for x in (a, b, c, d)] == [4096, 48, 4096, 48]
    assert (c.dtype, d.dtype) == ("bf16", "f32")


def test_overlapped_collectives_sees_compute_between_start_and_done():
    text = """
ENTRY %main (p: bf16[8]) -> bf16[8] {
  %p = bf16[8]{0} parameter(0)
  %s1 = (bf16[8]{0}, bf16[8]{0}) all-to-all-start(bf16[8]{0} %p), replica_groups={{0,1}}
  %d1 = bf16[8]{0} all-to-all-done((bf16[8]{0}, bf16[8]{0}) %s1)
  %s2 = (bf16[8]{0}, bf16[32]{0}) all-gather-start(bf16[8]{0} %d1), replica_groups={{0,1,2,3}}
  %f = bf16[8]{0} fusion(bf16[8]{0} %d1), kind=kLoop, calls=%fused
  %d2 = bf16[32]{0} all-gather-done((bf16[8]{0}, bf16[32]{0}) %s2)
  ROOT %r = bf16[8]{0} bitcast(bf16[8]{0} %f)
}
"""
    assert hlo.overlapped_collectives(text) == {"all-to-all": {"pairs": 1, "overlapped": 0},
                                                "all-gather": {"pairs": 1, "overlapped": 1}}


def test_compile_report_rows_do_not_merge_group_sizes():
    """train.tools.aot's table, one row per (kind, dtype, group size). Two f32 all-reduces of the GPU
    host-sharded step: the loss's 8-byte sums over all 8 devices, and the embedding
    gradient's 1/4 shard between the hosts. Merged, they printed as 250.5 MiB over 8 devices."""
    from train.tools.gpu_compile import collective_rows

    text = """
  %all-reduce-start.2 = f32[2]{0} all-reduce-start(%wrapped_concatenate), channel_id=204, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%region_29.32.clone
  %all-reduce-start = f32[32064,2048]{1,0} all-reduce-start(%bitcast.311.0), channel_id=83, replica_groups=mesh['axis_0'=2,'axis_1'=4,'axis_2'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%region_24.28.clone
"""
    found = comm.parse_collectives(text, 8)
    assert {c.groups[0] for c in found} == {tuple(range(8)), (0, 4)}
    rows = collective_rows(found, devices_per_host=4, num_layers=2, grad_accum=1)
    assert [(r["dtype"], r["group_size"], r["bytes"]) for r in rows] == [
        ("f32", 2, 32064 * 2048 * 4), ("f32", 8, 8)]
    assert rows[0]["inter_host_wire_bytes"] == 32064 * 2048 * 4  # 2 (n-1)/n x the shard, n = 2


def test_collectives_in_a_loop_of_unknown_trip_count_are_flagged():
    """A while whose backend_config records no trip count (XLA's double-buffered microbatch loop
    at grad_accum=4): its collectives are counted once and reported as such; a loop with a
    known trip count is not."""
    def loop(name):
        return (f"%body_{name} (p: f32[8]) -> f32[8] {{\n"
                f"  %p = f32[8] parameter(0)\n"
                f"  ROOT %ar_{name} = f32[8] all-reduce(%p), replica_groups={{{{0,1}}}}, "
                f"to_apply=%add\n}}\n")
    text = (loop("known") + loop("unknown") +
            "ENTRY %main (x: f32[8]) -> f32[8] {\n  %x = f32[8] parameter(0)\n"
            '  %w1 = f32[8] while(%x), condition=%c, body=%body_known, '
            'backend_config={"known_trip_count":{"n":"3"}}\n'
            '  ROOT %w2 = f32[8] while(%w1), condition=%c, body=%body_unknown, '
            'backend_config={"known_induction_variable":{"tuple_index":"0"}}\n}\n')
    assert sorted(c.executions for c in comm.parse_collectives(text, 2)) == [1, 3]
    assert comm.in_unknown_loops(text) == 1


# A GPU program's FP8 matmuls in both of XLA's forms, inside a scanned layer loop of 4 trips:
# cuBLASLt's FP8 call (what XLA picks with --xla_gpu_enable_triton_gemm=false) and a GEMM fusion
# whose dot takes f8 operands (its Triton GEMM, the default when compiled without a GPU); a bf16
# GEMM fusion beside them is not counted.
FP8_GEMMS_HLO = """HloModule jit_train_step

%fp8_gemm (a: f8e4m3fn[64,32], b: f8e4m3fn[32,16]) -> bf16[64,16] {
  %a = f8e4m3fn[64,32]{1,0} parameter(0)
  %b = f8e4m3fn[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%bf16_gemm (c: bf16[64,32], d: bf16[32,16]) -> bf16[64,16] {
  %c = bf16[64,32]{1,0} parameter(0)
  %d = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.2 = bf16[64,16]{1,0} dot(%c, %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%layer_body (p: (s32[], f8e4m3fn[64,32], f8e4m3fn[32,16])) -> (s32[], f8e4m3fn[64,32], f8e4m3fn[32,16]) {
  %p = (s32[], f8e4m3fn[64,32]{1,0}, f8e4m3fn[32,16]{1,0}) parameter(0)
  %x = f8e4m3fn[64,32]{1,0} get-tuple-element(%p), index=1
  %w = f8e4m3fn[32,16]{1,0} get-tuple-element(%p), index=2
  %lt = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul$f8"
  %fusion.1 = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fp8_gemm
  %xb = bf16[64,32]{1,0} convert(%x)
  %wb = bf16[32,16]{1,0} convert(%w)
  %fusion.2 = bf16[64,16]{1,0} fusion(%xb, %wb), kind=kCustom, calls=%bf16_gemm
  ROOT %t = (s32[], f8e4m3fn[64,32]{1,0}, f8e4m3fn[32,16]{1,0}) tuple(%p)
}

%layer_cond (q: (s32[], f8e4m3fn[64,32], f8e4m3fn[32,16])) -> pred[] {
  %q = (s32[], f8e4m3fn[64,32]{1,0}, f8e4m3fn[32,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (init: (s32[], f8e4m3fn[64,32], f8e4m3fn[32,16])) -> (s32[], f8e4m3fn[64,32], f8e4m3fn[32,16]) {
  %init = (s32[], f8e4m3fn[64,32]{1,0}, f8e4m3fn[32,16]{1,0}) parameter(0)
  ROOT %while.1 = (s32[], f8e4m3fn[64,32]{1,0}, f8e4m3fn[32,16]{1,0}) while(%init), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_fp8_gemms_counts_cublaslt_calls_and_fp8_gemm_fusions_per_execution():
    from basp_jax.compiled import hlo

    assert hlo.fp8_gemms(FP8_GEMMS_HLO) == {"cublaslt": 4, "fusion": 4, "total": 8}
    # the same GEMM fusion on bf16 operands is not an FP8 GEMM
    assert hlo.fp8_gemms(FP8_GEMMS_HLO.replace("f8e4m3fn", "bf16"))["fusion"] == 0
