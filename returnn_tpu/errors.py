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


class DatasetError(RuntimeError):
    """A dataset raised while its batches were made (a corrupt file, a config function that
    fails): one line naming the dataset, the epoch and the error, exit status 1."""

    def __init__(self, dataset, epoch: int, exc: BaseException):
        import traceback

        cause = traceback.format_exception_only(type(exc), exc)[-1].strip()
        super().__init__(f"{dataset.name}: RETURNN's {type(dataset).__name__} failed in epoch {epoch}: {cause}")


# The exit status of a run that stopped early where running the same command continues it (a lost
# worker, the time limit): sysexits.h's EX_TEMPFAIL, "try again later".
RESUMABLE_STATUS = 75


def write_failure_status(exc: BaseException) -> int:
    """The exit status of a run that could not write a file (a checkpoint, its record): 75 (run
    the same command again) when the disk was full or failed, which a later start may find mended;
    2 when the place cannot be written (read-only, not permitted, no such folder), which needs a
    person. ``exc`` is an ``OSError`` or TensorFlow's error of a save op (known by its text)."""
    import errno

    if isinstance(exc, OSError) and exc.errno is not None:
        return RESUMABLE_STATUS if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO) else 2
    text = str(exc)
    return RESUMABLE_STATUS if any(t in text for t in ("No space left", "quota exceeded", "Input/output error")) else 2
