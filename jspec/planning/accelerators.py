"""jspec's programs compiled for accelerators that are not here, from any machine: TPU topologies and NVIDIA GPUs.

With `libtpu` installed (`pip install -e ".[tpu]"`), or the CUDA plugin (`pip install -e ".[gpu-compile]"`,
`jspec.planning.gpus`), `jax.experimental.topologies` gives the devices without owning them; the decode
program, lowered with abstract weights sharded over a mesh of them, compiles for that hardware (Mosaic or
Triton kernels included), and the executable says what XLA will allocate per device (`memory_analysis`) and
how many FLOPs and bytes it moves (`cost_analysis`; the CUDA compiler reports none, so a GPU program's are
counted by XLA's cost analysis, on this machine's CPU client, of the optimized module the GPU executable holds:
its fusions, as the GPU runs them). The time estimates
divide those by a chip's public peak figures (`CHIPS`): a roofline, not a measurement.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jspec.decoding import batches, loop, programs
from jspec.decoding.decoder import Decoder
from jspec.model import sharding
from jspec.model.kernels import pallas_attention
from jspec.planning import gpus, memory, shaped


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip's public figures."""
  hbm_bytes: int
  hbm_bytes_per_s: float
  bf16_flops_per_s: float
  source: str


CHIPS = {  # by platform, then name
    "tpu": {
        "v4": Chip(32 * 2 ** 30, 1200e9, 275e12, "https://cloud.google.com/tpu/docs/v4"),
        "v5e": Chip(16 * 10 ** 9, 819e9, 197e12, "https://cloud.google.com/tpu/docs/v5e"),
        "v5p": Chip(95 * 10 ** 9, 2765e9, 459e12, "https://cloud.google.com/tpu/docs/v5p"),
        "v6e": Chip(32 * 10 ** 9, 1638e9, 918e12, "https://cloud.google.com/tpu/docs/v6e"),
    },
    "gpu": {name: Chip(g.memory_bytes, g.bandwidth_bytes_per_s, g.bf16_flops_per_s, g.source)
            for name, g in gpus.GPUS.items()},
}
SHAPES = {"tpu": ("TOPOLOGY", "tpu:v5e:2x4"), "gpu": ("COUNT", "gpu:h100:2")}  # what follows the chip


@dataclasses.dataclass(frozen=True)
class Target:
  """`tpu:v5e:2x4` (a TPU chip and a topology of it) or `gpu:h100:2` (a GPU and how many, on one host)."""
  chip_name: str
  topology: str
  platform: str = "tpu"

  @classmethod
  def parse(cls, text: str) -> Target:
    parts = text.split(":")
    platform = parts[0] if len(parts) == 3 and parts[0] in CHIPS else None
    dims = parts[2].split("x") if platform == "tpu" else parts[2:]
    if platform is None or parts[1] not in CHIPS[platform] or not all(d.isdigit() and int(d) > 0 for d in dims):
      forms = "; ".join(f"{p}:CHIP:{SHAPES[p][0]} with CHIP one of {', '.join(CHIPS[p])} (e.g. {SHAPES[p][1]})"
                        for p in CHIPS)
      raise ValueError(f"--compile-for: expected {forms}; got {text!r}")
    return cls(parts[1], parts[2], platform)

  def __str__(self) -> str:
    return f"{self.platform}:{self.chip_name}:{self.topology}"

  @property
  def chip(self) -> Chip:
    return CHIPS[self.platform][self.chip_name]

  @property
  def chips(self) -> int:
    return math.prod(int(d) for d in self.topology.split("x"))

  def per_device(self, devices: int) -> Chip:
    """The chip's figures per device of a topology of `devices` devices (a v4 chip is two)."""
    share = self.chips / devices
    c = self.chip
    return Chip(int(c.hbm_bytes * share), c.hbm_bytes_per_s * share, c.bf16_flops_per_s * share, c.source)

  def devices(self) -> list:
    """The topology's abstract devices (libtpu's, or the CUDA plugin's); a missing compiler is a one-line
    ValueError."""
    if self.platform == "gpu":
      return gpus.devices(self.chip_name, self.chips)
    try:
      from jax.experimental import topologies
      return list(topologies.get_topology_desc(f"{self.chip_name}:{self.topology}", platform="tpu").devices)
    except Exception as e:  # no libtpu, or a topology it does not know: both say so in their message
      raise ValueError(f"--compile-for tpu:{self.chip_name}:{self.topology}: no TPU compiler here ("
                       f"{' '.join(str(e).split())[:160]}); install it with pip install -e \".[tpu]\"") from None


@dataclasses.dataclass(frozen=True)
class Compiled:
  """What XLA says of one executable, per device."""
  argument_bytes: int
  temp_bytes: int
  output_bytes: int
  code_bytes: int
  flops: float
  bytes_accessed: float
  alias_bytes: int = 0  # outputs that reuse a donated argument's buffer
  cost_source: str = "compiled"  # whose FLOPs and bytes: the executable's, or "optimized hlo" (`hlo_cost`)

  @property
  def total_bytes(self) -> int:
    return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes + self.code_bytes


def compiled(lowered) -> Compiled:
  """What XLA says of `lowered` compiled for its devices, per device."""
  executable = lowered.compile()
  m = executable.memory_analysis()
  cost, source = executable.cost_analysis(), "compiled"
  if not cost:
    cost, source = hlo_cost(executable), "optimized hlo"
  cost = cost[0] if isinstance(cost, list) else cost
  return Compiled(int(m.argument_size_in_bytes), int(m.temp_size_in_bytes), int(m.output_size_in_bytes),
                  int(m.generated_code_size_in_bytes), float(cost.get("flops", 0.0)),
                  float(cost.get("bytes accessed", 0.0)), int(m.alias_size_in_bytes), source)


def hlo_cost(executable) -> dict[str, float]:
  """XLA's FLOPs and bytes of the optimized (per-device) module an executable holds, by this machine's CPU
  client: what a GPU program's estimate reads, since the CUDA compiler reports no cost of its executables.
  Each fusion counts the bytes it reads and writes, as the GPU runs it (an int8 weight read inside a GEMM
  fusion counts one byte per weight)."""
  from jax._src.lib import _jax  # the analysis `Lowered.cost_analysis` runs, given a client that has one
  module = executable.runtime_executable().hlo_modules()[0]
  cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
  return {k: cost.get(k, 0.0) for k in ("flops", "bytes accessed")}


def workspace_per_row(target: Target, decoder: Decoder, batch: int, prompt_width: int, capacity: int,
                      mesh_spec: str | None = None, shard_draft: bool = True) -> float:
  """The workspace per row that XLA assigns on each of `target`'s devices, from the program's own buffers: the
  temporaries, less the caches, of the decode program with one layer per model (`shaped.one_layer`: a layer's
  temporaries are reused by the next) compiled for them on `mesh_spec`, over the rows each device holds."""
  devices = target.devices()
  mesh = sharding.make_mesh(mesh_spec or f"model={len(devices)}", devices)
  small = shaped.one_layer(decoder)
  placed = sharding.place_decoder(mesh, small, batch, shard_draft)
  abstract = sharding.place(memory.abstract_batch(placed, batch, prompt_width, capacity), mesh)
  temp = programs.lower(placed, abstract).compile().memory_analysis().temp_size_in_bytes
  need = memory.usage(small, batch, prompt_width, capacity, mesh, shard_draft, workspace_per_row=0.0)
  rows = batch // mesh.shape["data"] if batch % mesh.shape["data"] == 0 else batch
  return max(temp - need.kv_cache_bytes - need.draft_kv_cache_bytes, 0) / rows


def _shardings(tree):
  return jax.tree.map(lambda x: x.sharding, tree)


def started_state(decoder: Decoder, batch, capacity: int):
  """The abstract state `decode.start` leaves for these placed batch, each leaf with the sharding the
  compiled start gives it: what a step or a segment is compiled for on its own."""
  start = lambda d, r: loop.start(d, r, capacity)
  started = jax.jit(start, in_shardings=_shardings((decoder, batch))).lower(decoder, batch).compile()
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      jax.eval_shape(start, decoder, batch), started.output_shardings)


@dataclasses.dataclass(frozen=True)
class Report:
  """The decode program compiled for a topology, and a roofline estimate of a plain step and a round;
  with `serving`, the server's programs too (or why they cannot run there)."""
  target: Target
  devices: int
  program: Compiled
  plain_step_s: float
  round_s: float
  draft_len: int
  attention: str  # what reads the caches: `pallas_attention.attention_name`
  server: dict[str, Compiled] | None = None  # "segment", "insert"
  rounds: dict[int, float] = dataclasses.field(default_factory=dict)  # more rounds' estimates, by fixed K

  @property
  def per_device(self) -> Chip:
    return self.target.per_device(self.devices)

  @property
  def fits(self) -> bool:
    return self.program.total_bytes <= self.per_device.hbm_bytes

  @property
  def cost_source(self) -> str:
    return self.program.cost_source

  @property
  def round_cost(self) -> float:
    """A round in plain steps: jspec's cost model for this hardware, from the compiler."""
    return self.round_s / self.plain_step_s

  def speedup(self, tau: float) -> float:
    """The speedup a round that commits τ tokens on average would give (estimate)."""
    return tau / self.round_cost

  def round_costs(self) -> dict[int, float]:
    """Every estimated round in plain steps, by K."""
    return {k: s / self.plain_step_s for k, s in sorted({**self.rounds, self.draft_len: self.round_s}.items())}


def roofline_seconds(cost: Compiled, chip: Chip) -> float:
  """The larger of memory time and compute time: what the chip cannot beat."""
  return max(cost.bytes_accessed / chip.hbm_bytes_per_s, cost.flops / chip.bf16_flops_per_s)


def untouched_experts(decoder: Decoder, tokens: int, mesh) -> float:
  """The bytes of the target's experts, on one device, that a forward over `tokens` tokens is expected not to
  read, with every token routed to `top_k` of the experts independently and uniformly (each expert missed by
  all of them with probability (1 - k/O)^tokens). XLA's cost analysis counts a grouped matmul as reading every
  expert; real routing, which favours some experts and repeats them along a text, touches fewer."""
  moe = decoder.target_config.moe
  if moe is None:
    return 0.0
  return memory.Experts.of(decoder, mesh).bytes_per_device * (1 - moe.top_k / moe.experts) ** tokens


def compile_for(target: Target, decoder: Decoder, batch: int, prompt_width: int, capacity: int,
                mesh_spec: str | None = None, shard_draft: bool = True, round_decoder: Decoder | None = None,
                serving: bool = False, pages: int | None = None,
                more_rounds: dict[int, Decoder] | None = None) -> Report:
  """Compiles the decode program of `decoder` (abstract weights: `jspec.planning.shaped.shaped_decoder`) for
  `target`'s devices, on `mesh_spec` (default: every device on the model axis), and estimates a plain step
  and a speculative round of `round_decoder` (default: `decoder`; a fixed K, since the cost of an adaptive
  round would count every offered K's branch), each compiled on its own over the state a prefill leaves, and
  the rounds of `more_rounds` (fixed K -> decoder) likewise. XLA counts a loop's body once: the drafter's
  chained steps inside a round count as one. On a TPU, a mixture of experts' step reads the experts its tokens
  touch (`untouched_experts`: the verify's K + 1 tokens per row, or a tree's entries). With `serving`, also the
  server's programs for `batch` slots over a pool of `pages` pages (`compile_server`)."""
  devices = target.devices()
  mesh = sharding.make_mesh(mesh_spec or f"model={len(devices)}", devices)
  place = lambda d: sharding.place_decoder(mesh, d, batch, shard_draft)
  program_decoder = place(decoder)
  abstract = sharding.place(memory.abstract_batch(program_decoder, batch, prompt_width, capacity), mesh)
  program = compiled(programs.lower(program_decoder, abstract))
  per_device = target.per_device(len(devices))
  rows = batch // mesh.shape["data"] if batch % mesh.shape["data"] == 0 else batch

  def step_time(placed: Decoder, step) -> float:
    # The state donated, as the loop updates it in place: no copy of the caches into a fresh output counts.
    state = started_state(placed, abstract, capacity)
    cost = compiled(jax.jit(step, in_shardings=_shardings((placed, state)), donate_argnums=1).lower(placed, state))
    verified = 1 if step is loop.autoregressive_step else placed.verify_width
    grouped = target.platform == "tpu"  # elsewhere every token runs through every expert (`jspec.model.moe`)
    touched = cost.bytes_accessed - grouped * untouched_experts(placed, rows * verified, mesh)
    return roofline_seconds(dataclasses.replace(cost, bytes_accessed=touched), per_device)

  placed = program_decoder if round_decoder is None else place(round_decoder)
  plain = step_time(placed, loop.autoregressive_step)
  spec_round = step_time(placed, loop.speculative_step) if placed.drafter is not None else plain
  kernel = placed.kernel(placed.target_config.head_dim)
  rounds = {k: step_time(place(d), loop.speculative_step) for k, d in (more_rounds or {}).items()}
  report = Report(target, len(devices), program, plain, spec_round, placed.draft_len,
                  pallas_attention.attention_name(kernel), rounds=rounds)
  if not serving:
    return report
  return dataclasses.replace(report, server=compile_server(program_decoder, batch, prompt_width, capacity, pages))


def compile_server(decoder: Decoder, slots: int, prompt_width: int, capacity: int,
                   pages: int | None = None) -> dict[str, Compiled]:
  """The server's programs (`jspec.engine.engine.Engine`) for a decoder placed on a mesh: a segment of the loop
  over every slot and the insert of a request of `prompt_width` tokens into a running state, whose caches
  are pools of `pages` pages (None: contiguous rows). The state lives between calls (donated to each), so a
  segment's arguments hold it beside the weights."""
  mesh = decoder.layout.mesh
  idle = sharding.place(memory.abstract_batch(decoder, slots, batches.prompt_bucket(1), capacity, pages), mesh)
  state = started_state(decoder, idle, capacity)
  one = sharding.place(memory.abstract_batch(decoder, 1, prompt_width, capacity, pages, pages is not None), mesh)
  scalar = lambda dtype, shape=(): jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))
  return {"segment": compiled(programs.segment.lower(decoder, state, scalar(jnp.int32), scalar(jnp.bool_),
                                                     scalar(jnp.bool_, (slots,)), width=slots)),
          "insert": compiled(programs.insert.lower(decoder, state, one, scalar(jnp.int32)))}
