"""parallel.mode=adaptive in the trainer: each step runs the layout with the most
groups whose rows hold its documents; same losses as the static layout on the same documents,
parameters that never move, a layout sequence a resume repeats, and one-line refusals."""

import json

import numpy as np
import pytest

from train.config.schema import ConfigError, load_config
from train.loop import run

from tests.helpers.trainer import adaptive_documents, tiny_config, tiny_overrides
from tests.helpers.trees import flat_params

# float32 on CPU: other layouts reorder the reductions (see tests/train/test_loop.py)
RTOL = 2e-5
STEPS = 6  # (adaptive_documents' default)


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _compare_with_static(tmp_path, static, adaptive):
    """The same rows, repacked per step: losses, token counts, gradient norms and the final
    parameters equal the static (1,8) run's to float32 rounding, while the steps ran on more
    than one layout and recorded which (with its all-to-all bytes)."""
    assert (adaptive["layout"].groups, adaptive["layout"].sp) == (1, 8)  # the static layout
    np.testing.assert_allclose(adaptive["losses"], static["losses"], rtol=RTOL)
    s, a = _records(tmp_path / "static"), _records(tmp_path / "adaptive")
    assert [r["loss_tokens"] for r in a] == [r["loss_tokens"] for r in s]
    np.testing.assert_allclose([r["grad_norm"] for r in a], [r["grad_norm"] for r in s],
                               rtol=1e-4)
    ps, pa = flat_params(static["params"]), flat_params(adaptive["params"])
    for k in ps:
        np.testing.assert_allclose(pa[k], ps[k], rtol=1e-4, atol=1e-6, err_msg=k)
    layouts = [r["layout"] for r in a]
    assert set(layouts) <= {"1x8", "2x4", "4x2", "8x1"}
    assert len(set(layouts)) > 1, layouts  # documents of 6-40 tokens: most steps fit more groups
    assert "layout" not in s[0]  # only adaptive runs record it
    by_layout = {r["layout"]: r for r in a}
    if "1x8" in by_layout:  # the static layout's all-to-alls cross the hosts, the others' do not
        assert by_layout["1x8"]["a2a_inter_host_bytes"] > 0
    for name, r in by_layout.items():
        if name != "1x8":
            assert r["a2a_inter_host_bytes"] == 0, r
        if name == "8x1":
            assert r["a2a_bytes"] == 0, r  # one device per row: no all-to-all at all
    record = json.loads((tmp_path / "adaptive" / "collectives.json").read_text())
    assert [(e["groups"], e["sp"]) for e in record["layouts"]] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    return layouts


@pytest.mark.slow
@pytest.mark.usefixtures("compile_cache")
def test_adaptive_steps_equal_the_static_layout_and_resume_repeats_them(tmp_path):
    """With two microbatches a step (one layout per step, the one both microbatches fit):
    _compare_with_static; then stopped after 3 steps and run again: the same layouts, step
    by step, and the same losses as the run straight through (nothing new is checkpointed: the
    choice follows the rows). (One microbatch a step: tests/e2e/test_multiprocess.py's
    adaptive run against one process.)"""
    data = adaptive_documents(tmp_path, "train.grad_accum=2")
    static = run(tiny_config(tmp_path / "static", *data, "parallel.mode=ulysses"))
    adaptive = run(tiny_config(tmp_path / "adaptive", *data, "parallel.mode=adaptive"))
    layouts = _compare_with_static(tmp_path, static, adaptive)
    cfg = tiny_config(tmp_path / "resumed", *data, "parallel.mode=adaptive")
    first = run(cfg, stop_at=3)
    second = run(cfg)
    assert second["start_step"] == 3
    np.testing.assert_allclose(first["losses"] + second["losses"], adaptive["losses"], rtol=1e-6)
    resumed = _records(tmp_path / "resumed")
    assert [r["layout"] for r in resumed] == layouts
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("extra, fragment", [
    (["parallel.mode=adaptive", "data.pack=false", "data.eos_id=null"],
     "parallel.mode=adaptive repacks each step's documents"),
    (["parallel.mode=adaptive", "optimizer.offload=true"],
     "parallel.mode=adaptive does not run the streamed step"),
    (["data.source=synthetic", "data.pack=true", "data.path=null", "data.eos_id=null"],
     "data.documents names a length distribution"),
    (["data.documents=longtail"], "data.documents=longtail draws synthetic documents"),
])
def test_adaptive_config_refusals(tmp_path, extra, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, tiny_overrides(tmp_path / "r", *adaptive_documents(tmp_path), *extra))


@pytest.mark.parametrize("extra, fragment", [
    (["parallel.mode=adaptive", "parallel.param_sharding=hsdp"],
     "param_sharding='hsdp' places parameters by the layout's sp"),
    (["parallel.mode=adaptive", "parallel.ring=4"],
     "set parallel.ring=2 or 1"),
    (["data.source=synthetic", "data.path=null", "data.eos_id=null", "data.documents=zipf"],
     "data.documents: expected one of longtail, full, got 'zipf'"),
])
def test_adaptive_refusals_before_anything_compiles(tmp_path, extra, fragment):
    """Checked by train.prepare (with JAX) before a row is built or a step compiles."""
    from train.prepare import check

    cfg = load_config(None, tiny_overrides(tmp_path / "r", *adaptive_documents(tmp_path), *extra))
    with pytest.raises(ConfigError, match=fragment):
        check(cfg, is_writer=True)
    assert not (tmp_path / "r").exists()  # nothing written


def test_auto_param_sharding_never_picks_one_that_moves(tmp_path):
    """parallel.param_sharding=auto under adaptive takes only a placement all layouts share."""
    from basp_jax import adaptive
    from train.prepare import check

    for per_host in (4, 8):
        cfg = load_config(None, tiny_overrides(
            tmp_path / "r", *adaptive_documents(tmp_path), "parallel.mode=adaptive",
            "parallel.param_sharding=auto", f"parallel.devices_per_host={per_host}"))
        plan = check(cfg, is_writer=True).plan
        assert adaptive.shares_placement(plan.strategy), plan.strategy
        assert [(p.layout.groups, p.layout.sp) for p in plan.adaptive] == \
            [(1, 8), (2, 4), (4, 2), (8, 1)]


def test_synthetic_documents_follow_the_named_distribution(tmp_path):
    """data.documents: rows of documents (segment ids from 0, padding after them), keyed by
    (seed, step, row) like every synthetic row; 'full' is one document per row."""
    from train.data import Pipeline

    def pipeline(documents, held_out=False):
        cfg = load_config(None, tiny_overrides(
            tmp_path / "r", "data.pack=true", f"data.documents={documents}",
            "data.seq_len=4096")).data
        return Pipeline(cfg, vocab_size=256, grad_accum=1, microbatch=4, seed=0,
                        held_out=held_out)

    tail = pipeline("longtail")
    rows = tail.rows(3, np.arange(4))
    again = tail.rows(3, np.arange(4))
    for name in rows:
        np.testing.assert_array_equal(rows[name], again[name])
    counts = [len(np.unique(seg)) for seg in rows["segment_ids"]]
    assert max(counts) > 2, counts  # a median of ~670 tokens: several documents per row
    for seg, tgt in zip(rows["segment_ids"], rows["targets"]):
        assert np.all(np.diff(seg) >= 0)  # numbered in order, padding last
        boundaries = np.flatnonzero(np.diff(seg)) # no prediction crosses a document boundary
        assert np.all(tgt[boundaries] == -1)
    other = tail.rows(4, np.arange(4))["segment_ids"]
    assert not np.array_equal(other, rows["segment_ids"])
    held = pipeline("longtail", held_out=True).rows(3, np.arange(4))["segment_ids"]
    assert not np.array_equal(held, rows["segment_ids"])
    full = pipeline("full").rows(0, np.arange(2))
    assert np.all(full["segment_ids"] == 0) and np.all(full["targets"] >= 0)
