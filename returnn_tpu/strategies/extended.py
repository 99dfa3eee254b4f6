"""What marks a strategy as local SGD, and what it owns: the single-machine, multi-worker and TPU
extendeds of both drivers share :class:`LocalSGDExtendedMixin`. It owns the averaging (and its
state: anchors, outer momenta, residuals), the :class:`~returnn_tpu.strategies.sync.SyncEngine`
that runs each sync, and the schedule; a TF2 program's extended drives them from its traced
program (:class:`returnn_tpu.strategies.local_sgd.ScheduledLocalSGDMixin`), the RETURNN
trainer's from the host (:meth:`LocalSGDExtendedMixin.start_host_syncs`). The sync package
imports nothing of this module: the arrows run one way.
"""

from __future__ import annotations

import tensorflow as tf

from returnn_tpu.strategies.sync import (LocalSGDSyncs, OverlappedSyncs, SyncEngine, SyncSchedule,
                                         make_averaging)


class LocalSGDExtendedMixin:
    """Marks an extended as local SGD, shared by the single-machine, multi-worker and TPU ones.

    ``in_step_sync``: the whole step, update and sync, runs in replica context (TPUs run one
    compiled program per step). The sync's all-reduce then sits inside a ``tf.cond``, which
    ``merge_call`` cannot enter; without ``merge_call``, collectives still work and an update in
    replica context goes to the replica's own copy.
    """

    in_step_sync = False

    def _start_engine(self, options, keep_synced_model: bool):
        """The averaging ``options`` ask for and the engine that runs its syncs;
        ``keep_synced_model``: keep the model of the last sync even where the syncs do not need it
        (several workers: a survivor of a lost peer saves it)."""
        self.averaging = make_averaging(options, keep_synced_model=keep_synced_model)
        self.engine = SyncEngine(self._container_strategy(), self.averaging, options.sync_fragments)

    def _local_step(self, options):
        """``local_param_sync_step`` where this worker has replicas to average among themselves, else None."""
        return options.local_param_sync_step if len(self.worker_devices) > 1 else None

    def start_host_syncs(self, options, *, num_workers: int, any_worker) -> LocalSGDSyncs:
        """The RETURNN trainer's local SGD on this extended: the host's schedule
        (:class:`~returnn_tpu.strategies.sync.SyncSchedule`: steps or seconds, warm-up, ramp,
        worker-local rounds, and ``any_worker(flag)``, True on every worker if on any, for the
        workers' agreement on time, every 10 updates with several workers), the engine, and the
        host driver the trainer's loop calls (:class:`~returnn_tpu.strategies.sync.LocalSGDSyncs`;
        overlapped: :class:`~returnn_tpu.strategies.sync.OverlappedSyncs`)."""
        self._start_engine(options, keep_synced_model=num_workers > 1)
        local_step = self._local_step(options)
        self.schedule = SyncSchedule(
            options.param_sync_step,
            options.param_sync_time_diff,
            fragments=options.sync_fragments,
            local_step=local_step,
            delay=options.sync_delay,
            any_worker=any_worker,
            time_check_steps=1 if num_workers == 1 else 10,
            warmup=options.sync_warmup_steps,
            ramp=options.param_sync_step_ramp,
        )
        driver = OverlappedSyncs if options.sync_delay else LocalSGDSyncs
        strategy = self._container_strategy()
        self.host_syncs = driver(strategy, self.engine, self.schedule, updates_in_replica=updates_in_replica(strategy),
                                 sync_steps=None if options.param_sync_time_diff else options.param_sync_step,
                                 ignored_local_step=bool(options.local_param_sync_step) and local_step is None)
        return self.host_syncs

    def _use_merge_call(self):
        return not self.in_step_sync and super()._use_merge_call()

    def gather_in_replica(self, value: tf.Tensor) -> tf.Tensor:
        """In replica context: every replica's ``value`` (of the same shape), concatenated along
        axis 0 in replica order. ``ReplicaContext.all_gather`` goes through ``merge_call``; the in-step
        path on local devices has none, so this replica's collective launcher gathers, as
        TensorFlow's own replica-context all-reduce does (FACTS.md, "Gathers without merge_call").
        TPUs' replica context gathers without it."""
        context = tf.distribute.get_replica_context()
        launchers = getattr(self, "_collective_ops", None)
        if self._use_merge_call() or launchers is None:
            return context.all_gather(value, axis=0)
        return launchers._launchers[context._replica_id].all_gather(value, axis=0)


def is_local_sgd(strategy: tf.distribute.Strategy) -> bool:
    """Whether the replicas of ``strategy`` keep their own parameters until a sync."""
    return isinstance(strategy.extended, LocalSGDExtendedMixin)


def updates_in_replica(strategy: tf.distribute.Strategy) -> bool:
    """Whether the whole step, update and local-SGD sync included, runs in replica context (TPU
    strategies, and ``local_sgd_tpu`` on local devices)."""
    return isinstance(strategy, tf.distribute.TPUStrategy) or getattr(strategy.extended, "in_step_sync", False)
