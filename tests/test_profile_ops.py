"""bench/profile_ops.py: a real jitted function, traced with jax.profiler, is summed per op
and attributed to the code that produced each op."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import profile_ops  # noqa: E402


def test_location_merges_layers_and_marks_backward():
  fwd = "jit(step)/jvp(Transformer)/decoder/layers_3/ffn/wi/dot_general"
  bwd = "jit(step)/transpose(jvp(Transformer))/encoder/layers_0/self_attn/out/dot_general"
  assert profile_ops.location(fwd) == "decoder/layers_*/ffn/wi/dot_general"
  assert profile_ops.location(bwd) == "bwd encoder/layers_*/self_attn/out/dot_general"


def test_wall_shares_split_overlaps_between_running_ops():
  # Hand case: A runs alone 0-2, with B 2-4 (each half), B alone 4-5; C is instantaneous.
  shares, busy = profile_ops.wall_shares([(0, 4), (2, 5), (3, 3)])
  assert shares == [3.0, 2.0, 0.0] and busy == 5.0
  # Random spans against a naive count on a fine grid of integer time points.
  rng = np.random.default_rng(0)
  starts = rng.integers(0, 200, 40)
  spans = [(int(s), int(s + d)) for s, d in zip(starts, rng.integers(0, 30, 40))]
  shares, busy = profile_ops.wall_shares(spans)
  naive, covered = np.zeros(len(spans)), 0
  for t in range(0, 240):
    on = [i for i, (s, e) in enumerate(spans) if s <= t < e]
    covered += bool(on)
    for i in on:
      naive[i] += 1 / len(on)
  np.testing.assert_allclose(shares, naive, atol=1e-9)
  assert busy == covered and abs(sum(shares) - busy) < 1e-9


@pytest.mark.slow   # profiles a benchmark's train step
def test_summary_attributes_traced_ops_to_source(tmp_path):
  def ffn(x, w1, w2):
    return jnp.maximum(x @ w1, 0.0) @ w2

  def loss(w1, x, w2):
    return ffn(x, w1, w2).sum()

  step = jax.jit(jax.grad(loss))
  x, w1, w2 = jnp.ones((128, 64)), jnp.ones((64, 256)), jnp.ones((256, 64))
  index = profile_ops.hlo_index(step.lower(w1, x, w2).compile().as_text())
  # Every op of the compiled module is indexed with its source (grad of a 2-matmul FFN:
  # forward matmuls plus at least one backward one).
  dots = [v for v in index.values() if v[1] in ("dot", "fusion") and "dot_general" in v[2]]
  assert len(dots) >= 3, index
  assert any(profile_ops.location(v[2]).startswith("bwd ") for v in dots), dots
  step(w1, x, w2).block_until_ready()
  iters = 3
  path, wall = profile_ops._trace(lambda: step(w1, x, w2).block_until_ready(), iters,
                                   str(tmp_path))
  text = profile_ops.summarize(path, index, iters, wall, top=10)
  assert "no op events" not in text, text
  by_loc = text.split("by source location")[1].split("by op kind")[0]
  assert "loss/dot_general" in by_loc and "bwd loss/" in by_loc, text
  # Per-iteration op time cannot exceed the wall time × threads.
  ops_ms = float(text.split("ops ")[1].split(" ms/iter")[0])
  assert 0 < ops_ms <= 1e3 * wall / iters * os.cpu_count() + 1e-6, text
  # The share column of every location adds up to the busy time (up to rounding), and no
  # location's share exceeds its own op time.
  busy_ms = float(text.split("busy ")[1].split(" ms/iter")[0])
  every_loc = profile_ops.summarize(path, index, iters, wall, top=10_000)
  rows = [line.split() for line in every_loc.split("by source location\n")[1]
          .split("\n\n")[0].splitlines()]
  own, share = [float(r[0]) for r in rows], [float(r[1]) for r in rows]
  assert all(s <= o + 0.01 for o, s in zip(own, share)), every_loc
  assert abs(sum(share) - busy_ms) <= 0.01 * len(rows) + 0.05, every_loc
