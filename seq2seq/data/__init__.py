"""Data: your parallel text, a TFDS dataset or the embedded numbers task, a SentencePiece
vocabulary, token ids on disk and deterministic packed batches. No TensorFlow needed: text
files are read where they lie, TFDS datasets are array_record files read through TFDS data
sources; tokenizing and batching are SentencePiece and NumPy.

    from seq2seq.data import load_dataset, Tokenizer
    ds = load_dataset(cfg, workdir)        # see dataset.py: the stages, in order
    for batch in ds.train_batches(start_step): ...

cfg.data.dataset selects the corpus (corpus.py):
  "numbers"        English -> French (target_lang=de: German) number phrases, built offline
                   with num2words (numbers.py). The vocabulary is capped at 1024 ids for it
                   (the unigram model stops at ~370: 4 specials, 256 bytes, ~110 pieces),
                   whatever data.vocab_size says.
  "parallel_text"  your aligned files or TSV (parallel_text.py), of any size.
  anything else    a TFDS catalog name such as wmt14_translate/de-en (catalog.py).

Token ids (tokenizer.py): PAD 0, BOS 1, EOS 2, UNK 3; byte fallback on. Sources and targets
are EOS-terminated in batches; the decoder input is `shift_right(tgt, BOS, tgt_segments)`.

Files: TFDS data in data.data_dir; <workdir>/vocab.model and vocab.json (what it was built
from: vocabulary.py); <workdir>/data_cache/ (token ids: token_ids.py); <workdir>/
train_sources.json (what the training sources were: sources.py). In multi-host runs
process 0 builds the dataset and trains the vocabulary while the others wait (seq2seq.hosts);
each host tokenizes and batches only its own training shards (every process_count-th pair),
all at once; eval_batches yields the whole split on every host.
"""
import importlib
import importlib.resources
import importlib.resources.abc
import sys

# tensorflow-datasets 4.9.x imports the `importlib_resources` backport unconditionally when
# it locates a builder's code (download_and_prepare), though it only declares it for
# Python < 3.9. The standard library module has the same API on 3.11: alias it if absent.
if "importlib_resources" not in sys.modules:
  try:
    import importlib_resources  # noqa: F401
  except ImportError:
    sys.modules["importlib_resources"] = importlib.resources

from seq2seq.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer  # noqa: E402

__all__ = ["load_dataset", "Dataset", "Tokenizer", "PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID"]


def __getattr__(name):   # the rest on first use: tokenizing workers import little
  if name in ("load_dataset", "Dataset"):
    return getattr(importlib.import_module("seq2seq.data.dataset"), name)
  raise AttributeError(f"module 'seq2seq.data' has no attribute {name!r}")
