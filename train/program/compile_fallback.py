"""Compiling a train step whose cuDNN attention XLA refuses: the same step once more, with the
kernel cuDNN falls back to (basp_jax.cudnn: our Pallas kernel), and one note.

JAX's checks while tracing catch most of what cuDNN cannot run (a head_dim, a dtype, a GPU
generation; basp_jax.cudnn_call.check), and those fall back as they are traced. What is left
shows only when XLA builds cuDNN's graphs, at compile time: a shape or mask this cuDNN version
has no engine for, or a compiler that cannot build them without a GPU (jaxlib 0.12's, compiling
for a GPU that is not present). Then this process stops asking cuDNN
(basp_jax.cudnn_call.refuse_for_process) and the step is traced and compiled again.
"""

from __future__ import annotations

from typing import Callable

from basp_jax import cudnn_call


def first_line(error: BaseException, limit: int = 300) -> str:
    """An error's first non-empty line (its type's name where it has none), cut at `limit`,
    without a closing period."""
    text = next((line.strip() for line in str(error).splitlines() if line.strip()),
                type(error).__name__)
    return text[:limit].rstrip(".")


def is_cudnn_refusal(error: BaseException, lowered) -> bool:
    """Whether compiling `lowered` (a jax Lowered) failed on its cuDNN attention: the error
    speaks of cuDNN (and not of memory: a step too big for the GPU stays too big) and the
    program calls cuDNN's attention kernels."""
    text = str(error)
    if "cudnn" not in text.lower() or "RESOURCE_EXHAUSTED" in text:
        return False
    try:
        return cudnn_call.CUSTOM_CALL_PREFIX in lowered.as_text()
    except Exception:  # noqa: BLE001 (a program that cannot print itself: not ours to retry)
        return False


def compile_step(program, params, opt_state, log: Callable[[str], None]):
    """(program, compiled) of a TrainProgram (train.program.state) for these parameters and
    optimizer state (arrays or ShapeDtypeStructs with shardings). Where XLA refuses the step's
    cuDNN attention, the program is built again (program.rebuild) with cuDNN refused for the
    rest of the process, logged in one line, and that program and its compiled step returned;
    any other error, or a second refusal, is raised as it is."""
    lowered = program.lower(params, opt_state)
    try:
        return program, lowered.compile()
    except Exception as e:  # noqa: BLE001 (XLA's errors have no common public type)
        if cudnn_call.compile_refusal() is not None or program.rebuild is None \
                or not is_cudnn_refusal(e, lowered):
            raise  # refused before (the fallback's own error), or not cuDNN's refusal
        reason = first_line(e)
    del lowered  # its program text can be large
    cudnn_call.refuse_for_process(reason)
    log(f"note: XLA could not compile cuDNN attention ({reason}); compiling the step again "
        f"with the Pallas kernel in its place")
    program = program.rebuild()
    return program, program.lower(params, opt_state).compile()
