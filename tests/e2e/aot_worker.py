"""Compile several configs for their GPU clusters in one process (the CUDA plugin loads once):

    python tests/e2e/aot_worker.py OUT.json CONFIG[,key=value...] ...

OUT.json: a list of train.tools.aot reports (without the HLO), one per argument, in order.

    python tests/e2e/aot_worker.py --cli OUT.json '["--config", ...]' ...

runs `python -m train.tools.aot` once per JSON argument list in this one process; OUT.json: a
list of {"rc", "stdout", "stderr"}, in order (for commands that stop before compiling).
"""

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.tools import aot, cuda_plugin, gpu_compile  # noqa: E402
from train.config.schema import load_config  # noqa: E402


def compile_cases(cases: list[str]) -> list[dict]:
    cuda_plugin.use_plugin()
    flags = argparse.Namespace(target=None, hosts=None, gpus_per_host=None)
    reports = []
    for case in cases:
        path, *overrides = case.split(",")
        cfg = load_config(path, overrides)
        r = gpu_compile.report(*aot.resolve_cluster(cfg, flags, overrides))
        r["case"] = case
        reports.append(r)
        print(f"{case}: {r['peak_bytes_per_device'] / 2**30:.2f} GiB, {r['compile_s']:.0f} s",
              flush=True)
    return reports


def run_commands(argvs: list[list[str]]) -> list[dict]:
    results = []
    for argv in argvs:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = aot.main(argv)
        results.append({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})
    return results


def main() -> None:
    if sys.argv[1] == "--cli":
        out = sys.argv[2]
        results = run_commands([json.loads(a) for a in sys.argv[3:]])
    else:
        out = sys.argv[1]
        results = compile_cases(sys.argv[2:])
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
