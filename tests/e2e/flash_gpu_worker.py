"""Compile sequence-parallel attention (forward and gradients, bf16, packed documents) for a GPU
target without a GPU and print which attention kernels the program runs, and which kernels each
shape of ring hop runs, as JSON ({"kernels": ..., "hops": ...}):

    python tests/e2e/flash_gpu_worker.py TARGET RING [ZIGZAG]

(one host of 8 GPUs; RING > 1: ring attention over RING runs of 8 / RING GPUs).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.tools import cuda_plugin  # noqa: E402


def main() -> None:
    target, ring = sys.argv[1], int(sys.argv[2])
    zigzag = len(sys.argv) > 3 and sys.argv[3] == "zigzag"
    cuda_plugin.use_plugin()
    import jax
    import jax.numpy as jnp

    from basp_jax import Layout, activation_sharding, attention, make_mesh
    from basp_jax.compiled import hlo

    b, s, hq, hkv, d = 1, 8192, 32, 8, 128
    layout = Layout.plan(8, batch=b, seq_len=s, num_heads=hq, num_kv_heads=hkv, groups=1,
                         ring=ring, zigzag=zigzag)
    mesh = make_mesh(layout, cuda_plugin.gpu_devices(target, 1, 8))
    sharding = activation_sharding(mesh)

    def step(q, k, v, seg):
        fn = lambda q, k, v: attention(q, k, v, mesh=mesh, layout=layout, causal=True,  # noqa: E731
                                       segment_ids=seg)
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(out)

    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype,  # noqa: E731
                                                                   sharding=sharding)
    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(spec((b, s, hq, d)), spec((b, s, hkv, d)),
                                       spec((b, s, hkv, d)), spec((b, s), jnp.int32)).compile()
    text = compiled.as_text()
    print(json.dumps({"kernels": hlo.attention_kernels(text), "hops": hlo.ring_hop_kernels(text)}))


if __name__ == "__main__":
    main()
