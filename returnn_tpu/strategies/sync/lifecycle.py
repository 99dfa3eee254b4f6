"""The RETURNN trainer's side of a strategy: where an update's gradients are combined, and what
happens to the replicas' copies after each update, at the end of an epoch (before its dev
evaluation and checkpoint), at a stop, and when a network starts.

The trainer asks one object, which :func:`returnn_tpu.strategies.make_syncs` makes for its
strategy, and never which strategy it runs:

* :class:`CopiesAlwaysEqual` (synchronous strategies): every update takes the replicas' mean
  gradient, so the copies never differ.
* :class:`LocalSGDSyncs`: each replica applies its own gradient; ``schedule`` says when and
  ``averaging`` how the copies are combined, by functions compiled for each network
  (:meth:`LocalSGDSyncs.attach`). The host path runs them between steps; the in-step path
  (``updates_in_replica``: TPUs, and ``local_sgd_tpu`` on local devices, where a step is one
  program run in replica context) runs them inside the step, under ``tf.cond`` on flags the host
  passes for the fragments due (:meth:`LocalSGDSyncs.step_flags`).
* :class:`OverlappedSyncs`: ``sync_delay`` > 0.

With ``sync_warmup_steps`` the schedule makes the first updates synchronous: the train step then
takes :meth:`CopiesAlwaysEqual.update_rules` ``(True)``, the rules of a synchronous strategy.

``stats`` counts the syncs of the epoch (:class:`returnn_tpu.reporting.EpochStats`); the
driver's :attr:`CopiesAlwaysEqual.sync_stats` counts those of the process, by the keys of a TF2
program's ``strategy.extended.sync_stats``.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from returnn_tpu.strategies.sync.averaging import ParameterAveraging
from returnn_tpu.strategies.sync.background import BackgroundCalls
from returnn_tpu.strategies.sync.engine import SyncEngine, Variables
from returnn_tpu.strategies.sync.schedule import SyncDue, SyncSchedule


class CopiesAlwaysEqual:
    """Synchronous strategies: every update is the replicas' mean gradient, so the copies never
    differ. ``updates_in_replica``: the update runs inside ``strategy.run`` (TPUs) and all-reduces
    the gradients there; otherwise the optimizer reduces them in cross-replica context."""

    averaging: Optional[ParameterAveraging] = None  # the state a checkpoint holds beside the model: none
    reduces_gradients = True  # whether the optimizer's update (host path) takes the replicas' mean gradient

    def __init__(self, strategy: tf.distribute.Strategy, *, updates_in_replica: bool):
        self.strategy = strategy
        self.updates_in_replica = updates_in_replica
        self.local_replicas = len(strategy.extended.worker_devices)
        self.update_bytes = 0  # this worker's gradients in one update's all-reduce
        self._totals = {"updates": 0, "syncs": 0, "local_syncs": 0, "bytes": 0}

    def attach(self, variables: Variables, optimizer):
        """A network's trainable variables exist (``variables()`` returns them by name) and
        ``optimizer`` (its ``slots_by_variable()``, ``slot_step`` and ``step``) updates them."""
        if self.strategy.num_replicas_in_sync > 1:
            self.update_bytes = self.local_replicas * sum(
                var.shape.num_elements() * var.dtype.size for var in variables().values())

    # ---- inside the train step ---------------------------------------------------------------

    def update_rules(self, mean_gradient: bool) -> "CopiesAlwaysEqual":
        """Whose :meth:`all_finite`, :meth:`gradients_in_replica` and :attr:`reduces_gradients` an
        update follows: ``mean_gradient`` (:attr:`SyncDue.mean_gradient`) asks for a synchronous one."""
        return self

    def all_finite(self, finite):
        """Host path, cross-replica context: where the update applies, given each replica's
        ``finite``: one replica's non-finite gradient spoils the mean, so all skip it."""
        bad = self.strategy.run(lambda ok: tf.cast(tf.logical_not(ok), tf.int32), args=(finite,))
        return tf.equal(self.strategy.reduce(tf.distribute.ReduceOp.SUM, bad, axis=None), 0)

    def gradients_in_replica(self, grads: List[tf.Tensor], finite) -> Tuple[List[tf.Tensor], tf.Tensor]:
        """In-step path, replica context: the gradients this replica applies, and whether it applies them."""
        context = tf.distribute.get_replica_context()
        grads = context.all_reduce(tf.distribute.ReduceOp.MEAN, grads)
        finite = tf.equal(context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.int32)), 0)
        return grads, finite

    def step_flags(self, due: Optional[SyncDue]) -> tuple:
        """In-step path: the train step's arguments that say what it syncs (``due`` from :meth:`due`)."""
        return ()

    def before_update_in_replica(self, flags: tuple):
        """In-step path, replica context: what the step does before its forward and backward pass."""

    def after_update_in_replica(self, flags: tuple, learning_rate):
        """In-step path, replica context: what the step does after its update."""

    # ---- the training loop's sync points ------------------------------------------------------

    def due(self) -> Optional[SyncDue]:
        """Before an update: what the update syncs (the in-step path passes it into the step)."""
        return None

    def after_update(self, due: Optional[SyncDue], learning_rate: float, stats) -> bool:
        """After an update: the sync ``due`` names, if the step did not make it itself. Returns
        whether the workers' copies were combined (a part of them, with fragments): the model a
        survivor of a lost peer saves moved on."""
        self._totals["updates"] += 1
        return self._after_update(due, learning_rate, stats)

    def _after_update(self, due: Optional[SyncDue], learning_rate: float, stats) -> bool:
        self._count(stats, sent_bytes=self.update_bytes)
        return True

    def _count(self, stats, seconds: float = 0.0, sent_bytes: int = 0, sync: Optional[str] = None):
        """What an update or a sync cost, counted in the epoch's ``stats`` (if any) and in
        :attr:`sync_stats`: its seconds in the loop, the bytes this worker handed to collectives,
        and, for ``sync`` ``"syncs"`` or ``"local_syncs"``, one sync of that kind."""
        self._totals["bytes"] += sent_bytes
        if sync:
            self._totals[sync] += 1
        if stats is not None:
            stats.sync_seconds += seconds
            stats.sync_bytes += sent_bytes
            if sync:
                setattr(stats, sync, getattr(stats, sync) + 1)

    @property
    def sync_stats(self) -> dict:
        """What this process did since it started: the updates, the syncs between all replicas (a
        fragment's sync counts as one), the worker-local rounds, and the bytes this worker handed
        to them (synchronous strategies: the gradients' all-reduces). The keys are those of a TF2
        program's ``strategy.extended.sync_stats``."""
        return dict(self._totals)

    def at_epoch_end(self, learning_rate: float, stats):
        """Before the epoch's dev evaluation and checkpoint: one model."""

    def sync_now(self, learning_rate: float = 0.0, stats=None):
        """All copies made one model now (before a stop's checkpoint, or when a caller needs it)."""

    def at_network_start(self):
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

    def checkpoint_state(self) -> Dict[str, tf.Variable]:
        """The state of the syncs a checkpoint holds beside the model and the optimizer, by name
        (local SGD's anchors and outer momenta; none for synchronous strategies and plain averaging)."""
        return self.averaging.state_variables() if self.averaging else {}


class LocalSGDSyncs(CopiesAlwaysEqual):
    """Local SGD, driven from the host: ``schedule`` says when, ``engine`` (:class:`SyncEngine`, with
    its averaging) how the copies are combined. Every full sync restarts the schedule's phase.
    ``sync_steps`` (updates between syncs; None: by time) is for the start's warning;
    ``ignored_local_step``: ``local_param_sync_step`` was set where each worker has one replica
    (nothing to average within a worker)."""

    reduces_gradients = False

    def __init__(self, strategy, engine: SyncEngine, schedule: SyncSchedule, *, updates_in_replica: bool,
                 sync_steps: Optional[int], ignored_local_step: bool = False):
        super().__init__(strategy, updates_in_replica=updates_in_replica)
        self.engine = engine
        self.averaging = engine.averaging
        self.schedule = schedule
        self.sync_steps = sync_steps
        self.ignored_local_step = ignored_local_step
        self._optimizer = None
        # The warm-up's updates (``sync_warmup_steps``) follow a synchronous strategy's rules.
        self._synchronous = CopiesAlwaysEqual(strategy, updates_in_replica=updates_in_replica)

    def attach(self, variables, optimizer):
        self._synchronous.attach(variables, optimizer)
        self._optimizer = optimizer
        self.engine.attach(variables, optimizer)
        self.averaging.create_state(self.strategy, variables())
        self._sync = tf.function(self._sync_fn, autograph=False)  # one trace per kind of sync
        self._start_sync = tf.function(self._start_sync_fn, autograph=False)

    def update_rules(self, mean_gradient):
        return self._synchronous if mean_gradient else self

    def all_finite(self, finite):
        return finite  # each replica's own update

    def gradients_in_replica(self, grads, finite):
        return grads, finite

    def step_flags(self, due):
        if not self.updates_in_replica:
            return ()
        if due is not None and due.local:
            raise ValueError("worker-local syncs need merge_call, which the in-step path does not have")
        return (self._fragment_flags(due.fragments if due else ()),)

    def after_update_in_replica(self, flags, learning_rate):
        # Ordered after the update (same resources).
        for index in range(self.schedule.num_fragments):
            tf.cond(flags[0][index], lambda i=index: self._replica_sync((i,), False, learning_rate),
                    lambda: tf.constant(False))

    def due(self):
        return self.schedule.step()  # param_sync_step counts updates

    def _after_update(self, due, learning_rate, stats):
        if due is None:
            return False
        if due.mean_gradient:
            return self._after_synchronous_update(stats)
        if self.updates_in_replica:  # the step synced: counted, not timed
            self._count_sync(stats, 0.0, due)
        else:
            self._run(due, learning_rate, stats)
        return not due.local

    def synced_model(self):
        # In the warm-up the copies are that model; the anchor is set when local SGD starts.
        return None if self.schedule.warming_up else self.engine.synced_model()

    def at_epoch_end(self, learning_rate, stats):
        if self.schedule.pending():
            self.sync_now(learning_rate, stats)

    def sync_now(self, learning_rate=0.0, stats=None):
        if self.schedule.warming_up:
            return  # the copies are equal after every synchronous update (and an outer step has no anchor yet)
        due = self.schedule.all_fragments
        self.schedule.synced()
        self._run(due, learning_rate, stats)

    def at_network_start(self):
        # One model everywhere, whatever each worker loaded, and the anchor that model (at a
        # checkpoint, the anchor is the model: checkpoints are written after a full sync).
        self._start_sync()
        self.schedule.synced()
        self.schedule.start_at(int(self._optimizer.step.numpy()))  # where the warm-up stands

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
        if self.schedule.warmup:
            notes.append(f"the first {self.schedule.warmup} updates are synchronous (sync_warmup_steps); local SGD "
                         "starts after them")
        if self.schedule.ramp:
            notes.append(f"the interval between syncs grows from 1 to {self.schedule.param_sync_step} updates over "
                         f"{self.schedule.ramp} updates (param_sync_step_ramp)")
        warning = self.averaging.start_warning(self.sync_steps)
        if warning:
            notes.append(f"warning: {warning}")
        return notes

    def _count_sync(self, stats, seconds: float, due: SyncDue):
        """One sync of ``due`` counted: ``seconds`` of the loop's, the bytes this worker hands to its collective."""
        self._count(stats, seconds, self.engine.sync_bytes(due.fragments, due.local),
                    sync="local_syncs" if due.local else "syncs")

    def _after_synchronous_update(self, stats) -> bool:
        """After a warm-up update: its gradients' bytes counted; after the last one, local SGD
        starts from the model every copy holds, which becomes the first cycle's anchor."""
        self._count(stats, sent_bytes=self._synchronous.update_bytes)
        if not self.schedule.warming_up:
            self._start_sync()
            self.schedule.synced()
        return True

    def _run(self, due: SyncDue, learning_rate: float, stats):
        start = time.perf_counter()
        self._sync_between_steps(due, learning_rate)
        self._count_sync(stats, time.perf_counter() - start, due)

    def _sync_between_steps(self, due: SyncDue, learning_rate: float):
        """Host path: the sync ``due`` names, between steps."""
        self._sync(tuple(due.fragments), due.local, tf.constant(learning_rate, tf.float32))

    def _fragment_flags(self, fragments: Tuple[int, ...]) -> tf.Tensor:
        return tf.constant([i in fragments for i in range(self.schedule.num_fragments)])

    # ---- traced: the syncs in replica context, and the host path's functions ----------------------

    def _replica_sync(self, fragments: Tuple[int, ...], local: bool, learning_rate) -> tf.Tensor:
        """In replica context: the sync of the named fragments, or a worker-local one."""
        self.engine.sync_in_replica(fragments, learning_rate, local)
        return tf.constant(True)

    def _sync_fn(self, fragments: Tuple[int, ...], local: bool, learning_rate):
        self.strategy.run(self._replica_sync, args=(fragments, local, learning_rate))

    def _start_sync_fn(self):
        """All copies, on all workers, one model and the averaging's anchor (no outer step)."""
        self.strategy.run(self.engine.start_in_replica)


class OverlappedSyncs(LocalSGDSyncs):
    """Overlapped syncs (``sync_delay`` tau > 0, Streaming DiLoCo): the sync due after an update
    takes each replica's change then, averages it while the next tau updates compute (the
    in-step path: in the next step) and is applied after the tau-th, mixed with each
    replica's copy (:meth:`ParameterAveraging.apply_in_replica`). A sync's seconds are those the
    loop waits: taking the snapshot, the rest of the all-reduce if it has not ended, applying."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._background: Optional[BackgroundCalls] = None  # host path: where the all-reduce in flight runs
        self._unreduced: Tuple[int, ...] = ()  # in-step path: fragments taken by the last step, reduced by the next

    def attach(self, variables, optimizer):
        super().attach(variables, optimizer)
        self._unreduced = ()
        self._snapshot = tf.function(self._snapshot_fn, autograph=False)
        self._reduce = tf.function(self._reduce_fn, autograph=False)
        self._apply = tf.function(self._apply_fn, autograph=False)

    def step_flags(self, due):
        if not self.updates_in_replica:
            return ()
        # What the step syncs, which fragments of the sync in flight it applies, and which it all-reduces.
        return super().step_flags(due) + (self._fragment_flags(due.applied if due else ()),
                                          self._fragment_flags(self._unreduced))

    def before_update_in_replica(self, flags):
        # The all-reduce of the last step's snapshot depends on nothing of this step's forward and
        # backward pass, so they may run at the same time.
        for index in range(self.schedule.num_fragments):
            tf.cond(flags[2][index], lambda i=index: self._replica_reduce((i,)), lambda: tf.constant(False))

    def after_update_in_replica(self, flags, learning_rate):
        # The one in flight applied, then what is due starts.
        due, applied = flags[0], flags[1]
        for index in range(self.schedule.num_fragments):
            tf.cond(applied[index], lambda i=index: self._replica_apply((i,), learning_rate),
                    lambda: tf.constant(False))
        for index in range(self.schedule.num_fragments):
            tf.cond(due[index], lambda i=index: self._replica_start_overlapped((i,)), lambda: tf.constant(False))

    def _after_update(self, due, learning_rate, stats):
        if due is not None and due.mean_gradient:
            return self._after_synchronous_update(stats)
        if self.updates_in_replica:
            self._unreduced = due.fragments if due else ()  # the next step all-reduces what this one took
        if due is None:
            return False
        start = time.perf_counter()
        if not self.updates_in_replica:
            if due.applied:
                self._finish_overlapped(due.applied, learning_rate)
            if due.fragments:
                self._start_overlapped(due.fragments)
            elif due.local:
                self._sync_between_steps(due, learning_rate)
        seconds = 0.0 if self.updates_in_replica else time.perf_counter() - start
        if due.fragments or due.local:
            self._count_sync(stats, seconds, due)
        else:
            self._count(stats, seconds)
        return bool(due.applied)

    def sync_now(self, learning_rate=0.0, stats=None):
        in_flight = self.schedule.take_in_flight()
        if in_flight:
            start = time.perf_counter()
            self._finish_overlapped(in_flight, learning_rate)
            self._count(stats, time.perf_counter() - start)
        super().sync_now(learning_rate, stats)

    def _start_overlapped(self, fragments: Tuple[int, ...]):
        """Host path: takes each replica's change of ``fragments`` now and starts their all-reduce,
        which runs in the background while the next steps compute."""
        fragments = tuple(fragments)
        self._snapshot(fragments)
        if self._background is None:
            self._background = BackgroundCalls()
        self._background.call(self._reduce, fragments)

    def _finish_overlapped(self, fragments: Tuple[int, ...], learning_rate: float):
        """Waits for the all-reduce in flight (host path; an error in it, such as a lost peer, is
        raised here; in-step path: all-reduces what no step has yet) and applies the sync of
        ``fragments``."""
        if self._background is not None:
            self._background.wait()  # bounded by the collective's own timeout and the peers' health check
        if self._unreduced:
            self._reduce(self._unreduced)
            self._unreduced = ()
        self._apply(tuple(fragments), tf.constant(learning_rate, tf.float32))

    def _replica_start_overlapped(self, fragments: Tuple[int, ...]) -> tf.Tensor:
        """In-step path: an overlapped sync's snapshot, after the update of the step it starts at."""
        self.engine.snapshot_in_replica(fragments)
        return tf.constant(True)

    def _replica_reduce(self, fragments: Tuple[int, ...]) -> tf.Tensor:
        self.engine.reduce_in_replica(fragments)
        return tf.constant(True)

    def _replica_apply(self, fragments: Tuple[int, ...], learning_rate) -> tf.Tensor:
        self.engine.apply_in_replica(fragments, learning_rate)
        return tf.constant(True)

    def _snapshot_fn(self, fragments: Tuple[int, ...]):
        self.strategy.run(self._replica_start_overlapped, args=(fragments,))

    def _reduce_fn(self, fragments: Tuple[int, ...]):
        self.strategy.run(self._replica_reduce, args=(fragments,))

    def _apply_fn(self, fragments: Tuple[int, ...], learning_rate):
        self.strategy.run(self._replica_apply, args=(fragments, learning_rate))
