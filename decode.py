"""Translate with a trained workdir: one output line per input line, in input order.

  python decode.py --workdir runs/bible "In the beginning" "And the earth was void"
  python decode.py --workdir runs/bible --input test.en > test.fr
  cat test.en | python decode.py --workdir runs/bible --top_p 0.9 --seed 1
  python decode.py --workdir runs/bible --n_best 4 "In the beginning"
  python decode.py --workdir runs/bible --input test.en --reference test.fr > test.hyp.fr

Everything (model config, parameters, SentencePiece vocabulary) comes from the workdir.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import sys
import time

EPILOG = """decoding strategy: beam search of 4 hypotheses with length penalty alpha 0.6 (the
  paper's), a sentence ending once no alive hypothesis can beat the best finished one
  (--beam_stop), unless --temperature, --top_k or --top_p is given (sampling) or
  --beam_size 1 (greedy). Sampling options with --beam_size above 1 are an error.
input: the SENTENCE arguments, else the lines of --input FILE, else standard input (UTF-8).
  Sources are normalised as the run's were (lower-cased for the numbers task). An empty
  line gives an empty line; a line longer than the model's max_len tokens is truncated
  (one warning for all of them). Lines unlike every training source (pieces no training
  source held, or longer than the longest) get translations all the same, and one warning.
output: one translation per line on standard output; with --n_best N (beam search only)
  up to N lines per input: index<TAB>score<TAB>translation (index counts input lines from
  0; score = log-probability / length penalty; an empty input gives one line, score 0).
  Lines are written as each chunk of --chunk_size lines is done; an interrupted run keeps
  them. Typed at a terminal, each line is translated when Enter is pressed.
  A progress bar (file or standard input) and the time spent compiling and decoding go to
  standard error.
flags: spelt with _ between words, as train.py's and the --config.KEY=VALUE fields; the -
  spelling works too (--beam-size).
scoring: --reference FILE (one reference line per input line) prints the corpus BLEU and
  chrF (sacreBLEU, its default 13a tokenisation) and the exact-match rate of the 1-best
  translations to standard error at the end."""


def parse_args(argv):
  from seq2seq.errors import ArgumentParser
  p = ArgumentParser(description=__doc__.split("\n")[0], epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("sentences", nargs="*", metavar="SENTENCE", help="sentences to translate")
  p.add_argument("--workdir", default="runs/default",
                 help="a workdir written by train.py (default: %(default)s)")
  p.add_argument("--input", default=None, metavar="FILE",
                 help="translate the lines of FILE ('-' = standard input)")
  p.add_argument("--checkpoint_step", type=int, default=None, metavar="STEP",
                 help="checkpoint to use (default: the latest)")
  p.add_argument("--beam_size", type=int, default=None, help="default 4; 1 = greedy")
  p.add_argument("--alpha", type=float, default=None, help="beam length penalty (default 0.6)")
  p.add_argument("--beam_stop", default=None, choices=("exact", "best", "count"),
                 help="when beam search ends a sentence: exact (default: once no alive "
                 "hypothesis can beat the best finished one, so it returns what the search "
                 "would at the length limit), best (once the step's best extension ends it) "
                 "or count (once beam_size hypotheses have ended, as fairseq and "
                 "CTranslate2: faster, but unlikely hypotheses that end early can stop the "
                 "search before the best one ends)")
  p.add_argument("--n_best", type=int, default=None, metavar="N",
                 help="print the N best hypotheses with their scores (beam search)")
  p.add_argument("--temperature", type=float, default=None, help="sampling temperature (> 0)")
  p.add_argument("--top_k", type=int, default=None,
                 help="sample from the k most probable tokens (0 = no limit)")
  p.add_argument("--top_p", type=float, default=None, help="nucleus sampling mass, in (0, 1]")
  p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
  p.add_argument("--max_len", type=int, default=None, help="output length limit (default: "
                 "source length + 50, at most the model's max_len)")
  p.add_argument("--batch_size", type=int, default=64,
                 help="sentences per batch (default: %(default)s)")
  p.add_argument("--chunk_size", type=int, default=2048, metavar="LINES",
                 help="translate and write this many lines at a time, so output comes as "
                 "it is ready and an interrupted run keeps it (default: %(default)s; "
                 "lines are sorted by length within a chunk)")
  p.add_argument("--reference", default=None, metavar="FILE",
                 help="score the translations against FILE, one reference per input "
                 "line: BLEU, chrF and exact match on standard error")
  p.add_argument("--no_progress", dest="no_progress", action="store_true",
                 help="no progress bar")
  return p.parse_args(argv)


# decode.py's beam stop rule: the search's own best. "count" (0.81x the time on the Bible
# validation verses) stops once 4 hypotheses have ended, and where the model is sure of its
# next token, unlikely extensions that end early fill the 4: on the numbers task 13 of 400
# random numbers came out wrong with it, none with "exact" (docs/usage.md).
BEAM_STOP = "exact"


def strategy_from_flags(*, beam_size: int | None = None, alpha: float | None = None,
                        n_best: int | None = None, temperature: float | None = None,
                        top_k: int | None = None, top_p: float | None = None,
                        beam_stop: str | None = None) -> Strategy:
  """decode.py's rule (None = flag not given): any of temperature / top_k / top_p means
  sampling, beam_size 1 means greedy, otherwise beam search (default size 4, alpha 0.6,
  stop rule BEAM_STOP).
  Options that contradict the chosen strategy raise UserError, e.g. top_k with a beam size
  above 1, alpha or n_best with sampling, temperature <= 0, top_p outside (0, 1]."""
  from seq2seq.errors import UserError
  from seq2seq.search import Beam, get_strategy
  paper = Beam()   # 4 hypotheses, alpha 0.6
  sampling = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items()
              if v is not None}
  if sampling:
    if beam_size not in (None, 1):
      raise UserError(f"{', '.join(sampling)} (sampling) cannot be used with beam search "
                      f"(beam size {beam_size!r}); drop the beam size to sample")
    return get_strategy("sample", alpha=alpha, n_best=n_best, beam_stop=beam_stop,
                        **sampling)
  if beam_size == 1:
    return get_strategy("greedy", alpha=alpha, n_best=n_best, beam_stop=beam_stop)
  return get_strategy("beam", beam_size=paper.size if beam_size is None else beam_size,
                      alpha=paper.alpha if alpha is None else alpha, n_best=n_best,
                      beam_stop=BEAM_STOP if beam_stop is None else beam_stop)


def _one_line(text: str) -> str:
  """A translation may hold line breaks (byte pieces can spell any character): keep it on
  one output line."""
  return " ".join(text.splitlines()) if text else text


def typed_lines(stream):
  """The lines of an interactive standard input, one at a time as they are entered."""
  from seq2seq.errors import UserError
  stream = getattr(stream, "buffer", stream)
  for n in itertools.count(1):
    raw = stream.readline()
    if not raw:
      return
    try:
      line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
      raise UserError(f"standard input line {n}: invalid UTF-8") from None
    yield line.removesuffix("\n").removesuffix("\r")


def write(out, first: int, n_best: int | None) -> list[str]:
  """One chunk's translations on standard output, flushed: they survive an interrupt.
  Returns the 1-best lines as written."""
  best = [_one_line(texts[0]) for texts in out.texts]
  rows = best if n_best is None else [
      f"{i}\t{score:.4f}\t{_one_line(text)}"
      for i, (texts, scores) in enumerate(zip(out.texts, out.scores), first)
      for text, score in zip(texts, scores)]
  sys.stdout.write("".join(row + "\n" for row in rows))
  sys.stdout.flush()
  return best


def read_references(path, num_lines: int) -> list[str]:
  """The lines of --reference FILE, which must match the input line for line."""
  from seq2seq.errors import UserError
  from seq2seq.textio import read_lines
  refs = read_lines(path)
  if len(refs) != num_lines:
    raise UserError(f"--reference {path} has {len(refs)} line(s), the input {num_lines}")
  return refs


def score_line(hypotheses: list[str], references: list[str], path) -> str:
  from seq2seq import metrics
  return (f"BLEU {metrics.bleu(hypotheses, references):.2f}, "
          f"chrF {metrics.chrf(hypotheses, references):.2f}, "
          f"exact match {100 * metrics.exact_match(hypotheses, references):.1f}% "
          f"against {path} ({len(references)} lines; sacreBLEU, 13a)")


@contextlib.contextmanager
def ctrl_c_waits():
  """Ctrl-C inside the block takes effect at its end, so a chunk is written and counted
  whole. (Only where Python's own Ctrl-C handler is in place.)"""
  if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
    yield
    return
  pressed = []
  old = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, old)
  if pressed:
    raise KeyboardInterrupt


# What JAX spends compiling a program: tracing, lowering, compiling (or loading it from the
# persistent cache).
COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration",
                            "/jax/core/compile/jaxpr_to_mlir_module_duration",
                            "/jax/core/compile/backend_compile_duration"})


@contextlib.contextmanager
def compile_spans():
  """Collects (start, end) of JAX's compile work while the block runs."""
  import jax.monitoring
  spans = []

  def listener(event, start, end, **_):
    if event in COMPILE_EVENTS:
      spans.append((start, end))
  jax.monitoring.register_event_time_span_listener(listener)
  try:
    yield spans
  finally:
    jax.monitoring.unregister_event_time_span_listener(listener)


def covered_seconds(spans) -> float:
  """Seconds covered by the union of (start, end) spans (nested ones count once)."""
  total, reach = 0.0, float("-inf")
  for start, end in sorted(spans):
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total


class InputWatch:
  """Hands the input lines to the translation one by one, noting which are unlike every
  training source (`seq2seq.data.sources.unfamiliar`) and how long it waited for them (a
  terminal waits for typing: not decoding time)."""

  def __init__(self, tokenizer, record):
    self.tokenizer, self.record = tokenizer, record
    self.unseen = self.long = self.flagged = 0    # counts: a long input keeps no list
    self.first, self.waited = [], 0.0             # the first 5 flagged lines' indices

  def lines(self, lines):
    from seq2seq.data import sources
    from seq2seq.translate import source_ids
    it = iter(lines)
    for i in itertools.count():
      start = time.perf_counter()
      line = next(it, None)
      self.waited += time.perf_counter() - start
      if line is None:
        return
      if line.strip():
        unseen, long = sources.unfamiliar(source_ids(self.tokenizer, line), self.tokenizer,
                                          self.record)
        self.unseen += bool(unseen)
        self.long += bool(long)
        if unseen or long:
          self.flagged += 1
          if len(self.first) < 5:
            self.first.append(i)
      yield line

  def warning(self, reads: str | None) -> str | None:
    """One line for all the unfamiliar input lines, or None."""
    if not self.flagged:
      return None
    why = []
    if self.unseen:
      why.append(f"{self.unseen} with pieces no training source held" if self.record
                 else f"{self.unseen} with characters the vocabulary has no piece for")
    if self.long:
      why.append(f"{self.long} longer than the longest training source "
                 f"({self.record.longest} tokens)")
    shown = (", ".join(str(i + 1) for i in self.first)
             + (", ..." if self.flagged > 5 else ""))
    return (f"warning: {self.flagged} input line(s) unlike anything the model was trained on, "
            f"so their translations are guesses (line {shown}): {', '.join(why)}"
            + (f"; this model reads {reads}" if reads else ""))


def speed_line(lines: int, tokens: int, compiling: float, decoding: float) -> str:
  return (f"{lines} line{'' if lines == 1 else 's'}, {tokens} tokens: compiling "
          f"{compiling:.2f} s, decoding {decoding:.2f} s "
          f"({tokens / max(decoding, 1e-9):.1f} tokens/s)")


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  import absl.logging  # Orbax logs through absl: keep its chatter out of the way
  absl.logging.set_verbosity(absl.logging.ERROR)
  from seq2seq import compile_cache, textio, translate
  from seq2seq.load import load_workdir
  from seq2seq.data import sources
  compile_cache.enable()
  from seq2seq.errors import UserError, one_line_warnings
  one_line_warnings()
  done = 0
  try:
    if args.chunk_size < 1:
      raise UserError(f"--chunk_size must be >= 1, got {args.chunk_size}")
    if not 0 <= args.seed < 2 ** 32:
      raise UserError(f"--seed must be in [0, 2**32), got {args.seed}")
    strategy = strategy_from_flags(
        beam_size=args.beam_size, alpha=args.alpha, n_best=args.n_best,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        beam_stop=args.beam_stop)
    if args.sentences and args.input is not None:
      raise UserError("give SENTENCE arguments or --input, not both")
    cfg, params, tokenizer = load_workdir(args.workdir, args.checkpoint_step)
    # Input is read as it is translated (a file of any length, held a chunk at a time).
    if args.sentences:
      lines, total = args.sentences, len(args.sentences)
    elif args.input not in (None, "-"):
      lines, total = textio.iter_lines(args.input), textio.count_lines(args.input)
    elif sys.stdin.isatty():                    # someone typing: answer each line
      if args.reference is not None:
        raise UserError("--reference needs the input as --input FILE, SENTENCE arguments "
                        "or piped standard input, not typed lines")
      print("type a sentence and press Enter (end with Ctrl-D)", file=sys.stderr)
      lines, args.chunk_size, args.no_progress = typed_lines(sys.stdin), 1, True
      total = None
    else:
      lines, total = textio.iter_lines(getattr(sys.stdin, "buffer", sys.stdin)), None
    if args.reference is not None:   # scored at the end: input and translations are kept
      lines = list(lines)
      references, total = read_references(args.reference, len(lines)), len(lines)
    bar = None
    if not args.sentences and not args.no_progress:
      from tqdm.auto import tqdm
      bar = tqdm(total=total, unit="line", file=sys.stderr, dynamic_ncols=True)
    watch = InputWatch(tokenizer, sources.read(args.workdir))
    start, done, num_tokens, truncated, hypotheses = time.perf_counter(), 0, 0, [], []
    chunks = translate.translate_chunks(
        params, cfg.model, tokenizer, watch.lines(lines), strategy,
        chunk_size=args.chunk_size, batch_size=args.batch_size, max_len=args.max_len,
        rng=args.seed, progress=None if bar is None else bar.update)
    try:
      with compile_spans() as spans:
        for _, out in chunks:                   # written as each chunk is done
          with ctrl_c_waits():
            if bar is not None:
              bar.clear()
            written = write(out, done, args.n_best)
            if args.reference is not None:
              hypotheses += written
            done += len(out.texts)
          num_tokens += out.num_tokens
          truncated += out.truncated
    finally:
      if bar is not None:
        bar.close()
    compiling = covered_seconds(spans)
    decoding = time.perf_counter() - start - compiling - watch.waited
  except UserError as e:   # e.g. a line of the input that is not UTF-8, met as it is read
    before = f" ({done} line(s) translated and written before)" if done else ""
    print(f"error: {e}{before}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"interrupted: {done} line(s) translated and written", file=sys.stderr)
    return 130
  except BrokenPipeError:  # e.g. `decode.py ... | head`: the reader has all it wanted
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
    return 0
  except OSError as e:     # standard output cannot be written (a full disk, ...)
    if e.filename is not None:
      raise                # not the output: a bug, with its traceback
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    print(f"error: cannot write the translations: {e.strerror or e} ({done} line(s) "
          f"written before)", file=sys.stderr)
    return 2

  if truncated:
    shown = ", ".join(str(i + 1) for i in truncated[:5])
    more = ", ..." if len(truncated) > 5 else ""
    print(f"warning: {len(truncated)} input line(s) longer than the model's "
          f"{cfg.model.max_len} tokens were truncated (line {shown}{more})", file=sys.stderr)
  unfamiliar = watch.warning(sources.what_the_model_reads(cfg.data))
  if unfamiliar:
    print(unfamiliar, file=sys.stderr)
  print(speed_line(done, num_tokens, compiling, max(decoding, 0.0)), file=sys.stderr)
  if args.reference is not None:
    print(score_line(hypotheses, references, args.reference), file=sys.stderr)
  return 0


if __name__ == "__main__":
  for stream in (sys.stdout, sys.stderr):  # translations are UTF-8, whatever the locale
    if hasattr(stream, "reconfigure"):
      stream.reconfigure(encoding="utf-8", errors="replace")
  sys.exit(main())
