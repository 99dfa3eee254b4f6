"""Local SGD as a ``tf.distribute`` strategy: mirrored variables whose copies may differ.

Every replica applies its own gradients to its own copy of each variable; no communication
happens in a training step. The variables are ordinary ``MirroredVariable`` objects.

* :class:`TrainerLocalSGDStrategy` (the RETURNN trainer's): every reduction reduces as TensorFlow
  defines it; the package's optimizers apply each replica's gradient to its own copy
  (:func:`returnn_tpu.strategies.extended.is_local_sgd`), and the trainer's syncs
  (:func:`returnn_tpu.strategies.make_syncs`) combine the copies.
* :class:`LocalSGDStrategy` (a TF2 or Keras program's): its extended
  (:class:`ScheduledLocalSGDMixin`) gives TensorFlow's and Keras' own update path local-SGD
  semantics, decides when to sync and combines the copies; :class:`SyncCallback` combines them
  where Keras reads the model.
"""

from __future__ import annotations

from typing import List, Optional

import keras
import tensorflow as tf
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import values as values_lib

from returnn_tpu.strategies.devices import KEYS_PER_STRATEGY, own_collective_key_base
from returnn_tpu.strategies.extended import LocalSGDExtendedMixin
from returnn_tpu.strategies.sync import TracedSchedule


class LocalSGDExtended(LocalSGDExtendedMixin, mirrored_strategy.MirroredExtended):
    """Local SGD over the devices of one machine."""


class ScheduledLocalSGDMixin:
    """What makes an extended that a TF2 or Keras program trains with local SGD: it gives
    TensorFlow's and Keras' own update path local-SGD semantics, owns the schedule and combines
    the copies with :mod:`returnn_tpu.strategies.sync`'s rules, those of the RETURNN trainer
    (docs/FACTS.md, "Local SGD for TF2 programs").

    * A replica-context all-reduce of gradients (Keras' optimizers sum the replicas' gradients
      with ``ReplicaContext.all_reduce``, which reaches :meth:`batch_reduce_to` in a
      ``merge_call``) leaves each replica its own: a SUM of gradients of a loss scaled to the
      global batch (``tf.nn.compute_average_loss``, Keras' ``scale_loss``) is the replica's own
      batch's mean gradient, so ``extended.update`` applies it to the replica's own copy. Such an
      all-reduce marks the ``strategy.run`` it happens in as an update; one of other values
      (:meth:`_are_gradients`) reduces as TensorFlow's does.
    * After every ``strategy.run`` that made an update (:meth:`_call_for_each_replica`), the
      schedule counts it, and the fragments due are synced by a second ``strategy.run`` in the
      same program, under ``tf.cond``: ``sync_fragments`` F splits the trainable variables into F
      fragments, fragment i synced after update ``(i + 1) * N / F`` of each cycle of
      ``param_sync_step`` N updates; with ``sync_delay`` d, a sync's mean is taken after its update
      and applied d updates later. The rule is the trainer's :class:`returnn_tpu.strategies.sync.SyncSchedule`,
      read from the table :class:`returnn_tpu.strategies.sync.TracedSchedule` derives from it.
    * How a sync runs is :class:`returnn_tpu.strategies.sync.SyncEngine`'s, the trainer's too; how
      copies combine is :func:`returnn_tpu.strategies.sync.make_averaging`'s object for the
      options: plain averaging, DiLoCo's Nesterov outer step, ``sync_dtype`` (int8/int4 with error
      feedback), ``sync_mix``. Its state (anchors, outer momenta, residuals) is made beside each
      trainable variable as the variable is made in the scope.
    * :meth:`sync_now` combines every trainable variable at once (before evaluating, saving or
      reading the model in cross-replica context, which sees the first replica's copy).

    Concrete extendeds call :meth:`_start_schedule` after their base's ``__init__`` (a
    multi-worker one must create no variable before it).
    """

    def _start_schedule(self, options, keep_synced_model: bool = False):
        """``options``: the checked :class:`returnn_tpu.options.DistributeOptions`;
        ``keep_synced_model``: keep the model of the last sync where the syncs do not need it
        (:meth:`synced_model`; several workers)."""
        self.sync_delay = options.sync_delay
        self._start_engine(options, keep_synced_model)
        self.engine.attach(lambda: self._synced_variables)
        local_step = self._local_step(options)
        self._schedule = TracedSchedule(options.param_sync_step, fragments=options.sync_fragments,
                                        delay=options.sync_delay, local_step=local_step)
        self._local_rounds = local_step is not None
        self._syncing = False  # while a sync's own run is built: its all-reduces reduce

        def counter(name, value=0):  # plain host variables, outside the strategy's scope
            return tf.Variable(value, dtype=tf.int64, trainable=False, name=f"local_sgd/{name}")

        self._updates, self._updates_scheduled = counter("updates"), counter("updates_scheduled")
        self._since_restart = counter("updates_since_restart")  # the traced clock (TracedSchedule)
        self._counts = {key: counter(key) for key in ("syncs", "local_syncs", "bytes")}  # sync_stats
        self._synced_variables = {}  # key (creation order) -> a trainable variable made in the scope
        self._sync_now_traced = None  # (variables when traced, sync_now's program)

    def _create_variable(self, next_creator, **kwargs):
        var = super()._create_variable(next_creator, **kwargs)
        if kwargs.get("trainable", True) and not self._syncing:
            key = f"{len(self._synced_variables):06d}_{var.name.split(':')[0]}"
            self._synced_variables[key] = var
            self.averaging.create_state(self._container_strategy(), {key: var})
            if key in self.averaging.anchors:
                with tf.init_scope():  # once, as the variable is made, also when made in a traced step
                    self.averaging.anchors[key].assign(tf.cast(var.read_value(), tf.float32))
        return var

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        if self._syncing or not self._are_gradients([value for value, _ in value_destination_pairs]):
            return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
        self._mark_update()
        scale = self._num_replicas_in_sync if reduce_op == tf.distribute.ReduceOp.SUM else 1
        return [self._own_gradient(value, scale) for value, _ in value_destination_pairs]

    def _mark_update(self):
        """The ``strategy.run`` being traced makes an update (counted in the program)."""
        self._updates.assign_add(1)

    def _own_gradient(self, value, scale):
        """Each replica's own gradient, where a reduction would give their sum (``scale``: the
        number of replicas) or mean (1)."""
        copies = value.values if isinstance(value, values_lib.PerReplica) else (value,) * len(self.worker_devices)
        return values_lib.PerReplica(tuple(copy * scale for copy in copies))

    def _are_gradients(self, values) -> bool:
        """Whether an all-reduce of ``values`` is one of gradients: floats whose shapes are those of
        as many trainable variables of the scope (Keras reduces the gradients of all variables it
        updates in one call). A program's own all-reduce of other values (a metric, a count)
        reduces as TensorFlow's does, unless its shapes happen to be those of variables."""
        shapes = [tuple(var.shape.as_list()) for var in self._synced_variables.values()]
        for value in values:
            component = value.values[0] if isinstance(value, values_lib.PerReplica) else value
            shape = tuple(component.shape.as_list()) if component.shape.rank is not None else None
            if not component.dtype.is_floating or shape not in shapes:
                return False
            shapes.remove(shape)
        return bool(values)

    def _call_for_each_replica(self, fn, args, kwargs):
        result = super()._call_for_each_replica(fn, args, kwargs)
        if not self._syncing:
            when(self._updates > self._updates_scheduled, self._count_update)
        return result

    # ---- the schedule (cross-replica context; the same decisions on every worker) -------------

    def _count_update(self):
        """One update made: what the schedule says after it (the tf.cond branch after a
        ``strategy.run``); overlapped, the sync in flight is applied before what is due starts,
        as the trainer's :class:`returnn_tpu.strategies.sync.OverlappedSyncs` does."""
        self._updates_scheduled.assign(self._updates)
        since_restart = self._since_restart.assign_add(1)
        due, applied, _ = self._schedule.row(since_restart)
        fragments = self._fragments()
        if self.sync_delay:
            for fragment in fragments:
                when(applied[fragment], lambda fragment=fragment: self._finish_overlapped(fragment))
        for fragment in fragments:
            start = self._start_overlapped if self.sync_delay else self._sync_fragment
            when(due[fragment], lambda fragment=fragment, start=start: start(fragment))
        if self._local_rounds:
            when(self._schedule.local_round(since_restart), self._sync_within_workers)

    def _fragments(self) -> List[int]:
        """The fragments that have trainable variables (a model of fewer variables than fragments
        leaves some empty)."""
        return [index for index, keys in enumerate(self.engine.fragments) if keys]

    def _in_replicas(self, sync_in_replica):
        """Runs ``sync_in_replica()`` in replica context on every replica, its all-reduces
        reducing (the sync's own ``strategy.run``)."""
        self._syncing = True
        try:
            self._run_in_replicas(sync_in_replica)
        finally:
            self._syncing = False

    def _run_in_replicas(self, fn):
        """``fn()`` in replica context on every replica, as the base strategy runs it."""
        super()._call_for_each_replica(fn, (), {})

    # The syncs: the engine's, in the program. The program's learning rate is not the strategy's
    # to see (SlowMo, which scales by it, is refused); 1.0 leaves the outer step as configured.

    def _sync_fragment(self, fragment: int):
        self._in_replicas(lambda: self.engine.sync_in_replica((fragment,), tf.constant(1.0)))
        self._count_sync(fragment)

    def _sync_within_workers(self):
        """A worker-local round (``local_param_sync_step``): no traffic between workers."""
        self._in_replicas(lambda: self.engine.sync_in_replica((), tf.constant(1.0), local=True))
        self._counts["local_syncs"].assign_add(1)

    def _start_overlapped(self, fragment: int):
        def snapshot_and_reduce():
            self.engine.snapshot_in_replica((fragment,))
            self.engine.reduce_in_replica((fragment,))

        self._in_replicas(snapshot_and_reduce)
        self._count_sync(fragment)

    def _finish_overlapped(self, fragment: int):
        self._in_replicas(lambda: self.engine.apply_in_replica((fragment,), tf.constant(1.0)))

    def _count_sync(self, fragment: int):
        self._counts["syncs"].assign_add(1)
        self._counts["bytes"].assign_add(self.engine.sync_bytes((fragment,)))

    # ---- the public surface ------------------------------------------------------------------

    def sync_now(self):
        """Combines every trainable variable's copies now, after applying a sync in flight
        (cross-replica context; with several workers, every worker calls it at the same point),
        and starts a new cycle of the schedule. Called eagerly, it runs one traced program, traced
        again only when trainable variables were added (an eager ``strategy.run`` would trace
        its function at every call)."""
        if not tf.executing_eagerly():
            return self._sync_all()
        if self._sync_now_traced is None or self._sync_now_traced[0] != len(self._synced_variables):
            self._sync_now_traced = (len(self._synced_variables), tf.function(self._sync_all, autograph=False))
        return self._sync_now_traced[1]()

    def _sync_all(self):
        if self.sync_delay:
            _, _, in_flight = self._schedule.row(self._since_restart.read_value())
            for fragment in self._fragments():
                when(in_flight[fragment], lambda fragment=fragment: self._finish_overlapped(fragment))
        for fragment in self._fragments():
            self._sync_fragment(fragment)
        self._since_restart.assign(0)  # a restart of the schedule, as the trainer's after a full sync

    @property
    def checkpoint_state(self) -> tf.train.Checkpoint:
        """The state a resumed run needs besides the model and optimizer: DiLoCo's anchors and
        outer momenta (the model of the last sync; the same on every replica). Give it to the
        program's checkpoint beside them, after :meth:`sync_now`:
        ``tf.train.Checkpoint(model=model, optimizer=optimizer, local_sgd=strategy.extended.checkpoint_state)``.
        Quantization residuals, each replica's own, start at zero on resume, as in the trainer.
        Named by the order the trainable variables were made in (the same in every run of a
        program; Keras' layer names are not, within one process)."""
        momenta = getattr(self.averaging, "momenta", {})  # outer optimizers'
        state = {}
        for index, key in enumerate(self._synced_variables):
            for kind, variables in (("anchor", self.averaging.anchors), ("outer_momentum", momenta)):
                if key in variables:
                    state[f"variable_{index}_{kind}"] = variables[key]
        return tf.train.Checkpoint(**state)

    def synced_model(self) -> Optional[List[tf.Variable]]:
        """The model of the last sync, which every worker holds: one float32 variable per trainable
        variable, in the order they were made (a Keras model's ``trainable_variables``' order).
        What a worker saves when a peer is lost between syncs (its collective fails), e.g.
        ``for var, synced in zip(model.trainable_variables, strategy.extended.synced_model()):
        var.assign(tf.cast(synced, var.dtype))`` before ``model.save``. None where it is not kept:
        plain float32 averaging on one machine (its syncs do not need it)."""
        model = self.engine.synced_model()
        return None if model is None else [model[key] for key in self._synced_variables]

    @property
    def sync_stats(self) -> dict:
        """The updates made, the syncs (each combines one fragment, all trainable variables
        without ``sync_fragments``), the worker-local rounds (``local_param_sync_step``) and the
        bytes this worker's replicas handed to them; the keys of the RETURNN trainer's
        (:attr:`returnn_tpu.strategies.sync.LocalSGDSyncs.sync_stats`)."""
        return {"updates": int(self._updates.numpy()),
                **{key: int(counter.numpy()) for key, counter in self._counts.items()}}


def when(condition: tf.Tensor, action):
    """Runs ``action()`` (which returns nothing) where ``condition`` holds, in a traced program
    as a ``tf.cond``, eagerly as Python."""
    tf.cond(condition, lambda: action() and None, lambda: None)


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

    def __init__(self, container_strategy, devices, options):
        super().__init__(container_strategy, devices=devices)
        self._start_schedule(options)


class TrainerLocalSGDStrategy(tf.distribute.Strategy):
    """Local SGD over the devices of one machine for the RETURNN trainer (a ``MirroredStrategy``
    in all but the name): the package's optimizers apply each replica's gradient to its own copy
    and :mod:`returnn_tpu.strategies.sync` combines the copies.

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
    defaults and checks (:func:`returnn_tpu.options.check_tf2_local_sgd_options`):
    ``param_sync_step`` (default 100), ``outer_optimizer`` (DiLoCo's ``{"class": "nesterov",
    "learning_rate": 0.7, "momentum": 0.9}``), ``sync_dtype``, ``sync_error_feedback``,
    ``sync_fragments``, ``sync_delay`` and ``sync_mix``:

    >>> strategy = LocalSGDStrategy(["/cpu:0", "/cpu:1"], param_sync_step=16)  # doctest: +SKIP
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = keras.Sequential([...]); model.compile(optimizer="sgd", loss="mse")
    >>> model.fit(dataset, epochs=2)  # doctest: +SKIP
    >>> strategy.extended.sync_now(); model.save("model.keras")  # doctest: +SKIP
    """

    def __init__(self, devices=None, **local_sgd_options):
        from returnn_tpu.options import check_tf2_local_sgd_options

        # Read by MirroredExtended. Half a step off the trainer's strategies' bases, so that a
        # MirroredStrategy of the same program (base 0, TensorFlow's) reuses none of its keys.
        self._collective_key_base = own_collective_key_base() + KEYS_PER_STRATEGY // 2
        super().__init__(ScheduledLocalSGDExtended(self, devices, check_tf2_local_sgd_options(local_sgd_options)))
