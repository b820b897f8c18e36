"""Compiled programs kept on disk between runs (JAX's persistent compilation cache), so a
second `decode.py` or a resumed `train.py` with the same shapes skips XLA's compile."""
import os
from pathlib import Path

MAX_BYTES = 2 << 30   # least recently used entries go first


def default_dir() -> Path:
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "seq2seq" / "jax"


def enable() -> str | None:
  """Turns the cache on; returns its directory, or None when it is off.

  JAX_COMPILATION_CACHE_DIR, if set, is JAX's own and wins. Otherwise SEQ2SEQ_COMPILE_CACHE
  names the directory (default: $XDG_CACHE_HOME/seq2seq/jax, i.e. ~/.cache/seq2seq/jax);
  SEQ2SEQ_COMPILE_CACHE=off turns it off. A directory that cannot be written means no cache,
  not an error."""
  import jax
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  where = os.environ.get("SEQ2SEQ_COMPILE_CACHE") or str(default_dir())
  if where.lower() in ("off", "0", "false", "none"):
    return None
  try:
    Path(where).mkdir(parents=True, exist_ok=True)
  except OSError:
    return None
  if not os.access(where, os.W_OK | os.X_OK):
    return None
  jax.config.update("jax_compilation_cache_dir", where)
  jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  return where
