"""What marks a strategy as local SGD, and where its steps update: the one test the optimizers'
update path and the trainer's syncs (:func:`returnn_tpu.strategies.make_syncs`) ask, shared by
the single-machine, multi-worker and TPU extendeds. It imports no other module of the package, so
that both :mod:`returnn_tpu.strategies.local_sgd` and :mod:`returnn_tpu.strategies.sync` can use it.
"""

from __future__ import annotations

import tensorflow as tf


class LocalSGDExtendedMixin:
    """Marks an extended as local SGD, shared by the single-machine, multi-worker and TPU ones.

    ``in_step_sync``: the whole step, update and sync, runs in replica context (TPUs run one
    compiled program per step). The sync's all-reduce then sits inside a ``tf.cond``, which
    ``merge_call`` cannot enter; without ``merge_call``, collectives still work and an update in
    replica context goes to the replica's own copy.
    """

    in_step_sync = False

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
