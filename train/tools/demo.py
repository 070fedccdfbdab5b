"""A short tour on 8 emulated CPU devices: the two layouts, where their all-to-alls go, and a
check of the parallel attention's forward pass against a single-device computation (about 5 s on
2 idle CPU cores; README.md gives the times).

    python -m train.tools.demo
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from basp_jax import Layout, activation_sharding, attention, make_mesh, mesh_groups  # noqa: E402
from basp_jax.compiled import comm
from basp_jax.kernels import xla_attention  # noqa: E402

B, S, HQ, HKV, D = 2, 1024, 8, 4, 32


def main() -> None:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (B, S, HQ, D))
    k, v = (jax.random.normal(key, (B, S, HKV, D)) for key in keys[1:])
    single = xla_attention(q, k, v, causal=True)
    for mode in ("ulysses", "basp"):
        layout = Layout.plan(8, B, S, HQ, HKV, devices_per_host=4, mode=mode)
        mesh = make_mesh(layout)
        sharding = activation_sharding(mesh)
        fn = jax.jit(lambda q, k, v: attention(q, k, v, mesh=mesh, causal=True))
        placed = [jax.device_put(x, sharding) for x in (q, k, v)]
        out = fn(*placed)
        error = float(jnp.abs(out - single).max())
        print(f"\n{layout.describe()}\n  seq groups: {mesh_groups(mesh)}")
        print(f"  max |parallel - single device| = {error:.2e}")
        print("  collectives of the forward pass, 2 hosts x 4 devices:")
        print("    " + comm.format_table(comm.compiled_collectives(fn, *placed), 4).replace("\n", "\n    "))
        assert np.isfinite(error) and error < 1e-4


if __name__ == "__main__":
    main()
