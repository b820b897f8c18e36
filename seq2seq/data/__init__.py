"""Data: TFDS builders (embedded numbers task, your parallel text, the TFDS catalog), a
SentencePiece tokenizer, and deterministic packed batches. No TensorFlow needed: datasets
are written as array_record and read through TFDS data sources; batching is NumPy.

    from seq2seq.data import load_dataset, Tokenizer
    ds = load_dataset(cfg, workdir)        # see dataset.py
    for batch in ds.train_batches(start_step): ...

cfg.data.dataset selects the source:
  "numbers"        English -> French (target_lang=de: German) number phrases, built offline
                   with num2words (numbers.py). The vocabulary is capped at 1024 ids for it
                   (the unigram model stops at ~370: 4 specials, 256 bytes, ~110 pieces),
                   whatever data.vocab_size says.
  "parallel_text"  your aligned files or TSV (parallel_text.py).
  anything else    a TFDS catalog name such as wmt14_translate/de-en (catalog.py).

Token ids (tokenizer.py): PAD 0, BOS 1, EOS 2, UNK 3; byte fallback on. Sources and targets
are EOS-terminated in batches; the decoder input is `shift_right(tgt, BOS, tgt_segments)`.

Files: TFDS data in data.data_dir; <workdir>/vocab.model and vocab.json (what it was built
from); <workdir>/data_cache/*.npz (tokenized splits); <workdir>/train_sources.json (what the
training sources were: sources.py). In multi-host runs process 0 builds and trains the vocabulary, the
others wait for the files; each host tokenizes and batches only its own training examples
(every process_count-th); eval_batches yields the whole split on every host.
"""
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

from seq2seq.data.dataset import Dataset, load_dataset  # noqa: E402
from seq2seq.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer  # noqa: E402

__all__ = ["load_dataset", "Dataset", "Tokenizer", "PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID"]
