"""The longest sequences: Llama-3.1-8B's train step compiled without a GPU (train.tools.aot) for 1 to
64 H100-80GB and 8 A100-40GB, with today's long-context settings (configs/gpu/llama-3.1-8b_long.yaml:
offloaded layer inputs, tiled layers) beside the 16K config's (remat=full, nothing tiled): device
and pinned host memory per GPU against what they may take, host copies per step, all-to-alls per
layer and between hosts, and the planner's step time.

    python benchmarks/long_context.py --out bench/long_context/results.json   # prints the table
    python benchmarks/long_context.py --out bench/long_context/results.json --table
    # --table: the compiled figures as recorded, the planner's recomputed with today's formulas

Needs JAX's CUDA plugin (python -m train.tools.aot --install); an 8B compile takes 0.5-2 minutes on
2 cores. What a deviceless compile cannot show: whether the copies to the host overlap compute,
the real PCIe time, and the step time itself (the planner's is a prediction).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from train.tools import cuda_plugin, gpu_compile  # noqa: E402

GiB = 2**30
LONG = "configs/gpu/llama-3.1-8b_long.yaml"
SHORT = ["model.remat=full", "model.tile_tokens=null"]  # the 16K config's memory settings

# (name, target, hosts, gpus per host, overrides): B=1, and one sequence per host
CASES = [
    # optimizer.offload=auto (configs/gpu/_base.yaml): the state in host memory (train.program.streamed)
    # only where nothing else fits; the "state on device" / "streamed" rows force it
    ("1xH100 B=1 512K", "h100-80gb", 1, 1, ["data.seq_len=524288"]),
    ("1xH100 B=1 512K (state on device)", "h100-80gb", 1, 1,
     ["data.seq_len=524288", "optimizer.offload=false"]),
    ("1xH100 B=1 1M", "h100-80gb", 1, 1, ["data.seq_len=1048576"]),
    ("8xH100 B=1 4M", "h100-80gb", 1, 8, []),
    ("8xH100 B=1 4M (streamed)", "h100-80gb", 1, 8, ["optimizer.offload=true"]),
    ("8xH100 B=1 8M", "h100-80gb", 1, 8, ["data.seq_len=8388608"]),
    ("8xH100 B=1 512K (16K settings)", "h100-80gb", 1, 8, ["data.seq_len=524288", *SHORT]),
    ("32xH100 B=4 4M", "h100-80gb", 4, 8, ["train.microbatch_size=4"]),
    ("32xH100 B=1 16M", "h100-80gb", 4, 8, ["data.seq_len=16777216"]),
    ("32xH100 B=1 16M ring=4", "h100-80gb", 4, 8, ["data.seq_len=16777216", "parallel.ring=4"]),
    ("64xH100 B=8 4M", "h100-80gb", 8, 8, ["train.microbatch_size=8"]),
    ("64xH100 B=1 32M", "h100-80gb", 8, 8, ["data.seq_len=33554432", "parallel.mode=auto"]),
    ("64xH100 B=1 32M ulysses", "h100-80gb", 8, 8, ["data.seq_len=33554432",
                                                    "parallel.mode=ulysses", "parallel.pad_heads=true"]),
    ("8xA100-40GB B=1 1M", "a100-40gb", 2, 4, ["data.seq_len=1048576"]),
    ("8xA100-40GB B=2 512K", "a100-40gb", 2, 4, ["data.seq_len=524288", "train.microbatch_size=2"]),
]


def _config(target, hosts, per_host, overrides):
    from train.config.schema import load_config

    return load_config(str(ROOT / LONG), [
        f"parallel.hardware={target}", f"parallel.devices_per_host={per_host}",
        f"runtime.devices={hosts * per_host}", *overrides])


def planner_figures(target, hosts, per_host, overrides, offload_state: bool) -> dict:
    """The planner's device and host memory and step time for a case, as the step compiled
    (optimizer.offload=auto resolved to `offload_state`): cheap, so --table recomputes them
    with today's formulas."""
    from basp_jax.planner import cost
    from basp_jax.planner.hardware import HARDWARE
    from train.config.schema import replace
    from train.program.planning import (host_memory_estimate, memory_estimate, memory_policy,
                                        model_shape, plan, precisions)
    from train.prepare import model_config

    cfg = replace(_config(target, hosts, per_host, overrides),
                  f"optimizer.offload={str(offload_state).lower()}")
    mcfg = model_config(cfg)
    layout, strategy = plan(cfg, mcfg, hosts * per_host, per_host)
    remat, tile = memory_policy(cfg, mcfg, layout, strategy, per_host)
    pred = cost.predict(model_shape(mcfg), layout, strategy, hw=HARDWARE[target],
                        remat=remat, tile_tokens=tile, precisions=precisions(cfg),
                        offload_state=cfg.optimizer.offload is True)
    return {"formula_memory_bytes": memory_estimate(cfg, mcfg, layout, strategy, remat=remat,
                                                    tile_tokens=tile)[0],
            "formula_host_memory_bytes": host_memory_estimate(cfg, mcfg, layout, strategy,
                                                              remat=remat),
            "predicted_step_s": pred.step_s, "predicted_host_s": pred.host_s}


def compile_case(name, target, hosts, per_host, overrides):
    r = gpu_compile.report(_config(target, hosts, per_host, overrides), target, hosts, per_host)
    a2a = [c for c in r["collectives"] if c["kind"] == "all-to-all"]
    return {"name": name, "remat": r["remat"], "tile_tokens": r["tile_tokens"],
            "offload_state": r["offload_state"],
            "a2a_per_layer": sum(c["per_layer"] for c in a2a),
            "a2a_inter_host_bytes": sum(c["inter_host_wire_bytes"] for c in a2a),
            **{k: r[k] for k in ("layout", "peak_bytes_per_device", "usable_memory_bytes",
                                 "host_peak_bytes_per_device", "host_budget_bytes",
                                 "host_transfers", "fits", "compile_s")},
            **planner_figures(target, hosts, per_host, overrides, r["offload_state"])}


def refresh(rows) -> list:
    """rows with the planner's figures recomputed by today's formulas (no compile)."""
    cases = {case[0]: case[1:] for case in CASES}
    return [{**r, **planner_figures(*cases[r["name"]], r.get("offload_state", False))}
            if r["name"] in cases else r for r in rows]


def table(rows) -> str:
    lines = ["| case | tokens/GPU | remat, tile | state in | device GiB (formula) / may take | "
             "host GiB (formula) / budget | host copies/step | a2a/layer, inter-host | "
             "predicted step | fits |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lay, t = r["layout"], r["host_transfers"]
        per_gpu = lay["batch"] * lay["seq_len"] // (lay["groups"] * lay["sp"])
        lines.append(
            f"| {r['name']} | {per_gpu:,} | {r['remat']}, {r['tile_tokens']} | "
            f"{'host' if r.get('offload_state') else 'device'} | "
            f"{r['peak_bytes_per_device'] / GiB:.1f} ({r['formula_memory_bytes'] / GiB:.1f}) / "
            f"{r['usable_memory_bytes'] / GiB:.1f} | {r['host_peak_bytes_per_device'] / GiB:.0f} "
            f"({r['formula_host_memory_bytes'] / GiB:.0f}) / {r['host_budget_bytes'] / GiB:.0f} | "
            f"{t['to_host_bytes'] / GiB:.0f} + {t['from_host_bytes'] / GiB:.0f} GiB | "
            f"{r['a2a_per_layer']:.0f}, {r['a2a_inter_host_bytes'] / GiB:.1f} GiB | "
            f"{r['predicted_step_s']:,.0f} s | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--table", action="store_true", help="print the table of --out again")
    p.add_argument("--only", help="comma-separated case names (default: all)")
    args = p.parse_args()
    out = Path(args.out)
    if args.table:  # the compiled figures as recorded, the planner's recomputed
        print(table(refresh(json.loads(out.read_text()))))
        return
    cuda_plugin.use_plugin()
    wanted = set(args.only.split(",")) if args.only else None
    unknown = (wanted or set()) - {case[0] for case in CASES}
    if unknown:
        p.error(f"unknown case(s) {', '.join(sorted(unknown))}; the cases: "
                + "; ".join(case[0] for case in CASES))
    # --only replaces those cases' rows of an existing --out and keeps the others
    rows = json.loads(out.read_text()) if wanted and out.exists() else []
    order = [case[0] for case in CASES]
    for case in CASES:
        if wanted and case[0] not in wanted:
            continue
        row = compile_case(*case)
        rows = sorted([r for r in rows if r["name"] != case[0]] + [row],
                      key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
        print(f"{case[0]}: {row['peak_bytes_per_device'] / GiB:.2f} GiB, "
              f"{row['compile_s']:.0f} s", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
