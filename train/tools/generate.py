"""See what a model writes: sample a continuation of a prompt, on one device.

    python -m train.tools.generate --hf_path DIR --prompt "Once upon a time" [--max-new-tokens 64]
        [--temperature 0.8 --top-p 0.95 --seed 0]
    python -m train.tools.generate --run_dir runs/NAME --prompt-ids 1,2,3   # a run's newest checkpoint

--hf_path reads a local Hugging Face directory (config.json, safetensors, tokenizer.json);
--run_dir the newest complete checkpoint in RUN/checkpoints, with the model RUN/config.yaml
describes. The prompt is text (tokenized with --tokenizer, else the tokenizer.json of the Hugging
Face directory, else the run's data.tokenizer) or token ids (--prompt-ids). Temperature 0 (the
default) is greedy. Generation stops after --max-new-tokens or an end-of-text token (--eos-id,
default the model's eos_token_id, or the run's data.eos_id). The continuation is printed (text, or
ids when there is no tokenizer). Runs on the first device, without sequence parallelism
(models.sampler). Exit status 0, or 2 with one line on stderr for bad input.
"""

from __future__ import annotations

import argparse
import os
import sys

from train.config.dtypes import COMPUTE as DTYPES  # float32, bfloat16, float16 (no JAX import)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors (e.g. --max-new-tokens abc) are one line and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: generate: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m train.tools.generate",
                                description="Sample a continuation of a prompt (KV cache, one "
                                            "device).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf_path", "--hf-path", type=os.path.expanduser, help="a local Hugging Face model directory")
    src.add_argument("--run_dir", "--run-dir", type=os.path.expanduser, help="a training run: its newest checkpoint")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma or space separated")
    p.add_argument("--tokenizer", type=os.path.expanduser, help="tokenizer.json (default: the model directory's)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos-id", type=int, action="append",
                   help="stop after this id (repeatable; default: the model's eos_token_id)")
    p.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: float32, or the run's)")
    return p


MAX_ID = 2**31 - 1  # token ids are int32 on the device
MAX_SEED = 2**32 - 1  # as run.seed
MAX_NEW_TOKENS = 1 << 20  # the cache is preallocated for all of them
# A positive temperature divides the logits: below the floor float32 overflows to inf (NaN
# probabilities); above the ceiling every token is equally likely to within float32.
TEMPERATURE_RANGE = (1e-3, 1e3)


def check_numbers(args) -> None:
    """Every number of the command line in its range, before a model is loaded: one line
    (ModelError) naming the flag and what would work. NaN fails every comparison below."""
    from models.config import ModelError

    low, high = TEMPERATURE_RANGE
    if not (args.temperature == 0 or low <= args.temperature <= high):
        raise ModelError(f"--temperature must be 0 (greedy) or lie in [{low:g}, {high:g}], got "
                         f"{args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ModelError(f"--top-p is a probability mass in (0, 1], got {args.top_p}")
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise ModelError(f"--max-new-tokens must lie in [1, {MAX_NEW_TOKENS:,}], got "
                         f"{args.max_new_tokens:,}")
    if not 0 <= args.seed <= MAX_SEED:
        raise ModelError(f"--seed must lie in [0, {MAX_SEED}], got {args.seed}")
    for eos in args.eos_id or ():
        if not 0 <= eos <= MAX_ID:
            raise ModelError(f"--eos-id must be a token id in [0, {MAX_ID}], got {eos}")
    if args.prompt_ids is not None:
        _prompt_ids(args.prompt_ids)


def _prompt_ids(text: str) -> list[int]:
    from models.config import ModelError

    # commas separate (spaces around them allowed): an empty id between two is a typo
    words = [t for part in text.split(",") for t in (part.split() or [""])]
    if "" in words:
        raise ModelError(f"--prompt-ids has an empty id in {text!r}; write one integer between "
                         f"each two commas, e.g. 1,2,3")
    try:
        ids = [int(t) for t in words]
    except ValueError:
        raise ModelError(f"--prompt-ids must be integers separated by commas or spaces, got "
                         f"{text!r}") from None
    bad = [i for i in ids if not 0 <= i <= MAX_ID]
    if bad:  # (numpy cannot even hold 10**30; the model's own vocabulary is checked later)
        raise ModelError(f"--prompt-ids must be token ids in [0, {MAX_ID}], got {bad[0]}")
    return ids


def _tokenizer(path: str | None):
    if path is None:
        return None
    from models.config import ModelError
    from models.tokenizer import load_tokenizer

    return load_tokenizer(path, ModelError)


def _eos_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def load_model(args):
    """(model on one device, tokenizer path or None, default eos ids)."""
    import jax.numpy as jnp

    from models import hf

    if args.hf_path:
        dtype = getattr(jnp, args.dtype or "float32")
        model = hf.from_pretrained(args.hf_path, dtype=dtype)
        local = os.path.join(args.hf_path, "tokenizer.json")
        return (model, local if os.path.isfile(local) else None,
                _eos_ids(model.config.eos_token_id))
    model, cfg = restore_model(args.run_dir, dtype=args.dtype)
    tokenizer = cfg.data.tokenizer
    if tokenizer is None and cfg.model.hf_path:
        local = os.path.join(cfg.model.hf_path, "tokenizer.json")
        tokenizer = local if os.path.isfile(local) else None
    eos = _eos_ids(model.config.eos_token_id) or _eos_ids(cfg.data.eos_id)
    return model, tokenizer, eos


def restore_model(run_dir: str, *, dtype: str | None = None):
    """(model on the first device, the run's Config): the Transformer that `run_dir/config.yaml`
    describes, with the parameters of the newest complete checkpoint (for sampling:
    models.sampler). dtype: the compute dtype (default: the run's model.dtype)."""
    import jax
    from flax import nnx

    import models
    from basp_jax.sharding import abstract_arrays
    from train.checkpoint import store as checkpoint
    from train.config.schema import load_config
    from train.program.model_setup import model_config, model_options

    config_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config_path):
        raise checkpoint.CheckpointError(
            f"{run_dir!r} has no config.yaml: not a training run directory")
    cfg = load_config(config_path)
    directory = checkpoint.checkpoint_dir(run_dir)
    if not checkpoint.complete_steps(directory):
        raise checkpoint.CheckpointError(f"{directory} holds no complete checkpoint")
    mcfg = model_config(cfg)
    # on one device, whatever kernel the run trained with
    options = models.RunOptions.of(model_options(cfg, dtype=dtype), attn_impl="auto")
    model = models.abstract_model(mcfg, options=options)
    abstract = nnx.state(model, nnx.Param)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = abstract_arrays(nnx.to_pure_dict(abstract), device)
    params = checkpoint.restore_newest_params(directory, target)
    nnx.replace_by_pure_dict(abstract, params)
    nnx.update(model, abstract)
    return model, cfg


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from models.config import ModelError

    errors: tuple[type, ...] = (ModelError,)
    if args.run_dir:
        from train.checkpoint.store import CheckpointError
        from train.config.schema import ConfigError

        errors += (CheckpointError, ConfigError)
    try:
        check_numbers(args)
        model, tok_path, eos = load_model(args)
        tok = _tokenizer(args.tokenizer or tok_path)
        if args.prompt is not None:
            if tok is None:
                raise ModelError("--prompt needs a tokenizer: the model has no tokenizer.json; "
                                 "pass --tokenizer FILE or --prompt-ids")
            # with the tokenizer's own special tokens (e.g. Llama 3's <|begin_of_text|>), as
            # transformers' pipelines encode a prompt
            try:
                prompt = tok.encode(args.prompt).ids
            except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception)
                raise ModelError(f"the tokenizer cannot encode the prompt "
                                 f"({' '.join(str(e).split())[:200]}); use the model's own "
                                 "tokenizer or --prompt-ids") from None
        else:
            prompt = _prompt_ids(args.prompt_ids)
        from models.sampler import generate

        new = generate(model, prompt, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                       eos_ids=args.eos_id if args.eos_id is not None else eos)
    except errors as e:
        print(f"error: generate: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if tok is not None and args.prompt is not None:
        print(tok.decode(new, skip_special_tokens=True))
    else:
        print(" ".join(map(str, new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
