"""When the replicas' copies are combined, as the training loop asks it: after each update, at the
end of an epoch (before its dev evaluation and checkpoint), at a stop, and when a network starts.

:class:`CopiesAlwaysEqual` answers for synchronous strategies, whose every update is one
all-reduce: nothing to do. :class:`LocalSGDSyncs` answers for local SGD with its schedule and
averaging. So the loop never asks which strategy it runs. ``steps`` is the trainer's
:class:`returnn_tpu.steps.ReplicaSteps` of the current network (it holds the compiled sync
functions); ``stats`` counts the syncs of the epoch (:class:`returnn_tpu.reporting.EpochStats`).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import tensorflow as tf

from returnn_tpu.sync.averaging import ParameterAveraging
from returnn_tpu.sync.schedule import SyncDue, SyncSchedule


class CopiesAlwaysEqual:
    """Synchronous strategies: every update is all-reduced, so the copies never differ."""

    averaging: Optional[ParameterAveraging] = None  # the state a checkpoint holds beside the model: none

    def due(self) -> Optional[SyncDue]:
        """Before an update: what the update syncs (the in-step path passes it into the step)."""
        return None

    def after_update(self, steps, due: Optional[SyncDue], learning_rate: float, stats) -> bool:
        """After an update: the sync ``due`` names, if the step did not make it itself. Returns
        whether the workers' copies were combined (a part of them, with fragments): the model a
        survivor of a lost peer saves moved on."""
        return True

    def at_epoch_end(self, steps, learning_rate: float, stats):
        """Before the epoch's dev evaluation and checkpoint: one model."""

    def now(self, steps, learning_rate: float = 0.0, stats=None):
        """All copies made one model now (before a stop's checkpoint, or when a caller needs it)."""

    def at_network_start(self, steps):
        """After a network's variables are made (and a checkpoint restored): one model everywhere."""

    def network_changed(self):
        """A new network (``pretrain``, ``get_network``) replaces the current one."""

    def start_notes(self, strategy: str, num_replicas: int) -> List[str]:
        """What a user should know of the syncs before the first step."""
        return []

    def synced_model(self) -> Optional[Dict[str, tf.Variable]]:
        """The model of the last sync (parameter name -> variable), which every worker holds; None:
        the parameters themselves (synchronous strategies' copies are always that model)."""
        return None


class LocalSGDSyncs(CopiesAlwaysEqual):
    """Local SGD: ``schedule`` says when, ``averaging`` how the copies are combined. Every full sync
    restarts the schedule's phase. ``sync_steps`` (updates between syncs; None: by time) is for the
    start's warning; ``ignored_local_step``: ``local_param_sync_step`` was set where each worker has
    one replica (nothing to average within a worker)."""

    def __init__(self, averaging: ParameterAveraging, schedule: SyncSchedule, *, sync_steps: Optional[int],
                 ignored_local_step: bool = False):
        self.averaging = averaging
        self.schedule = schedule
        self.sync_steps = sync_steps
        self.ignored_local_step = ignored_local_step

    def due(self) -> Optional[SyncDue]:
        return self.schedule.step()  # param_sync_step counts updates

    def after_update(self, steps, due, learning_rate, stats):
        if due is None:
            return False
        if steps.in_step:  # the step synced: counted, not timed
            stats.add_sync(0.0, steps.sync_bytes(due), local=due.local)
        else:
            self._run(steps, due, learning_rate, stats)
        return not due.local

    def synced_model(self):
        return self.averaging.anchors if self.averaging.keeps_anchor else None

    def at_epoch_end(self, steps, learning_rate, stats):
        if self.schedule.pending():
            self.now(steps, learning_rate, stats)

    def now(self, steps, learning_rate=0.0, stats=None):
        due = self.schedule.all_fragments
        self.schedule.synced()
        self._run(steps, due, learning_rate, stats)

    def at_network_start(self, steps):
        # One model everywhere, whatever each worker loaded, and the anchor that model (at a
        # checkpoint, the anchor is the model: checkpoints are written after a full sync).
        steps.start_sync()
        self.schedule.synced()

    def network_changed(self):
        self.averaging.forget_state()  # the new network's outer state starts from its parameters

    def start_notes(self, strategy, num_replicas):
        notes = []
        if self.ignored_local_step:
            notes.append("distribute_options['local_param_sync_step'] has no effect with one replica per worker")
        if num_replicas == 1:
            notes.append(f"{strategy} with 1 replica trains as on one device (nothing to average); set "
                         "distribute_options['num_replicas'] (CPU: logical devices), or run on several GPUs or "
                         "workers")
        warning = self.averaging.start_warning(self.sync_steps)
        if warning:
            notes.append(f"warning: {warning}")
        return notes

    @staticmethod
    def _run(steps, due: SyncDue, learning_rate: float, stats):
        start = time.perf_counter()
        steps.sync(due, learning_rate)
        if stats is not None:
            stats.add_sync(time.perf_counter() - start, steps.sync_bytes(due), local=due.local)


class OverlappedSyncs(LocalSGDSyncs):
    """Overlapped syncs (``sync_delay`` tau > 0, Streaming DiLoCo): the sync due after an update
    takes each replica's change then, averages it while the next tau updates compute (the
    in-step path: in the next step) and is applied after the tau-th, mixed with each
    replica's copy (:meth:`ParameterAveraging.apply_in_replica`). A sync's seconds are those the
    loop waits: taking the snapshot, the rest of the all-reduce if it has not ended, applying."""

    def after_update(self, steps, due, learning_rate, stats):
        if due is None:
            return False
        start = time.perf_counter()
        if not steps.in_step:
            if due.applied:
                steps.finish_overlapped(due.applied, learning_rate)
            if due.fragments:
                steps.start_overlapped(due.fragments)
            elif due.local:
                steps.sync(due, learning_rate)
        seconds = 0.0 if steps.in_step else time.perf_counter() - start
        if due.fragments or due.local:
            stats.add_sync(seconds, steps.sync_bytes(due), local=due.local)
        else:
            stats.sync_seconds += seconds
        return bool(due.applied)

    def now(self, steps, learning_rate=0.0, stats=None):
        in_flight = self.schedule.take_in_flight()
        if in_flight:
            start = time.perf_counter()
            steps.finish_overlapped(in_flight, learning_rate)
            if stats is not None:
                stats.sync_seconds += time.perf_counter() - start
        super().now(steps, learning_rate, stats)
