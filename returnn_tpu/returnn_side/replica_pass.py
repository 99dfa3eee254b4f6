"""What one replica computes in a step: the forward and backward pass of the RETURNN network
(compiled by XLA with ``jit_compile``; without it, on several local devices, traced once for all
local replicas), RETURNN's treatment of the gradients, the non-finite check, and the eval
metrics. :class:`returnn_tpu.returnn_side.steps.ReplicaSteps` calls it inside ``strategy.run``; it does not
know how the replicas' updates are combined.

Gradients are treated as RETURNN's updater treats them, in its order: ``maximize_grad_norm``
added, summed over ``accum_grad_multiple_step`` micro-batches (per-replica sums, to which a
micro-batch adds its gradients; the next update adds its own and applies), then noise and
clipping (:class:`returnn_tpu.optimizers.GradientOptions`).
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from returnn_tpu.errors import ConfigError
from returnn_tpu.optimizers import GradientOptions, Optimizer
from returnn_tpu.patches import SharedBuildUnsupported, function_graph, variables_over_handles
from returnn_tpu.returnn_side.returnn_bridge import (NetworkBuilder, SharedBuild, loss_metrics, static_replica_id,
                                                     without_summaries)


class ReplicaPass:
    """One replica's part of the train and eval steps of a network, for ``strategy``.

    :param shared_trace: one trace of the network for all local replicas, each calling it with
        its own variables (FACTS.md, "One trace for all replicas"): without XLA, on several local
        devices, where the update is not in replica context.
    :param accumulate: ``accum_grad_multiple_step``: keep per-replica gradient sums.
    :param first_replica: the global index of this worker's first replica.
    """

    def __init__(self, strategy: tf.distribute.Strategy, builder: NetworkBuilder, optimizer: Optimizer, *,
                 jit_compile: bool, shared_trace: bool, gradients: GradientOptions, accumulate: bool,
                 first_replica: int):
        self.strategy = strategy
        self.builder = builder
        self.optimizer = optimizer
        self.gradient_options = gradients
        self.first_replica = first_replica
        self.shared_trace = shared_trace
        self.accumulators: Optional[Dict[str, tf.Variable]] = {} if accumulate else None  # per-replica gradient sums
        self.trainable_names: Optional[List[str]] = None  # known after the first trace
        self.compiled_shapes = set()  # input shapes the XLA replica step was compiled for
        self.nonfinite: Dict[str, tf.Variable] = {}  # see take_nonfinite()
        self._shared_functions: Dict[str, Optional[tf.types.experimental.ConcreteFunction]] = {}
        self._shared_lock = threading.Lock()  # the replicas' trace threads: the first traces, the others wait
        self._jit_forward_backward = (
            tf.function(self._forward_backward_xla, autograph=False, jit_compile=True) if jit_compile else None
        )
        self._jit_evaluate = tf.function(self._evaluate_xla, autograph=False, jit_compile=True) if jit_compile else None

    def create_variables(self, batch_signature):
        """Creates the network's parameters by building its forward pass once, for a batch of
        ``batch_signature`` (cross-replica context)."""
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
            function_graph("returnn_tpu_variables", first_replica_build, [batch_signature])

    def create_state(self):
        """Creates the per-replica gradient sums (if accumulating) and non-finite counts."""
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

    def gradients(self, batch):
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
            factor = self.gradient_options.maximize_grad_norm
            if factor:  # RETURNN: the gradient of -factor * global gradient norm is added
                norm_loss = -factor * tf.linalg.global_norm(grads)
        if factor:
            extra = outer_tape.gradient(norm_loss, variables)
            grads = [grad if more is None else grad + more for grad, more in zip(grads, extra)]
        self.trainable_names = names
        return dict(zip(names, grads)), loss_metrics(net, train=True)

    def update_gradients(self, batch, update=True):
        """One replica's final gradients of an update: its micro-batch sums (if accumulating) plus
        this batch's, with RETURNN's noise and clipping. Returns them, the metrics and whether they
        are finite. With ``update`` False (a micro-batch) the sums keep this batch's gradients."""
        grads, metrics = self.gradients(batch)
        names = sorted(grads)
        batch_grads = grad_list = [grads[name] for name in names]
        if self.accumulators is not None:
            sums = [self.accumulators[name] for name in names]
            grad_list = [acc.read_value() + grad for acc, grad in zip(sums, grad_list)]
            with tf.control_dependencies(grad_list):  # an update starts the next sums from zero
                stores = [acc.assign(tf.where(update, tf.zeros_like(grad), grad)) for acc, grad in zip(sums, grad_list)]
            with tf.control_dependencies(stores):
                grad_list = [tf.identity(grad) for grad in grad_list]
        grad_list = self.gradient_options.final(grad_list, batch_grads)
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

    def evaluate(self, batch, weight):
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
