"""A checksum of every array of a checkpoint, the same whatever the arrays' sharding.

Orbax writes arrays through TensorStore (zarr, zstd-compressed, in OCDBT files) with no
checksum of the data: a flipped bit reads back as another number. TensorStore's zarr3
driver has a crc32c codec, but Orbax puts it only on the shard index, with no option to
put it on the data. So each array's checksum is computed from its bits on its devices
(any sharding gives the same), stored in the checkpoint's meta item (written with the
checkpoint: no checkpoint without it) and compared after a restore.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _fmix32(h):
  """MurmurHash3's finaliser: a bijection of uint32 that spreads every input bit."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


_CHUNK = 1 << 14


def _layout(sizes: list[int]) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
  """Each array is padded with zeros to whole chunks: (its padding, the position within its
  array of each chunk's first element, the index of each array's first chunk)."""
  chunks = [max(-(-n // _CHUNK), 1) for n in sizes]
  pads = tuple(k * _CHUNK - n for n, k in zip(sizes, chunks))
  first = np.concatenate([np.arange(k, dtype=np.int64) * _CHUNK for k in chunks])
  return pads, (first % 2**32).astype(np.uint32), np.cumsum([0] + chunks[:-1])


@functools.partial(jax.jit, static_argnums=1)
def _chunk_sums(leaves, pads, first):
  """Two 32-bit sums per chunk of every element's bits mixed with its position in its
  array. One program for the whole tree: a program per array compiles for minutes on CPU."""
  bits = []
  for x, pad in zip(leaves, pads):
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    b = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32).reshape(-1)
    bits.append(jnp.pad(b, (0, pad)))
  flat = jnp.concatenate(bits).reshape(-1, _CHUNK)
  index = first[:, None] + jax.lax.broadcasted_iota(jnp.uint32, flat.shape, 1)
  a = _fmix32(flat + index * jnp.uint32(0x9E3779B1))
  b = _fmix32(flat ^ (index * jnp.uint32(0x85EBCA77) + jnp.uint32(0x165667B1)))
  return jnp.stack([a.sum(1, dtype=jnp.uint32), b.sum(1, dtype=jnp.uint32)], -1)


def checksums(tree) -> dict[str, str]:
  """{path: 16 hex digits} of each array of `tree`: the same whatever its sharding."""
  with_paths = jax.tree_util.tree_leaves_with_path(tree)
  if not with_paths:
    return {}
  paths, leaves = zip(*with_paths)
  pads, first, starts = _layout([x.size for x in leaves])
  sums = _chunk_sums(list(leaves), pads, first)
  sums = np.asarray(sums.addressable_data(0)).astype(np.uint64)
  per_array = np.add.reduceat(sums, starts, axis=0) % 2**32
  return {jax.tree_util.keystr(p, simple=True, separator="/"): f"{a:08x}{b:08x}"
          for p, (a, b) in zip(paths, per_array.tolist())}


# Named in each checkpoint: one written with another definition is not checked against it.
CHECKSUM_ALGORITHM = "fmix32x2-chunk16384-v1"


def record(tree) -> dict:
  """What a checkpoint stores of `tree`: the algorithm and each array's checksum."""
  return {"algorithm": CHECKSUM_ALGORITHM, "arrays": checksums(tree)}


def mismatch(tree, stored: dict | None) -> str:
  """The first array of `tree` whose checksum differs from the one the `record` `stored`
  holds ("" if none; nothing is checked for a checkpoint saved without checksums, or with
  others)."""
  if not isinstance(stored, dict) or stored.get("algorithm") != CHECKSUM_ALGORITHM:
    return ""
  arrays = stored.get("arrays") or {}
  for path, value in checksums(tree).items():
    if path in arrays and arrays[path] != value:
      return path
  return ""
