"""Local SGD as a ``tf.distribute`` strategy.

Every replica applies its own gradients to its own copy of each variable; no communication
happens in a training step. :meth:`LocalSGDStrategy.sync` replaces every copy by the mean over
all replicas; the trainer calls it every ``param_sync_step`` steps (or every
``param_sync_time_diff`` seconds), before each checkpoint and before each evaluation.

The variables are ordinary ``MirroredVariable`` objects; only the meaning of one reduction
changes. Optimizers reduce the gradients with ``extended.batch_reduce_to(op, [(grad, var)])``
before they apply them; when the destination of such a pair is a distributed variable, this
extended returns the per-replica gradients unreduced, so each replica's gradient reaches only
its own copy. Every other reduction (``strategy.reduce``, ``ReplicaContext.all_reduce``, and
the parameter average itself, whose destinations are the per-replica values) reduces as usual,
so metrics and all-reduced flags still agree between replicas.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import values as tf_values


class LocalSGDExtendedMixin:
    """The local-SGD behaviour, shared by the single-machine and multi-worker extendeds.

    Subclasses override :meth:`average_replica_values` to change how copies are combined
    (outer momentum, hierarchical or compressed averaging).

    Two ways to run the algorithm, with the same semantics:

    * cross-replica (``local_sgd`` on devices and workers): the step applies each replica's
      gradients (:meth:`_batch_reduce_to` skips the reduction), the trainer calls
      :meth:`sync_variables` between steps when a sync is due;
    * inside the step (``local_sgd_tpu``; TPUs run one compiled program per step): each replica
      applies its own gradients in replica context and :meth:`sync_in_replica` averages with a
      cross-replica mean under ``tf.cond`` on a flag computed from the step counter, so all
      replicas take the same branch.
    """

    in_step_sync = False  # whether the sync runs inside the replica step (no merge_call)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        if value_destination_pairs and all(
            isinstance(dest, tf_values.DistributedVariable) for _, dest in value_destination_pairs
        ):
            # Optimizer apply path: each replica keeps its own gradient.
            return [value for value, _ in value_destination_pairs]
        return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)

    def _reduce_to(self, reduce_op, value, destinations, options):
        if isinstance(destinations, tf_values.DistributedVariable) and isinstance(value, tf_values.PerReplica):
            return value
        return super()._reduce_to(reduce_op, value, destinations, options)

    def average_replica_values(self, per_replica_values: Sequence[tf_values.PerReplica]) -> list:
        """Returns the mean over all replicas of each value, as mirrored values.

        All means are computed (one batched all-reduce) before the caller assigns any of them.
        """
        pairs = [(value, value) for value in per_replica_values]
        return self.batch_reduce_to(tf.distribute.ReduceOp.MEAN, pairs)

    def _use_merge_call(self):
        # In-step sync all-reduces inside tf.cond, which merge_call cannot do; collectives can.
        # Without merge_call, updates in replica context go to the replica's own copy.
        return not self.in_step_sync and super()._use_merge_call()

    def sync_in_replica(self, variables: Sequence[tf.Variable], due: tf.Tensor):
        """In replica context: if ``due`` (the same on all replicas), average ``variables``."""
        context = tf.distribute.get_replica_context()

        def average():
            means = context.all_reduce(tf.distribute.ReduceOp.MEAN, [tf.identity(v) for v in variables])
            return tf.group(
                [self.update(v, lambda local, mean: local.assign(mean), args=(m,)) for v, m in zip(variables, means)]
            )

        return tf.cond(due, average, tf.no_op)

    def sync_variables(self, variables: Sequence[tf.Variable]):
        """Replaces every replica's copy of each variable by the mean over all replicas.

        Call in cross-replica context (inside or outside a ``tf.function``).
        """
        per_replica = [
            tf_values.PerReplica(tuple(tf.identity(component) for component in var.values)) for var in variables
        ]
        means = self.average_replica_values(per_replica)
        return tf.group([var.assign(mean) for var, mean in zip(variables, means)])


class LocalSGDExtended(LocalSGDExtendedMixin, mirrored_strategy.MirroredExtended):
    """Local SGD over the devices of one machine. All behaviour is in the mixin."""


class LocalSGDStrategy(tf.distribute.Strategy):
    """Local SGD over the devices of one machine.

    Each replica trains its own copy of the parameters; :meth:`sync` averages the copies.
    Averaging after every step gives the same parameters as ``MirroredStrategy`` with plain SGD.

    >>> strategy = LocalSGDStrategy(["/cpu:0", "/cpu:1"])
    >>> with strategy.scope():
    ...     w = tf.Variable(1.0)
    >>> @tf.function
    ... def train_step():
    ...     def replica_step():
    ...         replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    ...         return tf.cast(replica, tf.float32) + 1.0  # a different "gradient" per replica
    ...     grads = strategy.run(replica_step)
    ...     grads = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.MEAN, [(grads, w)])[0]
    ...     strategy.extended.update(w, lambda v, g: v.assign_sub(g), args=(grads,))
    >>> train_step()
    >>> [float(c) for c in strategy.experimental_local_results(w)]
    [0.0, -1.0]
    >>> strategy.sync([w])
    >>> [float(c) for c in strategy.experimental_local_results(w)]
    [-0.5, -0.5]
    """

    _collective_key_base = 0  # read by MirroredExtended, as on MirroredStrategy

    def __init__(self, devices=None, cross_device_ops=None, in_step_sync: bool = False):
        """``in_step_sync``: run the sync inside the step, as ``local_sgd_tpu`` does on TPUs."""
        extended = LocalSGDExtended(self, devices=devices, cross_device_ops=cross_device_ops)
        extended.in_step_sync = in_step_sync
        super().__init__(extended)

    def sync(self, variables: Sequence[tf.Variable]):
        """Averages ``variables`` over all replicas (cross-replica context)."""
        return self.extended.sync_variables(variables)
