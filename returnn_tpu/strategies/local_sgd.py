"""Local SGD as a ``tf.distribute`` strategy: mirrored variables whose copies may differ.

Every replica applies its own gradients to its own copy of each variable; no communication
happens in a training step. The variables are ordinary ``MirroredVariable`` objects.

* :class:`TrainerLocalSGDStrategy` (the RETURNN trainer's): every reduction reduces as TensorFlow
  defines it; the package's optimizers apply each replica's gradient to its own copy
  (:func:`returnn_tpu.strategies.is_local_sgd`), and :mod:`returnn_tpu.sync` combines the copies.
* :class:`LocalSGDStrategy` (a TF2 or Keras program's): its extended
  (:class:`ScheduledLocalSGDMixin`) gives TensorFlow's and Keras' own update path local-SGD
  semantics, decides when to sync and combines the copies; :class:`SyncCallback` combines them
  where Keras reads the model.
"""

from __future__ import annotations

from typing import Optional

import keras
import tensorflow as tf
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import values as values_lib


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


class ScheduledLocalSGDMixin:
    """What makes an extended that a TF2 or Keras program trains with local SGD: it gives
    TensorFlow's and Keras' own update path local-SGD semantics and owns the schedule
    (docs/FACTS.md, "Local SGD for TF2 programs").

    * A replica-context all-reduce of gradients (Keras' optimizers sum the replicas' gradients
      with ``ReplicaContext.all_reduce``, which reaches :meth:`batch_reduce_to` in a
      ``merge_call``) leaves each replica its own: a SUM of gradients of a loss scaled to the
      global batch (``tf.nn.compute_average_loss``, Keras' ``scale_loss``) is the replica's own
      batch's mean gradient, so ``extended.update`` applies it to the replica's own copy.
    * Every such all-reduce is one update; after the update of every ``param_sync_step``-th one,
      each trainable variable's copies are averaged over all replicas as it is updated
      (:meth:`_update`).
    * :meth:`sync_now` averages every trainable variable at once (before evaluating, saving or
      reading the model in cross-replica context, which sees the first replica's copy).

    * With an ``outer_optimizer`` (DiLoCo's Nesterov), the copies' mean is not the new model:
      the outer gradient ``g = anchor - mean`` takes a Nesterov momentum step from the anchor
      (``m = momentum * m + g``, ``new = anchor - learning_rate * (g + momentum * m)``, the
      trainer's rule), and the anchor and ``m`` are this extended's variables, one each per
      trainable variable, made beside it in the scope (:attr:`outer_state`).

    The other local-SGD options are the RETURNN trainer's so far (:class:`TrainerLocalSGDStrategy`).
    Concrete extendeds call :meth:`_start_schedule` after their base's ``__init__`` (a
    multi-worker one must create no variable before it).
    """

    def _start_schedule(self, param_sync_step: int, outer_optimizer: Optional[dict] = None):
        self.param_sync_step = param_sync_step
        self.outer_optimizer = outer_optimizer
        # Outside the strategy's scope (plain host variables): the updates so far, the syncs made.
        self._updates = tf.Variable(0, dtype=tf.int64, trainable=False, name="local_sgd/updates")
        self._syncs = tf.Variable(0, dtype=tf.int64, trainable=False, name="local_sgd/syncs")
        self._synced_variables = []  # the trainable variables made in the scope
        self.outer_state = {}  # id of a synced variable -> (its anchor, its outer momentum)

    def _create_variable(self, next_creator, **kwargs):
        var = super()._create_variable(next_creator, **kwargs)
        if kwargs.get("trainable", True):
            self._synced_variables.append(var)
            if self.outer_optimizer is not None:
                name = var.name.split(":")[0]
                anchor = super()._create_variable(next_creator, initial_value=lambda: tf.identity(var.read_value()),
                                                  trainable=False, name=f"{name}/local_sgd_anchor")
                momentum = super()._create_variable(next_creator, initial_value=lambda: tf.zeros(var.shape, var.dtype),
                                                    trainable=False, name=f"{name}/local_sgd_momentum")
                self.outer_state[id(var)] = (anchor, momentum)
        return var

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        self._updates.assign_add(1)
        tf.cond(self._sync_due(), lambda: self._syncs.assign_add(1), lambda: self._syncs.read_value())
        scale = self._num_replicas_in_sync if reduce_op == tf.distribute.ReduceOp.SUM else 1
        own = []
        for value, _ in value_destination_pairs:
            copies = value.values if isinstance(value, values_lib.PerReplica) else (value,) * len(self.worker_devices)
            own.append(values_lib.PerReplica(tuple(copy * scale for copy in copies)))
        return own

    def _update(self, var, fn, args, kwargs, group):
        result = super()._update(var, fn, args, kwargs, group)
        if not any(var is synced for synced in self._synced_variables):
            return result
        with tf.control_dependencies([op for op in tf.nest.flatten(result) if op is not None]):
            tf.cond(self._sync_due(), lambda: self._average(var), lambda: tf.constant(False))
        return result

    def _sync_due(self) -> tf.Tensor:
        return tf.equal(self._updates % self.param_sync_step, 0)

    def _average(self, var) -> tf.Tensor:
        """Sets every copy of ``var`` (of all workers) to the copies' mean. The copies are reduced
        as a per-replica value: reduced as a mirrored variable, they would be taken as equal."""
        copies = var.values
        mean = self.reduce_to(tf.distribute.ReduceOp.MEAN, values_lib.PerReplica(tuple(c.read_value() for c in copies)),
                              destinations=var)
        new_values = self._local_results(mean)
        if self.outer_optimizer is not None:
            new_values = self._outer_step(var, new_values)
        for copy, value in zip(copies, new_values):
            with tf.device(copy.device):
                copy.assign(value)
        return tf.constant(True)

    def _outer_step(self, var, means) -> list:
        """DiLoCo's Nesterov step from each copy's anchor with the outer gradient ``anchor - mean``;
        the new model, per local copy (anchors and momenta updated, the same on every replica)."""
        learning_rate, momentum = self.outer_optimizer["learning_rate"], self.outer_optimizer["momentum"]
        anchor, outer_momentum = self.outer_state[id(var)]
        new_values = []
        for anchor_copy, momentum_copy, mean in zip(anchor.values, outer_momentum.values, means):
            with tf.device(anchor_copy.device):
                grad = anchor_copy.read_value() - mean
                moved = momentum_copy.assign(momentum * momentum_copy + grad)
                new = anchor_copy.read_value() - learning_rate * (grad + momentum * moved)
                new_values.append(anchor_copy.assign(new))
        return new_values

    def sync_now(self):
        """Combines every trainable variable's copies now (cross-replica context; with several
        workers, every worker calls it at the same point), as a scheduled sync does."""
        for var in self._synced_variables:
            self._average(var)
        self._syncs.assign_add(1)

    @property
    def sync_stats(self) -> dict:
        """The updates made, the syncs (each combines every trainable variable) and the bytes this
        worker handed to their all-reduces (its local copies of every trainable variable)."""
        syncs = int(self._syncs.numpy())
        per_sync = sum(len(var.values) * var.shape.num_elements() * var.dtype.size for var in self._synced_variables)
        return {"updates": int(self._updates.numpy()), "syncs": syncs, "bytes": syncs * per_sync}


class SyncCallback(keras.callbacks.Callback):
    """A Keras callback that combines a local-SGD strategy's copies where Keras reads the model in
    cross-replica context: before evaluating (also ``fit``'s validation), predicting, at each
    epoch's end (before ``ModelCheckpoint`` saves, when listed first) and at the end of training.
    ``model.fit(..., callbacks=[SyncCallback(strategy), ...])``."""

    def __init__(self, strategy: tf.distribute.Strategy):
        super().__init__()
        self.extended = strategy.extended

    def _sync(self, *_args, **_kwargs):
        self.extended.sync_now()

    on_test_begin = on_predict_begin = on_epoch_end = on_train_end = _sync


class ScheduledLocalSGDExtended(ScheduledLocalSGDMixin, LocalSGDExtended):
    """:class:`ScheduledLocalSGDMixin` over the devices of one machine."""

    def __init__(self, container_strategy, devices, param_sync_step: int, outer_optimizer: Optional[dict] = None):
        super().__init__(container_strategy, devices=devices)
        self._start_schedule(param_sync_step, outer_optimizer)


class TrainerLocalSGDStrategy(tf.distribute.Strategy):
    """Local SGD over the devices of one machine for the RETURNN trainer (a ``MirroredStrategy``
    in all but the name): the package's optimizers apply each replica's gradient to its own copy
    and :mod:`returnn_tpu.sync` combines the copies.

    >>> strategy = TrainerLocalSGDStrategy(["/cpu:0", "/cpu:1"])
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


class LocalSGDStrategy(tf.distribute.Strategy):
    """Local SGD over the devices of one machine for a TF2 or Keras program: a drop-in replacement
    of ``tf.distribute.MirroredStrategy`` (:class:`ScheduledLocalSGDExtended`).

    ``local_sgd_options`` are the local-SGD keys of ``distribute_options``, with their names,
    defaults and checks; so far ``param_sync_step`` (default 100) and ``outer_optimizer`` (DiLoCo's
    ``{"class": "nesterov", "learning_rate": 0.7, "momentum": 0.9}``):

    >>> strategy = LocalSGDStrategy(["/cpu:0", "/cpu:1"], param_sync_step=16)  # doctest: +SKIP
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = keras.Sequential([...]); model.compile(optimizer="sgd", loss="mse")
    >>> model.fit(dataset, epochs=2)  # doctest: +SKIP
    >>> strategy.extended.sync_now(); model.save("model.keras")  # doctest: +SKIP
    """

    _collective_key_base = 0  # read by MirroredExtended, as on MirroredStrategy

    def __init__(self, devices=None, **local_sgd_options):
        from returnn_tpu.options import check_tf2_local_sgd_options

        step, outer = check_tf2_local_sgd_options(local_sgd_options)
        super().__init__(ScheduledLocalSGDExtended(self, devices, step, outer))
