"""bench/bench_matmul_layouts.py --few_rows times a decode step's x·W in two forms; they
must compute the same thing, over distinct copies of W when cold and one W when hot."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import bench_matmul_layouts as bml  # noqa: E402


def test_few_rows_times_both_forms_cold_and_hot():
  r = bml.few_rows_measure(rows=4, k=16, n=24, dtype="bfloat16", repeats=1, cold_bytes=4e3)
  assert r["weight_bytes"] == 2 * 16 * 24 and r["copies"] == 4e3 // (2 * 16 * 24)
  for name in ("x.W cold", "x.(Wt)t cold", "x.W hot", "x.(Wt)t hot"):
    assert r[name]["s"] > 0
    assert r[name]["bytes_per_s"] == pytest.approx(r["weight_bytes"] / r[name]["s"])


def test_few_rows_rejects_a_form_that_computes_something_else(monkeypatch):
  monkeypatch.setattr(bml, "dot_nt", lambda a, b: bml.jnp.dot(a, b[:, ::-1].T,
                                                              preferred_element_type=bml.F32))
  with pytest.raises(AssertionError):
    bml.few_rows_measure(rows=4, k=16, n=24, dtype="float32", repeats=1, cold_bytes=4e3)
