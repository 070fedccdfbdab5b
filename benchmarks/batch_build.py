"""Time the train loop's thread spends in data.global_batch per step, the step emulated by a
sleep: with the prefetch (train/data/pipeline.py) it only takes the batch built in the background.

    python benchmarks/batch_build.py TOKENS.bin --seq-len 256 --accum 2 --micro 2
    PYTHONPATH=/path/to/before python benchmarks/batch_build.py ...   # another version's

Packed documents (data.pack=true, eos 0) on 8 emulated CPU devices, P(None, 'group', 'seq').
"""

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # this checkout's trainer (PYTHONPATH: another one's)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from train.config import DataConfig
    from train.data import Pipeline

    cfg = DataConfig(source="tokens", path=args.path, seq_len=args.seq_len, pack=True, eos_id=0)
    data = Pipeline(cfg, vocab_size=1 << 16, grad_accum=args.accum, microbatch=args.micro, seed=0)
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("group", "seq"))
    sharding = NamedSharding(mesh, P(None, "group", "seq"))
    ahead = "prefetch" in inspect.signature(data.global_batch).parameters
    times = []
    for step in range(args.steps):
        t = time.perf_counter()
        data.global_batch(step, sharding, **({"prefetch": True} if ahead else {}))
        times.append(time.perf_counter() - t)
        time.sleep(args.step_s)  # the step
    print(f"{'prefetch' if ahead else 'inline'}: seq_len {args.seq_len}, "
          f"{args.accum * args.micro} rows: {1e3 * statistics.median(times[5:]):.3f} ms "
          "in global_batch per step (median)")


if __name__ == "__main__":
    main()
