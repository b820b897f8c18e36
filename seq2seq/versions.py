"""The JAX versions the project has run, and a notice for a newer one.

pyproject.toml sets no upper bound on jax: a GPU's or TPU's JAX comes with its plugin, and an
install that replaced it would leave the plugin of another version (a broken accelerator).
A JAX newer than any here runs, with a one-line notice."""
from __future__ import annotations

import re

# Each has run the fast tier of the tests and the offline GPU compile (seq2seq/aot.py) in CI;
# 0.10.2 the whole suite (README, "Tested with").
TESTED_JAX = ("0.10.2", "0.11.2", "0.12.0.1")


def _release(version: str) -> tuple[int, ...]:
  """The numeric release of a version string: "0.12.0.1" -> (0, 12, 0, 1); "0.13.0rc1" ->
  (0, 13, 0)."""
  return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0].split("rc")[0]
                                           .split(".dev")[0]))


def notice(version: str | None = None) -> str | None:
  """A line saying that JAX `version` (default: the installed one) is newer than any the
  project has run; None if it is not."""
  if version is None:
    import jax
    version = jax.__version__
  newest = max(TESTED_JAX, key=_release)
  if _release(version) <= _release(newest):
    return None
  return (f"notice: jax {version} is newer than any this project has run (newest: "
          f"{newest}); if something fails, try jax {newest} (README, Install)")
