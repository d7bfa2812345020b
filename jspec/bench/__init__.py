"""Benchmarks, run as `python -m jspec.bench --suite NAME` (`--help` lists the suites).

They live in the package, not beside it, so that a pip user can measure their own pair on their own machine
(`--target DIR --draft KIND=DIR`) with the code that measured the shipped ones. One module a concern:
`harness` (peak memory, progress, the machine), `prompts` (the prompt sets), `parts` (steps, rounds, cost models),
`sweep` (drafter x K grids, trees), `end_to_end` (defaults, adaptive, streaming, batching), `hf` (transformers'
assisted generation), `gpu` (the prepared accelerator check), `report` (tables and plots); `cli`
holds the registry of suites.
"""
