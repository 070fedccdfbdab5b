"""What makes a Hugging Face export usable as is, beside the weights models.save_pretrained writes:
the tokenizer (data.tokenizer's directory, or model.hf_path's), bos/eos ids in config.json and a
generation_config.json, so `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained(dir)` and
`generate` need nothing else."""

from __future__ import annotations

import json
import os
import shutil

from ..config.schema import Config

# the tokenizer files transformers reads (tokenizer.json is the one the trainer itself uses)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja")


def tokenizer_source(cfg: Config) -> str | None:
    """The tokenizer.json the export copies: data.tokenizer, else model.hf_path's, else none."""
    if cfg.data.tokenizer:
        return cfg.data.tokenizer
    if cfg.model.hf_path and os.path.isfile(os.path.join(cfg.model.hf_path, "tokenizer.json")):
        return os.path.join(cfg.model.hf_path, "tokenizer.json")
    return None


def special_ids(cfg: Config, hf_config: dict) -> tuple[int | None, int | list | None]:
    """(bos, eos): the model's own (model.hf_path's config), else for eos data.eos_id, else the
    end-of-document id the token files' sidecars record (the documents the run trained on)."""
    eos = hf_config.get("eos_token_id")
    if eos is None:
        eos = cfg.data.eos_id if cfg.data.eos_id is not None else sidecar_eos(cfg, hf_config)
    return hf_config.get("bos_token_id"), eos


def sidecar_eos(cfg: Config, hf_config: dict) -> int | None:
    """The eos_id that the sidecars of data.source=tokens's files (train.tools.tokenize) record
    when every file has a sidecar that is trusted (train.data.checked_sidecar) and they agree."""
    from ..data import DataError, checked_sidecar  # (numpy: only for an export)

    if cfg.data.source != "tokens":
        return None
    try:
        found = {(checked_sidecar(path, cfg.data, hf_config["vocab_size"]) or {}).get("eos_id")
                 for path in (list(cfg.data.mix) or [cfg.data.path])}
    except DataError:  # a file changed since start-up: its sidecar claims nothing of the run
        return None
    return found.pop() if len(found) == 1 else None


def write(cfg: Config, directory: str) -> None:
    """Complete the export in `directory` (config.json written already)."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        hf_config = json.load(f)
    bos, eos = special_ids(cfg, hf_config)
    hf_config["bos_token_id"], hf_config["eos_token_id"] = bos, eos
    with open(path, "w") as f:
        json.dump(hf_config, f, indent=2)
    generation = {"_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos}
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in generation.items() if v is not None}, f, indent=2)
    source = tokenizer_source(cfg)
    if source is None:
        return
    folder = os.path.dirname(os.path.abspath(source))
    shutil.copyfile(source, os.path.join(directory, "tokenizer.json"))
    for name in TOKENIZER_FILES[1:]:  # its companions, when the tokenizer came with them
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(directory, name))
    if not os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        _tokenizer_config(source, directory, bos, eos, hf_config)


def _tokenizer_config(source: str, directory: str, bos, eos, hf_config: dict) -> None:
    """A tokenizer_config.json for a bare tokenizer.json: the fast tokenizer class, its special
    tokens named by id (so transformers' tokenizer knows its eos), the model's context length."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(source)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for key, ids in (("bos_token", bos), ("eos_token", eos)):
        first = ids[0] if isinstance(ids, list) else ids
        if first is not None and tok.id_to_token(first) is not None:
            config[key] = tok.id_to_token(first)
    if hf_config.get("max_position_embeddings"):
        config["model_max_length"] = hf_config["max_position_embeddings"]
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
