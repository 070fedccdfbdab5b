"""Hardware presets of the cost model: each GPU kind's peak FLOP/s and memory, its links' bandwidth
and latency inside a host and across hosts, and its host memory and PCIe link."""

from __future__ import annotations

import dataclasses

from .. import gpus
from . import calibration
from .calibration import Calibration


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # per device, bf16 dense
    intra_bw: float  # bytes/s per device per direction inside a host (NVLink)
    inter_bw: float  # bytes/s per device across hosts (its share of the NICs)
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    devices_per_host: int = 8
    memory_bytes: float = 80e9  # what the planner may use per device
    efficiency: float = 0.4  # achieved fraction of peak for the model's FLOPs
    # Each GPU's share of its host: pinned memory the offload policies may fill, and its PCIe
    # link's bytes/s per direction (basp_jax.remat.REMAT_POLICIES "offload*").
    host_memory_bytes: float = 128e9
    host_bw: float = 25e9
    fp8_peak_flops: float | None = None  # per device, dense FP8 (None: no FP8 tensor cores)
    # measured rates of this GPU kind (basp_jax.planner.calibration), read in place of
    # `efficiency` where one was measured
    calibration: Calibration | None = dataclasses.field(default=None, compare=False)

    def describe_compute(self) -> str:
        """One line: which compute model the step times come from."""
        if self.calibration is not None:
            c = self.calibration
            return f"compute from the {c.target} calibration ({c.source})"
        return (f"compute at {self.efficiency:.0%} of the peak (no calibration measured for this "
                f"GPU kind)")

    def compute_seconds(self, flops: float, fp8_flops: float = 0.0) -> float:
        """Seconds for `flops` at this efficiency, `fp8_flops` of them (model.fp8's projections)
        at the FP8 peak where the GPU has one, the rest at the bf16 peak."""
        if not self.fp8_peak_flops:
            return flops / (self.peak_flops * self.efficiency)
        return ((flops - fp8_flops) / self.peak_flops
                + fp8_flops / self.fp8_peak_flops) / self.efficiency


def _cluster(gpu: str, description: str, intra_bw: float, inter_bw: float,
             devices_per_host: int, host_memory: float, host_bw: float) -> Hardware:
    """A cluster preset of `gpu` (basp_jax.gpus): its peak FLOP/s, and the memory JAX may take."""
    g = gpus.get(gpu)
    return Hardware(f"{g.device_kind}, {description}", g.peak_flops, intra_bw, inter_bw,
                    devices_per_host=devices_per_host, memory_bytes=gpus.usable_memory_bytes(g),
                    host_memory_bytes=host_memory, host_bw=host_bw,
                    fp8_peak_flops=g.fp8_peak_flops, calibration=calibration.for_target(gpu))


# Named like the GPU targets of basp_jax.gpus (and python -m train.tools.aot --target).
# Host memory per GPU: a DGX A100 has 1 TB for 8 GPUs, a DGX H100/H200 2 TB (the planner may
# fill 90% of the share with pinned buffers); PCIe Gen4 x16 moves ~25 GB/s per direction, Gen5
# ~50 GB/s (what a copy engine reaches, not the link's 32 / 64 GB/s).
HARDWARE = {
    # The paper's testbed: 2 nodes x 4 A100-SXM4-40GB (NVLink3), 400 Gb/s InfiniBand per node.
    "a100-40gb": _cluster("a100-40gb", "NVLink3, 400 Gb/s IB per node of 4", 250e9,
                          400e9 / 8 / 4, 4, 0.9 * 1e12 / 8, 25e9),
    "a100-80gb": _cluster("a100-80gb", "NVLink3, 400 Gb/s IB per node of 4", 250e9,
                          400e9 / 8 / 4, 4, 0.9 * 1e12 / 8, 25e9),
    # H100/H200 HGX: NVLink4, one 400 Gb/s NIC per GPU.
    "h100-80gb": _cluster("h100-80gb", "NVLink4, 400 Gb/s IB per GPU", 370e9, 400e9 / 8, 8,
                          0.9 * 2e12 / 8, 50e9),
    "h200-141gb": _cluster("h200-141gb", "NVLink4, 400 Gb/s IB per GPU", 370e9, 400e9 / 8, 8,
                           0.9 * 2e12 / 8, 50e9),
    # One-GPU and PCIe machines, no NVLink: GPUs of one host talk over PCIe (Gen3 x16 on the T4,
    # ~12 GB/s; Gen4 ~25 GB/s), hosts over Ethernet. Clusters of 4 per host: AWS g4dn.12xlarge
    # (T4, 50 Gb/s), GCP g2-standard-48 (L4, 100 Gb/s), AWS g5.12xlarge (A10G, 40 Gb/s), a
    # workstation (RTX 4090, 10 GbE). Host memory per GPU: Colab's runtimes for the T4 (12.7 GB
    # for its one GPU) and the L4 (53 GB); 192 GB / 4 on g5.12xlarge; 128 GB / 4 for the
    # workstation.
    "t4-16gb": _cluster("t4-16gb", "PCIe Gen3, 50 Gb/s Ethernet per node of 4", 12e9,
                        50e9 / 8 / 4, 4, 0.9 * 12.7e9, 12e9),
    "l4-24gb": _cluster("l4-24gb", "PCIe Gen4, 100 Gb/s Ethernet per node of 4", 25e9,
                        100e9 / 8 / 4, 4, 0.9 * 53e9, 25e9),
    "a10g-24gb": _cluster("a10g-24gb", "PCIe Gen4, 40 Gb/s Ethernet per node of 4", 25e9,
                          40e9 / 8 / 4, 4, 0.9 * 192e9 / 4, 25e9),
    "rtx4090-24gb": _cluster("rtx4090-24gb", "PCIe Gen4, 10 Gb/s Ethernet per node of 4", 25e9,
                             10e9 / 8 / 4, 4, 0.9 * 128e9 / 4, 25e9),
}

