"""One process of the emulated cluster's all-to-all timing: the attention exchanges alone.

For each layout, times a jitted program that does exactly the all-to-alls of `layers` attention
layers, forward and backward (q, k, v to heads and the output back: 4 per pass), with nothing else,
and prints one JSON line per layout from process 0. Started by benchmarks/emulated_cluster.py in
each network namespace; not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--modes", default="ulysses,basp")
    args = parser.parse_args()

    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices_per_process}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import jax.numpy as jnp

    from basp_jax import ACTIVATION_SPEC, Layout, activation_sharding, make_mesh
    from basp_jax.attention import heads_to_seq, seq_to_heads

    n = jax.device_count()
    for mode in args.modes.split(","):
        layout = Layout.plan(n, args.batch, args.seq_len, args.heads, args.kv_heads,
                             devices_per_host=args.devices_per_process, mode=mode)
        mesh = make_mesh(layout)
        sp = layout.sp
        q_shape = (args.batch, args.seq_len, args.heads, args.head_dim)
        kv_shape = (args.batch, args.seq_len, args.kv_heads * layout.kv_replication, args.head_dim)

        def exchanges(q, k, v):
            for _ in range(args.layers * 2):  # forward and backward passes
                q2, k2, v2 = (seq_to_heads(x, sp) for x in (q, k, v))
                q = heads_to_seq(q2 + k2.mean() + v2.mean(), sp)  # keep every exchange live
            return q

        fn = jax.jit(jax.shard_map(exchanges, mesh=mesh, in_specs=(ACTIVATION_SPEC,) * 3,
                                   out_specs=ACTIVATION_SPEC, check_vma=False))
        sharding = activation_sharding(mesh)
        q, k, v = (jax.make_array_from_callback(shape, sharding, lambda idx, s=shape: jnp.ones(s)[idx])
                   for shape in (q_shape, kv_shape, kv_shape))
        fn(q, k, v).block_until_ready()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn(q, k, v).block_until_ready()
            times.append(time.perf_counter() - start)
        if jax.process_index() == 0:
            print(json.dumps({"mode": mode, "groups": layout.groups, "sp": sp,
                              "a2a_s": statistics.median(times), "times": times}), flush=True)


if __name__ == "__main__":
    main()
