"""Evaluation of a split: teacher-forced loss and accuracy, and the translations' scores;
`run_eval` is the training loop's, logged and printed."""
from __future__ import annotations

import math
import sys
import time

import jax
import numpy as np

from seq2seq import metrics as metrics_lib
from seq2seq import net, watchdog
from seq2seq.config import Config
from seq2seq.kernels import malloc
from seq2seq.steps import Trainer, raise_if_out_of_memory


def evaluate_loss(trainer: Trainer, params, ds, split: str, max_examples: int = 0) -> dict:
  """Teacher-forced metrics over a split (padded, none dropped), per target token: `loss` as
  trained (label-smoothed: the KL divergence to the smoothed target, 0 at best), `nll` (the
  targets' negative log-likelihood), `perplexity` = exp(nll), and token `accuracy`."""
  cfg = trainer.cfg
  bs = _eval_batch_size(cfg, trainer.data_parallel)
  tot = {"loss_sum": 0.0, "nll_sum": 0.0, "tokens": 0.0, "correct": 0.0}
  for batch in _local_eval_batches(ds, split, bs, max_examples):
    m = trainer.eval(params, trainer.global_batch(batch))
    watchdog.progress(m)   # (in a training run: a device that fails or hangs stops it)
    for k in tot:
      tot[k] += float(m[k])
  n = max(tot["tokens"], 1.0)
  nll = tot["nll_sum"] / n
  return {"loss": tot["loss_sum"] / n, "nll": nll, "accuracy": tot["correct"] / n,
          "perplexity": math.exp(min(nll, 50.0))}


def _eval_batch_size(cfg: Config, data_parallel: int) -> int:
  bs = cfg.train.eval_batch_size
  return -(-bs // data_parallel) * data_parallel


def _local_eval_batches(ds, split, batch_size, max_examples):
  """Each host's rows of every global eval batch."""
  p, n = jax.process_index(), jax.process_count()
  per = batch_size // n
  for b in ds.eval_batches(split, batch_size, max_examples):
    yield {k: v[p * per:(p + 1) * per] for k, v in b.items()
           if isinstance(v, np.ndarray) and k in ("src", "tgt")}


def evaluate_translations(cfg: Config, params, ds, split: str, max_examples: int = 0,
                          strategy=None) -> tuple[dict, list[tuple[str, str, str]]]:
  """Decodes a split and scores it: BLEU, chrF and exact match. Returns (metrics, samples);
  metrics["finite_scores"] says whether no hypothesis scored NaN (a failing attention).

  A source longer than the model's max_len is cut to it, as the loss's batches cut it, and
  counted in metrics["truncated"]."""
  from seq2seq import search, translate
  if strategy is None:
    t = cfg.train
    strategy = (search.get_strategy("beam", beam_size=t.beam_size, alpha=t.length_penalty)
                if t.decode_strategy == "beam" else search.get_strategy("greedy"))
  srcs, refs = [], []
  for b in ds.eval_batches(split, cfg.train.eval_batch_size, max_examples):
    valid = b["valid"]
    srcs += [s for s, v in zip(b["src_text"], valid) if v]
    refs += [t for t, v in zip(b["tgt_text"], valid) if v]
  out = translate.translate_nbest(params, cfg.model, ds.tokenizer, srcs, strategy,
                                 batch_size=cfg.train.eval_batch_size, truncate=True,
                                 skip_empty=False)
  hyps = [t[0] for t in out.texts]
  m = {"bleu": metrics_lib.bleu(hyps, refs), "chrf": metrics_lib.chrf(hyps, refs),
       "exact_match": metrics_lib.exact_match(hyps, refs), "examples": len(hyps),
       "truncated": len(out.truncated),
       "finite_scores": not any(math.isnan(s) for row in out.scores for s in row)}
  return m, list(zip(srcs, refs, hyps))


def run_eval(trainer: Trainer, cfg: Config, state, ds, split: str, writer, step: int, bar,
             samples: int = 3, final: bool = False) -> dict:
  """The training loop's evaluation of `split` at `step` (its first num_eval_examples, all
  of it if `final`): written to the run's metrics and printed with `samples` translations
  (through the progress bar `bar` if there is one). {} if the dataset has no such split."""
  if split not in ds.splits:
    return {}
  n = 0 if final else cfg.train.num_eval_examples
  t0 = time.time()
  malloc.release_freed_memory()   # the train steps' kept buffers, before the evaluation's
  # Under the net (a cuDNN attention that fails moves to XLA's and is done again) and the
  # watch (a device that fails while others wait for it, or hangs, stops the run)
  try:
    with watchdog.phase(f"the evaluation of {split} at step {step}"):
      m, said = net.netted("evaluation", lambda: evaluate_loss(trainer, state.params, ds,
                                                               split, n), net.finite_metrics)
      params = trainer.local_params(state)
      (tm, examples), more = net.netted(
          "decoding", lambda: evaluate_translations(cfg, params, ds, split, n),
          lambda out: out[0]["finite_scores"])
  except jax.errors.JaxRuntimeError as e:   # its batch too large for the device: one line
    raise_if_out_of_memory(e, cfg, trainer.data_parallel, evaluation=True)
    raise
  malloc.release_freed_memory()   # and the evaluation's, before the next train step
  del tm["finite_scores"]
  m.update(tm, seconds=time.time() - t0)
  writer.write(step, split, m)
  if jax.process_index() == 0:
    lines = [*said, *more, f"[{split} @ {step}] loss {m['loss']:.3f}  ppl {m['perplexity']:.2f}  "
             f"acc {m['accuracy']:.3f}  "
             f"BLEU {m['bleu']:.1f}  chrF {m['chrf']:.1f}  exact {m['exact_match']:.3f} "
             f"({m['examples']} examples"
             + (f", {m['truncated']} sources cut to {cfg.model.max_len} tokens)"
                if m.get("truncated") else ")")]
    for src, ref, hyp in examples[:samples]:
      lines.append(f"  src: {src}\n  ref: {ref}\n  hyp: {hyp}")
    if bar is not None:
      bar.write("\n".join(lines), file=sys.stderr)
    else:
      print("\n".join(lines), file=sys.stderr, flush=True)
  return dict(m, step=step)
