"""What stops a run besides its end: non-finite updates, and stop signals.

The trainer asks :class:`NonFiniteMonitor` every ``NONFINITE_CHECK_STEPS`` steps and before every
sync and checkpoint, so no copy, average or checkpoint is ever non-finite; :class:`StopRequest`
holds a signal until the next step boundary, where the trainer writes the interrupted epoch's
checkpoint and raises :class:`Stopped`.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

NONFINITE_CHECK_STEPS = 50  # how often the device's non-finite counts are read (and, multi-worker, shared)
STOP_CHECK_STEPS = 10  # with several workers, how often they agree whether one was asked to stop


class NonFiniteScore(RuntimeError):
    """The epoch's train score is NaN or Inf (RETURNN stops then, unless stop_on_nonfinite_train_score is off)."""


class NonFiniteUpdate(NonFiniteScore):
    """An update's loss or gradient was NaN or Inf (the update was not applied)."""


class Stopped(RuntimeError):
    """Training stopped at a step boundary because the process got a signal (SIGTERM, SIGINT, SIGHUP)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class NonFiniteMonitor:
    """Reads the steps' counts of updates whose loss or gradient was NaN or Inf (they were not
    applied; FACTS.md, "Non-finite updates") and stops the run, or with ``skip`` counts them.
    All workers see the same counts (one small collective through ``workers``)."""

    def __init__(self, workers, *, skip: bool, num_workers: int, log):
        self.workers = workers
        self.skip = skip
        self.num_workers = num_workers
        self.log = log

    def check(self, steps, epoch_name: str) -> int:
        """The skipped updates since the last check (0 if none), or :class:`NonFiniteUpdate`."""
        local = steps.take_nonfinite()
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
    """A stop signal (SIGTERM, SIGINT, SIGHUP), held until a step boundary; with several workers,
    they agree every ``STOP_CHECK_STEPS`` steps whether any got one."""

    def __init__(self, workers, num_workers: int, log):
        self.workers = workers
        self.num_workers = num_workers
        self.log = log
        self.signum: Optional[int] = None

    def handle(self, signum: int, _frame=None):
        """Signal handler: stop at the next step boundary. A second signal ends the process at
        once, as without this handler."""
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum
        print(f"returnn-tpu: got signal {signum}; stopping at the next step boundary", file=self.log.v1)

    def due(self, step: int) -> Optional[int]:
        """Before step ``step``: the signal to stop for (a peer's counts as SIGTERM), or None."""
        if self.num_workers > 1:
            if step % STOP_CHECK_STEPS or not self.workers.any(self.signum is not None):
                return None
            return self.signum or signal.SIGTERM
        return self.signum
