"""Layouts beyond the paper in the trainer: any batch size, masked pad rows, mode=auto, HSDP."""

import numpy as np
import pytest

from train.config.schema import ConfigError
from train.loop import run

from tests.helpers.trainer import packed_stream, tiny_config

RTOL = 2e-5  # float32, different reduction orders across layouts


pytestmark = pytest.mark.usefixtures("compile_cache")  # this run's (tests/conftest.py)


def _single(tmp_path, batch):
    return run(tiny_config(tmp_path / f"single{batch}", "runtime.cpu_devices=1",
                           f"train.microbatch_size={batch}", "train.steps=3"))


@pytest.mark.slow
def test_masked_pad_rows_leave_losses_unchanged(tmp_path):
    """B=3 on 8 devices: gcd(3, 8) = 1 group; auto pads one masked row for 4 groups."""
    auto = run(tiny_config(tmp_path / "auto", "parallel.mode=auto", "train.microbatch_size=3",
                           "train.steps=3", "parallel.devices_per_host=4"))
    layout = auto["layout"]
    assert layout.batch == 4 and layout.groups in (2, 4), layout
    np.testing.assert_allclose(auto["losses"], _single(tmp_path, 3)["losses"], rtol=RTOL)


# 3 rows per group over two groups (sp=4); more groups of 3 rows (B=12 on 4) take the same path,
# and one group of 3 rows is Ulysses's layout (the note's one-group wording:
# test_basp_names_a_layout_of_fewer_groups_than_rows).
@pytest.mark.slow
@pytest.mark.parametrize("batch,groups", [(6, 2)])
def test_batch_that_does_not_divide_the_devices(tmp_path, capsys, batch, groups):
    basp = run(tiny_config(tmp_path / f"basp{batch}", f"train.microbatch_size={batch}", "train.steps=3"))
    assert basp["layout"].groups == groups
    # the start-up log says why basp runs fewer groups than rows (3 rows: Ulysses's one group)
    err = capsys.readouterr().err
    assert f"note: parallel.mode=basp runs {groups} group" in err, err
    np.testing.assert_allclose(basp["losses"], _single(tmp_path, batch)["losses"], rtol=RTOL)


@pytest.mark.parametrize("extra, note", [
    (["train.microbatch_size=3"], "runs 1 group of 8 devices (Ulysses's layout"),
    (["train.microbatch_size=6"], "runs 2 groups of 4 devices because train.microbatch_size=6"),
    (["train.microbatch_size=12"], "runs 4 groups of 2 devices"),
    (["train.microbatch_size=2"], None),  # a group per row
    (["train.microbatch_size=16"], None),  # a group per device
    (["train.microbatch_size=1"], None),  # one row: one group is all basp can take
    (["train.microbatch_size=3", "parallel.groups=1"], None),  # asked for
    (["train.microbatch_size=3", "parallel.mode=ulysses"], None),
])
def test_basp_names_a_layout_of_fewer_groups_than_rows(tmp_path, extra, note):
    """B=3 on 8 devices shares no factor with them: basp's gcd rule gives one group of 8 (what
    Ulysses runs); the start-up note (train.observe.report.log_start) says so, with what would split more."""
    import models
    from train.program.planning import layout_note, plan

    cfg = tiny_config(tmp_path / "r", *extra)
    layout, _ = plan(cfg, models.ModelConfig.preset("tiny"), 8, 8)
    said = layout_note(cfg, layout)
    assert said is None if note is None else note in said, said
    if said:
        assert "\n" not in said and "parallel.mode=auto" in said


@pytest.mark.slow
def test_hsdp_and_fsdp_train_the_same_losses(tmp_path):
    fsdp = run(tiny_config(tmp_path / "fsdp", "parallel.param_sharding=fsdp", "train.steps=3"))
    hsdp = run(tiny_config(tmp_path / "hsdp", "parallel.param_sharding=hsdp", "train.steps=3"))
    np.testing.assert_allclose(hsdp["losses"], fsdp["losses"], rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("sharding,batch", [("replicated", 2)])
def test_a_replicated_head_trains_the_single_device_losses(tmp_path, sharding, batch):
    """The loss's per-device chunks (models.loss._per_device_chunks: the head replicated over the
    token shards, its gradient summed once) train the single device's losses. (Under hsdp, its
    gradient against the whole computation's: tests/models/test_loss_chunked.py.)"""
    run_ = run(tiny_config(tmp_path / sharding, f"parallel.param_sharding={sharding}",
                           f"train.microbatch_size={batch}", "train.steps=3"))
    np.testing.assert_allclose(run_["losses"], _single(tmp_path, batch)["losses"], rtol=RTOL)


def test_param_sharding_auto_prefers_staged_then_hsdp_where_they_fit(tmp_path):
    """On several hosts staged_keep (fsdp's shards, each layer crossing hosts once); on one host
    hsdp where it applies, else fsdp, which is also taken where nothing else fits."""
    from train.program import planning
    from train.loop import model_config

    cfg = tiny_config(tmp_path / "plan", "train.microbatch_size=2", "parallel.devices_per_host=4")
    mcfg = model_config(cfg)
    layout, strategy = planning.plan(cfg, mcfg, 8, 4)
    assert (layout.groups, layout.sp, strategy) == (2, 4, "staged_keep")
    b8 = tiny_config(tmp_path / "b8", "train.microbatch_size=8")
    assert planning.plan(b8, mcfg, 8, 4)[1] == "staged_keep"  # seq groups of one device
    assert planning.plan(cfg, mcfg, 8, 8)[1] == "hsdp"  # one host: host would be fsdp
    tight = tiny_config(tmp_path / "tight", "train.microbatch_size=2", "parallel.memory_gb=1e-4")
    assert planning.plan(tight, mcfg, 8, 4)[1] == "fsdp"  # larger shards do not fit
    ulysses = tiny_config(tmp_path / "u", "parallel.mode=ulysses")
    assert planning.plan(ulysses, mcfg, 8, 4)[1] == "staged_keep"  # any seq group size
    assert planning.plan(ulysses, mcfg, 8, 8)[1] == "fsdp"  # one host, one group


def test_the_planner_is_given_the_compute_dtypes_bytes(tmp_path):
    """The trainer's predictions count the weights, their gradients and the hosts' sums in the
    bytes of model.dtype; under float16 the hosts' sums in float32 (train.program.per_group)."""
    from basp_jax.planner.precisions import Precisions
    from train.program import planning

    def sizes(*extra):
        return planning.precisions(tiny_config(tmp_path / "d", *extra))

    assert sizes("model.dtype=bfloat16") == Precisions(act=2, sum=2)
    assert sizes("model.dtype=float16") == Precisions(act=2, sum=4)
    assert sizes("model.dtype=float32") == Precisions(act=4, sum=4)
    assert sizes("model.dtype=auto", "parallel.hardware=t4-16gb") == Precisions(
        act=2, sum=4)  # a T4 computes in float16
    assert sizes("optimizer.mu_dtype=bfloat16").moments == 2
    assert sizes("optimizer.mu_dtype=null").moments is None  # the master dtype's


def test_auto_takes_the_papers_layout_in_the_papers_case(tmp_path):
    from train.program import planning
    from train.loop import model_config

    cfg = tiny_config(tmp_path / "auto", "parallel.mode=auto", "train.microbatch_size=2",
                      "data.seq_len=16384", "parallel.hardware=a100-40gb")
    mcfg = model_config(tiny_config(tmp_path / "m", "model.shape={}", "model.preset=llama-3.1-8b"))
    layout, strategy = planning.plan(cfg, mcfg, 8, 4)
    assert (layout.groups, layout.sp, layout.batch) == (2, 4, 2)


def test_auto_refuses_manual_layout_keys(tmp_path):
    with pytest.raises(ConfigError, match="parallel.mode=auto chooses groups, ring and head padding"):
        tiny_config(tmp_path / "x", "parallel.mode=auto", "parallel.ring=2")
    with pytest.raises(ConfigError, match="parallel.hardware='tpu' is unknown"):
        from train.program import planning
        from train.loop import model_config

        cfg = tiny_config(tmp_path / "y", "parallel.hardware=tpu")
        planning.plan(cfg, model_config(cfg), 8, 4)


@pytest.mark.slow
def test_zigzag_ring_in_the_trainer_equals_one_device(tmp_path):
    """basp (4,2) with ring 2 on packed documents: tokens, targets, segment ids and positions in
    zig-zag order. (Unpacked rows in zig-zag order, ulysses (1,8) with ring 2:
    tests/basp_jax/test_attention.py::test_zigzag_ring_matches_reference.)"""
    packed_stream(tmp_path / "docs.bin")
    data = ["data.source=tokens", f"data.path={tmp_path / 'docs.bin'}", "data.pack=true", "data.eos_id=0"]
    ring = run(tiny_config(tmp_path / "ring", "parallel.ring=2", "train.steps=3", *data))
    assert (ring["layout"].groups, ring["layout"].sp, ring["layout"].ring) == (4, 2, 2)
    assert ring["layout"].zigzag
    single = run(tiny_config(tmp_path / "one", "runtime.cpu_devices=1", "train.steps=3", *data))
    np.testing.assert_allclose(ring["losses"], single["losses"], rtol=RTOL)
    unpacked = run(tiny_config(tmp_path / "unpacked", *data[:2], "parallel.groups=2",
                               "train.steps=1"))
    # masking the cross-document predictions changes the loss: packing really is applied
    assert abs(unpacked["losses"][0] - single["losses"][0]) > 1e-3
