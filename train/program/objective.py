"""What a train step differentiates for one microbatch: the loss sum, plus for a model with
sparse MoE layers router_aux_loss_coef times the routers' load-balancing loss
(models.moe.load_balancing_loss, over every token of the microbatch) and, where
router_z_loss_coef is set, that times the routers' z-loss (models.moe.router_z_loss; not
logged apart).

The step divides every microbatch's sum by the step's counted tokens, so the balancing loss is
weighted by the microbatch's counted tokens here: the step then minimises
loss + coef * aux_loss, each the token-weighted mean over its microbatches (with equal counts,
the plain mean of the microbatches', as transformers adds it to each forward's loss).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp


def objective(model, tokens, targets, segment_ids, loss_fn: Callable):
    """(the sum to differentiate, (loss sum, counted tokens, aux_loss x counted tokens)), all
    float32 scalars; a dense model's is its loss sum (the program as without experts)."""
    if not model.config.is_moe:
        loss, count = model.loss(tokens, targets, segment_ids, loss_fn=loss_fn)
        return loss, (loss, count, jnp.zeros((), jnp.float32))
    config = model.config
    if not config.router_z_loss_coef:  # the program as without the z-loss
        loss, count, aux = model.loss_and_aux(tokens, targets, segment_ids, loss_fn=loss_fn)
        weighted = aux * count
        return loss + config.router_aux_loss_coef * weighted, (loss, count, weighted)
    loss, count, aux, z = model.loss_and_router_losses(tokens, targets, segment_ids,
                                                       loss_fn=loss_fn)
    weighted = aux * count
    total = loss + config.router_aux_loss_coef * weighted + config.router_z_loss_coef * z * count
    return total, (loss, count, weighted)
