"""The one exception type meant for users: scripts print it as one line and exit 2."""
import argparse


class UserError(ValueError):
  """Bad input from the user (flags, files, workdir). Anything else is a bug."""


def one_line_warnings() -> None:
  """Command lines print `warning: ...` on one line instead of Python's two-line format."""
  import warnings
  warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"


class ArgumentParser(argparse.ArgumentParser):
  """Bad flags print one line and exit 2, like every other user error (no usage dump).
  A flag may be spelt with - or _ between words (--beam-size or --beam_size)."""

  def error(self, message):
    self.exit(2, f"error: {message} (see --help)\n")

  def parse_known_args(self, args=None, namespace=None):
    import sys
    known = {o for a in self._actions for o in a.option_strings}

    def spelt(arg):
      name, eq, value = arg.partition("=")
      if not name.startswith("--") or "." in name or name in known:
        return arg  # --config.KEY=VALUE overrides keep their field names
      for other in (name[:2] + name[2:].replace("_", "-"), name[:2] + name[2:].replace("-", "_")):
        if other in known:
          return other + eq + value
      return arg
    args = sys.argv[1:] if args is None else list(args)
    if "--" in args:  # what follows is positional
      i = args.index("--")
      args = [spelt(a) for a in args[:i]] + args[i:]
    else:
      args = [spelt(a) for a in args]
    return super().parse_known_args(args, namespace)

  def parse_with_overrides(self, args=None):
    """(the flags, the KEY=VALUE of each --config.KEY=VALUE); any other flag is an error."""
    known, rest = self.parse_known_args(args)
    overrides = []
    for r in rest:
      if r.startswith("--config.") and "=" in r:
        overrides.append(r[len("--config."):])
      else:
        self.error(f"unrecognized argument {r}")
    return known, overrides
