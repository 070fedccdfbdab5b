"""Compile a config's real train step for a GPU cluster, on any machine, and report what it runs.

No GPU is needed; the report gives what the GPUs would run: memory per device, attention
kernels, collectives, compile time.

    python -m train.tools.aot --config configs/gpu/llama-3.1-8b_basp.yaml --target a100-40gb \\
        --hosts 2 --gpus-per-host 4 [key.sub=value ...] [--json OUT.json] [--hlo OUT.hlo]
    python -m train.tools.aot --config ... --plan   # every candidate layout compiled, ranked
    python -m train.tools.aot --install      # once: the CUDA compiler plugin (about 1.5 GB)
    python -m train.tools.aot --install-if-supported   # the same where JAX ships it, when missing

The step is built by the trainer's own code (train.program.state: layout, model, optimizer, shardings)
from shapes alone: no weights, no data and nothing under run.dir are read or written. XLA compiles
it through JAX's CUDA plugin for a deviceless topology of `hosts x gpus-per-host` GPUs described by
basp_jax.gpus. The plugin is either installed in this environment (jax[cuda12] or jax[cuda13] on
a GPU host) or installed by --install into a folder beside this environment, which only this
command puts on its path (so `import jax` elsewhere stays quiet on CPU-only machines).

Exit status: 0, the step fits; 1, it compiled but does not fit in the memory JAX may take (the
report's last line says what would), or XLA could not compile it for this GPU (one line on stderr
naming the kernel or setting to change, never a traceback); 2, bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile

USAGE = ("python -m train.tools.aot --config CONFIG.yaml --target GPU --hosts N --gpus-per-host M "
         "[key.sub=value ...] [--json OUT.json] [--hlo OUT.hlo]")
# JAX's CUDA plugins, tried in this order for the installed jaxlib: a jaxlib release sometimes
# reaches the registry before one of them (the cuDNN wheel is the one built for that CUDA).
PLUGIN_FLAVOURS = (("cuda12", "nvidia-cudnn-cu12>=9.8,<10"),
                   ("cuda13", "nvidia-cudnn-cu13>=9.8,<10"))
GiB = 2**30


class AotError(ValueError):
    """Bad input for the compile command; the one-line message says what to change or install."""


class CompileFailed(AotError):
    """XLA refused to compile the step for the target (exit 1, as a step that does not fit)."""


class DoesNotFitUncompiled(CompileFailed):
    """The step cannot fit the target, plainly enough to say so before compiling (exit 1): the
    compile could take many minutes to say the same."""


def check_state_fits(cfg, mcfg, target: str, num_devices: int) -> None:
    """Refuse, in one line, a step whose master weights and Adam moments (the part of memory no
    layout, remat policy or kernel can shrink) do not fit even spread over all num_devices GPUs:
    in device memory, or with optimizer.offload=true in the host memory each GPU may use."""
    from basp_jax import gpus
    from basp_jax.planner import cost

    from ..program import planning

    sizes = planning.state_bytes(cfg)
    per_param = cost.state_bytes_per_param(sizes["master_bytes"], sizes["moment_bytes"])
    need = planning.model_shape(mcfg).num_params * per_param / num_devices
    if cfg.optimizer.offload is True:
        budget, where = cost.HARDWARE[target].host_memory_bytes, "the host memory each GPU may use"
    else:
        budget, where = gpus.usable_memory_bytes(gpus.get(target)), f"what JAX may take on {target}"
    if need <= budget:
        return
    fewest = -(-need * num_devices // budget)
    raise DoesNotFitUncompiled(
        f"does not fit, not compiled: the parameters and optimizer state alone need "
        f"{need / GiB:.1f} GiB per GPU sharded over {num_devices} GPU(s) "
        f"({per_param} bytes per parameter), more than {where} ({budget / GiB:.1f} GiB); use at "
        f"least {fewest:.0f} GPUs of this kind (--hosts / --gpus-per-host), a GPU with more memory"
        + ("" if cfg.optimizer.offload is True else ", or optimizer.offload=true"))


# The planner's memory formula is within 15% of the compiled programs; a step it puts at more than
# this many times the memory is refused without compiling (the compile says the same, minutes
# later), while one nearer the edge is compiled and the report says whether it fits.
REFUSE_ABOVE_PLANNED = 2.0


def check_planned_fit(cfg, mcfg, target: str, num_devices: int) -> None:
    """Refuse, in one line, a step the planner's memory formula puts at more than
    REFUSE_ABOVE_PLANNED times what JAX may take on each GPU (cfg with parallel.hardware=target
    and its cluster set, as report() passes it)."""
    from basp_jax import gpus

    from ..program.planning import memory_estimate, memory_policy, plan

    per_host = cfg.parallel.devices_per_host
    layout, strategy = plan(cfg, mcfg, num_devices, per_host)
    remat, tile = memory_policy(cfg, mcfg, layout, strategy, per_host)
    need = memory_estimate(cfg, mcfg, layout, strategy, remat=remat, tile_tokens=tile)[0]
    usable = gpus.usable_memory_bytes(gpus.get(target))
    if need <= REFUSE_ABOVE_PLANNED * usable:
        return
    raise DoesNotFitUncompiled(
        f"does not fit, not compiled: the planner puts the step ({layout.short_name}, "
        f"{strategy} parameters, model.remat={remat}) at {need / GiB:.1f} GiB per GPU, "
        f"{need / usable:.1f}x what JAX may take on {target} ({usable / GiB:.1f} GiB; the "
        f"formula is within 15% of compiled steps); lower data.seq_len, use more GPUs "
        f"(--hosts / --gpus-per-host) or a GPU with more memory")


# What XLA's error says -> the setting to change (first match wins). A kernel the target cannot
# run is refused before compiling (train.prepare.check_kernel); these are what gets past that.
_COMPILE_HINTS = (
    ("Triton", "the Pallas/Triton attention kernel does not compile for {target} (Triton needs "
     "sm80); set model.attn_impl=auto or blockwise"),
    ("ALG_DOT_BF16", "{target} has no bf16 matrix multiply in XLA (sm{sm}); set model.dtype=auto "
     "(float16 there) or float32, or model.attn_impl=blockwise if it is attention's"),
    ("cudnn", "the cuDNN attention kernel does not compile for {target}; set "
     "model.attn_impl=blockwise (or auto)"),
    ("RESOURCE_EXHAUSTED", "the step needs more memory than {target} has even to compile; lower "
     "data.seq_len or train.microbatch_size, or set model.remat=auto"),
)


def compile_failure(error: BaseException, target: str) -> str:
    """One line for a compile error: XLA's first line and the setting that avoids it."""
    from basp_jax import gpus

    text = str(error)
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    cc = gpus.get(target).compute_capability
    for needle, hint in _COMPILE_HINTS:
        if needle.lower() in text.lower():
            fix = hint.format(target=target, sm=f"{cc[0]}{cc[1]}")
            break
    else:
        fix = "try model.attn_impl=blockwise (it compiles for every GPU) or model.dtype=float32"
    return f"XLA could not compile the step for {target}: {first[:300]}; {fix}"


# ---------------------------------------------------------------------------- the CUDA plugin

def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        raise AotError("jaxlib is not installed; pip install -e . first") from None


def plugin_dir() -> str:
    """Where --install puts the CUDA plugin: beside this environment, one folder per jaxlib."""
    base = os.environ.get("BASP_GPU_COMPILE_DIR") or os.path.join(sys.prefix, "basp-gpu-compile")
    return os.path.join(base, f"jaxlib-{_jaxlib_version()}")


def _plugin_installed_here() -> bool:
    return importlib.util.find_spec("jax_cuda12_plugin") is not None or \
        importlib.util.find_spec("jax_cuda13_plugin") is not None


def _plugin_platform() -> bool:
    """Whether JAX ships its CUDA plugin for this machine (Linux x86_64 only)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def _check_platform() -> None:
    if not _plugin_platform():
        raise AotError(
            f"compiling for a GPU needs JAX's CUDA plugin, which exists for Linux x86_64 only "
            f"(this is {platform.system()} {platform.machine()}); run it on a Linux x86_64 machine")


def plugin_ready() -> bool:
    """Whether the CUDA plugin is installed, in this environment or by --install."""
    return _plugin_installed_here() or os.path.isdir(os.path.join(plugin_dir(), "jax_plugins"))


def install_plugin() -> str:
    """pip-install the CUDA plugin matching this jaxlib, and cuDNN (for fused attention), into
    plugin_dir(): the CUDA 12 one, else the CUDA 13 one where only that is published for this
    jaxlib. Only the three packages: no CUDA runtime libraries are needed to compile."""
    _check_platform()
    version = _jaxlib_version()
    target = plugin_dir()
    os.makedirs(os.path.dirname(target), exist_ok=True)
    # Two installs at once (parallel test workers, two shells) would interleave pip's writes into
    # one folder: the second waits for the first, then installs over a complete copy.
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tried = []
        for flavour, cudnn in PLUGIN_FLAVOURS:
            packages = [f"jax-{flavour}-plugin=={version}", f"jax-{flavour}-pjrt=={version}", cudnn]
            print(f"installing {', '.join(packages)} into {target}", flush=True)
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
                   "--target", target, *packages]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if not done.returncode:
                return target
            tried.append(f"{' '.join(packages)} (exit {done.returncode})")
            if "No matching distribution" not in done.stderr:
                break  # a failure other than "not published": the next flavour would not help
            print(f"jax-{flavour}-plugin=={version} is not published; trying the next CUDA",
                  flush=True)
    sys.stderr.write(done.stdout + done.stderr)
    raise AotError(f"pip could not install {'; nor '.join(tried)}; see its output above")


def use_plugin() -> None:
    """Make the CUDA plugin importable and keep JAX on the CPU (must run before `import jax`).
    The XLA flags and memory fraction a GPU run of the trainer sets (train.process.gpu_defaults) are set
    here too, so the program compiled is the one a run would compile."""
    global _plugin_started
    if _plugin_started:  # a second command in the same process (tests/e2e/aot_worker.py)
        return
    os.environ["JAX_PLATFORMS"] = "cpu"  # compile for the GPU topology; run nothing on a GPU
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA driver is needed
    if "jax" in sys.modules:
        raise RuntimeError("train.tools.aot.use_plugin() must run before jax is imported")
    from ..process import gpu_defaults

    gpu_defaults.apply_env(os.environ)
    if not _plugin_installed_here():
        _add_plugin_folder()
    _start_jax()
    _plugin_started = True


_plugin_started = False


def _add_plugin_folder() -> None:
    _check_platform()
    folder = plugin_dir()
    if not os.path.isdir(os.path.join(folder, "jax_plugins")):
        raise AotError(
            f"JAX's CUDA plugin is not installed (looked in this environment and {folder}); run "
            f"`python -m train.tools.aot --install` once (jax-cuda12-plugin/pjrt=={_jaxlib_version()}, "
            "or the cuda13 ones, and cuDNN: about 1.5 GB), or pip install \"jax[cuda12]\"")
    sys.path.insert(0, folder)


def _start_jax() -> None:
    """Import JAX and start its backends (which loads the CUDA plugin) without its notices."""
    with _without_driver_notices():
        import jax

        jax.devices()


# ---------------------------------------------------------------------------- compile and report

def gpu_devices(target: str, hosts: int, gpus_per_host: int):
    """The devices of a deviceless topology of `hosts` x `gpus_per_host` GPUs of `target`."""
    from jax.experimental import topologies

    from basp_jax import gpus

    with _without_driver_notices():
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=gpus.target_config(target),
            topology=f"1x{hosts}x{gpus_per_host}")
    return list(topology.devices)


# What the CUDA plugin prints (from C++, before its logging is set up) on a machine without a GPU.
_DRIVER_NOTICES = ("All log messages before absl::InitializeLog()",
                   "Could not find cuda drivers on your machine")


@contextlib.contextmanager
def _without_driver_notices():
    """Drop the plugin's 'no CUDA driver' notices from stderr (file descriptor 2, where its C++
    code writes them); every other line written meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines(keepends=True):
                if not any(n in line for n in _DRIVER_NOTICES):
                    sys.stderr.write(line)


def compile_step(cfg, devices, devices_per_host: int, *, want_hlo: bool = False,
                 layout_index: int = 0) -> dict:
    """Compile the train step of `cfg` for `devices` and return the report (see `report`);
    under parallel.mode=adaptive, that of layout `layout_index` of the set."""
    import jax

    from basp_jax.compiled import comm, hlo

    from ..program.model_setup import fp8_enabled
    from ..program.planning import (hardware, host_memory_estimate, memory_estimate,
                                    predicted_step_s)
    from ..program.state import compile_program

    compiled, run_plan, mcfg, compile_s = compile_program(cfg, devices, devices_per_host,
                                                          layout_index=layout_index)
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
        # model.fp8: the FP8 GEMMs the program runs per step (cuBLASLt calls and GEMM fusions)
        "fp8": fp8_enabled(cfg, devices[0]), "fp8_gemms": hlo.fp8_gemms(text),
        # the planner's step time for this layout (basp_jax.planner.cost.predict; FP8 FLOPs at the FP8 peak)
        "predicted_step_s": predicted_step_s(cfg, mcfg, run_plan),
        "predicted_from": hardware(cfg, run_plan.layout.devices_per_host).describe_compute(),
        # async collectives with compute between start and done: the latency-hiding scheduler's work
        "overlapped_collectives": hlo.overlapped_collectives(text),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "collectives": collective_rows(collectives, layout.devices_per_host, mcfg.num_layers,
                                       cfg.train.grad_accum),
        # collectives in a loop whose trip count XLA left unrecorded, counted once above (e.g. a
        # microbatch loop XLA peeled and double-buffered)
        "collectives_in_unknown_loops": comm.in_unknown_loops(text),
        "compile_s": compile_s,
        "jax_version": jax.__version__,
        **({"hlo": text} if want_hlo else {}),
    }


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


def format_report(r: dict) -> str:
    mem, lay = r["memory"], r["layout"]
    usable = r["usable_memory_bytes"]
    lines = [
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
        "",
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
    lines.append("")
    kernels = r["attention_kernels"]
    if kernels:
        parts = [f"{kind} ({', '.join(v['targets']) or 'ops'}; {v['count']} per step)"
                 for kind, v in kernels.items()]
        lines.append("attention kernel: " + "; ".join(parts))
    else:
        lines.append("attention kernel: none found")
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
    lines.append(f"async collectives overlapping compute: {sum(v['overlapped'] for v in overlap.values())}"
                 f" of {pairs} in the program text (XLA flags: train.process.gpu_defaults and XLA_FLAGS)")
    lines += ["", "collectives per step, bytes per device:",
              f"  {'kind':<20}{'dtype':<7}{'group':>6}{'count':>7}{'/layer':>8}{'MiB':>11}"
              f"{'wire MiB':>11}{'inter-host MiB':>16}"]
    for c in r["collectives"]:
        lines.append(
            f"  {c['kind']:<20}{c['dtype']:<7}{c['group_size']:>6}{c['count']:>7}"
            f"{c['per_layer']:>8.2f}{c['bytes'] / 2**20:>11.1f}{c['wire_bytes'] / 2**20:>11.1f}"
            f"{c['inter_host_wire_bytes'] / 2**20:>16.1f}")
    if r.get("collectives_in_unknown_loops"):
        lines.append(f"  note: {r['collectives_in_unknown_loops']} of these sit in a loop whose "
                     f"trip count XLA did not record, counted once: the step runs them more often")
    if r.get("adaptive_layouts"):
        lines += ["", "adaptive layouts (parallel.mode=adaptive), each compiled:",
                  f"  {'groups x sp':<14}{'rows x tokens':>15}{'peak GiB':>10}{'fits':>6}"
                  f"{'a2a MiB':>10}{'inter-host a2a MiB':>20}{'compile s':>11}"]
        for row in r["adaptive_layouts"]:
            name = f"{row['groups']}x{row['sp']}" + (f"/ring{row['ring']}" if row["ring"] > 1
                                                     else "")
            lines.append(f"  {name:<14}{row['batch']:>7} x {row['seq_len']:<6}"
                         f"{row['peak_bytes_per_device'] / GiB:>10.2f}"
                         f"{'yes' if row['fits'] else 'NO':>6}{row['a2a_bytes'] / 2**20:>10.1f}"
                         f"{row['a2a_inter_host_bytes'] / 2**20:>20.1f}{row['compile_s']:>11.1f}")
    if not r["fits"]:
        lines += ["", f"does not fit: {r['peak_bytes_per_device'] / GiB:.2f} GiB per device of the "
                  f"{usable / GiB:.2f} JAX may take on {r['target']['device_kind']}; would fit "
                  f"(the planner's estimate, not compiled): {r['would_fit']}"]
    return "\n".join(lines)


def report(cfg, target: str, hosts: int, gpus_per_host: int, *, want_hlo: bool = False) -> dict:
    """Compile `cfg` for `hosts` x `gpus_per_host` GPUs of `target`: the report as a dict."""
    import jax

    from basp_jax import LayoutError, gpus
    from basp_jax.planner import cost
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
    host_budget = cost.HARDWARE[target].host_memory_bytes
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


def would_fit(cfg, r: dict, num_devices: int, devices_per_host: int) -> str:
    """What would fit when the compiled step does not: model.remat=auto at this length, else the
    longest shorter data.seq_len (halving) and the fewest hosts (doubling, up to 8x) that fit at
    this length, by the planner's formula scaled to what this compile measured (the formula is
    within 15% of compiled programs; the scale takes this one's error out). A suggestion, not a
    compiled result."""
    from ..config.schema import replace
    from ..program.planning import memory_estimate, memory_policy, plan
    from ..prepare import model_config

    mcfg = model_config(cfg)
    scale = r["peak_bytes_per_device"] / r["formula_memory_bytes"]
    usable = r["usable_memory_bytes"]

    def fits(variant, devices=num_devices) -> bool:
        try:
            layout, strategy = plan(variant, mcfg, devices, devices_per_host)
        except ValueError:  # a length this layout cannot split
            return False
        remat, tile = memory_policy(variant, mcfg, layout, strategy, devices_per_host)
        need = memory_estimate(variant, mcfg, layout, strategy, remat=remat, tile_tokens=tile)[0]
        return need * scale <= usable

    def with_remat(variant, devices=num_devices) -> str | None:
        """'' when `variant` fits as it is, ' model.remat=auto' when it fits with it, else None."""
        if fits(variant, devices):
            return ""
        if cfg.model.remat != "auto" and fits(replace(variant, "model.remat=auto"), devices):
            return " model.remat=auto"
        return None

    if (extra := with_remat(cfg)) is not None:
        return extra.strip()
    options = []
    seq = cfg.data.seq_len // 2
    while seq >= 256 and not options:
        if (extra := with_remat(replace(cfg, f"data.seq_len={seq}"))) is not None:
            options.append(f"data.seq_len={seq}{extra}")
        seq //= 2
    hosts = num_devices // devices_per_host
    for more in (2 * hosts, 4 * hosts, 8 * hosts):
        devices = more * devices_per_host
        variant = replace(cfg, f"runtime.devices={devices}")
        if (extra := with_remat(variant, devices)) is not None:
            options.append(f"--hosts {more} ({devices} GPUs){extra}")
            break
    return " or ".join(options) or \
        "nothing shorter nor up to 8x the hosts: a smaller model (or a GPU with more memory)"


# ---------------------------------------------------------------------------- compiled planner

def plan_compiled(cfg, target: str, hosts: int, gpus_per_host: int) -> list[dict]:
    """Every layout the planner would consider for `cfg` on this cluster, each compiled: rows
    with the prediction (basp_jax.planner.cost) and the compiled report, fastest fitting first. On
    several hosts the candidates include host parameter sharding beside fsdp and hsdp; a
    parallel.param_sharding other than auto keeps the candidates of that strategy alone."""
    from basp_jax.planner import cost

    from ..config.schema import replace
    from ..prepare import model_config
    from ..program.planning import (dtype_bytes, fp8_planned, memory_policy, resolve_offload,
                                    state_bytes)

    devices = hosts * gpus_per_host
    cfg = replace(cfg, f"parallel.hardware={target}")
    mcfg = model_config(cfg)
    shape = mcfg.shape
    hw = cost.HARDWARE[target]
    hw = dataclasses.replace(hw, devices_per_host=gpus_per_host)
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
                            **dtype_bytes(variant), **state_bytes(variant))
        r = report(variant, target, hosts, gpus_per_host)
        rows.append({"name": pred.name, "predicted_step_s": pred.step_s,
                     "formula_memory_bytes": pred.memory_bytes,
                     "predicted_inter_host_bytes": pred.params.inter + pred.all_to_all.inter,
                     "report": r})
    rows.sort(key=lambda row: (not row["report"]["fits"], row["predicted_step_s"]))
    return rows


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


# ---------------------------------------------------------------------------- command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.tools.aot", usage=USAGE,
                                description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML config (configs/gpu/*.yaml)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, as for train.py")
    p.add_argument("--target", help="GPU model, e.g. a100-40gb (default: parallel.hardware)")
    p.add_argument("--hosts", type=int, help="hosts (default: runtime.devices / gpus per host)")
    p.add_argument("--gpus-per-host", type=int,
                   help="GPUs per host (default: parallel.devices_per_host, else 8)")
    p.add_argument("--json", type=os.path.expanduser, help="write the report as JSON here")
    p.add_argument("--hlo", help="write the optimized HLO text here")
    p.add_argument("--plan", action="store_true",
                   help="compile every candidate layout and rank those that fit (slow)")
    p.add_argument("--install", action="store_true",
                   help="install JAX's CUDA plugin for this jaxlib, then exit")
    p.add_argument("--install-if-supported", action="store_true",
                   help="as --install where JAX ships the plugin (Linux x86_64) and it is not "
                        "installed yet; elsewhere say so and exit 0 (the test setup's step)")
    return p


def resolve_cluster(cfg, args, overrides=()) -> tuple[object, str, int, int]:
    """(cfg, target, hosts, gpus per host): the cluster from the flags, else from the config.
    Flags describe the cluster compiled for, so they win over the config file's
    parallel.devices_per_host and runtime.devices (cfg comes back set to them); the same keys
    given as `overrides` that disagree with the flags are refused."""
    from basp_jax import gpus

    from ..config.schema import replace

    target = args.target or cfg.parallel.hardware
    if target not in gpus.TARGETS:
        raise AotError(f"unknown target {target!r}; use --target with one of {', '.join(gpus.TARGETS)}")
    given = {o.split("=", 1)[0].strip() for o in overrides if "=" in o}
    per_host = args.gpus_per_host or cfg.parallel.devices_per_host or 8
    if per_host <= 0:
        raise AotError(f"--gpus-per-host must be positive, got {per_host}")
    if "parallel.devices_per_host" in given and cfg.parallel.devices_per_host != per_host:
        raise AotError(f"--gpus-per-host {per_host} differs from the override "
                       f"parallel.devices_per_host={cfg.parallel.devices_per_host}; make them agree")
    hosts = args.hosts
    if hosts is None:
        if cfg.runtime.devices is None:
            raise AotError("give --hosts (the config does not set runtime.devices)")
        if cfg.runtime.devices % per_host:
            raise AotError(f"runtime.devices={cfg.runtime.devices} is not a multiple of "
                           f"{per_host} GPUs per host; give --hosts and --gpus-per-host")
        hosts = cfg.runtime.devices // per_host
    if hosts <= 0:
        raise AotError(f"--hosts must be positive, got {hosts}")
    if "runtime.devices" in given and cfg.runtime.devices != hosts * per_host:
        raise AotError(f"the override runtime.devices={cfg.runtime.devices} disagrees with the "
                       f"cluster of {hosts} x {per_host} GPUs; change --hosts/--gpus-per-host "
                       "or the override")
    cfg = replace(cfg, f"parallel.devices_per_host={per_host}", f"runtime.devices={hosts * per_host}")
    return cfg, target, hosts, per_host


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise AotError(f"cannot write {path!r}: {e.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    from ..config.schema import ConfigError, load_config

    try:
        if args.install:
            install_plugin()
            return 0
        if args.install_if_supported:
            if not _plugin_platform():
                print(f"no CUDA plugin for {platform.system()} {platform.machine()}: the GPU "
                      "compile tests skip here")
            elif plugin_ready():
                print(f"the CUDA plugin for jaxlib {_jaxlib_version()} is installed")
            else:
                install_plugin()
            return 0
        if not args.config:
            raise AotError("--config is required (e.g. configs/gpu/llama-3.1-8b_basp.yaml)")
        cfg = load_config(args.config, args.overrides)
        use_plugin()  # before anything imports jax (basp_jax does)
        cfg, target, hosts, per_host = resolve_cluster(cfg, args, args.overrides)
        for path in (args.json, args.hlo):
            if path and os.path.isdir(path):
                raise AotError(f"{path!r} is a directory; give a file name")
            folder = os.path.dirname(os.path.abspath(path)) if path else None
            if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
                raise AotError(f"cannot write {path!r}: {folder} is not a writable folder")
        from basp_jax import LayoutError
        from models import ModelError

        from .. import choices

        choices.check(cfg)  # (after use_plugin: the registries import JAX)
        try:
            if args.plan:
                rows = plan_compiled(cfg, target, hosts, per_host)
            else:
                r = report(cfg, target, hosts, per_host, want_hlo=bool(args.hlo))
        except (LayoutError, ModelError) as e:
            raise AotError(str(e)) from None
    except (AotError, ConfigError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1 if isinstance(e, CompileFailed) else 2
    print(format_plan(rows) if args.plan else format_report(r), flush=True)
    try:
        if args.hlo and not args.plan:
            _write(args.hlo, r.pop("hlo"))
        if args.json:
            _write(args.json, json.dumps(rows if args.plan else r, indent=1))
    except AotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fits = any(row["report"]["fits"] for row in rows) if args.plan else r["fits"]
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
