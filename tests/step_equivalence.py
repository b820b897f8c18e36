"""Run in a subprocess with 8 fake CPU devices (XLA_FLAGS set by the caller): prints JSON
with the largest differences between the single-device train step and its sharded forms."""
import json
import sys

import jax
import numpy as np

from seq2seq import sharding
from seq2seq.config import Config, TrainConfig, TransformerConfig
from seq2seq.train_lib import Trainer


def batch(seed=0, b=16, length=12, vocab=50):
  rng = np.random.default_rng(seed)
  lens_s, lens_t = rng.integers(3, length + 1, b), rng.integers(3, length + 1, b)
  src, tgt = np.zeros((b, length), np.int32), np.zeros((b, length), np.int32)
  for i in range(b):
    src[i, :lens_s[i]] = rng.integers(4, vocab, lens_s[i])
    tgt[i, :lens_t[i]] = rng.integers(4, vocab, lens_t[i])
  pos = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy()
  return {"src": src, "tgt": tgt, "src_segments": (src != 0).astype(np.int32),
          "tgt_segments": (tgt != 0).astype(np.int32), "src_positions": pos,
          "tgt_positions": pos}


def trainer(cfg, mesh_devices, mesh_shape):
  return Trainer(cfg, mesh=sharding.make_mesh(mesh_shape, devices=mesh_devices), bos_id=1)


def run(cfg, mesh_devices, mesh_shape, steps=3, init_seed=0, tr=None):
  """Losses and parameters after `steps` steps (with `tr`: that Trainer's compiled steps)."""
  tr = tr or trainer(cfg, mesh_devices, mesh_shape)
  state = tr.init(jax.random.key(init_seed))
  losses = []
  for i in range(steps):
    state, m = tr.step(state, tr.global_batch(batch(i)))
    losses.append(float(m["loss_sum"]) / float(m["tokens"]))
  return np.array(losses), jax.tree_util.tree_map(np.asarray, state.params)


def maxdiff(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in
             zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def main():
  cfg = Config(model=TransformerConfig(vocab_size=50, d_model=32, num_heads=4,
                                       num_encoder_layers=1, num_decoder_layers=1, d_ff=64,
                                       dropout_rate=0.1, attention_dropout_rate=0.1,
                                       ffn_dropout_rate=0.1),
               train=TrainConfig(batch_size=16, warmup_steps=10, learning_rate_scale=1.0))
  devs = jax.devices()
  single = trainer(cfg, devs[:1], "")
  ref_loss, ref_params = run(cfg, devs[:1], "", tr=single)
  out = {"devices": len(devs)}
  for name, c, mesh_devs, shape in [
      ("data8", cfg, devs, ""),
      ("fsdp", cfg.replace(train=cfg.train.replace(fsdp=True)), devs, "data=2,fsdp=4"),
  ]:
    loss, params = run(c, mesh_devs, shape)
    out[name] = {"loss": float(np.max(np.abs(loss - ref_loss))), "params": maxdiff(params, ref_params)}
  # The cpu kernels' head + loss over 3 slices of the target length (what `head_chunks`
  # picks for large batches), data-parallel over 8 devices == one piece on one device.
  from seq2seq.kernels import cpu_head
  whole = cpu_head.head_chunks
  cpu_head.head_chunks = lambda batch, length, vocab: 3
  try:
    loss, params = run(cfg, devs, "")
  finally:
    cpu_head.head_chunks = whole
  out["data8_head3"] = {"loss": float(np.max(np.abs(loss - ref_loss))),
                        "params": maxdiff(params, ref_params)}
  # Gradient accumulation over 2 micro-batches == one big batch (without dropout, whose
  # masks are drawn per micro-batch). Its sums run in another order, so adam_eps well above
  # their rounding: Adam with eps≈0 moves a weight by ~lr·sign(g) for a gradient near 0,
  # whose sign the order can flip.
  nodrop = cfg.replace(model=cfg.model.replace(dropout_rate=0.0, attention_dropout_rate=0.0,
                                               ffn_dropout_rate=0.0),
                       train=cfg.train.replace(adam_eps=1e-4))
  loss1, params1 = run(nodrop, devs[:1], "")
  loss2, params2 = run(nodrop.replace(train=nodrop.train.replace(grad_accum_steps=2)), devs[:1], "")
  out["accum2"] = {"loss": float(np.max(np.abs(loss1 - loss2))), "params": maxdiff(params1, params2)}
  # Another initialisation must change the result (the comparison can fail).
  loss, params = run(cfg, devs[:1], "", init_seed=1, tr=single)
  out["other_seed"] = {"loss": float(np.max(np.abs(loss - ref_loss))), "params": maxdiff(params, ref_params)}
  print(json.dumps(out))


if __name__ == "__main__":
  sys.exit(main())
