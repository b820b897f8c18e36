"""The parameters' layout, apart from the paper's model.

A stack's layers (model.Encoder, model.Decoder) are either traced once, their parameters
stacked on a leading axis under `layers` (model.scan_layers, how training runs), or one
module per layer, `layers_0` ... `layers_{N-1}` (how decoding runs, and how runs written
before scan_layers stored them). `layer_stack` builds the first; `unroll_layers` and
`stack_layers` convert a parameter tree between the two, for the code that reads
checkpoints (load.py, decoding.py, export.py). `head_weights` says where the output head's
weights lie, for the kernels that fuse the head with the loss or the search.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from seq2seq import kernels
from seq2seq.config import TransformerConfig
from seq2seq.layers import EncoderLayer


class EncoderLayerStep(EncoderLayer):
  """An encoder layer as a step of a scan over the layers: (output, nothing per layer)."""

  def __call__(self, x_BxSxD, mask, train: bool = False):
    return super().__call__(x_BxSxD, mask, train), None


def layer_stack(layer: type[nn.Module], config: TransformerConfig, n: int, n_args: int):
  """`n` layers of class `layer` applied in turn, traced once (flax nn.scan): the same
  arguments (`n_args` after the first) for each, their parameters stacked on a leading
  axis, their own random initialisation and dropout each. The kernels say how many layers
  each iteration of the compiled loop runs (`scan_unroll`)."""
  return nn.scan(layer, variable_axes={"params": 0},
                 split_rngs={"params": True, "dropout": True}, in_axes=(nn.broadcast,) * n_args,
                 length=n, unroll=kernels.get(config.kernels).scan_unroll(n))(config)


def unroll_layers(params):
  """`params` as the model with one module per layer reads them (scan_layers=False, how
  decoding runs): a stack's layer i as `layers_i`. Such params come back as they are."""
  def unroll(tree):
    if "layers" not in tree:
      return tree
    n = jax.tree_util.tree_leaves(tree["layers"])[0].shape[0]
    layers = {f"layers_{i}": jax.tree_util.tree_map(lambda x: x[i], tree["layers"])
              for i in range(n)}
    return {**{k: v for k, v in tree.items() if k != "layers"}, **layers}
  if "params" in params:
    return {**params, "params": unroll_layers(params["params"])}
  return {k: unroll(v) if k in ("encoder", "decoder") else v for k, v in params.items()}


def stack_layers(params):
  """The inverse of `unroll_layers`: `layers_0` ... `layers_{N-1}` stacked as `layers`."""
  def stack(tree):
    names = sorted((k for k in tree if k.startswith("layers_")), key=lambda k: int(k[7:]))
    if not names:
      return tree
    rest = {k: v for k, v in tree.items() if not k.startswith("layers_")}
    return {**rest, "layers": jax.tree_util.tree_map(lambda *x: jnp.stack(x),
                                                     *[tree[k] for k in names])}
  if "params" in params:
    return {**params, "params": stack_layers(params["params"])}
  return {k: stack(v) if k in ("encoder", "decoder") else v for k, v in params.items()}


def head_weights(config: TransformerConfig, params) -> tuple:
  """(W, b, w_is_VxD) of the output head: the tied embedding [V, D] with no bias, or the
  untied projection's kernel [D, V] and bias. logits = features·Wᵀ (+ b) / features·W + b."""
  if config.tie_output:
    emb = params["embed" if config.share_embeddings else "tgt_embed"]["embedding"]
    return emb, None, True
  return params["logits_dense"]["kernel"], params["logits_dense"]["bias"], False


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
