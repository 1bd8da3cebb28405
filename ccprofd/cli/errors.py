"""The command line's own error: bad input or usage, shared by every sub-command module."""


class UsageError(Exception):
    """Bad input or usage: reported in one line, exit status 2."""
