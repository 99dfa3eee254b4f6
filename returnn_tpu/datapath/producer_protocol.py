"""The messages between a trainer and its data producer, and how their failures are raised.

Every message is a ``(kind, *fields)`` tuple, over the producer's queue and pipe or worker 0's
TCP connections alike. Both sides (:mod:`returnn_tpu.datapath.producer` in the trainer,
:mod:`returnn_tpu.datapath.producer_process` in the producer) check what came with :func:`expect`, and the
trainer raises a producer's ``error`` message with :func:`raise_error`. A module of its own so
that both sides use one definition without importing each other. No TensorFlow (the producer
process runs without it).
"""

from __future__ import annotations


class ProducerError(RuntimeError):
    """The dataset producer failed or died."""


def expect(message: tuple, kind: str, what: str) -> tuple:
    """The fields of ``message`` (a ``(kind, *fields)`` tuple of the protocol), which must be of
    ``kind``; else a :class:`ProducerError` naming what came instead of ``what``."""
    if not message or message[0] != kind:
        raise ProducerError(f"the data producer's protocol is out of step: {message[:1]!r} came where {kind!r} "
                            f"({what}) was due")
    return tuple(message[1:])


def raise_error(message: tuple, producer: str):
    """Raises the error of an ``("error", text, bad_input)`` message: bad input that the producer
    found as the :class:`ConfigError` it was (one line, exit status 2), a failure as
    :class:`ProducerError`."""
    from returnn_tpu.errors import ConfigError

    _, text, bad_input = message
    if bad_input:
        raise ConfigError(text)
    raise ProducerError(f"{producer} failed: {text}")
