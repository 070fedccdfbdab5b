"""`check(cfg, is_writer) -> Run`: every check a run's config, devices, data and checkpoints can
fail, before anything compiles or is written; the Run holds what they found (the resolved
config, the plan, the data pipelines, the checkpoint to resume from). train.loop then takes
run.dir's lock and builds the state (train.program.state).

    run = check(cfg, is_writer=jax.process_index() == 0)
    run.plan, run.data, run.latest, ...
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
from flax import nnx

import models
from models import fp8 as model_fp8
from basp_jax import Layout
from basp_jax import kernels as basp_kernels

from . import choices
from .config import dtypes
from .observe import evaluate
from .program import planning
from .config import resume
from .observe import writers
from .process import runtime
from .checkpoint.store import checkpoint_dir, complete_steps, inspect_latest
from .config.schema import Config, ConfigError, replace
from .data import Pipeline, check_files
from .process.lock import check_free
from .observe.metrics import peak_flops
from .program.model_setup import fp8_enabled, model_config, model_options
from .process.outputs import check_output_paths
from .program.state import RunPlan, plan_run
from .program.step import compute_dtype, loss_scaling, make_optimizer


def select_devices(cfg: Config) -> list:
    """The devices to train on: all of them, or the first runtime.devices; on a single-process CPU
    run at most runtime.cpu_devices. runtime.platform=cpu takes the CPU even beside GPUs; gpu
    refuses a JAX without one."""
    platform = cfg.runtime.platform
    devices = jax.devices("cpu") if platform == "cpu" else jax.devices()
    if platform == "gpu" and devices[0].platform != "gpu":
        raise ConfigError(runtime.no_gpu_message(jax.__version__))
    want = cfg.runtime.cpu_devices
    if devices[0].platform == "cpu":
        local = jax.local_device_count()
        if local < want:
            raise ConfigError(
                f"runtime.cpu_devices={want} but JAX started with {local} CPU devices per process; "
                "set it before JAX initialises (python train.py does) or lower it"
            )
        if jax.process_count() == 1:
            devices = devices[:want]
    n = cfg.runtime.devices
    if n is not None:
        if n > len(devices):
            raise ConfigError(
                f"runtime.devices={n} but only {len(devices)} {devices[0].platform} device(s) are "
                f"visible; lower runtime.devices or leave it null (all devices)"
            )
        if jax.process_count() > 1 and n != len(devices):
            raise ConfigError(
                f"runtime.devices={n} would leave some of the {jax.process_count()} processes' "
                f"{len(devices)} devices idle; leave it null in multi-process runs"
            )
        devices = devices[:n]
    return devices


def with_compute_dtype(cfg: Config, device) -> Config:
    """cfg with model.dtype=auto resolved for `device` (train.program.step.compute_dtype)."""
    if cfg.model.dtype != "auto":
        return cfg
    return replace(cfg, f"model.dtype={compute_dtype('auto', device)}")


def check_kernel(cfg: Config, device) -> None:
    """model.attn_impl names a kernel this device runs in model.dtype: cuDNN needs a GPU, cuDNN
    and Pallas/Triton an Ampere (sm80) or newer one, xla's half-precision dot bf16 support (sm80)
    or, in f16, a GPU (basp_jax.kernels); refused here, before anything compiles (the compiler's
    own error is a page of traceback)."""
    impl, platform = cfg.model.attn_impl, device.platform
    dtype = dtypes.jnp_dtype(compute_dtype(cfg.model.dtype, device))
    if platform != "gpu" and basp_kernels.kernel_unsupported(impl, "gpu", None) is None \
            and basp_kernels.kernel_unsupported(impl, platform, None):  # a GPU-only kernel
        runs = [f"auto ({impl} where it applies)"] + [
            name for name in basp_kernels.KERNELS
            if basp_kernels.kernel_unsupported(name, platform, None, dtype) is None]
        raise ConfigError(f"model.attn_impl={impl} needs a GPU but the devices are {platform}; use "
                          f"{', '.join(runs[:-1])} or {runs[-1]}")
    why = basp_kernels.kernel_unsupported(impl, platform, basp_kernels.device_capability(device),
                                          dtype)
    if why:
        name = getattr(device, "device_kind", platform)
        raise ConfigError(f"model.attn_impl={impl} on {name}: {why.replace('impl=', 'attn_impl=')}"
                          f" (model.dtype={cfg.model.dtype})")


def fp8_share(cfg: Config, mcfg, device) -> float:
    """The share of a step's FLOPs that model.fp8 runs as FP8 matmuls on `device` (0: off)."""
    if not fp8_enabled(cfg, device):
        return 0.0
    shape = mcfg.shape
    return shape.fp8_flops_per_token() / shape.train_flops_per_token(cfg.data.seq_len)


def check_fp8(cfg: Config, device) -> None:
    """model.fp8=true on a device without FP8 tensor cores (a GPU before sm89: T4, A100):
    refused here, before compiling (XLA would quietly run every FP8 matmul upcast, slower)."""
    if cfg.model.fp8 is not True:
        return
    why = model_fp8.unsupported(device.platform, basp_kernels.device_capability(device))
    if why:
        name = getattr(device, "device_kind", device.platform)
        raise ConfigError(f"model.fp8=true on {name}: {why}; set model.fp8=auto (on where "
                          "the GPU has them) or false")


@dataclasses.dataclass
class Run:
    """One invocation of the trainer, as the checks found it (complete when made)."""

    cfg: Config
    run_dir: str  # absolute
    is_writer: bool  # process 0: writes run.dir
    mcfg: Any  # models.ModelConfig
    devices: list
    plan: RunPlan
    fp8_share: float  # of a step's FLOPs, run as FP8 matmuls (model.fp8; 0: none)
    data: Pipeline
    eval_data: Pipeline | None  # None: no evaluation
    latest: int | None  # the checkpoint step to resume from (None: a fresh start)
    record: dict  # what each checkpoint's meta records of the config (train.config.resume)
    changes: dict  # key -> (checkpoint's value, this config's): allowed changes on resume

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @functools.cached_property
    def _mfu_peak(self) -> tuple[float | None, str]:
        # metrics.device names a known GPU: train.choices checked it
        return peak_flops(self.cfg.metrics, getattr(self.devices[0], "device_kind", None),
                          fp8_share=self.fp8_share)

    @property
    def peak(self) -> float | None:
        """Peak FLOP/s of one device, what MFU divides by (None: no mfu)."""
        return self._mfu_peak[0]

    @property
    def peak_source(self) -> str:
        """The log line naming the peak (or saying why there is no mfu)."""
        return self._mfu_peak[1]

    @property
    def saved_dtype(self) -> str | None:
        """The compute dtype the checkpoint to resume was written in, where a resume changes it
        (checkpoint.allow_changed=model.dtype); None otherwise."""
        return self.changes.get("model.dtype", (None,))[0]

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.grad_accum * self.cfg.train.microbatch_size * self.cfg.data.seq_len

    @property
    def flops_per_token(self) -> float:
        # basp_jax.planner.shape's count, the planner's too: 6N plus the causal half of the S x S scores
        return self.mcfg.shape.train_flops_per_token(self.cfg.data.seq_len)


def check(cfg: Config, *, is_writer: bool) -> Run:
    """Everything that can be wrong, checked before anything compiles or is written."""
    choices.check(cfg)  # the keys train.config cannot check without JAX
    run_dir = os.path.abspath(cfg.run.dir)
    if is_writer:
        check_free(run_dir)  # another run owns it: say so before reading what it is writing
    check_output_paths(cfg, run_dir)
    mcfg = model_config(cfg)
    if cfg.model.hf_path and cfg.model.load_weights:
        models.check_pretrained(cfg.model.hf_path, mcfg)  # tensor names and shapes, headers only
    devices = select_devices(cfg)
    cfg = with_compute_dtype(cfg, devices[0])  # the run (and its checkpoint record) computes in it
    check_kernel(cfg, devices[0])
    check_fp8(cfg, devices[0])
    per_host = cfg.parallel.devices_per_host or len(devices) // jax.process_count()
    cfg = planning.resolve_offload(cfg, mcfg, len(devices), per_host)  # optimizer.offload=auto
    writers.check(cfg, is_writer)
    held_out = evaluate.held_out_data(cfg)  # None: no evaluation
    check_files(cfg.data)  # a missing file is reported as such, not as a changed one on resume
    record = resume.record(cfg, dataclasses.asdict(mcfg))
    latest, changes = check_resume(cfg, mcfg, run_dir, record)
    share = fp8_share(cfg, mcfg, devices[0])
    # the plan comes last: it hands the config down to the library (planner, layout, gpus)
    plan = plan_run(cfg, mcfg, devices, per_host)
    planning.check_memory(cfg, mcfg, plan.layout, plan.strategy, devices,  # before any row
                          remat=plan.remat, tile_tokens=plan.tile_tokens)
    layout = plan.layout  # the rows it pads and the token order it wants
    # (adaptive layouts repack rows in natural order and put them in each layout's own order)
    data = Pipeline(cfg.data, vocab_size=mcfg.vocab_size, grad_accum=cfg.train.grad_accum,
                    microbatch=cfg.train.microbatch_size, seed=cfg.run.seed,
                    pad_rows=layout.pad_rows,
                    seq_order=None if plan.adaptive else layout.token_order)
    if data.documents_per_row and not plan.adaptive:  # (adaptive layouts repack the rows)
        plan = dataclasses.replace(plan, document_bound=data.documents_per_row)
    eval_data = None if held_out is None else Pipeline(
        held_out, vocab_size=mcfg.vocab_size, grad_accum=cfg.eval.batches,
        microbatch=cfg.train.microbatch_size, seed=cfg.run.seed, pad_rows=layout.pad_rows,
        seq_order=layout.token_order, held_out=True)
    return Run(cfg, run_dir, is_writer, mcfg, devices, plan, share, data, eval_data, latest,
               record, changes)


def check_resume(cfg: Config, mcfg, run_dir: str, record: dict) -> tuple[int | None, dict]:
    """The checkpoint step to resume from (None: start fresh) and the config's changes since
    that checkpoint (those checkpoint.allow_changed allows; train.config.resume refuses the others),
    after checking that it fits this config (checkpoint metadata only: no array is read;
    record: this config's train.config.resume.record)."""
    # its state's structure, for inspection (cfg.model.dtype is resolved: check())
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.steps, loss_scaling(cfg.model.dtype))
    if not cfg.checkpoint.resume:
        existing = complete_steps(checkpoint_dir(run_dir))
        if existing:
            raise ConfigError(
                f"checkpoint.resume=false but {checkpoint_dir(run_dir)} holds steps "
                f"{existing}, which a fresh run would overwrite or prune; use a new run.dir, "
                "or resume (checkpoint.resume=true)"
            )
        return None, {}
    expected = nnx.to_pure_dict(nnx.state(models.abstract_model(mcfg, options=model_options(cfg)),
                                          nnx.Param))

    def expected_opt_state(meta: dict):
        """The optimizer state the checkpoint should hold: float16 keeps its loss scale there,
        so the checkpoint's compute dtype decides (a changed model.dtype is train.config.resume's to
        refuse or allow; the state is converted on restore, train.program.state)."""
        saved = (meta.get("resume") or {}).get("model.dtype", cfg.model.dtype)
        saved_tx = tx if saved == cfg.model.dtype else make_optimizer(
            cfg.optimizer, cfg.train.steps, loss_scaling(saved))[0]
        return jax.eval_shape(saved_tx.init, expected)

    latest, meta = inspect_latest(run_dir, expected, expected_opt_state)
    if latest is not None and latest > cfg.train.steps:
        raise ConfigError(
            f"run.dir holds a checkpoint of step {latest}, beyond train.steps={cfg.train.steps}; "
            "raise train.steps (with checkpoint.allow_changed=train.steps: the schedule changes) "
            "or use a new run.dir"
        )
    if latest is None:
        return None, {}
    # a checkpoint of an earlier version records only its seed
    before = meta.get("resume") or {"run.seed": meta.get("seed", cfg.run.seed)}
    return latest, resume.check(before, record, cfg.checkpoint.allow_changed)
