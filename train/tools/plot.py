"""Figures as PNG files: training curves of runs, the emulated-cluster benchmark, the two layouts.

    python -m train.tools.plot losses RUN_DIR [RUN_DIR ...] -o losses.png [--metric loss --metric grad_norm]
    python -m train.tools.plot bench bench/emulated_b2/results.json -o bench.png
    python -m train.tools.plot layouts --devices 8 --devices-per-host 4 --batch 2 -o layouts.png

`losses` draws any number metrics.jsonl holds (eval_loss: at the steps that evaluated) and labels
each run with the layouts it trained under, in order ("basp 2x4 -> ulysses 1x8" when resumed
under another).

Each command prints the path it wrote. Bad input (no metrics.jsonl, an empty one, an unknown metric,
a number out of its range in a metrics line or a result, an impossible layout, an -o that is one of
the inputs, symlinks resolved) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

from ..config import paths

try:
    import matplotlib
except ImportError:  # not a dependency of training itself: `--help` works, drawing says so
    matplotlib = None
else:
    matplotlib.use("Agg")  # files only: no display on clusters and in CI
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

NO_MATPLOTLIB = "train.tools.plot draws with matplotlib, which is not installed: pip install -e '.[plot]'"

# the numbers the trainer writes to metrics.jsonl (train.observe.report, train.observe.evaluate),
# checked in every line; another numeric field of the runs' lines plots too, under its own name
METRIC_LABELS = {
    "loss": "loss (nats/token)", "grad_norm": "gradient norm", "lr": "learning rate",
    "tokens_per_s": "tokens/s", "step_time_s": "step time (s)", "mfu": "MFU",
    "loss_tokens": "loss tokens per step", "loss_scale": "float16 loss scale",
    "eval_loss": "eval loss (nats/token)", "eval_perplexity": "eval perplexity",
    "eval_tokens": "eval tokens", "eval_time_s": "eval time (s)",
    "eval_compile_s": "eval compile (s)", "a2a_bytes": "all-to-all bytes per device",
    "a2a_inter_host_bytes": "inter-host all-to-all bytes per device",
}
METRICS = tuple(METRIC_LABELS)
LINESTYLES = ("-", "--", ":", "-.")


class PlotError(ValueError):
    """Input that cannot be drawn; the one-line message says which file and why."""


# --------------------------------------------------------------------------- training curves


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of run_dir/metrics.jsonl, one per step in step order.

    A resumed run logs the steps after its last checkpoint again: the last record of a step wins.
    Unreadable lines (a run killed mid-write) are skipped with a warning, as the trainer does; a
    readable line whose step or metric is out of range (a damaged or foreign file) is refused,
    naming its line and field.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path}: no such file; is {run_dir} a run directory (run.dir)?")
    by_step: dict[int, dict] = {}
    unreadable = 0
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as e:
        raise PlotError(f"{path}: {e.strerror.lower()}") from None
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:  # a line that is not UTF-8 JSON (a damaged or foreign file) counts as unreadable
            record = json.loads(raw.decode("utf-8"))
            step = record["step"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError,
                RecursionError):  # (nested thousands deep; digits past Python's int limit)
            unreadable += 1
            continue
        by_step[_checked_record(record, f"{path}, line {number}")] = record
    if not by_step:
        extra = f" ({unreadable} unreadable line(s))" if unreadable else ""
        raise PlotError(f"{path} holds no step records{extra}")
    if unreadable:
        print(f"warning: skipped {unreadable} unreadable line(s) in {path}", file=sys.stderr)
    return [by_step[step] for step in sorted(by_step)]


MAX_STEP = 2**31 - 1  # train.steps' largest value (train.config)


def _checked_record(record: dict, where: str) -> int:
    """The record's step, after checking it and the metrics drawn from it: a step is an integer
    in [0, MAX_STEP]; a metric is null, a number a float holds, or "nan"/"inf" (the trainer's
    non-finite values)."""
    step = record["step"]
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step != step \
            or not 0 <= step <= MAX_STEP or step != int(step):
        raise PlotError(f"{where}: field 'step' is {_shown(step)}, not a step number in "
                        f"[0, {MAX_STEP}]; is this a metrics.jsonl the trainer wrote?")
    for metric in METRICS:
        _check_metric(record, metric, where)
    return int(step)


def _check_metric(record: dict, metric: str, where: str) -> None:
    if not _is_metric(record.get(metric)):
        raise PlotError(f"{where}: field {metric!r} is {_shown(record[metric])}, not a number "
                        "(null, a float, or \"nan\"/\"inf\")")


def _is_metric(value) -> bool:
    """null, a number a float holds, or a string float() reads ("nan"/"inf")."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return False
    try:
        float(value)
    except (ValueError, OverflowError):
        return False
    return True


def _shown(value) -> str:
    """A value for a message, cut short (a 400-digit number stays readable)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


def _number(value) -> float:
    """A metric value as a float (_checked_record has checked it); null (e.g. mfu without a known
    peak) becomes a gap."""
    return math.nan if value is None else float(value)  # "nan"/"inf" strings included


def run_label(run_dir: str | Path, records: list[dict] | None = None) -> str:
    """The run directory's name, with the layouts it trained under in step order:
    "run (basp 2x4 -> ulysses 1x8)" for a run resumed under another layout."""
    if records is None:
        try:
            records = read_metrics(run_dir)
        except PlotError:
            records = []
    name = Path(run_dir).resolve().name
    history = layout_history(run_dir, records)
    return f"{name} ({' -> '.join(history)})" if history else name


def layout_history(run_dir: str | Path, records: list[dict]) -> list[str]:
    """The layouts of a run's steps in order, each once per stretch: from run_layout, which the
    first metrics.jsonl line of each trainer invocation holds; before the first such line (a run
    begun by a trainer that did not write it), the layouts in the kept checkpoints' metadata and
    collectives.json's (the last invocation's compiled step)."""
    marked = [(r["step"], r["run_layout"]) for r in records
              if isinstance(r.get("run_layout"), str)]
    first = marked[0][0] if marked else math.inf
    found = [layout for step, layout in _checkpoint_layouts(run_dir) if step < first]
    if not marked:
        found += _collectives_layout(run_dir)
    elif records[0]["step"] < first and not found:
        found = ["?"]  # steps whose layout nothing recorded
    found += [layout for _, layout in marked]
    return [layout for i, layout in enumerate(found) if i == 0 or layout != found[i - 1]]


def _checkpoint_layouts(run_dir: str | Path) -> list[tuple[int, str]]:
    """(step, layout) of each checkpoint in run_dir/checkpoints whose metadata names one."""
    directory = Path(run_dir) / "checkpoints"
    try:
        steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
    except OSError:
        return []
    found = []
    for step in steps:
        try:
            layout = json.loads((directory / str(step) / "meta" / "metadata").read_text())["layout"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue
        if isinstance(layout, str):
            found.append((step, short_layout(layout)))
    return found


def _collectives_layout(run_dir: str | Path) -> list[str]:
    try:
        layout = json.loads((Path(run_dir) / "collectives.json").read_text())["layout"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return []
    return [short_layout(str(layout))]


# basp_jax.layout.Layout.describe(): "basp: 2 group(s) x sp=4 (ring 2 x all-to-all 2) on ..."
_DESCRIBED = re.compile(r"(\w+): (\d+) group\(s\) x sp=(\d+)(?: \(ring (\d+) x)?")


def short_layout(described: str) -> str:
    """A Layout.describe() line as run_layout names the layout: "basp 2x4", "ulysses 1x8/ring2"."""
    match = _DESCRIBED.match(described)
    if match is None:
        return described.split(" on ")[0]
    mode, groups, sp, ring = match.groups()
    return f"{mode} {groups}x{sp}" + (f"/ring{ring}" if ring and int(ring) > 1 else "")


def _series(records: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """Steps and values of the records that hold `metric` (eval_loss: the steps that evaluated);
    null is a gap."""
    held = [r for r in records if metric in r]
    return [r["step"] for r in held], [_number(r[metric]) for r in held]


def _check_metrics(metrics: list[str], runs: list[tuple[str, list[dict]]]) -> None:
    """Each metric is one the trainer writes, or a field that holds numbers in the runs' lines
    (then every value of it is checked as read_metrics checks the trainer's)."""
    extra = {key for _, records in runs for r in records for key, value in r.items()
             if key not in METRICS and key != "step" and _is_metric(value)
             and not isinstance(value, str) and value is not None}
    for metric in metrics:
        if metric not in METRICS and metric not in extra:
            known = ", ".join([*METRICS, *sorted(extra)])
            raise PlotError(f"unknown metric {metric!r}; use one of {known}")
        if metric in extra:
            for run_dir, records in runs:
                for r in records:
                    if metric in r:
                        _check_metric(r, metric, f"{Path(run_dir) / 'metrics.jsonl'}, step "
                                                 f"{r['step']}")


def losses_figure(run_dirs: list[str], out: str | Path, metrics: list[str]) -> Path:
    """One panel per metric, one curve per run, against the optimizer step; a metric that some
    steps lack (eval_loss) is drawn through the steps that have it, with a marker on each."""
    runs = [(d, read_metrics(d)) for d in run_dirs]
    _check_metrics(metrics, runs)
    runs = [(run_label(d, records), records) for d, records in runs]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(7, 2.2 + 1.8 * len(metrics)), sharex=True,
                             squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics):
        for i, (label, records) in enumerate(runs):
            steps, values = _series(records, metric)
            if all(math.isnan(v) for v in values):
                raise PlotError(f"{label}: no values of {metric!r} in its metrics.jsonl")
            # runs that should agree (basp vs ulysses) overlap: dashes keep both visible
            ax.plot(steps, values, label=label, linestyle=LINESTYLES[i % 4],
                    marker="o" if len(steps) < len(records) else None, markersize=3)
        ax.set_ylabel(METRIC_LABELS.get(metric, metric))
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].legend()
    return _save(fig, out)


# --------------------------------------------------------------------------- benchmark


def rate_label(rate) -> str:
    """An emulated inter-host link rate in Mbit/s; None is the unthrottled link."""
    return "unthrottled" if rate is None else f"{rate:g} Mbit/s"


def bench_figure(results: list[dict], out: str | Path) -> Path:
    """Step time per setup and all-to-all time per mode against the inter-host link rate, from
    the results of benchmarks/emulated_cluster.py."""
    try:
        labels = [rate_label(r["rate"]) for r in results]
        setups = list(results[0]["train"])
        step_times = {name: [r["train"][name]["step_s"] for r in results] for name in setups}
        a2a_times = {mode: [r["a2a"][mode] for r in results] for mode in ("ulysses", "basp")}
    except (KeyError, IndexError, TypeError) as e:
        raise PlotError(f"not a results list of benchmarks/emulated_cluster.py (missing {e})") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    _rate_panel(left, labels, step_times, "median step time (s)", "training step, 2 hosts x 4 devices")
    _rate_panel(right, labels, a2a_times, "attention all-to-alls per step (s)", "all-to-alls alone")
    return _save(fig, out)


def _rate_panel(ax, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str):
    for name, times in series.items():
        ax.plot(labels, times, marker="o", label=name)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("inter-host link")
    ax.set_title(title)
    ax.legend()


def read_bench(path: str | Path) -> list[dict]:
    path = Path(path)
    try:
        results = json.loads(path.read_text())
    except OSError as e:
        raise PlotError(f"{path}: {e.strerror.lower()}") from None
    except UnicodeDecodeError:
        raise PlotError(f"{path}: not UTF-8 text, so not JSON") from None
    except json.JSONDecodeError as e:
        raise PlotError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    except RecursionError:
        raise PlotError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(results, list) or not results:
        raise PlotError(f"{path}: expected a non-empty list of results per link rate")
    for i, result in enumerate(results):
        _check_result(result, f"{path}, result {i}")
    return results


MAX_SECONDS = 1e9  # a time of a step or of its all-to-alls (decades: beyond any measurement)
MAX_RATE_MBIT = 1e9  # an emulated link rate in Mbit/s (a petabit link)


def _check_result(result, where: str) -> None:
    """The numbers bench_figure draws from one result of benchmarks/emulated_cluster.py: the
    link rate (null: unthrottled) and the times, each a number in its range. A missing key is
    bench_figure's to name."""
    if not isinstance(result, dict):
        raise PlotError(f"{where}: expected an object with 'rate', 'train' and 'a2a', got "
                        f"{_shown(result)}")
    if result.get("rate") is not None:
        _check_in_range(result["rate"], f"{where}: field 'rate'", 0, MAX_RATE_MBIT, "Mbit/s")
    train, a2a = result.get("train"), result.get("a2a")
    fields = [(f"train.{name}.step_s", setup.get("step_s"))
              for name, setup in (train.items() if isinstance(train, dict) else ())
              if isinstance(setup, dict)]
    fields += [(f"a2a.{mode}", value) for mode, value in (a2a.items() if isinstance(a2a, dict)
                                                           else ())]
    for field, value in fields:
        if value is not None:
            _check_in_range(value, f"{where}: field {field!r}", 0, MAX_SECONDS, "s")


def _check_in_range(value, what: str, low: float, high: float, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not low <= value <= high:  # (nan fails every comparison)
        raise PlotError(f"{what} is {_shown(value)}, not a number in [{low:g}, {high:g}] {unit}")


# --------------------------------------------------------------------------- layouts

DEVICE_W, HOST_GAP = 1.0, 0.5  # box pitch and the extra space between hosts, in device widths


def _device_x(device: int, devices_per_host: int) -> float:
    return device * DEVICE_W + (device // devices_per_host) * HOST_GAP


def _draw_layout(ax, layout) -> None:
    """Hosts as grey frames, devices as boxes coloured by group, one bar per all-to-all span."""
    colours = plt.get_cmap("tab10").colors
    per_host, sp = layout.devices_per_host, layout.sp
    for host in range(layout.num_hosts):
        first = host * per_host
        x0 = _device_x(first, per_host) - 0.15
        ax.add_patch(FancyBboxPatch((x0, -0.2), per_host * DEVICE_W + 0.1, 1.45,
                                    boxstyle="round,pad=0.02", facecolor="0.93", edgecolor="0.5"))
        ax.text(x0 + 0.05, 1.12, f"host {host}", fontsize=9, color="0.3", va="center")
    for device in range(layout.num_devices):
        group = device // sp  # make_mesh: each group is a run of sp consecutive host-major devices
        ax.add_patch(Rectangle((_device_x(device, per_host), 0), 0.8, 0.8,
                               facecolor=colours[group % len(colours)], edgecolor="black"))
        ax.text(_device_x(device, per_host) + 0.4, 0.4, f"d{device}", ha="center", va="center",
                color="white", fontsize=10, weight="bold")
    rows = layout.rows_per_group
    for group in range(layout.groups):
        first, last = group * sp, group * sp + sp - 1
        hosts = {first // per_host, last // per_host}
        x0, x1 = _device_x(first, per_host), _device_x(last, per_host) + 0.8
        crosses = len(hosts) > 1
        style = dict(color="crimson" if crosses else colours[group % len(colours)], lw=2.5)
        ax.plot([x0, x0, x1, x1], [-0.4, -0.5, -0.5, -0.4], **style)
        row_text = (f"sequence {group * rows}" if rows == 1
                    else f"sequences {group * rows}-{group * rows + rows - 1}")
        where = "crosses hosts" if crosses else "inside a host"
        ax.text((x0 + x1) / 2, -0.75, f"{row_text}: {sp}-way all-to-all, {where}", ha="center",
                va="top", fontsize=9, color=style["color"])
    name = "Ulysses" if layout.mode == "ulysses" else "BASP"
    ax.set_title(f"{name}: {layout.groups} group{'s' if layout.groups > 1 else ''} x sp={sp}")
    ax.set_xlim(-0.4, _device_x(layout.num_devices - 1, per_host) + 1.2)
    ax.set_ylim(-1.0, 1.45)
    ax.set_aspect("equal")
    ax.axis("off")


MAX_DRAWN_DEVICES = 128  # one box each: a wider figure is unreadable (and past 2**16 pixels)
MAX_BATCH = 1 << 20


def _check_drawable(devices: int, devices_per_host: int, batch: int) -> None:
    """The numbers of `layouts` in the ranges a figure can show, before any layout is planned."""
    boxes = "a figure draws one box per device"
    for flag, value, most, why in (("--devices", devices, MAX_DRAWN_DEVICES, boxes),
                                   ("--devices-per-host", devices_per_host, MAX_DRAWN_DEVICES,
                                    boxes),
                                   ("--batch", batch, MAX_BATCH, "rows of a microbatch")):
        if not 1 <= value <= most:
            raise PlotError(f"{flag} must lie in [1, {most:,}] ({why}), got {value:,}")


def layouts_figure(devices: int, devices_per_host: int, batch: int, out: str | Path) -> Path:
    """Ulysses (one group of all devices) and BASP (batch-many groups) side by side."""
    from basp_jax.layout import Layout, LayoutError

    _check_drawable(devices, devices_per_host, batch)
    try:
        # Only groups, sp and hosts are drawn; heads and tokens = devices always divide evenly.
        layouts = [Layout.plan(devices, batch, seq_len=devices, num_heads=devices,
                               devices_per_host=devices_per_host, mode=mode)
                   for mode in ("ulysses", "basp")]
    except LayoutError as e:
        raise PlotError(f"layout: {e}") from None
    width = _device_x(devices - 1, devices_per_host) + 1.6
    fig, axes = plt.subplots(1, 2, figsize=(max(2 * 0.75 * width, 8), 2.6))
    for ax, layout in zip(axes, layouts):
        _draw_layout(ax, layout)
    tokens = f"batch {batch}: each device holds 1/{devices} of the tokens in both layouts"
    fig.suptitle(f"{devices} devices, {devices_per_host} per host, {tokens}", fontsize=10)
    return _save(fig, out)


# --------------------------------------------------------------------------- command line


def _save(fig, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _inputs(args) -> list[tuple[str, str]]:
    """(what, path) of every file the command reads."""
    if args.command == "losses":
        return [(name, str(Path(d) / name)) for d in args.run_dirs
                for name in ("metrics.jsonl", "collectives.json")]
    if args.command == "bench":
        return [("RESULTS_JSON", args.results)]
    return []


def _check_output_apart(out: str, inputs: list[tuple[str, str]]) -> None:
    """-o is none of the inputs, symlinks resolved (a link named x.png to a run's metrics.jsonl
    would have the figure written over the metrics)."""
    try:
        paths.check_apart([("-o", out)], inputs, why={"-o": "the figure would replace it"})
    except paths.PathError as e:
        raise PlotError(str(e)) from None


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit status 2, like the rest of the project."""

    def error(self, message: str):
        self.exit(2, f"error: plot: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m train.tools.plot", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    losses = sub.add_parser("losses", help="curves from each run's metrics.jsonl")
    losses.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=os.path.expanduser)
    losses.add_argument("--metric", action="append", dest="metrics", metavar="NAME",
                        help=f"a numeric field of metrics.jsonl: {', '.join(METRICS)}, or "
                        "another the runs hold; repeat for more panels (default: loss)")
    bench = sub.add_parser("bench", help="the figure of benchmarks/emulated_cluster.py")
    bench.add_argument("results", metavar="RESULTS_JSON", type=os.path.expanduser)
    layouts = sub.add_parser("layouts", help="Ulysses and BASP device layouts side by side")
    layouts.add_argument("--devices", type=int, default=8)
    layouts.add_argument("--devices-per-host", type=int, default=4)
    layouts.add_argument("--batch", type=int, default=2, help="microbatch size B")
    for p in (losses, bench, layouts):
        p.add_argument("-o", "--out", required=True, type=os.path.expanduser,
                       help="PNG file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if matplotlib is None:
        print(f"error: plot: {NO_MATPLOTLIB}", file=sys.stderr)
        return 2
    try:
        if Path(args.out).suffix.lower() != ".png":
            raise PlotError(f"output {args.out}: expected a .png file name")
        _check_output_apart(args.out, _inputs(args))
        if args.command == "losses":
            out = losses_figure(args.run_dirs, args.out, args.metrics or ["loss"])
        elif args.command == "bench":
            out = bench_figure(read_bench(args.results), args.out)
        else:
            out = layouts_figure(args.devices, args.devices_per_host, args.batch, args.out)
    except PlotError as e:
        print(f"error: plot: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the output: a directory that cannot be created, no permission, no space
        where = e.filename or args.out
        print(f"error: plot: cannot write {where}: {(e.strerror or str(e)).lower()}",
              file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
