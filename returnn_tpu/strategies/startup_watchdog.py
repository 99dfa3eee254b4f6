"""A separate process that ends a worker whose cluster start-up takes too long.

TensorFlow's multi-worker start-up blocks in C++ while holding the GIL, waiting far longer than
a job should for workers that never come; no Python thread or signal handler in the worker
can run then. The worker meets every other one first in Python
(:mod:`returnn_tpu.strategies.startup_barrier`), so this is for a worker lost after that. The
watchdog runs beside TensorFlow's start-up: if the worker has not closed the watchdog's stdin
within the timeout, it probes the other workers' ports, prints one line naming those that do
not answer, and sends the worker SIGHUP. During its start-up the worker handles SIGHUP by C's
``_exit`` itself (:func:`returnn_tpu.strategies.multi_worker.startup_deadline`), which needs no
GIL and makes the exit status 1 (SIGHUP is signal 1): docs/faults.md's status of a failure to
look at, not 137, which a job loop reads as an OOM kill. A worker still there after
:data:`SIGKILL_AFTER_SECONDS` gets SIGKILL.

    python -m returnn_tpu.strategies.startup_watchdog PID TIMEOUT OPTION OWN_NAME NAME=HOST:PORT ...

(``OPTION``: where the user set the timeout, named in the error.)
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time

SIGKILL_AFTER_SECONDS = 5.0


def unanswered(peers: dict, timeout_seconds: float = 1.0) -> list:
    """The peers (name -> "host:port") whose port does not accept a TCP connection."""
    missing = []
    for name, address in peers.items():
        host, port = address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=timeout_seconds).close()
        except OSError:
            missing.append(f"{name} ({address})")
    return missing


def main(argv):
    pid, timeout, option, own = int(argv[0]), float(argv[1]), argv[2], argv[3]
    peers = dict(arg.split("=", 1) for arg in argv[4:])
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    if ready:  # the worker closed our stdin (start-up done) or died
        return 0
    missing = unanswered(peers)
    sys.stderr.write(
        f"returnn-tpu: error: {own}: the cluster did not come up: all workers had met, then TensorFlow's "
        f"start-up took over {timeout:g} s ({option}); no answer from {', '.join(missing) or 'a worker that left'}\n"
    )
    sys.stderr.flush()
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + SIGKILL_AFTER_SECONDS
    while os.getppid() == pid and time.monotonic() < deadline:  # the worker is our parent until it ends
        time.sleep(0.05)
    if os.getppid() == pid:
        os.kill(pid, signal.SIGKILL)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
