"""The network being trained and its compiled steps: which network an epoch trains, switching to
it as RETURNN's ``init_train_epoch`` does (``pretrain``, ``get_network``), creating its variables
and carrying parameters over from the one before. The trainer asks; this decides when the network
changes and what changes with it (step functions, optimizer slots, the syncs' outer state, batching).
"""

from __future__ import annotations

import time
from typing import List, Optional

import tensorflow as tf

from returnn_tpu.errors import ConfigError
from returnn_tpu.optimizers import GradientOptions, StepLearningRate
from returnn_tpu.returnn_side.returnn_bridge import check_xla_compatible
from returnn_tpu.returnn_side.steps import ReplicaSteps


class CurrentNetwork:
    """The network of the epoch being trained, with its step functions (:attr:`steps`).

    ``networks`` (:class:`returnn_tpu.returnn_side.networks.EpochNetworks`) says which network each epoch
    trains, ``builder`` (:class:`returnn_tpu.returnn_side.returnn_bridge.NetworkBuilder`) builds it, ``syncs``
    (:mod:`returnn_tpu.strategies.sync.lifecycle`) and ``data``
    (:class:`returnn_tpu.datapath.epochs.EpochData`) hear of a change, ``workers`` check that every worker
    has the same network.
    """

    def __init__(self, config, options, strategy, *, networks, builder, optimizer, syncs, workers, data,
                 learning_rate_control, batches_per_update: int, worker_index: int, log):
        self.config = config
        self.options = options
        self.strategy = strategy
        self.networks = networks
        self.builder = builder
        self.optimizer = optimizer
        self.syncs = syncs
        self.workers = workers
        self.data = data
        self.learning_rate_control = learning_rate_control
        self.batches_per_update = batches_per_update
        self.worker_index = worker_index
        self.log = log
        self.steps = self._replica_steps()
        if syncs.updates_in_replica and batches_per_update > 1:
            raise ConfigError(
                f"accum_grad_multiple_step cannot be used with {options.strategy!r} yet (the update is "
                "inside the compiled step); use 'local_sgd' or 'mirrored'"
            )
        self.info, self._inspected = None, None  # what the builder's network is, and of which net dict
        self.inspect()
        self.epoch: Optional[int] = None  # the epoch whose network is in use (None: none yet)
        self.built = False  # whether its variables exist and its train step is traced
        self.created_in_epoch = 0  # resuming: the epoch of the checkpoint, in which RETURNN creates the network

    def _replica_steps(self) -> ReplicaSteps:
        """Step functions for the builder's current network (traced on their first call)."""
        return ReplicaSteps(
            self.strategy,
            self.builder,
            self.optimizer,
            jit_compile=self.options.jit_compile,
            syncs=self.syncs,
            gradients=GradientOptions.from_config(self.config),
            step_learning_rate=StepLearningRate.from_config(self.config),
            accumulate=self.batches_per_update > 1,
            worker_index=self.worker_index,
        )

    def inspect(self):
        """What batching needs to know of the builder's network (and, with XLA, whether it compiles);
        once per network dict (each inspection logs RETURNN's layer templates, as its build does)."""
        if self.info is not None and self._inspected is self.builder.net_dict:
            return
        if self.options.jit_compile:
            check_xla_compatible(self.builder.net_dict)
        self.info = self.builder.inspect()
        self._inspected = self.builder.net_dict
        self.workers.check_same_network(self.info.param_shapes)
        self.data.use_network(self.info)

    def use_epoch(self, epoch: int):
        """Switches to the network ``epoch`` trains if it differs from the current one, as RETURNN's
        ``init_train_epoch`` does.

        The step functions are traced anew; parameters of the same name and shape carry over,
        others as ``copy_param_mode`` says; the new network is seeded from the epoch it is created
        in; and, as RETURNN builds a new graph and optimizer then, the optimizer's slots restart.
        """
        net_dict = self.networks.net_dict(epoch)
        if self.networks.apply_config_updates(net_dict, epoch, self.learning_rate_control):
            self.data.read_batching_options()
        first = self.epoch is None
        if not first and not self.networks.differs(self.builder.net_dict, net_dict):
            return
        reset = ()
        if not first:
            print(f"reinit because network description differs (epoch {epoch})", file=self.log.v3)
            if self.networks.copy_param_mode(net_dict, epoch) == "reset":
                reset = list(self.builder.variables.by_name)
            elif self.networks.reset_output_layers(epoch):
                reset = self.info.output_layer_params
            self.optimizer.reset_slots()
            self.syncs.network_changed()
        seeds = self.networks.random_seeds(self.created_in_epoch if first and self.created_in_epoch else epoch)
        self.builder.use_network(
            net_dict,
            seeds=seeds,
            train_param_args=self.networks.train_param_args(epoch),
            allow_new_shapes=self.networks.changes_per_epoch,
            reset=reset,
        )
        tf.random.set_seed(seeds[1])
        self.inspect()
        self.steps = self._replica_steps()
        self.built = False
        self.epoch = epoch

    def build(self, step_batches: List):
        """Creates the network's variables and traces its train step on the first step's batches;
        parameters carry over from the network before as ``copy_param_mode`` says."""
        start = time.perf_counter()
        replicas = self.strategy.num_replicas_in_sync
        print(f"building the network for {replicas} replica{'s' if replicas > 1 else ''} and tracing the train "
              "step ...", file=self.log.v2)
        self.steps.create_variables(step_batches)
        print(f"network built and train step traced in {time.perf_counter() - start:.1f} s", file=self.log.v2)
        self.built = True
        copy_mode = self.networks.copy_param_mode(self.builder.net_dict, self.epoch)
        self.builder.variables.carry_over(copy_mode, self.steps.first_copy, log_file=self.log.v3)
