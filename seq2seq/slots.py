"""Decoding many sources through a fixed set of slots: no step spent on a sentence that has
ended.

`decoding.decode` runs a batch until its slowest row is done, so on real text (sentences of
many lengths) a third to a half of its row-steps produce nothing. `decode_stream` keeps
`slots` sentences stepping together in one compiled loop instead; when a sentence ends, its
result is copied out and the next waiting source takes its slot: it is encoded, its
cross-attention keys and values are written there, and its step count starts again at 0.
The self-attention cache needs no clearing: it is a ring that every slot writes at the same
column each step, and a slot attends only to the columns it has written since it started
(`Transformer.decode_step`'s `column`). For beam search a slot is one sentence's `size`
beams; where the kernels read keys through a table of rows (`kernels.beam_rows`) the cache
stays in place and only the table follows the beams (search._reorder_beams).

    one compiled loop, per source width:
      ┌─▶ fill: while `refill` slots are free and sources wait, the finished ones'
      │         results go to the output buffer and `refill` queued sources are encoded
      │         into them (`_insert`)
      └── step every slot once (search.py's `sample_step` / `beam_step`, per-row positions)
    exits when the queue is used up (or, to narrow, when no slot holds a wider source)

The host hands the loop a queue of up to `queue` sources of one width at a time and takes
the results out when it returns, so the loop compiles once per source width, as
`decode` compiles once per batch width. Sources go in longest first: the slots' source
width (and their output buffers, source length + 50) only ever shrinks, by slicing, once
no slot holds a longer source, and the last sentences to finish are the shortest.

Every row keeps its own step (`Transformer.decode_step` takes per-row positions), so a
sentence decodes as `decode` decodes it alone (the same function; the ring turns the order
of the keys, so float32 sums may round differently in the last bit). Sampling draws from
one key per sentence, folded with its index: its translation does not depend on the
sentences beside it.
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
from seq2seq.decoding import EXTRA_LEN, as_key, decode_params, decoding_model
from seq2seq.layout import head_weights
from seq2seq.model import Transformer, init_cache
from seq2seq.search import (Beam, Greedy, Sample, Strategy, _check, _is_int, beam_carry,
                            beam_results, beam_step, sample_carry, sample_results,
                            sample_step)

__all__ = ["decode_stream", "StreamStats"]


@dataclasses.dataclass
class StreamStats:
  """What `decode_stream` calls spent: loop steps, slot-steps (steps × slots), those of
  slots that held a sentence still searching (`busy_slot_steps`), the tokens of the
  returned best hypotheses (EOS included) and the loop's returns to the host. `useful` =
  tokens / slot_steps: the share of slot-steps that produced a token the caller gets;
  `busy`: the share that stepped a sentence (the rest: free slots waiting for a refill or
  with no source left). Beam search's busy steps beyond its tokens are the search for
  hypotheses better than the one returned (its stop rule)."""
  steps: int = 0
  slot_steps: int = 0
  busy_slot_steps: int = 0
  tokens: int = 0
  runs: int = 0

  @property
  def useful(self) -> float:
    return self.tokens / max(self.slot_steps, 1)

  @property
  def busy(self) -> float:
    return self.busy_slot_steps / max(self.slot_steps, 1)


def _beam(strategy) -> int:
  return strategy.size if isinstance(strategy, Beam) else 1


def _fresh_carry(strategy: Strategy, state, rows: int, out_len: int, *, bos_id: int,
                 pad_id: int) -> dict:
  """The search carry of `rows` sentences before their first step, with per-row steps."""
  if isinstance(strategy, Beam):
    carry = beam_carry(state, rows, strategy, out_len, bos_id=bos_id, pad_id=pad_id)
  else:
    carry = sample_carry(state, rows, out_len, bos_id=bos_id, pad_id=pad_id)
  return dict(carry, i=jnp.zeros((rows,), jnp.int32))


@functools.partial(jax.jit, static_argnums=range(6), static_argnames=("bos_id", "pad_id"))
def _empty_state(cfg: TransformerConfig, strategy: Strategy, slots: int, width: int,
                 out_len: int, ring: int, *, bos_id: int, pad_id: int) -> dict:
  """Every slot free: done, holding no source (id -1); source width `width`, output
  buffers of `out_len` tokens, a self-attention cache ring of `ring` columns."""
  ops = kernels.get(cfg.kernels)
  dtype = ops.cache_dtype(cfg)
  # Beam search reads its hypotheses' keys where their ancestors wrote them, where the
  # kernels can (a table of rows; see search._reorder_beams), instead of moving the cache.
  cache = init_cache(cfg, slots * _beam(strategy), ring, dtype,
                     rows=isinstance(strategy, Beam) and ops.beam_rows(cfg))
  carry = _fresh_carry(strategy, cache, slots, out_len, bos_id=bos_id, pad_id=pad_id)
  kv = jnp.zeros((slots, cfg.num_heads, width, cfg.head_dim), dtype)
  state = dict(carry=dict(carry, done=jnp.ones((slots,), bool)), column=jnp.int32(0),
               cross_kv=tuple((kv, kv) for _ in range(cfg.num_decoder_layers)),
               src_valid=jnp.zeros((slots, width), bool),
               limit=jnp.zeros((slots,), jnp.int32), key=jnp.zeros((slots, 2), jnp.uint32),
               source=jnp.full((slots,), -1, jnp.int32), width=jnp.zeros((slots,), jnp.int32))
  # One program (not an op at a time), whose outputs are one buffer per entry: the loop
  # updates them in place (donated), so none may be shared.
  return state


_SEQS = ("seq", "alive_seq", "fin_seq")    # token buffers: BOS, then out_len tokens


def _resize(state: dict, width: int, out_len: int, ring: int, pad_id: int) -> dict:
  """The state with source width `width`, output buffers of `out_len` tokens and a cache
  ring of `ring` columns: each sliced (when no busy slot reads past it) or zero-padded."""
  def fit(x, axis: int, n: int, fill=0):
    have = x.shape[axis]
    if have >= n:
      return lax.slice_in_dim(x, 0, n, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - have)
    return jnp.pad(x, pad, constant_values=fill)

  carry = dict(state["carry"])
  carry["i"] = jnp.minimum(carry["i"], out_len - 1)     # free slots' steps, kept in bounds
  # The cache ring turned so that the next column is 0 (the newest entries last), then its
  # oldest columns cut, or empty ones added after the newest (the next column, then).
  have = carry["state"][0]["k"].shape[2]

  def ring_fit(x):   # keys and values [N, H, ring, Dh]; a table of rows [N, ring]
    axis = 2 if x.ndim == 4 else 1
    x = jnp.roll(x, -state["column"], axis=axis)
    return (lax.slice_in_dim(x, have - ring, have, axis=axis) if have >= ring
            else fit(x, axis, ring))
  carry["state"] = jax.tree_util.tree_map(ring_fit, carry["state"])
  for name in _SEQS:
    if name in carry:
      carry[name] = fit(carry[name], carry[name].ndim - 1, out_len + 1, pad_id)
  return dict(state, carry=carry, column=jnp.int32(0 if have >= ring else have),
              src_valid=fit(state["src_valid"], 1, width, False),
              cross_kv=jax.tree_util.tree_map(lambda x: fit(x, 2, width), state["cross_kv"]))


# One program per new size, not one per operation and shape (eager slices compile too).
_resize_jit = jax.jit(_resize, static_argnums=(1, 2, 3, 4))


def _results(strategy: Strategy, carry: dict, pad_id: int):
  return (beam_results(carry, strategy, pad_id=pad_id) if isinstance(strategy, Beam)
          else sample_results(carry))


def _loop_impl(params, head_w, head_b, state, queue, stop_free, narrow_to, *,
               cfg: TransformerConfig, strategy: Strategy, refill: int, bos_id: int,
               eos_id: int, pad_id: int, min_len: int):
  """Fills free slots from `queue` and steps every slot, until the queue is used up and at
  least `stop_free` slots are done, or (narrow_to > 0) no busy slot holds a source wider
  than narrow_to.

  queue: dict of src [Q, S], limit [Q], key [Q, 2], source [Q] (ids), width [Q], count
  (how many entries are real) and taken (how many were taken before). Returns (state,
  queue with `taken` updated, out: the results of the sentences that finished and whose
  slots were refilled, with their source ids, and how many; the results of the slots;
  steps: the loop's steps and busy slot-steps).
  """
  model, ops = decoding_model(cfg), kernels.get(cfg.kernels)
  slots, k = state["limit"].shape[0], _beam(strategy)
  ring = state["carry"]["state"][0]["k"].shape[2]
  out_len = state["carry"]["alive_seq" if isinstance(strategy, Beam) else "seq"].shape[-1] - 1
  if ops.decode_head is None:
    head = lambda y_NxD: model.apply(params, y_NxD, method=Transformer.output_head)
  else:
    head = ops.decode_head(head_w, head_b, False, cfg.dtype)

  def insert(st, out, q):
    """Copies out the results of `refill` free slots (those that held a sentence), then
    encodes the next `refill` queued sources into them (fewer at the queue's end)."""
    slot_R = jnp.nonzero(st["carry"]["done"], size=refill, fill_value=slots)[0]
    take_R = q["taken"] + jnp.arange(refill)
    real_R = take_R < q["count"]
    # Results of finished sentences, appended to `out` (a free slot that held none: -1).
    rows = jax.tree_util.tree_map(lambda x: jnp.take(x, slot_R, axis=0, mode="clip"),
                                  {n: x for n, x in st["carry"].items() if n != "state"})
    res = _results(strategy, rows, pad_id)
    held_R = (slot_R < slots) & (jnp.take(st["source"], slot_R, mode="fill",
                                          fill_value=-1) >= 0)
    at_R = jnp.where(held_R, out["count"] + jnp.cumsum(held_R) - 1, out["source"].shape[0])
    out = dict(tokens=out["tokens"].at[at_R].set(res.tokens, mode="drop"),
               scores=out["scores"].at[at_R].set(res.scores, mode="drop"),
               lengths=out["lengths"].at[at_R].set(res.lengths, mode="drop"),
               source=out["source"].at[at_R].set(st["source"][slot_R], mode="drop"),
               count=out["count"] + jnp.sum(held_R))
    # The queued sources, into the slots (filler rows and unfilled slots: dropped).
    into_R = jnp.where(real_R, slot_R, slots)
    src_RxS = jnp.take(q["src"], take_R, axis=0, mode="clip")
    encoded = model.apply(params, src_RxS, method=Transformer.encode)
    cross = model.apply(params, encoded, method=Transformer.precompute_cross_kv)

    def put(x, new, where=into_R):
      return x.at[where].set(new.astype(x.dtype), mode="drop")

    fresh = _fresh_carry(strategy, (), refill, out_len, bos_id=bos_id, pad_id=pad_id)
    carry = {n: x if n == "state" else put(x, fresh[n]) for n, x in st["carry"].items()}
    pick = lambda x: jnp.take(x, take_R, axis=0, mode="clip")
    put_kv = lambda x, new: put(x, ops.cache_store(new, x.dtype))   # as the slots keep them
    st = dict(st, carry=carry, cross_kv=jax.tree_util.tree_map(put_kv, st["cross_kv"], cross),
              src_valid=put(st["src_valid"], src_RxS != pad_id),
              limit=put(st["limit"], pick(q["limit"])), key=put(st["key"], pick(q["key"])),
              width=put(st["width"], pick(q["width"])),
              # Harvested slots left unfilled hold nothing any more.
              source=put(put(st["source"], jnp.full((refill,), -1, jnp.int32), slot_R),
                         pick(q["source"])))
    return st, out, dict(q, taken=q["taken"] + jnp.sum(real_R))

  def must_fill(c):
    st, _, q = c
    waiting = q["count"] - q["taken"]
    return (waiting > 0) & (jnp.sum(st["carry"]["done"]) >= jnp.minimum(refill, waiting))

  def step(st):
    """One search step of every slot. The self-attention cache is a ring
    (`Transformer.decode_step`'s `column`): every row writes the same column, so the write
    is one in-place slice, whatever the rows' positions."""
    cross_kv, src_valid = st["cross_kv"], st["src_valid"]
    common = dict(limits_B=st["limit"], eos_id=eos_id, pad_id=pad_id, min_len=min_len)
    keys, column = jax.random.wrap_key_data(st["key"]), st["column"]

    def tokens_to_logits(seq_NxL1, i_B, cache):
      i_N = i_B if k == 1 else jnp.repeat(i_B, k)
      tokens_Nx1 = jnp.take_along_axis(seq_NxL1, i_N[:, None], axis=1)
      y_Nx1xD, cache = model.apply(params, tokens_Nx1, i_N, cache, cross_kv, src_valid,
                                   True, column, method=Transformer.decode_step)
      return head(y_Nx1xD[:, 0]), cache
    if isinstance(strategy, Beam):
      carry = beam_step(tokens_to_logits, st["carry"], beam=strategy,
                        top_k_logsumexp=ops.top_k_logsumexp, **common)
    else:
      carry = sample_step(tokens_to_logits, st["carry"], strategy=strategy, rng=keys,
                          top_k=ops.top_k, argmax=ops.argmax, **common)
    return dict(st, carry=carry, column=(column + 1) % ring)

  def finished(c):
    st, _, q, _ = c
    done = st["carry"]["done"]
    drained = (q["taken"] >= q["count"]) & (jnp.sum(done) >= stop_free)
    busy_width = jnp.max(jnp.where(done, 0, st["width"]))
    out = drained | ((narrow_to > 0) & (busy_width <= narrow_to))
    if ring < out_len:   # a busy slot would outgrow the ring: the host widens it
      out |= jnp.max(jnp.where(done, 0, st["carry"]["i"])) > ring - 1
    return out

  def body(c):
    st, out, q, steps = c
    st, out, q = lax.while_loop(must_fill, lambda c: insert(*c), (st, out, q))
    busy = jnp.sum(~st["carry"]["done"], dtype=jnp.int32)
    return step(st), out, q, dict(steps=steps["steps"] + 1, busy=steps["busy"] + busy)

  size, n_best = queue["src"].shape[0] + refill, getattr(strategy, "n_best", 1)
  out = dict(tokens=jnp.zeros((size, n_best, out_len), jnp.int32),
             scores=jnp.zeros((size, n_best), jnp.float32),
             lengths=jnp.zeros((size, n_best), jnp.int32),
             source=jnp.full((size,), -1, jnp.int32), count=jnp.int32(0))
  steps = dict(steps=jnp.int32(0), busy=jnp.int32(0))    # loop steps; busy slot-steps
  state, out, queue, steps = lax.while_loop(lambda c: ~finished(c), body,
                                            (state, out, queue, steps))
  # The sentences that finished but still sit in their slots.
  return state, queue, out, _results(strategy, state["carry"], pad_id), steps


@functools.cache
def _jitted_loop(options: tuple = ()):
  return jax.jit(_loop_impl, compiler_options=dict(options) or None,
                 donate_argnames=("state",),
                 static_argnames=("cfg", "strategy", "refill", "bos_id", "eos_id", "pad_id",
                                  "min_len"))


RING_ROOM = 32   # the cache ring holds source width + RING_ROOM tokens (see ring_for)


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def decode_stream(cfg: TransformerConfig, params, sources: Sequence[Sequence[int]],
                  strategy: Strategy = Greedy(), *, bos_id: int, eos_id: int,
                  pad_id: int = 0, slots: int = 64, refill: int | None = None,
                  queue: int | None = None, max_len: int | None = None, rng=None,
                  min_len: int = 0, length_multiple: int = 16,
                  progress: Callable[[int], object] | None = None,
                  stats: StreamStats | None = None) -> list[tuple]:
  """Decodes every source (a list of ids, EOS-terminated, at most config.max_len long).
  Returns, in the order of `sources`, (tokens, scores, lengths) per source: numpy arrays of
  shape [n, L], [n], [n] as `DecodeResult` has them per row (n = 1, or n_best for beam).

  params: the parameters as `decoding.decode_params` makes them (or the raw ones).
  slots: sentences decoded together (fewer if there are fewer sources: a power of two).
  refill: free slots filled at a time (default slots / 16, at least 1): each fill encodes
    that many sources together; smaller leaves fewer slots waiting.
  queue: sources handed to the loop at a time (default 2 × slots): the loop returns to the
    host when they are used up (and to narrow the slots' source width).
  max_len: every sentence's length limit; None = its source length + 50 (decode's default).
  rng: sampling key or seed (None = 0); sentence j draws from fold_in(rng, j).
  length_multiple: source widths are rounded up to it (one compile per width).
  progress: called with the number of sentences finished at each return to the host (0
    where none did).
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
  queue = 2 * slots if queue is None else max(1, int(queue))
  stats = StreamStats() if stats is None else stats
  ops = kernels.get(cfg.kernels)
  loop = _jitted_loop(tuple(sorted(ops.decode_compiler_options(cfg).items())))
  params = decode_params(cfg, params if "params" in params else {"params": params})
  w, head_b, w_is_VxD = head_weights(cfg, params["params"])
  head_w = (w.T if w_is_VxD else w).astype(cfg.dtype) if ops.decode_head else None
  keys = np.zeros((n, 2), np.uint32)
  if isinstance(strategy, Sample):
    keys = np.asarray(jax.random.key_data(jax.vmap(jax.random.fold_in, (None, 0))(
        as_key(rng), jnp.arange(n, dtype=jnp.uint32))))

  def width(j: int) -> int:
    return min(_round_up(lengths[j], length_multiple), cfg.max_len)

  def out_len(w: int) -> int:
    return max_len if max_len is not None else min(w + EXTRA_LEN, cfg.max_len)

  def ring_for(step: int, w: int) -> int:
    """Cache columns for sources of width w whose busy slots have reached `step`: room for
    RING_ROOM tokens more than the width (translations seldom run longer), or the whole
    output length once a slot needs it; so mostly one compile per width. Beam search keeps
    alive hypotheses well past the length of the one it returns: the whole length."""
    ring = min(_round_up(w + RING_ROOM, 16), out_len(w))
    return ring if step + 2 <= ring and not isinstance(strategy, Beam) else out_len(w)

  # The state lives where the parameters do, committed there like the loop's outputs:
  # a call with an uncommitted state would compile the loop a second time.
  leaf = jax.tree_util.tree_leaves(params)[0]
  place = (functools.partial(jax.device_put, device=leaf.sharding)
           if isinstance(getattr(leaf, "sharding", None), jax.sharding.SingleDeviceSharding)
           else lambda st: st)
  order = sorted(range(n), key=lambda j: -lengths[j])     # longest first (stable)
  cur_w = width(order[0])
  ring = out_len(cur_w)   # the longest sources come first: the likeliest to run long
  state = place(_empty_state(cfg, strategy, slots, cur_w, out_len(cur_w), ring,
                             bos_id=bos_id, pad_id=pad_id))
  busy = np.zeros(slots, bool)      # slots holding a sentence, as of the last return
  nxt = 0
  while nxt < n or busy.any():
    # The next sources of one width, padded to the slots' width.
    w_q = width(order[nxt]) if nxt < n else cur_w
    take = [j for j in order[nxt:nxt + queue] if width(j) == w_q]
    q = dict(src=np.zeros((queue, cur_w), np.int32), limit=np.zeros(queue, np.int32),
             key=np.zeros((queue, 2), np.uint32), source=np.full(queue, -1, np.int32),
             width=np.full(queue, w_q, np.int32), count=np.int32(len(take)),
             taken=np.int32(0))
    q["src"][:, 0] = eos_id                               # filler rows: an empty source
    for r, j in enumerate(take):
      q["src"][r, :lengths[j]] = sources[j]
      q["src"][r, lengths[j]:] = pad_id
      q["limit"][r] = max_len if max_len is not None else min(lengths[j] + EXTRA_LEN,
                                                             out_len(w_q))
      q["key"][r], q["source"][r] = keys[j], j
    more = nxt + len(take) < n
    state, q_left, out, res, steps = loop(
        params, head_w, head_b, state, q, refill if more else slots,
        w_q if w_q < cur_w else 0, cfg=cfg, strategy=strategy, refill=refill,
        bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, min_len=min_len)
    out, res, taken, source, done, step, steps = jax.device_get(
        (out, res, q_left["taken"], state["source"], state["carry"]["done"],
         state["carry"]["i"], steps))
    nxt += int(taken)
    # Results: those copied out by the loop, then those still in their slots.
    ids = [(int(out["source"][r]), (out["tokens"][r], out["scores"][r], out["lengths"][r]))
           for r in range(int(out["count"]))]
    ended = np.flatnonzero(done & (source >= 0))
    ids += [(int(source[s]), (res.tokens[s], res.scores[s], res.lengths[s])) for s in ended]
    for j, r in ids:
      results[j] = r
      stats.tokens += int(r[2][0])
    stats.runs += 1
    stats.steps += int(steps["steps"])
    stats.slot_steps += int(steps["steps"]) * slots
    stats.busy_slot_steps += int(steps["busy"])
    if progress is not None:
      progress(len(ids))
    busy = ~done & (source >= 0)
    state = dict(state, source=jnp.where(busy, state["source"], -1))
    # Narrower once no busy slot (nor the next source) needs the width.
    # A ring as long as the busy slots need.
    need = max([width(int(j)) for j in source[busy]] + [width(order[nxt]) if nxt < n else 1])
    want = ring_for(int(step[busy].max(initial=0)), min(need, cur_w))
    if (need < cur_w or want > ring) and (nxt < n or busy.any()):
      cur_w, ring = min(need, cur_w), want
      state = place(_resize_jit(state, cur_w, out_len(cur_w), ring, pad_id))
  return results
