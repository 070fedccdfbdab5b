"""Plan a layout from the command line: predicted communication and step time of every candidate.

    python -m train.tools.plan --model llama-3.1-8b --seq 16384 --batch 2 --devices 8 \
        --devices-per-host 4 --hardware a100-40gb [--docs longtail]

--docs adds the adaptive choice (basp_jax.adaptive, basp_jax.planner.gain): per step, the layout with the most groups
whose rows hold that step's documents, drawn from a named length distribution; its predicted
step time is the mean over sampled steps, against the static layout it expands. Every document of
a sampled step is drawn and packed: 256 steps, fewer when they would hold more than 2**26 tokens
together (at least one), and --docs takes steps of at most 2**26 tokens and 4,096 rows.
"""

from __future__ import annotations

import argparse
import sys

from basp_jax import adaptive
from basp_jax.planner.cost import Prediction, default_pad_rows, plan_table
from basp_jax.planner.gain import predicted_gain
from basp_jax.planner.hardware import HARDWARE
from basp_jax.remat import REMAT_POLICIES
from models.config import MODEL_SHAPES

from ..data.synthetic import DISTRIBUTIONS, sample_steps

GB = 1e9
# The largest value of each integer flag: far beyond any real run, small enough that every
# prediction stays a finite float and the candidate search (divisors, pad rows) answers at once.
LIMITS = {"seq": 1 << 32, "batch": 1 << 20, "devices": 1 << 20, "grad_accum": 1 << 20,
          "devices_per_host": 1 << 20}
MAX_MEMORY_GB = 1e6
MIN_MEMORY_GB = 0.1  # below any accelerator's memory: a typo (or MB for GB)
SAMPLED_STEPS = 256  # --docs: steps drawn (seeded) for the adaptive choice's mean step time
# --docs draws and packs every document of each sampled step in Python: the tokens of all sampled
# steps together stay within SAMPLED_TOKENS, a row counting as at least ROW_TOKENS_FLOOR (fewer
# steps for larger ones, at least one: a step of SAMPLED_TOKENS holds ~50,000 long-tail documents,
# so its choice is already an average over many), and a step's rows within DOCS_MAX_BATCH (each
# document is packed into the first row with room)
SAMPLED_TOKENS = 1 << 26
ROW_TOKENS_FLOOR = 1 << 10  # about a long-tail document: a row of 16 tokens costs as one of 1K
DOCS_MAX_BATCH = 4096


def format_plan(preds: list[Prediction], memory_limit: float) -> str:
    header = (f"{'layout':<30}{'a2a GB':>8}{'a2a inter':>10}{'param GB':>9}{'param inter':>12}"
              f"{'a2a s':>8}{'param s':>8}{'compute s':>10}{'step s':>8}{'mem GB':>8}")
    lines = [header]
    for p in preds:
        over = "  (over memory)" if p.memory_bytes > memory_limit else ""
        lines.append(
            f"{p.name:<30}{(p.all_to_all.intra + p.all_to_all.inter) / GB:>8.2f}"
            f"{p.all_to_all.inter / GB:>10.2f}{(p.params.intra + p.params.inter) / GB:>9.2f}"
            f"{p.params.inter / GB:>12.2f}{p.all_to_all_s:>8.3f}{p.params_s:>8.3f}"
            f"{p.compute_s:>10.3f}{p.step_s:>8.3f}{p.memory_bytes / GB:>8.1f}{over}"
        )
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit status 2, like the rest of the project."""

    def error(self, message: str):
        self.exit(2, f"error: plan: {message} (see {self.prog} --help)\n")


def _check_args(parser, args) -> None:
    """Every number in range, each refusal one line (parser.error, exit status 2)."""
    for name, most in LIMITS.items():
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
        if value is not None and value > most:
            parser.error(f"--{name.replace('_', '-')} must be at most {most:,} (beyond any "
                         f"cluster this models), got {value:,}")
    if args.max_pad_rows is not None and args.max_pad_rows < 0:
        parser.error(f"--max-pad-rows must be >= 0 (masked rows added to the microbatch), got "
                     f"{args.max_pad_rows}")
    if args.max_pad_rows is not None and args.max_pad_rows > args.devices:
        # every group count is reached with fewer pad rows than devices
        parser.error(f"--max-pad-rows must be at most --devices={args.devices} (more reach no "
                     f"other layout), got {args.max_pad_rows}")
    if not 0.0 <= args.overlap <= 1.0:  # also refuses nan
        parser.error(f"--overlap is a share of the parameter collectives, in [0, 1]; got "
                     f"{args.overlap}")
    if args.memory_gb is not None and not MIN_MEMORY_GB <= args.memory_gb <= MAX_MEMORY_GB:
        parser.error(f"--memory-gb must be a positive number of at most {MAX_MEMORY_GB:g} and at "
                     f"least {MIN_MEMORY_GB:g} (GB per device), got {args.memory_gb}")  # nan too
    if args.docs is not None:
        _check_docs_sample(parser, args.batch, args.seq)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m train.tools.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(MODEL_SHAPES))
    parser.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--batch", type=int, required=True, help="microbatch size (sequences)")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--devices-per-host", type=int, default=None)
    parser.add_argument("--hardware", default="a100-40gb", choices=sorted(HARDWARE))
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--memory-gb", type=float, default=None, help="per-device memory limit")
    parser.add_argument("--max-pad-rows", type=int, default=None,
                        help="masked rows the microbatch may be padded with to form more groups "
                             "(default: enough for the next batch size with more groups)")
    # the policies that keep everything on the device: the table has no host memory column
    parser.add_argument("--remat", default="full",
                        choices=[name for name, p in REMAT_POLICIES.items() if not p.offloads],
                        help="the rematerialisation policy, for the memory column (model.remat)")
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="share of parameter collectives hidden behind compute (0..1)")
    parser.add_argument("--no-zigzag", dest="zigzag", action="store_false",
                        help="rings in natural token order (the trainer's parallel.zigzag=false): "
                             "each ring step then waits for its busiest device")
    parser.add_argument("--attn-impl", default="auto",
                        choices=("auto", "cudnn", "pallas", "blockwise", "xla"),
                        help="the attention kernel, for a GPU kind with a measured calibration "
                             "(model.attn_impl; auto: cuDNN's, as for unpacked input on sm80+)")
    parser.add_argument("--fp8", action="store_true",
                        help="the layers' projections at the GPU's FP8 peak (model.fp8)")
    parser.add_argument("--docs", choices=sorted(DISTRIBUTIONS), default=None,
                        help="also predict the adaptive choice for documents of this length "
                             "distribution (longtail: lognormal(6.5, 1.2); full: each fills a row)")
    args = parser.parse_args(argv)
    _check_args(parser, args)
    hw = HARDWARE[args.hardware]
    if args.devices_per_host is not None:
        if args.devices % args.devices_per_host:
            parser.error(f"--devices-per-host {args.devices_per_host} does not divide --devices {args.devices}")
        hw = type(hw)(**{**hw.__dict__, "devices_per_host": args.devices_per_host})
    limit = hw.memory_bytes if args.memory_gb is None else args.memory_gb * GB
    if args.max_pad_rows is None:
        args.max_pad_rows = default_pad_rows(args.batch, args.devices)
    shape = MODEL_SHAPES[args.model]
    preds = plan_table(shape, batch=args.batch, seq_len=args.seq, num_devices=args.devices, hw=hw,
                       grad_accum=args.grad_accum, memory_limit=limit,
                       max_pad_rows=args.max_pad_rows, overlap=args.overlap, remat=args.remat,
                       zigzag=args.zigzag, fp8=args.fp8, attn_impl=args.attn_impl)
    if not preds:
        print(f"error: no layout splits {shape.num_heads} heads and {args.seq} tokens over "
              f"{args.devices} devices; try another --devices or --seq", file=sys.stderr)
        return 2
    print(f"{args.model}: {shape.num_params / 1e9:.2f}B params, batch {args.batch} x {args.seq} tokens, "
          f"{args.devices} devices ({hw.devices_per_host} per host), {hw.name}")
    print("bytes are per device per step; 'inter' = crossing hosts; times are predictions, "
          f"{hw.describe_compute()}\n")
    print(format_plan(preds, limit))
    best = preds[0]
    # The paper's baseline: Ulysses (no ring) with ZeRO-3 (fsdp) parameters.
    ulysses = next((p for p in preds if p.layout.groups == 1 and p.layout.ring == 1
                    and p.param_sharding == "fsdp"), None)
    line = f"\npick: {best.name}, predicted {best.step_s:.3f} s/step"
    if ulysses is not None and best is not ulysses:
        line += f" ({ulysses.step_s / best.step_s:.2f}x vs {ulysses.name})"
    print(line)
    if args.docs is not None:
        print(adaptive_line(shape, preds, args, hw))
    return 0


def _check_docs_sample(parser, batch: int, seq: int) -> None:
    """--docs samples whole steps: one step's documents and rows within the bounds above."""
    if batch > DOCS_MAX_BATCH:
        parser.error(f"--docs packs every document of a step into its rows: --batch must be at "
                     f"most {DOCS_MAX_BATCH:,} with --docs, got {batch:,}")
    if batch * seq > SAMPLED_TOKENS:
        parser.error(f"--docs samples every document of a step: --batch x --seq must be at most "
                     f"{SAMPLED_TOKENS:,} tokens with --docs, got {batch * seq:,}; predict at a "
                     "shorter --seq or smaller --batch")


def sampled_steps(batch: int, seq: int) -> int:
    """How many steps --docs samples: SAMPLED_STEPS, fewer when they would hold more than
    SAMPLED_TOKENS tokens together (rows of at least ROW_TOKENS_FLOOR; at least one step)."""
    return max(1, min(SAMPLED_STEPS, SAMPLED_TOKENS // (batch * max(seq, ROW_TOKENS_FLOOR))))


def adaptive_line(shape, preds: list[Prediction], args, hw) -> str:
    """The adaptive choice over the best static layout whose parameters stay put when it
    switches (basp_jax.adaptive.shares_placement; no pad rows): its predicted mean step time
    for --docs, and how often each layout of its set would run."""
    base = next((p for p in preds if adaptive.shares_placement(p.param_sharding)
                 and not p.layout.pad_rows), None)
    if base is None:
        return "adaptive: no candidate keeps its parameters in place across layouts (fsdp/host)"
    layouts = adaptive.expand(base.layout, param_sharding=base.param_sharding)
    count = sampled_steps(base.layout.batch, base.layout.seq_len)
    steps = sample_steps(args.docs, count, rows=base.layout.batch, seq_len=base.layout.seq_len)
    gain = predicted_gain(shape, layouts, steps, hw=hw, param_sharding=base.param_sharding,
                          grad_accum=args.grad_accum, remat=args.remat, overlap=args.overlap)
    shares = ", ".join(f"{lay.groups}x{lay.sp} {gain.share(i):.0%}"
                       for i, lay in enumerate(layouts) if gain.share(i))
    return (f"adaptive over {base.name} (--docs {args.docs}, {count} sampled steps): "
            f"predicted {gain.adaptive_s:.3f} s/step ({gain.gain:.2f}x); layouts run: {shares}")


if __name__ == "__main__":
    sys.exit(main())
