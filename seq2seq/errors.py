"""The one exception type meant for users: scripts print it as one line and exit 2."""


class UserError(ValueError):
  """Bad input from the user (flags, files, workdir). Anything else is a bug."""
