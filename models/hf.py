"""Hugging Face checkpoint interop: load a local model directory onto a mesh, save it back.

A multimodal Qwen3.5 directory (model_type qwen3_5) loads as its text model: the text_config,
the tensors under model.language_model. (models.safetensors_io.Checkpoint reads them by the text
model's names); its vision tower is not read. Saving writes the text model (Qwen3_5ForCausalLM).

The name mapping is mechanical because the modules use Hugging Face's attribute names:

    ('embed_tokens', 'weight')                     <-> model.embed_tokens.weight
    ('layers', i, 'self_attn', 'q_proj', 'kernel') <-> model.layers.{i}.self_attn.q_proj.weight  (T)
    ('layers', i, 'self_attn', 'q_proj', 'bias')   <-> model.layers.{i}.self_attn.q_proj.bias
    ('norm', 'weight')                             <-> model.norm.weight
    ('lm_head', 'kernel')                          <-> lm_head.weight                            (T)

(T): our kernels are [in, out]; Hugging Face Linear weights are [out, in].

A sparse MLP's expert weights (models.moe) are one array per projection, [experts, in, out]:
('layers', i, 'mlp', 'experts', 'gate_proj', 'kernel') slice e is
model.layers.{i}.mlp.experts.{e}.gate_proj.weight (T), as transformers writes its Qwen3-MoE
checkpoints (and reads them, fusing them in memory in transformers 5); the router is
('layers', i, 'mlp', 'gate', 'kernel') <-> model.layers.{i}.mlp.gate.weight (T).

With scanned layers (the default) a layer parameter is one stacked array, e.g.
('layers', 'self_attn', 'q_proj', 'kernel') [num_layers, in, out]: its slice i is
model.layers.{i}.self_attn.q_proj.weight (T). Loading reads the layers' tensors into the stack
(each device only its slice), saving writes one tensor per layer again. Layers stacked by their
pattern of `period` kinds (a hybrid's, models.transformer.Period) are
('layers', 'blocks', j, ...) [num_layers / period, ...]: slice r is layer r * period + j.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from huggingface_hub import split_state_dict_into_shards_factory

from .config import ModelConfig, ModelError
from .layers import axis_names
from .options import RunOptions
from .safetensors_io import INDEX_FILE, SINGLE_FILE, Checkpoint, write_safetensors
from .transformer import PERIOD_BLOCKS, Transformer, abstract_model

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # transformers' default max_shard_size, "5GB"


def hf_name(path: tuple) -> tuple[str, bool]:
    """(Hugging Face tensor name, whether our array is the transpose of it) for a parameter path."""
    parts = [str(p) for p in path]
    transpose = parts[-1] == "kernel"
    if transpose:
        parts[-1] = "weight"
    name = ".".join(parts)
    return (name if parts[0] == "lm_head" else "model." + name), transpose


def is_stacked(path: tuple) -> bool:
    """Whether a parameter path is a scanned layer stack ('layers', <name>, ...), leading axis
    the layer, rather than one layer's ('layers', i, ...)."""
    return len(path) > 1 and str(path[0]) == "layers" and not str(path[1]).isdigit()


def is_expert(path: tuple) -> bool:
    """Whether a parameter holds every expert of a sparse MLP ([experts, ...] after any layer
    axis): (..., 'experts', <projection>, 'kernel')."""
    return "experts" in [str(p) for p in path[:-1]]


def stack_axes(path: tuple) -> int:
    """How many leading axes of a parameter index Hugging Face tensors: a scanned stack's layer,
    then a sparse MLP's expert."""
    return int(is_stacked(path)) + int(is_expert(path))


def _slice_path(path: tuple, layer=None, expert=None, period: int = 1) -> tuple:
    """A stacked parameter's path with its layer and expert indices written in, where Hugging
    Face's names hold them (after 'layers', after 'experts'); slice `layer` of a stack by
    period, ('layers', 'blocks', j, ...), is layer layer * period + j ('*' stays '*')."""
    parts = list(path)
    if expert is not None:
        parts.insert([str(p) for p in parts].index("experts") + 1, expert)
    if layer is not None:
        if str(parts[1]) == PERIOD_BLOCKS:
            parts[1:3] = [layer if layer == "*" else layer * period + int(parts[2])]
        else:
            parts.insert(1, layer)
    return tuple(parts)


def layer_period(paths) -> int:
    """The period of a stack by period among parameter paths (how many of its blocks), else 1."""
    return 1 + max((int(p[2]) for p in paths if len(p) > 2 and str(p[0]) == "layers"
                    and str(p[1]) == PERIOD_BLOCKS), default=0)


def hf_names(path: tuple, shape: tuple, period: int = 1) -> tuple[list[str], bool]:
    """([Hugging Face tensor name per slice], transposed?) of a parameter: one name, or one per
    index of its leading stack axes (stack_axes: a stacked parameter's layers, an expert
    array's experts), in C order. period: of the layers' stack (layer_period)."""
    layers = range(shape[0]) if is_stacked(path) else [None]
    experts = range(shape[stack_axes(path) - 1]) if is_expert(path) else [None]
    names = [hf_name(_slice_path(path, i, e, period))[0] for i in layers for e in experts]
    return names, hf_name(path)[1]


def display_name(path: tuple) -> str:
    """A parameter's Hugging Face name with '*' for the layer and expert it stacks."""
    return hf_name(_slice_path(path, "*" if is_stacked(path) else None,
                               "*" if is_expert(path) else None))[0]


def _param_leaves(state) -> list[tuple[tuple, object]]:
    """(path, leaf) for every parameter of an nnx.State, in a stable order."""
    return [(tuple(path), leaf) for path, leaf in nnx.to_flat_state(state)]


def _leaf_value(leaf):
    if isinstance(leaf, nnx.Variable):
        return leaf.get_value() if hasattr(leaf, "get_value") else leaf.value
    return leaf


def load_hf_params(path: str, config: ModelConfig | None = None, *,
                   options: RunOptions | None = None, **option_fields):
    """The parameters of a Hugging Face directory as an nnx.State matching
    `nnx.state(Transformer(config, options=options), nnx.Param)` (options as for Transformer:
    a models.RunOptions or its fields as keywords; its param_dtype, scan_layers, mesh and
    param_sharding matter here).

    With a mesh, each parameter is created with jax.make_array_from_callback under its sharding
    from options.rules (its logical axis names): every device receives only its slice, read from
    the memory-mapped file, so no device or host holds the whole checkpoint. Without a mesh,
    arrays go to the default device. Use with nnx.update(model, params).
    """
    options = RunOptions.of(options, **option_fields)
    config = ModelConfig.from_hf(path) if config is None else config
    checkpoint = Checkpoint(path)
    dtype = np.dtype(options.param_dtype)
    rules = options.rules
    flat = []
    for key, names, transpose, leaf in _expected_tensors(checkpoint, config, options.param_dtype,
                                                         options.scan_layers):
        tensors = [checkpoint.slice(name) for name in names]  # lazy: each device reads its block
        shape = tuple(_leaf_value(leaf).shape)
        sharding = None if rules is None else rules.sharding(axis_names(leaf), shape)
        flat.append((key, _place(tensors, stack_axes(key), transpose, shape, dtype, sharding)))
    return nnx.from_flat_state(flat)


def _expected_tensors(checkpoint: Checkpoint, config: ModelConfig, param_dtype=jnp.float32,
                      scan_layers: bool = True):
    """(state key, HF names, transposed?, abstract nnx.Param) of every parameter of `config`, after checking
    that the directory holds each tensor with the matching shape (reads only the headers)."""
    state = nnx.state(abstract_model(config, param_dtype=param_dtype, scan_layers=scan_layers),
                      nnx.Param)
    out = []
    leaves = _param_leaves(state)
    period = layer_period(key for key, _ in leaves)
    for key, leaf in leaves:
        shape = tuple(_leaf_value(leaf).shape)
        names, transpose = hf_names(key, shape, period)
        one = shape[stack_axes(key):]
        hf_shape = one[::-1] if transpose else one
        for name in names:
            found = checkpoint.shape(name)
            if found != hf_shape:
                raise ModelError(
                    f"tensor {name} has shape {found} in {checkpoint.directory} but its "
                    f"config.json needs {hf_shape}; the weights belong to another model"
                )
            checkpoint.check(name)
        out.append((key, names, transpose, leaf))
    return out


def check_pretrained(path: str, config: ModelConfig | None = None) -> ModelConfig:
    """The directory's ModelConfig, after checking that every tensor it needs is present with the
    right shape, a readable dtype and all its bytes in the file; reads config.json, the
    safetensors headers and file sizes only (nothing is loaded)."""
    config = ModelConfig.from_hf(path) if config is None else config
    _expected_tensors(Checkpoint(path), config)
    return config


def _place(tensors: list, stacked: int, transpose: bool, shape, dtype, sharding):
    """A (sharded) array of `shape` from its tensors: one, or one per index of its `stacked`
    leading axes (C order), stacked."""
    grid = np.arange(len(tensors)).reshape(shape[:stacked])

    def read_one(tensor, index=None):
        if transpose:
            block = tensor[:].T if index is None else tensor[index[1], index[0]].T
        else:
            block = tensor[:] if index is None else tensor[index]
        return np.ascontiguousarray(block).astype(dtype)

    def read(index=None):
        if not stacked:
            return read_one(tensors[0], index)
        picked = grid if index is None else grid[index[:stacked]]
        rest = None if index is None else index[stacked:]
        blocks = [read_one(tensors[i], rest) for i in picked.flat]
        return np.stack(blocks).reshape(picked.shape + blocks[0].shape)

    if sharding is None:
        return jnp.asarray(read())
    return jax.make_array_from_callback(shape, sharding, lambda index: read(index))


def from_pretrained(path: str, *, options: RunOptions | None = None,
                    **option_fields) -> Transformer:
    """A Transformer with the weights of a local Hugging Face directory (config.json + safetensors).

    How it runs is a models.RunOptions (`options=`, or its fields as keywords: mesh, dtype,
    param_dtype, attn_impl, remat, layout, scan_layers, param_sharding). Here param_dtype, the
    storage dtype, defaults to dtype, the compute dtype. With a mesh, parameters are sharded by
    `param_sharding` (basp_jax.sharding.PARAM_SHARDINGS) and the model computes on the mesh; its
    logits come back sharded as activations (basp_jax.ACTIVATION_SPEC).
    """
    if option_fields.get("param_dtype") is None:
        option_fields.pop("param_dtype", None)
        if "dtype" in option_fields:
            option_fields["param_dtype"] = option_fields["dtype"]
    options = RunOptions.of(options, **option_fields)
    config = ModelConfig.from_hf(path)
    model = abstract_model(config, options=options)
    nnx.update(model, load_hf_params(path, config, options=options))
    return model


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def hf_state_dict(model_or_state) -> dict[str, np.ndarray]:
    """{Hugging Face name: numpy array in Hugging Face layout}, gathered to host memory.

    Takes a Transformer or its nnx.State of parameters. Every process must call it when the
    parameters span several processes (it all-gathers).
    """
    state = model_or_state
    if isinstance(model_or_state, nnx.Module):
        state = nnx.state(model_or_state, nnx.Param)
    out = {}
    leaves = _param_leaves(state)
    period = layer_period(key for key, _ in leaves)
    for key, leaf in leaves:
        array = _to_host(_leaf_value(leaf))
        names, transpose = hf_names(key, array.shape, period)
        n = stack_axes(key)
        for name, part in zip(names, array.reshape(-1, *array.shape[n:]) if n else [array]):
            out[name] = np.ascontiguousarray(part.T) if transpose else part
    return out


def _largest_magnitudes(values: list) -> np.ndarray:
    """max |x| of each array (NaN where one holds a NaN), read on the host a shard at a time; in
    a multi-process run the maximum over every process's shards (all processes must call it)."""
    local = []
    for value in values:
        shards = ([s.data for s in value.addressable_shards if s.replica_id == 0]
                  if isinstance(value, jax.Array) else [value])
        largest = np.float64(0.0)
        for shard in shards:
            data = np.asarray(shard)
            if data.size:  # np.maximum keeps a NaN
                largest = np.maximum(largest, np.float64(np.max(np.abs(data))))
        local.append(largest)
    local = np.asarray(local, np.float64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        local = np.max(multihost_utils.process_allgather(local), axis=0)
    return local


def check_exportable(state, dtype: str | None = None) -> None:
    """Raise ModelError naming the first parameter of `state` (an nnx.State of parameters) that
    would not be finite in an export in `dtype` (None: its own): one holding NaN or Inf, or one
    whose largest |value| is beyond the dtype's range (float16's is 65504). Reads the values only:
    save_pretrained calls it before anything is written."""
    leaves = [(key, _leaf_value(leaf)) for key, leaf in _param_leaves(state)]
    leaves = [(key, value) for key, value in leaves if jnp.issubdtype(value.dtype, jnp.inexact)]
    for (key, value), largest in zip(leaves, _largest_magnitudes([v for _, v in leaves])):
        target = jnp.dtype(dtype) if dtype else value.dtype
        with np.errstate(over="ignore"):  # the overflow is what is looked for
            if np.isfinite(np.asarray(largest).astype(target)):
                continue
        name = display_name(key)
        if not np.isfinite(largest):
            raise ModelError(f"parameter {name} holds NaN or Inf values; an export would carry "
                             "them")
        raise ModelError(
            f"parameter {name} has a largest |value| of {largest:.6g}, beyond the range of "
            f"{np.dtype(target).name} (largest {float(jnp.finfo(target).max):.6g}): it would be "
            "inf in the export; export in a wider dtype (bfloat16 or float32)")


def save_pretrained(model: Transformer, path: str, *,
                    max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES, params=None,
                    dtype: str | None = None) -> None:
    """Write config.json and model.safetensors (or shards + model.safetensors.index.json when the
    weights exceed max_shard_size) in the layout `transformers` loads.

    `params` (an nnx.State of parameters) overrides the model's own, e.g. the trainer's final state.
    Tensors are written in the parameters' dtype, or in `dtype` (e.g. "bfloat16"); a parameter
    that would not be finite in it is refused before anything is written (check_exportable). All
    processes must call it (parameters are gathered one shard at a time); only process 0 writes.
    """
    config: ModelConfig = model.config
    state = nnx.state(model, nnx.Param) if params is None else params
    check_exportable(state, dtype)
    values, transposed = {}, {}  # per Hugging Face tensor; stacks split per layer
    leaves = _param_leaves(state)
    period = layer_period(key for key, _ in leaves)
    for key, leaf in leaves:
        value = _leaf_value(leaf)
        names, transpose = hf_names(key, value.shape, period)
        n = stack_axes(key)
        parts = _to_host(value).reshape(-1, *value.shape[n:]) if n else [value]
        for name, part in zip(names, parts):
            values[name], transposed[name] = part, transpose
    try:  # the same split (and file names) as transformers' save_pretrained
        split = split_state_dict_into_shards_factory(
            values, max_shard_size=max_shard_size, get_storage_size=lambda value: value.size * (
                jnp.dtype(dtype).itemsize if dtype else value.dtype.itemsize),
            filename_pattern="model{suffix}.safetensors")
    except ValueError as e:  # a max_shard_size it cannot parse
        raise ModelError(f"max_shard_size must be bytes or like '5GB'/'500MB': {e}") from None
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(path, exist_ok=True)
        for stale in os.listdir(path):
            if stale == INDEX_FILE or re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", stale):
                os.remove(os.path.join(path, stale))
    dtypes = set()
    for file_name, names in split.filename_to_tensors.items():
        tensors = {}
        for name in names:  # gathered to the host one shard at a time
            array = _to_host(values[name])
            if dtype is not None:
                array = array.astype(jnp.dtype(dtype))
            tensors[name] = array.T if transposed[name] else array
            dtypes.add(str(np.dtype(array.dtype)))
        if writer:
            write_safetensors(os.path.join(path, file_name), tensors)
    if not writer:
        return
    if split.is_sharded:
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f,
                      indent=2)
    hf_config = config.to_hf()
    dtype_name = dtypes.pop() if len(dtypes) == 1 else "float32"
    hf_config["torch_dtype"] = hf_config["dtype"] = dtype_name
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
