"""Sampling with a key/value cache, on one device: enough to see what a model writes.

    tokens = models.sampler.generate(model, prompt_ids, max_new_tokens=64)            # greedy
    tokens = models.sampler.generate(model, prompt_ids, max_new_tokens=64, temperature=0.8,
                                     top_p=0.95, seed=0, eos_ids=[eos])

The cache is preallocated to prompt + max_new_tokens; the prompt runs once (prefill), then one
token per call of a jitted step whose cache is donated (updated in place) and whose position is
an argument, so the step compiles once for the whole generation. No batching, no mesh: the model
must be built without one (models.from_pretrained(path)).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import ModelError
from .transformer import Transformer


def pick(logits, key, temperature, top_p):
    """Next token [B] from last-position logits [B, vocab]: argmax when temperature is 0, else a
    sample at `temperature` from the smallest set of tokens whose probability reaches top_p
    (nucleus). Both are traced values, so one compiled step serves every setting."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    ordered = jnp.sort(scaled, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    # keep a token while the mass before it is below top_p (the most likely one always)
    kept = jnp.sum((jnp.cumsum(probs, axis=-1) - probs) < top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)
    sampled = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


@functools.lru_cache(maxsize=8)
def _programs(graphdef):
    """(prefill, step) jitted for one model structure; both donate the cache."""

    def advance(state, tokens, cache, index, key, temperature, top_p):
        model = nnx.merge(graphdef, state)
        hidden, cache = model.decode(tokens, cache, index)
        key, sub = jax.random.split(key)
        return pick(model.logits(hidden[:, -1]), sub, temperature, top_p), cache, key

    def first(state, tokens, cache, key, temperature, top_p):
        return advance(state, tokens, cache, 0, key, temperature, top_p)

    return jax.jit(first, donate_argnums=2), jax.jit(advance, donate_argnums=2)


def generate(model: Transformer, prompt: Iterable[int], *, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             eos_ids: Iterable[int] = (), on_token: Callable[[int], None] | None = None
             ) -> list[int]:
    """The new token ids after `prompt` (at most max_new_tokens; stops after an eos_ids token).
    temperature 0 is greedy (argmax); on_token(id) is called as each token is chosen."""
    prompt = np.asarray(list(prompt), dtype=np.int64)
    vocab = model.config.vocab_size
    if prompt.ndim != 1 or len(prompt) == 0:
        raise ModelError("the prompt must hold at least one token id")
    if prompt.min() < 0 or prompt.max() >= vocab:
        raise ModelError(f"prompt token ids must lie in [0, {vocab}), got {prompt.min()}.."
                         f"{prompt.max()}; the tokenizer belongs to another model")
    if max_new_tokens < 1:
        raise ModelError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not temperature >= 0 or not 0 < top_p <= 1:  # (written so that NaN fails too)
        raise ModelError(f"need temperature >= 0 and 0 < top_p <= 1, got temperature="
                         f"{temperature}, top_p={top_p}")
    limit = model.config.max_position_embeddings
    if len(prompt) + max_new_tokens > limit:  # the cache is allocated for all of them at once
        raise ModelError(f"the prompt ({len(prompt)} tokens) and max_new_tokens={max_new_tokens} "
                         f"exceed the model's max_position_embeddings={limit}; ask for fewer")
    if model.mesh is not None:
        raise ModelError("generate runs on one device: load the model without a mesh")
    eos = set(int(e) for e in eos_ids)
    graphdef, state = nnx.split(model)
    prefill, step = _programs(graphdef)
    cache = model.init_cache(1, len(prompt) + max_new_tokens)
    key = jax.random.key(seed)
    temperature, top_p = jnp.float32(temperature), jnp.float32(top_p)
    token, cache, key = prefill(state, jnp.asarray(prompt[None], jnp.int32), cache, key,
                                temperature, top_p)
    out: list[int] = []
    for i in range(max_new_tokens):
        out.append(int(token[0]))
        if on_token is not None:
            on_token(out[-1])
        if out[-1] in eos or i == max_new_tokens - 1:
            break
        token, cache, key = step(state, token[:, None], cache, jnp.int32(len(prompt) + i), key,
                                 temperature, top_p)
    return out
