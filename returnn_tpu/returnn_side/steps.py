"""The compiled functions of a training run: train step and eval step.

A train step is a ``tf.function`` that calls ``strategy.run`` on each replica's forward and
backward pass (:mod:`returnn_tpu.returnn_side.replica_pass`; the RETURNN network is built inside that trace,
see :mod:`returnn_tpu.returnn_side.returnn_bridge`), optionally compiled by XLA. The update then happens

* in cross-replica context (CPU/GPU strategies): :meth:`Optimizer.apply` updates every copy,
  with the replicas' mean gradient or each replica's own, as the strategy's ``syncs`` say;
* or inside ``strategy.run`` (TPU strategies, and ``local_sgd_tpu`` on local devices): every
  replica applies the gradients ``syncs`` give it, and the step runs what ``syncs`` add to it
  (the sync due), all in one program.

``syncs`` is the trainer's side of the strategy (:mod:`returnn_tpu.strategies.sync.lifecycle`):
what combines the copies, and when, is its; this module never asks which strategy it runs.

With ``accum_grad_multiple_step``, :meth:`ReplicaSteps.accumulate` adds a micro-batch's gradients
to per-replica sums, and the next :meth:`ReplicaSteps.train` adds its own and applies.
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Dict, List, Optional, Tuple

import numpy
import tensorflow as tf

from returnn_tpu.datapath.data import read_ahead
from returnn_tpu.optimizers import GradientOptions, Optimizer, StepLearningRate
from returnn_tpu.returnn_side.replica_pass import ReplicaPass
from returnn_tpu.returnn_side.returnn_bridge import NetworkBuilder
from returnn_tpu.strategies import CopiesAlwaysEqual, SyncDue, distribute_local_values, varying_shapes_spec


class ReplicaSteps:
    """The step functions for one strategy, network and optimizer.

    :param syncs: the trainer's side of the strategy (:func:`returnn_tpu.strategies.make_syncs`).
    :param worker_index: this worker's index in the cluster (0 on one machine).
    """

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        builder: NetworkBuilder,
        optimizer: Optimizer,
        *,
        jit_compile: bool,
        syncs: CopiesAlwaysEqual,
        gradients: GradientOptions = GradientOptions(),
        step_learning_rate: StepLearningRate = StepLearningRate(),
        accumulate: bool = False,
        worker_index: int = 0,
    ):
        self.strategy = strategy
        self.builder = builder
        self.optimizer = optimizer
        self.syncs = syncs
        self.step_learning_rate = step_learning_rate  # RETURNN's dynamic_learning_rate (per update)
        self.num_replicas = strategy.num_replicas_in_sync  # over all workers
        self.local_replicas = len(strategy.extended.worker_devices)
        self.first_replica = worker_index * self.local_replicas  # global index of this worker's first
        self.jit_compile = jit_compile
        self._run_shapes = set()  # batch shapes train() has run (with XLA, each new one compiles)
        self._traces = {}  # (function, options) -> (its trace for _signature(), signature); no XLA: all shapes
        self.compilations = 0  # since the last take_compilations()
        self.compile_seconds = 0.0  # those calls' time: trace, compilation (or cache load), one step
        self.replica = ReplicaPass(
            strategy, builder, optimizer, jit_compile=jit_compile, gradients=gradients, accumulate=accumulate,
            shared_trace=not jit_compile and not syncs.updates_in_replica and self.local_replicas > 1,
            first_replica=self.first_replica,
        )
        # With XLA: one trace (and compilation) per bucket shape; else one trace for all shapes.
        self._train = tf.function(
            self._train_in_replica_fn if syncs.updates_in_replica else self._train_fn,
            autograph=False,
            reduce_retracing=not jit_compile,
        )
        self._evaluate = tf.function(self._evaluate_fn, autograph=False, reduce_retracing=not jit_compile)
        # Per-replica batches -> (per-replica gradients by name, metrics), without an update.
        self.replica_gradients = tf.function(
            lambda batches: self.strategy.run(self.replica.gradients, args=(batches,)), autograph=False
        )

    # ---- public ---------------------------------------------------------------------------------

    def distribute(self, per_replica: List):
        """One value per local replica -> the strategy's per-replica value."""
        return distribute_local_values(self.strategy, per_replica, self.first_replica)

    def place(self, step_batches: List) -> List[Dict[str, tf.Tensor]]:
        """Each local replica's batch as tensors on that replica's device. Called on a thread one
        step ahead (:func:`returnn_tpu.datapath.data.read_ahead`), so a step finds its batch there and
        does not wait for the host-to-device copy."""
        placed = []
        for device, batch in zip(self.strategy.extended.worker_devices, step_batches):
            with tf.device(device):
                placed.append({key: tf.identity(value) for key, value in batch.items()})
        return placed

    def on_device(self, batches):
        """``batches``' steps with each replica's batch already on its device: the next step's is
        copied there while the current step runs."""
        return read_ahead(batches, 1, name="returnn_tpu to device",
                          transform=lambda step: (self.place(step[0]), step[1]))

    def parameter_copies(self) -> Dict[str, List[numpy.ndarray]]:
        """Every parameter of the network (RETURNN names) as its value on each of this worker's
        replicas (read back to the host)."""
        return {name: [copy.numpy() for copy in self.strategy.experimental_local_results(var)]
                for name, var in self.builder.variables.by_name.items()}

    def first_copy(self, var: tf.Variable) -> numpy.ndarray:
        """The value of this worker's first replica's copy of ``var``."""
        return self.strategy.experimental_local_results(var)[0].numpy()

    def parameter_checksum(self) -> float:
        """Sum of the absolute parameter values of this worker's first replica (logged; equal on all
        workers after a sync)."""
        return sum(float(tf.reduce_sum(tf.abs(tf.cast(self.strategy.experimental_local_results(var)[0], tf.float64))))
                   for var in self.builder.variables.by_name.values())

    def local_sums(self, metrics: Dict[str, tf.Tensor]) -> Dict[str, float]:
        """Per-replica step metrics summed over this worker's replicas (reads them back)."""
        return {k: sum(float(v) for v in self.strategy.experimental_local_results(t)) for k, t in metrics.items()}

    def create_variables(self, first_step: List):
        """Creates the parameters (by building the forward pass once), the optimizer state, and
        traces the train step, on one batch per local replica."""
        self.optimizer.create_step(self.strategy)
        self.replica.create_variables(self._signature(first_step[0]))
        self.optimizer.create_state(self.strategy, list(self.replica.trainable().values()))
        self.replica.create_state()
        self.syncs.attach(self.replica.trainable, self.optimizer)
        self._trace(self._train, self._train_args(self.distribute(first_step), 0.0, None))

    def _train_args(self, batches, learning_rate: float, due: Optional[SyncDue], update: bool = True) -> tuple:
        args = (batches, tf.constant(learning_rate, tf.float32))
        if self.replica.accumulators is not None:  # a micro-batch only adds its gradients to the sums
            args += (tf.constant(update),)
        return args + self.syncs.step_flags(due)  # the in-step path: what the step syncs

    def train(self, step_batches: List, learning_rate: float, due: Optional[SyncDue] = None) -> Dict:
        """One update; returns the per-replica metrics. On the in-step path, the step also syncs
        what ``due`` names (the host path syncs after it: ``syncs.after_update``)."""
        shape = tuple(sorted((key, value.shape) for key, value in step_batches[0].items())) if self.jit_compile else None
        start = time.perf_counter()
        synchronous = {"mean_gradient": True} if due and due.mean_gradient else {}  # a trace of its own
        metrics = self._call(self._train, self._train_args(self.distribute(step_batches), learning_rate, due),
                             **synchronous)
        if shape is not None and shape not in self._run_shapes:  # this call compiled the step
            self._run_shapes.add(shape)
            self.compilations += 1
            self.compile_seconds += time.perf_counter() - start
        return metrics

    def take_compilations(self) -> Tuple[int, float]:
        """With XLA: the train step's compilations since the last call and their seconds (trace,
        compile or load from the persistent cache, one step); resets both."""
        taken = (self.compilations, self.compile_seconds)
        self.compilations, self.compile_seconds = 0, 0.0
        return taken

    def accumulate(self, step_batches: List) -> Dict:
        """A micro-batch of ``accum_grad_multiple_step``: adds each replica's gradients to its sums,
        without an update. Returns the per-replica metrics.

        The train step itself, told not to update: as in RETURNN's one graph, every micro-batch runs
        the same random ops, so each draws new dropout masks (a function of its own would repeat
        the train step's masks; FACTS.md, "RETURNN's root graph") and the network is traced once.
        """
        return self._call(self._train, self._train_args(self.distribute(step_batches), 0.0, None, update=False))

    def evaluate(self, step_batches: List, weights: List[float]) -> Dict:
        """Per-replica metrics of the eval network, each replica's scaled by its weight (0: padding)."""
        weights = self.distribute([tf.constant(w, tf.float32) for w in weights])
        return self._call(self._evaluate, (self.distribute(step_batches), weights))

    def _signature(self, batches):
        """What a step function is traced for: XLA compiles per shape anyway (buckets); otherwise the
        batch and time dims are open. RETURNN's TF1 graphs never know them, and a static batch size
        taken from a trace (an LSTM's initial state in a loop) would not fit the loop's (FACTS.md,
        "RETURNN's root graph")."""
        return batches if self.jit_compile else varying_shapes_spec(batches)

    def _trace(self, function, args: tuple, **options):
        """``function``'s trace for :meth:`_signature` of ``args`` (the batches first) and these
        keyword ``options``, made on the first call and kept, with the Python signature its
        arguments are bound by."""
        key = (function, tuple(sorted(options.items())))
        if key not in self._traces:
            self._traces[key] = (function.get_concrete_function(self._signature(args[0]), *args[1:], **options),
                                 inspect.signature(function.python_function))
        return self._traces[key]

    def _call(self, function, args: tuple, **options):
        """Runs the step ``function`` on ``args``. Without XLA, through its one trace, called
        directly: ``tf.function``'s own dispatch looks up each new batch shape among those it has
        seen, which costs milliseconds per step once there are hundreds (FACTS.md, "tf.function's
        dispatch per call"). With XLA, through ``tf.function``, which compiles each bucket's shape."""
        if self.jit_compile:
            return function(*args, **options)
        trace, parameters = self._trace(function, args, **options)
        arguments = parameters.bind(*args, **options)
        arguments.apply_defaults()  # a concrete function takes every argument, defaults too
        return trace(*arguments.args, **arguments.kwargs)

    # ---- traced ---------------------------------------------------------------------------------

    def _train_fn(self, batch, learning_rate, update=None, *, mean_gradient=False):
        """An update (``update`` None or True) or, with ``accum_grad_multiple_step``, a micro-batch;
        ``mean_gradient``: a synchronous update (:meth:`CopiesAlwaysEqual.update_rules`), a trace of its own."""
        rules = self.syncs.update_rules(mean_gradient)
        grads, metrics, finite = self.strategy.run(
            self.replica.update_gradients, args=(batch,) if update is None else (batch, update)
        )
        grads_and_vars = [(grads[name], self.builder.variables.by_name[name]) for name in sorted(grads)]

        def apply():
            ok = rules.all_finite(finite)
            rate = self.step_learning_rate(learning_rate, self.optimizer.step.read_value())
            with tf.control_dependencies([self.optimizer.apply(self.strategy, grads_and_vars, rate,
                                                               reduce=rules.reduces_gradients, apply_if=ok)]):
                return tf.constant(True)

        # Runs although unused: tf.function keeps stateful ops. A micro-batch neither updates nor
        # all-reduces (the same decision on every worker, so their collectives stay in step).
        tf.cond(update, apply, lambda: tf.constant(False)) if update is not None else apply()
        return metrics

    def _train_in_replica_fn(self, batch, learning_rate, *sync_flags, mean_gradient=False):
        rules = self.syncs.update_rules(mean_gradient)
        return self.strategy.run(functools.partial(self._replica_train_and_apply, rules),
                                 args=(batch, learning_rate, *sync_flags))

    def _replica_train_and_apply(self, rules, batch, learning_rate, *sync_flags):
        self.syncs.before_update_in_replica(sync_flags)
        grads, metrics, finite = self.replica.update_gradients(batch)
        names = sorted(grads)
        grad_list, finite = rules.gradients_in_replica([grads[name] for name in names], finite)
        variables = [self.builder.variables.by_name[name] for name in names]
        rate = self.step_learning_rate(learning_rate, self.optimizer.step.read_value())
        self.optimizer.apply_in_replica(self.strategy, list(zip(grad_list, variables)), rate, apply_if=finite)
        self.syncs.after_update_in_replica(sync_flags, learning_rate)
        return metrics

    def _evaluate_fn(self, batch, weight):
        return self.strategy.run(self.replica.evaluate, args=(batch, weight))
