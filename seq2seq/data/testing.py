"""Tiny synthetic parallel corpora for tests and examples (no network, no big files)."""
from __future__ import annotations

import os

import numpy as np

_WORDS = ("red blue green small big old new cat dog bird tree house river sun moon "
          "runs sees eats likes the a one two three and").split()
# A word-for-word "translation": every word is mapped to a fixed invented word.
_TRANSLATE = {w: w[::-1] + "o" for w in _WORDS}


def sentence_pairs(n: int, seed: int = 0, max_words: int = 12) -> list[tuple[str, str]]:
  """`n` deterministic (source, target) pairs of 1..max_words words."""
  rng = np.random.default_rng(seed)
  pairs = []
  for _ in range(n):
    words = [_WORDS[i] for i in rng.integers(len(_WORDS), size=rng.integers(1, max_words + 1))]
    pairs.append((" ".join(words), " ".join(_TRANSLATE[w] for w in words)))
  return pairs


def write_moses(prefix: str, pairs, src_lang: str = "en", tgt_lang: str = "fr") -> str:
  """Writes `prefix.src_lang` / `prefix.tgt_lang`; returns the prefix."""
  os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
  with open(f"{prefix}.{src_lang}", "w", encoding="utf-8") as f:
    f.writelines(s + "\n" for s, _ in pairs)
  with open(f"{prefix}.{tgt_lang}", "w", encoding="utf-8") as f:
    f.writelines(t + "\n" for _, t in pairs)
  return prefix


def write_tsv(path: str, pairs) -> str:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(f"{s}\t{t}\n" for s, t in pairs)
  return path


def write_corpus_dir(root: str, sizes=(("train", 300), ("validation", 20), ("test", 25)),
                     seed: int = 0) -> str:
  """A directory of Moses files train/validation/test.{en,fr} with disjoint random pairs."""
  for i, (split, n) in enumerate(sizes):
    write_moses(os.path.join(root, split), sentence_pairs(n, seed=seed * 100 + i))
  return root
