"""What a run saves and says when it stops early: a stop signal or the time limit at a step
boundary, a signal in the middle of a long step, and a lost worker.

Each writes a checkpoint the same command continues from (:class:`returnn_tpu.checkpoints.RunCheckpoints`)
and ends in one line, made by :func:`resume_hint`: which model is where, and at which step the
same command continues. :class:`returnn_tpu.faults.StopRequest` decides *whether* a run stops
at a step boundary; :class:`RunStops` does the stopping.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterable, Optional, Tuple

import returnn_tpu
from returnn_tpu.cluster.mpi import mpirun_kill_grace
from returnn_tpu.errors import ConfigError
from returnn_tpu.faults import PeerLost, SignalWatch, StopRequest, Stopped

LAST_SYNC = "the model of the last sync"
NOTHING_NEW = "nothing was trained since the newest checkpoint: run the same command to resume"


def resume_hint(prefix: Optional[str], model: str, epoch_name: str, next_step: int) -> str:
    """``"<model> is in <prefix>: run the same command to continue <epoch_name> at step <next_step>"``;
    :data:`NOTHING_NEW` if no checkpoint was written (``prefix`` None: one as new is on disk)."""
    if prefix is None:
        return NOTHING_NEW
    return f"{model} is in {prefix}: run the same command to continue {epoch_name} at step {next_step}"


class RunStops:
    """The trainer's early stops, on its ``checkpoints``, ``syncs`` (the model of the last sync),
    ``workers`` and ``network`` (whether its variables exist); ``epoch_name(epoch)`` as RETURNN
    names epochs in its log. ``options``' ``time_limit`` is a stop too (:attr:`request`, which
    agrees across the ``num_workers`` workers).

    :ivar lock: held while the model of the last sync or its point changes (the build and restore,
        a sync, a step that syncs inside itself), so that :meth:`at_signal`, on another thread,
        writes a whole one.
    """

    def __init__(self, options, checkpoints, syncs, workers, network, *, num_workers: int,
                 epoch_name: Callable[[int], str], log):
        stop_at = (returnn_tpu.STARTED + options.time_limit - options.stop_before_time_limit
                   if options.time_limit else None)
        # Its handler is installed by cli.py.
        self.request = StopRequest(workers, num_workers, log, stop_at, kill_grace=mpirun_kill_grace(os.environ))
        self.checkpoints = checkpoints
        self.syncs = syncs
        self.workers = workers
        self.network = network
        self.options = options
        self.epoch_name = epoch_name
        self.log = log
        self.lock = threading.Lock()
        self._signal_watch: Optional[SignalWatch] = None

    def _save_last_sync(self) -> Tuple[Optional[str], str]:
        """Writes the model of the last sync as the interrupted checkpoint (unless one as new is on
        disk): its prefix (or None) and the line that says where the same command continues."""
        point = self.checkpoints.last_sync
        prefix = self.checkpoints.save_last_sync(self.syncs.synced_model())
        if prefix is None:
            return None, NOTHING_NEW
        return prefix, resume_hint(prefix, LAST_SYNC, self.epoch_name(point.epoch), point.steps_done + 1)

    # ---- a signal while a step runs ----------------------------------------------------------

    def watch_signals(self, signals: Iterable[int]):
        """From now on, a stop signal also has the model of the last sync written at once, on
        another thread, whatever the step running meanwhile is doing (:meth:`at_signal`)."""
        self._signal_watch = SignalWatch(signals, self.at_signal)

    def at_signal(self, signum: int):
        """At the first stop signal (on the watch's thread): writes the model of the last sync,
        so that a launcher's SIGKILL soon after its signal (``mpirun``: 1 s) loses at most what
        was trained since that sync; the loop goes on to stop at the next step boundary as
        before, and writes a newer one if it gets there. Synchronous strategies' parameters change
        within a step: only the step boundary writes them."""
        if self.request.signum not in (None, signum):
            return  # a second signal: the handler ends the process
        with self.lock:
            if not self.network.built or self.syncs.synced_model() is None:
                return
            try:
                prefix, hint = self._save_last_sync()
            except Exception as exc:  # noqa: BLE001 (the loop's own save at the step boundary still follows)
                print(f"returnn-tpu: at signal {signum}: could not write {LAST_SYNC}: {exc}", file=self.log.v1)
                return
        if prefix:
            print(f"returnn-tpu: at signal {signum}: {hint}", file=self.log.v1)

    def close(self):
        """Stops watching for signals (from the main thread)."""
        if self._signal_watch:
            self._signal_watch.close()
            self._signal_watch = None

    # ---- at a step boundary, and while the data starts ---------------------------------------

    def at_step_boundary(self, epoch: int, step: int, step_seconds: float, *, stepped: bool,
                         one_model: Callable[[], None], streams: Callable[[int], Optional[dict]]):
        """Before step ``step`` of ``epoch`` (steps take ``step_seconds``): if a stop is due on any
        worker, makes the copies one model (``one_model()``), has the chief write the interrupted
        epoch's checkpoint with where the data ``streams(step)`` stand, and raises :class:`Stopped`.
        ``stepped``: whether this process has made a step (a time limit before the first one
        would stop every resubmission there: bad input)."""
        stop = self.request.due(step, step_seconds)
        if stop is None:
            return
        where = f"{stop} in {self.epoch_name(epoch)} before step {step + 1}"
        if stop.signum is None and not stepped:
            options = self.options
            raise ConfigError(
                f"distribute_options['time_limit']: the run reached its stop before the time limit "
                f"({options.time_limit:g} s minus stop_before_time_limit {options.stop_before_time_limit:g} s) "
                f"after {time.perf_counter() - returnn_tpu.STARTED:.0f} s, before its first step; give the job more "
                "time, or a smaller stop_before_time_limit")
        if stop.at_last_sync and self.network.built:  # no time to agree: every worker has the last sync's model
            raise Stopped(f"{where}; {self._save_last_sync()[1]}", stop.signum)
        previous = self.checkpoints.epoch_filename(epoch - 1) if epoch > 1 else None
        if not self.network.built or (step == 0 and previous and os.path.exists(previous + ".index")):
            raise Stopped(f"{where}; {NOTHING_NEW}", stop.signum)
        one_model()
        prefix = self.checkpoints.save_interrupted(epoch, step, streams(step))
        self.workers.all_workers(0)  # the chief has written it
        raise Stopped(f"{where}; {resume_hint(prefix, 'the combined model', self.epoch_name(epoch), step + 1)}",
                      stop.signum)

    def within_grace(self, step_seconds: float, save: Callable[[], None]):
        """``save()``s the epoch; under ``mpirun``, says in one line if a step (``step_seconds``) or
        the save takes longer than the launcher's grace after a stop signal (:meth:`StopRequest.check_grace`)."""
        self.request.check_grace("a step", step_seconds)
        start = time.perf_counter()
        save()
        self.request.check_grace("saving the model", time.perf_counter() - start)

    def while_waiting(self, epoch: int):
        """While the producer starts an epoch (RETURNN's ``init_seq_order``, long for some
        datasets): a stop signal ends the run there; nothing of the epoch was trained, so the
        newest checkpoint is where the same command resumes."""
        signum = self.request.signum
        if signum is not None:
            raise Stopped(f"stopped by signal {signum} while the data producer started {self.epoch_name(epoch)}; "
                          "nothing of it was trained: run the same command to resume", signum)

    # ---- a lost worker -----------------------------------------------------------------------

    def after_peer_loss(self, exc: Exception) -> PeerLost:
        """A collective failed because a worker is gone: this survivor writes the model of the
        last sync; the error to end the run with."""
        return PeerLost(exc, self._save_last_sync()[1])
