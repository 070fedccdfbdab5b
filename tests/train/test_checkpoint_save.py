"""train.checkpoint.store.Checkpointer on 8 devices: arrays held whole by several devices are saved
without compiling anything (each from its first replica) and restore to the same values."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from train.checkpoint.store import Checkpointer
from train.config.schema import CheckpointConfig

COMPILE_CACHE = False  # tests/conftest.py: this module counts XLA compilations


def test_replicated_arrays_save_without_compiling_and_restore(tmp_path):
    mesh = jax.make_mesh((8,), ("x",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    params = {"norm": jax.device_put(jnp.linspace(0.0, 1.0, 24).reshape(3, 8), replicated),
              "kernel": jax.device_put(jnp.arange(64.0).reshape(16, 4), split)}
    opt_state = {"count": jax.device_put(jnp.int32(7), replicated),
                 "mu": jax.device_put(jnp.full((5, 8), 0.5), replicated)}
    jax.block_until_ready((params, opt_state))

    compiles = []

    def on_event(name, seconds, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    checkpointer = Checkpointer(str(tmp_path), CheckpointConfig(), total_steps=1)
    try:
        assert checkpointer.save(1, params, opt_state, {"step": 1}, force=True)
        checkpointer.wait()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert compiles == [], f"{len(compiles)} XLA compilations during a save"

    abstract = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
    got_params, got_state, meta = checkpointer.restore(1, abstract(params), abstract(opt_state))
    checkpointer.close()
    assert meta == {"step": 1}
    for want, got in ((params, got_params), (opt_state, got_state)):
        jax.tree.map(lambda w, g: np.testing.assert_array_equal(np.asarray(g), np.asarray(w)),
                     want, got)
        assert jax.tree.map(lambda g: g.sharding, got) == jax.tree.map(lambda w: w.sharding, want)


def test_checkpoints_written_compressed_restore(tmp_path):
    """Saves are uncompressed (the writer's CPU time); a checkpoint written with orbax's
    default zstd compression, as earlier versions wrote them, restores the same."""
    import orbax.checkpoint as ocp

    mesh = jax.make_mesh((8,), ("x",))
    split = NamedSharding(mesh, P("x"))
    params = {"kernel": jax.device_put(jnp.arange(65536.0).reshape(256, 256), split)}
    opt_state = {"mu": jax.device_put(jnp.full((256, 256), 0.25), split)}  # compresses to ~0
    raw = 2 * 65536 * 4
    directory = tmp_path / "checkpoints"
    size = lambda step: sum(p.stat().st_size for p in (directory / str(step)).rglob("*")  # noqa: E731
                            if p.is_file())
    with ocp.CheckpointManager(directory, item_names=("params", "opt_state", "meta")) as old:
        old.save(3, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                            opt_state=ocp.args.StandardSave(opt_state),
                                            meta=ocp.args.JsonSave({"step": 3})))
        old.wait_until_finished()
    assert size(3) < 0.75 * raw  # compressed
    checkpointer = Checkpointer(str(tmp_path), CheckpointConfig(), total_steps=4)
    abstract = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
    got_params, got_state, meta = checkpointer.restore(3, abstract(params), abstract(opt_state))
    assert meta == {"step": 3}
    np.testing.assert_array_equal(np.asarray(got_params["kernel"]), np.asarray(params["kernel"]))
    np.testing.assert_array_equal(np.asarray(got_state["mu"]), np.asarray(opt_state["mu"]))
    assert checkpointer.save(4, params, opt_state, {"step": 4}, force=True)
    checkpointer.close()
    assert size(4) >= raw  # not compressed
