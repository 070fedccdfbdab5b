"""Per-step metrics: one JSON object per line in run.dir/metrics.jsonl, a progress bar, a summary.

Only process 0 writes. On resume, lines of steps after the checkpoint are dropped first, so the
file always holds one line per step of the run that is being continued.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from ..config.schema import ConfigError, MetricsConfig


def peak_flops(cfg: MetricsConfig, device_kind: str | None = None, *,
               fp8_share: float = 0.0) -> tuple[float | None, str]:
    """Peak FLOP/s of one device for MFU, and a line for the log naming it (or saying why MFU is
    not reported): metrics.peak_flops, else the GPU metrics.device names, else the GPU whose
    device kind is exactly `device_kind` (basp_jax.gpus, bf16 dense; fp16 without bf16).
    fp8_share: the share of the step's FLOPs model.fp8 runs as FP8 matmuls; on a GPU with an
    FP8 peak those count at it (basp_jax.gpus.Gpu.step_peak), the rest at the bf16 one."""
    from basp_jax import gpus

    if cfg.peak_flops is not None:
        return cfg.peak_flops, f"{cfg.peak_flops / 1e12:g} TFLOP/s per device (metrics.peak_flops)"
    if cfg.device is not None:
        gpu = gpus.GPUS.get(cfg.device.lower())
        if gpu is None:
            raise ConfigError(f"metrics.device {cfg.device!r} is not a known GPU; use one of "
                              f"{', '.join(gpus.GPUS)} or set metrics.peak_flops")
        peak, line = gpu.step_peak(fp8_share)
        return peak, f"{line} (metrics.device={gpu.name})"
    gpu = gpus.by_device_kind(device_kind) if device_kind else None
    if gpu is None:
        return None, (f"no peak FLOP/s is known for device kind {device_kind!r}, so mfu is not "
                      "reported; set metrics.peak_flops (FLOP/s per device) or metrics.device")
    return gpu.step_peak(fp8_share)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def progress_line(record: dict[str, Any], total: int, remaining_s: float | None) -> str:
    """One progress line for a log that is not a terminal (no carriage returns)."""
    parts = [f"step {record['step']}/{total}", f"loss {record['loss']:.4f}"]
    if "aux_loss" in record:
        parts.append(f"aux_loss {record['aux_loss']:.4f}")
    parts += [f"grad_norm {record['grad_norm']:.3g}", f"lr {record['lr']:.3g}",
              f"{record['tokens_per_s']:,.0f} tok/s", f"{record['step_time_s']:.3g} s/step"]
    if record.get("mfu") is not None:
        parts.append(f"mfu {record['mfu']:.1%}")
    if remaining_s is not None:
        parts.append(f"eta {remaining_s:,.0f}s")
    return "  ".join(parts)


class MetricsLogger:
    """metrics.jsonl, and the progress on stderr: a bar on a terminal, else a line every
    log_every steps and at the last one. files=False: nothing is written (a run with nothing
    to do), messages still go to stderr."""

    def __init__(self, run_dir: str, cfg: MetricsConfig, *, total_steps: int, start_step: int,
                 is_writer: bool, files: bool = True):
        self.is_writer = is_writer
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.bar = None
        self.file = None
        self.total = total_steps
        self.every = 0  # progress lines every so many steps (0: none)
        if not is_writer or not files:
            return
        kept = []
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                for raw in f:
                    try:  # a line cut short by a crash (no newline, half an object) is dropped
                        line = raw.decode("utf-8").rstrip("\r\n")
                        if json.loads(line)["step"] <= start_step:
                            kept.append(line + "\n")  # the last line may lack its newline
                    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
                            RecursionError):  # (nested thousands deep: not ours either)
                        continue
        # rewrite through a temporary file: a crash here must not lose the kept lines
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)
        self.file = open(self.path, "a")
        if cfg.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr)
        elif cfg.progress:
            self.every = cfg.log_every or max(1, round(total_steps / 20))

    def log(self, record: dict[str, Any]) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self.file.flush()
        step = record["step"]
        if self.every and (step % self.every == 0 or step == self.total):
            remaining = (self.total - step) * record["step_time_s"]
            print(progress_line(record, self.total, remaining if step < self.total else None),
                  file=sys.stderr, flush=True)
        if self.bar is not None:
            postfix = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
            if record.get("mfu") is not None:
                postfix["mfu"] = f"{record['mfu']:.1%}"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)

    def message(self, text: str) -> None:
        if not self.is_writer:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
