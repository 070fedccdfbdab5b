"""Config parsing: YAML + dotted overrides, type coercion, one-line errors."""

import pytest
import yaml

from train.config.schema import ConfigError, Config, load_config, replace, to_yaml

from tests.helpers.trainer import shipped_configs, tiny_overrides


def test_overrides_are_typed(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path / "r", "optimizer.lr=1e-3", "train.steps=7",
                                          "data.pack=false", "optimizer.clip_norm=null",
                                          "model.shape.hidden_size=32"))
    assert isinstance(cfg, Config)
    assert cfg.optimizer.lr == 1e-3 and cfg.train.steps == 7 and cfg.data.pack is False
    assert cfg.optimizer.clip_norm is None
    assert cfg.model.shape["hidden_size"] == 32  # YAML's scalar: model.shape has no types


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run": {"dir": str(tmp_path / "r")}, "train": {"steps": 3}}))
    cfg = load_config(str(path), tiny_overrides(tmp_path / "r2")[1:] + ["train.steps=9"])
    assert cfg.run.dir == str(tmp_path / "r") and cfg.train.steps == 9


def test_round_trip(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path / "r"))
    path = tmp_path / "saved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(str(path)) == cfg
    assert replace(cfg, "parallel.mode=ulysses").parallel.mode == "ulysses"


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.stepz=3", "unknown config key 'train.stepz'"),
        ("train.steps=three", "train.steps: expected an integer"),
        ("train.steps=2.5", "train.steps: expected an integer"),
        ("data.pack=maybe", "data.pack: expected true or false"),
        ("optimizer.lr=-1", "optimizer.lr is required and must be > 0"),
        ("train.steps=0", "train.steps must be a positive integer"),
        ("runtime.cpu_devices=0", "runtime.cpu_devices must be a positive integer"),
        ("model.hf_path=/x", "set exactly one of model.preset"),
        ("data.source=tokens", "data.source=tokens needs data.path"),
        ("parallel.groups=2", None),  # fine with basp
        ("optimizer.warmup_steps=99", None),  # longer than the run: clamped, with a note
        ("optimizer.warmup_steps=-1", "optimizer.warmup_steps must be >= 0"),
        ("noequals", "is not key.sub=value"),
        # nan passes every `x <= 0` check and would train to NaN: every float must be finite
        ("optimizer.lr=nan", "optimizer.lr: expected a finite number, got 'nan'"),
        ("optimizer.weight_decay=nan", "optimizer.weight_decay: expected a finite number"),
        ("optimizer.clip_norm=nan", "optimizer.clip_norm: expected a finite number"),
        ("optimizer.lr=inf", "optimizer.lr: expected a finite number"),
        ("run.seed=-1", "run.seed must lie in [0, 4294967295], got -1"),
        (f"run.seed={2**64}", f"run.seed must lie in [0, 4294967295], got {2**64}"),
        ("model.shape={a: 1, a: 2}", "override model.shape: key 'a' appears twice (lines 1 and 1)"),
    ],
)
def test_bad_values_one_line(tmp_path, override, fragment):
    args = tiny_overrides(tmp_path / "r", override)
    if fragment is None:
        load_config(None, args)
        return
    with pytest.raises(ConfigError) as info:
        load_config(None, args)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


QWEN35 = "model.preset=tiny-qwen3.5"


@pytest.mark.parametrize("overrides, fragment", [
    ([QWEN35, "model.shape={layer_types: [1, 2]}"],
     "model: layer_types[0] is 1; each entry must be 'linear_attention' or 'full_attention'"),
    ([QWEN35, "model.shape={layer_types: [linear_attention, [2], 3, full_attention]}"],
     "model: layer_types[1] is [2]; each entry must be 'linear_attention' or"),
    ([QWEN35, "model.shape={layer_types: 5}"], "model: layer_types must be a list with one entry "
                                               "per layer, each 'linear_attention' or "
                                               "'full_attention', got 5"),
    ([QWEN35, "model.shape={layer_types: linear_attention}"], "layer_types must be a list"),
    ([QWEN35, 'model.shape={layer_types: "[a, b"}'],
     "config: model.shape.layer_types: '[a, b' is not valid YAML (expected ',' or ']', but got "
     "'<stream end>'); write a YAML list or mapping"),
    (['model.shape={rope_scaling: "{a: 1, a: 2}"}'],
     "config: model.shape.rope_scaling: key 'a' appears twice (lines 1 and 1); keep one"),
    (['model.shape={eos_token_id: "[1, 2"}'], "config: model.shape.eos_token_id: '[1, 2' is not "
                                              "valid YAML"),
], ids=["layer_types [1, 2]", "layer_types [[2], 3]", "layer_types 5", "layer_types a string",
        "layer_types bad YAML", "rope_scaling duplicate key", "eos_token_id bad YAML"])
def test_bad_model_shape_values_one_line(tmp_path, overrides, fragment):
    """Values model.shape hands to ModelConfig unchecked: one line (ConfigError or ModelError, as
    train.cli prints them) when the model config is built, before anything compiles."""
    import models
    from train.program.model_setup import model_config

    cfg = load_config(None, tiny_overrides(tmp_path / "r", *overrides))
    with pytest.raises((ConfigError, models.ModelError)) as info:
        model_config(cfg)
    kind = "config" if isinstance(info.value, ConfigError) else "model"
    line = f"{kind}: {info.value}"
    assert fragment in line and "\n" not in line, line


def test_dotted_overrides_into_a_mapping_take_yamls_scalars(tmp_path):
    """model.shape.rope_scaling.factor=2 is the number 2, as in model.shape={...}, not '2'."""
    from train.program.model_setup import model_config

    dotted = load_config(None, tiny_overrides(
        tmp_path / "r", "model.shape.rope_scaling.rope_type=linear",
        "model.shape.rope_scaling.factor=2", "model.shape.rope_scaling.low=2.5",
        "model.shape.rope_scaling.keep=true", "optimizer.lr=1e-3"))
    flow = load_config(None, tiny_overrides(
        tmp_path / "r", "model.shape.rope_scaling={rope_type: linear, factor: 2, low: 2.5, "
                        "keep: true}"))
    assert dotted.model.shape == flow.model.shape
    assert model_config(dotted).rope_scaling == {"rope_type": "linear", "factor": 2, "low": 2.5,
                                                 "keep": True}
    assert dotted.optimizer.lr == 1e-3  # typed fields still coerce what was typed


@pytest.mark.parametrize("override, names", [
    ("parallel.mode=ring", "basp, ulysses, auto, adaptive"),
    ("model.attn_impl=flash", "auto, xla, cudnn, pallas, blockwise"),
    ("parallel.param_sharding=zero", "auto, fsdp, hsdp, host, staged_keep, staged_offload, staged, replicated"),
    ("model.remat=some", "none, full, full_kv, inputs, dots, offload, offload_exchanges, auto"),
])
def test_registry_choices_are_checked_with_one_line_naming_them(tmp_path, override, names):
    """Keys that take a registry's names are `str` in train/config/schema.py (no JAX there) and
    checked by train.choices, which train.prepare and train.tools.aot run first."""
    from train import choices

    cfg = load_config(None, tiny_overrides(tmp_path / "r", override))
    key, got = override.split("=")
    with pytest.raises(ConfigError) as info:
        choices.check(cfg)
    assert str(info.value) == f"{key}: expected one of {names}, got {got!r}"
    choices.check(load_config(None, tiny_overrides(tmp_path / "r")))  # the defaults pass


def test_ulysses_with_groups_rejected_by_the_layouts_own_rule(tmp_path):
    """The config leaves the split's rules to Layout.plan, which the trainer asks before
    anything compiles (train.program.planning.plan)."""
    import models
    from basp_jax import LayoutError
    from train.program.planning import plan

    cfg = load_config(None, tiny_overrides(tmp_path / "r", "parallel.mode=ulysses",
                                           "parallel.groups=2"))
    with pytest.raises(LayoutError, match="mode='ulysses' means groups=1, got groups=2"):
        plan(cfg, models.ModelConfig.preset("tiny"), 8, 8)


def test_missing_required(tmp_path):
    with pytest.raises(ConfigError, match="run.dir is required"):
        load_config(None, ["train.steps=1"])


def test_shipped_configs_load_and_plan():
    """Every config in configs/ parses; the GPU ones plan their layout for their model on 8 devices."""
    import models
    from basp_jax import Layout
    from train.program import planning

    paths = shipped_configs()
    assert len(paths) >= 11
    for path in paths:
        cfg = load_config(str(path))
        if "gpu" not in path.parts:
            continue
        preset = path.stem.rsplit("_", 1)[0]
        mc = models.ModelConfig.preset(preset)
        adaptive = cfg.parallel.mode == "adaptive"  # basp's layout and its siblings
        devices, per_host = cfg.runtime.devices, cfg.parallel.devices_per_host
        strategy = planning.plan(cfg, mc, devices, per_host)[1]
        # on several hosts the planner's choice: FSDP's shards, each layer across hosts once;
        # a config that names a sharding gets it
        planned = "staged_keep" if devices > per_host else "fsdp"
        named = cfg.parallel.param_sharding
        assert strategy == (planned if named == "auto" else named), path
        layout = Layout.plan(num_devices=devices, batch=cfg.train.microbatch_size,
                             seq_len=cfg.data.seq_len, num_heads=mc.num_heads,
                             num_kv_heads=mc.num_kv_heads,
                             mode="basp" if adaptive else cfg.parallel.mode,
                             devices_per_host=per_host)
        assert cfg.data.eos_id < mc.vocab_size
        if adaptive:  # one sequence per microbatch: (1,8) and 2, 4, 8 groups of shorter rows
            from basp_jax import adaptive as adapt

            sets = adapt.expand(layout, param_sharding=strategy)
            assert [(x.groups, x.sp, x.seq_len) for x in sets] == \
                [(1, 8, 16384), (2, 4, 8192), (4, 2, 4096), (8, 1, 2048)]
            assert cfg.data.pack
            continue
        if path.stem.endswith("_long"):  # one 4M sequence: one group of 8
            assert (layout.groups, layout.sp, cfg.data.seq_len) == (1, 8, 4194304)
            continue
        if mc.is_moe:  # 32K tokens on 2 hosts x 8 H100: one group per host
            assert (devices, per_host, cfg.data.seq_len) == (16, 8, 32768)
            assert (layout.groups, layout.sp) == ((2, 8) if cfg.parallel.mode == "basp"
                                                  else (1, 16))
            continue
        assert (layout.groups, layout.sp) == ((2, 4) if cfg.parallel.mode == "basp" else (1, 8))
        assert cfg.data.seq_len == 16384


def test_required_keys_one_by_one(tmp_path):
    full = tiny_overrides(tmp_path / "r")
    # a required key left out is None, never a placeholder like 0: the error says it is required
    required = {key: f"{key} is required: " for key in (
        "run.dir", "train.steps", "train.microbatch_size", "train.grad_accum", "parallel.mode",
        "runtime.cpu_devices", "data.source", "data.seq_len", "optimizer.lr")}
    required["model.preset"] = "set exactly one of model.preset"
    for key, fragment in required.items():
        args = [a for a in full if not a.startswith(key + "=")]
        assert len(args) == len(full) - 1, key
        with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
            load_config(None, args)


def test_duplicate_yaml_keys_are_an_error(tmp_path):
    """The last of two equal keys would silently win; the config names both lines instead."""
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  steps: 10\n  microbatch_size: 2\n  steps: 20\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), tiny_overrides(tmp_path / "r"))
    assert str(info.value) == (f"config file {str(path)!r}: key 'steps' appears twice (lines 2 "
                               "and 4); keep one")


def test_warmup_longer_than_the_run_is_clamped():
    from train.config.schema import OptimizerConfig
    from train.program.step import make_schedule

    schedule = make_schedule(OptimizerConfig(lr=1.0, warmup_steps=20), steps=4)
    assert float(schedule(4)) == pytest.approx(1.0)  # reaches the peak within the run


def test_shipped_configs_accept_a_short_smoke_run(tmp_path):
    """`train.steps=4` on a config with a 20-step warm-up was refused; it is clamped instead (the
    trainer prints a note)."""
    paths = shipped_configs()
    assert paths
    for path in paths:
        cfg = load_config(str(path), ["train.steps=4", f"run.dir={tmp_path / 'smoke'}"])
        assert cfg.train.steps == 4


def test_a_compiled_step_larger_than_the_device_is_refused(tmp_path):
    """The compiled program's own memory analysis is checked against the device before step 1
    (train.loop calls this right after compiling)."""
    import types

    import jax

    from train.program import planning

    cfg = load_config(None, tiny_overrides(tmp_path / "run"))
    limit = planning.device_memory(jax.devices()[0])
    stats = types.SimpleNamespace(argument_size_in_bytes=int(limit), output_size_in_bytes=0,
                                  alias_size_in_bytes=0, temp_size_in_bytes=int(limit))
    compiled = types.SimpleNamespace(memory_analysis=lambda: stats)
    with pytest.raises(planning.ResourceError, match="from the compiled train step's memory"):
        planning.check_compiled_memory(cfg, compiled, jax.devices())
    stats.argument_size_in_bytes, stats.temp_size_in_bytes = int(limit) // 4, 0  # a quarter fits
    planning.check_compiled_memory(cfg, compiled, jax.devices())


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_include_lays_the_including_files_values_over_the_included(tmp_path):
    """include: relative to the including file; mappings merge key by key, its values win, a
    list merges in order, includes nest, a null leaf replaces, an empty section adds nothing;
    the saved config holds the values, not the include."""
    _write(tmp_path / "bases" / "deep.yaml", "train: {steps: 1, grad_accum: 3}\nrun: {seed: 5}\n"
                                              "checkpoint: {keep: 4}\n")
    _write(tmp_path / "bases" / "a.yaml",
           "include: deep.yaml\ntrain: {steps: 2, microbatch_size: 4}\noptimizer: {lr: 0.5}\n")
    _write(tmp_path / "bases" / "b.yaml", "optimizer: {lr: 0.25, clip_norm: 2.0}\n")
    path = _write(tmp_path / "c.yaml", (
        "include: [bases/a.yaml, bases/b.yaml]\n"
        f"run: {{dir: {tmp_path / 'r'}}}\n"
        "train: {steps: 7}\n"
        "optimizer: {clip_norm: null}\n"
        "checkpoint:\n"))
    overrides = [o for o in tiny_overrides(tmp_path / "r") if o.split("=")[0] not in (
        "run.dir", "run.seed", "train.steps", "train.microbatch_size", "train.grad_accum",
        "optimizer.lr")]
    cfg = load_config(path, overrides + ["train.grad_accum=2"])
    assert (cfg.train.steps, cfg.train.microbatch_size, cfg.train.grad_accum) == (7, 4, 2)
    assert cfg.run.seed == 5 and cfg.run.dir == str(tmp_path / "r")
    assert cfg.optimizer.lr == 0.25 and cfg.optimizer.clip_norm is None  # b over a; null wins
    assert cfg.checkpoint.keep == 4  # c.yaml's empty checkpoint section kept deep.yaml's
    saved = yaml.safe_load(to_yaml(cfg))
    assert "include" not in saved and saved["train"]["steps"] == 7 and saved["run"]["seed"] == 5
    assert load_config(_write(tmp_path / "saved.yaml", to_yaml(cfg))) == cfg


@pytest.mark.parametrize("text, others, fragment", [
    ("include: missing.yaml\n", {}, "include 'missing.yaml' does not exist (looked for "),
    ("include: a.yaml\n", {"a.yaml": "include: b.yaml\n", "b.yaml": "include: ./c.yaml\n"},
     "include './c.yaml' makes a cycle ("),
    ("include: c.yaml\n", {}, "include 'c.yaml' makes a cycle ("),
    ("include: 3\n", {}, "include must be a file path or a list of them, got 3"),
    ("include: []\n", {}, "include must be a file path or a list of them, got []"),
    ("include: a.yaml\n", {"a.yaml": "train: [1\n"}, "a.yaml' is not valid YAML"),
])
def test_bad_includes_are_one_line_errors(tmp_path, text, others, fragment):
    for name, body in others.items():
        _write(tmp_path / name, body)
    path = _write(tmp_path / "c.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_config(path, tiny_overrides(tmp_path / "r"))
    message = str(info.value)
    assert "\n" not in message and fragment in message, message


def test_gpu_configs_state_only_what_differs_from_what_they_include():
    """configs/gpu: every config resolves through its include chain (to _base.yaml), and no key
    a file sets repeats the value it already has from the files it includes."""
    from train.config.tree import load_tree, read_yaml

    paths = shipped_configs("gpu/*.yaml")
    assert len(paths) == 18  # eight models x basp/ulysses, the 8B's long-context and adaptive ones
    for path in paths:
        own = read_yaml(str(path))
        included = load_tree(str(path.parent / own.pop("include")))
        for section, values in own.items():
            for key, value in values.items():
                assert included.get(section, {}).get(key, object()) != value, (path, section, key)
        cfg = load_config(str(path))
        mode = "basp" if path.stem.endswith("_long") else cfg.parallel.mode  # a basp config
        assert mode in path.stem or path.stem.endswith("_long"), path
        assert cfg.parallel.mode == mode and cfg.run.dir == f"runs/{path.stem}"
        assert cfg.model.preset == path.stem.rsplit("_", 1)[0]
