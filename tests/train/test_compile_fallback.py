"""A cuDNN refusal at compile time (train.program.compile_fallback): XLA refuses the step's
cuDNN attention, the step is traced again with the fallback kernel in its place, compiled, and
says so in one note; the rest of the process asks cuDNN no more (basp_jax.cudnn_call). On CPU
the kernels are tests/helpers/cudnn_emulator's and the refusing compiler a stand-in that fails
as jaxlib 0.12's does for any program that binds cuDNN; the GPU-compile tier
(tests/e2e/test_gpu_compile.py) meets the real refusal under that jaxlib."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from basp_jax import cudnn, cudnn_call, ring_hops
from basp_jax.flash import FlashBlocks
from basp_jax.ring_hops import HopKernel
from train.program import compile_fallback

from tests.helpers import cudnn_emulator
from tests.helpers.reference import reference_attention

# jaxlib 0.12's message, verbatim (a deviceless compile of a cuDNN custom call)
XLA_REFUSAL = ("INVALID_ARGUMENT: StreamExecutor is null and deviceless cuDNN compilation is "
               "not enabled.\nMore of XLA's words")


@pytest.fixture
def fake_cudnn(monkeypatch):
    calls = cudnn_emulator.install(monkeypatch, cudnn_call)
    yield calls
    cudnn_call.allow_again()  # the refusal is the process's: never past this test


def _qkv(seed, shape=(2, 32, 4, 8)):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(x, shape) for x in keys)


def _attention(q, k, v):
    """The step's attention as the GPU runs it: cuDNN, our kernel where cuDNN is refused."""
    return cudnn.attention(q, k, v, causal=True, capability=(9, 0),
                           fallback=lambda q, k, v, **kw: reference_attention(q, k, v, **kw))


class _Compiler:
    """XLA as it refuses cuDNN attention: compiling a program that binds cuDNN's kernels fails
    with `error` (always: every program fails with it)."""

    def __init__(self, calls, error=XLA_REFUSAL, always=False):
        self.calls, self.error, self.always, self.compiles = calls, error, always, 0

    def program(self, fn=_attention):
        compiler = self

        class Lowered:
            def __init__(self, lowered, binds):
                self.lowered, self.binds = lowered, binds

            def as_text(self):
                text = self.lowered.as_text()
                return text + f"\ncustom_call @{cudnn_call.CUSTOM_CALL_PREFIX}Softmax" \
                    if self.binds else text

            def compile(self):
                compiler.compiles += 1
                if self.binds or compiler.always:
                    raise RuntimeError(compiler.error)
                return self.lowered.compile()

        class Program:
            rebuilds = 0

            def __init__(self):  # a function of its own, as each built step is: traced afresh
                self.step = jax.jit(lambda *args: fn(*args))

            def lower(self, q, kv):
                before = len(compiler.calls)
                lowered = self.step.lower(q, *kv)
                return Lowered(lowered, len(compiler.calls) > before)

            def rebuild(self):
                again = Program()
                again.rebuilds = self.rebuilds + 1
                return again

        return Program()


def test_a_refused_step_compiles_again_with_the_fallback_and_one_note(fake_cudnn):
    q, k, v = _qkv(0)
    xla = _Compiler(fake_cudnn)
    lines = []
    program, compiled = compile_fallback.compile_step(xla.program(), q, (k, v), lines.append)
    assert program.rebuilds == 1 and xla.compiles == 2
    assert len(fake_cudnn) == 1  # the first trace bound cuDNN, the second did not
    np.testing.assert_allclose(compiled(q, k, v), reference_attention(q, k, v, causal=True),
                               atol=1e-5)
    assert len(lines) == 1 and "deviceless cuDNN compilation is not enabled" in lines[0] \
        and "More of XLA's words" not in lines[0] and "Pallas" in lines[0], lines
    assert "deviceless cuDNN" in cudnn_call.compile_refusal()
    # the process has learned: the next step is traced with the fallback at once
    program, _ = compile_fallback.compile_step(xla.program(), q, (k, v), lines.append)
    assert program.rebuilds == 0 and xla.compiles == 3 and len(fake_cudnn) == 1
    assert len(lines) == 1


def test_a_ring_traced_after_the_refusal_runs_pallas_hops_without_a_second_note(fake_cudnn,
                                                                                caplog):
    cudnn_call.refuse_for_process("no engine for this graph")
    q, k, v = _qkv(1, (1, 32, 2, 16))
    kernel = HopKernel("cudnn", FlashBlocks.square(16), True)
    with caplog.at_level(logging.WARNING):
        got = ring_hops.forward(kernel, q, k, v, causal=True, block_size=16, diagonal=False,
                                k_shift=-32)
        out = _attention(q, k, v)
    want = ring_hops.forward(HopKernel("pallas", FlashBlocks.square(16), True), q, k, v,
                             causal=True, block_size=16, diagonal=False, k_shift=-32)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w)
    np.testing.assert_allclose(out, reference_attention(q, k, v, causal=True), atol=1e-5)
    assert not fake_cudnn and not caplog.records  # the one note was the compiler's caller's
    cudnn_call.allow_again()
    _attention(q, k, v)
    assert fake_cudnn == ["CAUSAL"]


@pytest.mark.parametrize("error,binds", [
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3.1GiB", True),
    # too big for the GPU, whatever kernel: a cuDNN workspace's allocation is not a refusal
    ("RESOURCE_EXHAUSTED: Failed to allocate 9.0GiB for the cuDNN workspace", True),
    (XLA_REFUSAL, False),  # a program without cuDNN attention: not its refusal
])
def test_other_compile_errors_are_raised_as_they_are(fake_cudnn, error, binds):
    q, k, v = _qkv(2)
    fn = _attention if binds else (lambda q, k, v: reference_attention(q, k, v, causal=True))
    program = _Compiler(fake_cudnn, error=error, always=True).program(fn)
    with pytest.raises(RuntimeError, match=error.split(":")[0]):
        compile_fallback.compile_step(program, q, (k, v), print)
    assert cudnn_call.compile_refusal() is None


def test_a_second_refusal_is_raised(fake_cudnn):
    q, k, v = _qkv(3)
    xla = _Compiler(fake_cudnn)
    # a step that binds cuDNN's kernels without asking whether they were refused: refused again
    program = xla.program(lambda q, k, v: cudnn_call.attention(q, k, v, mask="causal"))
    with pytest.raises(RuntimeError, match="deviceless cuDNN"):
        compile_fallback.compile_step(program, q, (k, v), print)
    assert xla.compiles == 2
    # refused before in this process: a later refusal is raised at once (no rebuild, no note)
    stale = xla.program(lambda q, k, v: cudnn_call.attention(q, k, v, mask="causal"))
    lines = []
    with pytest.raises(RuntimeError, match="deviceless cuDNN"):
        compile_fallback.compile_step(stale, q, (k, v), lines.append)
    assert not lines and xla.compiles == 3


def test_a_program_that_cannot_be_rebuilt_raises_the_refusal(fake_cudnn):
    q, k, v = _qkv(4)
    program = _Compiler(fake_cudnn).program()
    program.rebuild = None
    with pytest.raises(RuntimeError, match="deviceless cuDNN"):
        compile_fallback.compile_step(program, q, (k, v), print)
    assert cudnn_call.compile_refusal() is None


def test_the_dense_path_before_hopper_asks_too(fake_cudnn, caplog):
    """Packed documents before Hopper (cuDNN with a dense segment mask, JAX's own wrapper): after
    a refusal the fallback runs without tracing cuDNN (on this CPU, tracing it would fail and be
    noted as a refusal of its own)."""
    cudnn_call.refuse_for_process("no engine")
    q, k, v = _qkv(5)
    segments = jnp.asarray(np.repeat([[1, 2, 3, 4]], 2, axis=0).repeat(8, axis=1))
    with caplog.at_level(logging.WARNING):
        out = cudnn.attention(q, k, v, causal=True, segment_ids=segments, capability=(8, 0),
                              fallback=lambda q, k, v, **kw: reference_attention(q, k, v, **kw))
    np.testing.assert_allclose(out, reference_attention(q, k, v, causal=True,
                                                        segment_ids=segments), atol=1e-5)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
