"""Next-token cross-entropy that ignores padding and masked labels (over chunks of tokens on a mesh:
basp_jax.vocab, Transformer.loss)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_lm_loss(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array | None = None):
    """(sum of token losses, number of counted tokens), both float32 scalars.

    logits [B, S, V]; targets [B, S] are the labels *for each position*, i.e. already shifted
    (targets[:, t] is the token that follows tokens[:, t]). A position counts when its target is
    >= 0 (use -100 or any negative id for padding, as Hugging Face does) and loss_mask, when given,
    is nonzero there. The mean is sum / max(count, 1); returning the pair lets gradient
    accumulation weight every token equally across microbatches.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {logits.shape} and targets {targets.shape} disagree on [batch, seq]")
    logits = logits.astype(jnp.float32)
    valid = targets >= 0
    if loss_mask is not None:
        if loss_mask.shape != targets.shape:
            raise ValueError(f"loss_mask must have shape {targets.shape}, got {loss_mask.shape}")
        valid = valid & (loss_mask != 0)
    safe = jnp.where(valid, targets, 0)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    losses = jnp.where(valid, log_z - target_logit, 0.0)
    return losses.sum(dtype=jnp.float32), valid.sum(dtype=jnp.float32)
