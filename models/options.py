"""How a model runs, as opposed to what it is (models.config.ModelConfig): one frozen object.

    options = RunOptions(mesh=mesh, layout=layout, dtype=jnp.bfloat16, remat="full")
    model = Transformer(config, rngs=nnx.Rngs(0), options=options)   # or init_model(config, ...)

Transformer, Block and Attention take it whole; the public builders (Transformer, abstract_model,
init_model, from_pretrained) also take its fields as keywords (`mesh=mesh, remat="full"`) and
build it once. Every field is checked here, before anything compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

import basp_jax
from basp_jax import Layout
from basp_jax import kernels as basp_kernels
from basp_jax.mesh import SEQ, layout_on
from basp_jax.remat import REMAT_POLICIES
from basp_jax import grouped_matmul, vocab
from basp_jax.sharding import (DEFAULT_STRATEGY, PARAM_SHARDINGS, ShardingRules,
                               needs_devices_per_host)

from .config import ModelConfig, ModelError

EXPERT_PARALLEL = ("auto", "seq", "none")
# the fields the ShardingRules are made of (RunOptions.of builds them anew when one changes)
_RULES_FIELDS = ("mesh", "layout", "param_sharding")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Where and how a model computes.

    mesh: a basp_jax.make_mesh mesh (axes basp_jax.AXES), or None for one device.
    layout: the Layout the mesh was made from, for its ring and token order (None: the mesh's
        plain split); with layout.zigzag, tokens come in layout.token_order.
    dtype / param_dtype: compute and storage dtypes.
    attn_impl: the attention kernel ("auto" or one of basp_jax.kernels.KERNELS).
    remat: the rematerialisation policy (basp_jax.remat.REMAT_POLICIES).
    tile_tokens: run each layer's token-local work (norms, projections, RoPE, MLP, residual
        adds) over chunks of at most this many tokens per device, each rematerialised
        (models.tiling, basp_jax.tiling): no [tokens, intermediate] or other per-token
        temporary of a whole shard exists, only attention's inputs and output (None: the whole
        shard at once).
    vocab_parallel: when an embedding / LM head stored split on its vocabulary is used where it
        is stored, moving the tokens' rows (basp_jax.vocab): "auto" where that moves
        fewer bytes than gathering the table (short sequences), "always", "never".
    scan_layers: the layers as one stacked Block under lax.scan, or a stacked Period of the
        pattern unlike layers repeat (models.transformer), else a Python list.
    param_sharding: how parameters are stored on the mesh (basp_jax.sharding.PARAM_SHARDINGS; a
        per-host one needs the layout, for its devices_per_host); `rules` places them. The
        embedding and LM head are used where they are stored when it splits the vocabulary;
        under a per-host one their gradient is summed inside each host before it crosses hosts
        (basp_jax.vocab).
    fp8: the layers' projections (q, k, v, o, gate, up, down; a Gated DeltaNet's qkv, z and
        out) as FP8 matmuls, e4m3 forward and e5m2 gradients with per-tensor current scales
        (models.fp8); attention, norms, the embedding and the LM head stay in `dtype`.
    fp8_exchange: attention's q, k and v cross its all-to-alls in float8_e4m3fn with per-head
        scales, their gradients back in float8_e5m2 (basp_jax.fp8_exchange): half the bytes of
        bf16; the kernel computes on them dequantized to `dtype`, the output's exchange stays
        in `dtype`. Nothing changes where no all-to-all runs (no mesh, seq degree 1), nor in a
        Gated DeltaNet layer's exchanges.
    expert_parallel: where a sparse layer's experts run (models.moe): "seq", split over the
        devices of each seq group (the group's tokens gathered and the outputs scattered back
        inside the group); "auto", over a host's devices where the seq groups are smaller than
        a host, else as "seq"; "none", whole copies on every device (experts_split; a layout
        that cannot split them is refused in one line).
    grouped_matmul: how a sparse layer's experts multiply their tokens (basp_jax.grouped_matmul):
        "pallas" (our grouped-matmul kernels; interpreted off a GPU), "xla" (jax.lax.ragged_dot,
        a dense loop over the experts on a GPU), "auto" (pallas on a GPU, else xla).
    rules: where parameters and activations live on the mesh (basp_jax.sharding.ShardingRules,
        None without a mesh): built from mesh, param_sharding and the layout's
        devices_per_host when not given; a run's trainer passes its own, so the run has one.
    document_bound: the most documents a packed row holds, where the data knows it (the
        trainer's packed token files do): cuDNN's packed layout is sized by it
        (basp_jax.attention). None: the library's default.
    """

    mesh: Mesh | None = None
    layout: Layout | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    attn_impl: str = "auto"
    remat: str = "none"
    tile_tokens: int | None = None
    vocab_parallel: str = "auto"
    scan_layers: bool = True
    param_sharding: str = DEFAULT_STRATEGY
    fp8: bool = False
    fp8_exchange: bool = False
    expert_parallel: str = "auto"
    grouped_matmul: str = "auto"
    rules: ShardingRules | None = None
    document_bound: int | None = None

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ModelError(
                f"unknown remat {self.remat!r}; use one of {', '.join(REMAT_POLICIES)}")
        if self.tile_tokens is not None and self.tile_tokens < 1:
            raise ModelError(f"tile_tokens must be a positive number of tokens or None, got "
                             f"{self.tile_tokens}")
        if self.vocab_parallel not in vocab.MODES:
            raise ModelError(f"unknown vocab_parallel {self.vocab_parallel!r}; use one of "
                             f"{', '.join(vocab.MODES)}")
        if self.attn_impl not in basp_kernels.impl_names():
            raise ModelError(f"unknown attn_impl {self.attn_impl!r}; use one of "
                             f"{', '.join(basp_kernels.impl_names())}")
        if not isinstance(self.fp8, bool):
            raise ModelError(f"fp8 must be True or False, got {self.fp8!r} (resolve 'auto' for "
                             "the device first: models.fp8.enabled)")
        if self.expert_parallel not in EXPERT_PARALLEL:
            raise ModelError(f"unknown expert_parallel {self.expert_parallel!r}; use one of "
                             f"{', '.join(EXPERT_PARALLEL)}")
        if self.grouped_matmul not in grouped_matmul.IMPLS:
            raise ModelError(f"unknown grouped_matmul {self.grouped_matmul!r}; use one of "
                             f"{', '.join(grouped_matmul.IMPLS)}")
        if self.document_bound is not None and (not isinstance(self.document_bound, int)
                                                or self.document_bound < 1):
            raise ModelError(f"document_bound must be a positive number of documents or None, "
                             f"got {self.document_bound!r}")
        if not isinstance(self.fp8_exchange, bool):
            raise ModelError(f"fp8_exchange must be True or False, got {self.fp8_exchange!r}")
        if self.param_sharding not in PARAM_SHARDINGS:
            raise ModelError(f"unknown param_sharding {self.param_sharding!r}; use one of "
                             f"{', '.join(PARAM_SHARDINGS)}")
        if self.mesh is not None and tuple(self.mesh.axis_names) != basp_jax.AXES:
            raise ModelError(
                f"the mesh must have axes {basp_jax.AXES}, got {tuple(self.mesh.axis_names)}; "
                f"build it with basp_jax.make_mesh(layout)"
            )
        if self.layout is not None and self.mesh is None:
            raise ModelError("a layout needs its mesh: pass mesh=basp_jax.make_mesh(layout)")
        if needs_devices_per_host(self.param_sharding) and self.mesh is not None \
                and self.layout is None:
            raise ModelError(f"param_sharding={self.param_sharding!r} needs the layout the mesh "
                             "was made from (its devices_per_host): pass layout=layout")
        self._check_rules()

    def _check_rules(self):
        """Build the rules when not given (once per options: the embedding, the head and the
        loss share them, and their host mesh); refuse given ones that place elsewhere."""
        if self.mesh is None:
            want = None
        else:
            per_host = None if self.layout is None else self.layout.devices_per_host
            want = ShardingRules(self.param_sharding, self.mesh, per_host)
        if self.rules is None:
            object.__setattr__(self, "rules", want)
        elif self.rules != want:
            raise ModelError(f"the rules given ({self.rules.strategy!r} on their mesh) disagree "
                             f"with mesh, layout and param_sharding={self.param_sharding!r}; "
                             "pass rules=None to build them")

    @classmethod
    def of(cls, options: "RunOptions | None" = None, **fields) -> "RunOptions":
        """`options` (default: RunOptions()) with some fields replaced: the one conversion of
        the builders' keyword arguments."""
        base = cls() if options is None else options
        if any(name in fields for name in _RULES_FIELDS) and "rules" not in fields:
            fields["rules"] = None  # built anew for the new placement
        return dataclasses.replace(base, **fields) if fields else base

    @property
    def remat_policy(self):
        """The jax.checkpoint policy (None: the layers are not rematerialised)."""
        return REMAT_POLICIES.get(self.remat).policy

    def experts_split(self, config: ModelConfig) -> int:
        """Over how many devices a sparse layer's experts are split (expert_parallel; 1: whole
        on every device): "seq", a seq group's; "auto", a host's devices where the seq groups
        are smaller than a host (their tokens gathered inside the host), else a seq group's
        (basp_jax.planner.shape.ModelShape.expert_split, the planner's same rule). On a mesh
        of several devices where they cannot be split, "auto" and "seq" are a one-line
        ModelError rather than every expert whole on every device unasked: expert_parallel=none
        asks for that."""
        if self.expert_parallel == "none" or self.mesh is None or self.mesh.devices.size == 1:
            return 1
        sp, experts = self.mesh.shape[SEQ], config.num_experts
        per_host = None if self.layout is None else min(self.layout.devices_per_host,
                                                         self.mesh.devices.size)
        split = config.shape.expert_split(sp, per_host, self.expert_parallel)
        if split > 1:
            return split
        over = (f"a seq group ({sp} devices)" if self.expert_parallel == "seq" or per_host is None
                else f"a host ({per_host} devices) or a seq group ({sp})")
        raise ModelError(f"expert_parallel={self.expert_parallel} splits the experts over {over}, "
                         f"which is one device or does not divide num_experts={experts}; use a "
                         "layout whose seq groups or hosts divide them, or expert_parallel=none "
                         "(every expert whole on every device)")

    def layout_for(self, config: ModelConfig, batch: int, seq_len: int) -> Layout | None:
        """The Layout that runs [batch, seq_len] tokens of `config` on the mesh (None without
        one): the layout's split, checked by basp_jax (basp_jax.mesh.layout_on)."""
        if self.mesh is None:
            return None
        return layout_on(self.mesh, batch, seq_len, config.num_heads, config.num_kv_heads,
                         like=self.layout)
