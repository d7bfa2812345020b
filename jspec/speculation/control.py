"""Branches that write KV caches, kept in place.

XLA:CPU copies every buffer that a conditional's branch writes, so a `lax.cond` around a cache update costs
a full copy of the cache per round. A while loop updates its carry in place (as GPUs and TPUs do for both),
so branches that write caches run as while loops of at most one trip: one code path on every backend.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax import lax

T = TypeVar("T")


def run_if(pred: jax.Array, fn: Callable[[T], T], operand: T) -> T:
  """`lax.cond(pred, fn, identity, operand)` as a while loop of at most one trip."""
  return lax.while_loop(lambda c: c[0], lambda c: (jnp.zeros_like(c[0]), fn(c[1])), (pred, operand))[1]


def run_switch(index: jax.Array, branches: Sequence[Callable[[T], T]], operand: T) -> T:
  """`lax.switch(index, branches, operand)` built from `run_if`, for branches that write caches."""
  for i, branch in enumerate(branches):
    operand = run_if(index == i, branch, operand)
  return operand
