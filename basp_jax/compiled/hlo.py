"""Reading a compiled program's HLO text: which instruction runs how often, and what it computes.

    for inst in instructions(hlo_text):      # every instruction of every computation
        inst.op, inst.line, inst.executions  # executions: runs per call of the program

A while loop with a known trip count (XLA writes `"known_trip_count":{"n":"32"}` into its
backend_config, e.g. for a scan over layers or microbatches) runs its body that many times; a
computation called from several places adds up. Collectives (basp_jax.compiled.comm) and kernels
(`attention_kernels`) are counted with these multiplicities, so a scanned program reports what it
executes, not how it is written. Kernels are found by the `attention_kernel` named scope
(jax.named_scope) that basp_jax.attention puts around whichever local kernel runs: XLA keeps it in
each instruction's `op_name` metadata, forward, backward and rematerialised alike.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from functools import cached_property

from ..attention import ATTENTION_SCOPE
from ..cudnn import FALLBACK_SCOPE
from ..cudnn_call import CUSTOM_CALL_PREFIX
from ..ring_hops import HOP_SCOPES

_COMPUTATION_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_CALLEE_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
    r"branch_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_TOP = "<top level>"
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    computation: str
    shape: str  # the result shape text (a tuple for async starts)
    op: str  # e.g. all-to-all-start, custom-call, while, fusion
    line: str
    executions: int  # times it runs per execution of the program
    loop_unknown: bool  # inside a loop whose trip count XLA does not know (counted once)


class Module:
    """An HLO module's text, split into computations with their execution counts."""

    def __init__(self, text: str):
        self.text = text
        # Instructions outside any computation (a snippet of lines) count as the entry's.
        self.computations: dict[str, list[tuple[str, str, str, str]]] = {_TOP: []}
        self.entry: str | None = None
        current = _TOP
        for line in text.splitlines():
            if current == _TOP:
                m = _COMPUTATION_RE.match(line)
                if m:
                    current = m.group(2)
                    self.computations[current] = []
                    if m.group(1):
                        self.entry = current
                    continue
            elif line.strip() == "}":
                current = _TOP
                continue
            m = _INSTRUCTION_RE.match(line)
            if m:
                self.computations[current].append((m.group(1), m.group(2), m.group(3), line))
        if self.entry is None:
            self.entry = list(self.computations)[-1]

    @cached_property
    def executions(self) -> dict[str, tuple[int, bool]]:
        """Per computation: (executions per program run, inside a loop of unknown trip count)."""
        calls: dict[str, list[tuple[str, int, bool]]] = defaultdict(list)  # callee -> callers
        for comp, insts in self.computations.items():
            for _, _, op, line in insts:
                trip = None
                if op == "while":
                    m = _TRIP_RE.search(line)
                    trip = int(m.group(1)) if m else None
                for attr, target in _CALLEE_RE.findall(line):
                    names = re.findall(r"%?([\w.\-]+)", target.strip("{}"))
                    for name in names:
                        if attr == "body":
                            calls[name].append((comp, trip or 1, trip is None))
                        elif attr != "condition":
                            calls[name].append((comp, 1, False))
        memo: dict[str, tuple[int, bool]] = {}

        def count(comp: str, seen=()) -> tuple[int, bool]:
            if comp in (self.entry, _TOP):
                return 1, False
            if comp in memo:
                return memo[comp]
            total, unknown = 0, False
            for caller, factor, unknown_trip in calls.get(comp, []):
                if caller in seen:
                    continue
                n, u = count(caller, seen + (comp,))
                total += n * factor
                unknown = unknown or u or unknown_trip
            memo[comp] = (total, unknown)
            return memo[comp]

        return {comp: count(comp) for comp in self.computations}

    def instructions(self):
        for comp, insts in self.computations.items():
            n, unknown = self.executions[comp]
            for name, shape, op, line in insts:
                yield Instruction(name, comp, shape, op, line, n, unknown)


def instructions(hlo_text: str):
    return Module(hlo_text).instructions()


# What each attention kernel looks like in a compiled program.
KERNEL_CUDNN = "cudnn"  # cuDNN fused (flash) attention custom calls
KERNEL_TRITON = "triton"  # a Pallas/Triton kernel (custom call __gpu$xla.gpu.triton)
KERNEL_LOOP = "pure-JAX loop"  # the blockwise kernel: while loops over key/query blocks
KERNEL_XLA = "xla"  # jax.nn.dot_product_attention's XLA path: materialised scores
# a Pallas/Triton kernel compiled as cuDNN's packed layout's fallback (basp_jax.cudnn): it runs
# only in a step whose rows hold more documents than the layout's bound
KERNEL_TRITON_FALLBACK = "triton, over cuDNN's document bound only"

# The named scope around every local kernel (basp_jax.attention.ATTENTION_SCOPE): what an
# instruction's op_name holds as one path component when attention computed it.
_SCOPE_RE = re.compile(r'op_name="(?:[^"]*/)?' + ATTENTION_SCOPE + r'[/"]')


def _kernel_of(inst) -> tuple[str, str] | None:
    """(kind, target) of an attention kernel's instruction (a cuDNN or Triton custom call, or
    a pure-JAX loop inside attention's scope); None for anything else."""
    if inst.op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', inst.line)
        target = target.group(1) if target else ""
        if target.startswith(CUSTOM_CALL_PREFIX):
            return KERNEL_CUDNN, target
        if "triton" in target:  # named by the function around the pallas_call
            name = _pallas_name(inst.line)
            if (name or "").startswith(GROUPED_MATMUL):  # the experts': expert_kernels
                return None
            kind = KERNEL_TRITON_FALLBACK if f"/{FALLBACK_SCOPE}/" in inst.line else KERNEL_TRITON
            return kind, name or target
    if inst.op == "while" and _SCOPE_RE.search(inst.line):
        return KERNEL_LOOP, "while"
    return None


def attention_kernels(hlo_text: str) -> dict[str, dict]:
    """The attention kernels a compiled program runs: kind -> {"count": executions per program
    run, "targets": the custom-call targets or kernel names seen}."""
    found: dict[str, dict] = {}
    other_attention_ops = 0
    for inst in Module(hlo_text).instructions():
        kernel = _kernel_of(inst)
        if kernel is not None:
            kind, target = kernel
            entry = found.setdefault(kind, {"count": 0, "targets": []})
            entry["count"] += inst.executions
            if target and target not in entry["targets"]:
                entry["targets"].append(target)
        elif inst.op in ("dot", "fusion", "custom-call") and _SCOPE_RE.search(inst.line):
            other_attention_ops += 1
    if not found and other_attention_ops:
        found[KERNEL_XLA] = {"count": other_attention_ops, "targets": []}
    return found


def ring_hop_kernels(hlo_text: str) -> dict[str, dict[str, int]]:
    """Which kernels each shape of ring hop runs (basp_jax.ring_hops.HOP_SCOPES: diagonal,
    off_diagonal, unmasked): shape -> {kind: executions per program run}. Empty without a
    ring."""
    found: dict[str, dict[str, int]] = {}
    for inst in Module(hlo_text).instructions():
        shape = next((name for name, scope in HOP_SCOPES.items() if f"/{scope}/" in inst.line),
                     None)
        kernel = _kernel_of(inst) if shape else None
        if kernel is not None:
            kinds = found.setdefault(shape, {})
            kinds[kernel[0]] = kinds.get(kernel[0], 0) + inst.executions
    return found


GROUPED_MATMUL = "grouped_matmul"  # basp_jax.grouped_matmul's kernels' names start so
KERNEL_RAGGED_DOT = "xla ragged_dot"  # jax.lax.ragged_dot as XLA lowers it


def _pallas_name(line: str) -> str | None:
    name = re.search(r'op_name="[^"]*?([\w.\-]+)/pallas_call"', line)
    return name.group(1) if name else None


def expert_kernels(hlo_text: str) -> dict[str, dict]:
    """The grouped matmuls of a mixture of experts' layers in a compiled program: our Pallas
    kernels (basp_jax.grouped_matmul, kind "triton") or XLA's ragged_dot (on a GPU a dense loop
    over the experts, counted by the instructions it became), as attention_kernels reports."""
    found: dict[str, dict] = {}
    for inst in Module(hlo_text).instructions():
        name = _pallas_name(inst.line) if inst.op == "custom-call" else None
        if name is not None and name.startswith(GROUPED_MATMUL):
            kind, target = KERNEL_TRITON, name
        elif inst.op in ("dot", "fusion") and "/ragged_dot_general" in inst.line:
            kind, target = KERNEL_RAGGED_DOT, inst.op
        else:
            continue
        entry = found.setdefault(kind, {"count": 0, "targets": []})
        entry["count"] += inst.executions
        if target not in entry["targets"]:
            entry["targets"].append(target)
    return found


# Ops that do work on the device (as opposed to bitcasts, tuples, parameters, copies of views).
_WORK_OPS = ("fusion", "custom-call", "convolution", "dot", "while", "call", "conditional")


def overlapped_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Of the async collectives of a scheduled (compiled GPU) program, per kind: how many start
    pairs there are ("pairs") and how many have work scheduled between their start and done
    ("overlapped"). The optimized HLO lists instructions in execution order; without XLA's
    latency-hiding scheduler most dones follow their start at once, with it most enclose compute,
    so this shows whether that scheduler ran. Counted per instruction, not per execution."""
    module = Module(hlo_text)
    out: dict[str, dict[str, int]] = {}
    for insts in module.computations.values():
        started: dict[str, tuple[int, str]] = {}
        for i, (name, _, op, line) in enumerate(insts):
            if op.endswith("-start") and op != "async-start":
                started[name] = (i, op[: -len("-start")])
            elif op.endswith("-done"):
                args = line.split(f"{op}(", 1)[1]  # "%start)" or "(shape) %start)"
                operand = re.search(r"%([\w.\-]+)", args) or re.match(r"\s*([\w.\-]+)", args)
                if operand is None or operand.group(1) not in started:
                    continue
                begin, kind = started.pop(operand.group(1))
                row = out.setdefault(kind, {"pairs": 0, "overlapped": 0})
                row["pairs"] += 1
                row["overlapped"] += any(o in _WORK_OPS for _, _, o, _ in insts[begin + 1:i])
    return out


# FP8 GEMMs in a compiled GPU program: cuBLASLt's FP8 matmul custom call, or a GEMM fusion (XLA's
# Triton emitter; its choice where it cannot autotune, e.g. compiling without a GPU) whose dot
# reads FP8 operands.
CUBLASLT_FP8 = "__cublas$lt$matmul$f8"
_F8_RE = re.compile(r"^f8e\d")


def fp8_gemms(hlo_text: str) -> dict[str, int]:
    """The FP8 matrix multiplies a compiled GPU program runs, in executions per program run:
    {"cublaslt": cuBLASLt FP8 calls, "fusion": GEMM fusions of FP8 operands, "total"}."""
    module = Module(hlo_text)
    f8_dot_computations = set()
    for comp, insts in module.computations.items():
        shapes = {name: shape for name, shape, _, _ in insts}
        for _, _, op, line in insts:
            if op != "dot":
                continue
            operands = re.findall(r"%([\w.\-]+)", line.split(" dot(", 1)[1].split(")", 1)[0])
            if operands and all(_F8_RE.match(shapes.get(o, "")) for o in operands):
                f8_dot_computations.add(comp)
    out = {"cublaslt": 0, "fusion": 0}
    for inst in module.instructions():
        if inst.op == "custom-call" and f'custom_call_target="{CUBLASLT_FP8}"' in inst.line:
            out["cublaslt"] += inst.executions
        elif inst.op == "fusion":
            callee = re.search(r"\bcalls=%?([\w.\-]+)", inst.line)
            if callee and callee.group(1) in f8_dot_computations:
                out["fusion"] += inst.executions
    out["total"] = out["cublaslt"] + out["fusion"]
    return out
