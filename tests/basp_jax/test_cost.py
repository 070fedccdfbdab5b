"""The topology cost model and the plan CLI."""

import re

import pytest

from basp_jax.planner import cost, memory, traffic
from basp_jax.planner.cost import predict
from basp_jax.planner.hardware import HARDWARE
from basp_jax.planner.precisions import Precisions
from basp_jax.planner.shape import ModelShape
from basp_jax.remat import REMAT_POLICIES
from models.config import MODEL_SHAPES
from train.data import synthetic
from train.tools import plan


def _layout(shape, groups, *, batch=2, seq_len=16384, hw=HARDWARE["a100-40gb"], **kwargs):
    """The (groups, 8 // groups) layout of `shape` on 8 devices of `hw`."""
    return cost.plan_layout(shape, num_devices=8, batch=batch, seq_len=seq_len, groups=groups,
                            devices_per_host=hw.devices_per_host, **kwargs)


def test_all_to_all_traffic_closed_form():
    """Per device per layer: 2 passes x (2*Hq + 2*Hkv) x Dh x bytes x tokens x (sp-1)/sp."""
    shape = MODEL_SHAPES["llama-3.1-8b"]
    hw = HARDWARE["a100-40gb"]
    tokens = 2 * 16384 / 8
    for groups, sp, inter_share in [(1, 8, 4 / 7), (2, 4, 0.0)]:
        p = predict(shape, _layout(shape, groups), "fsdp", hw=hw)
        per_layer = 2 * tokens * (2 * 32 + 2 * 8) * 128 * 2 * (sp - 1) / sp
        total = per_layer * shape.num_layers
        assert p.all_to_all.intra + p.all_to_all.inter == pytest.approx(total)
        assert p.all_to_all.inter == pytest.approx(total * inter_share)


def test_each_remat_policy_pays_for_the_all_to_alls_it_repeats():
    """The backward pass repeats what a policy keeps of no exchange: full keeps all four (8 per
    layer), full_kv k and v (10: q's and the output's again, each Hq wide), inputs and offload
    none (12); what full_kv keeps is the k/v width only, a fifth of full's exchanged values."""
    shape = MODEL_SHAPES["llama-3.1-8b"]
    hw = HARDWARE["h100-80gb"]
    layout = _layout(shape, 2, seq_len=131072, hw=hw)
    tokens = 2 * 131072 / 8
    one = tokens * 128 * 2 * 3 / 4 * shape.num_layers  # one head's exchange, every layer
    a2a = {remat: predict(shape, layout, "fsdp", hw=hw, remat=remat).all_to_all.intra
           for remat in ("full", "full_kv", "inputs", "offload", "offload_exchanges")}
    assert a2a["full"] == pytest.approx(2 * (2 * 32 + 2 * 8) * one)
    assert a2a["offload_exchanges"] == pytest.approx(a2a["full"])
    assert a2a["full_kv"] - a2a["full"] == pytest.approx(2 * 32 * one)
    assert a2a["offload"] - a2a["full"] == pytest.approx((2 * 32 + 2 * 8) * one)
    assert a2a["inputs"] == pytest.approx(a2a["offload"])
    saved = {remat: memory.memory_terms(shape, tokens, 8, q_heads=32, kv_heads=8,
                                        remat=remat)["saved"]
             for remat in ("full", "full_kv", "inputs")}
    assert saved["inputs"] == pytest.approx(saved["full"] * 4096 / (4096 + (2 * 32 + 2 * 8) * 128))
    assert saved["full_kv"] - saved["inputs"] == pytest.approx((saved["full"] - saved["inputs"]) / 5)


def test_hsdp_moves_only_a_shard_across_hosts():
    shape = MODEL_SHAPES["llama-3.2-1b"]
    hw = HARDWARE["a100-40gb"]
    fsdp = predict(shape, _layout(shape, 2), "fsdp", hw=hw)
    hsdp = predict(shape, _layout(shape, 2), "hsdp", hw=hw)
    # HSDP: one all-reduce of the gradient shard (1/sp; bf16, as the layers computed it) between
    # the 2 groups: 2 * 1/2 of it.
    assert hsdp.params.inter == pytest.approx(shape.num_params * 2 / 4 * 2 * (2 - 1) / 2)
    assert fsdp.params.inter > 3 * hsdp.params.inter
    assert hsdp.memory_bytes > fsdp.memory_bytes  # state is sharded over 4 devices, not 8


def test_planner_picks_the_papers_layout_in_the_papers_case():
    preds = cost.plan_table(MODEL_SHAPES["llama-3.1-8b"], batch=2, seq_len=16384, num_devices=8,
                            hw=HARDWARE["a100-40gb"])
    best = preds[0].layout
    assert (best.groups, best.sp) == (2, 4)
    ulysses = next(p for p in preds if p.layout.groups == 1)
    basp_fsdp = next(p for p in preds if p.name == "basp (2,4) fsdp")
    assert basp_fsdp.all_to_all_s < ulysses.all_to_all_s / 3  # no inter-host all-to-all at all


def test_host_sharding_sends_the_minimal_gradient_across_hosts_at_any_batch():
    """Host sharding's inter-host bytes are the closed-form minimum for every seq group size;
    HSDP reaches it only when a seq group fills a host (at B=8 it sends devices-per-host x)."""
    shape, hw = MODEL_SHAPES["llama-3.2-1b"], HARDWARE["a100-40gb"]  # 4 devices per host
    table = shape.vocab_size * shape.hidden_size  # tied: one table, used in float32
    # the bf16 gradient the bf16 layers produce, the table's in float32 (compiled GPU programs)
    grads = (shape.num_params - table) * 2 + table * 4
    minimum = traffic.min_inter_host_gradient_bytes(grads, 8, 4)
    assert minimum == pytest.approx(grads / 4)  # 2 hosts: all-reduce of a quarter shard
    assert traffic.min_inter_host_gradient_bytes(grads, 8, 8) == 0
    for groups in (1, 2, 4, 8):
        host = cost.predict(shape, _layout(shape, groups, batch=8, seq_len=4096), "host", hw=hw)
        assert host.params.inter == pytest.approx(minimum), groups
    hsdp = cost.predict(shape, _layout(shape, 8, batch=8, seq_len=4096), "hsdp", hw=hw)
    bf16 = traffic.min_inter_host_gradient_bytes(shape.num_params * 2, 8, 4)  # its table: bf16
    assert hsdp.params.inter == pytest.approx(4 * bf16)


def test_candidates_respect_heads_and_padding():
    shape = MODEL_SHAPES["qwen2.5-3b"]  # 16 heads
    names = {cost.layout_name(*c) for c in cost.candidates(shape, batch=3, seq_len=4096,
                                                            num_devices=8)}
    assert names == {"ulysses (1,8) fsdp"}  # gcd(3, 8) = 1
    padded = cost.candidates(shape, batch=3, seq_len=4096, num_devices=8, max_pad_rows=1)
    assert (cost.plan_layout(shape, num_devices=8, batch=3, seq_len=4096, groups=4, pad_rows=1),
            "hsdp") in padded
    assert "basp (4,2) hsdp [+1 pad rows]" in {cost.layout_name(*c) for c in padded}


def test_plan_cli_prints_a_table_and_a_pick(capsys):
    assert plan.main(["--model", "llama-3.1-8b", "--seq", "16384", "--batch", "2", "--devices", "8",
                      "--devices-per-host", "4", "--hardware", "a100-40gb"]) == 0
    out = capsys.readouterr().out
    assert "ulysses (1,8) fsdp" in out and "basp (2,4) host" in out
    assert "pick: basp (2,4)" in out


def _adaptive_line(capsys, docs: str, batch: int) -> str:
    assert plan.main(["--model", "llama-3.1-8b", "--seq", "16384", "--batch", str(batch),
                      "--devices", "8", "--devices-per-host", "4", "--docs", docs]) == 0
    (line,) = [s for s in capsys.readouterr().out.splitlines() if s.startswith("adaptive over")]
    return line


def test_plan_cli_predicts_the_adaptive_choice_for_a_document_distribution(capsys):
    """--docs: a long tail runs more groups on most steps and is predicted faster than the
    static layout it expands; documents that fill the context keep the static layout, 1.00x."""
    for batch in (1, 2):
        tail = _adaptive_line(capsys, "longtail", batch)
        gain = float(re.search(r"\(([0-9.]+)x\)", tail).group(1))
        assert gain > 1.0, tail
        assert re.search(r"layouts run: .*8x1 [1-9]", tail), tail  # some steps on 8 groups
    full = _adaptive_line(capsys, "full", 1)
    assert "(1.00x)" in full and full.endswith("layouts run: 1x8 100%"), full


def test_sampled_steps_fill_their_rows_and_are_seeded():
    steps = synthetic.sample_steps("longtail", 50, rows=2, seq_len=4096, seed=3)
    assert steps == synthetic.sample_steps("longtail", 50, rows=2, seq_len=4096, seed=3)
    for step in steps:
        assert all(2 <= n <= 4097 for n in step)
        assert sum(step) <= 2 * 4097  # two rows of seq_len + 1 tokens at most
    assert len({len(s) for s in steps}) > 1  # lengths vary
    assert synthetic.sample_steps("full", 3, rows=2, seq_len=64) == [[65, 65]] * 3
    with pytest.raises(ValueError, match="unknown document distribution 'zipf'"):
        synthetic.sample_steps("zipf", 1, rows=1, seq_len=64)


@pytest.mark.parametrize("flags, fragment", [
    (["--seq", "0"], "--seq must be positive, got 0"),
    (["--devices-per-host", "0"], "--devices-per-host must be positive, got 0"),  # was 1/0
    (["--devices-per-host", "-4"], "--devices-per-host must be positive, got -4"),
    (["--overlap", "7"], "--overlap is a share of the parameter collectives, in [0, 1]; got 7.0"),
    (["--overlap", "nan"], "--overlap is a share"),
    (["--max-pad-rows", "-3"], "--max-pad-rows must be >= 0"),
    (["--memory-gb", "0"], "--memory-gb must be a positive number"),
    (["--model", "gpt-9"], "argument --model: invalid choice: 'gpt-9'"),
    (["--docs", "zipf"], "argument --docs: invalid choice: 'zipf'"),
])
def test_plan_cli_rejects_bad_flags_with_one_line(capsys, flags, fragment):
    argv = ["--model", "llama-3.1-8b", "--seq", "4096", "--batch", "2", "--devices", "8", *flags]
    with pytest.raises(SystemExit) as err:
        plan.main(argv)
    assert err.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1, out.err
    assert out.err.startswith("error: plan: ") and fragment in out.err, out.err


DOCS_EXTREMES = {  # the largest --seq and --batch --docs takes, and many rows of one token
    "longest step": (plan.SAMPLED_TOKENS, 1),
    "most rows": (plan.SAMPLED_TOKENS // plan.DOCS_MAX_BATCH, plan.DOCS_MAX_BATCH),
    "most rows of one token": (1, plan.DOCS_MAX_BATCH),
}


@pytest.mark.parametrize("case", DOCS_EXTREMES)
def test_plan_cli_answers_at_once_at_the_largest_values_docs_takes(capsys, case):
    """--docs samples whole steps, each document drawn and packed in Python: its sample is
    bounded (fewer steps for longer ones), so the largest allowed --seq and --batch answer in
    seconds (about 2 s on 2 cores); the count of steps sampled is what bounds it."""
    seq, batch = DOCS_EXTREMES[case]
    assert plan.main(["--model", "llama-3.1-8b", "--seq", str(seq), "--batch", str(batch),
                      "--devices", "8", "--docs", "longtail"]) == 0
    (line,) = [s for s in capsys.readouterr().out.splitlines() if s.startswith("adaptive over")]
    count = int(re.search(r"(\d+) sampled steps", line).group(1))
    assert count == plan.sampled_steps(batch, seq) >= 1, line


@pytest.mark.parametrize("flags, fragment", [
    (["--batch", str(plan.DOCS_MAX_BATCH + 1), "--seq", "8"], "--batch must be at most"),
    (["--batch", "2", "--seq", str(plan.SAMPLED_TOKENS)], "--batch x --seq must be at most"),
    (["--batch", str(1 << 20), "--seq", str(1 << 32)], "--batch must be at most"),  # the flags' own
])
def test_plan_cli_refuses_a_step_docs_cannot_sample_in_one_line(capsys, flags, fragment):
    with pytest.raises(SystemExit) as err:
        plan.main(["--model", "llama-3.1-8b", "--devices", "8", "--docs", "longtail", *flags])
    assert err.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1, out.err
    assert out.err.startswith("error: plan: ") and fragment in out.err, out.err


def test_sampled_steps_keep_the_usual_count_for_usual_steps():
    """The README's and the tests' plans (16K tokens, batch 1-2) sample all SAMPLED_STEPS."""
    assert plan.sampled_steps(2, 16384) == plan.SAMPLED_STEPS
    assert plan.sampled_steps(1, plan.SAMPLED_TOKENS) == 1


@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_model_presets_are_built_on_the_cost_models_shapes(name):
    """basp_jax may not import models: the presets of the paper's models take their shapes from
    MODEL_SHAPES (written once), so the planner counts exactly the model's parameters."""
    from models import ModelConfig

    config = ModelConfig.preset(name)
    assert config.shape == MODEL_SHAPES[name]
    assert MODEL_SHAPES[name].num_params == config.num_params()


def test_the_planner_and_the_trainers_mfu_count_the_same_flops():
    """One FLOP formula (ModelShape.train_flops_per_token): the planner's compute time is the
    trainer's per-token count (train.prepare.Run.flops_per_token) at the stated efficiency."""
    from models import ModelConfig

    shape = ModelConfig.preset("qwen3-8b").shape
    hw = HARDWARE["a100-40gb"]
    layout = cost.plan_layout(shape, num_devices=8, batch=2, seq_len=16384, groups=2)
    p = predict(shape, layout, "fsdp", hw=hw, grad_accum=3)
    tokens = 3 * 2 * 16384 / 8
    assert p.compute_s == pytest.approx(
        shape.train_flops_per_token(16384) * tokens / (hw.peak_flops * hw.efficiency), rel=1e-12)


def test_auto_picks_the_papers_layout_in_the_papers_case():
    """BASP (2,4) with groups inside hosts; staged_keep parameters (sharded like fsdp, gathered
    across hosts once a step), whose bytes between hosts are host sharding's at fsdp's memory
    plus one host-local copy: on an A100-40GB (the paper's testbed), where host sharding does not
    fit, and on an A100-80GB, where it does but sends more (its tables cross in float32)."""
    for gpu, sharding in (("a100-40gb", "staged_keep"), ("a100-80gb", "staged_keep")):
        layout, pred = cost.auto_layout(MODEL_SHAPES["llama-3.1-8b"], batch=2, seq_len=16384,
                                        num_devices=8, hw=HARDWARE[gpu])
        assert (layout.groups, layout.sp, layout.batch, layout.ring) == (2, 4, 2, 1)
        assert layout.group_within_host and pred.param_sharding == sharding, gpu


@pytest.mark.slow
@pytest.mark.parametrize(
    "batch,heads,kv_heads,per_host",
    [(3, 8, 2, 4), (6, 8, 2, 4), (12, 8, 2, 4), (1, 28, 4, 8), (1, 4, 4, 8), (2, 4, 1, 4)],
)
def test_auto_finds_a_valid_exact_layout_beyond_the_paper(batch, heads, kv_heads, per_host):
    """B not dividing N, 28 heads on 8 devices, fewer heads than devices: the chosen layout plans,
    and attention under it equals the single-device reference."""
    import jax
    import numpy as np

    from basp_jax import activation_sharding, attention, make_mesh
    from tests.helpers.reference import reference_attention

    shape = ModelShape(2, 256, 512, heads, kv_heads, 16, 1000)
    layout, pred = cost.auto_layout(shape, batch=batch, seq_len=64, num_devices=8,
                                    hw=HARDWARE["a100-40gb"], devices_per_host=per_host)
    assert layout.batch >= batch and layout.batch - batch == layout.pad_rows == pred.layout.pad_rows
    assert layout.groups * layout.sp == 8
    mesh = make_mesh(layout)
    q = jax.random.normal(jax.random.PRNGKey(batch), (layout.batch, 64, heads, 16))
    k = jax.random.normal(jax.random.PRNGKey(1), (layout.batch, 64, kv_heads, 16))
    sharding = activation_sharding(mesh)
    out = jax.jit(lambda q, k: attention(q, k, k, mesh=mesh, layout=layout, block_size=16))(
        jax.device_put(q, sharding), jax.device_put(k, sharding))
    np.testing.assert_allclose(out, reference_attention(q, k, k, causal=True), atol=5e-5, rtol=5e-5)


def test_a_bfloat16_first_moment_saves_its_half_of_the_state():
    shape = MODEL_SHAPES["llama-3.1-8b"]
    kw = dict(q_heads=32, kv_heads=8)
    f32 = memory.memory_terms(shape, 4096, 8, **kw)
    bf16 = memory.memory_terms(shape, 4096, 8, precisions=Precisions(moments=2), **kw)
    assert f32["state"] - bf16["state"] == shape.num_params * 2 / 8
    assert {k: v for k, v in f32.items() if k != "state"} == \
        {k: v for k, v in bf16.items() if k != "state"}


def test_a_group_across_hosts_may_ring_between_them_instead():
    """A 64-GPU case (the 8B, B=2 x 1M): the planner used to run every all-to-all in
    groups of 32 across 4 hosts. With the ring that keeps each all-to-all inside a host (ring 4
    x 8), only the 8 kv heads' k/v hop between hosts: fewer inter-host bytes, ranked first."""
    shape, hw = MODEL_SHAPES["llama-3.1-8b"], HARDWARE["h100-80gb"]
    preds = cost.plan_table(shape, batch=2, seq_len=1 << 20, num_devices=64, hw=hw, zigzag=True)
    best = preds[0]
    assert (best.layout.groups, best.layout.sp, best.layout.ring) == (2, 32, 4), best.name
    plain = next(p for p in preds if p.layout.groups == 2 and p.layout.ring == 1
                 and p.param_sharding == best.param_sharding)
    assert best.all_to_all.inter < plain.all_to_all.inter / 1.9
    # in natural token order the ring's causal imbalance costs more than the bytes save
    natural = cost.plan_table(shape, batch=2, seq_len=1 << 20, num_devices=64, hw=hw)
    assert natural[0].layout.ring == 1


def test_a_ring_is_not_planned_where_its_partial_outputs_do_not_fit():
    """One 16M-token sequence on 32 H100s with the state on the device: the ring's attention
    working set (compiled: 71.25 GiB per device with the Pallas hop kernel) does not fit; Ulysses
    across the hosts does (62.2 GiB compiled) in the 90% of the device the trainer and
    train.tools.aot let JAX take (train.process.gpu_defaults). (With the state streamed the ring
    fits: tests/train/test_long_context.py.)"""
    import dataclasses

    from basp_jax import gpus

    shape = MODEL_SHAPES["llama-3.1-8b"]
    hw = dataclasses.replace(HARDWARE["h100-80gb"],
                             memory_bytes=0.9 * gpus.get("h100-80gb").memory_bytes)
    layout, pred = cost.auto_layout(shape, batch=1, seq_len=1 << 24, num_devices=32, hw=hw,
                                    remat="offload", tile_tokens=4096,
                                    precisions=Precisions(moments=2),
                                    zigzag=True)
    assert (layout.sp, layout.ring) == (32, 1) and pred.memory_bytes <= hw.memory_bytes
    ring = cost.plan_layout(shape, num_devices=32, batch=1, seq_len=1 << 24, groups=1,
                            devices_per_host=8, ring=4, zigzag=True)
    ringed = cost.predict(shape, ring, pred.param_sharding, hw=hw, remat="offload",
                          tile_tokens=4096, precisions=Precisions(moments=2))
    assert ringed.memory_bytes > hw.memory_bytes


def test_a_hybrid_is_planned_without_rings():
    """Qwen3.5's linear-attention layers run no ring (the model refuses one in one line), so the
    planner offers none, on one host or across several."""
    from models import ModelConfig

    shape = ModelConfig.preset("qwen3.5-9b").shape
    assert shape.linear_layers > 0
    for per_host in (4, 8):
        found = cost.candidates(shape, batch=1, seq_len=65536, num_devices=16,
                                devices_per_host=per_host)
        assert found and all(layout.ring == 1 and not layout.pad_heads for layout, _ in found)
        assert all(shape.linear_num_value_heads % layout.sp == 0 for layout, _ in found)


def test_a_hybrids_linear_layers_have_their_own_memory_terms():
    """The Gated DeltaNet layers keep their own exchanged tensors (q, k, v, output, gates), not
    attention's; scanned by period, a hybrid holds no recomputed layers beyond one's working
    set (no term of its own for them)."""
    import dataclasses

    from models import ModelConfig

    hybrid = ModelConfig.preset("qwen3.5-9b").shape
    kw = dict(q_heads=16, kv_heads=4, remat="full")
    terms = memory.memory_terms(hybrid, 4096, 8, **kw)
    as_attention = dataclasses.replace(hybrid, linear_layers=0)  # every layer counted as attention
    plain = memory.memory_terms(as_attention, 4096, 8, **kw)
    assert "recompute" not in terms and terms.keys() == plain.keys()
    # saved: one more linear layer adds its own widths, not an attention layer's
    wider = dataclasses.replace(hybrid, linear_value_head_dim=2 * hybrid.linear_value_head_dim)
    assert memory.memory_terms(wider, 4096, 8, **kw)["saved"] > terms["saved"]
    narrower = dataclasses.replace(hybrid, linear_num_key_heads=hybrid.linear_num_key_heads // 2)
    assert memory.memory_terms(narrower, 4096, 8, **kw)["saved"] < terms["saved"]
    assert terms["saved"] != plain["saved"]
    more_heads = dict(kw, q_heads=32)  # attention's heads: only its 8 layers change
    grown = memory.memory_terms(hybrid, 4096, 8, **more_heads)["saved"] - terms["saved"]
    grown_plain = memory.memory_terms(as_attention, 4096, 8, **more_heads)["saved"] - plain["saved"]
    assert grown == pytest.approx(grown_plain * hybrid.attention_layers / hybrid.num_layers)


def test_a_hybrids_linear_layers_exchange_their_own_tensors():
    """Per Gated DeltaNet layer and pass: q, k, v and output in bf16, the two float32 gates;
    none crosses hosts under BASP, Ulysses sends the same share across as attention's."""
    from models import ModelConfig

    hybrid = ModelConfig.preset("qwen3.5-9b").shape
    hw = HARDWARE["a100-40gb"]
    basp, ulysses = (predict(hybrid, _layout(hybrid, g), "fsdp", hw=hw) for g in (2, 1))
    linear_layer = traffic.linear_exchange_traffic(
        hybrid, _layout(hybrid, 2), REMAT_POLICIES.get("full"), 2)
    assert linear_layer.launches == 2 * 6
    key, value = 16 * 128, 32 * 128
    one_pass = 4096 * (2 * 2 * key + 2 * 2 * value + 2 * 4 * 32)  # bytes per device
    assert linear_layer.intra == pytest.approx(2 * one_pass * 3 / 4)
    assert basp.all_to_all.inter == 0 and basp.all_to_all.launches == 8 * 8 + 24 * 12
    assert ulysses.all_to_all.inter > 0


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-3b", "qwen3-8b"])
def test_fp8_params_are_the_layers_matrices(name):
    """Everything but the embedding tables, the norms and the biases runs in FP8 under model.fp8."""
    shape = MODEL_SHAPES[name]
    d, hd = shape.hidden_size, shape.head_dim
    layers = shape.num_layers
    norms = shape.hidden_size * (2 * layers + 1) + 2 * hd * layers * shape.qk_norm
    biases = layers * (shape.num_heads + 2 * shape.num_kv_heads) * hd * shape.attention_bias
    assert shape.fp8_params == shape.num_params - shape.embedding_params - norms - biases
    assert 0.5 < shape.fp8_flops_per_token() / shape.train_flops_per_token(16384) < 1


def test_fp8_runs_the_projections_at_the_fp8_peak_where_there_is_one():
    shape = MODEL_SHAPES["llama-3.1-8b"]
    for target in ("h100-80gb", "a100-40gb"):
        hw = HARDWARE[target]
        layout = _layout(shape, 2, hw=hw)
        bf16 = predict(shape, layout, "fsdp", hw=hw)
        fp8 = predict(shape, layout, "fsdp", hw=hw, fp8=True)
        if hw.fp8_peak_flops is None:  # an A100: no FP8 tensor cores, nothing changes
            assert fp8.compute_s == bf16.compute_s
            continue
        tokens = layout.tokens_per_device
        saved = shape.fp8_flops_per_token() * tokens * (
            1 / hw.peak_flops - 1 / hw.fp8_peak_flops) / hw.efficiency
        assert fp8.compute_s == pytest.approx(bf16.compute_s - saved)
        assert fp8.memory_bytes == bf16.memory_bytes


def test_plan_cli_fp8_shortens_compute_on_an_h100_only(capsys):
    def compute_s(hardware, *extra):
        assert plan.main(["--model", "llama-3.1-8b", "--seq", "16384", "--batch", "2",
                          "--devices", "8", "--hardware", hardware, *extra]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("basp (2,4) fsdp"))
        return float(row.split()[-3])  # the compute s column

    assert compute_s("h100-80gb", "--fp8") < 0.7 * compute_s("h100-80gb")
    assert compute_s("a100-40gb", "--fp8") == compute_s("a100-40gb")


def test_accumulation_counts_what_the_compiled_step_repeats():
    """train.grad_accum=A, as the compiled steps run it (BENCHMARKS.md section 10). Where each
    BASP group is one host, host and staged_keep keep each host's gradient sum apart over the
    microbatches (basp_jax.sharding.sums_per_host): everything they send across hosts crosses
    once a step, however many microbatches. Elsewhere every strategy's gradient crosses hosts
    once per microbatch (host's and hsdp's sync too), and so does everything of fsdp and
    staged; staged_keep's cross-host layer gathers run once a step (train.program.step). The
    memory formula adds the float32 gradient sum beside the microbatch's gradient once there
    are several microbatches, however many: split over a host's devices where the hosts keep
    their sums."""
    shape, hw = MODEL_SHAPES["llama-3.1-8b"], HARDWARE["a100-40gb"]
    hosts_are_groups = cost.plan_layout(shape, num_devices=8, batch=2, seq_len=16384, groups=2,
                                        devices_per_host=4)
    smaller_groups = cost.plan_layout(shape, num_devices=8, batch=4, seq_len=8192, groups=4,
                                      devices_per_host=4)

    def inter(layout, strategy, accum):
        return predict(shape, layout, strategy, hw=hw, grad_accum=accum).params.inter

    for layout in (hosts_are_groups, smaller_groups):
        for strategy in ("hsdp", "fsdp", "staged"):
            assert inter(layout, strategy, 2) == pytest.approx(2 * inter(layout, strategy, 1))
    assert inter(smaller_groups, "host", 2) == pytest.approx(2 * inter(smaller_groups, "host", 1))
    keep = [inter(hosts_are_groups, "staged_keep", a) for a in (1, 2, 4)]
    assert keep[0] > 0 and keep == pytest.approx([keep[0]] * 3)
    host = [inter(hosts_are_groups, "host", a) for a in (1, 2, 4)]
    assert host[1] == pytest.approx(host[2]) and host[1] <= host[0]  # (tables: bf16, not fp32)
    keep = [inter(smaller_groups, "staged_keep", a) for a in (1, 2, 4)]
    per_micro = keep[1] - keep[0]
    assert 0.3 * keep[0] < per_micro < 0.7 * keep[0]  # the gathers (about half) are not repeated
    assert keep[2] - keep[1] == pytest.approx(2 * per_micro)
    for layout, sum_devices in ((smaller_groups, 8), (hosts_are_groups, 4)):
        memory = [predict(shape, layout, "staged_keep", hw=hw, grad_accum=a).memory_bytes
                  for a in (1, 2, 4)]
        gradient = shape.num_params * 4 / sum_devices  # one float32 gradient sum's shard
        assert gradient < memory[1] - memory[0] < 3 * gradient and memory[2] == memory[1]


def test_the_hosts_sums_cross_in_float32_under_float16_compute():
    """train.program.per_group reduces the hosts' gradient sums across hosts in float32 under
    float16 compute (a sum of scaled float16 gradients would overflow): predict counts them in
    precisions.sum bytes a parameter. staged_keep's sums are half of what it sends across hosts
    (the other half: the host-local copies gathered), host sharding's all of it; where no host
    keeps a sum (groups smaller than a host) the sums' bytes change nothing. The gathered
    weights' bytes follow the compute dtype's."""
    shape, hw = MODEL_SHAPES["llama-3.1-8b"], HARDWARE["a100-40gb"]
    hosts_are_groups = cost.plan_layout(shape, num_devices=8, batch=2, seq_len=16384, groups=2,
                                        devices_per_host=4)
    smaller_groups = cost.plan_layout(shape, num_devices=8, batch=4, seq_len=8192, groups=4,
                                      devices_per_host=4)

    def inter(layout, strategy, **sizes):
        return predict(shape, layout, strategy, hw=hw, grad_accum=2,
                       precisions=Precisions(**sizes)).params.inter

    bf16 = inter(hosts_are_groups, "staged_keep")
    assert inter(hosts_are_groups, "staged_keep", sum=4) == pytest.approx(1.5 * bf16)
    assert inter(hosts_are_groups, "host", sum=4) == pytest.approx(
        2 * inter(hosts_are_groups, "host"))
    for strategy in ("staged_keep", "host", "fsdp"):
        assert inter(smaller_groups, strategy, sum=4) == inter(smaller_groups, strategy)
    assert inter(hosts_are_groups, "staged_keep", act=4) == pytest.approx(2 * bf16)
