"""Strings in, strings out: the translation API over `slots.decode_stream`.

    cfg, params, tokenizer = load_workdir("runs/default")     # seq2seq.load
    translate(params, cfg.model, tokenizer, ["twelve", "forty-two"], Beam())

`translate` gives the best translation of each sentence; `translate_nbest` every hypothesis
with its score (cutting over-long sources, skipping empty ones); `translate_chunks` the same
chunk by chunk, for output written as it comes. A single string is one sentence. Sources are
read as the tokenizer's `normalize_source` says (lower-cased for the numbers task: the
tokenizer of `load_workdir` follows the run's data config).

Decoding runs under the net of seq2seq/net.py: where cuDNN's attention fails in its
programs (they do not compile, a run raises, scores come out NaN), its forms move to XLA's
attention, the sentences are decoded again, and one warning says so.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import jax
import numpy as np

from seq2seq import kernels, net, slots, watchdog
from seq2seq.config import TransformerConfig
from seq2seq.decoding import _variables, as_key, decode, decode_params
from seq2seq.search import Beam, Greedy, Sample, Strategy, _check, _is_int
from seq2seq.slots import StreamStats


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _ids(tokens, length: int, eos: int) -> list[int]:
  """A hypothesis' ids: its `length` tokens without the final EOS."""
  ids = tokens[:length].tolist()
  return ids[:-1] if ids and ids[-1] == eos else ids


def _sentences(sentences) -> Sequence[str]:
  """A str is one sentence; otherwise every item must be a str."""
  if isinstance(sentences, str):
    return [sentences]
  sentences = list(sentences)
  bad = [s for s in sentences if not isinstance(s, str)][:1]
  _check(not bad, f"sentences must be strings, got {type(bad[0]).__name__} {bad[0]!r:.40}"
         if bad else "")
  return sentences


class Translations(NamedTuple):
  """What `translate_nbest` returns, in input order.

  texts       [sentence][hypothesis] strings, best first: n_best of them for beam search
              (fewer only if the beam held fewer), one for greedy and sampling.
  scores      the same shape: DecodeResult.scores (log-probability; for beam search divided
              by the length penalty). A skipped empty sentence has [""] and [0.0].
  num_tokens  tokens generated over all returned hypotheses, EOS included.
  truncated   indices of the sentences whose source was cut to config.max_len tokens.
  """
  texts: list[list[str]]
  scores: list[list[float]]
  num_tokens: int
  truncated: list[int]


def source_ids(tokenizer, sentence: str) -> list[int]:
  """The ids the model reads for `sentence`: normalised as the run's sources were (e.g.
  lower-cased), encoded, EOS-terminated. Every translation reads its sources through here."""
  normalize = getattr(tokenizer, "normalize_source", None)
  text = normalize(sentence) if normalize is not None else sentence
  return list(tokenizer.encode(text)) + [int(tokenizer.eos_id)]


def encode_sources(tokenizer, sentences: Sequence[str], max_len: int, *,
                   truncate: bool = True) -> tuple[list[list[int]], list[int]]:
  """(sources, truncated): `source_ids` of each sentence, and the indices of those longer
  than `max_len` tokens, which are cut to max_len with EOS kept as the last token
  (truncate=True) or raise UserError (truncate=False)."""
  eos = int(tokenizer.eos_id)
  srcs, truncated = [], []
  for i, sentence in enumerate(sentences):
    ids = source_ids(tokenizer, sentence)
    if len(ids) > max_len:
      _check(truncate, f"sentence {i} has {len(ids)} tokens (EOS included); the model reads "
             f"at most {max_len}")
      ids = ids[:max_len - 1] + [eos]
      truncated.append(i)
    srcs.append(ids)
  return srcs, truncated


BATCHING = ("auto", "slots", "fixed")


def resolve_batching(batching: str, strategy: Strategy, num_sentences: int | None = None,
                     batch_size: int = 64, cfg: TransformerConfig | None = None) -> str:
  """"auto": decode slots where a finished sentence has a successor to take its slot.
  Measured on real text (docs/performance.md, "Real text"): greedy slots spend 96% of their
  steps on tokens against 68% for fixed batches, and decode 1.2x faster; beam search in
  slots 1.2-1.3x, where its kernels read each hypothesis's keys through a table of rows
  (`kernels.beam_rows`, `cfg`'s table). Elsewhere a beam-search step moves every beam's
  whole cache, which the slots hold at full length where the fixed loop's early phases
  hold a quarter: fixed batches. Greedy or beam search of no more sentences than one batch
  holds (a line typed at a terminal) has no slot to refill: fixed batches, whose step is
  cheaper (the same tokens). Sampling keeps the slots' one key per sentence."""
  if batching != "auto":
    return batching
  if isinstance(strategy, Sample):
    return "slots"
  if num_sentences is not None and num_sentences <= batch_size:
    return "fixed"
  if isinstance(strategy, Beam):
    rows = cfg is not None and kernels.get(cfg.kernels).beam_rows(cfg)
    return "slots" if rows else "fixed"
  return "slots"


def translate_nbest(params, cfg: TransformerConfig, tokenizer, sentences: Sequence[str],
                    strategy: Strategy = Greedy(), *, batch_size: int = 64,
                    length_multiple: int = 16, max_len: int | None = None, rng=None,
                    truncate: bool = True, skip_empty: bool = True,
                    progress: Callable[[int], Any] | None = None,
                    batching: str = "auto", stats: StreamStats | None = None) -> Translations:
  """Translates `sentences`: every hypothesis (n_best for beam search) with its score.

  Sources are `source_ids(tokenizer, s)`, padded to a multiple of `length_multiple` tokens
  so few shapes are compiled and reused.

  batching: "auto" (`resolve_batching`: slots for sampling, and for greedy and beam search
    of more sentences than a batch; fixed batches for beam search where the kernels move
    every beam's cache), "slots"
    (`slots.decode_stream`): `batch_size` sentences decode together and one that ends
    hands its place to the next, longest sources first; sentence j (counting
    the sentences decoded, not the skipped ones) samples with `fold_in(rng, j)`. "fixed":
    sorted by length, cut into batches of `batch_size` (rows rounded up to a power of two),
    each decoded by `decoding.decode` until its slowest row ends; batch n samples with
    `fold_in(rng, n)`. Greedy and beam search give the same translations either way.
  truncate: a source longer than config.max_len is cut to it (EOS kept) and listed in
    `truncated`; False raises UserError instead.
  skip_empty: a sentence with no tokens (empty or blank) translates to "" with score 0
    without running the model; False decodes it as the source [eos].
  progress: called with the number of sentences finished, as they finish.
  stats: with "slots", a StreamStats to add the decode's step counts to.
  """
  _check(isinstance(strategy, (Greedy, Sample, Beam)),
         f"strategy must be Greedy(), Sample(...) or Beam(...), got {strategy!r}")
  _check(_is_int(batch_size) and batch_size >= 1, f"batch_size must be >= 1, got {batch_size!r}")
  _check(batching in BATCHING, f"batching must be one of {', '.join(BATCHING)}, "
         f"got {batching!r}")
  _check(max_len is None or (_is_int(max_len) and 1 <= max_len <= cfg.max_len),
         f"max_len must be in [1, {cfg.max_len}] (the model's max_len), got {max_len!r}")
  sentences = _sentences(sentences)
  batching = resolve_batching(batching, strategy, len(sentences), batch_size, cfg)
  pad, eos = int(getattr(tokenizer, "pad_id", 0)), int(tokenizer.eos_id)
  srcs, truncated = encode_sources(tokenizer, sentences, cfg.max_len, truncate=truncate)
  todo = [i for i, s in enumerate(srcs) if not (skip_empty and len(s) == 1)]
  if progress is not None and len(todo) < len(srcs):
    progress(len(srcs) - len(todo))
  params = decode_params(cfg, _variables(params))   # once, not per batch
  decoded = functools.partial(
      _decode, params, cfg, int(tokenizer.bos_id), eos, pad, srcs, todo, strategy,
      batching=batching, batch_size=batch_size, length_multiple=length_multiple,
      max_len=max_len, rng=rng, progress=_Progress(progress), stats=stats)
  # Under the net: a decoding whose cuDNN attention failed (compiling, running, or with
  # non-finite scores) is done again on XLA's attention, said in one warning.
  out, said = net.netted("decoding", decoded, _Decoded.finite)
  for line in said:
    warnings.warn(line, stacklevel=2)
  texts: list[list[str]] = [[""] for _ in srcs]
  scores: list[list[float]] = [[0.0] for _ in srcs]
  for i, (ids, scr) in out.hyps.items():
    texts[i] = [tokenizer.decode(x) for x in ids]
    scores[i] = scr
  return Translations(texts, scores, out.num_tokens, truncated)


@dataclasses.dataclass
class _Decoded:
  """What `_decode` gives (one object, not a tree of JAX's: nothing in it is on a device).
  hyps: {sentence index: (its hypotheses' ids, their scores)}; num_tokens: generated over
  them."""
  hyps: dict
  num_tokens: int

  def finite(self) -> bool:
    """No NaN score (an empty beam slot's -inf is no failure)."""
    return not any(math.isnan(s) for _, scores in self.hyps.values() for s in scores)


class _Progress:
  """`progress` told of each sentence once, however often the decoding is begun again."""

  def __init__(self, progress: Callable[[int], Any] | None):
    self.progress, self.told, self.done = progress, 0, 0

  def restart(self) -> None:
    self.done = 0

  def __call__(self, n: int) -> None:
    watchdog.progress()   # (in a training run's evaluation: a batch done)
    self.done += n
    if self.progress is not None and self.done > self.told:
      self.progress(self.done - self.told)
      self.told = self.done


def _decode(params, cfg: TransformerConfig, bos: int, eos: int, pad: int, srcs, todo,
            strategy: Strategy, *, batching: str, batch_size: int, length_multiple: int,
            max_len, rng, progress: _Progress, stats: StreamStats | None) -> _Decoded:
  """Decodes the sources `todo` indexes. `stats` gets the counts of a decoding that
  returns."""
  progress.restart()
  hyps, num_tokens = {}, 0
  if batching == "slots":
    counts = StreamStats()
    out = [] if not todo else slots.decode_stream(
        cfg, params, [srcs[i] for i in todo], strategy, bos_id=bos, eos_id=eos, pad_id=pad,
        slots=batch_size, max_len=max_len, rng=rng, length_multiple=length_multiple,
        progress=progress, stats=counts)
    for i, (toks, scr, lens) in zip(todo, out):
      # An empty beam slot (score -inf) is dropped; the best hypothesis is always kept.
      keep = [j for j in range(len(scr)) if j == 0 or scr[j] > -np.inf]
      hyps[i] = ([_ids(toks[j], lens[j], eos) for j in keep], [float(scr[j]) for j in keep])
      num_tokens += int(sum(lens[j] for j in keep))
    if stats is not None:
      for field in dataclasses.fields(counts):
        setattr(stats, field.name, getattr(stats, field.name) + getattr(counts, field.name))
    return _Decoded(hyps, num_tokens)
  order = sorted(todo, key=lambda i: len(srcs[i]))
  key = as_key(rng)
  for n, start in enumerate(range(0, len(order), batch_size)):
    idx = order[start:start + batch_size]
    rows = min(batch_size, 1 << (len(idx) - 1).bit_length())
    width = min(_round_up(max(len(srcs[i]) for i in idx), length_multiple), cfg.max_len)
    src = np.full((rows, width), pad, np.int32)
    src[len(idx):, 0] = eos                     # filler rows: an empty sentence
    for r, i in enumerate(idx):
      src[r, :len(srcs[i])] = srcs[i]
    res = decode(cfg, params, src, strategy, bos_id=bos, eos_id=eos,
                 pad_id=pad, max_len=max_len, rng=jax.random.fold_in(key, n))
    ids = [res.token_lists(eos, j) for j in range(res.tokens.shape[1])]
    for r, i in enumerate(idx):
      # An empty beam slot (score -inf) is dropped; the best hypothesis is always kept.
      keep = [j for j in range(len(ids)) if j == 0 or res.scores[r, j] > -np.inf]
      hyps[i] = ([ids[j][r] for j in keep], [float(res.scores[r, j]) for j in keep])
      num_tokens += int(sum(res.lengths[r, j] for j in keep))
    progress(len(idx))
  return _Decoded(hyps, num_tokens)


def translate_chunks(params, cfg: TransformerConfig, tokenizer, sentences: Iterable[str],
                     strategy: Strategy = Greedy(), *, chunk_size: int = 2048, rng=None,
                     **kwargs) -> Iterator[tuple[int, Translations]]:
  """`translate_nbest` over consecutive chunks of `chunk_size` sentences: yields (index of
  the chunk's first sentence, its Translations) as each chunk is done, so a caller can write
  results while the rest decode (and keep them if interrupted). `sentences` may be any
  iterable, read lazily one chunk at a time (chunk_size 1 translates each line as it is
  typed). Sorting by length happens within a chunk; `truncated` holds global indices.
  Chunk k decodes with `fold_in(rng, k)`. kwargs go to `translate_nbest`."""
  _check(_is_int(chunk_size) and chunk_size >= 1, f"chunk_size must be >= 1, got {chunk_size!r}")
  key = as_key(rng)
  params = decode_params(cfg, _variables(params))   # once, not per chunk
  lines, offset = iter([sentences] if isinstance(sentences, str) else sentences), 0
  for k in itertools.count():
    chunk = _sentences(list(itertools.islice(lines, chunk_size)))
    if not chunk:
      return
    out = translate_nbest(params, cfg, tokenizer, chunk, strategy,
                          rng=jax.random.fold_in(key, k), **kwargs)
    yield offset, out._replace(truncated=[offset + i for i in out.truncated])
    offset += len(chunk)


def translate(params, cfg: TransformerConfig, tokenizer, sentences: Sequence[str],
              strategy: Strategy = Greedy(), *, batch_size: int = 64, length_multiple: int = 16,
              max_len: int | None = None, rng=None) -> list[str]:
  """Translates `sentences`, returning the best hypothesis of each, in input order.

  Sources are `source_ids(tokenizer, s)`; one longer than config.max_len raises
  UserError, and an empty sentence is decoded like any other (`translate_nbest` with
  truncate=False, skip_empty=False; see it for the batching).
  """
  out = translate_nbest(params, cfg, tokenizer, sentences, strategy, batch_size=batch_size,
                        length_multiple=length_multiple, max_len=max_len, rng=rng,
                        truncate=False, skip_empty=False)
  return [t[0] for t in out.texts]
