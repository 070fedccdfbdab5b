"""What follows from a GPU's generation, checked without one: the compute dtype model.dtype=auto
gives, the kernels the trainer and train.tools.aot refuse before compiling, and train.tools.aot's one-line
answers when XLA refuses or the step does not fit (the compiled cases: tests/e2e/test_gpu_compile.py).
"""

import pytest

from basp_jax import gpus
from train.tools import aot_errors, fit_advice
from train.config.schema import ConfigError, load_config, replace
from train.prepare import check_kernel, with_compute_dtype
from train.program.step import compute_dtype


class FakeDevice:
    """The attributes of a jax device these checks read."""

    def __init__(self, gpu: str | None):
        g = gpus.GPUS.get(gpu)
        self.platform = "gpu" if g else "cpu"
        self.device_kind = g.device_kind if g else "cpu"
        self.compute_capability = "%d.%d" % g.compute_capability if g else None


@pytest.mark.parametrize("gpu,dtype", [("t4-16gb", "float16"), ("l4-24gb", "bfloat16"),
                                       ("a10g-24gb", "bfloat16"), ("a100-40gb", "bfloat16"),
                                       (None, "float32")])
def test_auto_dtype_is_bf16_where_the_gpu_has_it(gpu, dtype):
    device = FakeDevice(gpu)
    assert compute_dtype("auto", device) == dtype
    assert compute_dtype("bfloat16", device) == "bfloat16"  # an explicit dtype is kept
    if gpu:
        assert dtype == gpus.GPUS[gpu].half_dtype
    cfg = load_config("configs/colab.yaml")
    assert cfg.model.dtype == "auto" and with_compute_dtype(cfg, device).model.dtype == dtype


@pytest.mark.parametrize("gpu", sorted(gpus.GPUS))
def test_the_trainer_and_the_planner_resolve_auto_alike(gpu):
    """model.dtype=auto on a device of this GPU (the trainer) and for it as parallel.hardware
    (the planner, train.tools.aot --plan) come from one rule, basp_jax.gpus.auto_compute_dtype."""
    from train.program.planning import _compute_dtype

    cfg = load_config("configs/colab.yaml", [f"parallel.hardware={gpu}"])
    assert compute_dtype("auto", FakeDevice(gpu)) == _compute_dtype(cfg) == gpus.GPUS[gpu].auto_dtype


def test_auto_compute_dtype_by_compute_capability():
    assert [gpus.auto_compute_dtype(cc) for cc in ((6, 1), (7, 0), (7, 5), (8, 0), (9, 0), None)] \
        == ["float32", "float16", "float16", "bfloat16", "bfloat16", "bfloat16"]


def test_a_kernel_the_gpu_cannot_run_is_one_config_error():
    cfg = load_config("configs/colab.yaml")
    t4, l4 = FakeDevice("t4-16gb"), FakeDevice("l4-24gb")
    for impl in ("pallas", "cudnn"):
        with pytest.raises(ConfigError, match=f"model.attn_impl={impl} on Tesla T4: "
                                              f"attn_impl='{impl}' needs a GPU of compute "
                                              "capability 8.0"):
            check_kernel(replace(cfg, f"model.attn_impl={impl}"), t4)
        check_kernel(replace(cfg, f"model.attn_impl={impl}"), l4)
    with pytest.raises(ConfigError, match="in bfloat16 does not compile for sm75"):
        check_kernel(replace(cfg, "model.attn_impl=xla", "model.dtype=bfloat16"), t4)
    for ok in ("model.attn_impl=xla", "model.attn_impl=blockwise", "model.attn_impl=auto"):
        check_kernel(replace(cfg, ok), t4)  # auto dtype is float16 there: xla compiles
    with pytest.raises(ConfigError, match="model.attn_impl=cudnn needs a GPU but the devices"):
        check_kernel(replace(cfg, "model.attn_impl=cudnn"), FakeDevice(None))


def test_an_xla_refusal_becomes_one_line_naming_the_setting():
    triton = RuntimeError("FAILED_PRECONDITION: Triton support is only enabled for Ampere GPUs "
                          "(compute capability 8.0) and up, but got compute capability 7.5.\n"
                          "\nFor simplicity, JAX has removed its internal frames ...")
    line = aot_errors.compile_failure(triton, "t4-16gb")
    assert "\n" not in line and line.startswith("XLA could not compile the step for t4-16gb: "
                                                "FAILED_PRECONDITION: Triton support")
    assert line.endswith("set model.attn_impl=auto or blockwise")
    bf16 = RuntimeError("UNIMPLEMENTED: Unsupported algorithm on the current device(s): "
                        "ALG_DOT_BF16_BF16_F32")
    assert "t4-16gb has no bf16 matrix multiply in XLA (sm75); set model.dtype=auto" in \
        aot_errors.compile_failure(bf16, "t4-16gb")
    # jaxlib 0.12's XLA compiles no cuDNN custom call without a GPU (its message, verbatim)
    deviceless = RuntimeError("INVALID_ARGUMENT: StreamExecutor is null and deviceless cuDNN "
                              "compilation is not enabled; failed to resolve cuDNN support for "
                              "custom call: __cudnn$fmhaSoftmax")
    assert aot_errors.compile_failure(deviceless, "h100-80gb").endswith(
        "compile with jax 0.10, or set model.attn_impl=pallas to compile the program with our "
        "kernel instead")
    other = aot_errors.compile_failure(RuntimeError("INTERNAL: something else"), "l4-24gb")
    assert other.endswith("try model.attn_impl=blockwise (it compiles for every GPU) or "
                          "model.dtype=float32")


def test_would_fit_names_the_shortest_change_by_the_planners_formula():
    """An 8B step on 2 x 4 T4s (16 GiB compiled, the formula's own figure here): 16 GPUs hold it,
    no shorter length does (the parameters and Adam state alone take 9.35 GiB of 13.3)."""
    cfg = replace(load_config("configs/gpu/llama-3.1-8b_basp.yaml"), "parallel.hardware=t4-16gb")
    usable = gpus.usable_memory_bytes(gpus.GPUS["t4-16gb"])
    r = {"peak_bytes_per_device": 16 * 2**30, "formula_memory_bytes": 16 * 2**30,
         "usable_memory_bytes": usable}
    assert fit_advice.would_fit(cfg, r, 8, 4) == "--hosts 4 (16 GPUs)"
    assert fit_advice.would_fit(replace(cfg, "model.remat=dots"), r, 8, 4) == \
        "--hosts 4 (16 GPUs) model.remat=auto"


@pytest.mark.parametrize("gpu,auto", [
    ("t4-16gb", False), ("a100-40gb", False), ("a10g-24gb", False), ("l4-24gb", False),
    ("h100-80gb", True), ("h200-141gb", True), (None, False)])
def test_fp8_true_needs_fp8_tensor_cores_and_auto_takes_sm90(gpu, auto):
    from train.program.model_setup import fp8_enabled
    from train.prepare import check_fp8

    device = FakeDevice(gpu)
    cfg = load_config("configs/colab.yaml")
    assert fp8_enabled(replace(cfg, "model.fp8=auto"), device) is auto
    assert fp8_enabled(cfg, device) is False  # off by default
    check_fp8(replace(cfg, "model.fp8=auto"), device)  # auto never refuses
    on = replace(cfg, "model.fp8=true")
    if gpu and gpus.GPUS[gpu].fp8_peak_flops is None:
        with pytest.raises(ConfigError, match=r"model.fp8=true on .*sm\d+ has no FP8 tensor cores"):
            check_fp8(on, device)
    else:  # sm89+, or the CPU, which emulates FP8
        check_fp8(on, device)
        assert fp8_enabled(on, device) is True
