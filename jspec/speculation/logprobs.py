"""Log-probabilities that clients ask for (OpenAI's `logprobs`, `top_logprobs`, `echo`): each emitted token's,
and the most likely tokens' at its position, from the target's distribution after the processing that
sampling applies (`jspec.speculation.sampling.log_probabilities`). The loop records them as it commits tokens, from the
forward that scored the tokens (a verify's, under speculation): they are exactly plain decoding's. A
prompt's come from one forward over it (`score`), from the model's own distribution.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jspec.model import model
from jspec.model.model import ModelConfig, Params
from jspec.speculation.sampling import SamplingParams, log_probabilities

# The most top log-probabilities a request may ask for (vLLM's default `max_logprobs`, OpenAI's top_logprobs).
MAX_TOP = 20


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """One token's log-probability and the `top` most likely tokens at its position, best first (a prompt's
  first token, which nothing predicts: None, and none)."""
  token_id: int
  logprob: float | None
  top: list[tuple[int, float]]


@flax.struct.dataclass
class Logprobs:
  """Buffers beside the token buffer: slot t of row b holds what the target gave token t when it was
  committed. Only rows that ask (`want_B`) are scored: a round none of whose rows asks skips it all."""
  token_BxT: jax.Array  # float32: token t's log-probability
  top_ids_BxTxN: jax.Array  # int32: the N most likely tokens at its position
  top_BxTxN: jax.Array  # float32: their log-probabilities
  want_B: jax.Array  # bool

  @classmethod
  def zeros(cls, want_B: jax.Array, capacity: int, top: int) -> Logprobs:
    batch = want_B.shape[0]
    return cls(jnp.zeros((batch, capacity), jnp.float32), jnp.zeros((batch, capacity, top), jnp.int32),
               jnp.zeros((batch, capacity, top), jnp.float32), want_B.astype(bool))

  def record(self, cols_BxS: jax.Array, tokens_BxS: jax.Array, logits_BxSxV: jax.Array, sampling: SamplingParams,
             active_B: jax.Array) -> Logprobs:
    """Records tokens_BxS committed at slots cols_BxS (a slot past the buffer: not committed), scored by
    the target's (masked) logits_BxSxV."""
    rows = jnp.broadcast_to(jnp.arange(cols_BxS.shape[0])[:, None], cols_BxS.shape)

    def scored(lp: Logprobs) -> Logprobs:
      logp_BxSxV = log_probabilities(logits_BxSxV, sampling)
      chosen = jnp.take_along_axis(logp_BxSxV, tokens_BxS[..., None], axis=-1)[..., 0]
      top, ids = lax.top_k(logp_BxSxV, lp.top_BxTxN.shape[-1])
      return lp.replace(token_BxT=lp.token_BxT.at[rows, cols_BxS].set(chosen, mode="drop"),
                        top_ids_BxTxN=lp.top_ids_BxTxN.at[rows, cols_BxS].set(ids, mode="drop"),
                        top_BxTxN=lp.top_BxTxN.at[rows, cols_BxS].set(top, mode="drop"))

    return lax.cond(jnp.any(self.want_B & active_B), scored, lambda lp: lp, self)

  def window(self, start_B: jax.Array, size: int) -> Logprobs:
    """Slots [start, start + size) of each row (clamped to the buffer): what a segment hands the host."""
    slots_BxW = jnp.minimum(start_B[:, None] + jnp.arange(size), self.token_BxT.shape[1] - 1)
    take = lambda x: jnp.take_along_axis(x, slots_BxW.reshape(slots_BxW.shape + (1,) * (x.ndim - 2)), axis=1)
    return self.replace(token_BxT=take(self.token_BxT), top_ids_BxTxN=take(self.top_ids_BxTxN),
                        top_BxTxN=take(self.top_BxTxN))


def read(buffers: Logprobs, row: int, start: int, token_ids: list[int], top: int) -> list[TokenLogprob]:
  """`token_ids`, at slots from `start` of row `row`, with their log-probabilities from fetched
  (`jax.device_get`) buffers and `top` alternatives each."""
  end = start + len(token_ids)
  return _entries(token_ids, buffers.token_BxT[row, start:end], buffers.top_ids_BxTxN[row, start:end],
                  buffers.top_BxTxN[row, start:end], top)


def _entries(token_ids: list[int], chosen_S, ids_SxN, best_SxN, top: int) -> list[TokenLogprob]:
  return [TokenLogprob(int(t), float(c), [(int(a), float(b)) for a, b in zip(i[:top], v[:top])])
          for t, c, i, v in zip(token_ids, chosen_S, ids_SxN, best_SxN)]


def _score(params: Params, prompts_BxP: jax.Array, *, config: ModelConfig) -> tuple[jax.Array, ...]:
  """Each prompt token's log-probability given those before it, and the `MAX_TOP` most likely tokens at
  each position (the model's own distribution): [B, P-1], [B, P-1, MAX_TOP] twice."""
  logits_BxPxV, _ = model.forward_full(params, prompts_BxP, config)
  logp = jax.nn.log_softmax(logits_BxPxV[:, :-1].astype(jnp.float32), -1)
  chosen = jnp.take_along_axis(logp, prompts_BxP[:, 1:, None], axis=-1)[..., 0]
  best, ids = lax.top_k(logp, MAX_TOP)
  return chosen, ids, best


score = jax.jit(_score, static_argnames="config")


def padded(prompt_ids: list[int], width: int) -> np.ndarray:
  """One prompt right-padded to `width`, as `score` takes it."""
  out = np.zeros((1, width), np.int32)
  out[0, :len(prompt_ids)] = prompt_ids
  return out


def prompt_entries(prompt_ids: list[int], scores: tuple[np.ndarray, ...], top: int) -> list[TokenLogprob]:
  """A prompt's tokens with `score`'s fetched figures and `top` alternatives each (the first token, which
  nothing predicts, with none)."""
  chosen, ids, best = scores
  return [TokenLogprob(prompt_ids[0], None, [])] + _entries(prompt_ids[1:], chosen[0], ids[0], best[0], top)
