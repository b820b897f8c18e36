"""A trained workdir as a model of another inference engine.

    python -m seq2seq.export ctranslate2 --workdir runs/default --output runs/default-ct2
    python -m seq2seq.export ctranslate2 --workdir runs/default --output runs/ct2-int8 \\
        --quantization int8

`ctranslate2` writes a CTranslate2 (https://github.com/OpenNMT/CTranslate2) model directory:
model.bin, config.json, shared_vocabulary.json (the SentencePiece pieces, by id) and a copy
of vocab.model. It computes the same function as this package's model (tests/test_export.py
checks the per-token log-probabilities and greedy translations). Install the engine with
`pip install 'seq2seq[ctranslate2]'`; then, from Python:

    import ctranslate2, sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file="runs/default-ct2/vocab.model")
    translator = ctranslate2.Translator("runs/default-ct2", compute_type="int8")
    out = translator.translate_batch([sp.encode("seven hundred and one", out_type=str)],
                                     beam_size=4, length_penalty=0.6)
    print(sp.decode(out[0].hypotheses[0]))

The source is its pieces followed by "</s>" (the model's config.json says add_source_eos),
the decoder starts from "<s>", and PAD is never predicted (the output layer's bias is -1e9
for it), as in `seq2seq.decoding`. Two differences of CTranslate2's searches, not of the
model: its beam search divides a hypothesis' log-probability by length ** length_penalty,
not by GNMT's ((5 + length) / 6) ** alpha as `seq2seq.decoding.Beam` does, so beams of
different lengths may rank differently (with length_penalty=0 and alpha=0 both rank by
log-probability); and its min_decoding_length defaults to 1, which bans "</s>" as the
first token and renormalises over the rest (min_decoding_length=0 gives our scores).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from seq2seq.errors import UserError

TARGETS = ("ctranslate2",)
# ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES (kept here so that --help and the
# check of the flag work without the package).
CT2_QUANTIZATIONS = ("float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16",
                     "int16", "float16", "bfloat16")
PAD_LOGIT_BIAS = -1e9   # added to PAD's logit: exp() of it is 0 in float32 and float16
MIN_POSITIONS = 1024   # rows of the exported position table, at least
CT2_MISSING = ("ctranslate2 is not installed: pip install 'seq2seq[ctranslate2]' "
               "(or pip install ctranslate2)")


def _import_ctranslate2():
  try:
    import ctranslate2
    from ctranslate2.specs import common_spec, transformer_spec  # noqa: F401
  except ImportError:
    raise UserError(CT2_MISSING) from None
  return ctranslate2


def _f32(x) -> np.ndarray:
  """A writable float32 copy (CTranslate2 quantizes in place; a JAX array's view is not)."""
  return np.array(x, dtype=np.float32)


def _out_in(kernel, n_in: int) -> np.ndarray:
  """Our kernel [in..., out...] (first `n_in` axes are inputs) as CTranslate2's [out, in]."""
  k = _f32(kernel)
  fan_in = int(np.prod(k.shape[:n_in]))
  return np.ascontiguousarray(k.reshape(fan_in, -1).T)


def _set_linear(spec, dense, n_in: int = 1, bias: bool = True) -> None:
  spec.weight = _out_in(dense["kernel"], n_in)
  if bias:
    spec.bias = _f32(dense["bias"]).reshape(-1)


def _set_norm(spec, norm) -> None:
  spec.gamma = _f32(norm["scale"])
  spec.beta = _f32(norm["bias"])


def _qkv(attn):
  """(weights, biases) of the query, key and value projections in CTranslate2's [out, in];
  our key projection has no bias (softmax ignores it): CTranslate2 gets zeros."""
  w = [_out_in(attn[n]["kernel"], 1) for n in ("query", "key", "value")]
  b = [_f32(attn["query"]["bias"]).reshape(-1), np.zeros(w[1].shape[0], np.float32),
       _f32(attn["value"]["bias"]).reshape(-1)]
  return w, b


def _set_self_attention(spec, attn, norm) -> None:
  w, b = _qkv(attn)
  spec.linear[0].weight = np.concatenate(w)          # fused [3D, D]: q, k, v
  spec.linear[0].bias = np.concatenate(b)
  _set_linear(spec.linear[1], attn["out"], n_in=2)
  _set_norm(spec.layer_norm, norm)


def _set_cross_attention(spec, attn, norm) -> None:
  w, b = _qkv(attn)
  spec.linear[0].weight, spec.linear[0].bias = w[0], b[0]
  spec.linear[1].weight = np.concatenate(w[1:])      # fused [2D, D]: k, v of the source
  spec.linear[1].bias = np.concatenate(b[1:])
  _set_linear(spec.linear[2], attn["out"], n_in=2)
  _set_norm(spec.layer_norm, norm)


def _set_ffn(spec, ffn, norm) -> None:
  _set_linear(spec.linear_0, ffn["wi"])
  _set_linear(spec.linear_1, ffn["wo"])
  _set_norm(spec.layer_norm, norm)


def ctranslate2_spec(cfg, params, tokenizer):
  """A `ctranslate2.specs.TransformerSpec` holding `params` of the model `cfg`
  (TransformerConfig), its vocabulary the pieces of `tokenizer`. Not yet validated."""
  _import_ctranslate2()
  from ctranslate2.specs import common_spec, transformer_spec
  from seq2seq.layers import sinusoidal_positions
  from seq2seq.layout import unroll_layers
  params = unroll_layers(params)   # one spec per layer

  if tokenizer.vocab_size != cfg.vocab_size:
    raise UserError(f"the model has {cfg.vocab_size} token ids but vocab.model holds "
                    f"{tokenizer.vocab_size} pieces: CTranslate2 needs one piece per id")
  enc = transformer_spec.TransformerEncoderSpec(
      cfg.num_encoder_layers, cfg.num_heads, pre_norm=cfg.pre_ln,
      activation=common_spec.Activation.RELU)
  dec = transformer_spec.TransformerDecoderSpec(
      cfg.num_decoder_layers, cfg.num_heads, pre_norm=cfg.pre_ln,
      activation=common_spec.Activation.RELU)
  spec = transformer_spec.TransformerSpec(enc, dec)

  src_emb = _f32(params["embed" if cfg.share_embeddings else "src_embed"]["embedding"])
  tgt_emb = src_emb if cfg.share_embeddings else _f32(params["tgt_embed"]["embedding"])
  # Our exact table (interleaved sin/cos from position 0); CTranslate2's own starts at 1 and
  # puts all sines first. The embeddings are scaled by sqrt(d_model) (scale_embeddings).
  # Rows past max_len continue the same formula: CTranslate2 decodes up to 256 tokens by
  # default, and would stop with an error at the end of the table.
  positions = sinusoidal_positions(max(cfg.max_len, MIN_POSITIONS), cfg.d_model)
  enc.embeddings[0].weight = src_emb
  enc.position_encodings.encodings = positions
  dec.embeddings.weight = tgt_emb
  dec.position_encodings.encodings = positions
  if cfg.tie_output:
    dec.projection.weight = tgt_emb                  # logits = y·Eᵀ
    dec.projection.bias = np.zeros(cfg.vocab_size, np.float32)
  else:
    _set_linear(dec.projection, params["logits_dense"])
  # seq2seq.decoding never predicts PAD (its logit is -inf before the softmax); CTranslate2
  # gets that as a bias, so that its searches and scores are ours with no extra option.
  dec.projection.bias[tokenizer.pad_id] = PAD_LOGIT_BIAS

  for i, layer in enumerate(enc.layer):
    p = params["encoder"][f"layers_{i}"]
    _set_self_attention(layer.self_attention, p["self_attn"], p["self_attn_norm"]["norm"])
    _set_ffn(layer.ffn, p["ffn"], p["ffn_norm"]["norm"])
  for i, layer in enumerate(dec.layer):
    p = params["decoder"][f"layers_{i}"]
    _set_self_attention(layer.self_attention, p["self_attn"], p["self_attn_norm"]["norm"])
    _set_cross_attention(layer.attention, p["cross_attn"], p["cross_attn_norm"]["norm"])
    _set_ffn(layer.ffn, p["ffn"], p["ffn_norm"]["norm"])
  if cfg.pre_ln:
    _set_norm(enc.layer_norm, params["encoder"]["final_norm"])
    _set_norm(dec.layer_norm, params["decoder"]["final_norm"])

  pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
  spec.register_source_vocabulary(pieces)
  spec.register_target_vocabulary(pieces)
  c = spec.config
  c.layer_norm_epsilon = 1e-6                        # CTranslate2's default is 1e-5
  c.unk_token, c.bos_token, c.eos_token = (pieces[tokenizer.unk_id], pieces[tokenizer.bos_id],
                                           pieces[tokenizer.eos_id])
  c.decoder_start_token = pieces[tokenizer.bos_id]
  c.add_source_bos, c.add_source_eos = False, True
  return spec


def _to_bfloat16_without_torch(spec, quantization: str) -> None:
  """CTranslate2 converts weights to bfloat16 with torch; ml_dtypes (a JAX dependency) does
  the same rounding. Casts every float32 array that `optimize` would turn into bfloat16:
  all of them, except for int8_bfloat16 the int8-quantized weights (those with a
  `*_scale` slot), which CTranslate2 quantizes from float32."""
  import ml_dtypes
  from ctranslate2.specs import model_spec

  def cast(layer, name, value):
    key = name.split("/")[-1]
    if (isinstance(value, model_spec.NumpyVariable) and value.dtype == "float32"
        and not value.is_scalar()
        and not (quantization.startswith("int8") and hasattr(layer, key + "_scale"))):
      value.array = value.array.astype(ml_dtypes.bfloat16)
  model_spec.visit_spec(spec, cast)


def _torch_available() -> bool:
  try:
    import torch  # noqa: F401
  except ImportError:
    return False
  return True


def export_ctranslate2(workdir, output, quantization: str = "float32",
                       step: int | None = None) -> dict:
  """Writes the CTranslate2 model of `workdir` (its newest checkpoint, or `step`) to the new
  directory `output`, its weights in `quantization`. Returns what was written."""
  from seq2seq.load import load_workdir
  from seq2seq.workdir import Workdir, refuse_url
  ct2 = _import_ctranslate2()
  if quantization not in CT2_QUANTIZATIONS:
    raise UserError(f"unknown quantization {quantization!r}; choose one of "
                    f"{', '.join(CT2_QUANTIZATIONS)}")
  refuse_url(output)
  output = Path(output)
  if output.exists() or output.is_symlink():
    raise UserError(f"{output} already exists: give a new directory")
  if not output.absolute().parent.is_dir():
    raise UserError(f"cannot write {output}: {output.absolute().parent} is not a directory")
  wd = Workdir.checked(workdir)
  cfg, params, tokenizer = load_workdir(wd, step)
  spec = ctranslate2_spec(cfg.model, params, tokenizer)
  spec.register_file(str(wd.vocab), "vocab.model")
  spec.validate()
  if quantization in ("bfloat16", "int8_bfloat16") and not _torch_available():
    _to_bfloat16_without_torch(spec, quantization)
  spec.optimize(quantization=quantization)
  # Written next to `output` and renamed into place: a failed export leaves nothing.
  tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.absolute().parent))
  try:
    spec.save(str(tmp))
    os.rename(tmp, output)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  files = sorted(p.name for p in output.iterdir())
  return dict(output=str(output), ctranslate2=ct2.__version__, quantization=quantization,
              files=files, bytes=sum((output / f).stat().st_size for f in files))


def main(argv=None) -> int:
  """python -m seq2seq.export ctranslate2 --workdir W --output DIR [--quantization Q]"""
  from seq2seq.errors import ArgumentParser, one_line_warnings
  p = ArgumentParser(prog="python -m seq2seq.export",
                     description="Export a trained workdir as another engine's model.")
  p.add_argument("target", choices=TARGETS)
  p.add_argument("--workdir", required=True)
  p.add_argument("--output", required=True, help="new directory for the exported model")
  p.add_argument("--quantization", default="float32", choices=CT2_QUANTIZATIONS,
                 help="weight type of the CTranslate2 model (default float32; a Translator "
                      "can still pick its compute_type when loading it)")
  p.add_argument("--checkpoint-step", type=int, default=None,
                 help="export this checkpoint (default: the newest)")
  args = p.parse_args(argv)
  import absl.logging  # Orbax logs through absl: keep its chatter out of the way
  absl.logging.set_verbosity(absl.logging.ERROR)
  one_line_warnings()
  try:
    out = export_ctranslate2(args.workdir, args.output, args.quantization,
                             args.checkpoint_step)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out['output']}: CTranslate2 {out['ctranslate2']} model, "
        f"{out['quantization']} weights, {out['bytes'] / 1e6:.1f} MB "
        f"({', '.join(out['files'])})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
