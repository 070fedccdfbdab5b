"""The shipped GPU configs compiled for a GPU cluster without a GPU (train.tools.aot): memory per device,
attention kernel, collectives, compile time, for BASP and Ulysses with FSDP and HSDP parameters,
next to the planner's memory formula (basp_jax.planner.cost).

    python benchmarks/gpu_compile.py --target a100-40gb --hosts 2 --gpus-per-host 4 \\
        --out bench/gpu_compile/a100-40gb_2x4.json          # prints a Markdown table
    python benchmarks/gpu_compile.py ... --longest 8192   # longest seq_len that fits (BASP):
                                                          # 16384 doubled until it does not
    python benchmarks/gpu_compile.py --out FILE.json --table   # the table again, from FILE.json

Needs JAX's CUDA plugin (python -m train.tools.aot --install). Each compile of an 8B step takes a
minute or two on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from train.tools import cuda_plugin, gpu_compile  # noqa: E402

MODELS = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-3b", "qwen3-8b")
GiB, MiB = 2**30, 2**20


def case_config(model, mode, sharding, args, seq_len=None):
    from train.config.schema import load_config

    overrides = [f"parallel.mode={mode}", f"parallel.param_sharding={sharding}",
                 f"parallel.hardware={args.target}", f"parallel.devices_per_host={args.gpus_per_host}",
                 f"runtime.devices={args.hosts * args.gpus_per_host}"]
    if seq_len:
        overrides.append(f"data.seq_len={seq_len}")
    return load_config(str(ROOT / "configs" / "gpu" / f"{model}_basp.yaml"), overrides)


def compile_case(model, mode, sharding, args, seq_len=None):
    cfg = case_config(model, mode, sharding, args, seq_len)
    r = gpu_compile.report(cfg, args.target, args.hosts, args.gpus_per_host)
    layout = r["layout"]
    r["case"] = {"model": model, "mode": mode, "sharding": sharding, "seq_len": layout["seq_len"]}
    return r


def formula(r, args) -> float:
    """The planner's memory formula (train.program.planning.memory_estimate) for a stored report."""
    from basp_jax import Layout
    from train.loop import model_config
    from train.program.planning import memory_estimate

    c, lay = r["case"], r["layout"]
    cfg = case_config(c["model"], c["mode"], c["sharding"], args, c["seq_len"])
    mcfg = model_config(cfg)
    layout = Layout.plan(args.hosts * args.gpus_per_host, lay["batch"], lay["seq_len"],
                         mcfg.num_heads, mcfg.num_kv_heads, devices_per_host=args.gpus_per_host,
                         mode=c["mode"], ring=lay["ring"], pad_heads=True)
    return memory_estimate(cfg, mcfg, layout, c["sharding"])[0]


def row(r) -> str:
    c = r["case"]
    a2a = [x for x in r["collectives"] if x["kind"] == "all-to-all"]
    params = [x for x in r["collectives"] if x["kind"] in ("all-gather", "reduce-scatter",
                                                          "all-reduce")]
    a2a_per_layer = sum(x["per_layer"] for x in a2a)
    a2a_inter = sum(x["inter_host_wire_bytes"] for x in a2a)
    p_wire = sum(x["wire_bytes"] for x in params)
    p_inter = sum(x["inter_host_wire_bytes"] for x in params)
    kernel = ", ".join(r["attention_kernels"]) or "none"
    return (f"| {c['model']} | {c['mode']} ({r['layout']['groups']},{r['layout']['sp']}) | "
            f"{c['sharding']} | {r['peak_bytes_per_device'] / GiB:.1f} | "
            f"{r['formula_memory_bytes'] / GiB:.1f} | {'yes' if r['fits'] else 'no'} | {kernel} | "
            f"{a2a_per_layer:.0f} | {sum(x['wire_bytes'] for x in a2a) / MiB:,.0f} / "
            f"{a2a_inter / MiB:,.0f} | {(p_wire - p_inter) / MiB:,.0f} / {p_inter / MiB:,.0f} | "
            f"{r['compile_s']:.0f} |")


HEADER = ("| model | layout | params | peak GiB (compiled) | formula GiB | fits | attention kernel "
          "| a2a per layer | a2a wire MiB total / inter-host | param collectives MiB intra / "
          "inter-host | compile s |\n|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="a100-40gb")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--gpus-per-host", type=int, default=4)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--setups", default="basp:fsdp,basp:hsdp,ulysses:fsdp")
    p.add_argument("--longest", type=int, default=0,
                   help="find the longest seq_len (multiples of this) that fits, BASP + FSDP")
    p.add_argument("--out", required=True, help="JSON file of all reports (appended as they come)")
    p.add_argument("--table", action="store_true", help="print the table of --out; compile nothing")
    args = p.parse_args()
    if args.table:
        print(HEADER)
        for r in json.load(open(args.out)):
            r["formula_memory_bytes"] = formula(r, args)  # today's formula
            print(row(r))
        return 0
    cuda_plugin.use_plugin()
    results = json.load(open(args.out)) if os.path.exists(args.out) else []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save(r):
        results.append(r)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    print(HEADER, flush=True)
    for model in args.models.split(","):
        if args.longest:
            seq, last_fit = args.longest * 2, None
            while True:
                try:
                    r = compile_case(model, "basp", "fsdp", args, seq_len=seq)
                except Exception as e:  # noqa: BLE001 (XLA refuses what cannot fit)
                    print(f"| {model} | seq_len {seq}: does not compile: "
                          f"{' '.join(str(e).split())[:200]} |", flush=True)
                    break
                save(r)
                print(row(r), flush=True)
                if not r["fits"]:
                    break
                last_fit, seq = seq, seq * 2
            print(f"{model}: longest fitting seq_len found {last_fit}", flush=True)
            continue
        for setup in args.setups.split(","):
            mode, sharding = setup.split(":")
            r = compile_case(model, mode, sharding, args)
            save(r)
            print(row(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
