"""NVIDIA GPUs that jspec compiles for without owning one: each one's public figures, and the target config
XLA's CUDA compiler takes in their place (a `GpuTargetConfigProto` in text form, the format of XLA's own
`xla/backends/gpu/target_config/specs/*.txtpb`).

With the CUDA plugin installed (`pip install -e ".[gpu-compile]"`: the plugin and ptxas, no CUDA libraries),
`jax.experimental.topologies.get_topology_desc(name, platform="cuda", topology="1x1xN",
target_config=target_config(name))` gives N abstract GPUs that programs compile for (`accelerators.Target`).
The plugin checks the CUDA driver when it registers unless `JAX_SKIP_CUDA_CONSTRAINTS_CHECK` is set
(`devices` sets it; a machine without a driver has nothing to check).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

GiB = 2 ** 30
KiB = 2 ** 10
MiB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU's public figures (the datasheet at `source`, and CUDA's documented per-SM limits for its compute
  capability)."""
  name: str  # the device name CUDA reports
  compute_capability: tuple[int, int]
  sms: int
  boost_clock_ghz: float
  memory_bytes: int
  bandwidth_bytes_per_s: float
  bf16_flops_per_s: float  # dense tensor-core peak
  l2_bytes: int
  shared_memory_per_sm: int
  shared_memory_per_block_optin: int
  fp32_lanes_per_sm: int
  threads_per_sm: int
  source: str


GPUS = {
    "h100": Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98, 80 * 10 ** 9, 3.35e12, 989e12, 50 * MiB, 228 * KiB,
                227 * KiB, 128, 2048, "https://www.nvidia.com/en-us/data-center/h100/ (SXM)"),
    "h200": Gpu("NVIDIA H200", (9, 0), 132, 1.98, 141 * 10 ** 9, 4.8e12, 989e12, 50 * MiB, 228 * KiB, 227 * KiB,
                128, 2048, "https://www.nvidia.com/en-us/data-center/h200/ (SXM)"),
    "a100": Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 1.41, 80 * 10 ** 9, 2.039e12, 312e12, 40 * MiB, 164 * KiB,
                163 * KiB, 64, 2048, "https://www.nvidia.com/en-us/data-center/a100/ (80 GB SXM)"),
    "b200": Gpu("NVIDIA B200", (10, 0), 148, 1.965, 180 * 10 ** 9, 7.7e12, 2.25e15, 126 * MiB, 228 * KiB,
                227 * KiB, 128, 2048, "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, per GPU)"),
    "l4": Gpu("NVIDIA L4", (8, 9), 58, 2.04, 24 * 10 ** 9, 300e9, 121e12, 48 * MiB, 100 * KiB, 99 * KiB, 128,
              1536, "https://www.nvidia.com/en-us/data-center/l4/"),
}


def target_config(name: str) -> str:
  """`GPUS[name]` as XLA's `GpuTargetConfigProto` text: what the compiler would otherwise ask the device."""
  g = GPUS[name]
  major, minor = g.compute_capability
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: {48 * KiB}
  shared_memory_per_core: {g.shared_memory_per_sm}
  threads_per_core_limit: {g.threads_per_sm}
  core_count: {g.sms}
  fpus_per_core: {g.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(g.bandwidth_bytes_per_s)}
  l2_cache_size: {g.l2_bytes}
  clock_rate_ghz: {g.boost_clock_ghz}
  device_memory_size: {g.memory_bytes}
  shared_memory_per_block_optin: {g.shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
device_description_str: "{g.name}"
"""


def compiler_installed() -> bool:
  """Whether jax's CUDA plugin is installed (`.[gpu-compile]` or `.[cuda12]`)."""
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:  # no plugin of any kind: no `jax_plugins` package
    return False


def devices(name: str, count: int) -> list:
  """`count` abstract `GPUS[name]` devices on one host; a missing plugin is a one-line ValueError."""
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # read when the plugin registers
  try:
    from jax.experimental import topologies
    topology = topologies.get_topology_desc(name, platform="cuda", topology=f"1x1x{count}",
                                            target_config=target_config(name))
    return list(topology.devices)
  except Exception as e:  # no plugin (or one registered before the switch was set): its message says which
    raise ValueError(f"--compile-for gpu:{name}:{count}: no CUDA compiler here ({' '.join(str(e).split())[:160]}); "
                     f"install it with pip install -e \".[gpu-compile]\"") from None
