"""Measure BASP against Ulysses on an emulated two-node cluster (needs root; not part of the tests).

Two JAX processes x 4 CPU devices, each process in its own network namespace, joined by a veth
pair whose rate `tc tbf` limits: exchanges inside a process play NVLink, the veth plays the
inter-node network. At each link rate it runs

  1. the attention all-to-alls alone (benchmarks/a2a_worker.py), Ulysses (1,8) vs BASP (2,4);
  2. real training steps of the trainer (`train.py`, optimizer update and parameter sharding
     included) for ulysses+fsdp and basp with every parameter sharding (fsdp, hsdp, host,
     replicated), or the --setups named,

and writes a JSON of everything, a markdown table and a PNG plot into --out.

    sudo python benchmarks/emulated_cluster.py --rates none,400,160,80 --out bench/cluster

--docs longtail|full trains on synthetic documents whose lengths follow that distribution
(train.data.synthetic.DISTRIBUTIONS, data.documents) and adds the adaptive layouts
(parallel.mode=adaptive, setup "adaptive+SHARDING") to the setups: each step on the layout with
the most groups whose rows hold its documents. Layouts change from step to step there, so the
table compares mean step times (tokens per second) and lists the layouts each run took:

    sudo python benchmarks/emulated_cluster.py --docs longtail --batch 1 --seq-len 4096 \
        --rates 80 --out bench/adaptive_b1

A setup named with the suffix /fp8x runs with model.fp8_exchange=true (q, k, v through the
all-to-alls in FP8, basp_jax.fp8_exchange); next to the same setup without it, the report adds
its step time, inter-host all-to-all bytes and loss drift. --set KEY=VALUE overrides the
training config of every run (e.g. model.dtype=bfloat16):

    sudo python benchmarks/emulated_cluster.py --rates 80 --set model.dtype=bfloat16 \
        --steps 10 --repeats 3 --setups ulysses+host,ulysses+host/fp8x,basp+host,basp+host/fp8x \
        --out bench/emulated_fp8x
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from netns_cluster import Cluster, require_root  # noqa: E402

from train.tools.plot import bench_figure, rate_label  # noqa: E402  (one drawing for this and the CLI)

TRAIN_CONFIG = ROOT / "benchmarks" / "cluster_train.yaml"
SETUPS = [("ulysses", "fsdp"), ("basp", "fsdp"), ("basp", "hsdp"), ("basp", "host"),
          ("basp", "replicated")]


def _launch(cluster: Cluster, argv_for_host, timeout: float) -> list[str]:
    """Start one process per host, wait for all, return their outputs; fail loudly."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(cluster.command(h, argv_for_host(h)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
             for h in range(2)]
    outputs = []
    deadline = time.time() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise SystemExit(f"error: a worker ran past {timeout:.0f} s; see its output above")
        outputs.append(out)
        if proc.returncode:
            sys.stderr.write(out[-4000:])
            raise SystemExit(f"error: worker exited with {proc.returncode}")
    return outputs


def _port(i: int) -> str:
    return f"{cluster_address(0)}:{12400 + i}"


def cluster_address(host: int) -> str:
    return f"10.77.0.{host + 1}"


def time_all_to_alls(cluster: Cluster, args, run_index: int) -> dict:
    def argv(host):
        return [sys.executable, "benchmarks/a2a_worker.py", "--coordinator", _port(run_index),
                "--process-id", str(host), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
                "--layers", str(args.layers), "--heads", str(args.heads),
                "--kv-heads", str(args.kv_heads or args.heads),
                "--head-dim", str(args.hidden // args.heads)]

    out = _launch(cluster, argv, timeout=args.timeout)[0]
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {row["mode"]: row["a2a_s"] for row in rows}


# the layouts a setup may name: Layout modes and the trainer's adaptive choice
SETUP_MODES = ("ulysses", "basp", "adaptive")
FP8_EXCHANGE = "/fp8x"  # a setup's suffix: model.fp8_exchange=true
DOC_SETUPS = {1: "ulysses+host,ulysses@ring2+host,adaptive+host,adaptive@ring2+host",
              2: "ulysses+host,basp+host,basp+hsdp,adaptive+host"}  # --docs defaults by --batch


def parse_setup(name: str) -> tuple[str, int, str]:
    """'ulysses+fsdp' -> ('ulysses', 1, 'fsdp'); 'ulysses@ring2+host' -> ('ulysses', 2, 'host'):
    the mode, its ring split (parallel.ring) and the parameter sharding (a /fp8x suffix is
    setup_overrides')."""
    mode, _, sharding = name.removesuffix(FP8_EXCHANGE).partition("+")
    mode, _, ring = mode.partition("@ring")
    return mode, int(ring or 1), sharding


def setup_overrides(name: str) -> list[str]:
    """The config overrides a setup's suffix asks for."""
    return ["model.fp8_exchange=true"] if name.endswith(FP8_EXCHANGE) else []


def train_steps(cluster: Cluster, args, run_index: int, setup: str, run_dir: Path) -> dict:
    mode, ring, sharding = parse_setup(setup)
    overrides = [
        f"run.dir={run_dir}", f"parallel.mode={mode}", f"parallel.param_sharding={sharding}",
        f"parallel.ring={ring}",
        f"train.steps={args.steps}", f"train.microbatch_size={args.batch}",
        f"data.seq_len={args.seq_len}", f"model.shape.num_layers={args.layers}",
        f"model.shape.hidden_size={args.hidden}", f"model.shape.intermediate_size={4 * args.hidden}",
        f"model.shape.num_heads={args.heads}",
        f"model.shape.num_kv_heads={args.kv_heads or args.heads}",
        f"model.shape.head_dim={args.hidden // args.heads}",
        "model.scan_layers=false",  # unrolled: collectives.json then counts every layer's traffic
        *(["data.pack=true", f"data.documents={args.docs}"] if args.docs else []),
        f"runtime.distributed.coordinator={_port(run_index)}", "runtime.distributed.num_processes=2",
        *args.set, *setup_overrides(setup),
    ]

    def argv(host):
        return [sys.executable, "train.py", "--config", str(TRAIN_CONFIG), *overrides,
                f"runtime.distributed.process_id={host}"]

    _launch(cluster, argv, timeout=args.timeout)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r["step_time_s"] for r in records[args.warmup:]]
    result = {"step_s": statistics.median(timed), "mean_step_s": statistics.mean(timed),
              "step_times": timed, "losses": [r["loss"] for r in records]}
    if "layout" in records[0]:  # adaptive: the layout of every step (warm-up ones included)
        result["layouts"] = [r["layout"] for r in records]
    comm_file = run_dir / "collectives.json"
    if comm_file.exists():
        result["collectives"] = json.loads(comm_file.read_text())
    return result


def _merge_repeat(before: dict | None, run: dict) -> dict:
    """A setup's results over --repeats runs: the medians and means over all their timed steps,
    each run's median (repeat_step_s), the first run's losses and collectives (the runs compute
    the same steps)."""
    if before is None:
        return {**run, "repeat_step_s": [run["step_s"]]}
    timed = before["step_times"] + run["step_times"]
    return {**before, "step_times": timed, "step_s": statistics.median(timed),
            "mean_step_s": statistics.mean(timed),
            "repeat_step_s": before["repeat_step_s"] + [run["step_s"]]}


def planner_view(args, name: str, rate: float | None) -> dict:
    """What the planner (basp_jax.planner.cost.predict) says of one setup on this emulated link: its
    inter-host bytes per device per step and the seconds they take at `rate` Mbit/s shared by
    a host's 4 devices (compute and in-host copies left out: they are the same for every
    setup of one batch and sequence length, and the planner knows no CPU's speed)."""
    import dataclasses

    import models
    from basp_jax import Layout
    from basp_jax.planner import cost
    from basp_jax.planner.hardware import Hardware
    from basp_jax.planner.precisions import Precisions

    mode, ring, sharding = parse_setup(name)
    if mode == "adaptive" or setup_overrides(name):
        return None  # adaptive: its layouts change per step (the planner's --docs line predicts
        # it); the planner counts no FP8 exchange
    mcfg = dataclasses.replace(
        models.ModelConfig.preset("tiny"), num_layers=args.layers, hidden_size=args.hidden,
        intermediate_size=4 * args.hidden, num_heads=args.heads,
        num_kv_heads=args.kv_heads or args.heads, head_dim=args.hidden // args.heads)
    layout = Layout.plan(8, args.batch, args.seq_len, mcfg.num_heads, mcfg.num_kv_heads,
                         devices_per_host=4, mode=mode, ring=ring, zigzag=ring > 1)
    link = (rate or 10_000) * 1e6 / 8 / 4  # bytes/s per device ('none': ~10 Gbit/s veth)
    hw = Hardware("emulated 2 x 4 CPU devices", 1e12, intra_bw=1e12, inter_bw=link,
                  devices_per_host=4)
    pred = cost.predict(mcfg.shape, layout, sharding, hw=hw,
                        precisions=Precisions(act=4, param=4))  # float32
    inter = pred.all_to_all.inter + pred.params.inter
    return {"inter_host_bytes": inter, "inter_host_s": inter / link}


def docs_report(results: list[dict]) -> list[str]:
    """--docs: every setup's mean step time against the baseline (the first setup) and against
    the fastest static one, and the layouts the adaptive runs took."""
    setups = list(results[0]["train"])
    lines = ["", f"Documents: {results[0]['docs']} ({results[0]['distribution']}); mean step time "
             "over the timed steps (layouts change per step); all setups train on the same "
             "documents:", "",
             "| link | setup | mean step (s) | median step (s) | vs first setup | vs fastest static "
             "| layouts run (all steps) | losses equal to the first |", "|---" * 8 + "|"]
    for r in results:
        runs = r["train"]
        base = runs[setups[0]]
        static = [n for n in setups if parse_setup(n)[0] != "adaptive"]
        best = min(static, key=lambda n: runs[n]["mean_step_s"])
        for name in setups:
            x = runs[name]
            layouts = x.get("layouts")
            shares = ", ".join(f"{k} {layouts.count(k)}" for k in sorted(set(layouts),
                                                                         key=layouts.index)) \
                if layouts else "static"
            same = max(abs(a - b) for a, b in zip(base["losses"], x["losses"])) < 1e-4
            lines.append(f"| {rate_label(r['rate'])} | {name} | {x['mean_step_s']:.2f} "
                         f"| {x['step_s']:.2f} | {base['mean_step_s'] / x['mean_step_s']:.2f}x "
                         f"| {runs[best]['mean_step_s'] / x['mean_step_s']:.2f}x ({best}) "
                         f"| {shares} | {'yes' if same else 'NO'} |")
    return lines


def _a2a_inter_mib(run: dict) -> float:
    per_kind = run.get("collectives", {}).get("per_kind", {})
    return per_kind.get("all-to-all", {}).get("inter_host_wire_bytes", 0.0) / 2**20


def _runs(run: dict) -> str:
    return ", ".join(f"{t:.2f}" for t in run.get("repeat_step_s", [run["step_s"]]))


def fp8_exchange_report(results: list[dict]) -> list[str]:
    """Each /fp8x setup against the same setup without it: step time, inter-host all-to-all
    bytes (compiled program), and how far its losses drift from the other's."""
    setups = list(results[0]["train"])
    pairs = [(n.removesuffix(FP8_EXCHANGE), n) for n in setups
             if n.endswith(FP8_EXCHANGE) and n.removesuffix(FP8_EXCHANGE) in setups]
    if not pairs:
        return []
    lines = ["", "FP8 exchanges (model.fp8_exchange): each setup with and without; loss drift: "
             "|loss_fp8x - loss| / loss at the last step and at most over all steps:", "",
             "| link | setup | median step (s) | with fp8x (s) | speedup | medians of each run "
             "(s) | inter-host a2a MiB | with fp8x | last loss | with fp8x | drift last "
             "| drift max |", "|---" * 12 + "|"]
    for r in results:
        for base, fp8x in pairs:
            a, b = r["train"][base], r["train"][fp8x]
            drift = [abs(y - x) / abs(x) for x, y in zip(a["losses"], b["losses"])]
            lines.append(
                f"| {rate_label(r['rate'])} | {base} | {a['step_s']:.2f} | {b['step_s']:.2f} "
                f"| {a['step_s'] / b['step_s']:.2f}x | {_runs(a)} / {_runs(b)} "
                f"| {_a2a_inter_mib(a):.2f} "
                f"| {_a2a_inter_mib(b):.2f} | {a['losses'][-1]:.4f} | {b['losses'][-1]:.4f} "
                f"| {drift[-1]:.2%} | {max(drift):.2%} |")
    return lines


def write_report(results: list[dict], out: Path) -> str:
    setups = list(results[0]["train"])  # "mode+sharding", the first is the baseline
    head = [f"step {name} (s)" for name in setups] + [f"speedup {name}" for name in setups[1:]]
    lines = ["| link | " + " | ".join(head) + " | a2a ulysses (s) | a2a basp (s) | a2a ratio "
             "| a2a share of ulysses step | losses equal |",
             "|---" * (len(head) + 6) + "|"]
    for r in results:
        runs = [r["train"][name] for name in setups]
        base = runs[0]
        a2a_u, a2a_b = r["a2a"]["ulysses"], r["a2a"]["basp"]
        same = all(max(abs(a - b) for a, b in zip(base["losses"], x["losses"])) < 1e-4
                   for name, x in zip(setups[1:], runs[1:]) if not setup_overrides(name))
        cells = [f"{x['step_s']:.2f}" for x in runs] + [f"{base['step_s'] / x['step_s']:.2f}x" for x in runs[1:]]
        lines.append(
            f"| {rate_label(r['rate'])} | " + " | ".join(cells)
            + f" | {a2a_u:.3f} | {a2a_b:.3f} | {a2a_u / a2a_b:.1f}x | {a2a_u / base['step_s']:.0%} "
            f"| {'yes' if same else 'NO'} |"
        )
    lines += ["", "Inter-host wire MiB per device per step, from the compiled program (all-to-all / "
              "parameter gathers / gradient reductions):", "",
              "| setup | all-to-all | all-gather | all-reduce + reduce-scatter | ring hops |",
              "|---|---|---|---|---|"]
    for name in setups:
        per_kind = results[0]["train"][name].get("collectives", {}).get("per_kind", {})

        def mib(*kinds):
            return sum(per_kind.get(k, {}).get("inter_host_wire_bytes", 0.0) for k in kinds) / 2**20

        lines.append(f"| {name} | {mib('all-to-all'):.2f} | {mib('all-gather'):.2f} "
                     f"| {mib('all-reduce', 'reduce-scatter'):.2f} "
                     f"| {mib('collective-permute'):.2f} |")
    lines += ["", "The planner's view (basp_jax.planner.cost.predict at each link rate: inter-host MiB per device "
              "per step and the seconds they take; its ranking against the measured one):", "",
              "| link | setup | measured step (s) | predicted inter-host MiB | predicted inter-host s "
              "| measured rank | predicted rank |", "|---|---|---|---|---|---|---|"]
    for r in results:
        views = r.get("planner", {})
        measured = sorted(setups, key=lambda n: r["train"][n]["step_s"])
        predicted = sorted(setups, key=lambda n: views.get(n, {}).get("inter_host_s", 0.0))
        for name in setups:
            view = views.get(name)
            if view is None:
                continue
            lines.append(f"| {rate_label(r['rate'])} | {name} | {r['train'][name]['step_s']:.2f} "
                         f"| {view['inter_host_bytes'] / 2**20:.2f} | {view['inter_host_s']:.2f} "
                         f"| {measured.index(name) + 1} | {predicted.index(name) + 1} |")
    if results[0].get("docs"):
        lines += docs_report(results)
    lines += fp8_exchange_report(results)
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="none,400,160,80",
                        help="comma-separated link rates in Mbit/s; 'none' = unthrottled")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="key/value heads (grouped-query attention; default: --heads)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the setups this many times in turn (a shared machine's load "
                             "drifts): medians over all their timed steps")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", default="bench/emulated_cluster")
    parser.add_argument("--setups", default=None,
                        help="comma-separated mode+sharding to time (mode@ringR+sharding: "
                             "parallel.ring=R, e.g. ulysses@ring2+host; mode adaptive: "
                             "parallel.mode=adaptive; suffix /fp8x: model.fp8_exchange=true); "
                             "the first is the baseline. Default: "
                             f"{','.join(f'{m}+{s}' for m, s in SETUPS)}; with --docs, by "
                             f"--batch: {DOC_SETUPS}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a training config override for every run (repeatable), e.g. "
                             "model.dtype=bfloat16")
    parser.add_argument("--docs", choices=("longtail", "full"), default=None,
                        help="train on synthetic documents of this length distribution "
                             "(data.documents; train.data.synthetic.DISTRIBUTIONS)")
    args = parser.parse_args()
    if args.setups is None:
        args.setups = DOC_SETUPS.get(args.batch, DOC_SETUPS[2]) if args.docs else \
            ",".join(f"{m}+{s}" for m, s in SETUPS)
    names = [name.strip() for name in args.setups.split(",")]
    from basp_jax.sharding import PARAM_SHARDINGS  # (imports JAX: only once the flags are read)

    unknown = [name for name in names if parse_setup(name)[0] not in SETUP_MODES
               or parse_setup(name)[2] not in PARAM_SHARDINGS]
    if unknown:
        parser.error(f"unknown setup(s) {', '.join(unknown)}; use MODE[@ringR]+SHARDING with MODE "
                     f"one of {', '.join(SETUP_MODES)} and SHARDING one of "
                     f"{', '.join(PARAM_SHARDINGS)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if any(parse_setup(n)[0] == "adaptive" for n in names) and not args.docs:
        parser.error("an adaptive setup needs documents to repack: add --docs longtail or full")
    require_root()
    rates = [None if r.strip().lower() == "none" else float(r) for r in args.rates.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with Cluster() as cluster, tempfile.TemporaryDirectory() as tmp:
        run_index = 0
        for rate in rates:
            cluster.set_rate(rate)
            entry = {"rate": rate, "batch": args.batch, "seq_len": args.seq_len,
                     "a2a": time_all_to_alls(cluster, args, run_index), "train": {},
                     "planner": {name: view for name in names
                                 if (view := planner_view(args, name, rate)) is not None}}
            if args.docs:
                from train.data.synthetic import DISTRIBUTIONS

                params = DISTRIBUTIONS[args.docs]
                entry["docs"] = args.docs
                entry["distribution"] = ("one document of seq_len + 1 tokens per row"
                                         if params is None else
                                         f"lognormal(mu={params[0]}, sigma={params[1]}) + 2 "
                                         "tokens per document, packed into rows in draw order")
            run_index += 1
            for repeat in range(args.repeats):  # the setups in turn, so slow drifts hit all
                for name in names:
                    run_dir = Path(tmp) / f"{rate}-{name}-{repeat}"
                    run = train_steps(cluster, args, run_index, name, run_dir)
                    run_index += 1
                    print(f"{rate_label(rate)} {name}: {run['step_s']:.2f} s/step "
                          f"(mean {run['mean_step_s']:.2f})", flush=True)
                    entry["train"][name] = _merge_repeat(entry["train"].get(name), run)
            results.append(entry)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    print(write_report(results, out))
    bench_figure(results, out / "emulated_cluster.png")
    print(f"\nwrote {out}/results.json, table.md, emulated_cluster.png")


if __name__ == "__main__":
    main()
