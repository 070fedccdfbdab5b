"""Compile several configs for their GPU clusters in one process (the CUDA plugin loads once):

    python tests/e2e/aot_worker.py OUT.json CONFIG[,key=value...] ...

OUT.json: a list of train.tools.aot reports (without the HLO), one per argument, in order.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.tools import aot  # noqa: E402
from train.config import load_config  # noqa: E402


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    aot.use_plugin()
    flags = argparse.Namespace(target=None, hosts=None, gpus_per_host=None)
    reports = []
    for case in cases:
        path, *overrides = case.split(",")
        cfg = load_config(path, overrides)
        r = aot.report(*aot.resolve_cluster(cfg, flags, overrides))
        r["case"] = case
        reports.append(r)
        print(f"{case}: {r['peak_bytes_per_device'] / 2**30:.2f} GiB, {r['compile_s']:.0f} s",
              flush=True)
    with open(out, "w") as f:
        json.dump(reports, f)


if __name__ == "__main__":
    main()
