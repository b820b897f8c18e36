"""Train a Transformer. `python train.py` trains the default model on the embedded
English→French numbers task; see `python train.py --help` for everything else.

  python -m seq2seq.data.bible data/bible        # the Bible, English -> French
  python train.py --workdir runs/bible --config small_cpu \\
      --train_files data/bible/train --validation_files data/bible/validation --tgt_lang fr
  python train.py --config base --dataset wmt14_translate/de-en --config.train.steps=100000
"""
import argparse
import sys

EPILOG = """config overrides: --config.KEY=VALUE sets any field of the run's Config, e.g.
  --config.model.d_model=256 --config.train.steps=3000 --config.data.vocab_size=16000
  (a field name unique to one section may drop the section: --config.steps=3000).
multi-host: run one process per host with --coordinator_address HOST:PORT
  --num_processes N --process_id I (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
  JAX_PROCESS_ID); on TPU pods set SEQ2SEQ_DISTRIBUTED=auto.
flags: spelt with _ between words, as the --config.KEY=VALUE fields and decode.py's flags;
  the - spelling works too (--train-files)."""


def parse_args(argv):
  from seq2seq.config import EXPERIMENTS
  from seq2seq.errors import ArgumentParser
  p = ArgumentParser(description=__doc__.split(";")[0], epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", default="runs/default", help="where everything is written (default: %(default)s)")
  p.add_argument("--config", default=None,
                 help=f"one of {', '.join(EXPERIMENTS)} (default numbers; small_cpu: the "
                      "small model on your own parallel text, ~30 min on a CPU)")
  p.add_argument("--dataset", default=None,
                 help="numbers (embedded), parallel_text, or a TFDS name such as wmt14_translate/de-en")
  p.add_argument("--data_dir", default=None, help="TFDS data directory")
  p.add_argument("--train_files", default=None, help="parallel_text: prefix of train.<lang> files, or a .tsv")
  p.add_argument("--validation_files", default=None)
  p.add_argument("--test_files", default=None)
  p.add_argument("--src_lang", default=None)
  p.add_argument("--tgt_lang", default=None)
  p.add_argument("--reverse", action="store_true", default=None, help="swap a TFDS dataset's source and target")
  p.add_argument("--steps", type=int, default=None, help="shortcut for --config.train.steps")
  p.add_argument("--no_progress", dest="no_progress", action="store_true",
                 help="no progress bar")
  p.add_argument("--coordinator_address", default="")
  p.add_argument("--num_processes", type=int, default=0)
  p.add_argument("--process_id", type=int, default=-1)
  p.add_argument("--check_memory", nargs="?", const="here", default=None, metavar="TARGET",
                 help="compile the train step, say in one line whether its batch fits the "
                      "device (and if not, the batch that does), and exit: on the GPU or "
                      "TPU here, or offline for TARGET (h100, h200, v5e, v6e; h100:8 for 8)")
  return p.parse_with_overrides(argv)


def config_items(args, overrides: list[str]) -> list[str]:
  """The flags as config items, before the --config.KEY=VALUE overrides. Data files given
  without --dataset mean your own parallel text."""
  from seq2seq.errors import UserError
  items = [f"data.{k}={v}" for k in ("dataset", "data_dir", "train_files", "validation_files",
                                     "test_files", "src_lang", "tgt_lang", "reverse")
           if (v := getattr(args, k)) is not None]
  if args.dataset is None and (args.train_files or args.validation_files or args.test_files):
    items.insert(0, "data.dataset=parallel_text")
  if args.steps is not None:
    if any(o.split("=")[0] in ("train.steps", "steps") for o in overrides):
      raise UserError("give --steps or --config.train.steps, not both")
    items.append(f"train.steps={args.steps}")
  return items


def main(argv=None) -> int:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  from seq2seq.kernels import malloc
  malloc.keep_freed_memory()   # before JAX starts its threads
  import absl.logging  # TFDS and Orbax log through absl: keep their chatter out of the way
  absl.logging.set_verbosity(absl.logging.ERROR)
  from seq2seq.errors import UserError, one_line_warnings
  one_line_warnings()
  from seq2seq import compile_cache
  compile_cache.enable()
  from seq2seq import versions
  if line := versions.notice():
    print(line, file=sys.stderr)
  try:
    from seq2seq import sharding
    sharding.maybe_initialize_distributed(args.coordinator_address, args.num_processes,
                                          args.process_id)
    from seq2seq import train_lib
    cfg = train_lib.resolve_config(args.workdir, args.config,
                                   config_items(args, overrides) + overrides)
    for flag in ("src_lang", "tgt_lang"):  # said, not silently ignored
      if getattr(args, flag) is not None and cfg.data.dataset != "parallel_text":
        raise UserError(f"--{flag} names the files of dataset parallel_text, not "
                        f"{cfg.data.dataset!r}" + ("; the numbers task's target language "
                        "is --config.data.target_lang (fr or de)"
                        if cfg.data.dataset == "numbers" else ""))
    if args.check_memory is not None:
      from seq2seq import aot
      fits, line = aot.check_memory(cfg, args.check_memory)
      if not fits:
        raise UserError(line)
      print(line)
      return 0
    result = train_lib.train(cfg, args.workdir, progress=not args.no_progress)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    from seq2seq import hosts
    hosts.leave(e)   # several hosts refusing: they leave together (none outlives process 0)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130
  import jax
  if jax.process_index() == 0:
    print(train_lib.summary(result))
  # Stopped by SIGTERM (preemption) before the run finished: saved, but not done. Exit as a
  # process killed by SIGTERM would (128 + 15), so that a scheduler (SLURM, Kubernetes)
  # reruns it rather than taking it for finished.
  return 143 if result.stopped_early else 0


if __name__ == "__main__":
  code = main()
  if code != 0:  # skip the interpreter's teardown: it can crash while XLA's and the input
    sys.stdout.flush()  # pipeline's threads still run (Ctrl-C), or wait minutes for the
    sys.stderr.flush()  # threads of a failed checkpoint write; what was saved is on disk
    import os
    os._exit(code)
  sys.exit(code)
