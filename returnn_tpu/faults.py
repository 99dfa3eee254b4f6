"""What stops a run besides its end: non-finite updates, stop signals, a time limit, a lost worker.

The trainer asks :class:`NonFiniteMonitor` every ``NONFINITE_CHECK_STEPS`` steps and before every
sync and checkpoint, so no copy, average or checkpoint is ever non-finite; :class:`StopRequest`
holds a signal, or the coming time limit, until the next step boundary, where the trainer writes
the interrupted epoch's checkpoint and raises :class:`Stopped`. A collective that fails because a
worker is gone (:data:`PEER_LOSS_ERRORS`) becomes :class:`PeerLost` once the survivor has saved
the model of the last sync.

Exit statuses (cli.py): :data:`RESUMABLE_STATUS` when the run stopped early and running the same
command continues it (a lost worker, the time limit); ``128 + N`` for a stop by signal N.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Iterable, Optional

import numpy
import tensorflow as tf

from returnn_tpu.errors import RESUMABLE_STATUS

NONFINITE_CHECK_STEPS = 50  # how often the device's non-finite counts are read (and, multi-worker, shared)
STOP_CHECK_STEPS = 10  # with several workers, how often they agree whether one was asked to stop
# The least grace (seconds from a launcher's stop signal to its SIGKILL) in which a stop at an
# agreed step is tried: it also combines the copies and writes the checkpoint.
AGREED_STOP_SECONDS = 10.0
# What a collective raises when a worker is gone (dead, hung past the health check, unreachable).
PEER_LOSS_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError)
# What a worker that refuses its input tells the others through TensorFlow's coordination service
# (cli.py, under TF_CONFIG); it reaches them in the message of their next collective's error.
REFUSAL_PREFIX = "returnn-tpu refusal of "


def reported_refusal(exc: BaseException) -> Optional[str]:
    """The refusal another worker reported to the cluster (``"worker 0: <its one line>"``), if
    ``exc`` is the error that ended this worker's collective because of it; else None."""
    text = getattr(exc, "message", None) or str(exc)
    for line in text.splitlines():
        if REFUSAL_PREFIX in line:
            return line.split(REFUSAL_PREFIX, 1)[1].split(" [type.googleapis.com/", 1)[0].strip()
    return None


class NonFiniteScore(RuntimeError):
    """The epoch's train score is NaN or Inf (RETURNN stops then, unless stop_on_nonfinite_train_score is off)."""


class NonFiniteUpdate(NonFiniteScore):
    """An update's loss or gradient was NaN or Inf (the update was not applied)."""


class Stopped(RuntimeError):
    """Training stopped at a step boundary because the process got a signal (SIGTERM, SIGINT,
    SIGHUP; ``signum``), or before its time limit (``signum`` None). ``at_last_sync``: the worker
    stops at once, without agreeing with the others, and saves the model of the last sync (its
    launcher kills it too soon for an agreed stop)."""

    def __init__(self, message: str, signum: Optional[int], at_last_sync: bool = False):
        super().__init__(message)
        self.signum = signum
        self.at_last_sync = at_last_sync

    @property
    def status(self) -> int:
        """The exit status: 128 + the signal, or :data:`RESUMABLE_STATUS` at the time limit."""
        return RESUMABLE_STATUS if self.signum is None else 128 + self.signum


class PeerLost(RuntimeError):
    """A collective failed because a worker is gone (``cause``, one of :data:`PEER_LOSS_ERRORS`);
    ``where``: where this survivor saved the model of the last sync and the same command
    continues (or that nothing was trained since the newest checkpoint)."""

    def __init__(self, cause: Exception, where: str):
        super().__init__(f"{where}: {cause}")
        self.cause = cause
        self.where = where


class NonFiniteMonitor:
    """Reads the steps' counts of updates whose loss or gradient was NaN or Inf (they were not
    applied; FACTS.md, "Non-finite updates") and stops the run, or with ``skip`` counts them.
    All workers see the same counts (one small collective through ``workers``)."""

    def __init__(self, workers, *, skip: bool, num_workers: int, log, stop_on_nonfinite_score: bool = True):
        self.workers = workers
        self.skip = skip
        self.num_workers = num_workers
        self.log = log
        self.stop_on_nonfinite_score = stop_on_nonfinite_score  # RETURNN's stop_on_nonfinite_train_score

    def check_score(self, score: dict, epoch_name: str):
        """RETURNN's rule for an epoch's train ``score``: a non-finite one stops the run before
        anything of the epoch is saved (unless ``stop_on_nonfinite_train_score`` is off)."""
        if self.stop_on_nonfinite_score and not all(numpy.isfinite(list(score.values()))):
            raise NonFiniteScore(f"{epoch_name}: non-finite train score {score}; not saved")

    def check(self, steps, epoch_name: str) -> int:
        """The skipped updates since the last check (0 if none), or :class:`NonFiniteUpdate`."""
        local = steps.replica.take_nonfinite()
        rows = self.workers.rows([value for replica in local for value in replica])
        found = []  # (step, replica, loss, count)
        for worker, row in enumerate(rows):
            for i in range(len(local)):
                count, step, loss = row[3 * i : 3 * i + 3]
                if count:
                    found.append((int(step), worker * len(local) + i, float(loss), int(count)))
        if not found:
            return 0
        total = sum(count for *_, count in found)
        step, replica, loss, _ = min(found)
        where = f"replica {replica}" + (f" (worker {replica // len(local)})" if self.num_workers > 1 else "")
        if not self.skip:
            raise NonFiniteUpdate(
                f"{epoch_name}: {where}, step {step}: non-finite loss {loss} or gradient; the update "
                f"was not applied and nothing of this epoch is saved ({total} such updates in all replicas); set "
                "distribute_options['skip_nonfinite_steps'] = True to skip such updates and go on"
            )
        print(f"{epoch_name}: skipped {total} non-finite updates (first: {where}, step {step}, loss {loss})",
              file=self.log.v2)
        return total


class StopRequest:
    """A stop signal (SIGTERM, SIGINT, SIGHUP), or a time limit, held until a step boundary; with
    several workers, they agree every ``STOP_CHECK_STEPS`` steps whether any is to stop, and why.

    ``stop_at``: the ``time.perf_counter()`` at which the run stops for its time limit (None: none).
    ``kill_grace``: the seconds the launcher gives between its stop signal and SIGKILL, where known
    (``mpirun``'s, :func:`returnn_tpu.cluster.mpi.mpirun_kill_grace`). A worker of several that
    gets a signal when that is shorter than :data:`AGREED_STOP_SECONDS`, or when the next agreement
    is further away than half of it, stops at once and saves the model of the last sync, which
    every worker holds (docs/faults.md).
    """

    def __init__(self, workers, num_workers: int, log, stop_at: Optional[float] = None,
                 kill_grace: Optional[float] = None):
        self.workers = workers
        self.num_workers = num_workers
        self.log = log
        self.stop_at = stop_at
        self.kill_grace = kill_grace
        self.signum: Optional[int] = None
        self._warned = False

    def check_grace(self, what: str, seconds: float):
        """Under ``mpirun``: says once, in one line, that ``what`` (a step, a save) takes longer
        than the launcher's grace, so that a stop signal (``qdel``, preemption) in the middle of
        it is followed by SIGKILL before anything is written, and names the MCA parameter to raise."""
        if self.kill_grace is None or seconds <= self.kill_grace or self._warned:
            return
        self._warned = True
        print(f"returnn-tpu: warning: {what} took {seconds:.1f} s, and mpirun kills the ranks {self.kill_grace:g} s after "
              "it forwards a stop signal (Open MPI's odls_base_sigkill_timeout): after a SIGTERM during one, nothing "
              "of this epoch may be written; give more, e.g. mpirun --mca odls_base_sigkill_timeout 60",
              file=self.log.v1)

    def handle(self, signum: int, _frame=None):
        """Signal handler: stop at the next step boundary. A second signal ends the process at
        once, as without this handler."""
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum
        print(f"returnn-tpu: got signal {signum}; stopping at the next step boundary", file=self.log.v1)

    def due(self, step: int, step_seconds: float = 0.0) -> Optional[Stopped]:
        """Before step ``step`` (steps take ``step_seconds``): why the run stops here (a
        :class:`Stopped` without its message), or None. With several workers, the cause is the
        first worker's that has one: a signal (also one that only another worker got), or the time
        limit."""
        late = self.stop_at is not None and time.perf_counter() >= self.stop_at
        own = self.signum or (_TIME_LIMIT if late else 0)
        if self.num_workers > 1:
            if self.signum is not None and self.kill_grace is not None and (
                    self.kill_grace < AGREED_STOP_SECONDS or -step % STOP_CHECK_STEPS * step_seconds > self.kill_grace / 2):
                return Stopped(f"stopped by signal {self.signum}", self.signum, at_last_sync=True)
            if step % STOP_CHECK_STEPS:
                return None
            causes = self.workers.all_workers(own)
            cause = next((c for c in causes if c), 0)
            by = "" if own else f" (sent to worker {causes.index(cause)})"
        else:
            cause, by = own, ""
        if not cause:
            return None
        if cause == _TIME_LIMIT:
            return Stopped("stopped before the time limit (distribute_options['time_limit'])", None)
        return Stopped(f"stopped by signal {cause}{by}", cause)


_TIME_LIMIT = -1  # the cause of a stop that is the time limit, where others are signal numbers


class SignalWatch:
    """Calls ``at_signal(signum)`` on a thread of its own the moment one of ``signals`` arrives,
    while the main thread may be inside a step for many seconds: its Python handler
    (:meth:`StopRequest.handle`) runs only once the step returns, which under ``mpirun`` can be
    after the SIGKILL that follows a stop signal by 1 s. Python's C-level handler writes each
    signal's number at once to the descriptor given to ``signal.set_wakeup_fd``, and TensorFlow
    releases the GIL while a step runs, so the thread acts then (FACTS.md, "A signal during a
    step"). Start it on the main thread, after the handlers are installed."""

    def __init__(self, signals: Iterable[int], at_signal: Callable[[int], None]):
        self.signals = set(signals)
        self.at_signal = at_signal
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="returnn_tpu signal watch", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            try:
                numbers = os.read(self._read, 64)
            except OSError:
                return
            if not numbers:  # closed
                return
            for signum in numbers:
                if signum in self.signals:
                    self.at_signal(signum)

    def close(self):
        """Stops watching (from the main thread)."""
        signal.set_wakeup_fd(-1)
        os.close(self._write)
        self._thread.join(timeout=5)
        os.close(self._read)
