"""Parameter strategies are applied to a model from outside it (basp_jax.param_use): a strategy
registered here, in a test, places the parameters and gathers them for the layers without any
file under models/ knowing of it, and the model's loss and gradients under it equal one
device's; the model's code names no strategy."""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import basp_jax
import models
from basp_jax.mesh import GROUP, SEQ
from basp_jax.param_use import LayerParams, ParamUse
from basp_jax.sharding import PARAM_SHARDINGS, ShardingRules, Strategy

from tests.helpers.one_device import assert_equal_to_one_device, mean_loss_and_grads

pytestmark = pytest.mark.usefixtures("compile_cache")  # this run's (tests/conftest.py)

SEQ_LEN = 32
TOY = "toy_gathered_whole"


@dataclasses.dataclass(frozen=True)
class WholeUse(ParamUse):
    """Every parameter gathered whole on every device where its layer uses it, recording the
    axis names of each one it gathers (at trace time)."""

    seen: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def gather(self, rules, x, names):
        self.seen.append(tuple(names))
        return super().gather(rules, x, names)


@pytest.fixture
def toy_strategy():
    """A strategy stored as fsdp stores (split over the whole mesh), used whole: registered for
    one test, then taken out."""
    use = WholeUse(axes=())
    PARAM_SHARDINGS.register(TOY, Strategy((GROUP, SEQ), lambda layout: layout.num_devices,
                                           use=use))
    try:
        yield use
    finally:
        PARAM_SHARDINGS.remove(TOY)


def _batch(seed: int):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (2, SEQ_LEN)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    targets[:, -1] = -100
    return jnp.asarray(tokens), jnp.asarray(targets)


def test_a_strategy_registered_outside_the_models_places_and_gathers_their_parameters(
        toy_strategy):
    config = dataclasses.replace(models.ModelConfig.preset("tiny"), vocab_size=256,
                                 num_layers=2, tie_word_embeddings=False)
    tokens, targets = _batch(seed=int(np.random.default_rng().integers(1 << 16)))
    want = mean_loss_and_grads(models.init_model(config, seed=5), tokens, targets)

    layout = basp_jax.Layout.plan(8, 2, SEQ_LEN, config.num_heads, config.num_kv_heads, groups=2)
    model = models.init_model(config, seed=5, mesh=basp_jax.make_mesh(layout), layout=layout,
                              param_sharding=TOY, remat="full")
    stored = {k: v[...].sharding for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    kernels = {k: s for k, s in stored.items() if k[-2].endswith("proj")}
    assert kernels and all(s.num_devices == 8 and not s.is_fully_replicated
                           for s in kernels.values()), kernels  # stored split, as fsdp

    got = mean_loss_and_grads(model, tokens, targets)
    # the layers' matrices went through the toy's gather (the tables follow their own use)
    gathered = set(toy_strategy.seen)
    for names in [("qkv_embed", "q_heads"), ("o_heads", "embed"), ("mlp_up_embed", "mlp_up"),
                  ("mlp_down", "embed"), ("norm",)]:
        assert names in gathered, (names, gathered)
    assert_equal_to_one_device(got, want)


def _rules(strategy: str) -> ShardingRules:
    layout = basp_jax.Layout.plan(8, 2, SEQ_LEN, 4, 2, groups=2, devices_per_host=4)
    return ShardingRules(strategy, basp_jax.make_mesh(layout), 4)


@pytest.mark.parametrize("strategy,wraps_without_policy,gathers_before,gathers_inside", [
    ("fsdp", False, False, False),
    ("host", False, False, False),
    ("staged", False, False, True),
    ("staged_keep", False, True, False),
    ("staged_offload", True, False, True),  # the copy parked in host memory needs the remat
])
def test_each_built_in_strategy_gathers_where_its_use_says(strategy, wraps_without_policy,
                                                          gathers_before, gathers_inside):
    layers = LayerParams(_rules(strategy), jnp.bfloat16)
    assert layers.checkpoint(None)[0] is wraps_without_policy
    policy = jax.checkpoint_policies.nothing_saveable
    assert layers.checkpoint(policy)[0] is True
    kernel = nnx.Param(jnp.ones((64, 32), jnp.float32), out_sharding=("qkv_embed", "q_heads"),
                       eager_sharding=False)
    state = nnx.State({"kernel": kernel})
    for hook, gathers in ((layers.before_body, gathers_before), (layers.in_body, gathers_inside)):
        dtype = jax.eval_shape(lambda s: hook(s)["kernel"][...], state).dtype
        # a gathered matrix is cast to the compute dtype first, one used where stored is not
        assert (dtype == jnp.bfloat16) is gathers, (hook.__name__, dtype)


def test_param_use_refuses_a_copy_without_a_gather_and_an_unknown_place():
    with pytest.raises(ValueError, match="gathers nothing"):
        ParamUse(copy="device")
    with pytest.raises(ValueError, match="use one of"):
        ParamUse(axes=(), copy="disk")


def test_the_models_name_no_parameter_strategy():
    """models/ applies whatever strategy the rules carry through basp_jax.param_use: no strategy
    name, flag or staging call of its own."""
    root = pathlib.Path(models.__file__).parent
    words = re.compile(r"keep_host_copy|offload_host_copy|staged|\bStrategy\b|\.entry\b|"
                       + "|".join(rf'"{name}"' for name in PARAM_SHARDINGS.names()))
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted(root.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if words.search(line)]
    assert not found, found
