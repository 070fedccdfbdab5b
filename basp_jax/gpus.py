"""The GPUs this project plans and compiles for: one table of facts per GPU model.

    gpus.GPUS["a100-40gb"].memory_bytes           # what the device reports as total memory
    gpus.target_config("h100-80gb")               # XLA's GpuTargetConfig text proto, for
                                                  # compiling without a GPU (train.tools.aot)
    gpus.usable_memory_bytes(gpus.GPUS["a100-40gb"])   # what JAX may take of it
    gpus.by_device_kind("NVIDIA H100 PCIe").peak_flops   # for MFU (None: not in the table)
    gpus.GPUS["t4-16gb"].bf16, gpus.GPUS["t4-16gb"].half_dtype   # False, "float16"
    gpus.GPUS["h100-80gb"].fp8_peak_flops        # dense FP8 peak (None: no FP8 tensor cores)

The planner (basp_jax.planner.hardware), the compile-for-GPU command (train.tools.aot) and the trainer's peak FLOP/s
(MFU) read this table, so a GPU's memory and speed are written once. Every GPU has its exact
device kind, compute capability and peak; the compile targets (TARGETS) also have what XLA needs
to compile for them. Memory sizes are the totals the CUDA driver reports (a little less than the
marketing GB); peak FLOP/s are dense tensor-core half precision (fp32 accumulate) without
sparsity, from NVIDIA's data sheets: bf16, or fp16 on a GPU without bf16 tensor cores (the T4,
sm75); fp8_peak_flops is the dense FP8 one (fp32 accumulate) of the GPUs with FP8 tensor cores
(sm89+), what model.fp8's projections run at. Which attention kernels a GPU runs follows from
its compute capability (basp_jax.kernels.gpu_kernels: cuDNN flash attention and Pallas/Triton
need sm80).
"""

from __future__ import annotations

import dataclasses
import os


# Tensor cores by compute capability: fp16 ones from Volta (sm70; the T4 is sm75), bf16 ones from
# sm80. Below sm80 XLA has no bf16 dot algorithm either (basp_jax.kernels).
FP16_MIN_CC = (7, 0)
BF16_MIN_CC = (8, 0)


def auto_compute_dtype(capability: tuple[int, int] | None) -> str:
    """What model.dtype=auto computes in on a GPU of this compute capability (None: a GPU whose
    capability is unknown, taken as a current one): bfloat16 where it has bf16 tensor cores,
    float16 (with loss scaling) where it has fp16 ones only, else float32. The one rule, for the
    trainer's devices and the planner's and compiler's targets alike."""
    if capability is None or tuple(capability) >= BF16_MIN_CC:
        return "bfloat16"
    return "float16" if tuple(capability) >= FP16_MIN_CC else "float32"


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str  # the key: a100-40gb, ...
    device_kind: str  # exactly what jax.Device.device_kind says on this GPU
    # dense half-precision tensor-core peak (half the data sheet's "with sparsity" figure), in
    # half_dtype: bf16 where the GPU has it, else fp16
    peak_flops: float
    compute_capability: tuple[int, int]  # sm80 = (8, 0): what kernels and dtypes it runs
    bf16: bool = True  # bf16 tensor cores (sm80 on); without them bf16 matmuls run as f32
    # What compiling for it without one needs (compile targets only; None for the others)
    memory_bytes: int | None = None  # total device memory as the driver reports it
    memory_bandwidth: float | None = None  # bytes/s
    sm_count: int | None = None
    clock_ghz: float | None = None  # boost clock
    l2_cache_bytes: int | None = None
    fp32_cores_per_sm: int | None = None
    shared_memory_per_sm: int | None = None
    shared_memory_per_block_optin: int | None = None
    threads_per_sm: int = 2048  # resident threads per SM: 2048 sm80/90, 1536 sm86/89, 1024 sm75
    # dense FP8 tensor-core peak (fp32 accumulate), where the GPU has FP8 tensor cores (sm89+)
    fp8_peak_flops: float | None = None

    @property
    def is_target(self) -> bool:
        """Whether the table holds what compiling for it needs (train.tools.aot, the planner)."""
        return self.sm_count is not None

    @property
    def half_dtype(self) -> str:
        """The half-precision dtype its tensor cores run (and peak_flops counts)."""
        return "bfloat16" if self.bf16 else "float16"

    @property
    def auto_dtype(self) -> str:
        """What model.dtype=auto computes in on it (auto_compute_dtype)."""
        return auto_compute_dtype(self.compute_capability)

    def step_peak(self, fp8_share: float = 0.0) -> tuple[float, str]:
        """The peak FLOP/s MFU divides by for a step that runs fp8_share of its FLOPs as FP8
        matmuls (those at fp8_peak_flops where the GPU has FP8 tensor cores, the rest at
        peak_flops), and a line naming it."""
        half = "bf16" if self.bf16 else "fp16"  # a T4's peak is fp16: it has no bf16 tensor cores
        line = (f"{self.peak_flops / 1e12:g} TFLOP/s per device, the {half} dense peak of "
                f"{self.device_kind}")
        if not (fp8_share and self.fp8_peak_flops):
            return self.peak_flops, line
        peak = mixed_peak_flops(1.0, fp8_share, self.peak_flops, self.fp8_peak_flops)
        return peak, (f"{peak / 1e12:.0f} TFLOP/s per device: {self.device_kind}'s dense FP8 peak "
                      f"({self.fp8_peak_flops / 1e12:g}) for the {fp8_share:.0%} of the FLOPs "
                      f"model.fp8 runs in FP8, its {half} one ({self.peak_flops / 1e12:g}) for "
                      "the rest")


def mixed_peak_flops(flops: float, fp8_flops: float, peak: float, fp8_peak: float | None
                     ) -> float:
    """The peak FLOP/s of a step whose `fp8_flops` of `flops` run at fp8_peak and the rest at
    `peak` (what MFU divides by under model.fp8): flops / the time both peaks would take."""
    if not fp8_peak or not fp8_flops:
        return peak
    return flops / ((flops - fp8_flops) / peak + fp8_flops / fp8_peak)


def _target(name, device_kind, cc, memory_bytes, peak, bandwidth, sms, clock, l2, fp32, smem,
            optin, *, bf16=True, threads_per_sm=2048, fp8_peak=None) -> Gpu:
    return Gpu(name, device_kind, peak, cc, bf16, memory_bytes, bandwidth, sms, clock, l2, fp32,
               smem, optin, threads_per_sm, fp8_peak)


# Peaks: NVIDIA's data sheets (A100; H100 SXM/PCIe/NVL, whose H800 and H200 siblings have the same
# Tensor Core peak as the H100 of their form factor; HGX B200; T4; L4; A10; the Ada Lovelace
# architecture whitepaper for the RTX 4090, whose fp16/bf16 peak with fp32 accumulate is half its
# fp16-accumulate one). Dense FP8 peaks are twice the bf16 ones on the same sheets (H100 SXM,
# H200 and H800 1,979 TFLOP/s, H100 PCIe 1,513, NVL 1,671, B200 4,500, L4 242, RTX 4090 330 with
# fp32 accumulate); the A100, A10G and T4 have no FP8 tensor cores. NVIDIA publishes no data
# sheet for the A10G (AWS's variant of the A10, 80 SMs at 1.71 GHz instead of 72 at 1.695 GHz):
# its peak here is the A10's 125 TFLOP/s.
# The single-GPU cards' SM counts, clocks, L2 sizes and bandwidths are their data sheets'; shared
# memory and resident threads per SM are the CUDA programming guide's for their compute
# capability (sm75: 64 KiB, 1024 threads; sm86/sm89: 100 KiB, 1536 threads, 99 KiB per block).
# Device memory: the T4's is what torch's total_memory reports on Colab (15,102 MiB; nvidia-smi
# says 15,360); the others' are nvidia-smi totals (L4 23,034 MiB, A10G 23,028, RTX 4090 24,564),
# which on an A100-40GB are ~1% above what the driver gives a process (40,960 vs 40,536 MiB):
# read on a real card, they may shrink by that much.
GPUS = {
    g.name: g
    for g in (
        _target("a100-40gb", "NVIDIA A100-SXM4-40GB", (8, 0), 42_505_273_344, 312e12, 1.555e12,
                108, 1.41, 40 * 2**20, 64, 167_936, 166_912),
        _target("a100-80gb", "NVIDIA A100-SXM4-80GB", (8, 0), 85_198_045_184, 312e12, 2.039e12,
                108, 1.41, 40 * 2**20, 64, 167_936, 166_912),
        _target("h100-80gb", "NVIDIA H100 80GB HBM3", (9, 0), 84_929_347_584, 989e12, 3.35e12,
                132, 1.98, 50 * 2**20, 128, 233_472, 232_448, fp8_peak=1979e12),
        _target("h200-141gb", "NVIDIA H200", (9, 0), 150_754_820_096, 989e12, 4.8e12,
                132, 1.98, 50 * 2**20, 128, 233_472, 232_448, fp8_peak=1979e12),
        # One-GPU machines: Colab (T4 free, L4 and A100 paid), AWS g4dn/g5, workstations. The
        # T4 (Turing) has fp16 tensor cores but no bf16; none of these has NVLink.
        _target("t4-16gb", "Tesla T4", (7, 5), 15_102 * 2**20, 65e12, 320e9,
                40, 1.59, 4 * 2**20, 64, 65_536, 65_536, bf16=False, threads_per_sm=1024),
        _target("l4-24gb", "NVIDIA L4", (8, 9), 23_034 * 2**20, 121e12, 300e9,
                58, 2.04, 48 * 2**20, 128, 102_400, 101_376, threads_per_sm=1536,
                fp8_peak=242e12),
        _target("a10g-24gb", "NVIDIA A10G", (8, 6), 23_028 * 2**20, 125e12, 600e9,
                80, 1.71, 6 * 2**20, 128, 102_400, 101_376, threads_per_sm=1536),
        _target("rtx4090-24gb", "NVIDIA GeForce RTX 4090", (8, 9), 24_564 * 2**20, 165.2e12,
                1.008e12, 128, 2.52, 72 * 2**20, 128, 102_400, 101_376, threads_per_sm=1536,
                fp8_peak=330.3e12),
        # peak FLOP/s only (MFU), not compile targets
        Gpu("a100-40gb-pcie", "NVIDIA A100-PCIE-40GB", 312e12, (8, 0)),
        Gpu("a100-80gb-pcie", "NVIDIA A100 80GB PCIe", 312e12, (8, 0)),
        Gpu("h100-pcie", "NVIDIA H100 PCIe", 756e12, (9, 0), fp8_peak_flops=1513e12),
        Gpu("h100-nvl", "NVIDIA H100 NVL", 835e12, (9, 0), fp8_peak_flops=1671e12),
        Gpu("h800", "NVIDIA H800", 989e12, (9, 0), fp8_peak_flops=1979e12),
        Gpu("h200-nvl", "NVIDIA H200 NVL", 835e12, (9, 0), fp8_peak_flops=1671e12),
        Gpu("b200", "NVIDIA B200", 2250e12, (10, 0), fp8_peak_flops=4500e12),
    )
}
TARGETS = {name: g for name, g in GPUS.items() if g.is_target}  # what train.tools.aot compiles for
_BY_KIND = {g.device_kind: g for g in GPUS.values()}

# The CUDA runtime and cuDNN versions the compiled program assumes (XLA picks kernels by them).
CUDA_VERSION = (12, 8)
CUDNN_VERSION = (9, 8)

# JAX preallocates this share of GPU memory unless XLA_CLIENT_MEM_FRACTION (or the older
# XLA_PYTHON_CLIENT_MEM_FRACTION) says otherwise.
DEFAULT_MEM_FRACTION = 0.75


def get(name: str) -> Gpu:
    """The compile target called `name`, or a ValueError listing them."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; use one of {', '.join(TARGETS)}") from None


def shared_memory_per_block(capability: tuple[int, int] | None) -> int | None:
    """The shared memory one thread block may take on a GPU of this compute capability: the
    least among the compile targets that have it (tiles that fit it fit them all), None when
    no target has it (the Pallas kernel then takes an A100's tiles)."""
    sizes = [g.shared_memory_per_block_optin for g in TARGETS.values()
             if capability is not None and g.compute_capability == tuple(capability)]
    return min(sizes) if sizes else None


def by_device_kind(device_kind: str) -> Gpu | None:
    """The GPU whose jax device_kind is exactly `device_kind`, or None (a substring match would
    give an H100 PCIe the SXM peak)."""
    return _BY_KIND.get(device_kind)


def memory_fraction() -> float:
    """The share of device memory JAX's allocator may use in this environment."""
    # jaxlib >= 0.10 reads XLA_CLIENT_MEM_FRACTION, and the older name when that one is unset
    name = next((n for n in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
                 if os.environ.get(n)), None)
    if name is None:
        return DEFAULT_MEM_FRACTION
    raw = os.environ[name]
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not 0 < value <= 1:
        raise ValueError(f"{name}={raw!r} must lie in (0, 1]")
    return value


def usable_memory_bytes(gpu: Gpu) -> float:
    return gpu.memory_bytes * memory_fraction()


def target_config(name: str) -> str:
    """XLA's GpuTargetConfig (text proto) for `name`: what
    jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...) needs to
    compile for this GPU on a machine without one."""
    g = get(name)
    major, minor = g.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {g.shared_memory_per_sm}
  threads_per_core_limit: {g.threads_per_sm}
  core_count: {g.sm_count}
  fpus_per_core: {g.fp32_cores_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(g.memory_bandwidth)}
  l2_cache_size: {g.l2_cache_bytes}
  clock_rate_ghz: {g.clock_ghz}
  device_memory_size: {g.memory_bytes}
  shared_memory_per_block_optin: {g.shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
runtime_version {{
  major: {CUDA_VERSION[0]}
  minor: {CUDA_VERSION[1]}
}}
platform_name: "CUDA"
dnn_version_info {{
  major: {CUDNN_VERSION[0]}
  minor: {CUDNN_VERSION[1]}
}}
device_description_str: "{g.device_kind}"
"""
