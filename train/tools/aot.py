"""Compile a config's real train step for a GPU cluster, on any machine, and report what it runs.

No GPU is needed; the report gives what the GPUs would run: memory per device, attention
kernels, collectives, compile time. This module is the command line; the work is in
train.tools.cuda_plugin (the plugin), train.tools.gpu_compile (compiling and the report's
numbers), train.tools.fit_advice (refusals before compiling, what would fit) and
train.tools.aot_report (the text).

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
import json
import os
import platform
import sys

from .aot_errors import AotError, CompileFailed
from .aot_report import format_plan, format_report
from .cuda_plugin import install_plugin, jaxlib_version, plugin_platform, plugin_ready, use_plugin
from .gpu_compile import plan_compiled, report

USAGE = ("python -m train.tools.aot --config CONFIG.yaml --target GPU --hosts N --gpus-per-host M "
         "[key.sub=value ...] [--json OUT.json] [--hlo OUT.hlo]")


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


def _install(only_if_supported: bool) -> None:
    """--install: the CUDA plugin, here or fail; --install-if-supported: where JAX ships it
    and it is missing."""
    if not only_if_supported:
        install_plugin()
    elif not plugin_platform():
        print(f"no CUDA plugin for {platform.system()} {platform.machine()}: the GPU compile "
              "tests skip here")
    elif plugin_ready():
        print(f"the CUDA plugin for jaxlib {jaxlib_version()} is installed")
    else:
        install_plugin()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    from ..config.schema import ConfigError, load_config

    try:
        if args.install or args.install_if_supported:
            _install(only_if_supported=args.install_if_supported)
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
