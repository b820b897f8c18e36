"""bench/bench_precision.py's bookkeeping: which runs it trains, which pairs it compares,
and the statistics it reports, checked against naive computations on made-up curves."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import bench_precision  # noqa: E402


def test_runs_and_pairs_cover_every_seed_in_both_dtypes():
  runs = bench_precision.run_names(3)
  assert runs["bfloat16_s2"] == ["model.dtype=bfloat16", "train.seed=2"]
  assert len(runs) == 6
  p = bench_precision.pairs(3)
  assert p["dtype"] == [("float32_s0", "bfloat16_s0"), ("float32_s1", "bfloat16_s1"),
                        ("float32_s2", "bfloat16_s2")]
  # within each dtype every seed pair once, and never across dtypes
  assert len(p["seed"]) == 6 and len(set(p["seed"])) == 6
  for a, b in p["seed"]:
    assert a.split("_s")[0] == b.split("_s")[0] and a != b
  assert all(n in runs for ps in p.values() for pair in ps for n in pair)
  assert bench_precision.pairs(1)["seed"] == []


def _run(loss, steps=None):
  return dict(steps=list(steps or range(1, len(loss) + 1)), loss=list(loss))


def test_compare_matches_a_naive_loop_on_the_common_steps():
  rng = np.random.default_rng(0)
  a = _run(np.exp(-np.arange(150) / 40) + 0.01)
  b = _run(rng.uniform(0.01, 1.0, 140), steps=range(11, 151))  # b logs from step 11 only
  c = bench_precision.compare(a, b, window=50)
  la, lb = dict(zip(a["steps"], a["loss"])), dict(zip(b["steps"], b["loss"]))
  common = [s for s in a["steps"] if s in lb]
  assert c["steps"] == common
  last = common[-50:]
  rel = [abs(lb[s] - la[s]) / la[s] for s in last]
  assert c["window"] == 50
  assert c["max_rel_diff"] == pytest.approx(max(rel))
  assert c["mean_rel_diff"] == pytest.approx(sum(rel) / 50)
  mean_a, mean_b = sum(la[s] for s in last) / 50, sum(lb[s] for s in last) / 50
  assert c["window_mean_diff"] == pytest.approx(mean_b - mean_a)
  assert c["window_mean_rel_diff"] == pytest.approx(abs(mean_b - mean_a) / mean_a)


def test_spikes_finds_the_injected_spikes_and_nothing_on_a_smooth_curve():
  smooth = np.exp(-np.arange(1, 301) / 60) + 0.008
  assert bench_precision.spikes(_run(smooth)) == []
  spiky = smooth.copy()
  spiky[[49, 144, 204, 205]] *= [5.0, 3.0, 2.0, 1.2]  # steps 50, 145, 205, 206
  # step 50 is before `after`; 206 is only 1.2x its neighbours
  assert bench_precision.spikes(_run(spiky)) == [145, 205]
  assert bench_precision.spikes(_run(spiky), after=0) == [50, 145, 205]


def test_summarize_gives_each_kinds_range_over_its_pairs():
  comps = {("a", "b"): dict(max_rel_diff=0.3, mean_rel_diff=0.1, window_mean_rel_diff=0.02),
           ("a", "c"): dict(max_rel_diff=0.5, mean_rel_diff=0.05, window_mean_rel_diff=0.04),
           ("b", "c"): dict(max_rel_diff=0.9, mean_rel_diff=0.2, window_mean_rel_diff=0.01)}
  s = bench_precision.summarize(comps, {"dtype": [("a", "b")], "seed": [("a", "c"), ("b", "c")]})
  assert s["dtype"] == dict(max_rel_diff=[0.3, 0.3], mean_rel_diff=[0.1, 0.1],
                            window_mean_rel_diff=[0.02, 0.02], pairs=1)
  assert s["seed"] == dict(max_rel_diff=[0.5, 0.9], mean_rel_diff=[0.05, 0.2],
                           window_mean_rel_diff=[0.01, 0.04], pairs=2)
  assert "seed" not in bench_precision.summarize(comps, {"dtype": [("a", "b")], "seed": []})
