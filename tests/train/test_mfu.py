"""Peak FLOP/s for MFU: one GPU table (basp_jax.gpus), matched by the exact device kind."""

import pytest

from basp_jax import gpus
from basp_jax.kernels import gpu_kernels
from basp_jax.planner.hardware import HARDWARE
from train.config.schema import ConfigError, MetricsConfig
from train.observe.metrics import peak_flops

# device_kind as JAX reports it on each GPU (the CUDA device name) -> bf16 dense peak, TFLOP/s
KINDS = {
    "NVIDIA A100-SXM4-40GB": 312, "NVIDIA A100-SXM4-80GB": 312, "NVIDIA A100-PCIE-40GB": 312,
    "NVIDIA A100 80GB PCIe": 312, "NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756,
    "NVIDIA H100 NVL": 835, "NVIDIA H800": 989, "NVIDIA H200": 989, "NVIDIA H200 NVL": 835,
    "NVIDIA B200": 2250, "NVIDIA L4": 121, "NVIDIA A10G": 125, "NVIDIA GeForce RTX 4090": 165.2,
    "Tesla T4": 65,  # fp16: no bf16 tensor cores
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_device_kind_gets_its_own_peak_and_the_log_names_it(kind):
    peak, line = peak_flops(MetricsConfig(), kind)
    assert peak == KINDS[kind] * 1e12
    half = "fp16" if kind == "Tesla T4" else "bf16"
    assert line == f"{KINDS[kind]:g} TFLOP/s per device, the {half} dense peak of {kind}"


@pytest.mark.parametrize("kind", ["NVIDIA H100", "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
                                  "NVIDIA GeForce RTX 3090", "cpu", None])
def test_an_unknown_kind_has_no_peak_and_says_so(kind):
    peak, line = peak_flops(MetricsConfig(), kind)
    assert peak is None
    assert line.startswith(f"no peak FLOP/s is known for device kind {kind!r}, so mfu is not "
                           "reported; set metrics.peak_flops")


def test_configured_peaks_come_first():
    assert peak_flops(MetricsConfig(peak_flops=5e14), "NVIDIA H100 PCIe") == (
        5e14, "500 TFLOP/s per device (metrics.peak_flops)")
    peak, line = peak_flops(MetricsConfig(device="h100-nvl"), "cpu")
    assert peak == 835e12 and "NVIDIA H100 NVL (metrics.device=h100-nvl)" in line
    with pytest.raises(ConfigError, match="metrics.device 'h100' is not a known GPU; use one of "
                                          "a100-40gb, a100-80gb, h100-80gb, h200-141gb, "):
        peak_flops(MetricsConfig(device="h100"), None)


def test_one_table_serves_mfu_the_planner_and_the_compile_targets():
    kinds = [g.device_kind for g in gpus.GPUS.values()]
    assert len(set(kinds)) == len(kinds) == len(KINDS) and set(kinds) == set(KINDS)
    for name, hw in HARDWARE.items():  # the planner's peak is the table's
        assert hw.peak_flops == gpus.GPUS[name].peak_flops
    assert set(gpus.TARGETS) == set(HARDWARE) == {
        "a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "t4-16gb", "l4-24gb", "a10g-24gb",
        "rtx4090-24gb"}
    # bf16 tensor cores and the fused attention kernels from sm80 only
    assert [n for n, g in gpus.GPUS.items() if not g.bf16] == ["t4-16gb"]
    assert gpus.GPUS["t4-16gb"].half_dtype == "float16"
    assert [n for n, g in gpus.GPUS.items()
            if "pallas" not in gpu_kernels(g.compute_capability)] == ["t4-16gb"]
    t4 = gpus.target_config("t4-16gb")  # what XLA is told about a T4 (sm75: 1024 threads per SM)
    assert "core_count: 40" in t4 and "threads_per_core_limit: 1024" in t4
    assert "major: 7\n    minor: 5" in t4 and 'device_description_str: "Tesla T4"' in t4
    with pytest.raises(ValueError, match="unknown GPU 'b200'; use one of a100-40gb"):
        gpus.target_config("b200")  # a peak alone is not enough to compile for it


@pytest.mark.parametrize("name", list(gpus.GPUS))
def test_a_gpu_has_an_fp8_peak_exactly_when_it_has_fp8_tensor_cores(name):
    """sm89+ (Ada, Hopper, Blackwell): dense FP8 is twice the bf16 peak on NVIDIA's sheets."""
    from models import fp8

    gpu = gpus.GPUS[name]
    if fp8.unsupported("gpu", gpu.compute_capability):
        assert gpu.fp8_peak_flops is None
    else:
        assert 1.99 < gpu.fp8_peak_flops / gpu.peak_flops < 2.01


def test_under_fp8_mfu_counts_the_projections_at_the_fp8_peak():
    h100, a100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"
    bf16_peak = peak_flops(MetricsConfig(), h100)[0]
    for share in (0.25, 0.9):
        peak, line = peak_flops(MetricsConfig(), h100, fp8_share=share)
        # the time both peaks take for the step's FLOPs, whatever the split
        assert 1 / peak == pytest.approx((1 - share) / 989e12 + share / 1979e12)
        assert bf16_peak < peak < 1979e12 and "FP8" in line and f"{share:.0%}" in line
    assert peak_flops(MetricsConfig(), a100, fp8_share=0.9) == peak_flops(MetricsConfig(), a100)
    assert peak_flops(MetricsConfig(peak_flops=5e14), h100, fp8_share=0.9)[0] == 5e14
