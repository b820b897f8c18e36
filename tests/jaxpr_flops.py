"""Matmul FLOPs counted from a jaxpr: the independent count the benchmarks' cost models are
tested against (bench_decode.step_cost, bench_train.train_flops)."""
import math

import jax


def _sub_jaxprs(value):
  if isinstance(value, jax.extend.core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jax.extend.core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def dot_flops(jaxpr) -> float:
  """2 x output size x contracted size, summed over every dot_general, sub-jaxprs included
  (a scan's body once per iteration); the C++ decode attention (kernels/native.py) counts
  as its two matmuls, q·kᵀ and weights·v: 2 x 2·B·H·Q·K·D."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "ffi_call" and eqn.params["target_name"].startswith("seq2seq_decode_attention"):
      (b, h, q, d), k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape[2]
      total += 4.0 * b * h * q * k * d
    if name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
    if name == "while":
      raise ValueError("a while loop's trip count is not in its jaxpr")
    times = eqn.params["length"] if name == "scan" else 1
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        total += times * dot_flops(sub)
  return total
