"""The compiled functions of a training run: train step, eval step, parameter sync.

A train step is a ``tf.function`` that calls ``strategy.run`` on the per-replica forward and
backward pass (the RETURNN network is built inside that trace, see
:mod:`returnn_tpu.returnn_bridge`), optionally compiled by XLA. The update then happens

* in cross-replica context (CPU/GPU strategies): :meth:`Optimizer.apply` updates every copy,
  with the replicas' mean gradient or each replica's own, as the strategy's ``syncs`` say;
* or inside ``strategy.run`` (TPU strategies, and ``local_sgd_tpu`` on local devices): every
  replica applies the gradients ``syncs`` give it, and the step runs what ``syncs`` add to it
  (the sync due), all in one program.

``syncs`` is the trainer's side of the strategy (:mod:`returnn_tpu.strategies.sync.lifecycle`):
what combines the copies, and when, is its; this module never asks which strategy it runs.

Gradients are treated as RETURNN's updater treats them, in its order: ``maximize_grad_norm``
added, summed over ``accum_grad_multiple_step`` micro-batches (:meth:`ReplicaSteps.accumulate`
adds a micro-batch's gradients to per-replica sums, the next :meth:`ReplicaSteps.train` adds its
own and applies), then noise and clipping (:class:`returnn_tpu.optimizers.GradientOptions`).
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy
import tensorflow as tf

from returnn_tpu.data import read_ahead
from returnn_tpu.errors import ConfigError
from returnn_tpu.optimizers import GradientOptions, Optimizer, StepLearningRate
from returnn_tpu.patches import SharedBuildUnsupported, function_graph, variables_over_handles
from returnn_tpu.returnn_bridge import NetworkBuilder, SharedBuild, loss_metrics, static_replica_id, without_summaries
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
        self.gradients = gradients
        self.step_learning_rate = step_learning_rate  # RETURNN's dynamic_learning_rate (per update)
        self.accumulators: Optional[Dict[str, tf.Variable]] = {} if accumulate else None  # per-replica gradient sums
        self.num_replicas = strategy.num_replicas_in_sync  # over all workers
        self.local_replicas = len(strategy.extended.worker_devices)
        self.first_replica = worker_index * self.local_replicas  # global index of this worker's first
        self.trainable_names: Optional[List[str]] = None  # known after the first trace
        self.compiled_shapes = set()  # input shapes the XLA replica step was compiled for
        self.jit_compile = jit_compile
        self._run_shapes = set()  # batch shapes train() has run (with XLA, each new one compiles)
        self.compilations = 0  # since the last take_compilations()
        self.compile_seconds = 0.0  # those calls' time: trace, compilation (or cache load), one step
        self.nonfinite: Dict[str, tf.Variable] = {}  # see take_nonfinite()
        # Without XLA, on several local devices: one trace of the network for all local replicas,
        # each calling it with its own variables (FACTS.md, "One trace for all replicas").
        self.shared_trace = not jit_compile and not syncs.updates_in_replica and self.local_replicas > 1
        self._shared_functions: Dict[str, Optional[tf.types.experimental.ConcreteFunction]] = {}
        self._shared_lock = threading.Lock()  # the replicas' trace threads: the first traces, the others wait
        # With XLA: one trace (and compilation) per bucket shape; else one trace for all shapes.
        self._train = tf.function(
            self._train_in_replica_fn if syncs.updates_in_replica else self._train_fn,
            autograph=False,
            reduce_retracing=not jit_compile,
        )
        self._jit_forward_backward = (
            tf.function(self._forward_backward_xla, autograph=False, jit_compile=True) if jit_compile else None
        )
        self._evaluate = tf.function(self._evaluate_fn, autograph=False, reduce_retracing=not jit_compile)
        self._jit_evaluate = tf.function(self._evaluate_xla, autograph=False, jit_compile=True) if jit_compile else None
        # Per-replica batches -> (per-replica gradients by name, metrics), without an update.
        self.replica_gradients = tf.function(
            lambda batches: self.strategy.run(self._replica_train, args=(batches,)), autograph=False
        )

    # ---- public ---------------------------------------------------------------------------------

    def distribute(self, per_replica: List):
        """One value per local replica -> the strategy's per-replica value."""
        return distribute_local_values(self.strategy, per_replica, self.first_replica)

    def place(self, step_batches: List) -> List[Dict[str, tf.Tensor]]:
        """Each local replica's batch as tensors on that replica's device. Called on a thread one
        step ahead (:func:`returnn_tpu.data.read_ahead`), so a step finds its batch there and
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
        # The variables come from one build of the network, as the first replica, in a graph never
        # run: one build, not one per replica, and of the forward pass only (the gradients, about
        # half of a build's time, are the train step's). They are made in cross-replica context all the
        # same (FACTS.md, "Variables in a trace"). A plain FuncGraph, not a tf.function, which
        # traces twice when its first trace creates variables.
        def first_replica_build(batch):
            with tf.distribute.ReplicaContext(self.strategy, replica_id_in_sync_group=self.first_replica):
                net, params = self.builder.build(batch, train=True, replica_id=0, global_step=self.optimizer.step)
                self.trainable_names = [name for name, _ in params]
                return net.get_objective()

        with self.strategy.scope():
            function_graph("returnn_tpu_variables", first_replica_build, [self._signature(first_step[0])])
        self.optimizer.create_state(self.strategy, list(self.trainable().values()))
        if self.accumulators is not None:
            with self.strategy.scope():
                for name in self.trainable_names:
                    var = self.builder.variables.by_name[name]
                    self.accumulators[name] = tf.Variable(
                        tf.zeros(var.shape, var.dtype), trainable=False, name=f"{name}/accum_grad",
                        synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM,
                    )
        with self.strategy.scope():  # per replica: non-finite updates skipped, and the first one's step and loss
            self.nonfinite = {
                key: tf.Variable(tf.zeros([], dtype), trainable=False, name=f"nonfinite/{key}",
                                 synchronization=tf.VariableSynchronization.ON_READ,
                                 aggregation=tf.VariableAggregation.SUM)
                for key, dtype in (("count", tf.int64), ("first_step", tf.int64), ("first_loss", tf.float32))
            }
        self.syncs.attach(self.trainable, self.optimizer)
        self._train.get_concrete_function(*self._train_args(self._signature(self.distribute(first_step)), 0.0, None))

    def _train_args(self, batches, learning_rate: float, due: Optional[SyncDue], update: bool = True) -> tuple:
        args = (batches, tf.constant(learning_rate, tf.float32))
        if self.accumulators is not None:  # a micro-batch only adds its gradients to the sums
            args += (tf.constant(update),)
        return args + self.syncs.step_flags(due)  # the in-step path: what the step syncs

    def train(self, step_batches: List, learning_rate: float, due: Optional[SyncDue] = None) -> Dict:
        """One update; returns the per-replica metrics. On the in-step path, the step also syncs
        what ``due`` names (the host path syncs after it: ``syncs.after_update``)."""
        shape = tuple(sorted((key, value.shape) for key, value in step_batches[0].items())) if self.jit_compile else None
        start = time.perf_counter()
        metrics = self._train(*self._train_args(self.distribute(step_batches), learning_rate, due))
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
        return self._train(*self._train_args(self.distribute(step_batches), 0.0, None, update=False))

    def evaluate(self, step_batches: List, weights: List[float]) -> Dict:
        """Per-replica metrics of the eval network, each replica's scaled by its weight (0: padding)."""
        weights = self.distribute([tf.constant(w, tf.float32) for w in weights])
        return self._call_with_open_shapes(self._evaluate, self.distribute(step_batches), weights)

    def _signature(self, batches):
        """What a step function is traced for: XLA compiles per shape anyway (buckets); otherwise the
        batch and time dims are open. RETURNN's TF1 graphs never know them, and a static batch size
        taken from a trace (an LSTM's initial state in a loop) would not fit the loop's (FACTS.md,
        "RETURNN's root graph")."""
        return batches if self.jit_compile else varying_shapes_spec(batches)

    def _call_with_open_shapes(self, function, *args):
        """Calls ``function``, its first trace made for :meth:`_signature` of the arguments."""
        if function.experimental_get_tracing_count() == 0:
            function.get_concrete_function(*self._signature(args))
        return function(*args)

    def take_nonfinite(self) -> List[Tuple[int, int, float]]:
        """Per local replica: updates skipped because their loss or gradient was NaN or Inf since
        the last call, the optimizer step of the first of them (1-based; 0: none) and its loss.
        Reads back to the host (not per step); resets the counts."""
        columns = [[v.numpy().item() for v in self.strategy.experimental_local_results(self.nonfinite[key])]
                   for key in ("count", "first_step", "first_loss")]
        for var in self.nonfinite.values():
            var.assign(tf.zeros_like(var))
        return list(zip(*columns))

    def trainable(self) -> Dict[str, tf.Variable]:
        """The trainable parameters by name."""
        return {name: self.builder.variables.by_name[name] for name in self.trainable_names}

    # ---- traced ---------------------------------------------------------------------------------

    def _replica_train(self, batch):
        """One replica's gradients and metrics, compiled by XLA with ``jit_compile``."""
        if self._jit_forward_backward is not None:
            return self._jit_forward_backward(batch, static_replica_id())
        shared = self._built_once_for_all_replicas("train", batch)
        return shared if shared is not None else self._forward_backward(batch, static_replica_id())

    def _built_once_for_all_replicas(self, kind: str, batch):
        """What ``kind`` (``"train"``: gradients and metrics; ``"eval"``: metrics) gives for this
        replica's ``batch``, from one function that the first replica to get here traces and every
        local replica calls with its own variables and seed. None where that cannot be (without
        :attr:`shared_trace`, or a network that cannot be built so): each replica builds its own."""
        if not self.shared_trace:
            return None
        names = sorted(self.builder.variables.in_network)
        variables = [self.builder.variables.by_name[name] for name in names]
        if self.optimizer.step is not None:  # the network's global_train_step (none before the first update)
            variables.append(self.optimizer.step)
        local = static_replica_id() - self.first_replica
        own = [var.values[local] if isinstance(var, tf.distribute.DistributedValues) else var for var in variables]
        args = (batch, tf.constant(self.builder.replica_seed(static_replica_id()), tf.int64),
                [var.handle for var in own])
        with self._shared_lock:
            if kind not in self._shared_functions:
                self._shared_functions[kind] = self._trace_for_all_replicas(kind, args, names, variables)
            function = self._shared_functions[kind]
        return function(*args) if function is not None else None

    def _trace_for_all_replicas(self, kind: str, args: tuple, names: List[str], variables: List[tf.Variable]):
        from returnn.log import log

        def build_from_inputs(batch, replica_seed, handles):
            params = variables_over_handles(handles, variables)
            step = params.pop() if len(params) > len(names) else None
            shared = SharedBuild(dict(zip(names, params)), replica_seed)
            if kind == "train":
                return self._forward_backward(batch, 0, shared=shared, global_step=step)
            return self._eval_metrics(batch, 0, shared=shared, global_step=step)

        try:
            # Not inlined into the train step: each replica's device instantiates the one body,
            # where inlining would optimize N copies of it in one graph (FACTS.md, "One trace for all replicas").
            function = tf.function(build_from_inputs, autograph=False, experimental_attributes={"_noinline": True})
            return function.get_concrete_function(*args)
        except SharedBuildUnsupported as exc:
            print(f"returnn-tpu: each replica builds the {kind} network in a trace of its own: {exc}", file=log.v2)
            return None

    def _forward_backward_xla(self, batch, replica_id: int):
        self.compiled_shapes.add(tuple(sorted((k, tuple(v.shape)) for k, v in batch.items())))
        with without_summaries():  # summary ops have no XLA kernel (FACTS.md, "XLA")
            return self._forward_backward(batch, replica_id)

    def _forward_backward(self, batch, replica_id: int, shared: Optional[SharedBuild] = None, global_step=None):
        from returnn.log import log

        with tf.GradientTape() as outer_tape:  # only used for maximize_grad_norm (a second derivative)
            with tf.GradientTape() as tape:
                net, params = self.builder.build(
                    batch, train=True, replica_id=replica_id, shared=shared,
                    global_step=self.optimizer.step if global_step is None else global_step,
                )
                objective = net.get_objective()
            names = [name for name, _ in params]
            variables = [var for _, var in params]
            grads = tape.gradient(objective, variables)
            missing = [name for name, grad in zip(names, grads) if grad is None]
            if len(missing) == len(names):
                raise ConfigError(f"no parameter gets a gradient from the loss ({missing}); check the network")
            if missing:  # e.g. below a stop_gradient; RETURNN's optimizer leaves them as they are, too
                print(f"parameters {missing} get no gradient from the loss and are not trained", file=log.v2)
                grads = [tf.zeros_like(var) if grad is None else grad for grad, var in zip(grads, variables)]
            factor = self.gradients.maximize_grad_norm
            if factor:  # RETURNN: the gradient of -factor * global gradient norm is added
                norm_loss = -factor * tf.linalg.global_norm(grads)
        if factor:
            extra = outer_tape.gradient(norm_loss, variables)
            grads = [grad if more is None else grad + more for grad, more in zip(grads, extra)]
        self.trainable_names = names
        return dict(zip(names, grads)), loss_metrics(net, train=True)

    def _replica_update_gradients(self, batch, update=True):
        """One replica's final gradients of an update: its micro-batch sums (if accumulating) plus
        this batch's, with RETURNN's noise and clipping. Returns them, the metrics and whether they
        are finite. With ``update`` False (a micro-batch) the sums keep this batch's gradients."""
        grads, metrics = self._replica_train(batch)
        names = sorted(grads)
        batch_grads = grad_list = [grads[name] for name in names]
        if self.accumulators is not None:
            sums = [self.accumulators[name] for name in names]
            grad_list = [acc.read_value() + grad for acc, grad in zip(sums, grad_list)]
            with tf.control_dependencies(grad_list):  # an update starts the next sums from zero
                stores = [acc.assign(tf.where(update, tf.zeros_like(grad), grad)) for acc, grad in zip(sums, grad_list)]
            with tf.control_dependencies(stores):
                grad_list = [tf.identity(grad) for grad in grad_list]
        grad_list = self.gradients.final(grad_list, batch_grads)
        finite, metrics = self._check_finite(grad_list, metrics, update)
        return dict(zip(names, grad_list)), metrics, finite

    def _check_finite(self, grad_list, metrics, update):
        """In replica context: whether this update's loss and gradients are finite, counted when not
        (FACTS.md, "Non-finite updates"), and the metrics, zero for a non-finite update so that
        the epoch's scores are those of the updates made. A micro-batch is not checked: its
        gradients are part of the next update's, which is."""
        loss = tf.add_n([tf.cast(v, tf.float32) for k, v in sorted(metrics.items()) if k.startswith("cost:")] or
                        [tf.zeros([])])
        finite = tf.math.is_finite(loss) & tf.math.is_finite(tf.linalg.global_norm(grad_list))
        finite = finite | tf.logical_not(update)
        bad = tf.cast(tf.logical_not(finite), tf.int64)
        first_step, count = self.nonfinite["first_step"], self.nonfinite["count"]
        is_first = tf.logical_and(tf.logical_not(finite), tf.equal(count.read_value(), 0))
        updates = [
            first_step.assign(tf.where(is_first, self.optimizer.step.read_value() + 1, first_step.read_value())),
            self.nonfinite["first_loss"].assign(tf.where(is_first, loss, self.nonfinite["first_loss"].read_value())),
        ]
        with tf.control_dependencies(updates):
            updates.append(count.assign_add(bad))
        with tf.control_dependencies(updates):
            metrics = {key: tf.where(finite, value, tf.zeros_like(value)) for key, value in metrics.items()}
        return finite, metrics

    def _train_fn(self, batch, learning_rate, update=None):
        """An update (``update`` None or True) or, with ``accum_grad_multiple_step``, a micro-batch."""
        grads, metrics, finite = self.strategy.run(
            self._replica_update_gradients, args=(batch,) if update is None else (batch, update)
        )
        grads_and_vars = [(grads[name], self.builder.variables.by_name[name]) for name in sorted(grads)]

        def apply():
            ok = self.syncs.all_finite(finite)
            rate = self.step_learning_rate(learning_rate, self.optimizer.step.read_value())
            with tf.control_dependencies([self.optimizer.apply(self.strategy, grads_and_vars, rate,
                                                               reduce=self.syncs.reduces_gradients, apply_if=ok)]):
                return tf.constant(True)

        # Runs although unused: tf.function keeps stateful ops. A micro-batch neither updates nor
        # all-reduces (the same decision on every worker, so their collectives stay in step).
        tf.cond(update, apply, lambda: tf.constant(False)) if update is not None else apply()
        return metrics

    def _train_in_replica_fn(self, batch, learning_rate, *sync_flags):
        return self.strategy.run(self._replica_train_and_apply, args=(batch, learning_rate, *sync_flags))

    def _replica_train_and_apply(self, batch, learning_rate, *sync_flags):
        self.syncs.before_update_in_replica(sync_flags)
        grads, metrics, finite = self._replica_update_gradients(batch)
        names = sorted(grads)
        grad_list, finite = self.syncs.gradients_in_replica([grads[name] for name in names], finite)
        variables = [self.builder.variables.by_name[name] for name in names]
        rate = self.step_learning_rate(learning_rate, self.optimizer.step.read_value())
        self.optimizer.apply_in_replica(self.strategy, list(zip(grad_list, variables)), rate, apply_if=finite)
        self.syncs.after_update_in_replica(sync_flags, learning_rate)
        return metrics

    def _replica_evaluate(self, batch, weight):
        """One replica's eval metrics, scaled by its weight; compiled by XLA with ``jit_compile``."""
        if self._jit_evaluate is not None:
            return self._jit_evaluate(batch, weight, static_replica_id())
        metrics = self._built_once_for_all_replicas("eval", batch)
        if metrics is None:
            metrics = self._eval_metrics(batch, static_replica_id())
        return {key: value * weight for key, value in metrics.items()}

    def _evaluate_xla(self, batch, weight, replica_id: int):
        with without_summaries():
            return {key: value * weight for key, value in self._eval_metrics(batch, replica_id).items()}

    def _eval_metrics(self, batch, replica_id: int, shared: Optional[SharedBuild] = None, global_step=None):
        step = self.optimizer.step if global_step is None else global_step
        net, _ = self.builder.build(batch, train=False, replica_id=replica_id, global_step=step, shared=shared)
        return loss_metrics(net, train=False)

    def _evaluate_fn(self, batch, weight):
        return self.strategy.run(self._replica_evaluate, args=(batch, weight))
