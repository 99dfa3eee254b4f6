"""The compiled functions of a training run: train step, eval step, parameter sync, gather.

A train step is a ``tf.function`` that calls ``strategy.run`` on the per-replica forward and
backward pass (the RETURNN network is built inside that trace, see
:mod:`returnn_tpu.returnn_bridge`), optionally compiled by XLA. The update then happens

* in cross-replica context (CPU/GPU strategies): :meth:`Optimizer.apply` reduces the gradients
  as the strategy defines (local SGD: not at all) and updates every copy; local-SGD syncs are
  separate calls of :meth:`ReplicaSteps.sync` between steps;
* or inside ``strategy.run`` (TPU strategies, and ``local_sgd_tpu`` on local devices): every
  replica applies its (for synchronous training: all-reduced) gradients, and local SGD averages
  under ``tf.cond`` on the step counter, all in one program.

Gradients are treated as RETURNN's updater treats them, in its order: ``maximize_grad_norm``
added, summed over ``accum_grad_multiple_step`` micro-batches (:meth:`ReplicaSteps.accumulate`
adds a micro-batch's gradients to per-replica sums, the next :meth:`ReplicaSteps.train` adds its
own and applies), then noise and clipping (:class:`returnn_tpu.optimizers.GradientOptions`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy
import tensorflow as tf

from returnn_tpu.errors import ConfigError
from returnn_tpu.optimizers import GradientOptions, Optimizer
from returnn_tpu.returnn_bridge import NetworkBuilder, loss_metrics, static_replica_id, without_summaries
from returnn_tpu.strategies import is_local_sgd, syncs_in_step


class ReplicaSteps:
    """The step functions for one strategy, network and optimizer.

    :param worker_index: this worker's index in the cluster (0 on one machine).
    """

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        builder: NetworkBuilder,
        optimizer: Optimizer,
        *,
        jit_compile: bool,
        param_sync_step: int,
        gradients: GradientOptions = GradientOptions(),
        accumulate: bool = False,
        worker_index: int = 0,
    ):
        self.strategy = strategy
        self.builder = builder
        self.optimizer = optimizer
        self.param_sync_step = param_sync_step
        self.gradients = gradients
        self.accumulators: Optional[Dict[str, tf.Variable]] = {} if accumulate else None  # per-replica gradient sums
        self.num_replicas = strategy.num_replicas_in_sync  # over all workers
        self.local_replicas = len(strategy.extended.worker_devices)
        self.num_workers = self.num_replicas // self.local_replicas
        self.first_replica = worker_index * self.local_replicas  # global index of this worker's first
        self.local_sgd = is_local_sgd(strategy)
        self.in_step = syncs_in_step(strategy)
        self.trainable_names: Optional[List[str]] = None  # known after the first trace
        self.compiled_shapes = set()  # input shapes the XLA replica step was compiled for
        # With XLA: one trace (and compilation) per bucket shape; else one trace for all shapes.
        self._train = tf.function(
            self._train_in_replica_fn if self.in_step else self._train_fn,
            autograph=False,
            reduce_retracing=not jit_compile,
        )
        self._jit_forward_backward = (
            tf.function(self._forward_backward_xla, autograph=False, jit_compile=True) if jit_compile else None
        )
        self._accumulate = tf.function(self._accumulate_fn, autograph=False, reduce_retracing=not jit_compile)
        self._evaluate = tf.function(self._evaluate_fn, autograph=False, reduce_retracing=True)
        self._sync = tf.function(self._sync_fn, autograph=False)
        self._gather = tf.function(lambda value: self.strategy.gather(value, axis=0), autograph=False)
        # Per-replica batches -> (per-replica gradients by name, metrics), without an update.
        self.replica_gradients = tf.function(
            lambda batches: self.strategy.run(self._replica_train, args=(batches,)), autograph=False
        )

    # ---- public ---------------------------------------------------------------------------------

    def distribute(self, per_replica: List):
        """One value per local replica -> the strategy's per-replica value."""
        if self.num_replicas == 1:
            return per_replica[0]
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: per_replica[ctx.replica_id_in_sync_group - self.first_replica]
        )

    def create_variables(self, first_step: List):
        """Creates the parameters (by tracing the forward/backward pass), the optimizer state, and
        traces the train step, on one batch per local replica."""
        batches = self.distribute(first_step)
        self.optimizer.create_step(self.strategy)
        self.replica_gradients.get_concrete_function(batches)
        self.optimizer.create_state(self.strategy, self.trainable_variables())
        if self.accumulators is not None:
            with self.strategy.scope():
                for name in self.trainable_names:
                    var = self.builder.variables.by_name[name]
                    self.accumulators[name] = tf.Variable(
                        tf.zeros(var.shape, var.dtype), trainable=False, name=f"{name}/accum_grad",
                        synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM,
                    )
        self._train.get_concrete_function(batches, tf.constant(0.0))

    def train(self, step_batches: List, learning_rate: float) -> Tuple[Dict, Optional[object]]:
        """One step; returns the per-replica metrics and, for in-step local SGD, whether it synced."""
        outputs = self._train(self.distribute(step_batches), tf.constant(learning_rate, tf.float32))
        if not self.in_step:
            return outputs, None
        metrics, synced = outputs
        return metrics, bool(self.strategy.experimental_local_results(synced)[0]) if self.local_sgd else None

    def accumulate(self, step_batches: List) -> Dict:
        """A micro-batch of ``accum_grad_multiple_step``: adds each replica's gradients to its sums,
        without an update. Returns the per-replica metrics."""
        return self._accumulate(self.distribute(step_batches))

    def evaluate(self, step_batches: List, weights: List[float]) -> Dict:
        """Per-replica metrics of the eval network, each replica's scaled by its weight (0: padding)."""
        weights = self.distribute([tf.constant(w, tf.float32) for w in weights])
        return self._evaluate(self.distribute(step_batches), weights)

    def sync(self):
        """Averages the trainable parameters over all replicas (local SGD)."""
        self._sync()

    def gather_rows(self, values: List[float]) -> numpy.ndarray:
        """One row of ``values`` per worker, gathered from all workers (one collective)."""
        if self.num_workers == 1:
            return numpy.array([values], dtype=numpy.float64)
        per_replica = self.distribute([tf.constant([values], tf.float64)] * self.local_replicas)
        return self._gather(per_replica).numpy()[:: self.local_replicas]

    def trainable_variables(self) -> List[tf.Variable]:
        return [self.builder.variables.by_name[name] for name in self.trainable_names]

    # ---- traced ---------------------------------------------------------------------------------

    def _replica_train(self, batch):
        """One replica's gradients (clipped) and metrics, compiled by XLA with ``jit_compile``."""
        if self._jit_forward_backward is not None:
            return self._jit_forward_backward(batch, static_replica_id())
        return self._forward_backward(batch, static_replica_id())

    def _forward_backward_xla(self, batch, replica_id: int):
        self.compiled_shapes.add(tuple(sorted((k, tuple(v.shape)) for k, v in batch.items())))
        with without_summaries():  # summary ops have no XLA kernel (FACTS.md, "XLA")
            return self._forward_backward(batch, replica_id)

    def _forward_backward(self, batch, replica_id: int):
        from returnn.log import log

        with tf.GradientTape() as outer_tape:  # only used for maximize_grad_norm (a second derivative)
            with tf.GradientTape() as tape:
                net, params = self.builder.build(
                    batch, train=True, replica_id=replica_id, global_step=self.optimizer.step
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

    def _replica_update_gradients(self, batch):
        """One replica's final gradients of an update: its micro-batch sums (if accumulating) plus
        this batch's, with RETURNN's noise and clipping. Returns them and the metrics."""
        grads, metrics = self._replica_train(batch)
        names = sorted(grads)
        batch_grads = grad_list = [grads[name] for name in names]
        if self.accumulators is not None:
            sums = [self.accumulators[name] for name in names]
            grad_list = [acc.read_value() + grad for acc, grad in zip(sums, grad_list)]
            with tf.control_dependencies(grad_list):
                resets = [acc.assign(tf.zeros_like(acc)) for acc in sums]
            with tf.control_dependencies(resets):
                grad_list = [tf.identity(grad) for grad in grad_list]
        return dict(zip(names, self.gradients.final(grad_list, batch_grads))), metrics

    def _replica_accumulate(self, batch):
        grads, metrics = self._replica_train(batch)
        with tf.control_dependencies([self.accumulators[name].assign_add(grad) for name, grad in grads.items()]):
            return {key: tf.identity(value) for key, value in metrics.items()}

    def _accumulate_fn(self, batch):
        return self.strategy.run(self._replica_accumulate, args=(batch,))

    def _train_fn(self, batch, learning_rate):
        grads, metrics = self.strategy.run(self._replica_update_gradients, args=(batch,))
        grads_and_vars = [(grads[name], self.builder.variables.by_name[name]) for name in sorted(grads)]
        self.optimizer.apply(self.strategy, grads_and_vars, learning_rate)  # runs: tf.function keeps stateful ops
        return metrics

    def _train_in_replica_fn(self, batch, learning_rate):
        return self.strategy.run(self._replica_train_and_apply, args=(batch, learning_rate))

    def _replica_train_and_apply(self, batch, learning_rate):
        grads, metrics = self._replica_update_gradients(batch)
        names = sorted(grads)
        grad_list = [grads[name] for name in names]
        if not self.local_sgd:
            grad_list = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.MEAN, grad_list)
        variables = [self.builder.variables.by_name[name] for name in names]
        step = self.optimizer.apply_in_replica(self.strategy, list(zip(grad_list, variables)), learning_rate)
        due = tf.equal(tf.math.floormod(step, self.param_sync_step), 0)
        if self.local_sgd:
            self.strategy.extended.sync_in_replica(variables, due)
        return metrics, due

    def _replica_evaluate(self, batch, weight):
        net, _ = self.builder.build(
            batch, train=False, replica_id=static_replica_id(), global_step=self.optimizer.step
        )
        return {key: value * weight for key, value in loss_metrics(net, train=False).items()}

    def _evaluate_fn(self, batch, weight):
        return self.strategy.run(self._replica_evaluate, args=(batch, weight))

    def _sync_fn(self):
        variables = self.trainable_variables()
        if self.in_step:
            self.strategy.run(lambda: self.strategy.extended.sync_in_replica(variables, tf.constant(True)))
        else:
            self.strategy.sync(variables)
