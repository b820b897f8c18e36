"""Data: TFDS builders (embedded numbers task, your parallel text, the TFDS catalog),
a SentencePiece tokenizer, and deterministic packed batches."""
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
