"""bench/ab.py: an older commit's package really is that commit's, under its own name, and
the CLI times both versions of a real decode call in one process."""
import json
import os
import shutil
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import ab  # noqa: E402

# bench/ab.py reads commits with git: these tests need it, and a checkout with history.
_HAS_GIT = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True
                          ).returncode == 0 if shutil.which("git") else False
needs_git = pytest.mark.skipif(not _HAS_GIT, reason="needs git and the project's git checkout")


def test_rename_imports_renames_the_package_and_nothing_else():
  src = ("from seq2seq.config import Config\nfrom seq2seq import malloc\nimport seq2seq\n"
         "import seq2seq.data as d\nm = importlib.import_module(f\"seq2seq.{name}\")\n"
         "log = logging.getLogger('seq2seq')\nx = my_seq2seq.y\n# seq2seq, the package\n"
         "import seq2seq_old\nfrom seq2seqx import z\n")
  want = ("from seq2seq_old.config import Config\nfrom seq2seq_old import malloc\n"
          "import seq2seq_old\nimport seq2seq_old.data as d\n"
          "m = importlib.import_module(f\"seq2seq_old.{name}\")\n"
          "log = logging.getLogger('seq2seq_old')\nx = my_seq2seq.y\n# seq2seq, the package\n"
          "import seq2seq_old\nfrom seq2seqx import z\n")
  assert ab.rename_imports(src) == want


def _git(repo, *args):
  subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                 check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@needs_git
def test_export_package_is_the_commits_code_under_its_own_name(tmp_path, monkeypatch):
  repo = tmp_path / "repo"
  (repo / "seq2seq" / "sub").mkdir(parents=True)
  (repo / "seq2seq" / "__init__.py").write_text(
      "from seq2seq.sub.mark import MARK\nimport seq2seq.sub.mark as m\n")
  (repo / "seq2seq" / "sub" / "__init__.py").write_text("")
  (repo / "seq2seq" / "sub" / "mark.py").write_text("MARK = 'committed'\n")
  _git(repo, "init", "-q")
  _git(repo, "add", "-A")
  _git(repo, "commit", "-qm", "one")
  (repo / "seq2seq" / "sub" / "mark.py").write_text("MARK = 'working tree'\n")  # not committed

  out = tmp_path / "out"
  dest = ab.export_package("HEAD", str(out), repo=str(repo), name="seq2seq_abtest")
  assert dest == str(out / "seq2seq_abtest")
  monkeypatch.syspath_prepend(str(out))
  pkg = __import__("seq2seq_abtest")
  try:
    assert pkg.MARK == "committed" and pkg.m.__name__ == "seq2seq_abtest.sub.mark"
    assert pkg.m.__file__.startswith(str(out))
  finally:
    for k in [k for k in sys.modules if k.startswith("seq2seq_abtest")]:
      del sys.modules[k]
  with pytest.raises(ValueError, match="nosuchcommit"):
    ab.export_package("nosuchcommit", str(tmp_path / "x"), repo=str(repo))


@pytest.mark.slow
@needs_git
def test_cli_times_both_versions_of_a_decode_call(tmp_path):
  out = tmp_path / "ab.json"
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ab.py"), "HEAD",
                         "decode", "--preset", "small", "--pairs", "2", "--calls", "1",
                         "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  r = json.loads(out.read_text())
  head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                        text=True).stdout.strip()
  assert r["commit_hash"] == head and r["what"] == "decode small float32 greedy"
  assert len(r["old_s"]) == len(r["new_s"]) == 2 and min(r["old_s"] + r["new_s"]) > 0
  # Both versions decoded the workload; HEAD's decoding is the working tree's here.
  assert r["same_tokens"] is True
  assert r["speedup_median"] == pytest.approx(
      statistics.median(o / n for o, n in zip(r["old_s"], r["new_s"])))
  assert "same tokens: True" in proc.stdout

  bad = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ab.py"), "nosuchcommit",
                        "train"], capture_output=True, text=True, cwd=ROOT)
  assert bad.returncode != 0 and "Traceback" not in bad.stderr
  assert bad.stderr.strip().startswith("error: git archive nosuchcommit")
