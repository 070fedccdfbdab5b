"""The config keys whose values are a registry's names, read from the registries themselves.

    check(cfg)          # ConfigError "model.attn_impl: expected one of auto, xla, ..., got 'x'"
    CHOICES[key].names()  # what the config reference (train.tools.config_doc) lists for the key

train/config/schema.py types these keys as `str`: it stays free of JAX, which the CLI and train.tools.aot
start only after reading the config (runtime.cpu_devices, the CUDA plugin), while the registries
live beside the code that imports JAX (basp_jax.kernels, ...). So they are checked here, once JAX
may be imported: by train.prepare and train.tools.aot, before anything compiles or is written.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from basp_jax import gpus, kernels
from basp_jax.layout import MODES
from basp_jax.remat import REMAT_POLICIES
from basp_jax.sharding import PARAM_SHARDINGS

from .config.schema import Config, ConfigError
from .data.synthetic import DISTRIBUTIONS


AUTO_MODE_DOC = "the planner's fastest predicted layout for parallel.hardware"
ADAPTIVE_MODE_DOC = ("per step, the layout with the most groups whose rows hold the step's "
                     "documents (basp_jax.adaptive; data.pack=true)")
AUTO_REMAT_DOC = ("the planner's fastest that fits parallel.hardware's device and host memory "
                  "(where that leaves less than a quarter of the device free, the leanest within "
                  "1% of its step time), with model.tile_tokens=4096 where nothing untiled fits")


@dataclasses.dataclass(frozen=True)
class Choice:
    names: Callable[[], tuple[str, ...]]  # the values the key takes, in the registry's order
    describe: Callable[[], str] | None = None  # each value with its note, for the reference
    optional: bool = False  # null is a value too (the key is off)


CHOICES = {
    # auto: train.program.planning.plan
    # auto: train.program.planning.plan; adaptive: train.program.planning.adaptive_set
    "parallel.mode": Choice(lambda: (*MODES, "auto", "adaptive"),
                            lambda: MODES.describe() + f", auto ({AUTO_MODE_DOC}), "
                            f"adaptive ({ADAPTIVE_MODE_DOC})"),
    "model.attn_impl": Choice(kernels.impl_names, kernels.describe),
    # auto: train.program.planning's pick
    "parallel.param_sharding": Choice(lambda: ("auto", *PARAM_SHARDINGS.names())),
    # auto: train.program.planning.memory_policy
    "model.remat": Choice(lambda: (*REMAT_POLICIES, "auto"),
                          lambda: REMAT_POLICIES.describe() + f", auto ({AUTO_REMAT_DOC})"),
    "data.documents": Choice(lambda: tuple(DISTRIBUTIONS), optional=True),
    # the GPU whose peak MFU divides by (train.observe.metrics.peak_flops)
    "metrics.device": Choice(lambda: tuple(gpus.GPUS), optional=True),
}


def value(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def check(cfg: Config) -> None:
    """Every registry-backed key names a registered value (the message of train.config's
    Literal keys, so every choice error reads alike)."""
    for key, choice in CHOICES.items():
        got, names = value(cfg, key), choice.names()
        if got is None and choice.optional:
            continue
        if got not in names:
            raise ConfigError(f"{key}: expected one of {', '.join(names)}, got {got!r}")
