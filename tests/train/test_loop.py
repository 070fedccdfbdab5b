"""End-to-end training in-process: layouts agree, resume is exact, checkpoints cross layouts."""

import json

import numpy as np
import pytest

from train.loop import run

from tests.helpers.trainer import tiny_config
from tests.helpers.trees import flat_params

# float32 on CPU: the layouts reorder reductions (all-to-all, sharded matmuls, gradient sums), so
# losses agree to ~1e-6 relative; 2e-5 leaves room without hiding a real difference (a wrong
# token or position moves the loss by > 1e-3).
RTOL = 2e-5
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compile_cache")]  # tests/conftest.py

LAYOUTS = {
    "single": ["runtime.cpu_devices=1"],
    "ulysses(1,8)": ["parallel.mode=ulysses"],
    "basp(2,4)": ["parallel.groups=2"],
    "basp(4,2)": ["parallel.groups=4"],
}


def test_padded_heads_match_single_device(tmp_path):
    """parallel.pad_heads reaches the layout and the model (same losses). (parallel.ring:
    tests/train/test_layouts.py's zig-zag ring in the trainer.)"""
    padded = run(tiny_config(tmp_path / "pad", "runtime.cpu_devices=6", "data.seq_len=48",
                             "parallel.pad_heads=true", "parallel.groups=2"))
    reference = run(tiny_config(tmp_path / "single48", "runtime.cpu_devices=1", "data.seq_len=48"))
    assert padded["layout"].sp == 3
    np.testing.assert_allclose(padded["losses"], reference["losses"], rtol=RTOL)


# (Gradient accumulation is a scan over microbatches around the same sharded step,
# train.program.step._accumulate, whatever the layout: test_accumulation_equals_larger_microbatch
# below, and against one device's gradients tests/models/test_staged_sharding.py.)
def test_layouts_give_the_same_losses(tmp_path):
    results = {}
    for name in LAYOUTS:
        extra = LAYOUTS[name]
        cfg = tiny_config(tmp_path / name, "train.microbatch_size=4", *extra)
        summary = run(cfg)
        expected = {"single": (1, 1), "ulysses(1,8)": (1, 8), "basp(2,4)": (2, 4), "basp(4,2)": (4, 2)}[name]
        assert (summary["layout"].groups, summary["layout"].sp) == expected
        results[name] = summary["losses"]
        assert len(results[name]) == 5
    reference = np.array(results["single"])
    assert reference[-1] < reference[0]  # it learns
    for name, losses in results.items():
        np.testing.assert_allclose(losses, reference, rtol=RTOL, err_msg=name)


def test_accumulation_equals_larger_microbatch(tmp_path):
    """2 microbatches of 2 rows = 1 microbatch of 4 rows: the same rows, loss = sum / count."""
    a = run(tiny_config(tmp_path / "a", "train.microbatch_size=2", "train.grad_accum=2"))
    b = run(tiny_config(tmp_path / "b", "train.microbatch_size=4", "train.grad_accum=1"))
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=RTOL)


def test_resume_is_exact(tmp_path):
    straight = run(tiny_config(tmp_path / "straight", "train.steps=6"))
    cfg = tiny_config(tmp_path / "resumed", "train.steps=6")
    first = run(cfg, stop_at=3)
    second = run(cfg)
    assert second["start_step"] == 3
    np.testing.assert_allclose(first["losses"] + second["losses"], straight["losses"], rtol=1e-6)
    s, r = flat_params(straight["params"]), flat_params(second["params"])
    assert s.keys() == r.keys()
    for k in s:
        np.testing.assert_allclose(r[k], s[k], rtol=1e-6, atol=1e-7, err_msg=k)
    lines = [json.loads(l) for l in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu"):
        assert key in lines[0]


def test_bfloat16_first_moment_follows_float32_and_resumes_exactly(tmp_path):
    """optimizer.mu_dtype=bfloat16 (Adam's first moment in half the memory): the run follows the
    float32 one closely but not bitwise (the option reaches optax), and its checkpoint, holding
    the bf16 moment, resumes exactly."""
    f32 = run(tiny_config(tmp_path / "f32", "train.steps=6"))
    straight = run(tiny_config(tmp_path / "straight", "train.steps=6", "optimizer.mu_dtype=bfloat16"))
    cfg = tiny_config(tmp_path / "resumed", "train.steps=6", "optimizer.mu_dtype=bfloat16")
    first = run(cfg, stop_at=3)
    second = run(cfg)
    np.testing.assert_allclose(first["losses"] + second["losses"], straight["losses"], rtol=1e-6)
    np.testing.assert_allclose(straight["losses"], f32["losses"], rtol=1e-2)
    assert straight["losses"][0] == f32["losses"][0]  # before any update
    assert not np.allclose(straight["losses"][2:], f32["losses"][2:], rtol=1e-7, atol=0)


def test_checkpoint_from_ulysses_resumes_under_basp(tmp_path):
    straight = run(tiny_config(tmp_path / "straight", "train.steps=6", "parallel.groups=2"))
    cfg = tiny_config(tmp_path / "cross", "train.steps=6", "parallel.mode=ulysses")
    first = run(cfg, stop_at=3)
    assert first["layout"].groups == 1
    from train.config.schema import replace

    second = run(replace(cfg, "parallel.mode=basp", "parallel.groups=2"))
    assert (second["layout"].groups, second["layout"].sp) == (2, 4)
    np.testing.assert_allclose(first["losses"] + second["losses"], straight["losses"], rtol=RTOL)


def test_checkpoint_restores_onto_fewer_devices(tmp_path):
    cfg = tiny_config(tmp_path / "r", "train.steps=4")
    first = run(cfg, stop_at=2)
    from train.config.schema import replace

    second = run(replace(cfg, "runtime.cpu_devices=2"))
    straight = run(tiny_config(tmp_path / "s", "train.steps=4"))
    np.testing.assert_allclose(first["losses"] + second["losses"], straight["losses"], rtol=RTOL)


def test_jsonl_with_tokenizer_and_bf16(tmp_path):
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    words = "the cat sat on a mat dog ran far away".split()
    vocab = {"<eos>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    with open(tmp_path / "d.jsonl", "w") as f:
        for _ in range(200):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=rng.integers(3, 30)))}) + "\n")
    summary = run(tiny_config(
        tmp_path / "r", "data.source=jsonl", f"data.path={tmp_path / 'd.jsonl'}",
        f"data.tokenizer={tmp_path / 'tokenizer.json'}", "data.eos_id=0", "data.pack=true",
        "model.dtype=bfloat16", "train.steps=8",
    ))
    assert all(np.isfinite(summary["losses"]))
    assert summary["losses"][-1] < summary["losses"][0] - 0.5


def test_export_then_train_from_hf_dir(tmp_path):
    hf = tmp_path / "hf"
    first = run(tiny_config(tmp_path / "a", f"checkpoint.export_hf={hf}"))
    assert (hf / "config.json").exists()
    # the exported weights start where the first run ended: its first loss is far below a fresh one
    second = run(tiny_config(tmp_path / "b", "model.preset=null", f"model.hf_path={hf}",
                             "model.shape={}"))
    assert second["losses"][0] < first["losses"][0] - 0.2
    # config only (fresh weights from the same shapes): the same losses as the first run
    third = run(tiny_config(tmp_path / "c", "model.preset=null", f"model.hf_path={hf}",
                            "model.shape={}", "model.load_weights=false"))
    np.testing.assert_allclose(third["losses"], first["losses"], rtol=RTOL)


def test_gpu_config_runs_scaled_down(tmp_path):
    """configs/gpu/*: the same keys (bf16, remat, packed uint32 token file) on a tiny model."""
    from train.config.schema import load_config

    stream = np.random.default_rng(0).integers(1, 512, size=20000).astype(np.uint32)
    stream[::50] = 0
    np.save(tmp_path / "train.npy", stream)
    cfg = load_config("configs/gpu/llama-3.1-8b_basp.yaml", [
        f"run.dir={tmp_path / 'r'}", "model.hf_path=null", "model.preset=tiny",
        f"data.path={tmp_path / 'train.npy'}", "data.eos_id=0", "data.seq_len=256",
        "train.steps=3", "optimizer.warmup_steps=1", "metrics.peak_flops=1e11",
        "metrics.progress=false", "runtime.platform=cpu", "runtime.cpu_devices=8",
    ])
    summary = run(cfg)
    assert len(summary["losses"]) == 3 and all(np.isfinite(summary["losses"]))
    line = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["mfu"] > 0


def test_async_checkpoint_taken_mid_run_resumes_exactly(tmp_path):
    """A save at step 4 runs asynchronously while steps 5-6 update (donated) buffers: it still
    holds step 4's state."""
    import shutil

    straight = run(tiny_config(tmp_path / "a", "train.steps=6", "checkpoint.every=2",
                               "checkpoint.keep=3"))
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["2", "4", "6"]
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "4", tmp_path / "b" / "checkpoints" / "4")
    resumed = run(tiny_config(tmp_path / "b", "train.steps=6"))
    assert resumed["start_step"] == 4
    np.testing.assert_allclose(resumed["losses"], straight["losses"][4:], rtol=1e-6)
