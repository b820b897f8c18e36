"""Search on hand-built distributions (no Transformer): beam search against brute force,
sampling filters against NumPy, strategies as validated data."""
import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seq2seq import decoding, search
from seq2seq.errors import UserError
from seq2seq.search import Beam, Greedy, Sample

PAD, BOS = 0, 1


# ---------------------------------------------------------------------------------------
# Strategies are validated data.

@pytest.mark.parametrize("make, msg", [
    (lambda: Sample(temperature=0.0), "temperature must be > 0"),
    (lambda: Sample(temperature=-1.0), "temperature must be > 0"),
    (lambda: Sample(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (lambda: Sample(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (lambda: Sample(top_k=-1), "top_k must be"),
    (lambda: Sample(top_k=2.5), "top_k must be"),
    (lambda: Beam(size=0), "beam size"),
    (lambda: Beam(alpha=-0.5), "alpha"),
    (lambda: Beam(size=2, n_best=3), "n_best"),
    (lambda: search.get_strategy("beam", top_k=5), "top_k cannot be used with beam"),
    (lambda: search.get_strategy("beam", temperature=0.5), "temperature cannot be used with beam"),
    (lambda: search.get_strategy("greedy", top_p=0.9), "top_p cannot be used with greedy"),
    (lambda: search.get_strategy("sample", temperature=0), "temperature must be > 0"),
    (lambda: search.get_strategy("sample", beam_size=4), "beam_size cannot be used with sample"),
    (lambda: search.get_strategy("nucleus"), "unknown decoding strategy"),
])
def test_bad_strategies_raise_one_line_user_errors(make, msg):
  with pytest.raises(UserError, match=msg) as e:
    make()
  assert "\n" not in str(e.value)


def test_get_strategy_builds_the_dataclasses():
  assert search.get_strategy("greedy") == Greedy()
  assert search.get_strategy("sample", top_k=40, temperature=0.8) == Sample(0.8, 40, 1.0)
  assert search.get_strategy("beam", beam_size=5, alpha=1.0, n_best=2) == Beam(5, 1.0, 2)
  assert search.get_strategy("beam") == Beam(size=4, alpha=0.6, n_best=1)
  with pytest.raises(dataclasses.FrozenInstanceError):
    Beam().size = 3




# ---------------------------------------------------------------------------------------
# Search cores on hand-built distributions (no Transformer).

def _table_fn(logp_of_prefix):
  """tokens_to_logits from a Python function prefix (tuple) -> next-token log-probs.

  Every prefix of length < 4 over the 6 ids is precomputed into a table indexed by a
  prefix code, sum of (token + 1) * 7^position, that is kept in the state and extended by
  one token per step, like a KV cache: it is right only if the state follows the beams."""
  vocab, base, depth = 6, 7, 4
  table = np.full((base ** depth, vocab), -1e9, np.float32)
  for n in range(depth):
    for prefix in itertools.product(range(vocab), repeat=n):
      table[sum((t + 1) * base ** i for i, t in enumerate(prefix))] = logp_of_prefix(prefix)
  table = jnp.asarray(table)

  def fn(seq_NxL1, index, code_N):
    tok = lax_index(seq_NxL1, index)
    # Position 0 holds BOS, which is not part of the prefix.
    code_N = jnp.where(index == 0, 0, code_N + (tok + 1) * base ** jnp.maximum(index - 1, 0))
    return table[code_N], code_N

  return fn


def lax_index(seq, index):
  return jax.lax.dynamic_index_in_dim(seq, index, axis=1, keepdims=False)


def _logp(d, default=-1e9):
  out = np.full(6, default, np.float32)
  for tok, p in d.items():
    out[tok] = np.log(p)
  return out


EOS, A, B_, C = 2, 3, 4, 5


def _run_beam(fn, beam, max_len, limits, batch=1, min_len=0, state=None):
  @jax.jit
  def go():
    if state is None:
      init = jnp.zeros((batch * beam.size,), jnp.int32)
    else:
      init = jnp.repeat(state, beam.size, axis=0)
    return search.beam_search(fn, init, batch_size=batch, beam=beam, max_len=max_len,
                              limits_B=jnp.asarray(limits), bos_id=BOS, eos_id=EOS,
                              pad_id=PAD, min_len=min_len)
  return jax.tree_util.tree_map(np.asarray, go())


def _run_greedy(fn, max_len, batch=1, strategy=Greedy(), state=None):
  @jax.jit
  def go():
    return search.sample_search(fn, jnp.zeros((batch,), jnp.int32) if state is None else state,
                                batch_size=batch, strategy=strategy, max_len=max_len,
                                limits_B=jnp.full((batch,), max_len), bos_id=BOS, eos_id=EOS,
                                pad_id=PAD, rng=jax.random.key(3))
  return jax.tree_util.tree_map(np.asarray, go())


def _random_lm(vocab=12, scale=3.0):
  """A random "language model" of unbounded depth: the state is a hash of the row's start
  value and of every token fed so far, and the logits are a hash of it and the token id."""
  def mix(x):
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)

  def fn(seq_NxL1, index, hash_N):
    hash_N = mix(hash_N + lax_index(seq_NxL1, index).astype(jnp.uint32) + jnp.uint32(1))
    bits = mix(hash_N[:, None] * jnp.uint32(vocab) + jnp.arange(vocab, dtype=jnp.uint32))
    return scale * (bits >> 8).astype(jnp.float32) / 2.0 ** 24, hash_N
  return fn


def test_cache_phases_grow_to_max_len():
  for max_len in range(1, 321):
    ends = search.cache_phases(max_len)
    assert ends[-1] == max_len and len(ends) <= 3 and ends == sorted(set(ends)), ends
    for end in ends[:-1]:   # inner ends: even (beam search takes 2 steps per iteration)
      assert end % 8 == 0 and 16 <= end <= 0.75 * max_len, ends
    if max_len >= 64:       # the first phase covers at most a quarter of the steps (+7)
      assert ends[0] <= max_len / 4 + 8, ends
  assert search.cache_phases(64) == [16, 32, 64] and search.cache_phases(20) == [20]


def _cache_lm(vocab=12):
  """A toy model with a KV-like cache [N, 1, slots, 1]: step i writes the fed token to slot
  i and its logits hash every slot <= i (integer sums, exact whatever the cache's length),
  so a lost write, a slot read past the cache, or a beam that kept another's cache shows."""
  seen = []

  def mix(x):
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    return x ^ (x >> 15)

  def fn(seq_NxL1, index, cache_Nx1xSx1):
    seen.append(cache_Nx1xSx1.shape[2])
    tok_N = lax_index(seq_NxL1, index).astype(jnp.uint32)
    cache = jax.lax.dynamic_update_slice(cache_Nx1xSx1, tok_N[:, None, None, None], (0, 0, index, 0))
    pos = jnp.arange(cache.shape[2], dtype=jnp.uint32)
    h_N = jnp.sum(jnp.where(pos <= index, mix(cache[:, 0, :, 0] + 7 * pos), 0), -1)
    bits = mix(h_N[:, None] * jnp.uint32(vocab) + jnp.arange(vocab, dtype=jnp.uint32))
    return 3.0 * (bits >> 8).astype(jnp.float32) / 2.0 ** 24, cache
  return fn, seen


@pytest.mark.parametrize("strategy", [Greedy(), Beam(size=3, alpha=0.6, n_best=3)])
def test_phased_loop_equals_one_loop_over_the_whole_cache(strategy):
  """The loop in phases over a growing cache (16, 32, 64 slots) decodes exactly as one loop
  over all 64 slots, for greedy and for beam search (whose cache moves with its beams)."""
  L, rows = 64, 2
  n = rows * getattr(strategy, "size", 1)
  outs, traced = [], []
  for resize in (None, decoding.resize_cache):
    fn, seen = _cache_lm()
    kw = dict(batch_size=rows, max_len=L, limits_B=jnp.full((rows,), L), bos_id=BOS,
              eos_id=EOS, pad_id=PAD, min_len=L, resize_state=resize)
    cache = jnp.zeros((n, 1, L, 1), jnp.uint32)
    if isinstance(strategy, Beam):
      run = jax.jit(lambda: search.beam_search(fn, cache, beam=strategy, **kw))
    else:
      run = jax.jit(lambda: search.sample_search(fn, cache, strategy=strategy, **kw))
    outs.append(jax.tree_util.tree_map(np.asarray, run()))
    traced.append(sorted(set(seen)))
  assert traced == [[64], [16, 32, 64]]
  np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
  np.testing.assert_array_equal(outs[0].scores, outs[1].scores)
  assert (outs[1].lengths == L).all() and len(np.unique(outs[1].tokens)) > 3


def test_top_k_one_tiny_top_p_and_beam_of_one_are_greedy():
  fn, rows, L = _random_lm(vocab=1200), 8, 16     # a vocabulary long enough for top_k's chunks
  start = jnp.arange(1, rows + 1, dtype=jnp.uint32)
  greedy = _run_greedy(fn, L, rows, state=start)
  assert len(set(greedy.lengths[:, 0].tolist())) > 1          # EOS ends some rows early
  for strategy in (Sample(temperature=0.7, top_k=1), Sample(temperature=1.5, top_p=1e-6)):
    out = _run_greedy(fn, L, rows, strategy, state=start)
    np.testing.assert_array_equal(out.tokens, greedy.tokens)
    np.testing.assert_allclose(out.scores, greedy.scores, atol=1e-5)
  out = _run_beam(fn, Beam(size=1, alpha=0.0), L, [L] * rows, batch=rows, state=start)
  np.testing.assert_array_equal(out.tokens, greedy.tokens)
  np.testing.assert_array_equal(out.lengths, greedy.lengths)
  np.testing.assert_allclose(out.scores, greedy.scores, atol=1e-5)


def test_sampling_is_reproducible_at_a_fixed_seed():
  fn, rows, L = _random_lm(), 8, 16
  run = jax.jit(lambda rng: search.sample_search(
      fn, jnp.arange(1, rows + 1, dtype=jnp.uint32), batch_size=rows,
      strategy=Sample(temperature=1.0, top_p=0.95), max_len=L,
      limits_B=jnp.full((rows,), L), bos_id=BOS, eos_id=EOS, pad_id=PAD, rng=rng))
  a, b, c = run(jax.random.key(7)), run(jax.random.key(7)), run(jax.random.key(8))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.scores, b.scores)
  assert not np.array_equal(a.tokens, c.tokens)
  # decode() takes an int seed, a key or raw key data alike.
  for rng in (7, jax.random.key(7), jax.random.PRNGKey(7)):
    assert jax.random.key_data(decoding.as_key(rng)).tolist() == [0, 7]


def test_beam_finds_the_best_sequence_that_greedy_misses():
  # Greedy takes A (0.6), after which everything is poor; B then EOS has p = 0.36.
  def logp(prefix):
    if prefix == ():
      return _logp({A: 0.6, B_: 0.4})
    if prefix[0] == A:
      return _logp({EOS: 0.3, A: 0.25, B_: 0.25, C: 0.2})
    return _logp({EOS: 0.9, C: 0.1})
  fn = _table_fn(logp)
  greedy = _run_greedy(fn, 4)
  assert greedy.tokens[0, 0, 0] == A
  out = _run_beam(fn, Beam(size=2, alpha=0.0, n_best=2), 4, [4])
  np.testing.assert_array_equal(out.tokens[0, 0], [B_, EOS, PAD, PAD])
  assert out.lengths[0, 0] == 2
  assert out.scores[0, 0] == pytest.approx(math.log(0.36), abs=1e-5)
  # Second best: the best of the A-branch, A then EOS (0.18), which greedy returns.
  assert out.scores[0, 1] == pytest.approx(math.log(0.18), abs=1e-5)
  np.testing.assert_array_equal(greedy.tokens[0, 0, :2], [A, EOS])
  assert out.tokens[0, 1, 1] == EOS and out.lengths[0, 1] == 2


@pytest.mark.parametrize("case", ["exact_outlasts_both", "only_count_stops_early"])
def test_beam_stop_rules(case):
  """"exact" runs on while an alive hypothesis could still win; "best" stops when the step's
  best extension ends with EOS; "count" once `size` hypotheses have ended."""
  if case == "exact_outlasts_both":
    # EOS is the best first step (0.5); A A EOS (0.44) wins under the length penalty.
    table = {(): {EOS: 0.5, A: 0.45, B_: 0.05}, (A,): {A: 0.98, EOS: 0.01, B_: 0.01},
             (A, A): {EOS: 0.99, A: 0.01}, (B_,): {EOS: 0.99, A: 0.01}}
    alpha, want = 2.0, {"exact": [A, A, EOS], "best": [EOS], "count": [EOS]}
  else:
    # After step 2, EOS and B EOS have ended (count stops), but A A leads: A A EOS (0.45).
    table = {(): {A: 0.5, EOS: 0.3, B_: 0.2}, (A,): {A: 0.9, EOS: 0.1},
             (A, A): {EOS: 1.0}, (B_,): {EOS: 0.9, A: 0.1}}
    alpha, want = 0.0, {"exact": [A, A, EOS], "best": [A, A, EOS], "count": [EOS]}
  fn = _table_fn(lambda prefix: _logp(table.get(prefix, {EOS: 1.0})))
  for stop, tokens in want.items():
    out = _run_beam(fn, Beam(size=2, alpha=alpha, stop=stop), 4, [4])
    assert out.tokens[0, 0, :out.lengths[0, 0]].tolist() == tokens, stop
    p = np.prod([table[tuple(tokens[:i])][t] for i, t in enumerate(tokens)])
    assert out.scores[0, 0] == pytest.approx(
        math.log(p) / ((5 + len(tokens)) / 6) ** alpha, abs=1e-5)


V_EAGER = 12


def eager_ends_logp(limit: int = 8):
  """Next-token log-probs [limit + 1, V_EAGER, V_EAGER] by step and last token (BOS at step
  0) of a peaked model: the likely hypothesis, A x 5 then EOS (p 0.95), is still growing
  while unlikely ones end. A takes p 0.99, leaving the other beams to B, C and EOS, and
  after B or C, EOS is likely; at the first step EOS (p 0.0008) ranks 4th, an empty
  hypothesis. Every other token has p 1e-7."""
  p = np.full((limit + 1, V_EAGER, V_EAGER), 1e-7)
  p[:, :, PAD] = 1e-30
  p[:, :, EOS], p[:, :, A] = 0.9, 0.05                  # after B or C
  p[:, A, EOS], p[:, A, A] = 0.99, 0.005                # after the fifth A
  for i in range(1, 5):
    p[i, A, [A, B_, C, EOS]] = 0.99, 0.004, 0.003, 0.003
  p[0, BOS, [A, B_, C, EOS]] = 0.9968, 0.0012, 0.0012, 0.0008
  return np.log(p / p.sum(-1, keepdims=True))


def eager_ends_best(logp, alpha: float):
  """(score, tokens) of the best hypothesis under `logp` (eager_ends_logp), by brute force
  over EOS, A, B and C: a hypothesis with any other token (p 1e-7) scores below -10."""
  limit = logp.shape[0] - 1
  (score, seq), = _brute_force_nbest(
      lambda prefix: logp[len(prefix), ((BOS,) + prefix)[-1]], limit, alpha, 1)
  assert score > math.log(1e-7) / ((5 + limit) / 6) ** alpha
  return score, list(seq)


def test_default_beam_outlasts_unlikely_early_ends():
  """While the likely hypothesis grows, unlikely ones end (eager_ends_logp): "count" stops
  once 4 have ended (the empty one among them) and returns one of those; the default stop
  rule returns the best hypothesis, as brute force finds it."""
  logp = eager_ends_logp()
  L, table = logp.shape[0] - 1, jnp.asarray(logp, jnp.float32)
  fn = lambda seq_NxL1, i, state: (table[i, lax_index(seq_NxL1, i)], state)
  score, want = eager_ends_best(logp, Beam().alpha)
  assert want == [A] * 5 + [EOS]
  out = _run_beam(fn, Beam(), L, [L])
  assert out.tokens[0, 0, :out.lengths[0, 0]].tolist() == want
  assert out.scores[0, 0] == pytest.approx(score, abs=1e-5)
  ends = _run_beam(fn, Beam(n_best=4, stop="count"), L, [L])
  ended = [ends.tokens[0, k, :ends.lengths[0, k]].tolist() for k in range(4)]
  assert [EOS] in ended and max(map(len, ended)) <= 3, ended   # 4 ended by the third step
  count = _run_beam(fn, Beam(stop="count"), L, [L])
  assert count.tokens[0, 0, :count.lengths[0, 0]].tolist() == ended[0] != want
  assert count.scores[0, 0] < score - 4


@pytest.mark.slow   # compiles a sampling loop per row (~13 s)
def test_per_row_steps_draw_from_their_own_keys():
  """`sample_step` with a step per row (the decode slots) and a key per row: each row's draw
  is fold_in(its key, its step); rows follow the filtered distribution."""
  strategy = Sample(temperature=2.0, top_k=4, top_p=0.8)
  logits = jnp.log(jnp.maximum(jnp.asarray(PROBS, jnp.float32), 1e-30))
  fn = lambda seq, i, s: (jnp.broadcast_to(logits, (seq.shape[0], 6)), s)
  n = 20000
  keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(0), jnp.arange(n))
  i = jnp.arange(n, dtype=jnp.int32) % 3                   # rows at steps 0, 1, 2
  carry = dict(search.sample_carry((), n, 4, bos_id=BOS, pad_id=PAD), i=i)
  out = jax.jit(lambda c: search.sample_step(
      fn, c, strategy=strategy, limits_B=jnp.full((n,), 4), eos_id=EOS, pad_id=PAD,
      rng=keys))(carry)
  tok = np.asarray(out["seq"])[np.arange(n), np.asarray(i) + 1]
  got = np.bincount(tok, minlength=6) / n
  np.testing.assert_allclose(got, _np_filter(PROBS, 2.0, 4, 0.8), atol=0.015)
  np.testing.assert_array_equal(out["i"], i + 1)
  # Row 5's draw is its own key's at its step, whatever the other rows are.
  x = search.filter_logits(logits[None], strategy)
  one = jax.random.categorical(jax.random.fold_in(keys[5], i[5]), x[0])
  assert tok[5] == int(one)


def test_length_penalty_decides_between_short_and_long():
  # "EOS" now: p 0.55, length 1. "A EOS": p 0.45 * 0.95 = 0.4275, length 2.
  def logp(prefix):
    if prefix == ():
      return _logp({EOS: 0.55, A: 0.45})
    return _logp({EOS: 0.95, A: 0.05})
  fn = _table_fn(logp)
  lp = lambda n, a: ((5 + n) / 6) ** a
  for alpha, want, size in ((0.0, [EOS], 1), (0.6, [EOS], 2), (3.0, [A, EOS], 1)):
    assert (math.log(0.55) / lp(1, alpha) > math.log(0.4275) / lp(2, alpha)) == (want == [EOS])
    # With alpha 3 even a beam of one goes on past its EOS: a longer one may still win.
    out = _run_beam(fn, Beam(size=size, alpha=alpha), 4, [4])
    n = len(want)
    np.testing.assert_array_equal(out.tokens[0, 0, :n], want)
    assert out.lengths[0, 0] == n and (out.tokens[0, 0, n:] == PAD).all()
    p = 0.55 if n == 1 else 0.4275
    assert out.scores[0, 0] == pytest.approx(math.log(p) / lp(n, alpha), abs=1e-5)
  # Greedy stops at the first EOS whatever the penalty.
  np.testing.assert_array_equal(_run_greedy(fn, 4).tokens[0, 0, :2], [EOS, PAD])


def _random_logp(seed):
  """Random next-token log-probs over {EOS, A, B, C} (PAD and BOS impossible)."""
  rng = np.random.default_rng(seed)
  cache = {}

  def logp(prefix):
    if prefix not in cache:
      x = np.full(6, -np.inf)
      x[[EOS, A, B_, C]] = rng.normal(size=4) * 1.5
      cache[prefix] = (x - np.log(np.exp(x - x.max()).sum()) - x.max()).astype(np.float32)
    return cache[prefix]
  return logp


def _brute_force_nbest(logp, limit, alpha, n):
  """Every sequence over {EOS, A, B, C} of length <= limit ending with (only) EOS."""
  hyps = []
  for length in range(1, limit + 1):
    for body in itertools.product([A, B_, C], repeat=length - 1):
      seq = body + (EOS,)
      total = sum(float(logp(seq[:t])[seq[t]]) for t in range(length))
      hyps.append((total / ((5 + length) / 6) ** alpha, seq))
  hyps.sort(key=lambda h: -h[0])
  return hyps[:n]


@pytest.mark.parametrize("alpha", [0.0, 0.6, 3.0])
@pytest.mark.parametrize("max_len, limits", [(4, (4, 2)), (3, (3, 1))])
def test_wide_beam_equals_brute_force_nbest(alpha, max_len, limits):
  """With more beams than extensions (3^3 prefixes x 4 tokens at the last step), beam
  search is exhaustive, so its n-best list must be the brute-force one. Two rows with
  different length limits check per-row limits; the table is read through a prefix code
  kept in the state, so the state must follow the beams' reordering. An odd max_len ends
  the loop (two steps per iteration) with a step past the end."""
  logp = _random_logp(0)
  fn = _table_fn(logp)          # draws every prefix's distribution once, in a fixed order
  out = _run_beam(fn, Beam(size=128, alpha=alpha, n_best=5), max_len, list(limits), batch=2)
  for row, limit in enumerate(limits):
    want = _brute_force_nbest(logp, limit, alpha, 5)
    for k, (score, seq) in enumerate(want):
      assert out.scores[row, k] == pytest.approx(score, abs=1e-4)
      assert out.lengths[row, k] == len(seq)
      np.testing.assert_array_equal(out.tokens[row, k, :len(seq)], seq)
  # The penalty changes the winner, so the test can tell the alphas apart.
  assert _brute_force_nbest(logp, 4, 0.0, 1)[0][1] != _brute_force_nbest(logp, 4, 3.0, 1)[0][1]


def test_beam_respects_min_len_and_falls_back_to_truncated_hypotheses():
  # EOS is likely everywhere, but min_len forbids it before length 3: with a limit of 3
  # every hypothesis is then exactly two non-EOS tokens and EOS.
  fn = _table_fn(lambda prefix: _logp({EOS: 0.7, A: 0.2, B_: 0.1}))
  out = _run_beam(fn, Beam(size=2, alpha=0.0, n_best=2), 4, [3], min_len=3)
  np.testing.assert_array_equal(out.lengths, [[3, 3]])
  assert (out.tokens[0, :, 2] == EOS).all() and (out.tokens[0, :, :2] != EOS).all()
  np.testing.assert_array_equal(out.tokens[0, 0], [A, A, EOS, PAD])
  # min_len beyond the limit: nothing can finish, the best hypotheses cut at the limit
  # come back (without EOS), scored with the penalty of their length.
  out = _run_beam(fn, Beam(size=2, alpha=0.6, n_best=2), 4, [3], min_len=9)
  np.testing.assert_array_equal(out.tokens[0, 0], [A, A, A, PAD])
  np.testing.assert_array_equal(out.lengths, [[3, 3]])
  assert out.scores[0, 0] == pytest.approx(3 * math.log(2 / 3) / (8 / 6) ** 0.6, abs=1e-5)
  assert out.scores[0, 1] == pytest.approx(math.log(4 / 27) / (8 / 6) ** 0.6, abs=1e-5)


PROBS = np.array([0.0, 0.05, 0.1, 0.15, 0.3, 0.4])     # PAD (id 0) is never chosen


def _np_filter(probs, temperature=1.0, top_k=0, top_p=1.0):
  """The distribution Sample(...) draws from, written out plainly."""
  p = np.where(probs > 0, probs ** (1 / temperature), 0.0)
  p /= p.sum()
  order = np.argsort(-p, kind="stable")                # ties: the lowest id first
  keep = np.zeros(len(p), bool)
  keep[order[:top_k or len(p)]] = True
  p = np.where(keep, p, 0.0) / p[keep].sum()
  mass_before = np.cumsum(p[order]) - p[order]
  keep[order[mass_before >= top_p]] = False
  return np.where(keep, p, 0.0) / p[keep].sum()


TIED = np.array([0.0, 0.1, 0.2, 0.2, 0.25, 0.25])


@pytest.mark.parametrize("probs, strategy, kept", [
    (PROBS, Sample(), [1, 2, 3, 4, 5]),
    (PROBS, Sample(top_k=2), [4, 5]),
    (PROBS, Sample(top_p=0.65), [4, 5]),            # 0.4 + 0.3 reaches 0.65
    (PROBS, Sample(top_p=0.75), [3, 4, 5]),         # 0.4 + 0.3 does not reach 0.75
    (PROBS, Sample(temperature=0.5, top_k=4, top_p=0.9), [3, 4, 5]),  # 0.57 + 0.32 < 0.9
    # ties are ranked by id
    (TIED, Sample(top_k=1), [4]),                   # greedy: the first of the tied best
    (TIED, Sample(top_k=3), [2, 4, 5]),             # exactly 3: the first of the tied 0.2s
    (TIED, Sample(top_p=0.2), [4]),                 # one 0.25 reaches 0.2
    (TIED, Sample(top_p=0.6), [2, 4, 5]),           # 0.25 + 0.25 < 0.6 <= 0.7
])
def test_filter_logits_keeps_the_top_k_and_the_nucleus(probs, strategy, kept):
  logits = jnp.log(jnp.asarray(probs[1:]))
  x = np.asarray(jax.jit(search.filter_logits, static_argnums=1)(logits[None], strategy))[0]
  np.testing.assert_array_equal(np.flatnonzero(np.isfinite(x)) + 1, kept)
  want = _np_filter(probs, strategy.temperature, strategy.top_k, strategy.top_p)
  np.testing.assert_allclose(np.exp(x - x.max()) / np.exp(x - x.max()).sum(), want[1:],
                             atol=1e-6)


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-45])
def test_a_tiny_temperature_is_greedy(temperature):
  """logits / T overflows float32 for these T (1e-38 and 1e-45 are subnormal)."""
  logits = jnp.asarray([[0.5, 2.0, 3.0, -1.0], [7.0, 1.0, 7.0, 6.5]], jnp.float32)
  x = np.asarray(search.filter_logits(logits, Sample(temperature=temperature)))
  assert not np.isnan(x).any()
  np.testing.assert_array_equal(x.argmax(-1), [2, 0])
  n = 1000
  fn = lambda seq, i, s: (jnp.broadcast_to(logits[0], (seq.shape[0], 4)), s)
  out = search.sample_search(fn, (), batch_size=n, strategy=Sample(temperature=temperature),
                          max_len=1, limits_B=jnp.ones((n,), jnp.int32), bos_id=BOS,
                          eos_id=EOS, pad_id=PAD, rng=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out.tokens[:, 0, 0]), 2)


@pytest.mark.slow   # draws thousands of samples per filter
def test_sampling_follows_the_filtered_distribution():
  """Temperature 2, top-k 4, top-p 0.8: empirical frequencies of 20,000 draws."""
  strategy = Sample(temperature=2.0, top_k=4, top_p=0.8)
  logits = jnp.log(jnp.maximum(jnp.asarray(PROBS, jnp.float32), 1e-30))
  fn = lambda seq, i, s: (jnp.broadcast_to(logits, (seq.shape[0], 6)), s)
  n = 20000
  out = jax.jit(lambda rng: search.sample_search(
      fn, (), batch_size=n, strategy=strategy, max_len=1, limits_B=jnp.ones((n,), jnp.int32),
      bos_id=BOS, eos_id=EOS, pad_id=PAD, rng=rng))(jax.random.key(0))
  got = np.bincount(np.asarray(out.tokens[:, 0, 0]), minlength=6) / n
  want = _np_filter(PROBS, 2.0, 4, 0.8)
  assert (want > 0).sum() == 3                  # both filters bite
  np.testing.assert_allclose(got, want, atol=0.015)
