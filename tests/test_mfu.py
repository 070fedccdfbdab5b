"""Peak FLOP/s for MFU: one GPU table (basp_jax.gpus), matched by the exact device kind."""

import pytest

from basp_jax import cost, gpus
from train.config import ConfigError, MetricsConfig
from train.metrics import peak_flops

# device_kind as JAX reports it on each GPU (the CUDA device name) -> bf16 dense peak, TFLOP/s
KINDS = {
    "NVIDIA A100-SXM4-40GB": 312, "NVIDIA A100-SXM4-80GB": 312, "NVIDIA A100-PCIE-40GB": 312,
    "NVIDIA A100 80GB PCIe": 312, "NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756,
    "NVIDIA H100 NVL": 835, "NVIDIA H800": 989, "NVIDIA H200": 989, "NVIDIA H200 NVL": 835,
    "NVIDIA B200": 2250,
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_device_kind_gets_its_own_peak_and_the_log_names_it(kind):
    peak, line = peak_flops(MetricsConfig(), kind)
    assert peak == KINDS[kind] * 1e12
    assert line == f"{KINDS[kind]:g} TFLOP/s per device, the bf16 dense peak of {kind}"


@pytest.mark.parametrize("kind", ["NVIDIA H100", "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
                                  "NVIDIA GeForce RTX 4090", "cpu", None])
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
    for name, hw in cost.HARDWARE.items():  # the planner's peak is the table's
        assert hw.peak_flops == gpus.GPUS[name].peak_bf16_flops
    assert set(gpus.TARGETS) == {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb"}
    with pytest.raises(ValueError, match="unknown GPU 'b200'; use one of a100-40gb"):
        gpus.target_config("b200")  # a peak alone is not enough to compile for it
