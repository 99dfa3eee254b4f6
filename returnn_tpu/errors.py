"""Errors and exit statuses that end a run with a one-line message: bad input (status 2), and a run
that stopped early where the same command continues it."""


class ConfigError(ValueError):
    """A config option has a value that cannot be used.

    The message is one line and names the option and what would be valid.
    The command prints it and exits with status 2 before anything is written.
    """


def refused_by_returnn(option: str, what: str, exc: BaseException) -> ConfigError:
    """The one-line error for an exception RETURNN's code raised while building ``what`` (a
    network, a dataset) from the config's ``option``: its type, first line and where it was
    raised, so a user sees which check of RETURNN's failed without a traceback."""
    import os
    import traceback

    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else (where.line if where else "")
    place = f" ({os.path.basename(where.filename)}:{where.lineno})" if where else ""
    return ConfigError(f"{option}: RETURNN cannot build {what} from the config: {type(exc).__name__}: {first}{place}")


# The exit status of a run that stopped early where running the same command continues it (a lost
# worker, the time limit): sysexits.h's EX_TEMPFAIL, "try again later".
RESUMABLE_STATUS = 75
