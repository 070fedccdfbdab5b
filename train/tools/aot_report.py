"""The text train.tools.aot prints: the compiled step's report and the compiled plan's table."""

from __future__ import annotations

GiB = 2**30


def format_report(r: dict) -> str:
    """The compiled step's report (train.tools.gpu_compile.report) as printed."""
    lines = _header(r) + [""] + _memory(r) + [""] + _kernels_and_prediction(r)
    lines += [""] + _collectives(r) + _adaptive(r)
    if not r["fits"]:
        lines += ["", f"does not fit: {r['peak_bytes_per_device'] / GiB:.2f} GiB per device of "
                  f"the {r['usable_memory_bytes'] / GiB:.2f} JAX may take on "
                  f"{r['target']['device_kind']}; would fit (the planner's estimate, not "
                  f"compiled): {r['would_fit']}"]
    return "\n".join(lines)


def _header(r: dict) -> list[str]:
    lay = r["layout"]
    return [
        f"{r['target']['device_kind']} x {r['hosts'] * r['gpus_per_host']} "
        f"({r['hosts']} host(s) x {r['gpus_per_host']}); {r['model']['type']} "
        f"{r['model']['params'] / 1e9:.2f}B params, {r['model']['num_layers']} layers; "
        f"compiled in {r['compile_s']:.1f}s with jax {r['jax_version']}",
        f"layout: {lay['describe']}; {r['param_sharding']} parameters; "
        f"{r['grad_accum']} microbatch(es) of {lay['batch']} x {lay['seq_len']} tokens; "
        f"remat {r['remat']}" + (f", tiles of {r['tile_tokens']} tokens" if r["tile_tokens"]
                                 else "") + f"; {r['compute_dtype']} compute"
        + (" with dynamic loss scaling" if r["compute_dtype"] == "float16" else "")
        + ("; master weights and optimizer state in host memory, streamed a layer at a time "
           "(optimizer.offload)" if r.get("offload_state") else ""),
    ]


def _memory(r: dict) -> list[str]:
    mem, usable = r["memory"], r["usable_memory_bytes"]
    lines = [
        "memory per device            GiB",
        f"  arguments           {mem['argument_bytes'] / GiB:>10.2f}",
        f"  outputs             {mem['output_bytes'] / GiB:>10.2f}   "
        f"(of which {mem['alias_bytes'] / GiB:.2f} reuse donated arguments)",
        f"  temporaries         {mem['temp_bytes'] / GiB:>10.2f}",
        f"  peak                {r['peak_bytes_per_device'] / GiB:>10.2f}   (planner's formula: "
        f"{r['formula_memory_bytes'] / GiB:.2f}) of "
        f"{r['device_memory_bytes'] / GiB:.2f} on the device; JAX may take {usable / GiB:.2f} "
        f"({r['memory_fraction']:.0%}): " + ("fits" if r["fits"] else "DOES NOT FIT"),
    ]
    if not r["bf16"] and r["compute_dtype"] == "bfloat16":
        lines.append(f"  model.dtype=bfloat16 on {r['target']['device_kind']}: no bf16 tensor "
                     "cores, XLA runs its bf16 matmuls in float32 (model.dtype=auto: float16)")
    if r["host_peak_bytes_per_device"] or r["formula_host_memory_bytes"]:
        t = r["host_transfers"]
        lines += [
            f"  pinned host         {r['host_peak_bytes_per_device'] / GiB:>10.2f}   (planner's "
            f"formula: {r['formula_host_memory_bytes'] / GiB:.2f}) of "
            f"{r['host_budget_bytes'] / GiB:.2f} per GPU on its host: "
            + ("fits" if r["host_fits"] else "DOES NOT FIT"),
            f"  host copies/step    {t['to_host_bytes'] / GiB:>10.2f} GiB to the host in "
            f"{t['to_host_count']}, {t['from_host_bytes'] / GiB:.2f} GiB back in "
            f"{t['from_host_count']}",
        ]
    return lines


def _kernels_and_prediction(r: dict) -> list[str]:
    kernels = r["attention_kernels"]
    if kernels:
        parts = [f"{kind} ({', '.join(v['targets']) or 'ops'}; {v['count']} per step)"
                 for kind, v in kernels.items()]
        lines = ["attention kernel: " + "; ".join(parts)]
    else:
        lines = ["attention kernel: none found"]
    if r.get("cudnn_refused"):  # train.program.compile_fallback
        lines.append(f"  (XLA could not compile cuDNN attention: {r['cudnn_refused']}; the step "
                     f"runs the Pallas kernel in its place)")
    hops = r.get("ring_hop_kernels")
    if hops:  # basp_jax.ring_hops: the queries' own piece, another piece, no causal mask
        names = {"diagonal": "diagonal", "off_diagonal": "off the diagonal",
                 "unmasked": "unmasked"}
        lines.append("ring hops, kernels per step: " + "; ".join(
            f"{names.get(shape, shape)}: " + ", ".join(f"{kind} {n}" for kind, n in kinds.items())
            for shape, kinds in hops.items()))
    experts = r.get("expert_kernels")
    if experts:  # a mixture of experts' grouped matmuls (basp_jax.grouped_matmul)
        lines.append("expert grouped matmuls: " + "; ".join(
            f"{kind} ({', '.join(v['targets'])}; {v['count']} per step)"
            for kind, v in experts.items()))
    if r.get("fp8") or r.get("fp8_gemms", {}).get("total"):
        from basp_jax.compiled.hlo import CUBLASLT_FP8

        g = r["fp8_gemms"]
        per_layer = g["total"] / (r["model"]["num_layers"] * r["grad_accum"])
        state = "on" if r.get("fp8") else "off"
        lines.append(f"FP8 GEMMs (model.fp8={state}): {g['total']} per step, {per_layer:g} per "
                     f"layer per microbatch ({g['cublaslt']} cuBLASLt {CUBLASLT_FP8}, "
                     f"{g['fusion']} GEMM fusions of FP8 operands)")
    if r.get("predicted_step_s") is not None:
        lines.append(f"predicted step: {r['predicted_step_s']:.3f} s (basp_jax.planner.cost, "
                     f"{r.get('predicted_from', 'at the peak and efficiency')})")
    overlap = r["overlapped_collectives"]
    pairs = sum(v["pairs"] for v in overlap.values())
    overlapped = sum(v["overlapped"] for v in overlap.values())
    lines.append(f"async collectives overlapping compute: {overlapped} of {pairs} in the program "
                 f"text (XLA flags: train.process.gpu_defaults and XLA_FLAGS)")
    return lines


def _collectives(r: dict) -> list[str]:
    lines = ["collectives per step, bytes per device:",
             f"  {'kind':<20}{'dtype':<7}{'group':>6}{'count':>7}{'/layer':>8}{'MiB':>11}"
             f"{'wire MiB':>11}{'inter-host MiB':>16}"]
    for c in r["collectives"]:
        lines.append(
            f"  {c['kind']:<20}{c['dtype']:<7}{c['group_size']:>6}{c['count']:>7}"
            f"{c['per_layer']:>8.2f}{c['bytes'] / 2**20:>11.1f}{c['wire_bytes'] / 2**20:>11.1f}"
            f"{c['inter_host_wire_bytes'] / 2**20:>16.1f}")
    if r.get("expert_collectives"):
        lines.append("  of which the experts' token exchanges (models.moe):")
        for c in r["expert_collectives"]:
            lines.append(
                f"  {c['kind']:<20}{c['dtype']:<7}{c['group_size']:>6}{c['count']:>7}"
                f"{c['per_layer']:>8.2f}{c['bytes'] / 2**20:>11.1f}"
                f"{c['wire_bytes'] / 2**20:>11.1f}{c['inter_host_wire_bytes'] / 2**20:>16.1f}")
    if r.get("collectives_in_unknown_loops"):
        lines.append(f"  note: {r['collectives_in_unknown_loops']} of these sit in a loop whose "
                     f"trip count XLA did not record, counted once: the step runs them more often")
    return lines


def _adaptive(r: dict) -> list[str]:
    if not r.get("adaptive_layouts"):
        return []
    lines = ["", "adaptive layouts (parallel.mode=adaptive), each compiled:",
             f"  {'groups x sp':<14}{'rows x tokens':>15}{'peak GiB':>10}{'fits':>6}"
             f"{'a2a MiB':>10}{'inter-host a2a MiB':>20}{'compile s':>11}"]
    for row in r["adaptive_layouts"]:
        name = f"{row['groups']}x{row['sp']}" + (f"/ring{row['ring']}" if row["ring"] > 1 else "")
        lines.append(f"  {name:<14}{row['batch']:>7} x {row['seq_len']:<6}"
                     f"{row['peak_bytes_per_device'] / GiB:>10.2f}"
                     f"{'yes' if row['fits'] else 'NO':>6}{row['a2a_bytes'] / 2**20:>10.1f}"
                     f"{row['a2a_inter_host_bytes'] / 2**20:>20.1f}{row['compile_s']:>11.1f}")
    return lines


def inter_host_bytes(report: dict) -> float:
    """Bytes one device sends to other hosts per step in a compiled report, every collective."""
    return sum(c["inter_host_wire_bytes"] for c in report["collectives"])


def format_plan(rows: list[dict]) -> str:
    lines = [f"{'layout':<40}{'step s':>8}{'formula GiB':>13}{'compiled GiB':>14}"
             f"{'inter-host MiB: planner':>25}{'compiled':>10}  fits"]
    for row in rows:
        r = row["report"]
        lines.append(f"{row['name']:<40}{row['predicted_step_s']:>8.3f}"
                     f"{row['formula_memory_bytes'] / GiB:>13.1f}"
                     f"{r['peak_bytes_per_device'] / GiB:>14.1f}"
                     f"{row['predicted_inter_host_bytes'] / 2**20:>25.1f}"
                     f"{inter_host_bytes(r) / 2**20:>10.1f}  {'yes' if r['fits'] else 'no'}")
    fitting = [row for row in rows if row["report"]["fits"]]
    lines.append("")
    lines.append(f"pick: {fitting[0]['name']} (fastest predicted step whose compiled memory fits)"
                 if fitting else "pick: none fits; lower data.seq_len or use more GPUs")
    return "\n".join(lines)
