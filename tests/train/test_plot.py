"""python -m train.tools.plot: figures from runs, the benchmark and the layout arithmetic; bad input is one
line and exit status 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from train.tools import plot

from tests.helpers.trainer import snapshot

ROOT = Path(__file__).resolve().parents[2]


def write_run(run_dir: Path, records: list[dict], layout: str | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if layout is not None:
        (run_dir / "collectives.json").write_text(json.dumps({"layout": layout, "per_kind": {}}))
    return run_dir


def record(step: int, loss: float, **extra) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 1.0 / step, "lr": 1e-3, "tokens_per_s": 1e4,
            "step_time_s": 0.1, "mfu": None, "skipped": False, **extra}


def assert_png(path: Path, min_width: int = 400, min_height: int = 200) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width >= min_width and height >= min_height, (width, height)


def test_resumed_run_keeps_the_last_record_of_each_step(tmp_path):
    # steps 1-3, then a resume from the step-1 checkpoint logs steps 2 and 3 again
    run = write_run(tmp_path / "run", [record(1, 5.0), record(2, 4.0), record(3, 3.0),
                                       record(2, 4.5), record(3, "nan", skipped=True)])
    records = plot.read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["loss"] for r in records] == [5.0, 4.5, "nan"]


def test_losses_of_two_runs(tmp_path, capsys):
    basp = write_run(tmp_path / "basp", [record(s, 6.0 / s) for s in range(1, 21)],
                     layout="basp: 2 group(s) x sp=4 on 8 devices (2 host(s)); 1 row(s) per group")
    ulysses = write_run(tmp_path / "ulysses", [record(s, 6.0 / s) for s in range(1, 21)])
    out = tmp_path / "figs" / "losses.png"
    argv = ["losses", str(basp), str(ulysses), "-o", str(out), "--metric", "loss",
            "--metric", "grad_norm", "--metric", "mfu"]
    # mfu is null throughout: nothing to draw is an error naming the run and the metric
    assert plot.main(argv) == 2
    assert "no values of 'mfu'" in capsys.readouterr().err
    assert plot.main(argv[:-2]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert_png(out, min_height=400)  # two panels
    assert plot.run_label(basp) == "basp (basp 2x4)"
    assert plot.run_label(ulysses) == "ulysses"


def test_eval_loss_and_the_other_numbers_of_metrics_jsonl_plot(tmp_path, capsys):
    """eval_loss is on the steps that evaluated only: drawn through them; a numeric field the
    trainer may add later plots under its own name; a name no run holds is still refused."""
    evals = {5: dict(eval_loss=4.0, eval_perplexity=54.6, eval_time_s=0.1, eval_compile_s=2.5),
             10: dict(eval_loss=3.0, eval_perplexity=20.1, eval_time_s=0.1)}
    run = write_run(tmp_path / "run", [record(s, 6.0 / s, new_metric=float(s), **evals.get(s, {}))
                                       for s in range(1, 11)])
    out = tmp_path / "eval.png"
    for metric in ("eval_loss", "eval_perplexity", "eval_compile_s", "new_metric"):
        assert plot.main(["losses", str(run), "--metric", metric, "-o", str(out)]) == 0, metric
        assert capsys.readouterr().out.strip() == f"wrote {out}"
        assert_png(out)
    assert plot._series(plot.read_metrics(run), "eval_loss") == ([5, 10], [4.0, 3.0])
    assert plot.main(["losses", str(run), "--metric", "perplexity", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: plot: unknown metric 'perplexity'; use one of ") \
        and "eval_perplexity" in err and "new_metric" in err and err.count("\n") == 1, err
    # an added field is checked as the trainer's are, where it is drawn
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[2] = json.dumps({**json.loads(lines[2]), "new_metric": "high"})
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert plot.main(["losses", str(run), "--metric", "new_metric", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl, step 3: field 'new_metric' is 'high', not a number" in err, err


def test_a_run_resumed_under_another_layout_is_labelled_with_each(tmp_path):
    """The first line of each trainer invocation names its layout: a resume from step 3 under
    ulysses (its lines replace steps 4-6 of the first) and another under the same layout."""
    lines = [record(s, 6.0 / s) for s in range(1, 7)]
    lines[0]["run_layout"] = "basp 2x4"
    resumed = [record(s, 5.0 / s) for s in range(4, 10)]
    resumed[0]["run_layout"] = resumed[3]["run_layout"] = "ulysses 1x8"
    run = write_run(tmp_path / "run", lines + resumed, layout="ulysses: 1 group(s) x sp=8 on 8")
    assert plot.run_label(run) == "run (basp 2x4 -> ulysses 1x8)"
    out = tmp_path / "x.png"
    assert plot.main(["losses", str(run), "-o", str(out)]) == 0
    # a resume from before the switch: its lines replace every ulysses line
    back = write_run(tmp_path / "back", lines + resumed + [
        record(2, 1.0, run_layout="basp 2x4"), *[record(s, 1.0) for s in range(3, 10)]])
    assert plot.run_label(back) == "back (basp 2x4)"


def write_checkpoint_meta(run_dir: Path, step: int, layout: str) -> None:
    meta = run_dir / "checkpoints" / str(step) / "meta"
    meta.mkdir(parents=True)
    (meta / "metadata").write_text(json.dumps({"step": step, "layout": layout}))


def test_a_run_begun_before_run_layout_is_labelled_from_its_checkpoints(tmp_path):
    """Lines without run_layout: the layouts of the kept checkpoints' metadata, then
    collectives.json's; the first line that has one takes over from there."""
    basp = "basp: 2 group(s) x sp=4 on 8 devices (1 host(s)); 1 row(s) per group"
    ring = "ulysses: 1 group(s) x sp=8 (ring 2 x all-to-all 4) on 8 devices (1 host(s))"
    old = write_run(tmp_path / "old", [record(s, 1.0) for s in range(1, 9)], layout=ring)
    write_checkpoint_meta(old, 2, basp)
    write_checkpoint_meta(old, 4, basp)
    assert plot.run_label(old) == "old (basp 2x4 -> ulysses 1x8/ring2)"
    mixed = write_run(tmp_path / "mixed", [record(s, 1.0, **({"run_layout": "basp 4x2"}
                                                             if s == 5 else {}))
                                           for s in range(1, 9)], layout=basp)
    write_checkpoint_meta(mixed, 4, ring)
    assert plot.run_label(mixed) == "mixed (ulysses 1x8/ring2 -> basp 4x2)"
    unknown = write_run(tmp_path / "unknown", [record(1, 1.0), record(2, 1.0, run_layout="x 1x8")])
    assert plot.run_label(unknown) == "unknown (? -> x 1x8)"


@pytest.mark.slow
def test_the_trainer_records_each_invocations_layout(tmp_path):
    """A tiny run stopped after step 3 under basp and resumed under ulysses: the plot's label
    names both, in order."""
    from train.config.schema import replace
    from train.loop import run

    from tests.helpers.trainer import tiny_config

    cfg = tiny_config(tmp_path / "run", "train.steps=5", "metrics.tensorboard=false")
    run(cfg, stop_at=3)
    run(replace(cfg, "parallel.mode=ulysses"))
    records = plot.read_metrics(tmp_path / "run")
    assert [r.get("run_layout") for r in records] == ["basp 4x2", None, None, "ulysses 1x8", None]
    assert plot.run_label(tmp_path / "run") == "run (basp 4x2 -> ulysses 1x8)"


def test_bench_figure_has_the_benchmark_figure_size(tmp_path, capsys):
    out = tmp_path / "bench.png"
    results = ROOT / "bench" / "emulated_b2" / "results.json"
    assert plot.main(["bench", str(results), "-o", str(out)]) == 0
    committed = matplotlib.image.imread(ROOT / "bench" / "emulated_b2" / "emulated_cluster.png")
    assert matplotlib.image.imread(out).shape == committed.shape  # same figure size and dpi


def test_layouts_figure(tmp_path, capsys):
    out = tmp_path / "layouts.png"
    assert plot.main(["layouts", "--devices", "16", "--devices-per-host", "8", "--batch", "4",
                      "-o", str(out)]) == 0
    assert_png(out, min_width=1000)


def test_tilde_paths_are_expanded(tmp_path, monkeypatch, capsys):
    """`-o ~/x.png` or `--out=~/x.png` (a shell expands neither in `--out=~/...` nor quoted)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert plot.main(["layouts", "--out=~/layouts.png"]) == 0
    assert_png(tmp_path / "layouts.png", min_width=100)
    assert not Path("~").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no run dir", "empty metrics", "unknown metric", "not results",
                                  "results not JSON", "bad layout", "not png", "missing -o",
                                  "metrics not UTF-8", "results not UTF-8", "-o not writable",
                                  "-o under a file", "-o is a directory"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    run = write_run(tmp_path / "run", [record(1, 5.0)])
    empty = write_run(tmp_path / "empty", [])
    (tmp_path / "results.json").write_text('{"rate": null}')
    (tmp_path / "broken.json").write_text("[{")
    (tmp_path / "latin1.json").write_bytes(b"caf\xe9")
    latin1 = tmp_path / "latin1"
    latin1.mkdir()
    (latin1 / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": "caf\xe9"}\n')
    (tmp_path / "a_file").write_text("")
    locked = tmp_path / "locked.png"
    locked.mkdir()
    locked.chmod(0o500)
    out = str(tmp_path / "out.png")
    argv = {
        "no run dir": ["losses", str(tmp_path / "nowhere"), "-o", out],
        "empty metrics": ["losses", str(run), str(empty), "-o", out],
        "unknown metric": ["losses", str(run), "--metric", "perplexity", "-o", out],
        "not results": ["bench", str(tmp_path / "results.json"), "-o", out],
        "results not JSON": ["bench", str(tmp_path / "broken.json"), "-o", out],
        "bad layout": ["layouts", "--devices", "8", "--devices-per-host", "3", "-o", out],
        "not png": ["layouts", "-o", str(tmp_path / "layouts.pdf")],
        "missing -o": ["layouts", "--devices", "8"],
        "metrics not UTF-8": ["losses", str(latin1), "-o", out],
        "results not UTF-8": ["bench", str(tmp_path / "latin1.json"), "-o", out],
        "-o not writable": ["layouts", "-o", str(locked / "out.png")],
        "-o under a file": ["layouts", "-o", str(tmp_path / "a_file" / "out.png")],
        "-o is a directory": ["layouts", "-o", str(locked)],
    }[case]
    if case == "-o not writable" and os.access(locked, os.W_OK):
        argv[-1] = "/proc/out.png"  # root writes into a read-only directory; not into /proc
    try:
        status = plot.main(argv)
    except SystemExit as e:  # argparse errors exit from inside parse_args
        status = e.code
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("error: plot: ") and err.count("\n") == 1, err
    assert not os.path.exists(out) or case == "-o is a directory"


@pytest.mark.slow
def test_command_line(tmp_path):
    out = tmp_path / "layouts.png"
    ok = subprocess.run([sys.executable, "-m", "train.tools.plot", "layouts", "-o", str(out)], cwd=ROOT,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == f"wrote {out}\n"
    assert_png(out, min_width=1000)
    bad = subprocess.run([sys.executable, "-m", "train.tools.plot", "losses", str(tmp_path), "-o",
                          str(tmp_path / "x.png")], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: plot: ") and bad.stderr.count("\n") == 1
    assert "Traceback" not in bad.stderr


def test_without_matplotlib_help_works_and_drawing_is_one_line(tmp_path):
    """The [plot] extra is optional: without it `--help` still answers and a figure is refused
    in one line that names the extra."""
    import subprocess
    import sys

    from tests.helpers.trainer import ROOT, train_env

    hide = "import sys; sys.modules['matplotlib'] = None; from train.tools.plot import main; "
    helped = subprocess.run([sys.executable, "-c", hide + "main(['--help'])"], cwd=ROOT,
                            env=train_env(), capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "losses" in helped.stdout, helped.stderr
    drawn = subprocess.run([sys.executable, "-c", hide + "sys.exit(main(['layouts', '-o', "
                            f"'{tmp_path}/x.png']))"], cwd=ROOT, env=train_env(),
                           capture_output=True, text=True, timeout=60)
    assert drawn.returncode == 2 and drawn.stderr == (
        "error: plot: train.tools.plot draws with matplotlib, which is not installed: "
        "pip install -e '.[plot]'\n")
    assert not (tmp_path / "x.png").exists()


def _plot_status(argv) -> int:
    try:
        return plot.main(argv)
    except SystemExit as e:
        return e.code


def test_an_output_that_is_an_input_through_a_symlink_is_refused(tmp_path, capsys):
    """-o x.png, a symlink to the run's metrics.jsonl (or to the bench results): the figure would
    be written over the input; one line, nothing changed."""
    run = write_run(tmp_path / "run", [record(1, 5.0), record(2, 4.0)])
    results = tmp_path / "results.json"
    results.write_text((ROOT / "bench" / "emulated_b2" / "results.json").read_text())
    (tmp_path / "x.png").symlink_to(run / "metrics.jsonl")
    (tmp_path / "y.png").symlink_to(results)
    before = snapshot(tmp_path)
    for argv in (["losses", str(run), "-o", str(tmp_path / "x.png")],
                 ["bench", str(results), "-o", str(tmp_path / "y.png")]):
        assert _plot_status(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: plot: ") and err.count("\n") == 1, err
        assert "-o" in err
    assert snapshot(tmp_path) == before


BAD_RECORDS = {  # the raw line, and the field its message names
    "step 1e999": ('{"step": 1e999, "loss": 1.0}', "step"),
    "400-digit step": ('{"step": ' + "9" * 400 + ', "loss": 1.0}', "step"),
    "negative step": ('{"step": -1, "loss": 1.0}', "step"),
    "fractional step": ('{"step": 1.5, "loss": 1.0}', "step"),
    "string step": ('{"step": "2", "loss": 1.0}', "step"),
    "400-digit loss": ('{"step": 2, "loss": ' + "9" * 400 + '}', "loss"),
    "string loss": ('{"step": 2, "loss": "low"}', "loss"),
    "list lr": ('{"step": 2, "loss": 1.0, "lr": [1]}', "lr"),
}


@pytest.mark.parametrize("case", BAD_RECORDS)
def test_numbers_out_of_range_in_metrics_are_one_line_naming_file_line_and_field(
        tmp_path, capsys, case):
    line, field = BAD_RECORDS[case]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(record(1, 5.0)) + "\n" + line + "\n")
    out = tmp_path / "out.png"
    assert _plot_status(["losses", str(run), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: plot: ") and err.count("\n") == 1, err
    assert "metrics.jsonl, line 2" in err and repr(field) in err, err
    assert len(err) < 400 and not out.exists()


BAD_RESULTS = {  # a change to the first result, and the field its message names
    "string rate": (lambda r: r.update(rate="fast"), "rate"),
    "negative rate": (lambda r: r.update(rate=-5), "rate"),
    "infinite rate": (lambda r: r.update(rate=float("inf")), "rate"),
    "400-digit step time": (lambda r: r["train"][next(iter(r["train"]))].update(step_s=10**400),
                            "step_s"),
    "string all-to-all": (lambda r: r["a2a"].update(basp="0.1"), "a2a.basp"),
}


@pytest.mark.parametrize("case", BAD_RESULTS)
def test_numbers_out_of_range_in_results_are_one_line_naming_file_and_field(
        tmp_path, capsys, case):
    change, field = BAD_RESULTS[case]
    results = json.loads((ROOT / "bench" / "emulated_b2" / "results.json").read_text())
    change(results[0])
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))  # (writes inf as Infinity, which json reads back)
    out = tmp_path / "out.png"
    assert _plot_status(["bench", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: plot: ") and err.count("\n") == 1, err
    assert "results.json, result 0" in err and field in err, err
    assert len(err) < 400 and not out.exists()
