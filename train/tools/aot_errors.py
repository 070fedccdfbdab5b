"""The errors of compiling for a GPU without one (train.tools.aot), and the one line that names
the setting to change when XLA refuses a step."""

from __future__ import annotations


class AotError(ValueError):
    """Bad input for the compile command; the one-line message says what to change or install."""



class CompileFailed(AotError):
    """XLA refused to compile the step for the target (exit 1, as a step that does not fit)."""



class DoesNotFitUncompiled(CompileFailed):
    """The step cannot fit the target, plainly enough to say so before compiling (exit 1): the
    compile could take many minutes to say the same."""


# What XLA's error says -> the setting to change (first match wins). A kernel the target cannot
# run is refused before compiling (train.prepare.check_kernel); these are what gets past that.
_COMPILE_HINTS = (
    ("Triton", "the Pallas/Triton attention kernel does not compile for {target} (Triton needs "
     "sm80); set model.attn_impl=auto or blockwise"),
    ("ALG_DOT_BF16", "{target} has no bf16 matrix multiply in XLA (sm{sm}); set model.dtype=auto "
     "(float16 there) or float32, or model.attn_impl=blockwise if it is attention's"),
    # jaxlib 0.12's XLA: "StreamExecutor is null and deviceless cuDNN compilation is not enabled"
    ("deviceless cudnn", "this jaxlib's XLA compiles no cuDNN attention without a GPU (jaxlib "
     "0.10's does); compile with jax 0.10, or set model.attn_impl=pallas to compile the program "
     "with our kernel instead"),
    ("cudnn", "the cuDNN attention kernel does not compile for {target}; set "
     "model.attn_impl=pallas or blockwise"),
    ("RESOURCE_EXHAUSTED", "the step needs more memory than {target} has even to compile; lower "
     "data.seq_len or train.microbatch_size, or set model.remat=auto"),
)


def compile_failure(error: BaseException, target: str) -> str:
    """One line for a compile error: XLA's first line and the setting that avoids it."""
    from basp_jax import gpus

    text = str(error)
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    cc = gpus.get(target).compute_capability
    for needle, hint in _COMPILE_HINTS:
        if needle.lower() in text.lower():
            fix = hint.format(target=target, sm=f"{cc[0]}{cc[1]}")
            break
    else:
        fix = "try model.attn_impl=blockwise (it compiles for every GPU) or model.dtype=float32"
    return f"XLA could not compile the step for {target}: {first[:300]}; {fix}"
