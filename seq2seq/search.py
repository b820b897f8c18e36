"""Search: the decoding strategies and the model-agnostic loops that run them.

A strategy is data, validated at construction (`UserError`, one line), built by name in one
place (`get_strategy`):

  Greedy()                                     argmax at every step
  Sample(temperature=1.0, top_k=0, top_p=1.0)  ancestral sampling, optionally filtered
  Beam(size=4, alpha=0.6, n_best=1)            beam search, GNMT length penalty

`sample_search` and `beam_search` take a `tokens_to_logits(seq_NxL1, index, state) ->
(logits_NxV, state)` function instead of the Transformer (decoding.py provides it), so they
can be tested on hand-built distributions. `seq_NxL1` holds the tokens fed so far (BOS at
position 0, the token fed at step `index` at position `index`, pad after); `state` is any
pytree whose leaves have the rows as leading axis (the KV cache), and
`resize_state(state, n)`, if given, fits it to each phase's n steps (`cache_phases`).

Conventions shared by every strategy:
  * Step i feeds the token at position i (BOS at i=0) and chooses output token i.
  * The pad token is never generated; EOS is not allowed before `min_len` tokens.
  * A row stops at EOS or at its length limit (`limits_B`).
  * Lengths count generated tokens, EOS included.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from seq2seq.errors import UserError

NEG_INF = -jnp.inf


class StrategyError(UserError):
  """An invalid decoding strategy or decoding argument."""


def _check(cond: bool, msg: str):
  if not cond:
    raise StrategyError(msg)


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_real(v) -> bool:
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


# ---------------------------------------------------------------------------------------
# Strategies.

@dataclasses.dataclass(frozen=True)
class Greedy:
  """The most probable token at every step."""


@dataclasses.dataclass(frozen=True)
class Sample:
  """Sample from softmax(logits / temperature), restricted to the `top_k` most probable
  tokens (0 = all) and to the smallest set whose probability reaches `top_p` (1 = all)."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    _check(_is_real(self.temperature) and math.isfinite(self.temperature)
           and self.temperature > 0,
           f"temperature must be > 0 for sampling, got {self.temperature!r} "
           f"(use the greedy strategy for argmax decoding)")
    _check(_is_int(self.top_k) and self.top_k >= 0,
           f"top_k must be an integer >= 0 (0 = no top-k filter), got {self.top_k!r}")
    _check(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0,
           f"top_p must be in (0, 1], got {self.top_p!r}")


BEAM_STOPS = ("exact", "best", "count")


@dataclasses.dataclass(frozen=True)
class Beam:
  """Beam search of `size` hypotheses, ranked by log p / ((5 + length) / 6) ** alpha
  (GNMT length penalty; length counts EOS); returns the `n_best` best. Paper: 4, 0.6.

  `stop`: when a sentence's search ends before its length limit. "exact": once no alive
  hypothesis can still beat the n_best-th finished one (what the search would return at the
  limit, so never a worse result); "best": once the step's best extension ends the
  sentence (CTranslate2's rule without a length penalty); "count": once `size` hypotheses
  have ended (fairseq's, and CTranslate2's with a length penalty)."""
  size: int = 4
  alpha: float = 0.6
  n_best: int = 1
  stop: str = "exact"

  def __post_init__(self):
    _check(_is_int(self.size) and self.size >= 1,
           f"beam size must be an integer >= 1, got {self.size!r}")
    _check(_is_real(self.alpha) and math.isfinite(self.alpha) and self.alpha >= 0,
           f"length penalty alpha must be >= 0, got {self.alpha!r}")
    _check(_is_int(self.n_best) and 1 <= self.n_best <= self.size,
           f"n_best must be an integer in [1, beam size {self.size!r}], got {self.n_best!r}")
    _check(self.stop in BEAM_STOPS,
           f"beam stop rule must be one of {', '.join(BEAM_STOPS)}, got {self.stop!r}")


Strategy = Greedy | Sample | Beam
STRATEGIES = ("greedy", "sample", "beam")


def get_strategy(name: str, *, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, beam_size: int | None = None,
                 alpha: float | None = None, n_best: int | None = None,
                 beam_stop: str | None = None) -> Strategy:
  """A strategy from flag-like values (None = not given); options that do not apply to the
  strategy raise `UserError`, e.g. top_k with beam search."""
  given = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p,
                                 beam_size=beam_size, alpha=alpha, n_best=n_best,
                                 beam_stop=beam_stop).items()
           if v is not None}
  allowed = {"greedy": (), "sample": ("temperature", "top_k", "top_p"),
             "beam": ("beam_size", "alpha", "n_best", "beam_stop")}
  _check(name in allowed, f"unknown decoding strategy {name!r}; choose one of "
         + ", ".join(STRATEGIES))
  extra = [k for k in given if k not in allowed[name]]
  _check(not extra, f"{', '.join(extra)} cannot be used with {name} decoding"
         + (f" (it takes {', '.join(allowed[name])})" if allowed[name] else ""))
  if name == "greedy":
    return Greedy()
  if name == "sample":
    return Sample(**given)
  return Beam(**{{"beam_size": "size", "beam_stop": "stop"}.get(k, k): v
                 for k, v in given.items()})


# ---------------------------------------------------------------------------------------
# Results.

class DecodeResult(NamedTuple):
  """What `decode` returns (numpy arrays once out of `decode`).

  tokens  [B, n, L] int32: n = 1 for greedy/sampling, n = n_best for beam (best first).
          Generated tokens without BOS, EOS included, pad_id after the end.
  scores  [B, n] float32: greedy/sampling: total log-probability of the tokens under the
          model (pad and too-early EOS excluded from the softmax); beam: that total divided
          by ((5 + length) / 6) ** alpha. -inf for an empty beam slot.
  lengths [B, n] int32: number of generated tokens, EOS included.
  logits  [B, L, V] float32 raw logits at each step (greedy/sampling with
          return_logits=True), else None.
  """
  tokens: Any
  scores: Any
  lengths: Any
  logits: Any = None

  @property
  def best(self):
    """[B, L] tokens of the best (or only) hypothesis."""
    return self.tokens[:, 0]

  def token_lists(self, eos_id: int, n: int = 0) -> list[list[int]]:
    """Hypothesis `n` of each row as a list of ids, EOS and padding removed."""
    toks, lens = np.asarray(self.tokens[:, n]), np.asarray(self.lengths[:, n])
    out = []
    for row, length in zip(toks, lens):
      ids = row[:length].tolist()
      out.append(ids[:-1] if ids and ids[-1] == eos_id else ids)
    return out


# ---------------------------------------------------------------------------------------
# Search cores: pure, jittable, model-agnostic.

TokensToLogits = Callable[[jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def _allowed_logits(logits_NxV, length, *, eos_id, pad_id, min_len):
  """float32 logits with pad (always) and EOS (while length < min_len) set to -inf;
  `length` is the hypothesis length if this step's token ends it. (Two columns written in
  place: no pass over the whole vocabulary.)"""
  logits_NxV = logits_NxV.astype(jnp.float32)
  n = logits_NxV.shape[0]
  logits_NxV = lax.dynamic_update_slice(logits_NxV, jnp.full((n, 1), NEG_INF), (0, pad_id))
  if min_len > 0:
    eos_Nx1 = jnp.where(jnp.reshape(length < min_len, (-1, 1)), NEG_INF,
                        logits_NxV[:, eos_id:eos_id + 1])
    logits_NxV = lax.dynamic_update_slice(logits_NxV, eos_Nx1, (0, eos_id))
  return logits_NxV


def _argmax(x_NxV):
  return jnp.argmax(x_NxV, axis=-1).astype(jnp.int32)


def _top_k_logsumexp(x_NxV, k: int):
  values_Nxk, ids_Nxk = lax.top_k(x_NxV, k)
  return values_Nxk, ids_Nxk, jax.nn.logsumexp(x_NxV, axis=-1)


def filter_logits(logits_NxV, strategy: Sample, top_k: Callable = lax.top_k):
  """Temperature, then top-k, then top-p (nucleus): excluded tokens get -inf.

  Exactly `top_k` tokens survive top-k (the lowest id wins a tie for the last place, so
  top_k=1 is greedy), and the nucleus is the smallest set of tokens, best first and tied
  ones by id, whose probability reaches `top_p`. The best logit is subtracted before
  dividing by the temperature, so a tiny temperature cannot overflow to +inf (one below
  float32's smallest normal acts as it). `top_k` computes lax.top_k (kernels.Kernels.top_k).
  """
  x = logits_NxV - jnp.max(logits_NxV, axis=-1, keepdims=True)
  x = x / jnp.float32(max(strategy.temperature, np.finfo(np.float32).tiny))  # no subnormal
  n, vocab = x.shape
  rows_Nx1 = jnp.arange(n)[:, None]
  if 0 < strategy.top_k < vocab:
    _, idx_Nxk = top_k(x, strategy.top_k)
    keep = jnp.zeros(x.shape, bool).at[rows_Nx1, idx_Nxk].set(True)
    x = jnp.where(keep, x, NEG_INF)
  if strategy.top_p < 1.0:
    order_NxV = jnp.argsort(-x, axis=-1, stable=True)     # best first, ties by token id
    probs = jax.nn.softmax(jnp.take_along_axis(x, order_NxV, axis=-1), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs             # mass of the better-ranked tokens
    n_keep = jnp.maximum(jnp.sum(before < strategy.top_p, axis=-1, keepdims=True), 1)
    keep = jnp.zeros(x.shape, bool).at[rows_Nx1, order_NxV].set(jnp.arange(vocab) < n_keep)
    x = jnp.where(keep, x, NEG_INF)
  return x


def put_column(seq_NxLx, col, tok_Nx):
  """seq with tok written at column `col` of its last axis: a scalar (every row) or [N] (each
  row its own, when rows hold sentences that started at different steps)."""
  if jnp.ndim(col) == 0:
    return lax.dynamic_update_slice_in_dim(seq_NxLx, tok_Nx[..., None], col, axis=-1)
  col = jnp.reshape(col, col.shape + (1,) * (seq_NxLx.ndim - 1))
  return jnp.where(jnp.arange(seq_NxLx.shape[-1]) == col, tok_Nx[..., None], seq_NxLx)


def _per_row(x, ndim: int):
  """A scalar as it is; [N] shaped to broadcast against [N, ...] of `ndim` axes."""
  return x if jnp.ndim(x) == 0 else jnp.reshape(x, x.shape + (1,) * (ndim - 1))


def _next_step(i, done):
  """The step after i: a shared step counts on; per-row steps stop at a finished row."""
  return i + 1 if jnp.ndim(i) == 0 else jnp.where(done, i, i + 1)


def _draw(rng, i, x_NxV):
  """A categorical draw per row at step i: one key for all rows (folded with the step), or
  one key per row, each folded with its own step."""
  if jnp.ndim(i) == 0:
    return jax.random.categorical(jax.random.fold_in(rng, i), x_NxV, axis=-1)
  fold = jax.vmap(jax.random.fold_in)(rng, i)
  return jax.vmap(lambda k, x: jax.random.categorical(k, x))(fold, x_NxV)


def sample_step(tokens_to_logits: TokensToLogits, c: dict, *, strategy: Greedy | Sample,
                limits_B, eos_id: int, pad_id: int, min_len: int = 0, rng=None,
                return_logits: bool = False, top_k: Callable = lax.top_k,
                argmax: Callable = _argmax) -> dict:
  """One step of greedy or sampling decoding on the carry `c` (see `sample_search`). The step
  `c["i"]` is shared by every row (a scalar) or each row's own ([B]; then `rng` holds one key
  per row)."""
  i, done = c["i"], c["done"]
  raw_BxV, state = tokens_to_logits(c["seq"], i, c["state"])
  raw_BxV = raw_BxV.astype(jnp.float32)
  x_BxV = _allowed_logits(raw_BxV, _per_row(i + 1, 2), eos_id=eos_id, pad_id=pad_id,
                          min_len=min_len)
  if isinstance(strategy, Greedy):
    tok_B = argmax(x_BxV)
  else:
    tok_B = _draw(rng, i, filter_logits(x_BxV, strategy, top_k)).astype(jnp.int32)
  logp_B = (jnp.take_along_axis(x_BxV, tok_B[:, None], axis=-1)[:, 0]
            - jax.nn.logsumexp(x_BxV, axis=-1))
  tok_B = jnp.where(done, pad_id, tok_B)
  new = dict(c, i=_next_step(i, done), state=state, seq=put_column(c["seq"], i + 1, tok_B),
             score=c["score"] + jnp.where(done, 0.0, logp_B),
             length=jnp.where(done, c["length"], i + 1),
             done=done | (tok_B == eos_id) | (i + 1 >= limits_B))
  if return_logits:
    new["logits"] = lax.dynamic_update_slice(c["logits"], raw_BxV[:, None], (0, i, 0))
  return new


def sample_carry(state, batch_size: int, max_len: int, *, bos_id: int, pad_id: int) -> dict:
  """The carry of `sample_step` before the first step: BOS fed at step 0 in every row."""
  seq = jnp.full((batch_size, max_len + 1), pad_id, jnp.int32).at[:, 0].set(bos_id)
  return dict(i=jnp.int32(0), seq=seq, state=state, done=jnp.zeros((batch_size,), bool),
              score=jnp.zeros((batch_size,), jnp.float32),
              length=jnp.zeros((batch_size,), jnp.int32))


def sample_search(tokens_to_logits: TokensToLogits, state, *, batch_size: int,
                  strategy: Greedy | Sample, max_len: int, limits_B, bos_id: int,
                  eos_id: int, pad_id: int, min_len: int = 0, rng=None,
                  return_logits: bool = False, resize_state=None,
                  top_k: Callable = lax.top_k, argmax: Callable = _argmax) -> DecodeResult:
  """Greedy or sampling decoding of `batch_size` rows in one `lax.while_loop`.

  `limits_B` [B] int: each row's length limit (<= max_len). Returns a DecodeResult of jax
  arrays with n = 1. `top_k` and `argmax` compute lax.top_k and jnp.argmax (the kernels'
  own may be faster).
  """
  B, L = batch_size, max_len
  limits_B = jnp.asarray(limits_B, jnp.int32)

  def cond(c):
    return (c["i"] < L) & ~jnp.all(c["done"])

  def body(c):
    return sample_step(tokens_to_logits, c, strategy=strategy, limits_B=limits_B,
                       eos_id=eos_id, pad_id=pad_id, min_len=min_len, rng=rng,
                       return_logits=return_logits, top_k=top_k, argmax=argmax)

  carry = sample_carry(state, B, L, bos_id=bos_id, pad_id=pad_id)
  if return_logits:
    vocab = jax.eval_shape(tokens_to_logits, carry["seq"], jnp.int32(0), state)[0].shape[-1]
    carry["logits"] = jnp.zeros((B, L, vocab), jnp.float32)
  c = _phased_while_loop(cond, body, carry, L, resize_state)
  return sample_results(c)


def sample_results(c: dict) -> DecodeResult:
  return DecodeResult(tokens=c["seq"][:, None, 1:], scores=c["score"][:, None],
                      lengths=c["length"][:, None], logits=c.get("logits"))


def cache_phases(max_len: int) -> list[int]:
  """The cache lengths of the decode loop's phases: L/4 and L/2 (rounded up to multiples of
  8, those from 16 to 3L/4) and L itself. Steps before L/4 attend over (and beam search
  moves) an L/4-slot cache instead of all L slots; each phase compiles its own loop
  (docs/performance.md)."""
  ends = {max_len}
  for d in (2, 4):
    end = -(-max_len // d) // -8 * -8   # ceil(L / d), rounded up to a multiple of 8
    if 16 <= end <= 0.75 * max_len:
      ends.add(end)
  return sorted(ends)


def _phased_while_loop(cond, body, carry, max_len: int, resize_state):
  """`lax.while_loop(cond, body, carry)` run as one loop per phase of `cache_phases`, with
  the state resized to the phase's length before it (`resize_state(state, n)`; None = one
  loop). `body` may take several steps, as long as an even count ends at each inner phase
  end (they are multiples of 8): a step past the end would write outside the cache."""
  if resize_state is None:
    return lax.while_loop(cond, body, carry)
  for end in cache_phases(max_len):
    carry = dict(carry, state=resize_state(carry["state"], end))
    carry = lax.while_loop(lambda c, end=end: cond(c) & (c["i"] < end), body, carry)
  return carry


def _reorder_beams(state, parent_BxK):
  """Each beam's state becomes its parent's: leaves [B * K, ...] gathered along rows. A KV
  cache with a table of rows (`model.init_cache(rows=True)`) stays where it is: only the
  table moves, and each hypothesis reads its keys where its ancestors wrote them."""
  B, K = parent_BxK.shape
  rows = (jnp.arange(B)[:, None] * K + parent_BxK).reshape(B * K)
  take = lambda s: jnp.take(s, rows, axis=0, mode="clip")
  has_rows = lambda node: isinstance(node, dict) and "rows" in node

  def reorder(node):
    return dict(node, rows=take(node["rows"])) if has_rows(node) else take(node)
  return jax.tree_util.tree_map(reorder, state, is_leaf=has_rows)


def length_penalty(length, alpha: float):
  """GNMT: ((5 + length) / 6) ** alpha."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def beam_step(tokens_to_logits: TokensToLogits, c: dict, *, beam: Beam, limits_B,
              eos_id: int, pad_id: int, min_len: int = 0,
              top_k_logsumexp: Callable = _top_k_logsumexp) -> dict:
  """One step of beam search on the carry `c` (see `beam_search`); the step `c["i"]` is
  shared by every row (a scalar) or each row's own ([B])."""
  done, length = c["done"], c["i"] + 1
  B, K, L1 = c["alive_seq"].shape
  alpha = float(beam.alpha)
  logits, state = tokens_to_logits(c["alive_seq"].reshape(B * K, L1), c["i"], c["state"])
  length_N = length if jnp.ndim(length) == 0 else jnp.repeat(length, K)
  x_NxV = _allowed_logits(logits, _per_row(length_N, 2), eos_id=eos_id, pad_id=pad_id,
                          min_len=min_len)

  # The best 2K extensions hold at least K that do not end with EOS (there are only K
  # EOS extensions, one per alive hypothesis), and each beam's share of them is among
  # its own best 2K tokens: log-probabilities of those only, not of the whole vocabulary.
  W = min(2 * K, x_NxV.shape[-1])
  beam_top_NxW, beam_tok_NxW, logsumexp_N = top_k_logsumexp(x_NxV, W)
  beam_logp_NxW = beam_top_NxW - logsumexp_N[:, None]
  cand_BxKxW = c["alive_logp"][:, :, None] + beam_logp_NxW.reshape(B, K, W)
  top_score, top_flat = lax.top_k(cand_BxKxW.reshape(B, K * W), 2 * K)
  top_parent = top_flat // W
  top_tok = jnp.take_along_axis(beam_tok_NxW.reshape(B, K * W), top_flat, axis=1)
  top_seq = jnp.take_along_axis(c["alive_seq"], top_parent[:, :, None], axis=1)
  top_is_eos = top_tok == eos_id

  # Finished: EOS extensions among the best K join the finished set (as in fairseq; so a
  # beam of one with alpha = 0 is exactly greedy), which keeps its best K. (Masking
  # rather than slicing the top-k output keeps XLA:CPU on its TopK kernel, not a sort.)
  ended = top_is_eos & (jnp.arange(2 * K) < K)[None]
  new_fin_score = jnp.where(ended, top_score / length_penalty(_per_row(length, 2), alpha),
                            NEG_INF)
  new_fin_seq = put_column(top_seq, length, jnp.full((B, 2 * K), eos_id, jnp.int32))
  fin_score, pick = lax.top_k(jnp.concatenate([c["fin_score"], new_fin_score], 1), K)
  fin_seq = jnp.take_along_axis(jnp.concatenate([c["fin_seq"], new_fin_seq], 1),
                                pick[:, :, None], axis=1)
  fin_len = jnp.take_along_axis(jnp.concatenate(
      [c["fin_len"], jnp.broadcast_to(_per_row(length, 2), (B, 2 * K)).astype(jnp.int32)],
      1), pick, 1)

  # Alive: the best K extensions that do not end with EOS; the state follows its parents.
  alive_logp, pick = lax.top_k(jnp.where(top_is_eos, NEG_INF, top_score), K)
  parent = jnp.take_along_axis(top_parent, pick, 1)
  alive_seq = jnp.take_along_axis(top_seq, pick[:, :, None], axis=1)
  alive_seq = put_column(alive_seq, length, jnp.take_along_axis(top_tok, pick, 1))
  state = _reorder_beams(state, parent)

  # Rows that were already done keep everything (their state is never read again).
  def keep(old, new):
    return jnp.where(done.reshape((B,) + (1,) * (new.ndim - 1)), old, new)

  new = dict(alive_seq=keep(c["alive_seq"], alive_seq),
             alive_logp=keep(c["alive_logp"], alive_logp),
             fin_seq=keep(c["fin_seq"], fin_seq), fin_score=keep(c["fin_score"], fin_score),
             fin_len=keep(c["fin_len"], fin_len),
             fin_count=c["fin_count"] + jnp.where(done, 0, jnp.sum(ended, 1)))
  if beam.stop == "exact":
    best_possible = new["alive_logp"][:, 0] / length_penalty(limits_B, alpha)
    settled = new["fin_score"][:, beam.n_best - 1] > best_possible
  elif beam.stop == "best":
    settled = top_is_eos[:, 0] & (new["fin_count"] >= beam.n_best)
  else:   # "count"
    settled = new["fin_count"] >= K
  dead = new["alive_logp"][:, 0] == NEG_INF
  return dict(c, **new, i=_next_step(c["i"], done), state=state,
              alive_len=jnp.where(done, c["alive_len"], length),
              done=done | (length >= limits_B) | settled | dead)


def beam_carry(state, batch_size: int, beam: Beam, max_len: int, *, bos_id: int,
               pad_id: int) -> dict:
  """The carry of `beam_step` before the first step: one alive hypothesis (BOS) per row."""
  B, K = batch_size, beam.size
  seq0 = jnp.full((B, K, max_len + 1), pad_id, jnp.int32).at[:, :, 0].set(bos_id)
  return dict(
      i=jnp.int32(0), state=state, done=jnp.zeros((B,), bool),
      alive_seq=seq0, alive_len=jnp.zeros((B,), jnp.int32),
      alive_logp=jnp.tile(jnp.array([0.0] + [NEG_INF] * (K - 1), jnp.float32), (B, 1)),
      fin_seq=seq0, fin_score=jnp.full((B, K), NEG_INF, jnp.float32),
      fin_len=jnp.zeros((B, K), jnp.int32), fin_count=jnp.zeros((B,), jnp.int32))


def beam_search(tokens_to_logits: TokensToLogits, state, *, batch_size: int, beam: Beam,
                max_len: int, limits_B, bos_id: int, eos_id: int, pad_id: int,
                min_len: int = 0, resize_state=None,
                top_k_logsumexp: Callable = _top_k_logsumexp) -> DecodeResult:
  """Beam search in one `lax.while_loop`; rows of `tokens_to_logits` and of `state` are
  batch-major beams (row b * size + k).

  Per row: `size` alive hypotheses (no EOS yet) ranked by log-probability, and up to
  `size` finished ones (ended by EOS) ranked by log-probability / length penalty. Each step
  takes the best `size` extensions of the alive hypotheses: those ending with EOS join the
  finished set, and the best `size` extensions not ending with EOS become the alive set
  (the state, e.g. the KV cache, follows its parents). A row stops at its length limit, or
  as `beam.stop` says: "exact", when its n_best-th finished score beats the best score any
  alive hypothesis could still reach (its log-probability can only fall and, with
  alpha >= 0, the penalty is largest at the limit); "best", when the step's best extension
  ends with EOS; "count", once `size` hypotheses have ended. If fewer than n_best
  hypotheses finished, the best alive ones cut at the limit fill the list (finished ones
  always rank first). With size 1 and alpha 0 this is greedy. `top_k_logsumexp` computes
  lax.top_k and each row's logsumexp of the step's logits (the kernels' may be faster).
  """
  L = max_len
  limits_B = jnp.asarray(limits_B, jnp.int32)

  def cond(c):
    return (c["i"] < L) & ~jnp.all(c["done"])

  def body(c):
    return beam_step(tokens_to_logits, c, beam=beam, limits_B=limits_B, eos_id=eos_id,
                     pad_id=pad_id, min_len=min_len, top_k_logsumexp=top_k_logsumexp)

  carry = beam_carry(state, batch_size, beam, L, bos_id=bos_id, pad_id=pad_id)
  # Two steps per iteration: the first step's reordered cache is the second step's scratch
  # buffer, so XLA copies the gathered cache back into the loop carry once per iteration
  # instead of after every step. A second step after every row is done changes nothing but
  # the state, which is never read again.
  c = _phased_while_loop(cond, lambda c: body(body(c)), carry, L, resize_state)
  return beam_results(c, beam, pad_id=pad_id)


def beam_results(c: dict, beam: Beam, *, pad_id: int) -> DecodeResult:
  """The n-best of each row of a beam carry: finished hypotheses first (by score), then
  alive ones cut at the limit."""
  B, K, _ = c["alive_seq"].shape
  alive_score = c["alive_logp"] / length_penalty(c["alive_len"][:, None], float(beam.alpha))
  score = jnp.concatenate([c["fin_score"], alive_score], 1)
  is_fin = jnp.concatenate([c["fin_score"] > NEG_INF, jnp.zeros((B, K), bool)], 1)
  order = jnp.lexsort((-score, ~is_fin), axis=-1)[:, :beam.n_best]
  score = jnp.take_along_axis(score, order, 1)
  seq = jnp.take_along_axis(jnp.concatenate([c["fin_seq"], c["alive_seq"]], 1),
                            order[:, :, None], 1)
  lengths = jnp.take_along_axis(
      jnp.concatenate([c["fin_len"], jnp.broadcast_to(c["alive_len"][:, None], (B, K))], 1),
      order, 1)
  empty = score == NEG_INF
  lengths = jnp.where(empty, 0, lengths)
  tokens = jnp.where(empty[:, :, None], pad_id, seq[:, :, 1:])
  return DecodeResult(tokens=tokens, scores=score, lengths=lengths)


