"""Errors that end a run with a one-line message and exit status 2 (bad input, not a crash)."""


class ConfigError(ValueError):
    """A config option has a value that cannot be used.

    The message is one line and names the option and what would be valid.
    The command prints it and exits with status 2 before anything is written.
    """
