"""The sizes of a decoder-only transformer, and the parameter and FLOP counts they give."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer (Llama / Qwen): what the cost model needs, and the
    one place its parameter count and training FLOPs are computed (the trainer's MFU reads them
    through models.ModelConfig.shape)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2)
    attention_out_bias: bool = False  # bias on the output projection
    qk_norm: bool = False  # per-head RMSNorm weights on q and k (Qwen3)
    attention_output_gate: bool = False  # q_proj also emits a gate per query channel (Qwen3.5)
    # Hybrids (Qwen3.5): how many of the layers are Gated DeltaNet ones instead of attention, and
    # their shapes (models.linear_attention)
    linear_layers: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Mixtures of experts (Qwen3-MoE, Qwen3.5-MoE): how many layers' MLPs are sparse, and their
    # experts' shapes (models.moe), with a shared expert every token runs through where its
    # width is not 0; the other layers' MLPs are dense ones of intermediate_size
    sparse_layers: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def attention_layers(self) -> int:
        return self.num_layers - self.linear_layers

    @property
    def layer_params(self) -> int:
        """An attention layer's parameters."""
        d, hd = self.hidden_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = (3 if self.attention_output_gate else 2) * d * q + 2 * d * kv
        if self.attention_bias:
            attn += q * (2 if self.attention_output_gate else 1) + 2 * kv
        if self.attention_out_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * hd
        return attn + self._mlp_and_norm_params

    @property
    def _mlp_and_norm_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size

    def expert_split(self, sp: int, devices_per_host: int | None = None,
                     expert_parallel: str = "auto") -> int:
        """Over how many devices the experts split (model.expert_parallel,
        models.options.RunOptions.experts_split): under "auto" a host's devices where seq
        groups of sp devices are smaller than a host and fill it (devices_per_host; None:
        unknown), else the seq group's sp; under "seq" the seq group's; whichever first has
        several devices and divides the experts, else 1 (whole on every device; "none": 1)."""
        if not self.sparse_layers or expert_parallel == "none":
            return 1
        if expert_parallel == "seq":
            devices_per_host = None
        splits = [sp]
        if devices_per_host is not None and devices_per_host > sp \
                and devices_per_host % sp == 0:
            splits.insert(0, devices_per_host)
        return next((n for n in splits if n > 1 and self.num_experts % n == 0), 1)

    @property
    def sparse_mlp_params(self) -> int:
        """A sparse layer's MLP: every expert's SwiGLU and the router; the shared expert's
        SwiGLU and its gate (a [hidden, 1] projection) where there is one."""
        d, shared = self.hidden_size, self.shared_expert_intermediate_size
        return (self.num_experts * (3 * d * self.moe_intermediate_size + d)
                + (3 * d * shared + d if shared else 0))

    @property
    def _sparse_extra_params(self) -> int:
        """What the sparse layers add to a dense model's count: their experts and routers, less
        their dense MLPs."""
        return self.sparse_layers * (self.sparse_mlp_params
                                     - 3 * self.hidden_size * self.intermediate_size)

    @property
    def inactive_expert_params(self) -> int:
        """The experts' parameters a token does not run through: all but its top-k, per layer."""
        d, f = self.hidden_size, self.moe_intermediate_size
        return self.sparse_layers * (self.num_experts - self.num_experts_per_tok) * 3 * d * f

    @property
    def linear_layer_params(self) -> int:
        """A Gated DeltaNet layer's parameters: the q/k/v, z, beta and decay projections, the
        conv, the decay's A and bias, the gated norm and out_proj."""
        d, nv = self.hidden_size, self.linear_num_value_heads
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = nv * self.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        mixer = (d * conv_dim + d * value_dim + 2 * d * nv + conv_dim * self.linear_conv_kernel_dim
                 + 2 * nv + self.linear_value_head_dim + value_dim * d)
        return mixer + self._mlp_and_norm_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def num_params(self) -> int:
        """Every parameter, as Hugging Face counts them (tied embeddings once)."""
        layers = self.attention_layers * self.layer_params
        if self.linear_layers:
            layers += self.linear_layers * self.linear_layer_params
        return layers + self._sparse_extra_params + self.embedding_params + self.hidden_size

    def dense_flops_per_token(self) -> float:
        """6 N, forward and backward: N counts every parameter a token runs through, so not the
        input embedding table when it is not tied to the output projection (a lookup costs no
        FLOPs), nor the experts beyond a token's top-k."""
        n = self.num_params - self.inactive_expert_params
        if not self.tie_word_embeddings:
            n -= self.vocab_size * self.hidden_size
        return 6.0 * n

    def attention_flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Attention scores and values, forward and backward: PaLM's 12 L Hq Dh S (appendix B)
        counts the full S x S scores; causal (MaxText's and Megatron's count) halves it, counting
        only the scores a causal kernel computes."""
        attn = 12 * self.attention_layers * self.num_heads * self.head_dim * seq_len
        return attn / 2 if causal else attn

    def linear_attention_flops_per_token(self) -> float:
        """The delta rule's own work (beyond its projections' 6N), forward and backward: per
        token and value head, the recurrent form's four products with the [Dk, Dv] state
        (decay, read, write, output), 2 FLOPs per element each, times 3. Independent of the
        sequence length."""
        state = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        return 3 * 4 * 2 * self.linear_layers * state

    @property
    def fp8_params(self) -> int:
        """The layers' projection matrices model.fp8 runs in FP8 (models.fp8): q, k, v, o, gate,
        up, down; a Gated DeltaNet's qkv, z and out (its beta and decay ones stay in bf16)."""
        d, hd = self.hidden_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        mlp = 3 * d * self.intermediate_size
        attention = (3 if self.attention_output_gate else 2) * d * q + 2 * d * kv + mlp
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        linear = d * (2 * key_dim + value_dim) + 2 * d * value_dim + mlp
        # a sparse layer's experts stay in the compute dtype (models.moe)
        return (self.attention_layers * attention + self.linear_layers * linear
                - self.sparse_layers * mlp)

    def fp8_flops_per_token(self) -> float:
        """Of train_flops_per_token, those model.fp8 runs as FP8 matmuls: 6 x fp8_params."""
        return 6.0 * self.fp8_params

    def train_flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Training FLOPs per token: what the planner's compute time and the trainer's MFU use."""
        return (self.dense_flops_per_token() + self.attention_flops_per_token(seq_len, causal)
                + self.linear_attention_flops_per_token())

