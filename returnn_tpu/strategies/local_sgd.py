"""Local SGD as a ``tf.distribute`` strategy: mirrored variables whose copies may differ.

Every replica applies its own gradients to its own copy of each variable; no communication
happens in a training step. The variables are ordinary ``MirroredVariable`` objects and every
reduction reduces as TensorFlow defines it; what makes the copies differ is that the
optimizers of this package apply each replica's gradient to its own copy when the strategy is
a local-SGD one (:func:`returnn_tpu.strategies.is_local_sgd`). Combining the copies is
:mod:`returnn_tpu.sync`'s job.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.distribute import mirrored_strategy


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


class LocalSGDExtended(LocalSGDExtendedMixin, mirrored_strategy.MirroredExtended):
    """Local SGD over the devices of one machine."""


class LocalSGDStrategy(tf.distribute.Strategy):
    """Local SGD over the devices of one machine (a ``MirroredStrategy`` in all but the name).

    >>> strategy = LocalSGDStrategy(["/cpu:0", "/cpu:1"])
    >>> with strategy.scope():
    ...     w = tf.Variable(1.0)
    >>> grads = strategy.experimental_distribute_values_from_function(
    ...     lambda ctx: float(ctx.replica_id_in_sync_group + 1))  # a different gradient per replica
    >>> _ = strategy.extended.update(w, lambda copy, grad: copy.assign_sub(grad), args=(grads,))
    >>> [float(c) for c in strategy.experimental_local_results(w)]
    [0.0, -1.0]
    """

    _collective_key_base = 0  # read by MirroredExtended, as on MirroredStrategy

    def __init__(self, devices=None, cross_device_ops=None, in_step_sync: bool = False):
        """``in_step_sync``: run the sync inside the step, as ``local_sgd_tpu`` does on TPUs."""
        extended = LocalSGDExtended(self, devices=devices, cross_device_ops=cross_device_ops)
        extended.in_step_sync = in_step_sync
        super().__init__(extended)
