"""When local SGD combines the replicas' copies: the one owner of that decision.

The host asks :meth:`SyncSchedule.step` before every update; the answer (a :class:`SyncDue` or
None) is the same on every worker, and both paths act on it: the host-driven path syncs after
the step, the in-step path passes it into the compiled step. The phase restarts after every
full sync (also the one before each checkpoint), as RETURNN's Horovod mode counts from its
last sync.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class SyncDue:
    """What to sync after a step: ``fragments`` over all replicas, or (``local``) every parameter
    among the replicas of each worker only. With ``sync_delay`` > 0 the syncs of ``fragments``
    start after the step and are applied later; ``applied`` names the fragments of the sync in
    flight whose result is applied after this step, before any new one starts. ``mean_gradient``:
    the update itself is synchronous (the warm-up, ``sync_warmup_steps``): every replica applies
    the replicas' mean gradient, so the copies stay equal and nothing is synced after it."""

    fragments: Tuple[int, ...] = ()
    local: bool = False
    applied: Tuple[int, ...] = ()
    mean_gradient: bool = False


SYNCHRONOUS_UPDATE = SyncDue(mean_gradient=True)


class SyncSchedule:
    """Syncs every ``param_sync_step`` updates, or every ``time_diff`` seconds.

    With ``fragments`` F > 1 (streaming), fragment i is synced at update ``(i + 1) * N / F`` of
    each cycle of N updates, so each fragment once per N updates and one at a time. With
    ``local_step`` L (hierarchical), the replicas of each worker average every L updates that
    are not a global sync. With ``delay`` tau > 0 (overlapped), the sync that starts after
    update t is applied after update t + tau; one sync is in flight at a time (a sync due
    earlier, by time, applies the one in flight first).

    With ``warmup`` W (post-local SGD, Lin et al., 2020; the synchronous start of DiLoCo's
    workers), the first W updates of the whole training are synchronous (:data:`SYNCHRONOUS_UPDATE`)
    and the first cycle starts after them; :meth:`start_at` tells the schedule how many updates a
    resumed run has already made.

    With ``ramp`` R (growing intervals, as the increasing local updates of Haddadpour et al., 2019,
    where early updates, far from a minimum, drift apart most), a cycle that starts u updates
    after the warm-up is ``min(N, 1 + u * N // R)`` updates long: syncs every update at first,
    every N from R updates on. Fragments divide each cycle as they divide N.

    Step counts agree between workers by construction; clocks do not, so with ``time_diff`` the
    workers decide together every ``time_check_steps`` steps (``any_worker``: one small
    collective): due as soon as one worker's time is up.
    """

    def __init__(
        self,
        param_sync_step: int,
        time_diff: Optional[float] = None,
        *,
        fragments: int = 1,
        local_step: Optional[int] = None,
        delay: int = 0,
        any_worker: Callable[[bool], bool] = bool,
        time_check_steps: int = 1,
        warmup: int = 0,
        ramp: int = 0,
    ):
        self.param_sync_step = param_sync_step
        self.time_diff = time_diff
        self.num_fragments = fragments
        self.local_step = local_step
        self.delay = delay
        self.any_worker = any_worker
        self.time_check_steps = time_check_steps
        self.warmup = warmup
        self.ramp = ramp
        self.updates = 0  # of the whole training (the warm-up counts them)
        self.steps_since_sync = 0  # updates in the current cycle
        self._start_cycle()
        self.last_sync_time = time.monotonic()
        self.in_flight: Tuple[int, ...] = ()  # the fragments of the sync started and not yet applied
        self.updates_in_flight = 0  # since it started

    @property
    def all_fragments(self) -> SyncDue:
        return SyncDue(fragments=tuple(range(self.num_fragments)))

    @property
    def warming_up(self) -> bool:
        """Whether the next update is one of the synchronous warm-up's."""
        return self.updates < self.warmup

    def start_at(self, updates: int):
        """The run has made ``updates`` updates (a resumed run: those of its checkpoint)."""
        self.updates = updates
        self._start_cycle()

    def _start_cycle(self):
        """The length of the cycle that starts now (``ramp``) and the update of it after which each
        fragment is synced (the last one ends the cycle)."""
        length = self.param_sync_step
        if self.ramp:
            length = min(length, 1 + max(0, self.updates - self.warmup) * length // self.ramp)
        self.cycle_length = length
        self.fragment_ends = [max(1, round((i + 1) * length / self.num_fragments)) for i in range(self.num_fragments)]

    def step(self) -> Optional[SyncDue]:
        """Counts one update; returns what is due after it (the same answer on every worker)."""
        warming_up = self.warming_up
        self.updates += 1
        if warming_up:
            return SYNCHRONOUS_UPDATE
        self.steps_since_sync += 1
        due = self._due()
        if not self.delay:
            return due
        applied = ()
        if self.in_flight:
            self.updates_in_flight += 1
            if self.updates_in_flight >= self.delay or (due is not None and due.fragments):
                applied = self.take_in_flight()
        if due is not None and due.fragments:
            self.in_flight, self.updates_in_flight = due.fragments, 0
        if due is None and not applied:
            return None
        return SyncDue(fragments=due.fragments if due else (), local=bool(due and due.local), applied=applied)

    def _due(self) -> Optional[SyncDue]:
        if self.time_diff is not None:
            if self.steps_since_sync % self.time_check_steps:
                return None
            if self.any_worker(time.monotonic() - self.last_sync_time >= self.time_diff):
                self.synced()
                return self.all_fragments
            return None
        due = tuple(i for i, end in enumerate(self.fragment_ends) if end == self.steps_since_sync)
        if self.steps_since_sync >= self.cycle_length:
            self.synced()
        if due:
            return SyncDue(fragments=due)
        if self.local_step and self.steps_since_sync % self.local_step == 0:
            return SyncDue(local=True)
        return None

    def take_in_flight(self) -> Tuple[int, ...]:
        """The fragments of the sync in flight, which the caller applies now (before a full sync)."""
        fragments, self.in_flight = self.in_flight, ()
        return fragments

    def pending(self) -> bool:
        """Whether updates happened since the last full sync, or a sync is in flight."""
        return self.steps_since_sync > 0 or bool(self.in_flight)

    def synced(self):
        """A full sync happened (the cycle ends or the epoch ends): the phase restarts."""
        self.steps_since_sync = 0
        self.last_sync_time = time.monotonic()
        self._start_cycle()
