"""The one exception type meant for users: scripts print it as one line and exit 2."""
import argparse


class UserError(ValueError):
  """Bad input from the user (flags, files, workdir). Anything else is a bug."""


def one_line_warnings() -> None:
  """Command lines print `warning: ...` on one line instead of Python's two-line format."""
  import warnings
  warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"


class ArgumentParser(argparse.ArgumentParser):
  """Bad flags print one line and exit 2, like every other user error (no usage dump)."""

  def error(self, message):
    self.exit(2, f"error: {message} (see --help)\n")
