"""checkpoint.copy_on_device: a periodic save written from a copy of the state made on the
devices, in a thread, while the next step runs (train.checkpoint.snapshot, train.loop). The
next step donates the state it takes, so a save that read the state itself after that dispatch
would hold a later step's values: every checkpoint is compared with the state saved itself."""

import errno
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from train.checkpoint import snapshot
from train.checkpoint.store import Checkpointer, StorageError
from train.config.schema import CheckpointConfig
from train.loop import run

from tests.helpers.trainer import tiny_config
from tests.helpers.trees import flat_params

pytestmark = pytest.mark.usefixtures("compile_cache")  # tests/conftest.py


def _saved(run_dir, step: int) -> dict:
    path = run_dir / "checkpoints" / str(step)
    return {item: flat_params(ocp.StandardCheckpointer().restore(path / item))
            for item in ("params", "opt_state")}


def test_saves_from_a_device_copy_equal_saves_of_the_state_itself(tmp_path):
    runs = {}
    for copy in ("true", "false"):
        runs[copy] = run(tiny_config(tmp_path / copy, "train.steps=6", "checkpoint.every=2",
                                     "checkpoint.keep=3", f"checkpoint.copy_on_device={copy}"))
    assert runs["true"]["losses"] == runs["false"]["losses"]
    for step in (2, 4, 6):  # 2 and 4 periodic (the copy), 6 the final save (the state)
        copied, itself = _saved(tmp_path / "true", step), _saved(tmp_path / "false", step)
        for item in itself:
            assert copied[item].keys() == itself[item].keys()
            for name, want in itself[item].items():
                np.testing.assert_array_equal(copied[item][name], want, err_msg=f"{step} {name}")
    # consecutive checkpoints differ: the comparison would see a save of the wrong step
    assert any(not np.array_equal(a, b) for a, b in zip(
        _saved(tmp_path / "true", 2)["params"].values(),
        _saved(tmp_path / "true", 4)["params"].values()))


def _state():
    mesh = jax.make_mesh((8,), ("x",))
    split = NamedSharding(mesh, P("x"))
    params = {"kernel": jax.device_put(jnp.arange(64.0).reshape(16, 4), split)}
    opt_state = {"mu": jax.device_put(jnp.ones((16, 4)), split),
                 "count": jax.device_put(jnp.int32(3), NamedSharding(mesh, P()))}
    return params, opt_state


def test_the_copy_is_new_buffers_placed_as_the_state():
    params, opt_state = _state()
    copy = snapshot.copy_state(params, opt_state)
    for want, got in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves(copy)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding == want.sharding
        assert {s.data.unsafe_buffer_pointer() for s in got.addressable_shards}.isdisjoint(
            s.data.unsafe_buffer_pointer() for s in want.addressable_shards)
    # per device: a (16, 4) float32 split 8 ways, another, and the replicated int32
    assert snapshot.device_bytes((params, opt_state)) == 2 * 2 * 4 * 4 + 4


def _compiled(peak_bytes: float):
    analysis = SimpleNamespace(argument_size_in_bytes=peak_bytes, output_size_in_bytes=0,
                               temp_size_in_bytes=0, alias_size_in_bytes=0)
    return SimpleNamespace(memory_analysis=lambda: analysis)


def test_the_copy_is_taken_only_where_it_fits_beside_the_step():
    state = _state()
    extra = snapshot.device_bytes(state)
    limit = 1000.0
    fits, why = snapshot.copy_fits([_compiled(100), _compiled(limit * 0.95 - extra)], limit,
                                   state, on_cpu=False)
    assert fits, why
    fits, why = snapshot.copy_fits([_compiled(100), _compiled(limit * 0.95 - extra + 1)], limit,
                                   state, on_cpu=False)
    assert not fits and "do not fit a device's" in why
    unknown = SimpleNamespace(memory_analysis=lambda: None)
    assert snapshot.copy_fits([unknown], limit, state, on_cpu=False)[0] is False
    assert snapshot.copy_fits([unknown], limit, state, on_cpu=True)[0] is True


def test_a_background_save_that_fails_is_one_error_at_the_next_use(tmp_path, monkeypatch):
    params, opt_state = _state()
    checkpointer = Checkpointer(str(tmp_path), CheckpointConfig(every=1), total_steps=3)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointer.manager, "save", no_space)
    assert checkpointer.save(1, params, opt_state, {"step": 1}, background=True)
    with pytest.raises(StorageError, match="space"):
        checkpointer.due(2)
    checkpointer.due(2)  # raised once
    checkpointer.close()


def test_a_state_partly_in_host_memory_is_saved_itself():
    params, opt_state = _state()
    host = jax.device_put(opt_state["mu"], opt_state["mu"].sharding.with_memory_kind("pinned_host"))
    fits, why = snapshot.copy_fits([_compiled(0)], 1e12, (params, {**opt_state, "mu": host}),
                                   on_cpu=True)
    assert not fits and "host memory" in why
