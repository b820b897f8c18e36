"""Any translation dataset of the TFDS catalog, by name: `wmt14_translate/de-en`,
`ted_hrlr_translate/pt_to_en`, ... Source and target are its supervised keys (swapped by
`--config.data.reverse`). Reading needs no TensorFlow (array_record + data sources), and
neither does building, whatever the size: past 1 GB a split, TFDS's writer spills examples
to bucket files through TensorFlow's file API, which `files_without_tensorflow` serves from
the file system where TensorFlow is not installed. *Preparing* most catalog datasets
downloads them: where that is impossible (no internet, missing optional dependencies, a
builder whose own code uses TensorFlow) the failure is a one-line `UserError`, said before
any download where it can be known then.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import re
import socket
import sys
import time
from pathlib import Path

import tensorflow_datasets as tfds
from etils import epath

from seq2seq.errors import UserError

_PROBE_HOST = "storage.googleapis.com"  # where TFDS keeps prepared datasets


def _import_legacy_builders() -> None:
  # TFDS imports its older builder modules (e.g. `translate/wmt14.py`) lazily, on first
  # attribute access, so `tfds.builder("wmt14_translate")` cannot find them until then.
  import tensorflow_datasets.translate  # noqa: F401


def get_builder(name: str, data_dir: str | None = None) -> tfds.core.DatasetBuilder:
  """The catalog builder `name` (array_record), not yet prepared. UserError if unknown."""
  try:
    return tfds.builder(name, data_dir=data_dir or None, file_format="array_record")
  except tfds.core.registered.DatasetNotFoundError:
    pass
  except ValueError as e:  # e.g. an unknown config or version
    raise UserError(f"TFDS dataset {name!r}: {str(e).splitlines()[0]}") from None
  _import_legacy_builders()
  try:
    return tfds.builder(name, data_dir=data_dir or None, file_format="array_record")
  except tfds.core.registered.DatasetNotFoundError:
    raise UserError(f"unknown dataset {name!r}: not 'numbers', 'parallel_text' or a TFDS "
                    f"catalog name (e.g. wmt14_translate/de-en)") from None
  except ValueError as e:
    raise UserError(f"TFDS dataset {name!r}: {str(e).splitlines()[0]}") from None


def supervised_keys(builder: tfds.core.DatasetBuilder, reverse: bool = False
                    ) -> tuple[str, str]:
  keys = builder.info.supervised_keys
  if not keys or len(keys) != 2 or not all(isinstance(k, str) for k in keys):
    raise UserError(f"TFDS dataset {builder.name!r} has no (source, target) text "
                    f"supervised keys (got {keys!r}): not a translation dataset")
  for k in keys:
    feature = builder.info.features[k]
    if not isinstance(feature, tfds.features.Text):
      raise UserError(f"TFDS dataset {builder.name!r}: supervised key {k!r} is "
                      f"{type(feature).__name__}, not Text")
  src, tgt = keys
  return (tgt, src) if reverse else (src, tgt)


def _offline_reason() -> str:
  """Why downloads cannot work here ("" if they might). Without this check an offline
  machine spends ~200 s in TFDS's download retries (10, exponential back-off) first."""
  if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY",
                                     "http_proxy")):
    return ""  # name resolution may happen at the proxy
  try:
    socket.getaddrinfo(_PROBE_HOST, 443)
  except OSError as e:
    return f"no network: cannot resolve {_PROBE_HOST} ({e.strerror or e})"
  return ""


class _FileApi:
  """The part of TensorFlow that TFDS's shuffler uses (`tf.io.gfile`, `tf.errors`) once a
  split passes its in-memory limit (`shuffle.MAX_MEM_BUFFER_SIZE`, 1 GB), served by the file
  system through etils.epath, as the rest of TFDS's writer is."""

  class errors:   # noqa: N801 - TensorFlow's names
    class ResourceExhaustedError(OSError):
      message = ""

  class io:   # noqa: N801
    class gfile:   # noqa: N801
      @staticmethod
      def GFile(path, mode="r"):   # noqa: N802
        try:
          return epath.Path(path).open(mode)
        except OSError as e:   # a bucket file each: raise the limit on open files, as TFDS
          if e.errno != 24:    # does when TensorFlow reports it (EMFILE)
            raise
          from tensorflow_datasets.core import shuffle
          shuffle._increase_open_files_limit()
          return epath.Path(path).open(mode)

      @staticmethod
      def exists(path) -> bool:
        return epath.Path(path).exists()

      @staticmethod
      def remove(path) -> None:
        epath.Path(path).unlink()


def tensorflow_installed() -> bool:
  return importlib.util.find_spec("tensorflow") is not None


@contextlib.contextmanager
def files_without_tensorflow():
  """TFDS's shuffler writes its bucket files through `_FileApi` while this is entered, where
  TensorFlow is not installed (where it is, TFDS uses it, as ever)."""
  from tensorflow_datasets.core import shuffle
  if tensorflow_installed():
    yield
    return
  was = shuffle.tf
  shuffle.tf = _FileApi
  try:
    yield
  finally:
    shuffle.tf = was


def uses_tensorflow(builder: tfds.core.DatasetBuilder) -> bool:
  """Whether the builder's own module imports TensorFlow (which its build then needs)."""
  try:
    code = inspect.getsource(inspect.getmodule(type(builder)))
  except (OSError, TypeError):
    return False
  return re.search(r"^(import tensorflow\b|from \S+ import tensorflow\b)", code,
                   re.MULTILINE) is not None


def prepare(builder: tfds.core.DatasetBuilder, downloads: bool = True) -> None:
  """download_and_prepare, turning any failure into a one-line UserError. `downloads`:
  the builder fetches files (check first that the network is reachable at all)."""
  if builder.is_prepared():
    return
  if downloads:
    where = (f"TFDS dataset {builder.info.full_name!r} is not prepared in {builder.data_dir} "
             f"and could not be downloaded")
    hint = ("prepare it on a machine with internet access and point --data_dir "
            "(TFDS_DATA_DIR) at it")
  else:  # built from local files: nothing to download, so the directory is the problem
    where = f"could not build TFDS dataset {builder.info.full_name!r} in {builder.data_dir}"
    hint = "check that --data_dir (TFDS_DATA_DIR) is a writable directory"
  if uses_tensorflow(builder) and not tensorflow_installed():
    raise UserError(f"TFDS's builder of {builder.info.full_name!r} uses TensorFlow, which is "
                    f"not installed: pip install tensorflow-cpu (or prepare it where TensorFlow "
                    f"is and point --data_dir (TFDS_DATA_DIR) at it)")
  reason = _offline_reason() if downloads else ""
  if reason:
    raise UserError(f"{where} ({reason}); {hint}")
  start = time.perf_counter()
  if not downloads:  # TFDS would announce "Downloading and preparing dataset Unknown size"
    builder._log_download_bytes = builder._log_download_done = lambda: None
    try:   # an unwritable data_dir: the one-line error, without a "building" line first
      Path(builder.data_dir).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise UserError(f"{where} ({e.strerror or e}); {hint}") from None
    print(f"building the dataset in {builder.data_dir} (once: later runs reuse it)",
          file=sys.stderr, flush=True)
  try:
    with contextlib.redirect_stdout(sys.stderr), files_without_tensorflow():
      builder.download_and_prepare()   # (TFDS's messages: stdout is for results)
  except Exception as e:  # noqa: BLE001 - network, checksum, missing dependency, ...
    reason = (str(e).strip().splitlines() or [""])[0][:200]
    raise UserError(f"{where} ({type(e).__name__}: {reason}); {hint}") from None
  if not downloads:
    print(f"built in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
