"""Decoding many sources through a fixed set of slots: no step spent on a sentence that has
ended.

`decoding.decode` runs a batch until its slowest row is done, so on real text (sentences of
many lengths) a third to a half of its row-steps produce nothing. `decode_stream` keeps
`slots` sentences stepping together in one compiled loop instead; when a sentence ends, its
result is taken out and the next waiting source takes its slot: it is encoded, its
cross-attention keys and values are written there, and its step count starts again at 0
(the self-attention cache needs no clearing: a slot attends only to the positions it has
written since). For beam search a slot is one sentence's `size` beams.

    state = empty slots ─▶ insert(sources, slots) ─▶ run until `refill` slots are free ─┐
                                  ▲                                                   │
                                  └──── results of the finished slots taken out ◀─────┘

The host drives the refills: `run` returns as soon as `refill` slots are free (or every slot
is, once no source waits), and `insert` encodes `refill` sources at a time, so each of the
two compiles once per source width. Sources go in longest first: the slots' source width
(and their output buffers, source length + 50) only shrinks, by slicing, once no slot holds
a longer source, and the last sentences to finish are the shortest.

Every row keeps its own step: `Transformer.decode_step` takes per-row positions, and the
search steps are search.py's own (`sample_step`, `beam_step`), so a sentence decodes as
`decode` would decode it alone. Sampling draws from one key per sentence, folded with the
sentence's index: its translation does not depend on the batch it shares.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from seq2seq import kernels
from seq2seq.config import TransformerConfig
from seq2seq.decoding import EXTRA_LEN, as_key
from seq2seq.model import Transformer, head_weights, init_cache
from seq2seq.search import (Beam, Greedy, Sample, Strategy, _check, _is_int, beam_carry,
                            beam_results, beam_step, sample_carry, sample_results,
                            sample_step)

__all__ = ["decode_stream", "StreamStats"]


@dataclasses.dataclass
class StreamStats:
  """What a `decode_stream` call spent: loop steps, slot-steps (steps × slots) and the tokens
  of the returned best hypotheses (EOS included). `useful` = tokens / slot_steps: the share
  of slot-steps that produced a token the caller gets."""
  steps: int = 0
  slot_steps: int = 0
  tokens: int = 0
  runs: int = 0
  inserts: int = 0

  @property
  def useful(self) -> float:
    return self.tokens / max(self.slot_steps, 1)


def _beam(strategy) -> int:
  return strategy.size if isinstance(strategy, Beam) else 1


def _empty_state(cfg: TransformerConfig, strategy: Strategy, slots: int, width: int,
                 out_len: int, *, bos_id: int, pad_id: int) -> dict:
  """Every slot free (done), source width `width`, output buffers of `out_len` tokens."""
  k = _beam(strategy)
  cache = init_cache(cfg, slots * k, out_len)
  if isinstance(strategy, Beam):
    carry = beam_carry(cache, slots, strategy, out_len, bos_id=bos_id, pad_id=pad_id)
  else:
    carry = sample_carry(cache, slots, out_len, bos_id=bos_id, pad_id=pad_id)
  carry = dict(carry, i=jnp.zeros((slots,), jnp.int32), done=jnp.ones((slots,), bool))
  kv = jnp.zeros((slots, cfg.num_heads, width, cfg.head_dim), cfg.dtype)
  state = dict(carry=carry, cross_kv=tuple((kv, kv) for _ in range(cfg.num_decoder_layers)),
               src_valid=jnp.zeros((slots, width), bool),
               limit=jnp.zeros((slots,), jnp.int32), key=jnp.zeros((slots, 2), jnp.uint32))
  # One buffer per entry: the loop updates them in place (donated), so none may be shared.
  return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)


# Which axis of each state entry is the source width (S) or the output length (L; L + 1 for
# the token buffers, which hold BOS first).
_SEQS = ("seq", "alive_seq", "fin_seq")


def _resize(state: dict, width: int, out_len: int, pad_id: int) -> dict:
  """The state with source width `width` and output buffers of `out_len` tokens: sliced
  (only when no slot reads past them) or zero-padded."""
  def fit(x, axis: int, n: int, fill=0):
    have = x.shape[axis]
    if have >= n:
      return lax.slice_in_dim(x, 0, n, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - have)
    return jnp.pad(x, pad, constant_values=fill)

  carry = dict(state["carry"])
  carry["i"] = jnp.minimum(carry["i"], out_len - 1)     # free slots' steps, kept in bounds
  carry["state"] = jax.tree_util.tree_map(lambda x: fit(x, 2, out_len), carry["state"])
  for name in _SEQS:
    if name in carry:
      carry[name] = fit(carry[name], carry[name].ndim - 1, out_len + 1, pad_id)
  return dict(state, carry=carry, src_valid=fit(state["src_valid"], 1, width, False),
              cross_kv=jax.tree_util.tree_map(lambda x: fit(x, 2, width), state["cross_kv"]))


def _insert_impl(params, state, src_RxS, slot_R, limit_R, key_R, *, cfg: TransformerConfig,
                 strategy: Strategy, bos_id: int, pad_id: int):
  """Sources `src_RxS` encoded and placed in slots `slot_R` (an index past the last slot:
  a filler row, dropped), each with a fresh search carry and its length limit."""
  model = Transformer(cfg)
  encoded_RxSxD = model.apply(params, src_RxS, method=Transformer.encode)
  cross = model.apply(params, encoded_RxSxD, method=Transformer.precompute_cross_kv)

  def put(x, new):
    return x.at[slot_R].set(new.astype(x.dtype), mode="drop")

  r, carry = src_RxS.shape[0], state["carry"]
  seq_len = carry["seq" if "seq" in carry else "alive_seq"].shape[-1] - 1
  if isinstance(strategy, Beam):
    fresh = beam_carry((), r, strategy, seq_len, bos_id=bos_id, pad_id=pad_id)
  else:
    fresh = sample_carry((), r, seq_len, bos_id=bos_id, pad_id=pad_id)
  fresh = dict(fresh, i=jnp.zeros((r,), jnp.int32))
  carry = {name: x if name == "state" else put(x, fresh[name]) for name, x in carry.items()}
  return dict(carry=carry, cross_kv=jax.tree_util.tree_map(put, state["cross_kv"], cross),
              src_valid=put(state["src_valid"], src_RxS != pad_id),
              limit=put(state["limit"], limit_R), key=put(state["key"], key_R))


def _run_impl(params, head_w, head_b, state, stop_free, *, cfg: TransformerConfig,
              strategy: Strategy, eos_id: int, pad_id: int, min_len: int):
  """Steps every slot until `stop_free` slots are done (free ones count). Returns (state,
  the DecodeResult of every slot, steps taken)."""
  model, ops = Transformer(cfg), kernels.get(cfg.kernels)
  cross_kv, src_valid, k = state["cross_kv"], state["src_valid"], _beam(strategy)
  if ops.decode_head is None:
    head = lambda y_NxD: model.apply(params, y_NxD, method=Transformer.output_head)
  else:
    head = ops.decode_head(head_w, head_b, False, cfg.dtype)

  def tokens_to_logits(seq_NxL1, i_B, cache):
    i_N = i_B if k == 1 else jnp.repeat(i_B, k)
    tokens_Nx1 = jnp.take_along_axis(seq_NxL1, i_N[:, None], axis=1)
    y_Nx1xD, cache = model.apply(params, tokens_Nx1, i_N, cache, cross_kv, src_valid, True,
                                 method=Transformer.decode_step)
    return head(y_Nx1xD[:, 0]), cache

  limits = state["limit"]
  if isinstance(strategy, Beam):
    one = functools.partial(beam_step, tokens_to_logits, beam=strategy, limits_B=limits,
                            eos_id=eos_id, pad_id=pad_id, min_len=min_len, top_k=ops.top_k)
    per_iteration, body = 2, lambda c: one(one(c))   # as beam_search: see its comment
  else:
    keys = jax.random.wrap_key_data(state["key"])
    one = functools.partial(sample_step, tokens_to_logits, strategy=strategy,
                            limits_B=limits, eos_id=eos_id, pad_id=pad_id, min_len=min_len,
                            rng=keys, top_k=ops.top_k, argmax=ops.argmax)
    per_iteration, body = 1, one

  def cond(c_n):
    return jnp.sum(c_n[0]["done"]) < stop_free

  carry, n = lax.while_loop(cond, lambda c_n: (body(c_n[0]), c_n[1] + 1),
                            (state["carry"], jnp.int32(0)))
  results = (beam_results(carry, strategy, pad_id=pad_id) if isinstance(strategy, Beam)
             else sample_results(carry))
  return dict(state, carry=carry), results, n * per_iteration


_STATIC = ("cfg", "strategy", "bos_id", "pad_id")


@functools.cache
def _jitted(options: tuple = ()):
  opts = dict(options) or None
  insert = jax.jit(_insert_impl, static_argnames=_STATIC, donate_argnames=("state",))
  run = jax.jit(_run_impl, compiler_options=opts, donate_argnames=("state",),
                static_argnames=("cfg", "strategy", "eos_id", "pad_id", "min_len"))
  return insert, run


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def decode_stream(cfg: TransformerConfig, params, sources: Sequence[Sequence[int]],
                  strategy: Strategy = Greedy(), *, bos_id: int, eos_id: int,
                  pad_id: int = 0, slots: int = 64, refill: int | None = None,
                  max_len: int | None = None, rng=None, min_len: int = 0,
                  length_multiple: int = 16, progress: Callable[[int], object] | None = None,
                  stats: StreamStats | None = None) -> list[tuple]:
  """Decodes every source (a list of ids, EOS-terminated, at most config.max_len long).
  Returns, in the order of `sources`, (tokens, scores, lengths) per source: numpy arrays of
  shape [n, L], [n], [n] as `DecodeResult` has them per row (n = 1, or n_best for beam).

  params: the parameters as `decoding.decode_params` makes them (or the raw ones).
  slots: sentences decoded together (rounded down to what the sources need: a power of two).
  refill: sources encoded and placed per insert (default slots / 16, at least 1): the loop
    returns to the host once that many slots are free. Smaller wastes fewer slot-steps on
    free slots and returns more often.
  max_len: every sentence's length limit; None = its source length + 50 (decode's default).
  rng: sampling key or seed (None = 0); sentence j draws from fold_in(rng, j).
  length_multiple: source widths are rounded up to it (one compile per width).
  progress: called with the number of sentences finished after each return to the host.
  stats: a StreamStats to add this call's counts to.
  """
  _check(isinstance(strategy, (Greedy, Sample, Beam)),
         f"strategy must be Greedy(), Sample(...) or Beam(...), got {strategy!r}")
  _check(_is_int(slots) and slots >= 1, f"slots must be >= 1, got {slots!r}")
  _check(max_len is None or (_is_int(max_len) and 1 <= max_len <= cfg.max_len),
         f"max_len must be in [1, {cfg.max_len}] (the model's max_len), got {max_len!r}")
  _check(pad_id == 0, f"pad_id must be 0, the id the model masks as padding, got {pad_id}")
  n = len(sources)
  lengths = [len(s) for s in sources]
  _check(all(0 < m <= cfg.max_len for m in lengths),
         f"every source must hold 1 to {cfg.max_len} tokens (the model's max_len)")
  results: list = [None] * n
  if n == 0:
    return results
  slots = min(slots, 1 << (n - 1).bit_length())
  refill = max(1, slots // 16) if refill is None else max(1, min(int(refill), slots))
  stats = StreamStats() if stats is None else stats
  ops = kernels.get(cfg.kernels)
  insert, run = _jitted(tuple(sorted(ops.decode_compiler_options(cfg).items())))
  params = ops.decode_params(cfg, params if "params" in params else {"params": params})
  w, head_b, w_is_VxD = head_weights(cfg, params["params"])
  head_w = (w.T if w_is_VxD else w).astype(cfg.dtype) if ops.decode_head else None
  keys = np.zeros((n, 2), np.uint32)
  if isinstance(strategy, Sample):
    keys = np.asarray(jax.random.key_data(jax.vmap(jax.random.fold_in, (None, 0))(
        as_key(rng), jnp.arange(n, dtype=jnp.uint32))))
  static = dict(cfg=cfg, strategy=strategy)

  def width(j: int) -> int:
    return min(_round_up(lengths[j], length_multiple), cfg.max_len)

  def out_len(w: int) -> int:
    return max_len if max_len is not None else min(w + EXTRA_LEN, cfg.max_len)

  order = sorted(range(n), key=lambda j: -lengths[j])     # longest first (stable)
  cur_w = width(order[0])
  state = _empty_state(cfg, strategy, slots, cur_w, out_len(cur_w), bos_id=bos_id,
                       pad_id=pad_id)
  held = np.full(slots, -1)                                # the source in each slot
  nxt = 0
  while True:
    free = list(np.flatnonzero(held < 0))
    while nxt < n and len(free) >= min(refill, n - nxt):
      take = order[nxt:nxt + refill]
      src = np.zeros((refill, cur_w), np.int32)
      src[:, 0] = eos_id                                   # filler rows: an empty source
      where = np.full(refill, slots, np.int32)             # filler rows are dropped
      limit = np.zeros(refill, np.int32)
      for r, j in enumerate(take):
        src[r] = 0
        src[r, :lengths[j]] = sources[j]
        where[r] = free[r]
        limit[r] = max_len if max_len is not None else min(lengths[j] + EXTRA_LEN,
                                                           out_len(cur_w))
        held[free[r]] = j
      state = insert(params, state, src, where, limit, keys[np.pad(take, (0, refill - len(take)))],
                     bos_id=bos_id, pad_id=pad_id, **static)
      stats.inserts += 1
      free, nxt = free[len(take):], nxt + len(take)
    if (held < 0).all():
      break
    stop = slots if nxt == n else min(refill, n - nxt)
    state, res, steps = run(params, head_w, head_b, state, stop, eos_id=eos_id,
                            pad_id=pad_id, min_len=min_len, **static)
    done, toks, scores, lens, steps = jax.device_get(
        (state["carry"]["done"], res.tokens, res.scores, res.lengths, steps))
    stats.runs += 1
    stats.steps += int(steps)
    stats.slot_steps += int(steps) * slots
    finished = np.flatnonzero(done & (held >= 0))
    for s in finished:
      results[held[s]] = (toks[s], scores[s], lens[s])
      stats.tokens += int(lens[s, 0])
      held[s] = -1
    if progress is not None and len(finished):
      progress(len(finished))
    # Narrower once no slot (nor the next source) needs the width: sources come longest
    # first, so it never grows.
    need = max([width(j) for j in held[held >= 0]] + ([width(order[nxt])] if nxt < n else [1]))
    if need < cur_w:
      cur_w = need
      state = _resize(state, cur_w, out_len(cur_w), pad_id)
  return results
