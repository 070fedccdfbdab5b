"""Typed training config: dataclasses with defaults, read from YAML plus `key.sub=value` overrides.

    cfg = load_config("configs/demo_cpu.yaml", ["train.steps=20", "parallel.mode=ulysses"])

Unknown keys, values of the wrong type, required keys left out (None until set: no placeholder
value stands in for them) and impossible combinations raise a ConfigError whose one line names the
key and what would work. Nothing here imports JAX: the CLI must read the config
(runtime.cpu_devices, runtime.distributed) before JAX initialises its backends.

A config file may start from others: `include: base.yaml` (or a list of files, merged in order)
at its top level reads those first, relative paths from the including file's folder, and lays
the including file's values over theirs, section by section and key by key (a value that is not
a mapping replaces the included one whole; a section left empty adds nothing). Included files
may include others (configs/gpu/ holds an example: _base.yaml and the files on it); the resolved
config (what `to_yaml` writes to {run.dir}/config.yaml) holds the values, not the include.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from typing import Any, Literal, Optional, Union

import yaml

from . import dtypes, paths


class ConfigError(ValueError):
    """A config that cannot run; the single-line message names the key and the fix."""


# dtype keys take train.dtypes' names: model.dtype and checkpoint.export_dtype any (model.dtype
# also auto), model.param_dtype and optimizer.mu_dtype those that store parameters
ComputeDtype = Literal[dtypes.COMPUTE]
ComputeDtypeOrAuto = Literal[(*dtypes.COMPUTE, "auto")]
StorageDtype = Literal[dtypes.STORAGE]


# seeds key numpy's and JAX's generators: a non-negative 32-bit integer fits both everywhere
MAX_SEED = 2**32 - 1

# train.peers polls the peers every min(1 s, timeout / 4); shorter timeouts would fire on noise
MIN_PEER_TIMEOUT_S = 2.0
MAX_PEER_TIMEOUT_S = 7 * 24 * 3600.0  # a week: no live peer is silent longer (0 turns it off)

# Upper bounds of counts, far beyond any real run: past them JAX, XLA or the int32 step counter
# and positions fail with tracebacks (or hang) instead of one line.
MAX_INT32 = 2**31 - 1  # train.steps, data.seq_len, train.microbatch_size x grad_accum
MAX_CPU_DEVICES = 1024  # emulated CPU devices; XLA's CPU client refuses absurd counts
MAX_PROCESSES = 1 << 20
MAX_EVAL_TOKENS = 1 << 28  # the held-out batch: 1 GiB per int32 array


def _require(key: str, value: Any, what: str) -> None:
    """A required key is None until set: no placeholder value stands in for it."""
    if value is None:
        raise ConfigError(f"{key} is required: {what}")


@dataclasses.dataclass
class RunConfig:
    dir: Optional[str] = None  # required: outputs, checkpoints, metrics.jsonl, config.yaml
    seed: int = 0

    def validate(self) -> None:
        _require("run.dir", self.dir or None, "where checkpoints and metrics.jsonl go")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"run.seed must lie in [0, {MAX_SEED}], got {self.seed}")


@dataclasses.dataclass
class ModelSection:
    preset: Optional[str] = None  # ModelConfig.preset name, e.g. tiny, llama-3.2-1b
    hf_path: Optional[str] = None  # local Hugging Face directory (config.json [+ safetensors])
    load_weights: bool = True  # with hf_path: load its safetensors (False: config only, random init)
    shape: dict = dataclasses.field(default_factory=dict)  # ModelConfig field overrides
    # compute dtype (float16: with dynamic loss scaling); auto: bfloat16 on a GPU with bf16 tensor
    # cores (sm80 on), float16 on one with fp16 ones only (T4), else float32 (CPU)
    dtype: ComputeDtypeOrAuto = "float32"
    param_dtype: StorageDtype = "float32"
    attn_impl: str = "auto"  # attention kernel (the choices: basp_jax.kernels.KERNELS)
    remat: str = "none"  # recompute in the backward pass (the choices: basp_jax.remat.REMAT_POLICIES)
    # each layer's norms, projections and MLP over chunks of at most this many tokens per device
    # (long sequences: no [tokens, intermediate] buffer of a whole shard); null: the whole shard
    tile_tokens: Optional[int] = None
    # a vocabulary-split embedding/head used where stored, moving tokens' rows: auto (where that
    # moves fewer bytes than gathering the table: short sequences), always, never
    vocab_parallel: Literal["auto", "always", "never"] = "auto"
    # the layers as one block of stacked parameters under lax.scan: compile time independent of
    # depth; the compiled step (collectives.json) then holds a layer's collectives once, not per layer
    scan_layers: bool = True

    def validate(self) -> None:
        if (self.preset is None) == (self.hf_path is None):
            raise ConfigError(
                "set exactly one of model.preset (e.g. tiny, llama-3.2-1b) and model.hf_path "
                f"(a local Hugging Face directory); got preset={self.preset!r}, "
                f"hf_path={self.hf_path!r}"
            )
        if self.tile_tokens is not None and self.tile_tokens < 1:
            raise ConfigError(f"model.tile_tokens must be a positive number of tokens or "
                              f"null, got {self.tile_tokens}")
        if self.hf_path is not None and self.load_weights and self.shape:
            raise ConfigError(
                "model.shape overrides change the architecture and cannot apply to pretrained "
                "weights from model.hf_path; set model.load_weights=false to train that shape "
                "from scratch"
            )


@dataclasses.dataclass
class DataConfig:
    source: Optional[Literal["synthetic", "tokens", "text", "jsonl"]] = None  # required
    path: Optional[str] = None  # tokens: .bin/.npy; text/jsonl: the file
    dtype: Literal["uint16", "uint32"] = "uint16"  # element type of a raw .bin token file
    tokenizer: Optional[str] = None  # text/jsonl: a local tokenizer.json
    text_key: str = "text"  # jsonl: the field holding each document
    eos_id: Optional[int] = None  # document separator; text/jsonl: appended after each document
    seq_len: Optional[int] = None  # required
    # documents end at eos_id: first-fit packed into rows (split only when longer than one), each
    # attending only within itself; false: windows of the stream
    pack: bool = False
    branching: int = 4  # synthetic: successors per token of the Markov chain (probabilities halve)
    # tokens: several token files mixed by weight, {path: weight} (instead of data.path)
    mix: dict = dataclasses.field(default_factory=dict)

    def require(self) -> None:
        """The required keys (checked with the other sections' before the combinations)."""
        _require("data.source", self.source, "synthetic, tokens, text or jsonl")
        _require("data.seq_len", self.seq_len, "tokens per row, an integer > 1")
        if self.seq_len <= 1:
            raise ConfigError(f"data.seq_len must be an integer > 1, got {self.seq_len}")
        if self.seq_len > MAX_INT32:  # positions are int32
            raise ConfigError(f"data.seq_len must be at most {MAX_INT32}, got {self.seq_len}")

    def validate(self) -> None:
        if self.mix and self.source != "tokens":
            raise ConfigError(f"data.mix mixes token files: it needs data.source=tokens, not "
                              f"{self.source}")
        if self.mix and self.path:
            raise ConfigError("data.path and data.mix are both set; list the file in data.mix "
                              "({path: weight, ...}) or set data.path only")
        for path, weight in self.mix.items():
            if not (path.endswith(".bin") or path.endswith(".npy")):
                raise ConfigError(f"data.mix path {path!r}: token files must end in .bin or .npy")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or \
                    not weight > 0 or weight == float("inf"):
                raise ConfigError(f"data.mix weight of {path!r} must be a positive number, got "
                                  f"{weight!r}")
        if self.source == "tokens" and not self.mix:
            if not self.path:
                raise ConfigError("data.source=tokens needs data.path: a .bin or .npy token file "
                                  "(or data.mix: {path: weight, ...})")
            if not (self.path.endswith(".bin") or self.path.endswith(".npy")):
                raise ConfigError(f"data.path {self.path!r}: token files must end in .bin or .npy")
        if self.source in ("text", "jsonl"):
            if not self.path:
                raise ConfigError(f"data.source={self.source} needs data.path")
            if not self.tokenizer:
                raise ConfigError(
                    f"data.source={self.source} needs data.tokenizer: a local tokenizer.json")
            if self.eos_id is None:
                raise ConfigError(f"data.source={self.source} needs data.eos_id: the token id "
                                  "that separates documents")
        if self.pack and self.source != "synthetic" and self.eos_id is None:
            raise ConfigError("data.pack=true needs data.eos_id: documents end at that token")
        if self.pack and self.source == "synthetic":
            raise ConfigError(
                "data.pack=true needs documents; synthetic data is one stream (pack=false)")
        if self.branching <= 0:
            raise ConfigError(f"data.branching must be a positive integer, got {self.branching}")
        if self.eos_id is not None and self.eos_id < 0:
            raise ConfigError(f"data.eos_id must be >= 0, got {self.eos_id}")


@dataclasses.dataclass
class TrainSection:
    steps: Optional[int] = None  # required
    microbatch_size: Optional[int] = None  # required: rows per microbatch (B of the layout)
    grad_accum: Optional[int] = None  # required: microbatches per optimizer step (1: no accumulation)
    # A step whose loss or gradient norm is NaN/Inf never changes the parameters; then: skip it
    # and go on, or stop the run (exit status 1). Non-finite state is never checkpointed either way.
    on_nonfinite: Literal["skip", "stop"] = "skip"

    def validate(self) -> None:
        _require("train.steps", self.steps, "a positive integer (optimizer steps)")
        if self.steps <= 0:
            raise ConfigError(f"train.steps must be a positive integer, got {self.steps}")
        if self.steps > MAX_INT32:  # the step counter is int32
            raise ConfigError(f"train.steps must be at most {MAX_INT32}, got {self.steps}")
        _require("train.microbatch_size", self.microbatch_size,
                 "a positive integer (rows per microbatch)")
        if self.microbatch_size <= 0:
            raise ConfigError(
                f"train.microbatch_size must be a positive integer, got {self.microbatch_size}"
            )
        _require("train.grad_accum", self.grad_accum,
                 "a positive integer (microbatches per step; 1: no accumulation)")
        if self.grad_accum <= 0:
            raise ConfigError(
                f"train.grad_accum must be a positive integer (1: no accumulation), "
                f"got {self.grad_accum}"
            )
        if self.microbatch_size * self.grad_accum > MAX_INT32:  # rows of a step, int32 indices
            raise ConfigError(
                f"train.microbatch_size x train.grad_accum = "
                f"{self.microbatch_size * self.grad_accum} rows per step; at most {MAX_INT32}")


@dataclasses.dataclass
class OptimizerConfig:
    lr: Optional[float] = None  # required: peak learning rate
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at train.steps
    weight_decay: float = 0.1  # not applied to norms and biases (parameters of rank < 2)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: Optional[float] = 1.0  # global gradient norm clip; null disables
    # dtype of Adam's first moment: null keeps model.param_dtype; bfloat16 halves its memory
    # (second moment and master weights stay in param_dtype)
    mu_dtype: Optional[StorageDtype] = None
    # master weights and optimizer state in pinned host memory, streamed through the device a
    # layer at a time (train.streamed): for a model whose state does not fit beside its
    # activations (an 8B model on one GPU); auto: only where the ordinary step's planned memory
    # does not fit parallel.hardware and the streamed step's does
    offload: Union[bool, Literal["auto"]] = False

    def validate(self) -> None:
        _require("optimizer.lr", self.lr, "the peak learning rate, > 0")
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr is required and must be > 0, got {self.lr}")
        if self.warmup_steps < 0:  # longer than the run: the trainer clamps it, with a note
            raise ConfigError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(
                f"optimizer.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ConfigError(
                f"optimizer.b1 and b2 must lie in [0, 1), got {self.b1}, {self.b2}")
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ConfigError(f"optimizer.clip_norm must be > 0 or null, got {self.clip_norm}")
        # Adam divides by sqrt(v) + eps: a negative eps flips or explodes the update
        if not 0 < self.eps < 1:
            raise ConfigError(f"optimizer.eps must lie in (0, 1) (e.g. 1e-8), got {self.eps}")


@dataclasses.dataclass
class ParallelConfig:
    # required; how the devices split each microbatch (the choices: basp_jax.layout.MODES)
    mode: Optional[str] = None
    groups: Optional[int] = None  # force a group count (basp); default gcd(microbatch, devices)
    devices_per_host: Optional[int] = None  # default: devices per process
    # auto: host (parameters sharded inside each host) where it fits in memory, else fsdp (the
    # choices: basp_jax.sharding.PARAM_SHARDINGS)
    param_sharding: str = "auto"
    hardware: str = "h100-80gb"  # the GPU (basp_jax.gpus) the planner assumes for mode=auto and param_sharding=auto
    memory_gb: Optional[float] = None  # per-device memory limit for the planner (default: preset)
    ring: int = 1  # ring attention across sp/ring-device all-to-all runs (ring must divide sp)
    pad_heads: bool = False  # allow zero-padded query heads when sp does not divide num_heads
    zigzag: bool = True  # with ring > 1: zig-zag token order, balancing the causal ring work

    def require(self) -> None:
        _require("parallel.mode", self.mode, "auto or a layout mode (basp_jax.layout.MODES, "
                 "listed in configs/README.md)")

    def validate(self) -> None:
        if self.mode == "auto" and (self.groups is not None or self.ring != 1 or self.pad_heads):
            raise ConfigError(
                "parallel.mode=auto chooses groups, ring and head padding itself; drop "
                "parallel.groups/ring/pad_heads or use parallel.mode=basp"
            )
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise ConfigError(f"parallel.memory_gb must be > 0, got {self.memory_gb}")
        if self.devices_per_host is not None and self.devices_per_host <= 0:  # sizes the cluster
            raise ConfigError(
                f"parallel.devices_per_host must be positive, got {self.devices_per_host}")
        # groups and ring: Layout.plan's rules, asked by train.planning before anything compiles
        # (not here: this module stays free of jax, which train.aot must start itself)


@dataclasses.dataclass
class CheckpointConfig:
    every: int = 0  # save every k steps (0: only at the end)
    keep: int = 3  # keep the last n
    async_save: bool = True
    save_final: bool = True
    resume: bool = True  # continue from the latest checkpoint in run.dir/checkpoints
    export_hf: Optional[str] = None  # write final weights as HF safetensors to this directory
    # the export's tensor dtype (null: the parameters', model.param_dtype)
    export_dtype: Optional[ComputeDtype] = None
    # keys a resume may find changed on purpose (e.g. optimizer.lr,train.steps; model.shape.*
    # for all of model.shape), logged and recorded in metrics.jsonl; any other change of a key
    # that alters the run (train/resume.py RULES) is refused
    allow_changed: list = dataclasses.field(default_factory=list)

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(
                f"checkpoint.every must be >= 0 (0: only at the end), got {self.every}")
        if self.keep <= 0:
            raise ConfigError(f"checkpoint.keep must be a positive integer, got {self.keep}")
        from .resume import check_allowed  # (the table of what a resume checks)

        check_allowed(self.allow_changed)


@dataclasses.dataclass
class MetricsConfig:
    peak_flops: Optional[float] = None  # peak FLOP/s of one device, for mfu
    device: Optional[str] = None  # a GPU of basp_jax.gpus (e.g. h100-pcie): its bf16 dense peak; null: from the device kind
    # progress on stderr: a tqdm bar on a terminal, else (a log file, SLURM) one line every
    # metrics.log_every steps; false: neither
    progress: bool = True
    log_every: int = 0  # steps between progress lines when stderr is not a terminal (0: ~20 lines a run)
    # TensorBoard event files in {run.dir}/tb: the metrics.jsonl scalars, eval loss, memory in
    # use and step-time percentiles
    tensorboard: bool = True
    # Weights & Biases project to log the same scalars to (needs `pip install wandb`); null: off
    wandb_project: Optional[str] = None

    def validate(self) -> None:
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ConfigError(f"metrics.peak_flops must be > 0 or null, got {self.peak_flops}")
        if self.log_every < 0:
            raise ConfigError(f"metrics.log_every must be >= 0 (0: about 20 lines a run), got "
                              f"{self.log_every}")


@dataclasses.dataclass
class EvalConfig:
    every: int = 0  # evaluate every k steps and after the last one (0: no evaluation)
    batches: int = 1  # held-out microbatches (of train.microbatch_size rows) per evaluation
    # held-out data read as data.source says (tokens: .bin/.npy of data.dtype; text/jsonl:
    # tokenized with data.tokenizer), consecutive windows from its start; null with synthetic
    # data: rows of the same Markov chain that no training step draws
    path: Optional[str] = None

    def validate(self, source: str) -> None:
        """source: data.source, which says how eval.path is read."""
        if self.every < 0:
            raise ConfigError(f"eval.every must be >= 0 (0: no evaluation), got {self.every}")
        if self.batches <= 0:
            raise ConfigError(f"eval.batches must be a positive integer, got {self.batches}")
        if self.path is None:
            if self.every > 0 and source != "synthetic":
                raise ConfigError(f"eval.every={self.every} needs eval.path: held-out data in the "
                                  f"format of data.source={source}")
            return
        if self.every == 0:
            raise ConfigError("eval.path is set but eval.every=0 never evaluates; set eval.every "
                              "(e.g. 100) or drop eval.path")
        if source == "synthetic":
            raise ConfigError("eval.path is read as data.source says, and synthetic data has no "
                              "files; drop eval.path (held-out synthetic rows) or use "
                              "data.source=tokens, text or jsonl")
        if source == "tokens" and not self.path.endswith((".bin", ".npy")):
            raise ConfigError(f"eval.path {self.path!r}: token files must end in .bin or .npy "
                              "(data.source=tokens)")


@dataclasses.dataclass
class ProfileConfig:
    steps: int = 0  # trace this many steps with jax.profiler into {run.dir}/profile (0: off)
    start_step: int = 3  # the first traced step (1-based, as metrics.jsonl counts steps)

    def validate(self, train_steps: int) -> None:
        if self.steps < 0:
            raise ConfigError(f"profile.steps must be >= 0 (0: no trace), got {self.steps}")
        if self.start_step < 1:
            raise ConfigError(f"profile.start_step must be >= 1 (steps count from 1), got "
                              f"{self.start_step}")
        if self.steps and self.start_step > train_steps:
            raise ConfigError(f"profile.start_step={self.start_step} is beyond train.steps="
                              f"{train_steps}: nothing would be traced; lower it")


@dataclasses.dataclass
class DistributedConfig:
    enabled: Optional[bool] = None  # null: when coordinator is set or JAX_COORDINATOR_ADDRESS is
    coordinator: Optional[str] = None  # host:port of process 0
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    # multi-process: when a peer (or the coordinator) is silent this long, stop with exit status 3
    # instead of hanging in a collective; 0 disables
    peer_timeout_s: float = 30.0

    def validate(self) -> None:
        if self.peer_timeout_s != 0 and not (
                MIN_PEER_TIMEOUT_S <= self.peer_timeout_s <= MAX_PEER_TIMEOUT_S):
            raise ConfigError(
                f"runtime.distributed.peer_timeout_s must be 0 (off) or lie in "
                f"[{MIN_PEER_TIMEOUT_S:g}, {MAX_PEER_TIMEOUT_S:g}] seconds, got "
                f"{self.peer_timeout_s:g}")
        if self.coordinator and (self.num_processes is None or self.process_id is None):
            raise ConfigError(
                "runtime.distributed.coordinator needs num_processes and process_id as well"
            )
        if self.num_processes is not None and not 0 < self.num_processes <= MAX_PROCESSES:
            raise ConfigError(
                f"runtime.distributed.num_processes must lie in [1, {MAX_PROCESSES}], got "
                f"{self.num_processes}")
        if self.process_id is not None and self.num_processes is not None and not (
            0 <= self.process_id < self.num_processes
        ):
            raise ConfigError(
                f"runtime.distributed.process_id={self.process_id} must lie in "
                f"[0, num_processes={self.num_processes})"
            )


@dataclasses.dataclass
class RuntimeConfig:
    # auto: the GPUs when JAX has a CUDA backend that finds one, else cpu_devices emulated CPU
    # devices; gpu: GPUs or stop with one line naming the pip extra to install (the configs in
    # configs/gpu); cpu: the CPU even where GPUs are (emulating cpu_devices)
    platform: Literal["auto", "cpu", "gpu"] = "auto"
    cpu_devices: Optional[int] = None  # required unless platform=gpu: CPU devices (per process) to emulate
    devices: Optional[int] = None  # use the first N devices of all processes (null: all of them)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def validate(self) -> None:
        """The device counts (runtime.distributed validates itself)."""
        if self.platform != "gpu":
            _require("runtime.cpu_devices", self.cpu_devices, "CPU devices to emulate when "
                     "training on the CPU (runtime.platform=gpu needs none)")
        if self.cpu_devices is not None and self.cpu_devices <= 0 and not (
                self.platform == "gpu" and self.cpu_devices == 0):
            raise ConfigError(
                f"runtime.cpu_devices must be a positive integer, got {self.cpu_devices} "
                f"(CPU devices to emulate when training on the CPU; runtime.platform=gpu needs "
                f"none)"
            )
        if self.cpu_devices is not None and self.cpu_devices > MAX_CPU_DEVICES:
            raise ConfigError(f"runtime.cpu_devices={self.cpu_devices} is more CPU devices than "
                              f"can be emulated; use at most {MAX_CPU_DEVICES}")
        if self.devices is not None and self.devices <= 0:
            raise ConfigError(
                f"runtime.devices must be a positive integer or null (all devices), "
                f"got {self.devices}"
            )


@dataclasses.dataclass
class Config:
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    # the config files load_config read (the one given, then its includes): not a config key (no
    # annotation), read by train.outputs, which keeps the run's outputs off them
    sources = ()

    def validate(self) -> None:
        """Each section checks its own keys: the required ones first, then the combinations.
        Model and layout checks come later (train.prepare), still before anything compiles."""
        self.run.validate()
        self.train.validate()
        self.runtime.validate()
        self.parallel.require()
        self.data.require()
        self.model.validate()
        self.data.validate()
        self.optimizer.validate()
        self.parallel.validate()
        self.checkpoint.validate()
        self.metrics.validate()
        self.eval.validate(self.data.source)
        held_out = self.eval.batches * self.train.microbatch_size * self.data.seq_len
        if self.eval.every and held_out > MAX_EVAL_TOKENS:  # built at once, kept on the devices
            raise ConfigError(
                f"eval.batches={self.eval.batches} x train.microbatch_size x data.seq_len = "
                f"{held_out} held-out tokens, more than the {MAX_EVAL_TOKENS} an evaluation "
                "batch may hold (it is built at once and kept on the devices); lower eval.batches")
        self.profile.validate(self.train.steps)
        self.runtime.distributed.validate()


# --------------------------------------------------------------------------- coercion

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NULL = {"null", "none", "~", ""}


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp) -> Any:
    """Convert a YAML value or a command-line string to the field type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _to_union(key, value, tp)
    if origin is Literal:
        return _to_literal(key, value, typing.get_args(tp))
    if tp not in _SCALARS:
        raise ConfigError(f"{key}: unsupported field type {tp!r}")  # pragma: no cover
    return _SCALARS[tp](key, value)


def _to_union(key: str, value: Any, tp) -> Any:
    args = typing.get_args(tp)
    if value is None or (isinstance(value, str) and value.strip().lower() in _NULL):
        if type(None) in args:
            return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(key, value, arg)
        except ConfigError as e:
            errors.append(e)
    if len(errors) == 1:  # Optional[X]: X's own message says what was expected
        raise errors[0]
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _to_literal(key: str, value: Any, choices: tuple) -> Any:
    if value in choices:
        return value
    if isinstance(value, str) and value.strip() in choices:
        return value.strip()
    raise ConfigError(f"{key}: expected one of {', '.join(map(str, choices))}, got {value!r}")


def _to_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _to_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""))
        except ValueError:
            try:
                f = float(value)
                if f.is_integer():
                    return int(f)
            except ValueError:
                pass
    raise ConfigError(f"{key}: expected an integer, got {value!r}")


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    number = None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if not math.isfinite(number):  # nan passes every `x <= 0` check, then poisons the run
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    return number


def _to_str(key: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected a string, got {value!r}")


def _to_list(key: str, value: Any) -> list:
    """A list of names: a YAML list of strings, or one string of comma-separated names."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        value = [v for v in value.split(",")]
    if isinstance(value, list) and all(isinstance(v, str) and v.strip() for v in value):
        return [v.strip() for v in value]
    raise ConfigError(f"{key}: expected a list of names (a,b or [a, b]), got {value!r}")


def _to_dict(key: str, value: Any) -> dict:
    if isinstance(value, dict):
        return dict(value)
    raise ConfigError(f"{key}: expected a mapping, got {value!r}")


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str, dict: _to_dict,
            list: _to_list}


class DuplicateKeyError(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with the same key twice (plain YAML keeps the last,
    so a config edited in two places would silently run with one of them)."""


def _construct_unique_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor`: construct_mapping merges it in; the explicit keys win
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            continue  # the default constructor reports unhashable keys itself
        if key in seen:
            raise DuplicateKeyError(f"key {key!r} appears twice (lines {seen[key].line + 1} and "
                                    f"{key_node.start_mark.line + 1}); keep one")
        seen[key] = key_node.start_mark
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_unique_mapping)


# No config value nests deeper than this (model.shape.rope_scaling is 2 levels deep): a value
# nested thousands deep would otherwise end in a RecursionError wherever it is first walked.
MAX_DEPTH = 16


class TooDeepError(yaml.YAMLError):
    pass


def _depth(value: Any) -> int:
    """How deep lists and mappings nest in value (0: a scalar), without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        if isinstance(node, dict):
            todo += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            todo += [(v, depth + 1) for v in node]
    return deepest


def _brackets_deeper_than(text: str, limit: int) -> bool:
    """Whether [ and { open more than `limit` deep in text (quotes ignored: a bound for flow
    style YAML, so a value nested thousands deep is refused before the parser recurses)."""
    depth = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth = max(depth - 1, 0)
    return False


def yaml_load(text: str):
    """yaml.safe_load that raises yaml.YAMLError on duplicate keys and on values nested more
    than MAX_DEPTH deep (TooDeepError)."""
    too_deep = _brackets_deeper_than(text, 8 * MAX_DEPTH)  # (a generous bound: quotes count)
    try:
        loaded = None if too_deep else yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506
    except RecursionError:  # the parser recurses once per level (block style, too)
        too_deep = True
    else:
        too_deep = too_deep or _depth(loaded) > MAX_DEPTH
    if too_deep:
        raise TooDeepError(f"a value nests lists or mappings more than {MAX_DEPTH} levels deep; "
                           "no config key takes that")
    return loaded


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _build(cls, data: Any, prefix: str):
    """A dataclass instance from a (possibly partial) nested dict; unknown keys are errors."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(
                f"unknown config key {where!r}; {prefix or 'the top level'} has: {', '.join(names)}"
            )
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        tp = hints[name]
        key = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, data[name], key)
        else:
            kwargs[name] = _coerce(key, data[name], tp)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"bad override key {dotted!r}; write section.key=value")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key.sub=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml_load(raw) if raw.strip() else None
    except (DuplicateKeyError, TooDeepError) as e:
        raise ConfigError(f"override {key}: {e}") from None
    except yaml.YAMLError:
        value = raw
    # Keep plain strings as typed on the command line (e.g. 1e-3, which YAML 1.1 leaves a string),
    # coercion by field type handles them; mappings and lists come from YAML.
    if isinstance(value, (str, int, float, bool)) or value is None:
        value = raw.strip() if raw.strip() else None
    return key, value


def _read_yaml(path: str) -> dict:
    """One config file's top-level mapping."""
    try:
        with open(path) as f:
            loaded = yaml_load(f.read())
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or getattr(e, "reason", None) or str(e)
        raise ConfigError(f"cannot read config file {path!r}: {reason}") from None
    except (DuplicateKeyError, TooDeepError) as e:
        raise ConfigError(f"config file {path!r}: {e}") from None
    except yaml.YAMLError as e:
        line = str(e).replace("\n", " ")
        raise ConfigError(f"config file {path!r} is not valid YAML: {line}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections")
    return loaded or {}


def _merge(base: dict, over: dict) -> dict:
    """base with over's values laid on top: mappings merge key by key, other values replace
    (null too, except over a mapping: a section left empty adds nothing)."""
    out = dict(base)
    for key, value in over.items():
        if value is None and isinstance(out.get(key), dict):
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


INCLUDE = "include"


def _load_tree(path: str, chain: tuple[str, ...] = (), files: list | None = None) -> dict:
    """A config file's mapping with the files its `include:` names merged under it; chain: the
    files that include this one (an include of one of them is a cycle); files: every file read
    is appended to it."""
    tree = _read_yaml(path)
    if files is not None:
        files.append(path)
    names = tree.pop(INCLUDE, None)
    if names is None:
        return tree
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip()
                                                           for n in names):
        raise ConfigError(f"config file {path!r}: {INCLUDE} must be a file path or a list of "
                          f"them, got {names!r}")
    chain = (*chain, path)
    base: dict = {}
    for name in names:
        # relative to the including file
        target = os.path.join(os.path.dirname(path), os.path.expanduser(name))
        if not os.path.isfile(target):
            raise ConfigError(f"config file {path!r}: {INCLUDE} {name!r} does not exist "
                              f"(looked for {target!r})")
        if any(os.path.samefile(target, seen) for seen in chain):
            raise ConfigError(f"config file {path!r}: {INCLUDE} {name!r} makes a cycle "
                              f"({' -> '.join([*chain, target])})")
        base = _merge(base, _load_tree(target, chain, files))
    return _merge(base, tree)


def load_config(path: Optional[str], overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (with the files it includes), apply `key.sub=value` overrides,
    type-check and validate it."""
    files: list[str] = []
    tree = _load_tree(os.path.expanduser(path), files=files) if path is not None else {}
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(tree, key, value)
    cfg = from_dict(tree)
    cfg.sources = tuple(files)
    return cfg


# the keys that hold a path (train.paths.local: `~` expanded, no URL); which the run reads or writes
INPUT_PATHS = ("model.hf_path", "data.path", "data.tokenizer", "eval.path")
OUTPUT_PATHS = ("run.dir", "checkpoint.export_hf")


def _local_paths(cfg: Config) -> None:
    for key in INPUT_PATHS + OUTPUT_PATHS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value:
            try:
                setattr(getattr(cfg, section), name, paths.local(key, value))
            except paths.PathError as e:
                raise ConfigError(str(e)) from None
    try:  # data.mix's keys are paths too
        cfg.data.mix = {paths.local("data.mix", str(k)): v for k, v in cfg.data.mix.items()}
    except paths.PathError as e:
        raise ConfigError(str(e)) from None


def from_dict(tree: dict) -> Config:
    cfg = _build(Config, tree, "")
    _local_paths(cfg)
    cfg.validate()
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def replace(cfg: Config, *overrides: str) -> Config:
    """A copy of cfg with `key.sub=value` overrides applied (validated again)."""
    tree = to_dict(cfg)
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(tree, key, value)
    return from_dict(tree)

