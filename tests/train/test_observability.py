"""What a run leaves to look at besides metrics.jsonl: TensorBoard event files, W&B logs (a fake
wandb module records the calls), a jax.profiler trace, held-out eval loss; the model's named
scopes in the train step's HLO. One tiny run (module fixture) serves most tests."""

import json
import logging
import math
import sys
import types

import jax
import numpy as np
import pytest
from flax import nnx

import models
from train.config.schema import ConfigError
from train.data import DataError
from train.loop import model_config, run
from train.observe.writers import Writers, memory_in_use

from tests.helpers.trainer import packed_stream, tiny_config

pytestmark = pytest.mark.usefixtures("compile_cache")  # this run's (tests/conftest.py)

STEPS, EVERY, BATCHES = 5, 2, 2


class FakeWandb(types.ModuleType):
    """A stand-in for the wandb module: records init/log/finish, touches no network."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        fake = self

        class Run:
            def log(self, data, step=None):
                fake.calls.append(("log", dict(data), step))

            def finish(self):
                fake.calls.append(("finish",))

        return Run()


class CompileLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """A packed token-file run with eval every 2 steps on a held-out file, a 1-step profile,
    TensorBoard and (fake) W&B."""
    tmp = tmp_path_factory.mktemp("observed")
    train_file, eval_file = tmp / "train.bin", tmp / "eval.bin"
    packed_stream(train_file, seed=0)
    packed_stream(eval_file, seed=1)
    cfg = tiny_config(
        tmp / "run", "data.source=tokens", f"data.path={train_file}", "data.pack=true",
        "data.eos_id=0", f"eval.path={eval_file}", f"eval.every={EVERY}",
        f"eval.batches={BATCHES}", "profile.steps=1", "profile.start_step=2",
        "metrics.wandb_project=basp-test", f"train.steps={STEPS}")
    wandb = FakeWandb()
    log = CompileLog()
    jax_logger = logging.getLogger("jax")
    jax_logger.addHandler(log)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "wandb", wandb)
        jax.config.update("jax_log_compiles", True)  # a line per compiled program, by name
        try:
            summary = run(cfg)
        finally:
            jax.config.update("jax_log_compiles", False)
            jax_logger.removeHandler(log)
    lines = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return types.SimpleNamespace(cfg=cfg, summary=summary, lines=lines, wandb=wandb,
                                 compiles=log.messages, run_dir=tmp / "run", eval_file=eval_file)


def numbers(line):
    """The numeric entries of a metrics.jsonl line (bools as 0/1), without the step."""
    return {k: float(v) for k, v in line.items()
            if k != "step" and isinstance(v, (int, float))}


def tb_name(key):
    return "eval/" + key[len("eval_"):] if key.startswith("eval_") else "train/" + key


@pytest.mark.slow
def test_tensorboard_holds_the_metrics_jsonl_scalars(observed):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(observed.run_dir / "tb"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert len(observed.lines) == STEPS
    for line in observed.lines:
        for key, value in numbers(line).items():
            events = {e.step: e.value for e in acc.Scalars(tb_name(key))}
            assert events[line["step"]] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    assert {"train/loss", "train/grad_norm", "eval/loss", "eval/perplexity"} <= tags
    # beyond metrics.jsonl: step-time percentiles over the steps so far
    p50 = {e.step: e.value for e in acc.Scalars("perf/step_time_p50_s")}
    times = [line["step_time_s"] for line in observed.lines]
    assert sorted(p50) == list(range(1, STEPS + 1))
    assert p50[STEPS] == pytest.approx(float(np.median(times)), rel=1e-6)
    assert {e.step for e in acc.Scalars("eval/loss")} == {2, 4, 5}


def test_wandb_gets_the_same_scalars(observed):
    calls = observed.wandb.calls
    assert calls[0][0] == "init" and calls[-1] == ("finish",)
    init = calls[0][1]
    assert init["project"] == "basp-test" and init["resume"] == "allow"
    assert init["config"]["eval"]["every"] == EVERY  # the resolved config
    assert (observed.run_dir / "wandb_id").read_text().strip() == init["id"]
    logs = [c for c in calls if c[0] == "log"]
    assert [step for _, _, step in logs] == list(range(1, STEPS + 1))
    for (_, data, step), line in zip(logs, observed.lines):
        for key, value in numbers(line).items():
            assert data[tb_name(key)] == pytest.approx(value, rel=1e-9), key
        assert "perf/step_time_p90_s" in data


def test_profile_directory_holds_a_trace(observed):
    traces = list((observed.run_dir / "profile").glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert list(traces[0].parent.glob("perfetto_trace.json.gz"))


def test_eval_loss_equals_a_single_device_reference(observed):
    """The last evaluation (after step 5, with the final parameters) against the model on one
    device, unchunked, on the first eval.batches x microbatch windows of the eval file, with the
    packed documents' masks rebuilt here from the eos tokens."""
    evals = {line["step"]: line for line in observed.lines if "eval_loss" in line}
    assert sorted(evals) == [2, 4, 5]
    cfg = observed.cfg
    seq, rows = cfg.data.seq_len, BATCHES * cfg.train.microbatch_size
    stream = np.fromfile(observed.eval_file, dtype=np.uint16).astype(np.int32)
    windows = np.stack([stream[i * seq: i * seq + seq + 1] for i in range(rows)])
    tokens, targets = windows[:, :-1], windows[:, 1:].copy()
    eos = cfg.data.eos_id
    targets[tokens == eos] = -1  # no prediction across a document boundary
    segments = np.concatenate([np.zeros((rows, 1), np.int32),
                               np.cumsum(tokens == eos, axis=1)[:, :-1]], axis=1)

    abstract = models.abstract_model(model_config(cfg))  # one device, no mesh
    graphdef, params = nnx.split(abstract, nnx.Param)  # (the model has no other state)
    nnx.replace_by_pure_dict(params, jax.device_get(observed.summary["params"]))
    model = nnx.merge(graphdef, params)
    forward = nnx.jit(lambda m, t, s: m(t, segment_ids=s))  # one program, not op by op
    logits = forward(model, jax.numpy.asarray(tokens), jax.numpy.asarray(segments))
    total, count = models.causal_lm_loss(logits, jax.numpy.asarray(targets))
    expected = float(total) / float(count)
    last = evals[STEPS]
    assert last["eval_tokens"] == int(count) == int((targets >= 0).sum())
    assert last["eval_loss"] == pytest.approx(expected, rel=2e-5)
    assert last["eval_perplexity"] == pytest.approx(math.exp(expected), rel=1e-4)
    assert evals[2]["eval_loss"] > last["eval_loss"]  # training lowers the held-out loss too


def test_eval_step_compiles_once(observed):
    compiled = [m for m in observed.compiles if m.startswith("Compiling jit(eval_step)")]
    assert len(compiled) == 1, compiled
    assert any(m.startswith("Compiling jit(train_step)") for m in observed.compiles)


STEP_S, EVAL_S = 10.0, 1000.0  # simulated: a train step's wait, an evaluation's compile or wait


@pytest.mark.slow
def test_no_train_step_is_credited_with_an_evaluation(tmp_path, monkeypatch):
    """A clock that jumps STEP_S whenever the host waits for a train step's metrics and EVAL_S
    while an evaluation starts (compile, dispatch) and while the host waits for its result: every
    step's step_time_s holds its own STEP_S and none of an EVAL_S (not the step before an
    evaluation, which ran while it compiled, nor the one after, which waited for it); the
    evaluations' rows report them."""
    import time

    from train.observe import evaluate

    offset = [0.0]
    real_clock, real_get = time.perf_counter, jax.device_get
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset[0])

    def get(x):
        if isinstance(x, dict) and "grad_norm" in x:  # a train step's metrics
            offset[0] += STEP_S
        return real_get(x)

    start, finish = evaluate.Evaluator.start, evaluate.Evaluator.finish

    def slow_start(self, params):
        pending = start(self, params)
        offset[0] += EVAL_S
        return pending

    def slow_finish(self, pending, **kwargs):
        offset[0] += EVAL_S
        return finish(self, pending, **kwargs)

    monkeypatch.setattr(jax, "device_get", get)
    monkeypatch.setattr(evaluate.Evaluator, "start", slow_start)
    monkeypatch.setattr(evaluate.Evaluator, "finish", slow_finish)
    steps = 7
    cfg = tiny_config(tmp_path / "run", f"train.steps={steps}", "eval.every=3",
                      "checkpoint.save_final=false", "metrics.tensorboard=false")
    run(cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
             .splitlines()]
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    tokens = cfg.data.seq_len * cfg.train.microbatch_size * cfg.train.grad_accum
    for line in lines:
        assert STEP_S <= line["step_time_s"] < STEP_S + EVAL_S / 2, lines
        assert line["tokens_per_s"] == pytest.approx(tokens / line["step_time_s"], rel=1e-9)
    evals = {line["step"]: line for line in lines if "eval_loss" in line}
    assert sorted(evals) == [3, 6, 7]
    assert all(line["eval_time_s"] >= EVAL_S for line in evals.values()), evals
    # the first evaluation compiled the eval step: its row says how long that took
    assert evals[3]["eval_compile_s"] > 0
    assert "eval_compile_s" not in evals[6] and "eval_compile_s" not in evals[7]


def test_named_scopes_reach_the_train_step_hlo(tmp_path):
    """The ops of the lowered train step (forward and backward) carry the model's scopes, which
    the compiled program keeps as op_name metadata and a profiler trace shows."""
    import re

    from train.program.state import build_model, build_program, model_factory, plan_run

    cfg = tiny_config(tmp_path / "r")
    mcfg = model_config(cfg)
    plan = plan_run(cfg, mcfg, jax.devices(), 8)
    parts = build_model(model_factory(cfg, mcfg, plan), plan.rules,
                        init_params=False)
    program = build_program(cfg, plan, parts)
    text = program.lower(*program.abstract_state(parts.params, program.abstract_opt_state)
                         ).as_text(debug_info=True)
    names = set(re.findall(r'loc\("([^"]+)"', text))
    for scope in ("seq_to_heads/all_to_all", "heads_to_seq/all_to_all", "attention_kernel/",
                  "attention/", "mlp/", "loss"):
        assert any(scope in n for n in names), scope
    # backward too (jax >= 0.11 prefixes the enclosing jit and loop: "jit(train_step)/while/...")
    assert any("transpose(jvp(loss" in n for n in names)


def test_a_resumed_run_replaces_the_tensorboard_steps_after_its_checkpoint(tmp_path):
    """Steps 3-4 written again after resuming from step 2 (as metrics.jsonl drops their lines):
    TensorBoard's reader shows each step once, with the new values."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    cfg = tiny_config(tmp_path / "r")
    first = Writers(cfg, str(tmp_path), start_step=0, is_writer=True)
    for step in range(1, 5):
        first.write({"step": step, "loss": float(step)})
    first.close()
    resumed = Writers(cfg, str(tmp_path), start_step=2, is_writer=True)
    for step in (3, 4):
        resumed.write({"step": step, "loss": 10.0 * step})
    resumed.close()
    acc = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    fresh = Writers(cfg, str(tmp_path), start_step=0, is_writer=True)  # a new run, same run.dir
    fresh.write({"step": 1, "loss": 7.0})
    fresh.close()
    acc = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 7.0)]
    assert Writers(cfg, str(tmp_path), start_step=0, is_writer=False).tb is None  # process > 0


def test_a_resumed_run_goes_on_in_the_same_wandb_run_a_fresh_one_starts_another(tmp_path):
    cfg = tiny_config(tmp_path / "r", "metrics.wandb_project=p", "metrics.tensorboard=false")
    ids = []
    with pytest.MonkeyPatch.context() as mp:
        wandb = FakeWandb()
        mp.setitem(sys.modules, "wandb", wandb)
        for start in (0, 3, 0, 5):
            Writers(cfg, str(tmp_path), start_step=start, is_writer=True).close()
            ids.append(wandb.calls[-2][1]["id"])
    assert ids[0] == ids[1] != ids[2] == ids[3]
    assert not (tmp_path / "tb").exists()


FULL_DISK_TB = """
import builtins, sys
from tensorboardX import record_writer
# every byte written to the event file goes to /dev/full
record_writer.open = lambda path, mode: builtins.open("/dev/full", mode)
from train.observe.writers import TensorBoardFile
tb = TensorBoardFile(sys.argv[1], start_step=0)
try:
    for step in range(1, 200):  # (far more events than its default queue of 10 holds)
        tb.write(step, {f"train/x{i}": 1.0 for i in range(20)})
except OSError as e:
    print(step, e.errno, e.filename)
try:
    tb.write(step + 1, {"train/loss": 1.0})  # at once, again
except OSError:
    print("again")
tb.close()  # it does not raise again
"""


@pytest.mark.slow
def test_a_full_disk_under_tensorboard_raises_naming_the_file_and_never_blocks(tmp_path):
    """SummaryWriter writes in a thread of its own: its ENOSPC reaches the trainer's thread at
    the step's flush (or the next write) as the trainer's one-line disk error, the writes after
    never block on its queue, and neither its thread nor its exit-time flush prints a traceback
    (a process of its own: pytest replaces the hooks that keep those quiet)."""
    import errno
    import subprocess

    from tests.helpers.trainer import ROOT, train_env

    done = subprocess.run([sys.executable, "-c", FULL_DISK_TB, str(tmp_path / "tb")], cwd=ROOT,
                          env=train_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    first, again = done.stdout.splitlines()
    step, code, filename = first.split(" ", 2)
    assert int(step) <= 2 and int(code) == errno.ENOSPC and again == "again"
    assert filename.startswith(str(tmp_path / "tb" / "events.out.tfevents."))
    assert filename.endswith(".from-step-0")


def test_writers_use_the_public_summary_writer_and_make_no_file_until_a_step(tmp_path):
    import tensorboardX

    cfg = tiny_config(tmp_path / "r")
    w = Writers(cfg, str(tmp_path), start_step=0, is_writer=True)
    w.close()
    assert not (tmp_path / "tb").exists()  # nothing to write: nothing written
    w = Writers(cfg, str(tmp_path), start_step=0, is_writer=True)
    w.write({"step": 1, "loss": 2.0})
    assert isinstance(w.tb.writer, tensorboardX.SummaryWriter)
    w.close()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1


def test_memory_in_use_reads_the_devices_that_report_it():
    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    gib = 2**30
    devices = [Device({"bytes_in_use": 2 * gib, "peak_bytes_in_use": 3 * gib}),
               Device({"bytes_in_use": 1 * gib, "peak_bytes_in_use": 5 * gib}), Device(None)]
    assert memory_in_use(devices) == {"memory/in_use_gib": 2.0, "memory/peak_gib": 5.0}
    assert memory_in_use([Device(None)]) == {}  # the CPU backend reports nothing


@pytest.mark.parametrize("override, fragment", [
    ("eval.every=-1", "eval.every must be >= 0"),
    ("eval.batches=0", "eval.batches must be a positive integer"),
    ("eval.path=/x/val.bin", "eval.path is set but eval.every=0 never evaluates"),
    ("profile.steps=-2", "profile.steps must be >= 0"),
    ("profile.start_step=0", "profile.start_step must be >= 1"),
    ("profile.steps=2 profile.start_step=9", "profile.start_step=9 is beyond train.steps=5"),
    ("eval.every=2 eval.path=/x/val.bin", "eval.path is read as data.source says"),
])
def test_bad_eval_and_profile_settings_are_one_line(tmp_path, override, fragment):
    with pytest.raises(ConfigError, match=fragment) as e:
        tiny_config(tmp_path / "r", *override.split())
    assert "\n" not in str(e.value)


def test_eval_needs_a_path_with_file_data(tmp_path):
    stream = tmp_path / "t.bin"
    packed_stream(stream)
    base = ("data.source=tokens", f"data.path={stream}")
    with pytest.raises(ConfigError, match="eval.every=3 needs eval.path"):
        tiny_config(tmp_path / "r", *base, "eval.every=3")
    with pytest.raises(ConfigError, match="token files must end in .bin or .npy"):
        tiny_config(tmp_path / "r", *base, "eval.every=3", "eval.path=val.txt")


def test_missing_eval_file_or_wandb_stop_before_anything_is_written(tmp_path):
    stream = tmp_path / "t.bin"
    packed_stream(stream)
    run_dir = tmp_path / "r"
    base = ("data.source=tokens", f"data.path={stream}", "eval.every=2")
    with pytest.raises(DataError, match=r"^eval: token file .*missing\.bin' does not exist$"):
        run(tiny_config(run_dir, *base, f"eval.path={tmp_path / 'missing.bin'}"))
    short = tmp_path / "short.bin"
    np.arange(1, 100, dtype=np.uint16).tofile(short)  # 99 tokens; 1 row of 64 + 1 needs 65 ...
    with pytest.raises(DataError, match=r"fewer than the 257 that 4 consecutive rows"):
        run(tiny_config(run_dir, *base, f"eval.path={short}"))  # ... 4 rows need 257
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "wandb", None)  # not installed: `import wandb` fails
        with pytest.raises(ConfigError, match="metrics.wandb_project=p but wandb is not installed"):
            run(tiny_config(run_dir, "metrics.wandb_project=p"))
    assert not run_dir.exists()


def test_a_file_where_tb_goes_stops_the_run_before_it_writes(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "tb").write_text("not a directory")
    with pytest.raises(ConfigError, match=r"/r/tb is not a directory .*; move it out of run.dir$"):
        run(tiny_config(run_dir))
    assert sorted(p.name for p in run_dir.iterdir()) == ["tb"]


def test_held_out_synthetic_rows_are_fixed_and_never_trained_on(tmp_path):
    from train.data import Pipeline

    cfg = tiny_config(tmp_path / "r", "eval.every=1")
    kwargs = dict(vocab_size=256, grad_accum=2, microbatch=4, seed=0)
    train, held_out = Pipeline(cfg.data, **kwargs), Pipeline(cfg.data, held_out=True, **kwargs)
    rows = np.arange(8)
    evaluated = held_out.rows(0, rows)["tokens"]
    np.testing.assert_array_equal(evaluated, Pipeline(cfg.data, held_out=True, **kwargs)
                                  .rows(0, rows)["tokens"])
    assert np.array_equal(train.source.table, held_out.source.table)  # the same chain
    trained = {tuple(r) for step in range(50) for r in train.rows(step, rows)["tokens"]}
    assert not any(tuple(r) in trained for r in evaluated)
