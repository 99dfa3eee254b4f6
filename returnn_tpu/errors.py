"""Errors and exit statuses that end a run with a one-line message: bad input (status 2), and a run
that stopped early where the same command continues it."""


class ConfigError(ValueError):
    """A config option has a value that cannot be used.

    The message is one line and names the option and what would be valid.
    The command prints it and exits with status 2 before anything is written.
    """


# The exit status of a run that stopped early where running the same command continues it (a lost
# worker, the time limit): sysexits.h's EX_TEMPFAIL, "try again later".
RESUMABLE_STATUS = 75
