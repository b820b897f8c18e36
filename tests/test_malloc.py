"""seq2seq.malloc: after `keep_freed_memory()`, XLA:CPU's per-run temporary memory is reused,
not faulted in afresh at every call (measured in fresh processes, with page-fault counts)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import USER_XLA_FLAGS
from seq2seq.kernels import malloc

# A jitted function whose temporaries (two [4096, 4096] f32 products, 64 MiB each) are far
# above glibc's mmap threshold; prints the minor page faults per warm call.
PROBE = """
import json, resource, sys
from seq2seq.kernels import malloc
assert malloc.keep_freed_memory() == (sys.argv[1] == "tuned")
import jax, jax.numpy as jnp
f = jax.jit(lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w.T).sum())
x, w = jnp.ones((4096, 1024)), jnp.full((1024, 4096), 1e-3)
f(x, w).block_until_ready()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
  f(x, w).block_until_ready()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 4))
"""


def _run(probe: str, mode: str = "tuned"):
  """Runs a probe in a fresh Python with no malloc tuning from the environment (or with
  SEQ2SEQ_MALLOC=default for mode "default") and XLA's code generation as a user has it,
  not the tests' (whose fusions allocate otherwise); returns its last line's JSON."""
  env = {k: v for k, v in os.environ.items()
         if not (k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "SEQ2SEQ_MALLOC",
                                                  "XLA_FLAGS"))}
  if USER_XLA_FLAGS is not None:
    env["XLA_FLAGS"] = USER_XLA_FLAGS
  if mode == "default":
    env["SEQ2SEQ_MALLOC"] = "default"
  p = subprocess.run([sys.executable, "-c", probe, mode], env=env, capture_output=True,
                     text=True, timeout=300)
  assert p.returncode == 0, p.stderr
  return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_keep_freed_memory_makes_xla_reuse_its_temporary_memory():
  default = _run(PROBE, "default")
  if default < 1000:
    pytest.skip(f"this system faults in only {default:.0f} pages per call even with "
                "malloc's defaults (huge pages?): nothing to compare")
  tuned = _run(PROBE, "tuned")
  # Pages faulted in afresh per call: under 1% of the temporaries (2 x 64 MiB), and under a
  # tenth of malloc's defaults. (Those fault in only part of the temporaries, a part that
  # varies between machines; the tuned count is not always zero either: 0.5 pages per call
  # on one machine, 128 on another, 0.4% of the temporaries.)
  temporaries_pages = 2 * 4096 * 4096 * 4 / os.sysconf("SC_PAGE_SIZE")
  assert tuned < 0.01 * temporaries_pages and tuned < 0.1 * default, (tuned, default)


# The same function's temporaries stay resident after each call under the tuned malloc, until
# release_freed_memory() gives them back. Prints the resident MiB before three calls
# (runtime warmed up, heap trimmed), after them, and after the release.
RELEASE_PROBE = """
import json
from seq2seq.kernels import malloc
assert malloc.keep_freed_memory()
import jax, jax.numpy as jnp
def rss_mib():
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024
x, w = jnp.ones((4096, 1024)), jnp.full((1024, 4096), 1e-3)
f = jax.jit(lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w.T).sum()).lower(x, w).compile()
f(x, w).block_until_ready()
assert malloc.release_freed_memory()
rss = [rss_mib()]
for _ in range(3):
  f(x, w).block_until_ready()
rss.append(rss_mib())
assert malloc.release_freed_memory()
rss.append(rss_mib())
print(json.dumps(rss + [float(f(x, w))]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_release_freed_memory_gives_the_kept_temporaries_back():
  start, kept, released, value = _run(RELEASE_PROBE)
  assert kept - start > 16, (start, kept)                       # the calls' memory stayed
  assert kept - released > 0.8 * (kept - start), (start, kept, released)  # and is given back
  assert value > 0                                               # and the function still runs


def test_release_does_nothing_unless_tuned(monkeypatch):
  monkeypatch.setattr(malloc, "_tuned", False)
  assert not malloc.release_freed_memory()


def test_leaves_malloc_alone_when_told_or_already_tuned():
  assert not malloc.keep_freed_memory({"SEQ2SEQ_MALLOC": "default"})
  assert not malloc.keep_freed_memory({"MALLOC_ARENA_MAX": "4"})
  assert not malloc.keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
