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

import tensorflow as tf


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


class TracedSchedule:
    """:class:`SyncSchedule`'s rule for a program that counts its updates in a trace (a TF2
    program's local SGD, :class:`returnn_tpu.strategies.local_sgd.ScheduledLocalSGDMixin`),
    derived from the host's rule rather than written again: a host schedule is run for the first
    ``2 * param_sync_step`` updates after a (re)start, and what it answers after each (the
    fragments due, those of the sync in flight that are applied, those left in flight) becomes a
    table. From the second cycle on the answers repeat with every cycle (checked here, on a third
    cycle), so the traced clock is one counter, the updates since the last (re)start, and a
    lookup (:meth:`row`, and :meth:`local_round` for ``local_step``'s worker-local rounds).
    Schedules whose answers depend on more than that counter (by time, a warm-up, a ramp) have no
    such table; the TF2 path refuses them (:data:`returnn_tpu.options.NOT_FOR_TF2_PROGRAMS`).
    """

    def __init__(self, param_sync_step: int, *, fragments: int = 1, delay: int = 0, local_step: Optional[int] = None):
        self.param_sync_step = param_sync_step
        self.num_fragments = fragments
        host = SyncSchedule(param_sync_step, fragments=fragments, delay=delay, local_step=local_step)
        rows = [((), (), (), False)]  # row 0: before the first update of a (re)start
        for _ in range(3 * param_sync_step):
            due = host.step() or SyncDue()
            rows.append((due.fragments, due.applied, host.in_flight, due.local))
        cycle = slice(param_sync_step + 1, 2 * param_sync_step + 1)
        assert rows[cycle] == rows[2 * param_sync_step + 1:], "the host schedule does not repeat with its cycle"
        self.rows = rows[:2 * param_sync_step + 1]
        # [row, (due, applied, in flight), fragment]
        self._table = tf.constant([[[i in part for i in range(fragments)] for part in row[:3]] for row in self.rows])
        self._local = tf.constant([row[3] for row in self.rows])

    def row_index(self, updates: tf.Tensor) -> tf.Tensor:
        """The table's row after ``updates`` updates since the last (re)start: itself within the
        first two cycles, then the second cycle's row at the same place of the cycle."""
        n = self.param_sync_step
        return tf.where(updates <= 2 * n, updates, n + 1 + (updates - n - 1) % n)

    def row(self, updates: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """Boolean masks over the fragments after ``updates`` updates since the last (re)start:
        those due now, those of the sync in flight applied now, those in flight afterwards."""
        row = tf.gather(self._table, self.row_index(updates))
        return row[0], row[1], row[2]

    def local_round(self, updates: tf.Tensor) -> tf.Tensor:
        """Whether the replicas of each worker average among themselves after ``updates`` updates
        since the last (re)start (``local_step``; never with a global sync)."""
        return tf.gather(self._local, self.row_index(updates))
