"""Typed training config: dataclasses with defaults, read from YAML plus `key.sub=value` overrides.

    cfg = load_config("configs/demo_cpu.yaml", ["train.steps=20", "parallel.mode=ulysses"])

Unknown keys, values of the wrong type, required keys left out (None until set: no placeholder
value stands in for them) and impossible combinations raise a ConfigError whose one line names the
key and what would work. Nothing here imports JAX: the CLI must read the config
(runtime.cpu_devices, runtime.distributed) before JAX initialises its backends.

A config file may start from others (`include: base.yaml`); how files, includes and overrides
become one tree, and that tree typed values: train/config/tree.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Literal, Optional, Union

import yaml

from . import tree as config_tree
from . import dtypes
from . import paths
from .errors import ConfigError  # noqa: F401 (train.config.ConfigError, as callers import it)
from .runtime_section import RuntimeConfig


# dtype keys take train.config.dtypes' names: model.dtype and checkpoint.export_dtype any (model.dtype
# also auto), model.param_dtype and optimizer.mu_dtype those that store parameters
ComputeDtype = Literal[dtypes.COMPUTE]
ComputeDtypeOrAuto = Literal[(*dtypes.COMPUTE, "auto")]
StorageDtype = Literal[dtypes.STORAGE]


# seeds key numpy's and JAX's generators: a non-negative 32-bit integer fits both everywhere
MAX_SEED = 2**32 - 1

# Upper bounds of counts, far beyond any real run: past them JAX, XLA or the int32 step counter
# and positions fail with tracebacks (or hang) instead of one line.
MAX_INT32 = 2**31 - 1  # train.steps, data.seq_len, train.microbatch_size x grad_accum
MAX_EVAL_TOKENS = 1 << 28  # the held-out batch: 1 GiB per int32 array
# data.mix's weights are relative: one below a billionth of another's is never read in any real
# run (a typo), and past that grain's integer proportions overflow; the smallest weight keeps
# 100 / weight (grain's scale) finite
MAX_MIX_RATIO = 1e9
MIN_MIX_WEIGHT = 1e-300


def _in_float32(key: str, value: float | None, *, positive: bool = False) -> float | None:
    """value as float32 holds it (None stays None), refused where that is inf, or 0 for a key
    that must be positive: the optimizer computes in float32, where 1e39 is inf and 1e-50 is 0."""
    if value is None:
        return None
    held = dtypes.float32(value)
    if math.isinf(held) or (positive and held == 0):
        raise ConfigError(f"{key}={value!r} is {held} in float32, which it is computed in; use a "
                          "value float32 holds (magnitude 1.4e-45 to 3.4e38)")
    return held


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
    # the layers as one block of stacked parameters under lax.scan (layers unlike each other, a
    # hybrid's: stacked by the pattern they repeat): compile time independent of depth; the
    # compiled step (collectives.json) then holds a layer's collectives once, not per layer.
    # false: a Python list; a checkpoint of either resumes in the other
    scan_layers: bool = True
    # the layers' projections as FP8 matmuls (e4m3 forward, e5m2 gradients, per-tensor current
    # scales; attention, norms, embedding and LM head stay in model.dtype): true needs FP8 tensor
    # cores (sm89+) on a GPU (the CPU emulates them); auto: on sm90+ GPUs (H100, H200, B200)
    fp8: Union[bool, Literal["auto"]] = False
    # attention's q, k and v through its all-to-alls in FP8 (e4m3, per-head scales; their
    # gradients back in e5m2): half the bytes of bf16 across the seq groups; any GPU or the CPU
    # (the bytes travel as uint8); the output's exchange stays in model.dtype
    fp8_exchange: bool = False
    # where a mixture-of-experts model's experts run: seq (split over each seq group's devices,
    # routed tokens gathered and scattered back inside the group), auto (over a host's devices
    # where seq groups are smaller than a host, else as seq), none (whole copies on every
    # device); a layout that cannot split them is refused in one line (none runs it whole)
    expert_parallel: Literal["auto", "seq", "none"] = "auto"
    # the experts' grouped matmuls: pallas (our kernels, basp_jax.grouped_matmul), xla
    # (jax.lax.ragged_dot: a dense loop over the experts on a GPU), auto (pallas on a GPU)
    grouped_matmul: Literal["auto", "xla", "pallas"] = "auto"

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
    # synthetic with pack=true: rows of documents whose lengths follow a named distribution
    # (train.data.synthetic.DISTRIBUTIONS: longtail, full), each a walk of the Markov chain
    documents: Optional[str] = None
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
            if weight < MIN_MIX_WEIGHT:  # (grain scales the weights by 100 / the smallest)
                raise ConfigError(f"data.mix weight of {path!r} is {weight!r}, below "
                                  f"{MIN_MIX_WEIGHT:g}; weights are relative: scale them all up")
        if self.mix and max(self.mix.values()) > MAX_MIX_RATIO * min(self.mix.values()):
            heavy, light = (max(self.mix, key=self.mix.get), min(self.mix, key=self.mix.get))
            raise ConfigError(
                f"data.mix weights {light!r}: {self.mix[light]!r} and {heavy!r}: "
                f"{self.mix[heavy]!r} are more than {MAX_MIX_RATIO:g} times apart: the lighter "
                "file would practically never be read; drop it or raise its weight")
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
        if self.pack and self.source == "synthetic" and self.documents is None:
            raise ConfigError(
                "data.pack=true needs documents; synthetic data is one stream unless "
                "data.documents names a length distribution (longtail or full)")
        if self.documents is not None and not (self.source == "synthetic" and self.pack):
            raise ConfigError(
                f"data.documents={self.documents} draws synthetic documents; it needs "
                "data.source=synthetic and data.pack=true (a corpus's documents are its own)")
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
    # layer at a time (train.program.streamed): for a model whose state does not fit beside its
    # activations (an 8B model on one GPU); auto: only where the ordinary step's planned memory
    # does not fit parallel.hardware and the streamed step's does
    offload: Union[bool, Literal["auto"]] = False

    def validate(self) -> None:
        _require("optimizer.lr", self.lr, "the peak learning rate, > 0")
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr is required and must be > 0, got {self.lr}")
        _in_float32("optimizer.lr", self.lr, positive=True)
        _in_float32("optimizer.weight_decay", self.weight_decay)
        _in_float32("optimizer.clip_norm", self.clip_norm, positive=True)
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
        for key, beta in (("optimizer.b1", self.b1), ("optimizer.b2", self.b2)):
            if dtypes.float32(beta) == 1:  # Adam's bias correction divides by 1 - beta**t
                raise ConfigError(f"{key}={beta!r} is 1.0 in float32, which Adam computes in (it "
                                  "divides by 1 - beta**step); use at most 0.99999994")
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ConfigError(f"optimizer.clip_norm must be > 0 or null, got {self.clip_norm}")
        # Adam divides by sqrt(v) + eps: a negative eps flips or explodes the update
        if not 0 < self.eps < 1:
            raise ConfigError(f"optimizer.eps must lie in (0, 1) (e.g. 1e-8), got {self.eps}")
        _in_float32("optimizer.eps", self.eps, positive=True)


@dataclasses.dataclass
class ParallelConfig:
    # required; how the devices split each microbatch (the choices: basp_jax.layout.MODES)
    mode: Optional[str] = None
    groups: Optional[int] = None  # force a group count (basp); default gcd(microbatch, devices)
    devices_per_host: Optional[int] = None  # default: devices per process
    # auto: on several hosts staged_keep (fsdp's shards, gathered across hosts once a step)
    # where it fits in memory, else host, staged, hsdp, fsdp (train.program.planning; the choices:
    # basp_jax.sharding.PARAM_SHARDINGS)
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
        # groups and ring: Layout.plan's rules, asked by train.program.planning before anything compiles
        # (not here: this module stays free of jax, which train.tools.aot must start itself)


@dataclasses.dataclass
class CheckpointConfig:
    every: int = 0  # save every k steps (0: only at the end)
    keep: int = 3  # keep the last n
    async_save: bool = True
    save_final: bool = True
    # copy the state on the device and write the copy while the next step runs (auto: where the
    # compiled step's memory plus the copy fits the device; false: the next step waits for the
    # state's copy to host memory, as it always does in a run of several processes)
    copy_on_device: Union[bool, Literal["auto"]] = "auto"
    resume: bool = True  # continue from the latest checkpoint in run.dir/checkpoints
    export_hf: Optional[str] = None  # write final weights as HF safetensors to this directory
    # the export's tensor dtype (null: the parameters', model.param_dtype)
    export_dtype: Optional[ComputeDtype] = None
    # keys a resume may find changed on purpose (e.g. optimizer.lr,train.steps; model.shape.*
    # for all of model.shape), logged and recorded in metrics.jsonl; any other change of a key
    # that alters the run (train/config/resume.py RULES) is refused
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
    # annotation), read by train.process.outputs, which keeps the run's outputs off them
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
        if self.parallel.mode == "adaptive":
            if not self.data.pack:
                raise ConfigError(
                    "parallel.mode=adaptive repacks each step's documents into the layout with "
                    "the most groups that holds them; it needs data.pack=true (windows of one "
                    "stream have no documents to repack)")
            if self.optimizer.offload is True:
                raise ConfigError(
                    "parallel.mode=adaptive does not run the streamed step (optimizer.offload="
                    "true); set optimizer.offload=false or use parallel.mode=basp")


def load_config(path: Optional[str], overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (with the files it includes), apply `key.sub=value` overrides,
    type-check and validate it."""
    files: list[str] = []
    tree = config_tree.load_tree(os.path.expanduser(path), files=files) if path is not None else {}
    cfg = from_dict(config_tree.apply_overrides(tree, overrides, Config))
    cfg.sources = tuple(files)
    return cfg


# the keys that hold a path (train.config.paths.local: `~` expanded, no URL); which the run reads or writes
INPUT_PATHS = ("model.hf_path", "data.path", "data.tokenizer", "eval.path")
OUTPUT_PATHS = ("run.dir", "checkpoint.export_hf")


def _local_paths(cfg: Config) -> None:
    try:
        for key in INPUT_PATHS + OUTPUT_PATHS:
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)
            if value:
                setattr(getattr(cfg, section), name, paths.local(key, value))
        # data.mix's keys are paths too
        cfg.data.mix = {paths.local("data.mix", str(k)): v for k, v in cfg.data.mix.items()}
    except paths.PathError as e:
        raise ConfigError(str(e)) from None


def from_dict(tree: dict) -> Config:
    cfg = config_tree.build(Config, tree)
    _local_paths(cfg)
    cfg.validate()
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def replace(cfg: Config, *overrides: str) -> Config:
    """A copy of cfg with `key.sub=value` overrides applied (validated again)."""
    return from_dict(config_tree.apply_overrides(to_dict(cfg), overrides, Config))

