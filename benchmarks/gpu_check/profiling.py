"""A few steps under jax.profiler, summarised: device time by kind of work and the operations
that take most of it. The parser reads the trace's JSON (`*.trace.json.gz`) with the standard
library only: the GPU machine has no xprof or TensorBoard profile plugin.

Device time is each event's self time (its duration less that of events nested in it on the same
thread), so nested ranges are not counted twice. The events read are, by what the trace has:
the GPU's stream kernels, else its "XLA Ops" line, else (a CPU run, whose trace has host events
only) the host's non-Python threads."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

CATEGORIES = ("matmul", "attention", "fusion", "collective", "copy", "optimizer", "other")
_COLLECTIVE = re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|"
                         r"nccl|allreduce|allgather|reducescatter|alltoall")
# by name: cuDNN's fused attention, our Pallas kernels (flash_attention_*), JAX's (mha_*); by
# scope: basp_jax.attention's `attention_kernel` around whichever kernel runs (the xla one too)
_ATTENTION_NAME = re.compile(r"fmha|flash|mha|sdpa")
_ATTENTION_ARGS = re.compile(r"fmha|flash_attention|attention_kernel")
_MATMUL = re.compile(r"gemm|cublas|matmul|xmma|cutlass|nvjet|wgmma|\bdot\b|dot[._]|convolution")
_OPTIMIZER = re.compile(r"optimizer|adam|optax")  # train/program/step.py's `optimizer` scope
_COPY = re.compile(r"memcpy|memset|copy|transpose|h2d|d2h|dynamic-update-slice|"
                   r"dynamic_update_slice|send|recv")
_FUSION = re.compile(r"fusion|loop_|input_|reduce|triton|scatter|gather|convert|broadcast")
# derived lines of a device: the same time again, by module or step
_DERIVED = re.compile(r"xla modules|steps|framework|source|tensorflow|xla traceme|launch stats")


def category(name: str, args: dict) -> str:
    """The kind of work an event is, from its name (a kernel's or an HLO op's) and its args
    (the HLO op, its text, its scope)."""
    n = f"{name} {args.get('hlo_op', '')}".lower()
    a = " ".join(str(v) for v in args.values()).lower()
    if _COLLECTIVE.search(n):
        return "collective"
    if _ATTENTION_NAME.search(n) or _ATTENTION_ARGS.search(a):
        return "attention"
    if _MATMUL.search(n) or re.search(r"cublas|\$gemm", a):
        return "matmul"
    if _OPTIMIZER.search(a) or _OPTIMIZER.search(n):
        return "optimizer"
    if _COPY.search(n):
        return "copy"
    if _FUSION.search(n):
        return "fusion"
    return "other"


def _args(e: dict) -> dict:
    args = e.get("args")
    return args if isinstance(args, dict) else {}


def _names(events: list, kind: str) -> dict:
    return {(e.get("pid"), e.get("tid")) if kind == "thread_name" else e.get("pid"):
            str(_args(e).get("name", "")) for e in events
            if e.get("ph") == "M" and e.get("name") == kind}


def select(trace: dict) -> tuple[str, list[dict], list[str]]:
    """(source, the complete events to count, their threads' names)."""
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    processes, threads = _names(events, "process_name"), _names(events, "thread_name")
    spans = [e for e in events if e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))
             and isinstance(e.get("ts", 0), (int, float))]
    device = {pid for pid, name in processes.items() if "/device:" in name}
    on_device = {key: name for key, name in threads.items() if key[0] in device}
    for source, keep in (
            ("device streams", lambda name: name.lower().startswith("stream")),
            ("device XLA ops", lambda name: name.lower() == "xla ops"),
            ("device", lambda name: not _DERIVED.search(name.lower()))):
        chosen = {key for key, name in on_device.items() if keep(name)}
        picked = [e for e in spans if (e.get("pid"), e.get("tid")) in chosen]
        if picked:
            return source, picked, sorted({on_device[k] for k in chosen})
    # host only (a CPU run): XLA's threads, not the Python interpreter's frames
    host = [e for e in spans if e.get("pid") not in device
            and threads.get((e.get("pid"), e.get("tid")), "") != "python"
            and not str(e.get("name", "")).startswith("$")]
    used = sorted({threads.get((e.get("pid"), e.get("tid")), "?") for e in host})
    return "host (the trace has no device events)", host, used


def self_times(events: list[dict]) -> list[float]:
    """Each event's duration less the events nested in it on its thread (microseconds)."""
    own = [float(e["dur"]) for e in events]
    start = [float(e.get("ts", 0)) for e in events]
    end = [s + d for s, d in zip(start, own)]
    by_thread = collections.defaultdict(list)
    for i, e in enumerate(events):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    for indices in by_thread.values():
        indices.sort(key=lambda i: (start[i], -own[i]))
        stack: list[int] = []  # enclosing events, innermost last
        for i in indices:
            while stack and end[stack[-1]] <= start[i]:
                stack.pop()
            if stack:
                own[stack[-1]] -= max(min(end[i], end[stack[-1]]) - start[i], 0.0)
            stack.append(i)
    return [max(t, 0.0) for t in own]


def summarize(trace: dict, steps: int, top: int = 10) -> dict:
    """Device time per step by category and the `top` operations, from a trace's JSON."""
    source, events, threads = select(trace)
    steps = max(steps, 1)
    by_cat = dict.fromkeys(CATEGORIES, 0.0)
    by_op: dict[str, list] = {}
    for e, us in zip(events, self_times(events)):
        name = str(e.get("name", ""))[:120]
        cat = category(name, _args(e))
        by_cat[cat] += us
        row = by_op.setdefault(name, [0.0, 0, cat])
        row[0] += us
        row[1] += 1
    total = sum(by_cat.values())
    ops = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "status": "ok", "source": source, "steps": steps, "events": len(events),
        "threads": threads[:16], "busy_s_per_step": total / 1e6 / steps,
        "by_category_s_per_step": {c: t / 1e6 / steps for c, t in by_cat.items()},
        "by_category_share": {c: (t / total if total else 0.0) for c, t in by_cat.items()},
        "top_ops": [{"name": n, "category": c, "s_per_step": t / 1e6 / steps,
                     "calls_per_step": k / steps, "share": t / total if total else 0.0}
                    for n, (t, k, c) in ops],
        # a few raw events: what the next reader of a new trace format needs to see
        "sample_events": [{"name": str(e.get("name", ""))[:120],
                           "args": {k: str(v)[:160] for k, v in _args(e).items()}}
                          for e in events[:3]],
    }


def load(directory: str) -> dict:
    """The trace JSON jax.profiler wrote under `directory` (plugins/profile/RUN/*.json.gz)."""
    found = sorted(glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True))
    found = found or sorted(glob.glob(os.path.join(directory, "**", "*.json.gz"), recursive=True))
    if not found:
        raise FileNotFoundError(f"jax.profiler wrote no *.trace.json.gz under {directory}")
    with gzip.open(found[-1], "rt") as f:
        return json.load(f)


def _options():
    """No Python frames (the host's XLA events stay) and no HLO dump: a smaller trace."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.enable_hlo_proto = False
    return options


def profile_steps(run_step, steps: int, on_gpu: bool) -> dict:
    """run_step() `steps` times (each waits for its step) under jax.profiler, summarised. On a
    GPU a trace without device events (no CUPTI) is a failure: its summary would be the host's."""
    import time

    import jax

    with tempfile.TemporaryDirectory(prefix="gpu-check-trace-") as directory:
        t0 = time.perf_counter()
        with jax.profiler.trace(directory, create_perfetto_trace=True,
                                profiler_options=_options()):
            for _ in range(steps):
                run_step()
        traced = time.perf_counter() - t0
        t0 = time.perf_counter()
        summary = summarize(load(directory), steps)
        summary["parse_s"] = time.perf_counter() - t0
    summary["traced_wall_s"] = traced
    shares = sorted(summary["by_category_share"].items(), key=lambda kv: -kv[1])
    print(f"  profile ({summary['source']}, {steps} steps): "
          + ", ".join(f"{c} {s:.0%}" for c, s in shares if s >= 0.005)
          + (f"; top: {summary['top_ops'][0]['name'][:60]}" if summary["top_ops"] else ""),
          flush=True)
    if on_gpu and not summary["source"].startswith("device"):
        summary.update(status="failed", error="the trace holds no GPU events (is CUPTI there?)")
        print(f"  FAILED: {summary['error']}", flush=True)
    return summary
