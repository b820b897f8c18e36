"""The one way native code is built (seq2seq.native_build): cached by what it depends on,
whole files only, and one line saying why where it cannot be had."""
import ctypes

import pytest

from seq2seq import native_build
from seq2seq.data import first_fit
from seq2seq.kernels import native

ADD = "int seq2seq_add(int a, int b) { return a + b; }\n"


@pytest.fixture
def source(tmp_path):
  path = tmp_path / "add.c"
  path.write_text(ADD)
  return path


def test_a_library_is_built_once_for_what_it_depends_on(tmp_path, source, monkeypatch):
  if native_build.compiler("C") is None:
    pytest.skip("no C compiler")
  monkeypatch.delenv("SEQ2SEQ_NATIVE", raising=False)
  where = tmp_path / "native"
  lib = native_build.build("add", "C", [source], ("-O2", "-shared", "-fPIC"), where=where)
  assert ctypes.CDLL(str(lib)).seq2seq_add(2, 3) == 5
  mtime = lib.stat().st_mtime_ns
  assert native_build.build("add", "C", [source], ("-O2", "-shared", "-fPIC"),
                            where=where) == lib and lib.stat().st_mtime_ns == mtime
  other = native_build.build("add", "C", [source], ("-O2", "-shared", "-fPIC"), where=where,
                             depends_on=("another JAX",))
  source.write_text(ADD + "int seq2seq_one(void) { return 1; }\n")
  changed = native_build.build("add", "C", [source], ("-O2", "-shared", "-fPIC"), where=where)
  assert len({lib, other, changed}) == 3
  assert sorted(p.name for p in where.iterdir()) == sorted(p.name for p in (lib, other, changed))


def test_what_cannot_be_built_is_one_line_and_leaves_nothing(tmp_path, source, monkeypatch):
  where = tmp_path / "native"
  monkeypatch.setenv("SEQ2SEQ_NATIVE", "off")
  with pytest.raises(native_build.Unavailable, match=f"^{native_build.OFF}$"):
    native_build.build("add", "C", [source], ("-shared",), where=where)
  monkeypatch.delenv("SEQ2SEQ_NATIVE")
  bad = tmp_path / "bad-cc"
  bad.write_text("#!/bin/sh\necho 'warning: first' >&2\necho 'add.c:1: error: not today' >&2\n"
                 "exit 1\n")
  bad.chmod(0o755)
  monkeypatch.setenv("CC", str(bad))
  with pytest.raises(native_build.Unavailable,
                     match=f"^{bad} failed on add.c: add.c:1: error: not today$"):
    native_build.build("add", "C", [source], ("-shared",), where=where)
  assert list(where.iterdir()) == []
  monkeypatch.setenv("CC", str(tmp_path / "missing"))
  monkeypatch.setenv("PATH", str(tmp_path / "empty"))
  with pytest.raises(native_build.Unavailable,
                     match=r"^no C compiler \(cc, gcc or clang; or set CC\) on PATH$"):
    native_build.build("add", "C", [source], ("-shared",), where=where)


def test_the_packing_loop_and_the_kernels_are_built_the_same_way(tmp_path, monkeypatch):
  """Both libraries land in SEQ2SEQ_NATIVE_DIR through native_build, and both are refused
  by SEQ2SEQ_NATIVE=off with its one line."""
  calls = []
  real = native_build.build

  def build(name, *args, **kwargs):
    calls.append(name)
    return real(name, *args, **kwargs)
  monkeypatch.setattr(native_build, "build", build)
  monkeypatch.setenv("SEQ2SEQ_NATIVE", "off")
  first_fit._library.cache_clear()
  try:
    assert first_fit._library() is None and first_fit._why_not == native_build.OFF
  finally:
    first_fit._library.cache_clear()
  with pytest.raises(native_build.Unavailable, match=native_build.OFF):
    native.build(tmp_path)
  assert calls == ["first_fit", "kernels"]
  monkeypatch.delenv("SEQ2SEQ_NATIVE")
  if native_build.compiler("C") is not None:
    monkeypatch.setenv("SEQ2SEQ_NATIVE_DIR", str(tmp_path / "here"))
    first_fit._library.cache_clear()
    try:
      assert first_fit._library() is not None
    finally:
      first_fit._library.cache_clear()
    assert [p.name.split("-")[0] for p in (tmp_path / "here").iterdir()] == ["seq2seq_first_fit"]
