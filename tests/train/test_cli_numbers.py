"""Every number a user gives is range-checked where it enters, and huge or deeply nested input is
one line too: train.py's config, python -m train.tools.plan, train.tools.plot, train.tools.generate
and train.tools.tokenize exit 2 with exactly one line on stderr, at once, and write nothing.

All in-process (each command's main), so the whole file runs in seconds; a case that would hang
(the divisor search of a 1e11-device layout used to) fails by pytest's timeout of the CI run
instead, and each command is timed here as well.
"""


import numpy as np
import pytest

from basp_jax import layout
from train.tools import plan
from train.tools import generate
from train import cli
from train.tools import plot, tokenize

from tests.helpers.trainer import snapshot, tiny_overrides

DEEP = "[" * 5000 + "]" * 5000  # a RecursionError in the YAML parser before


def _one_line(capsys, call, *, fragment: str, status: int = 2) -> str:
    """Run call() (a main, or something raising SystemExit); its status and one stderr line. (A
    refusal that hung instead would end at the suite's 10-minute limit: no timing here.)"""
    capsys.readouterr()
    try:
        got = call()
    except SystemExit as e:  # argparse's errors
        got = e.code
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert got == status, err
    assert len(lines) == 1, err
    assert fragment in lines[0], lines[0]
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------ train.py: the config

TRAIN_CASES = [
    ("eps -1", ["optimizer.eps=-1"], "error: config: optimizer.eps must lie in (0, 1) (e.g. 1e-8), "
                                     "got -1.0"),
    ("eps 0", ["optimizer.eps=0"], "optimizer.eps must lie in (0, 1)"),
    ("cpu_devices 1e12", ["runtime.cpu_devices=1000000000000"],
     "error: config: runtime.cpu_devices=1000000000000 is more CPU devices than can be emulated; "
     "use at most 1024"),
    ("steps 1e20", ["train.steps=100000000000000000000"],
     "error: config: train.steps must be at most 2147483647"),
    ("rows 1e20", ["train.microbatch_size=100000000000000000000"],
     "rows per step; at most 2147483647"),
    ("seq_len 1e21", ["data.seq_len=1000000000000000000000"],
     "error: config: data.seq_len must be at most 2147483647"),
    ("peer timeout 1e300", ["runtime.distributed.peer_timeout_s=1e300"],
     "runtime.distributed.peer_timeout_s must be 0 (off) or lie in [2, 604800] seconds"),
    ("join timeout 0", ["runtime.distributed.join_timeout_s=0"],
     "runtime.distributed.join_timeout_s must lie in [2, 604800] seconds, got 0"),
    ("num_processes 1e20", ["runtime.distributed.num_processes=100000000000000000000"],
     "runtime.distributed.num_processes must lie in [1, 1048576]"),
    ("eval batches 1e14", ["eval.every=1", "eval.batches=100000000000000"],
     "error: config: eval.batches=100000000000000 x train.microbatch_size x data.seq_len = "),
    ("override nested 5000 deep", [f"model.shape.rope_scaling={DEEP}"],
     "error: config: override model.shape.rope_scaling: a value nests lists or mappings more "
     "than 16 levels deep"),
    ("override nested 20 deep", ["model.shape.rope_scaling=" + "{a: " * 20 + "1" + "}" * 20],
     "nests lists or mappings more than 16 levels deep"),
    ("allow_changed of a fixed key", ["checkpoint.allow_changed=run.seed"],
     "error: config: checkpoint.allow_changed: run.seed cannot change on resume"),
    ("allow_changed of an unknown key", ["checkpoint.allow_changed=optimizer.lrr"],
     "error: config: checkpoint.allow_changed: 'optimizer.lrr' is not a key a resume checks"),
    # finite in Python's float64, inf or 0 in the float32 they are computed in
    ("initializer_range 1e39", ["model.shape.initializer_range=1e39"],
     "error: model: initializer_range=1e+39 is inf in float32"),
    ("rope_theta 1e39", ["model.shape.rope_theta=1e39"], "rope_theta=1e+39 is inf in float32"),
    ("rms_norm_eps 1e-50", ["model.shape.rms_norm_eps=1e-50"],
     "rms_norm_eps=1e-50 is 0.0 in float32"),
    ("initializer_range 0", ["model.shape.initializer_range=0"],
     "error: model: initializer_range must be a positive number, got 0.0"),
    ("lr 1e39", ["optimizer.lr=1e39"], "error: config: optimizer.lr=1e+39 is inf in float32"),
    ("weight_decay 1e39", ["optimizer.weight_decay=1e39"], "optimizer.weight_decay=1e+39 is inf"),
    ("clip_norm 1e39", ["optimizer.clip_norm=1e39"], "optimizer.clip_norm=1e+39 is inf"),
    ("eps 1e-50", ["optimizer.eps=1e-50"], "optimizer.eps=1e-50 is 0.0 in float32"),
    ("b2 1.0 in float32", ["optimizer.b2=0.99999999999"],
     "error: config: optimizer.b2=0.99999999999 is 1.0 in float32"),
    # the model's token ids and context: exported into config.json, compared on resume
    ("eos NaN in a list", ["model.shape.eos_token_id=[1, .nan]"],
     "error: model: eos_token_id must be null or an id or a list of ids of the vocabulary "
     "[0, 256), got [1, nan]"),
    ("eos beyond the vocabulary", ["model.shape.eos_token_id=999999"],
     "eos_token_id must be null or an id or a list of ids of the vocabulary [0, 256), got 999999"),
    ("bos -7", ["model.shape.bos_token_id=-7"],
     "error: model: bos_token_id must be null or an id of the vocabulary [0, 256), got -7"),
    ("bos true", ["model.shape.bos_token_id=true"], "bos_token_id must be null or an id"),
    ("max_position_embeddings -5", ["model.shape.max_position_embeddings=-5"],
     "error: model: max_position_embeddings must be a positive integer, got -5"),
    # data.mix's weights: a subnormal one overflowed grain's integer proportions (a traceback)
    ("mix weight 1e-320", ["data.source=tokens", "data.mix={/no/a.bin: 1, /no/b.bin: 1.0e-320}"],
     "error: config: data.mix weight of '/no/b.bin' is 1e-320, below 1e-300"),
    ("mix weights 1e12 apart", ["data.source=tokens", "data.mix={/no/a.bin: 1.0e+6, /no/b.bin: "
                                                      "1.0e-6}"],
     "error: config: data.mix weights '/no/b.bin': 1e-06 and '/no/a.bin': 1000000.0 are more "
     "than 1e+09 times apart"),
]


@pytest.mark.parametrize("extra, fragment", [c[1:] for c in TRAIN_CASES],
                         ids=[c[0] for c in TRAIN_CASES])
def test_train_config_numbers_are_one_line(tmp_path, capsys, extra, fragment):
    run_dir = tmp_path / "run"
    _one_line(capsys, lambda: cli.main(tiny_overrides(run_dir, *extra)), fragment=fragment)
    assert not run_dir.exists()


def test_a_config_file_nested_thousands_deep_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("model:\n  shape:\n    rope_scaling: " + DEEP + "\n")
    run_dir = tmp_path / "run"
    _one_line(capsys, lambda: cli.main(["--config", str(deep), *tiny_overrides(run_dir)]),
              fragment=f"error: config: config file '{deep}': a value nests lists or mappings")
    assert not run_dir.exists()


def test_a_config_file_of_aliases_expanding_to_billions_is_refused_at_once(tmp_path, capsys):
    """Aliases of aliases (each line repeats the one before ten times): 400 bytes that expand to
    a billion values; every walk of the tree visited each of them (a hang) before."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text("model:\n  shape:\n    rope_scaling:\n" + "".join(
        f"      {line}\n" for line in lines))
    run_dir = tmp_path / "run"
    _one_line(capsys, lambda: cli.main(["--config", str(laughs), *tiny_overrides(run_dir)]),
              fragment=f"error: config: config file '{laughs}': the YAML expands to more than "
                       "100000 values")
    assert not run_dir.exists()


def test_aliases_that_expand_to_a_config_still_load(tmp_path):
    """What aliases are for (one value written once, used twice) is untouched by the bound."""
    from train.config.tree import yaml_load

    loaded = yaml_load("a: &a {x: 1}\nb: {<<: *a, y: 2}\nc: &c [1, 2]\nd: [*c, *c]\n")
    assert loaded == {"a": {"x": 1}, "b": {"x": 1, "y": 2}, "c": [1, 2], "d": [[1, 2], [1, 2]]}


# ------------------------------------------------------------------ train.py: data it cannot read

@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    """An empty .bin, and a tokenizer.json that loads but cannot encode (no unknown token)."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    d = tmp_path_factory.mktemp("bad_data")
    (d / "empty.bin").write_bytes(b"")
    tok = Tokenizer(tok_models.WordLevel({"<eos>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "no_unk.json"))
    (d / "docs.txt").write_text("a b\na zebra b\n" * 20)
    deep_json = "[" * 100_000 + "]" * 100_000  # a RecursionError in json.loads
    (d / "deep.jsonl").write_text('{"text": "a b"}\n' + deep_json + "\n")
    np.arange(10, dtype=np.uint16).tofile(d / "ids.bin")
    np.array([7], dtype=np.uint16).tofile(d / "one_token.bin")  # nothing to predict when packed
    np.zeros(50, dtype=np.uint16).tofile(d / "only_eos.bin")
    (d / "ids.bin.json").write_text(deep_json)
    (d / "hf_deep").mkdir()
    (d / "hf_deep" / "config.json").write_text(deep_json)
    return d


def test_train_refuses_unreadable_data_with_one_line(tmp_path, capsys, bad_data):
    before = snapshot(bad_data)
    cases = [
        (["data.source=tokens", f"data.path={bad_data}/empty.bin"],
         f"error: data: token file '{bad_data}/empty.bin' is empty"),
        (["data.source=text", f"data.path={bad_data}/docs.txt",
          f"data.tokenizer={bad_data}/no_unk.json", "data.eos_id=0"],
         f"error: data: tokenizer '{bad_data}/no_unk.json' loads but cannot encode the "
         f"documents of '{bad_data}/docs.txt' (WordLevel error: Missing [UNK] token"),
        (["data.source=jsonl", f"data.path={bad_data}/deep.jsonl",
          f"data.tokenizer={bad_data}/no_unk.json", "data.eos_id=0"],
         f"error: data: {bad_data}/deep.jsonl:2: JSON nested too deeply to read"),
        (["data.source=tokens", f"data.path={bad_data}/ids.bin"],
         f"error: data: token file sidecar '{bad_data}/ids.bin.json' cannot be read "
         "(RecursionError: "),
        (["model.preset=null", "model.shape={}", f"model.hf_path={bad_data}/hf_deep"],
         f"error: model: cannot read {bad_data}/hf_deep/config.json: JSON nested too deeply"),
        # packed documents of one token each: no prediction (a loss of 0.0 over 0 tokens before)
        (["data.source=tokens", f"data.path={bad_data}/one_token.bin", "data.pack=true",
          "data.eos_id=0"], f"error: data: {bad_data}/one_token.bin holds 1 tokens in 1 "
                            "document(s) of one token each"),
        (["data.source=tokens", f"data.path={bad_data}/only_eos.bin", "data.pack=true",
          "data.eos_id=0"], "packed rows hold nothing to predict"),
    ]
    for i, (extra, fragment) in enumerate(cases):
        run_dir = tmp_path / f"run{i}"
        _one_line(capsys, lambda: cli.main(tiny_overrides(run_dir, *extra)), fragment=fragment)
        assert not run_dir.exists()
    assert snapshot(bad_data) == before


def test_plot_skips_a_metrics_line_nested_thousands_deep(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    _one_line(capsys, lambda: plot.main(["losses", str(run_dir), "-o", str(tmp_path / "l.png")]),
              fragment="metrics.jsonl holds no step records (1 unreadable line(s))")


def test_tokenize_refuses_a_tokenizer_that_cannot_encode_and_bad_numbers(tmp_path, capsys,
                                                                        bad_data):
    out = tmp_path / "t.bin"
    common = [str(bad_data / "docs.txt"), "--tokenizer", str(bad_data / "no_unk.json"), "-o",
              str(out)]
    _one_line(capsys, lambda: tokenize.main([*common, "--eos-id", "0", "--workers", "1"]),
              fragment="the tokenizer cannot encode the documents of")
    _one_line(capsys, lambda: tokenize.main([*common, "--workers", "1000000000"]),
              fragment="error: tokenize: --workers must lie in [1, 256] (processes), got 1000000000")
    _one_line(capsys, lambda: tokenize.main([*common, "--workers", "1", "--eos-id",
                                             "100000000000000000000"]),
              fragment="error: tokenize: --eos-id must be a token id in [0, 4294967295] (uint32)")
    assert list(tmp_path.iterdir()) == []  # no output, no temporary


# ------------------------------------------------------------------ the other commands

PLAN = ["--model", "llama-3.1-8b", "--seq", "4096", "--batch", "2", "--devices", "8"]


@pytest.mark.parametrize("flags, fragment", [
    (["--batch", "1e20"], "argument --batch: invalid int value: '1e20'"),
    (["--batch", str(10**20)], "--batch must be at most 1,048,576 (beyond any cluster this "
                               "models), got 100,000,000,000,000,000,000"),
    (["--devices", str(10**11)], "--devices must be at most 1,048,576"),
    (["--seq", str(10**20)], "--seq must be at most 4,294,967,296"),
    (["--grad-accum", str(10**20)], "--grad-accum must be at most 1,048,576"),
    (["--memory-gb", "inf"], "--memory-gb must be a positive number of at most 1e+06"),
    (["--memory-gb", "nan"], "--memory-gb must be a positive number"),
    (["--memory-gb", "1e-300"], "--memory-gb must be a positive number of at most 1e+06 and at "
                                "least 0.1 (GB per device), got 1e-300"),
    (["--max-pad-rows", str(10**9)], "--max-pad-rows must be at most --devices=8"),
], ids=["batch 1e20 written so", "batch 1e20", "devices 1e11", "seq 1e20", "grad_accum 1e20", "memory inf", "memory nan",
        "memory 1e-300", "pad rows 1e9"])
def test_plan_refuses_huge_numbers_at_once(capsys, flags, fragment):
    _one_line(capsys, lambda: plan.main([*PLAN, *flags]), fragment=fragment)


def test_plan_answers_at_once_for_the_largest_cluster_it_takes(capsys):
    """A million devices and as many pad rows as devices: the divisors come from pairs up to
    sqrt(n) and each group count is tried once, with its fewest pad rows."""
    status = plan.main(["--model", "llama-3.1-8b", "--seq", "4096", "--batch", "7", "--devices",
                        str(2**20), "--max-pad-rows", str(2**20)])
    assert status in (0, 2)  # (no layout splits 32 heads over 2**20 devices: one line too)
    assert layout.divisors(10**11)[-3:] == [25 * 10**9, 5 * 10**10, 10**11]
    assert layout.divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]


def test_plot_layouts_refuses_more_devices_than_a_figure_draws(tmp_path, capsys):
    out = str(tmp_path / "l.png")
    _one_line(capsys, lambda: plot.main(["layouts", "--devices", str(10**11), "-o", out]),
              fragment="error: plot: --devices must lie in [1, 128] (a figure draws one box per "
                       "device), got 100,000,000,000")
    _one_line(capsys, lambda: plot.main(["layouts", "--batch", str(10**30), "-o", out]),
              fragment="error: plot: --batch must lie in [1, 1,048,576]")
    assert list(tmp_path.iterdir()) == []


GENERATE_CASES = [
    (["--temperature", "nan"], "error: generate: --temperature must be 0 (greedy) or lie in [0.001, 1000], "
                               "got nan"),
    (["--temperature", "inf"], "--temperature must be 0 (greedy) or lie in"),
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or lie in"),
    (["--temperature", "1e-30"], "--temperature must be 0 (greedy) or lie in"),
    (["--top-p", "-0.5"], "error: generate: --top-p is a probability mass in (0, 1], got -0.5"),
    (["--top-p", "nan"], "--top-p is a probability mass in (0, 1]"),
    (["--max-new-tokens", str(10**12)], "--max-new-tokens must lie in [1, 1,048,576]"),
    (["--seed", str(10**30)], "--seed must lie in [0, 4294967295]"),
    (["--eos-id", "-3"], "--eos-id must be a token id in [0, 2147483647]"),
    (["--prompt-ids", "1,,2"], "error: generate: --prompt-ids has an empty id in '1,,2'; write one "
                               "integer between each two commas, e.g. 1,2,3"),
    (["--prompt-ids", "1,2,"], "--prompt-ids has an empty id in '1,2,'"),
]


@pytest.mark.parametrize("flags, fragment", [c for c in GENERATE_CASES],
                         ids=[" ".join(c[0]) for c in GENERATE_CASES])
def test_generate_refuses_bad_numbers_before_loading_a_model(tmp_path, capsys, flags, fragment):
    """Checked before the model loads: the directory need not even exist."""
    argv = ["--hf_path", str(tmp_path / "no_model"), "--prompt-ids", "1,2", *flags]
    _one_line(capsys, lambda: generate.main(argv), fragment=fragment)


@pytest.mark.parametrize("command, argv, fragment", [
    (generate, ["--hf_path", "x", "--prompt-ids", "1", "--max-new-tokens", "abc"],
     "error: generate: argument --max-new-tokens: invalid int value: 'abc'"),
    (generate, ["--hf_path", "x", "--prompt-ids", "1", "--temperature", "warm"],
     "error: generate: argument --temperature: invalid float value: 'warm'"),
    (tokenize, ["in.txt", "--tokenizer", "t.json", "-o", "o.bin", "--workers", "1e3"],
     "error: tokenize: argument --workers: invalid int value: '1e3'"),
], ids=["generate max-new-tokens abc", "generate temperature warm", "tokenize workers 1e3"])
def test_a_flag_that_is_no_number_is_one_line(capsys, command, argv, fragment):
    """argparse's own usage line would make it two."""
    _one_line(capsys, lambda: command.main(argv), fragment=fragment)


def test_generate_refuses_prompt_ids_numpy_cannot_hold(tmp_path, capsys):
    argv = ["--hf_path", str(tmp_path), "--prompt-ids", f"1,{10**30}"]
    _one_line(capsys, lambda: generate.main(argv),
              fragment="error: generate: --prompt-ids must be token ids in [0, 2147483647], got 1000")


def test_generate_reads_prompt_ids_split_by_commas_or_spaces():
    assert generate._prompt_ids("1, 2 3,4") == [1, 2, 3, 4]


def test_generate_refuses_a_prompt_its_tokenizer_cannot_encode(tmp_path, capsys, bad_data):
    import models

    models.save_pretrained(models.init_model(models.ModelConfig.preset("tiny"), seed=0),
                           str(tmp_path))
    (tmp_path / "tokenizer.json").write_bytes((bad_data / "no_unk.json").read_bytes())
    before = snapshot(tmp_path)
    _one_line(capsys, lambda: generate.main(["--hf_path", str(tmp_path), "--prompt", "a zebra"]),
              fragment="error: generate: the tokenizer cannot encode the prompt (WordLevel error: Missing "
                       "[UNK] token from the vocabulary); use the model's own tokenizer or "
                       "--prompt-ids")
    assert snapshot(tmp_path) == before


def test_sampler_refuses_nan_temperature_and_more_tokens_than_positions():
    """The library call too (not only the command line): NaN fails `temperature < 0`."""
    import models
    from models import sampler
    from models.config import ModelError

    model = models.init_model(models.ModelConfig.preset("tiny"), seed=0)
    with pytest.raises(ModelError, match="need temperature >= 0"):
        sampler.generate(model, [1, 2], max_new_tokens=2, temperature=float("nan"))
    limit = model.config.max_position_embeddings
    with pytest.raises(ModelError, match="exceed the model's max_position_embeddings"):
        sampler.generate(model, [1, 2], max_new_tokens=limit)
    assert np.isfinite(limit)
