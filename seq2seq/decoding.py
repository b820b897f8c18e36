"""Decoding: greedy, sampling (temperature, top-k, top-p) and beam search.

One entry point, `decode(model_or_config, params, src_BxS, strategy, bos_id=, eos_id=)`,
serves the CLI, the training eval loop and the notebooks. Per call it runs ONE jitted
function: encode the source once, project each decoder layer's cross-attention keys/values
once, then a `lax.while_loop` that feeds one token per step through `Transformer.decode_step`
with a preallocated self-attention KV cache ([rows, heads, slots, head_dim], written in
place). The loop runs in up to three phases whose caches hold L/4, L/2 and L slots
(`cache_phases`), so early steps read and move a short cache; it stops as soon as every row
has finished. Compiled once per (batch, source length, max_len, strategy, ...) and cached by
`jax.jit`; params are an argument, never a closed-over constant, so new params (e.g. a new
checkpoint) reuse the compiled code.

A strategy is data, validated at construction (`UserError`, one line):

  Greedy()                                     argmax at every step
  Sample(temperature=1.0, top_k=0, top_p=1.0)  ancestral sampling, optionally filtered
  Beam(size=4, alpha=0.6, n_best=1)            beam search, GNMT length penalty

The two search cores, `sample_search` and `beam_search`, take a `tokens_to_logits(seq_NxL1,
index, state) -> (logits_NxV, state)` function instead of the Transformer, so they can be
tested on hand-built distributions. `seq_NxL1` holds the tokens fed so far (BOS at position
0, the token fed at step `index` at position `index`, pad after); `state` is any pytree
whose leaves have the rows as leading axis (the KV cache for the Transformer), and
`resize_state(state, n)`, if given, fits it to each phase's n steps (`resize_cache`).

Conventions shared by every strategy:
  * Step i feeds the token at position i (BOS at i=0) and chooses output token i.
  * The pad token is never generated; EOS is not allowed before `min_len` tokens.
  * A row stops at EOS or at its length limit: `max_len` if given, else its own source
    length (non-pad tokens) + 50 as in the paper; never more than `config.max_len`, the
    positions the model knows. Because the default limit is per row, a batch decodes
    exactly as each of its sources alone.
  * Lengths count generated tokens, EOS included.

Sentences in, sentences out: `translate` (best hypothesis of each sentence),
`translate_nbest` (every hypothesis with its score; cuts over-long sources, skips empty
ones) and `translate_chunks` (the same, chunk by chunk, for output written as it comes).
decode.py also uses `strategy_from_flags` and `read_lines`.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from seq2seq.attention import row_major
from seq2seq.config import TransformerConfig
from seq2seq.errors import UserError
from seq2seq.model import Transformer, head_weights, init_cache

EXTRA_LEN = 50  # default length limit: source length + 50 (paper, section 6.1)
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


@dataclasses.dataclass(frozen=True)
class Beam:
  """Beam search of `size` hypotheses, ranked by log p / ((5 + length) / 6) ** alpha
  (GNMT length penalty; length counts EOS); returns the `n_best` best. Paper: 4, 0.6."""
  size: int = 4
  alpha: float = 0.6
  n_best: int = 1

  def __post_init__(self):
    _check(_is_int(self.size) and self.size >= 1,
           f"beam size must be an integer >= 1, got {self.size!r}")
    _check(_is_real(self.alpha) and math.isfinite(self.alpha) and self.alpha >= 0,
           f"length penalty alpha must be >= 0, got {self.alpha!r}")
    _check(_is_int(self.n_best) and 1 <= self.n_best <= self.size,
           f"n_best must be an integer in [1, beam size {self.size!r}], got {self.n_best!r}")


Strategy = Greedy | Sample | Beam
STRATEGIES = ("greedy", "sample", "beam")


def get_strategy(name: str, *, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, beam_size: int | None = None,
                 alpha: float | None = None, n_best: int | None = None) -> Strategy:
  """A strategy from flag-like values (None = not given); options that do not apply to the
  strategy raise `UserError`, e.g. top_k with beam search."""
  given = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p,
                                 beam_size=beam_size, alpha=alpha, n_best=n_best).items()
           if v is not None}
  allowed = {"greedy": (), "sample": ("temperature", "top_k", "top_p"),
             "beam": ("beam_size", "alpha", "n_best")}
  _check(name in allowed, f"unknown decoding strategy {name!r}; choose one of "
         + ", ".join(STRATEGIES))
  extra = [k for k in given if k not in allowed[name]]
  _check(not extra, f"{', '.join(extra)} cannot be used with {name} decoding"
         + (f" (it takes {', '.join(allowed[name])})" if allowed[name] else ""))
  if name == "greedy":
    return Greedy()
  if name == "sample":
    return Sample(**given)
  return Beam(**{{"beam_size": "size"}.get(k, k): v for k, v in given.items()})


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
  `length` is the hypothesis length if this step's token ends it."""
  logits_NxV = logits_NxV.astype(jnp.float32)
  ids = jnp.arange(logits_NxV.shape[-1])
  banned = ids == pad_id
  if min_len > 0:
    banned = banned | ((ids == eos_id) & (length < min_len))
  return jnp.where(banned, NEG_INF, logits_NxV)


def argmax(x_NxV):
  """jnp.argmax over the last axis (first maximum), as a max and a min: about twice as fast
  on XLA:CPU, whose argmax reduction is not vectorised."""
  best = jnp.max(x_NxV, axis=-1, keepdims=True)
  vocab = x_NxV.shape[-1]
  return jnp.min(jnp.where(x_NxV == best, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def top_k(x_NxV, k: int, chunk: int = 64):
  """lax.top_k over the last axis (values best first, and their indices).

  A long axis is cut into chunks of `chunk`: the k best entries lie in the k chunks with
  the best maxima, so one cheap max pass and a top-k over k * chunk candidates give the same
  values (ties aside, the same indices) as one top-k over the whole vocabulary, which
  XLA:CPU runs 3-5x slower.
  """
  n, vocab = x_NxV.shape
  if vocab <= 4 * k * chunk:
    return lax.top_k(x_NxV, k)
  pad = -vocab % chunk
  x_NxCxW = jnp.pad(x_NxV, ((0, 0), (0, pad)), constant_values=NEG_INF).reshape(n, -1, chunk)
  _, best_chunks_Nxk = lax.top_k(jnp.max(x_NxCxW, axis=-1), k)
  cand_NxkW = jnp.take_along_axis(x_NxCxW, best_chunks_Nxk[:, :, None], axis=1,
                                  mode="clip").reshape(n, k * chunk)
  values, j = lax.top_k(cand_NxkW, k)
  return values, jnp.take_along_axis(best_chunks_Nxk, j // chunk, axis=1) * chunk + j % chunk


def filter_logits(logits_NxV, strategy: Sample):
  """Temperature, then top-k, then top-p (nucleus): excluded tokens get -inf.

  Exactly `top_k` tokens survive top-k (the lowest id wins a tie for the last place, so
  top_k=1 is greedy), and the nucleus is the smallest set of tokens, best first and tied
  ones by id, whose probability reaches `top_p`. The best logit is subtracted before
  dividing by the temperature, so a tiny temperature cannot overflow to +inf (one below
  float32's smallest normal acts as it).
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


def sample_search(tokens_to_logits: TokensToLogits, state, *, batch_size: int,
                  strategy: Greedy | Sample, max_len: int, limits_B, bos_id: int,
                  eos_id: int, pad_id: int, min_len: int = 0, rng=None,
                  return_logits: bool = False, resize_state=None) -> DecodeResult:
  """Greedy or sampling decoding of `batch_size` rows in one `lax.while_loop`.

  `limits_B` [B] int: each row's length limit (<= max_len). Returns a DecodeResult of jax
  arrays with n = 1.
  """
  B, L = batch_size, max_len
  limits_B = jnp.asarray(limits_B, jnp.int32)

  def cond(c):
    return (c["i"] < L) & ~jnp.all(c["done"])

  def body(c):
    i, done = c["i"], c["done"]
    raw_BxV, state = tokens_to_logits(c["seq"], i, c["state"])
    raw_BxV = raw_BxV.astype(jnp.float32)
    x_BxV = _allowed_logits(raw_BxV, i + 1, eos_id=eos_id, pad_id=pad_id, min_len=min_len)
    if isinstance(strategy, Greedy):
      tok_B = argmax(x_BxV)
    else:
      tok_B = jax.random.categorical(jax.random.fold_in(rng, i),
                                     filter_logits(x_BxV, strategy), axis=-1).astype(jnp.int32)
    logp_B = (jnp.take_along_axis(x_BxV, tok_B[:, None], axis=-1)[:, 0]
              - jax.nn.logsumexp(x_BxV, axis=-1))
    tok_B = jnp.where(done, pad_id, tok_B)
    new = dict(
        i=i + 1, state=state,
        seq=lax.dynamic_update_slice(c["seq"], tok_B[:, None], (0, i + 1)),
        score=c["score"] + jnp.where(done, 0.0, logp_B),
        length=jnp.where(done, c["length"], i + 1),
        done=done | (tok_B == eos_id) | (i + 1 >= limits_B))
    if return_logits:
      new["logits"] = lax.dynamic_update_slice(c["logits"], raw_BxV[:, None], (0, i, 0))
    return new

  seq = jnp.full((B, L + 1), pad_id, jnp.int32).at[:, 0].set(bos_id)
  carry = dict(i=jnp.int32(0), seq=seq, state=state, done=jnp.zeros((B,), bool),
               score=jnp.zeros((B,), jnp.float32), length=jnp.zeros((B,), jnp.int32))
  if return_logits:
    vocab = jax.eval_shape(tokens_to_logits, seq, jnp.int32(0), state)[0].shape[-1]
    carry["logits"] = jnp.zeros((B, L, vocab), jnp.float32)
  c = _phased_while_loop(cond, body, carry, L, resize_state)
  return DecodeResult(tokens=c["seq"][:, None, 1:], scores=c["score"][:, None],
                      lengths=c["length"][:, None], logits=c.get("logits"))


def cache_phases(max_len: int) -> list[int]:
  """The cache lengths of the decode loop's phases: L/4 and L/2 (rounded up to multiples of
  8, those from 16 to 3L/4) and L itself. Steps before L/4 attend over (and beam search
  moves) an L/4-slot cache instead of all L slots: 1.1-1.2x for `small` beam 4 at L = 64,
  more when every row stops long before L. Each phase compiles its own loop (1.5x the
  compile time at L = 64)."""
  ends = {max_len}
  for d in (2, 4):
    end = _round_up(-(-max_len // d), 8)
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
  """Each beam's state becomes its parent's: leaves [B * K, ...] gathered along rows."""
  B, K = parent_BxK.shape
  rows = (jnp.arange(B)[:, None] * K + parent_BxK).reshape(B * K)
  return jax.tree_util.tree_map(lambda s: jnp.take(s, rows, axis=0, mode="clip"), state)


def length_penalty(length, alpha: float):
  """GNMT: ((5 + length) / 6) ** alpha."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def beam_search(tokens_to_logits: TokensToLogits, state, *, batch_size: int, beam: Beam,
                max_len: int, limits_B, bos_id: int, eos_id: int, pad_id: int,
                min_len: int = 0, resize_state=None) -> DecodeResult:
  """Beam search in one `lax.while_loop`; rows of `tokens_to_logits` and of `state` are
  batch-major beams (row b * size + k).

  Per row: `size` alive hypotheses (no EOS yet) ranked by log-probability, and up to
  `size` finished ones (ended by EOS) ranked by log-probability / length penalty. Each step
  takes the best `size` extensions of the alive hypotheses: those ending with EOS join the
  finished set, and the best `size` extensions not ending with EOS become the alive set
  (the state, e.g. the KV cache, follows its parents). A row stops at its length limit, or
  when its n_best-th finished score beats the best score any alive hypothesis could still
  reach (its log-probability can only fall and, with alpha >= 0, the penalty is largest at
  the limit). If fewer than n_best hypotheses finished, the best alive ones cut at the limit
  fill the list (finished ones always rank first). With size 1 and alpha 0 this is greedy.
  """
  B, K, L, alpha = batch_size, beam.size, max_len, float(beam.alpha)
  limits_B = jnp.asarray(limits_B, jnp.int32)
  seq0 = jnp.full((B, K, L + 1), pad_id, jnp.int32).at[:, :, 0].set(bos_id)

  def cond(c):
    return (c["i"] < L) & ~jnp.all(c["done"])

  def body(c):
    i, done, length = c["i"], c["done"], c["i"] + 1
    logits, state = tokens_to_logits(c["alive_seq"].reshape(B * K, L + 1), i, c["state"])
    x_NxV = _allowed_logits(logits, length, eos_id=eos_id, pad_id=pad_id, min_len=min_len)

    # The best 2K extensions hold at least K that do not end with EOS (there are only K
    # EOS extensions, one per alive hypothesis), and each beam's share of them is among
    # its own best 2K tokens: log-probabilities of those only, not of the whole vocabulary.
    W = min(2 * K, x_NxV.shape[-1])
    beam_top_NxW, beam_tok_NxW = top_k(x_NxV, W)
    beam_logp_NxW = beam_top_NxW - jax.nn.logsumexp(x_NxV, axis=-1, keepdims=True)
    cand_BxKxW = c["alive_logp"][:, :, None] + beam_logp_NxW.reshape(B, K, W)
    top_score, top_flat = lax.top_k(cand_BxKxW.reshape(B, K * W), 2 * K)
    top_parent = top_flat // W
    top_tok = jnp.take_along_axis(beam_tok_NxW.reshape(B, K * W), top_flat, axis=1)
    top_seq = jnp.take_along_axis(c["alive_seq"], top_parent[:, :, None], axis=1)
    top_is_eos = top_tok == eos_id

    # Finished: EOS extensions among the best K join the finished set (as in fairseq; so a
    # beam of one with alpha = 0 is exactly greedy), which keeps its best K. (Masking
    # rather than slicing the top-k output keeps XLA:CPU on its TopK kernel, not a sort.)
    new_fin_score = jnp.where(top_is_eos & (jnp.arange(2 * K) < K)[None],
                              top_score / length_penalty(length, alpha), NEG_INF)
    new_fin_seq = lax.dynamic_update_slice(top_seq, jnp.full((B, 2 * K, 1), eos_id, jnp.int32),
                                           (0, 0, length))
    fin_score, pick = lax.top_k(jnp.concatenate([c["fin_score"], new_fin_score], 1), K)
    fin_seq = jnp.take_along_axis(jnp.concatenate([c["fin_seq"], new_fin_seq], 1),
                                  pick[:, :, None], axis=1)
    fin_len = jnp.take_along_axis(
        jnp.concatenate([c["fin_len"], jnp.full((B, 2 * K), length, jnp.int32)], 1), pick, 1)

    # Alive: the best K extensions that do not end with EOS; the state follows its parents.
    alive_logp, pick = lax.top_k(jnp.where(top_is_eos, NEG_INF, top_score), K)
    parent = jnp.take_along_axis(top_parent, pick, 1)
    alive_seq = jnp.take_along_axis(top_seq, pick[:, :, None], axis=1)
    alive_seq = lax.dynamic_update_slice(
        alive_seq, jnp.take_along_axis(top_tok, pick, 1)[:, :, None], (0, 0, length))
    state = _reorder_beams(state, parent)

    # Rows that were already done keep everything (their state is never read again).
    def keep(old, new):
      return jnp.where(done.reshape((B,) + (1,) * (new.ndim - 1)), old, new)

    new = dict(alive_seq=keep(c["alive_seq"], alive_seq),
               alive_logp=keep(c["alive_logp"], alive_logp),
               fin_seq=keep(c["fin_seq"], fin_seq), fin_score=keep(c["fin_score"], fin_score),
               fin_len=keep(c["fin_len"], fin_len))
    best_possible = new["alive_logp"][:, 0] / length_penalty(limits_B, alpha)
    settled = new["fin_score"][:, beam.n_best - 1] > best_possible
    dead = new["alive_logp"][:, 0] == NEG_INF
    return dict(new, i=length, state=state, alive_len=jnp.where(done, c["alive_len"], length),
                done=done | (length >= limits_B) | settled | dead)

  carry = dict(
      i=jnp.int32(0), state=state, done=jnp.zeros((B,), bool),
      alive_seq=seq0, alive_len=jnp.zeros((B,), jnp.int32),
      alive_logp=jnp.tile(jnp.array([0.0] + [NEG_INF] * (K - 1), jnp.float32), (B, 1)),
      fin_seq=seq0, fin_score=jnp.full((B, K), NEG_INF, jnp.float32),
      fin_len=jnp.zeros((B, K), jnp.int32))
  # Two steps per iteration: the first step's reordered cache is the second step's scratch
  # buffer, so XLA copies the gathered cache back into the loop carry once per iteration
  # instead of after every step. A second step after every row is done changes nothing but
  # the state, which is never read again.
  c = _phased_while_loop(cond, lambda c: body(body(c)), carry, L, resize_state)

  # n-best: finished hypotheses first (by score), then alive ones cut at the limit.
  alive_score = c["alive_logp"] / length_penalty(c["alive_len"][:, None], alpha)
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


# ---------------------------------------------------------------------------------------
# The Transformer behind `tokens_to_logits`.

def _variables(params):
  return params if "params" in params else {"params": params}


def _repeat_rows(tree, n: int):
  return tree if n == 1 else jax.tree_util.tree_map(lambda x: jnp.repeat(x, n, axis=0), tree)


def head_DxV(cfg: TransformerConfig, params):
  """The output head's weights as [D, V] in the compute dtype (and bias [V] or None), laid
  out once per decode call, so that every step's head is a plain [N, D]·[D, V] dot. XLA:CPU's
  own dot emitter (which the f32 loop uses without AVX-512, see `XLA_DOTS`) runs the tied
  [V, D]ᵀ form of it ~3x slower. (Row-major: else XLA casts the table in one pass and
  transposes it in a second.)"""
  w, b_V, w_is_VxD = head_weights(cfg, params)
  return row_major((w.T if w_is_VxD else w).astype(cfg.dtype)), b_V


def transformer_tokens_to_logits(model: Transformer, variables, src_BxS, *, max_len: int,
                                 repeat: int = 1, pad_id: int = 0,
                                 full_recompute: bool = False):
  """(tokens_to_logits, initial state) for B * repeat rows (row b * repeat + r decodes
  source b). Encodes the source and projects the cross-attention keys/values once.

  Cached: feeds one token per step to `decode_step`; the state is the KV cache.
  full_recompute: the benchmark's baseline; re-runs the teacher-forced decoder on the whole
  [rows, max_len] buffer every step (causal masking makes it equal) and keeps no state.
  """
  cfg = model.config
  encoded_BxSxD = model.apply(variables, src_BxS, method=Transformer.encode)
  if full_recompute:
    encoded, src = _repeat_rows((encoded_BxSxD, src_BxS), repeat)

    def full_tokens_to_logits(seq_NxL1, index, state):
      logits_NxLxV = model.apply(variables, encoded, src, seq_NxL1[:, :max_len],
                                 method=Transformer.decode)
      return lax.dynamic_index_in_dim(logits_NxLxV, index, axis=1, keepdims=False), state

    return full_tokens_to_logits, ()

  # One copy per source: the `repeat` rows of a source share it (see dot_product_attention).
  cross_kv = model.apply(variables, encoded_BxSxD, method=Transformer.precompute_cross_kv)
  src_valid = src_BxS != pad_id
  w_DxV, b_V = head_DxV(cfg, variables["params"])

  def cached_tokens_to_logits(seq_NxL1, index, cache):
    tokens_Nx1 = lax.dynamic_slice_in_dim(seq_NxL1, index, 1, axis=1)
    y_Nx1xD, cache = model.apply(variables, tokens_Nx1, index, cache, cross_kv, src_valid,
                                 True, method=Transformer.decode_step)
    logits_NxV = jnp.dot(y_Nx1xD[:, 0].astype(w_DxV.dtype), w_DxV,
                         preferred_element_type=jnp.float32)
    return (logits_NxV if b_V is None else logits_NxV + b_V.astype(jnp.float32)), cache

  return cached_tokens_to_logits, init_cache(cfg, src_BxS.shape[0] * repeat, max_len)


def resize_cache(cache, length: int):
  """The KV cache cut or zero-padded to `length` slots (a phase of the decode loop)."""
  def resize(x_NxHxLxD):
    n = x_NxHxLxD.shape[2]
    if n >= length:
      return x_NxHxLxD[:, :, :length]
    return jnp.pad(x_NxHxLxD, ((0, 0), (0, 0), (0, length - n), (0, 0)))
  return jax.tree_util.tree_map(resize, cache)


def decode_params(cfg: TransformerConfig, params):
  """The weight matrices in the compute dtype: decoding a few rows at a time is bound by
  reading the weights, so a bf16 model decodes from bf16 copies. `decode` makes them once
  per call; callers that decode many batches (`translate_nbest`) make them once and pass
  them in. Embedding tables keep their dtype: they are only looked up (and XLA:CPU would
  widen a whole bf16 table to f32 for each call's lookups); the head casts its own copy.
  Params already cast come back as they are."""
  def done(path, x):
    return x.ndim < 2 or getattr(path[-1], "key", None) == "embedding" or x.dtype == cfg.dtype
  leaves = jax.tree_util.tree_leaves_with_path(params)
  return params if all(done(path, x) for path, x in leaves) else _cast_matrices(cfg, params)


@functools.partial(jax.jit, static_argnums=0)
def _cast_matrices(cfg: TransformerConfig, params):
  def cast(path, x):
    name = getattr(path[-1], "key", None)
    return x if x.ndim < 2 or name == "embedding" else x.astype(cfg.dtype)
  return jax.tree_util.tree_map_with_path(cast, params)


def _decode_impl(params, src_BxS, rng, *, cfg: TransformerConfig, strategy, max_len: int,
                 per_row_limit: bool, bos_id: int, eos_id: int, pad_id: int, min_len: int,
                 full_recompute: bool, return_logits: bool) -> DecodeResult:
  model = Transformer(cfg)
  batch = src_BxS.shape[0]
  params = decode_params(cfg, params)
  if per_row_limit:
    src_len_B = jnp.sum(src_BxS != pad_id, axis=1).astype(jnp.int32)
    limits_B = jnp.minimum(src_len_B + EXTRA_LEN, max_len)
  else:
    limits_B = jnp.full((batch,), max_len, jnp.int32)
  ids = dict(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, min_len=min_len)
  repeat = strategy.size if isinstance(strategy, Beam) else 1
  fn, state = transformer_tokens_to_logits(model, params, src_BxS, max_len=max_len,
                                           repeat=repeat, pad_id=pad_id,
                                           full_recompute=full_recompute)
  ids["resize_state"] = None if full_recompute else resize_cache
  if isinstance(strategy, Beam):
    return beam_search(fn, state, batch_size=batch, beam=strategy, max_len=max_len,
                       limits_B=limits_B, **ids)
  return sample_search(fn, state, batch_size=batch, strategy=strategy, max_len=max_len,
                       limits_B=limits_B, rng=rng, return_logits=return_logits, **ids)


# XLA:CPU options for the float32 decode loop. An empty list of YNNPACK fusion kinds hands
# the loop's dots (a few rows times a [D, F] matrix each) to XLA's own dot emitter. With the
# [D, V] head, 7 interleaved runs of `python bench/bench_decode.py --modes cached` against
# the previous loop on an AVX2 Zen 3 (issue 7): greedy 1.46x (small) and 1.16x (base),
# beam 4 1.00x (small) and 1.14x (base), medians. On an AVX-512 EPYC, XLA's default
# (YNNPACK) was faster instead: 8 in-process pairs, twice, gave base greedy 1.06-1.07x,
# base beam 4 1.09-1.12x, small beam 4 1.04-1.10x, small greedy 0.91-1.00x, same tokens.
# So these options apply on CPUs without AVX-512 (`cpu_f32_decode_options`). Training keeps
# the default: its large transposed dots are faster with YNNPACK. bfloat16 keeps the
# default too. `bench_decode.py --f32_dots` compares the two on a new machine.
XLA_DOTS = {"xla_cpu_experimental_ynn_fusion_type": ""}
F32_DOTS = "auto"   # or "xla" (XLA_DOTS) or "ynnpack" (XLA's defaults): for benchmarks


def cpu_has_avx512(cpuinfo: str | None = None) -> bool:
  """Whether the CPU lists avx512f among its flags (Linux's /proc/cpuinfo; False where that
  cannot be read)."""
  if cpuinfo is None:
    try:
      with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    except OSError:
      return False
  return any(line.startswith("flags") and "avx512f" in line.split()
             for line in cpuinfo.splitlines())


@functools.cache
def _this_cpu_has_avx512() -> bool:
  return cpu_has_avx512()


def cpu_f32_decode_options() -> dict:
  """The XLA:CPU compiler options of the float32 decode loop: XLA_DOTS or {} (defaults)."""
  _check(F32_DOTS in ("auto", "xla", "ynnpack"),
         f"F32_DOTS must be auto, xla or ynnpack, got {F32_DOTS!r}")
  if F32_DOTS == "auto":
    return {} if _this_cpu_has_avx512() else XLA_DOTS
  return XLA_DOTS if F32_DOTS == "xla" else {}


@functools.cache
def _decode_jit(options: tuple = ()):
  return jax.jit(_decode_impl, compiler_options=dict(options) or None, static_argnames=(
      "cfg", "strategy", "max_len", "per_row_limit", "bos_id", "eos_id", "pad_id",
      "min_len", "full_recompute", "return_logits"))


def decode_jit_for(cfg: TransformerConfig):
  """The jitted decode function `decode` calls for this config on the default backend."""
  cpu_f32 = jax.default_backend() == "cpu" and cfg.dtype == "float32"
  return _decode_jit(tuple(sorted(cpu_f32_decode_options().items())) if cpu_f32 else ())


def _as_key(rng):
  if rng is None:
    return jax.random.key(0)
  if _is_int(rng):
    return jax.random.key(int(rng))
  rng = jnp.asarray(rng)
  return rng if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(rng)


def decode(model_or_config: Transformer | TransformerConfig, params, src_BxS,
           strategy: Strategy = Greedy(), *, bos_id: int, eos_id: int,
           max_len: int | None = None, rng=None, pad_id: int = 0, min_len: int = 0,
           full_recompute: bool = False, return_logits: bool = False) -> DecodeResult:
  """Decodes a batch of sources. Returns a DecodeResult of numpy arrays (see its docstring:
  tokens [B, n, L] with n = 1 or n_best, scores [B, n], lengths [B, n]).

  params: the model's variables ({"params": ...}) or the bare params tree.
  src_BxS: int source ids, EOS-terminated, right-padded with pad_id (which must be 0: the
    model's masks treat id 0 as padding).
  max_len: output buffer length L and every row's limit; None = per row source length + 50,
    buffer S + 50; both capped at config.max_len.
  rng: key, raw key data or int seed for sampling (None = seed 0, so runs are repeatable).
  min_len: EOS is forbidden until a hypothesis would have this many tokens (EOS included).
  full_recompute: uncached baseline (benchmark only): same loop, whole decoder every step.
  return_logits: also return the raw logits of every step (greedy/sampling only).
  """
  cfg = model_or_config.config if isinstance(model_or_config, Transformer) else model_or_config
  _check(isinstance(cfg, TransformerConfig),
         f"decode needs a Transformer or TransformerConfig, got {type(cfg).__name__}")
  _check(isinstance(strategy, (Greedy, Sample, Beam)),
         f"strategy must be Greedy(), Sample(...) or Beam(...), got {strategy!r}")
  src_BxS = jnp.asarray(src_BxS)
  _check(src_BxS.ndim == 2 and jnp.issubdtype(src_BxS.dtype, jnp.integer),
         f"source must be a [batch, length] integer array, got {src_BxS.dtype}{src_BxS.shape}")
  batch, src_len = src_BxS.shape
  _check(batch > 0 and src_len > 0, f"empty source batch of shape {src_BxS.shape}")
  _check(src_len <= cfg.max_len, f"source length {src_len} exceeds the model's "
         f"max_len {cfg.max_len}")
  for name, v in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
    _check(_is_int(v) and 0 <= v < cfg.vocab_size,
           f"{name} must be a token id in [0, {cfg.vocab_size}), got {v!r}")
  _check(pad_id == 0, f"pad_id must be 0, the id the model masks as padding, got {pad_id}")
  _check(len({bos_id, eos_id, pad_id}) == 3,
         f"bos_id, eos_id and pad_id must differ, got {bos_id}, {eos_id}, {pad_id}")
  if max_len is None:
    max_len, per_row_limit = min(src_len + EXTRA_LEN, cfg.max_len), True
  else:
    _check(_is_int(max_len) and 1 <= max_len <= cfg.max_len,
           f"max_len must be in [1, {cfg.max_len}] (the model's max_len), got {max_len!r}")
    per_row_limit = False
  _check(_is_int(min_len) and min_len >= 0, f"min_len must be an integer >= 0, got {min_len!r}")
  _check(not isinstance(strategy, Beam) or strategy.size <= cfg.vocab_size,
         f"beam size {getattr(strategy, 'size', 0)} is larger than the vocabulary "
         f"({cfg.vocab_size} tokens)")
  _check(not (return_logits and isinstance(strategy, Beam)),
         "return_logits is only available for greedy and sampling")
  out = decode_jit_for(cfg)(
      _variables(params), src_BxS.astype(jnp.int32), _as_key(rng), cfg=cfg,
      strategy=strategy, max_len=int(max_len), per_row_limit=per_row_limit,
      bos_id=int(bos_id), eos_id=int(eos_id), pad_id=int(pad_id), min_len=int(min_len),
      full_recompute=bool(full_recompute), return_logits=bool(return_logits))
  return DecodeResult(*(None if x is None else np.asarray(x) for x in out))


# ---------------------------------------------------------------------------------------
# Sentences in, sentences out.

def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


class Translations(NamedTuple):
  """What `translate_nbest` returns, in input order.

  texts       [sentence][hypothesis] strings, best first: n_best of them for beam search
              (fewer only if the beam held fewer), one for greedy and sampling.
  scores      the same shape: DecodeResult.scores (log-probability; for beam search divided
              by the length penalty). A skipped empty sentence has [""] and [0.0].
  num_tokens  tokens generated over all returned hypotheses, EOS included.
  truncated   indices of the sentences whose source was cut to config.max_len tokens.
  """
  texts: list[list[str]]
  scores: list[list[float]]
  num_tokens: int
  truncated: list[int]


def encode_sources(tokenizer, sentences: Sequence[str], max_len: int, *,
                   truncate: bool = True) -> tuple[list[list[int]], list[int]]:
  """(sources, truncated): `tokenizer.encode(s) + [eos]` per sentence, and the indices of
  those longer than `max_len` tokens, which are cut to max_len with EOS kept as the last
  token (truncate=True) or raise UserError (truncate=False)."""
  eos = int(tokenizer.eos_id)
  srcs, truncated = [], []
  for i, sentence in enumerate(sentences):
    ids = list(tokenizer.encode(sentence)) + [eos]
    if len(ids) > max_len:
      _check(truncate, f"sentence {i} has {len(ids)} tokens (EOS included); the model reads "
             f"at most {max_len}")
      ids = ids[:max_len - 1] + [eos]
      truncated.append(i)
    srcs.append(ids)
  return srcs, truncated


def translate_nbest(params, cfg: TransformerConfig, tokenizer, sentences: Sequence[str],
                    strategy: Strategy = Greedy(), *, batch_size: int = 64,
                    length_multiple: int = 16, max_len: int | None = None, rng=None,
                    truncate: bool = True, skip_empty: bool = True,
                    progress: Callable[[int], Any] | None = None) -> Translations:
  """Translates `sentences`: every hypothesis (n_best for beam search) with its score.

  Sources are `tokenizer.encode(s) + [eos]`. Sentences are sorted by length and batched;
  each batch is padded to a multiple of `length_multiple` tokens and to a power-of-two
  number of rows (at most batch_size), so few shapes are compiled and reused. Batch `n`
  decodes with `fold_in(rng, n)`.

  truncate: a source longer than config.max_len is cut to it (EOS kept) and listed in
    `truncated`; False raises UserError instead.
  skip_empty: a sentence with no tokens (empty or blank) translates to "" with score 0
    without running the model; False decodes it as the source [eos].
  progress: called with the number of sentences finished after each batch.
  """
  _check(isinstance(strategy, (Greedy, Sample, Beam)),
         f"strategy must be Greedy(), Sample(...) or Beam(...), got {strategy!r}")
  _check(_is_int(batch_size) and batch_size >= 1, f"batch_size must be >= 1, got {batch_size!r}")
  _check(max_len is None or (_is_int(max_len) and 1 <= max_len <= cfg.max_len),
         f"max_len must be in [1, {cfg.max_len}] (the model's max_len), got {max_len!r}")
  pad, eos = int(getattr(tokenizer, "pad_id", 0)), int(tokenizer.eos_id)
  srcs, truncated = encode_sources(tokenizer, sentences, cfg.max_len, truncate=truncate)
  texts: list[list[str]] = [[""] for _ in srcs]
  scores: list[list[float]] = [[0.0] for _ in srcs]
  todo = [i for i, s in enumerate(srcs) if not (skip_empty and len(s) == 1)]
  if progress is not None and len(todo) < len(srcs):
    progress(len(srcs) - len(todo))
  order = sorted(todo, key=lambda i: len(srcs[i]))
  key = _as_key(rng)
  params = decode_params(cfg, _variables(params))   # once, not per batch
  num_tokens = 0
  for n, start in enumerate(range(0, len(order), batch_size)):
    idx = order[start:start + batch_size]
    rows = min(batch_size, 1 << (len(idx) - 1).bit_length())
    width = min(_round_up(max(len(srcs[i]) for i in idx), length_multiple), cfg.max_len)
    src = np.full((rows, width), pad, np.int32)
    src[len(idx):, 0] = eos                     # filler rows: an empty sentence
    for r, i in enumerate(idx):
      src[r, :len(srcs[i])] = srcs[i]
    res = decode(cfg, params, src, strategy, bos_id=int(tokenizer.bos_id), eos_id=eos,
                 pad_id=pad, max_len=max_len, rng=jax.random.fold_in(key, n))
    hyps = [res.token_lists(eos, j) for j in range(res.tokens.shape[1])]
    for r, i in enumerate(idx):
      # An empty beam slot (score -inf) is dropped; the best hypothesis is always kept.
      keep = [j for j in range(len(hyps)) if j == 0 or res.scores[r, j] > -np.inf]
      texts[i] = [tokenizer.decode(hyps[j][r]) for j in keep]
      scores[i] = [float(res.scores[r, j]) for j in keep]
      num_tokens += int(sum(res.lengths[r, j] for j in keep))
    if progress is not None:
      progress(len(idx))
  return Translations(texts, scores, num_tokens, truncated)


def translate_chunks(params, cfg: TransformerConfig, tokenizer, sentences: Iterable[str],
                     strategy: Strategy = Greedy(), *, chunk_size: int = 2048, rng=None,
                     **kwargs) -> Iterator[tuple[int, Translations]]:
  """`translate_nbest` over consecutive chunks of `chunk_size` sentences: yields (index of
  the chunk's first sentence, its Translations) as each chunk is done, so a caller can write
  results while the rest decode (and keep them if interrupted). `sentences` may be any
  iterable, read lazily one chunk at a time (chunk_size 1 translates each line as it is
  typed). Sorting by length happens within a chunk; `truncated` holds global indices.
  Chunk k decodes with `fold_in(rng, k)`. kwargs go to `translate_nbest`."""
  _check(_is_int(chunk_size) and chunk_size >= 1, f"chunk_size must be >= 1, got {chunk_size!r}")
  key = _as_key(rng)
  params = decode_params(cfg, _variables(params))   # once, not per chunk
  lines, offset = iter(sentences), 0
  for k in itertools.count():
    chunk = list(itertools.islice(lines, chunk_size))
    if not chunk:
      return
    out = translate_nbest(params, cfg, tokenizer, chunk, strategy,
                          rng=jax.random.fold_in(key, k), **kwargs)
    yield offset, out._replace(truncated=[offset + i for i in out.truncated])
    offset += len(chunk)


def translate(params, cfg: TransformerConfig, tokenizer, sentences: Sequence[str],
              strategy: Strategy = Greedy(), *, batch_size: int = 64, length_multiple: int = 16,
              max_len: int | None = None, rng=None) -> list[str]:
  """Translates `sentences`, returning the best hypothesis of each, in input order.

  Sources are `tokenizer.encode(s) + [eos]`; one longer than config.max_len raises
  UserError, and an empty sentence is decoded like any other (`translate_nbest` with
  truncate=False, skip_empty=False; see it for the batching).
  """
  out = translate_nbest(params, cfg, tokenizer, sentences, strategy, batch_size=batch_size,
                        length_multiple=length_multiple, max_len=max_len, rng=rng,
                        truncate=False, skip_empty=False)
  return [t[0] for t in out.texts]


# ---------------------------------------------------------------------------------------
# What the decode.py command line needs.

DEFAULT_BEAM = Beam()  # the paper's beam search: 4 hypotheses, alpha 0.6


def strategy_from_flags(*, beam_size: int | None = None, alpha: float | None = None,
                        n_best: int | None = None, temperature: float | None = None,
                        top_k: int | None = None, top_p: float | None = None) -> Strategy:
  """decode.py's rule (None = flag not given): any of temperature / top_k / top_p means
  sampling, beam_size 1 means greedy, otherwise beam search (default size 4, alpha 0.6).
  Options that contradict the chosen strategy raise UserError, e.g. top_k with a beam size
  above 1, alpha or n_best with sampling, temperature <= 0, top_p outside (0, 1]."""
  sampling = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items()
              if v is not None}
  if sampling:
    _check(beam_size is None or beam_size == 1,
           f"{', '.join(sampling)} (sampling) cannot be used with beam search (beam size "
           f"{beam_size!r}); drop the beam size to sample")
    return get_strategy("sample", alpha=alpha, n_best=n_best, **sampling)
  if beam_size == 1:
    return get_strategy("greedy", alpha=alpha, n_best=n_best)
  return get_strategy("beam", beam_size=DEFAULT_BEAM.size if beam_size is None else beam_size,
                      alpha=DEFAULT_BEAM.alpha if alpha is None else alpha, n_best=n_best)


def read_lines(source) -> list[str]:
  r"""The lines of `source`: a path, or an open binary or text stream (e.g. standard input).
  Lines split at "\n" only; "\n" / "\r\n" ends and a leading byte-order mark removed.
  A missing or unreadable file, or bytes that are not UTF-8, raise UserError."""
  name = "standard input"
  if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
    name = str(source)
    try:
      with open(source, "rb") as f:
        data = f.read()
    except OSError as e:
      raise UserError(f"cannot read {source}: {e.strerror or e}") from None
  else:
    data = source.read()
  if isinstance(data, bytes):
    try:
      text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
      line = data.count(b"\n", 0, e.start) + 1
      raise UserError(f"{name} line {line}: invalid UTF-8 (byte 0x{data[e.start]:02x})"
                      ) from None
  else:
    text = data
  text = text.removeprefix("\ufeff")
  lines = text.split("\n")
  if lines[-1] == "":
    lines.pop()
  return [line.removesuffix("\r") for line in lines]
