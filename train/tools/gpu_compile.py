"""Compile a config's real train step for a deviceless GPU cluster and report what it runs:
memory per device, attention kernels, collectives, FP8 GEMMs, the planner's prediction
(report); every candidate layout compiled and ranked (plan_compiled)."""

from __future__ import annotations

import dataclasses
import os
import sys

from .aot_errors import AotError, CompileFailed, compile_failure
from .cuda_plugin import gpu_devices
from .fit_advice import check_planned_fit, check_state_fits, would_fit

def compile_step(cfg, devices, devices_per_host: int, *, want_hlo: bool = False,
                 layout_index: int = 0) -> dict:
    """Compile the train step of `cfg` for `devices` and return the report (see `report`);
    under parallel.mode=adaptive, that of layout `layout_index` of the set."""
    import jax

    from basp_jax import cudnn_call
    from basp_jax.compiled import comm, hlo
    from basp_jax.grouped_matmul import EXPERTS_SCOPE

    from ..program.model_setup import fp8_enabled
    from ..program.planning import (hardware, host_memory_estimate, memory_estimate,
                                    predicted_step_s)
    from ..program.state import compile_program

    compiled, run_plan, mcfg, compile_s = compile_program(
        cfg, devices, devices_per_host, layout_index=layout_index, log=_to_stderr)
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    layout = run_plan.layout
    collectives = comm.parse_collectives(text, len(devices))
    return {
        # the planner's prediction, to set beside the compiled figure
        "formula_memory_bytes": memory_estimate(cfg, mcfg, layout, run_plan.strategy,
                                                remat=run_plan.remat,
                                                tile_tokens=run_plan.tile_tokens)[0],
        "remat": run_plan.remat, "tile_tokens": run_plan.tile_tokens,
        "offload_state": run_plan.offload_state,
        "model": {"type": mcfg.model_type, "params": mcfg.num_params(),
                  "num_layers": mcfg.num_layers},
        "layout": {"describe": layout.describe(), "mode": layout.mode, "groups": layout.groups,
                   "sp": layout.sp, "ring": layout.ring, "batch": layout.batch,
                   "seq_len": layout.seq_len, "devices_per_host": layout.devices_per_host},
        "param_sharding": run_plan.strategy,
        "grad_accum": cfg.train.grad_accum,
        "memory": {"argument_bytes": mem.argument_size_in_bytes,
                   "output_bytes": mem.output_size_in_bytes,
                   "alias_bytes": mem.alias_size_in_bytes,
                   "temp_bytes": mem.temp_size_in_bytes},
        # Live at once: the inputs, the scratch space, and outputs not written over donated inputs.
        "peak_bytes_per_device": (mem.argument_size_in_bytes + mem.temp_size_in_bytes
                                  + mem.output_size_in_bytes - mem.alias_size_in_bytes),
        # pinned host memory (an offload policy's residuals) and the copies to it and back
        "host_memory": {"argument_bytes": mem.host_argument_size_in_bytes,
                        "output_bytes": mem.host_output_size_in_bytes,
                        "alias_bytes": mem.host_alias_size_in_bytes,
                        "temp_bytes": mem.host_temp_size_in_bytes},
        "host_peak_bytes_per_device": (
            mem.host_argument_size_in_bytes + mem.host_temp_size_in_bytes
            + mem.host_output_size_in_bytes - mem.host_alias_size_in_bytes),
        "formula_host_memory_bytes": host_memory_estimate(cfg, mcfg, layout, run_plan.strategy,
                                                          remat=run_plan.remat),
        "host_transfers": comm.host_transfers(text),
        "attention_kernels": hlo.attention_kernels(text),
        # XLA's reason where it refused cuDNN attention (Pallas runs: train.program.compile_fallback)
        "cudnn_refused": cudnn_call.compile_refusal(),
        "ring_hop_kernels": hlo.ring_hop_kernels(text),  # which kernel each shape of hop runs
        "expert_kernels": hlo.expert_kernels(text),
        # model.fp8: the FP8 GEMMs the program runs per step (cuBLASLt calls and GEMM fusions)
        "fp8": fp8_enabled(cfg, devices[0]), "fp8_gemms": hlo.fp8_gemms(text),
        # the planner's step time for this layout (basp_jax.planner.cost.predict; FP8 FLOPs at the FP8 peak)
        "predicted_step_s": predicted_step_s(cfg, mcfg, run_plan),
        "predicted_from": hardware(cfg, run_plan.layout.devices_per_host).describe_compute(),
        # async collectives with compute between start and done: the latency-hiding scheduler's work
        "overlapped_collectives": hlo.overlapped_collectives(text),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        # of those, a mixture of experts' token exchanges (models.moe's scope)
        "expert_collectives": collective_rows(
            [c for c in collectives if EXPERTS_SCOPE in c.op_name], layout.devices_per_host,
            mcfg.num_layers, cfg.train.grad_accum),
        "collectives": collective_rows(collectives, layout.devices_per_host, mcfg.num_layers,
                                       cfg.train.grad_accum),
        # collectives in a loop whose trip count XLA left unrecorded, counted once above (e.g. a
        # microbatch loop XLA peeled and double-buffered)
        "collectives_in_unknown_loops": comm.in_unknown_loops(text),
        "compile_s": compile_s,
        "jax_version": jax.__version__,
        **({"hlo": text} if want_hlo else {}),
    }


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def report(cfg, target: str, hosts: int, gpus_per_host: int, *, want_hlo: bool = False) -> dict:
    """Compile `cfg` for `hosts` x `gpus_per_host` GPUs of `target`: the report as a dict."""
    import jax

    from basp_jax import LayoutError, cudnn_call, gpus

    # each report asks cuDNN afresh: a refusal for one config or target (--plan's candidates, a
    # worker compiling several) says nothing of the next, and the report says what it compiled
    cudnn_call.allow_again()
    from basp_jax.planner.hardware import HARDWARE
    from models import ModelError

    from ..config.schema import ConfigError, replace
    from ..prepare import check_fp8, check_kernel, with_compute_dtype

    gpu = gpus.get(target)
    devices = gpu_devices(target, hosts, gpus_per_host)
    cfg = with_compute_dtype(cfg, devices[0])  # model.dtype=auto: as this GPU would compute
    check_kernel(cfg, devices[0])  # a kernel this GPU cannot run: one line, before compiling
    check_fp8(cfg, devices[0])  # FP8 without FP8 tensor cores: likewise
    # the planner's choices (mode=auto, param_sharding=auto, remat=auto) for the target's memory
    cfg = replace(cfg, f"parallel.hardware={target}")
    from ..program.planning import resolve_offload
    from ..prepare import model_config

    try:
        cfg = resolve_offload(cfg, model_config(cfg), hosts * gpus_per_host, gpus_per_host)
        check_state_fits(cfg, model_config(cfg), target, hosts * gpus_per_host)
        check_planned_fit(cfg, model_config(cfg), target, hosts * gpus_per_host)
        r = compile_step(cfg, devices, gpus_per_host, want_hlo=want_hlo)
    except (jax.errors.JaxRuntimeError, NotImplementedError) as e:  # XLA's, cuDNN's refusals
        raise CompileFailed(compile_failure(e, target)) from None
    except (LayoutError, ModelError, ConfigError, AotError):
        raise  # their one line (bad input, or refused before compiling)
    except ValueError as e:  # a kernel's own check while tracing (basp_jax.kernels: one line)
        raise AotError(f"model.attn_impl={cfg.model.attn_impl}: {e}") from None
    usable = gpus.usable_memory_bytes(gpu)
    host_budget = HARDWARE[target].host_memory_bytes
    r["compute_dtype"] = cfg.model.dtype
    r.update({
        "host_budget_bytes": host_budget,
        "host_fits": r["host_peak_bytes_per_device"] <= host_budget,
        "target": {"name": gpu.name, "device_kind": gpu.device_kind},
        "hosts": hosts, "gpus_per_host": gpus_per_host,
        "device_memory_bytes": gpu.memory_bytes,
        "memory_fraction": gpus.memory_fraction(),
        "usable_memory_bytes": usable,
        "fits": r["peak_bytes_per_device"] <= usable and r["host_peak_bytes_per_device"] <= host_budget,
        "bf16": gpu.bf16,
    })
    if cfg.parallel.mode == "adaptive":  # every layout of the set, each compiled
        r["adaptive_layouts"] = [adaptive_row(r, usable, host_budget)] + [
            adaptive_row(compile_step(cfg, devices, gpus_per_host, layout_index=i), usable,
                         host_budget)
            for i in range(1, adaptive_set_size(cfg, hosts * gpus_per_host, gpus_per_host))]
        r["fits"] = all(row["fits"] for row in r["adaptive_layouts"])
    if not r["fits"]:
        r["would_fit"] = would_fit(cfg, r, hosts * gpus_per_host, gpus_per_host)
    return r


def adaptive_set_size(cfg, num_devices: int, devices_per_host: int) -> int:
    """How many layouts parallel.mode=adaptive compiles for this cluster (train.program.planning)."""
    from ..program.planning import adaptive_set, plan
    from ..prepare import model_config

    layout, strategy = plan(cfg, model_config(cfg), num_devices, devices_per_host)
    return len(adaptive_set(cfg, layout, strategy))


def adaptive_row(r: dict, usable: float, host_budget: float) -> dict:
    """One layout of an adaptive set: its split, peak memory, whether it fits, its all-to-alls
    (bytes per device, total and between hosts) and compile time."""
    lay = r["layout"]
    a2a = [c for c in r["collectives"] if c["kind"] == "all-to-all"]
    return {"groups": lay["groups"], "sp": lay["sp"], "ring": lay["ring"],
            "batch": lay["batch"], "seq_len": lay["seq_len"],
            "peak_bytes_per_device": r["peak_bytes_per_device"],
            "fits": r["peak_bytes_per_device"] <= usable
            and r["host_peak_bytes_per_device"] <= host_budget,
            "a2a_bytes": sum(c["bytes"] for c in a2a),
            "a2a_inter_host_bytes": sum(c["inter_host_wire_bytes"] for c in a2a),
            "compile_s": r["compile_s"]}


def plan_compiled(cfg, target: str, hosts: int, gpus_per_host: int) -> list[dict]:
    """Every layout the planner would consider for `cfg` on this cluster, each compiled: rows
    with the prediction (basp_jax.planner.cost) and the compiled report, fastest fitting first. On
    several hosts the candidates include host parameter sharding beside fsdp and hsdp; a
    parallel.param_sharding other than auto keeps the candidates of that strategy alone."""
    from basp_jax.planner import cost
    from basp_jax.planner.hardware import HARDWARE

    from ..config.schema import replace
    from ..prepare import model_config
    from ..program.planning import fp8_planned, memory_policy, precisions, resolve_offload

    devices = hosts * gpus_per_host
    cfg = replace(cfg, f"parallel.hardware={target}")
    mcfg = model_config(cfg)
    shape = mcfg.shape
    hw = dataclasses.replace(HARDWARE[target], devices_per_host=gpus_per_host)
    rows = []
    for layout, sharding in cost.candidates(shape, batch=cfg.train.microbatch_size,
                                            seq_len=cfg.data.seq_len, num_devices=devices,
                                            devices_per_host=gpus_per_host):
        if cfg.parallel.param_sharding not in ("auto", sharding):
            continue
        mode = ["parallel.mode=ulysses", "parallel.groups=null"] if layout.groups == 1 else \
            ["parallel.mode=basp", f"parallel.groups={layout.groups}"]
        variant = replace(cfg, *mode, f"parallel.ring={layout.ring}",
                          f"parallel.pad_heads={layout.pad_heads}",
                          f"parallel.param_sharding={sharding}")
        # optimizer.offload=auto and model.remat=auto decided per layout, as report() does
        variant = resolve_offload(variant, mcfg, devices, gpus_per_host)
        remat, tile = memory_policy(variant, mcfg, layout, sharding, gpus_per_host)
        pred = cost.predict(shape, layout, sharding, hw=hw, grad_accum=cfg.train.grad_accum,
                            remat=remat, tile_tokens=tile, fp8=fp8_planned(variant),
                            precisions=precisions(variant),
                            expert_parallel=cfg.model.expert_parallel,
                            offload_state=variant.optimizer.offload is True)
        r = report(variant, target, hosts, gpus_per_host)
        rows.append({"name": pred.name, "predicted_step_s": pred.step_s,
                     "formula_memory_bytes": pred.memory_bytes,
                     "predicted_inter_host_bytes": pred.params.inter + pred.all_to_all.inter,
                     "report": r})
    rows.sort(key=lambda row: (not row["report"]["fits"], row["predicted_step_s"]))
    return rows


def collective_rows(collectives, devices_per_host: int, num_layers: int, grad_accum: int) -> list:
    """Per (kind, dtype, group size): executions per step and per layer per microbatch, bytes
    per device. The group size is part of the key: a row merged over sizes would print one size
    beside bytes of another (the loss's 8-byte f32 sum over all devices beside a 250 MiB f32
    gradient all-reduce between two hosts read as a 250 MiB all-reduce over every device)."""
    from basp_jax.compiled import comm

    rows = {}
    for c in collectives:
        rows.setdefault((c.kind, c.dtype, c.group_size), []).append(c)
    out = []
    for kind in comm.KINDS:
        for (k, dtype, size), group in sorted(rows.items()):
            if k != kind:
                continue
            row = comm.summarize(group, devices_per_host)[kind]
            out.append({
                "kind": kind, "dtype": dtype, "count": int(row["count"]),
                "per_layer": row["count"] / (num_layers * grad_accum),
                "bytes": int(row["bytes"]), "wire_bytes": row["wire_bytes"],
                "inter_host_wire_bytes": row["inter_host_wire_bytes"],
                "group_size": size,
            })
    return out
