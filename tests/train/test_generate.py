"""KV-cached sampling (models.sampler, python -m train.tools.generate) against transformers' greedy
generate on the tiny random models, the cache path against the full forward, and a run's
checkpoint through the same command."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch")
pytest.importorskip("transformers")

import models  # noqa: E402
from models import sampler  # noqa: E402

from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.trainer import ROOT, tiny_config, train_env  # noqa: E402

PROMPT = [17, 3, 250, 42, 99, 7, 128]
NEW = 12


def _hf_greedy(torch_model, prompt, new):
    import torch

    out = torch_model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("family", hf_tiny.FAMILIES)
def test_greedy_tokens_match_transformers(tmp_path, family):
    torch_model = hf_tiny.save(family, tmp_path)
    model = models.from_pretrained(str(tmp_path))
    eos = [model.config.eos_token_id] if model.config.eos_token_id is not None else []
    ours = sampler.generate(model, PROMPT, max_new_tokens=NEW, eos_ids=eos)
    expected = _hf_greedy(torch_model, PROMPT, NEW)
    assert ours == expected
    assert len(set(ours)) > 2  # a real continuation, not one repeated token


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_decode_with_cache_equals_the_full_forward(tmp_path, scan_layers):
    """Prefill of 5 tokens, then one at a time: each position's logits equal the full forward's
    (RoPE at the offset, causal against the cache, zeros beyond masked out)."""
    hf_tiny.save("qwen3", tmp_path)
    model = models.from_pretrained(str(tmp_path), scan_layers=scan_layers)
    tokens = jnp.asarray([PROMPT + [5, 6, 8]], jnp.int32)
    full = np.asarray(model(tokens))
    cache = model.init_cache(1, tokens.shape[1] + 3)  # longer than used: the tail stays masked

    @nnx.jit
    def decode(model, tokens, cache, index):
        hidden, cache = model.decode(tokens, cache, index)
        return model.logits(hidden), cache

    logits, cache = decode(model, tokens[:, :5], cache, 0)
    got = [np.asarray(logits)[0]]
    for i in range(5, tokens.shape[1]):
        logits, cache = decode(model, tokens[:, i:i + 1], cache, jnp.int32(i))
        got.append(np.asarray(logits)[0])
    np.testing.assert_allclose(np.concatenate(got), full[0], atol=1e-4, rtol=0)


def test_sampling_is_seeded_and_top_p_keeps_the_head(tmp_path):
    hf_tiny.save("llama", tmp_path)
    model = models.from_pretrained(str(tmp_path))
    a = sampler.generate(model, PROMPT, max_new_tokens=NEW, temperature=1.0, seed=3)
    assert a == sampler.generate(model, PROMPT, max_new_tokens=NEW, temperature=1.0, seed=3)
    assert a != sampler.generate(model, PROMPT, max_new_tokens=NEW, temperature=1.0, seed=4)
    # a vanishing nucleus keeps only the most likely token: greedy
    assert (sampler.generate(model, PROMPT, max_new_tokens=NEW, temperature=1.0, top_p=1e-6)
            == sampler.generate(model, PROMPT, max_new_tokens=NEW))
    import jax

    logits = jnp.log(jnp.tile(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]), (256, 1)))
    picks = np.asarray(sampler.pick(logits, jax.random.key(0), 1.0, 0.7))
    assert set(picks.tolist()) == {0, 1}  # 0.5 + 0.3 reach 0.7; the tail is never drawn


def _word_tokenizer(path):
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    tok = Tokenizer(tok_models.WordLevel({f"w{i}": i for i in range(hf_tiny.VOCAB)},
                                         unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def _main(capsys, *args):
    """python -m train.tools.generate ARGS in-process (shares compiled programs): (status, out, err)."""
    from train.tools.generate import main

    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.slow
def test_cli_from_hf_dir_text_and_ids(tmp_path, capsys):
    torch_model = hf_tiny.save("qwen2", tmp_path)
    expected = _hf_greedy(torch_model, PROMPT, 6)
    capsys.readouterr()  # transformers' progress bars
    done = subprocess.run(
        [sys.executable, "-m", "train.tools.generate", "--hf_path", str(tmp_path), "--prompt-ids",
         ",".join(map(str, PROMPT)), "--max-new-tokens", "6"],
        cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(t) for t in expected]
    # no tokenizer.json yet: a text prompt is one line of error
    status, _, err = _main(capsys, "--hf_path", str(tmp_path), "--prompt", "w1 w2")
    assert status == 2 and err.count("\n") == 1 and "tokenizer" in err
    _word_tokenizer(tmp_path / "tokenizer.json")
    status, out, err = _main(capsys, "--hf_path", str(tmp_path), "--prompt",
                             " ".join(f"w{t}" for t in PROMPT), "--max-new-tokens", "6")
    assert status == 0, err
    assert out.split() == [f"w{t}" for t in expected]


@pytest.mark.slow
def test_cli_from_a_run_checkpoint(tmp_path, capsys):
    """The run's newest checkpoint (written sharded over 8 devices) gives the same tokens as its
    Hugging Face export, in the run's compute dtype (float16, which the CPU's attention dot
    lacks in float32 accumulation) by default, or in the one --dtype names."""
    import jax.numpy as jnp

    from train.loop import run

    run_dir, export = tmp_path / "run", tmp_path / "export"
    run(tiny_config(run_dir, "train.steps=2", "model.dtype=float16",
                    f"checkpoint.export_hf={export}"))
    capsys.readouterr()
    ids = ",".join(map(str, PROMPT))
    for dtype, flags in (("float16", ()), ("float32", ("--dtype", "float32")),
                         ("float16", ("--dtype", "float16"))):
        status, out, err = _main(capsys, "--run_dir", str(run_dir), "--prompt-ids", ids,
                                 "--max-new-tokens", "5", *flags)
        assert status == 0, err
        from_export = sampler.generate(
            models.from_pretrained(str(export), dtype=getattr(jnp, dtype)), PROMPT,
            max_new_tokens=5)
        assert out.split() == [str(t) for t in from_export], (dtype, flags)
    empty = tmp_path / "empty"
    empty.mkdir()
    status, _, err = _main(capsys, "--run_dir", str(empty), "--prompt-ids", ids)
    assert status == 2 and err.count("\n") == 1 and "config.yaml" in err


@pytest.mark.slow
@pytest.mark.usefixtures("compile_cache")  # its runs share one compile
def test_a_runs_export_is_a_complete_hugging_face_model(tmp_path):
    """checkpoint.export_hf of a run on tokenized text: transformers loads the tokenizer (with its
    eos) and the model from the directory alone and generates what our sampler does; the eos id
    is in config.json and generation_config.json; checkpoint.export_dtype sets the tensors'."""
    import json

    import transformers
    from safetensors import safe_open

    from train.loop import run

    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, hf_tiny.VOCAB)}}
    tokenizer = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    (tmp_path / "d.txt").write_text("\n".join(
        " ".join(f"w{t}" for t in rng.integers(2, 256, rng.integers(3, 40))) for _ in range(100)))
    export = tmp_path / "export"
    run(tiny_config(tmp_path / "run", "train.steps=2",  # the program of the test above
                    "data.source=text", f"data.path={tmp_path / 'd.txt'}",
                    f"data.tokenizer={tmp_path / 'tokenizer.json'}", "data.eos_id=1",
                    f"checkpoint.export_hf={export}"))
    assert json.loads((export / "config.json").read_text())["eos_token_id"] == 1
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == 1
    tok = transformers.AutoTokenizer.from_pretrained(str(export))
    assert tok.eos_token == "<eos>" and tok.eos_token_id == 1
    prompt = tok(" ".join(f"w{t}" for t in PROMPT))["input_ids"]
    assert prompt == PROMPT
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(export))
    assert hf.generation_config.eos_token_id == 1
    theirs = _hf_greedy(hf, prompt, NEW)
    ours = sampler.generate(models.from_pretrained(str(export)), PROMPT, max_new_tokens=NEW,
                            eos_ids=[1])
    assert theirs[:len(ours)] == ours and len(ours) > 2
    assert tok.decode(theirs[:3]) == " ".join(f"w{t}" for t in theirs[:3])

    half = tmp_path / "bf16"  # what checkpoint.export_dtype=bfloat16 passes on
    models.save_pretrained(models.from_pretrained(str(export)), str(half), dtype="bfloat16")
    with safe_open(str(half / "model.safetensors"), "np") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
