"""``tf.distribute`` strategies, chosen by the config's ``distribute_strategy``.

Knows nothing of RETURNN: importable and testable without it.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from returnn_tpu.cluster import Cluster
from returnn_tpu.errors import ConfigError
from returnn_tpu.options import TPU_STRATEGY_NAMES, DistributeOptions
from returnn_tpu.strategies.devices import local_replica_devices, own_collective_key_base
from returnn_tpu.strategies.extended import is_local_sgd, updates_in_replica
from returnn_tpu.strategies.local_sgd import LocalSGDStrategy, SyncCallback, TrainerLocalSGDStrategy
from returnn_tpu.strategies.multi_worker import (MultiWorkerLocalSGDStrategy, MultiWorkerMirroredStrategy,
                                                 TrainerMultiWorkerLocalSGDStrategy)
from returnn_tpu.strategies.startup_barrier import ClusterDidNotComeUp
from returnn_tpu.strategies.sync import CopiesAlwaysEqual, SyncDue
from returnn_tpu.strategies.tpu import LocalSGDTPUStrategy, TrainerLocalSGDTPUStrategy, make_tpu_strategy

__all__ = [
    "make_strategy",
    "make_syncs",
    "CopiesAlwaysEqual",
    "SyncDue",
    "LocalSGDStrategy",
    "TrainerLocalSGDStrategy",
    "SyncCallback",
    "MultiWorkerLocalSGDStrategy",
    "ClusterDidNotComeUp",
    "TrainerMultiWorkerLocalSGDStrategy",
    "MultiWorkerMirroredStrategy",
    "LocalSGDTPUStrategy",
    "TrainerLocalSGDTPUStrategy",
    "local_replica_devices",
    "distribute_local_values",
    "with_own_collective_keys",
]


def with_own_collective_keys(cls, *args, **kwargs):
    """``cls(*args)`` (a mirrored strategy: TensorFlow's or ours) with collective keys no other
    strategy of this process uses (:func:`own_collective_key_base`). A training run makes one
    strategy, which keeps TensorFlow's numbering; a process that makes more (the tests,
    ``--check``, benchmarks, a TF2 program comparing strategies) gives each later one a base of
    its own."""
    strategy = cls.__new__(cls)
    strategy._collective_key_base = own_collective_key_base()
    strategy.__init__(*args, **kwargs)
    return strategy


def make_strategy(options: DistributeOptions, cluster: Optional[Cluster] = None) -> tf.distribute.Strategy:
    """Builds the strategy that ``options.strategy`` names.

    With a ``cluster`` of several workers, ``local_sgd`` and ``multi_worker_mirrored`` span all of
    them (one replica per worker on CPU; per GPU on GPU machines); otherwise this machine's devices.
    """
    multi_worker = cluster is not None and cluster.num_workers > 1
    if options.strategy == "multi_worker_mirrored" or (options.strategy == "local_sgd" and multi_worker):
        cls = TrainerMultiWorkerLocalSGDStrategy if options.strategy == "local_sgd" else MultiWorkerMirroredStrategy
        return with_own_collective_keys(
            cls,
            cluster.resolver if cluster else None,
            collective_timeout=options.collective_timeout,
            bucket_bytes=options.sync_bucket_bytes,
            startup_timeout=options.startup_timeout,
        )
    if options.strategy in TPU_STRATEGY_NAMES:
        if options.strategy == "local_sgd_tpu" and options.cluster_resolver == "local":
            # The TPU program's in-step sync, on local devices: to run the TPU path without a TPU.
            devices = local_replica_devices(options.num_replicas)
            return with_own_collective_keys(TrainerLocalSGDStrategy, devices, in_step_sync=True)
        return make_tpu_strategy(options.strategy)
    devices = local_replica_devices(options.num_replicas)
    if options.strategy == "single":
        return tf.distribute.OneDeviceStrategy(devices[0])
    if options.strategy == "mirrored":
        return with_own_collective_keys(tf.distribute.MirroredStrategy, devices)
    if options.strategy == "local_sgd":
        return with_own_collective_keys(TrainerLocalSGDStrategy, devices)
    raise AssertionError(f"unhandled distribute_strategy {options.strategy!r}")  # options.py validated it


def make_syncs(options: DistributeOptions, strategy: tf.distribute.Strategy, *, num_workers: int,
               any_worker) -> CopiesAlwaysEqual:
    """The RETURNN trainer's side of ``strategy``: for synchronous strategies the mean gradient of
    every update; for local SGD the host driver of the strategy's extended, which owns the
    schedule, the engine and their state (:meth:`~returnn_tpu.strategies.extended.LocalSGDExtendedMixin.start_host_syncs`)."""
    if not is_local_sgd(strategy):
        return CopiesAlwaysEqual(strategy, updates_in_replica=updates_in_replica(strategy))
    return strategy.extended.start_host_syncs(options, num_workers=num_workers, any_worker=any_worker)


def check_replicas_per_worker(options: DistributeOptions, cluster: Optional[Cluster]):
    """Before TensorFlow's devices start: a CPU worker of several has one replica
    (``make_strategy``'s multi-worker strategies place one per worker on CPU); bad input otherwise."""
    if cluster is None or cluster.num_workers < 2 or (options.num_replicas or 1) == 1:
        return
    if not tf.config.list_physical_devices("GPU"):
        raise ConfigError(f"distribute_options['num_replicas'] must be 1 (or left out) with several CPU workers "
                          f"(each has one replica), got {options.num_replicas}; or run on GPUs")


def varying_shapes_spec(batches):
    """The trace signature of per-replica batches (as :func:`distribute_local_values` makes them)
    with the first two dimensions of every array (batch and time, which RETURNN's batches vary)
    left open, so that one trace serves all batches; TensorFlow's own retracing would trace the
    first shape, then again for the second."""
    from tensorflow.python.distribute import values as values_lib

    def spec(value):
        if isinstance(value, values_lib.PerReplica):
            return values_lib.PerReplicaSpec(*[spec(v) for v in value.values])
        shape = tf.TensorShape(value.shape)  # a tensor's, or a NumPy array's
        return tf.TensorSpec([None] * min(2, shape.rank) + shape.as_list()[2:], tf.as_dtype(value.dtype))

    return tf.nest.map_structure(spec, batches)


def distribute_local_values(strategy: tf.distribute.Strategy, values: list, first_replica: int = 0):
    """One value per local replica (this worker's, whose first has global index ``first_replica``)
    -> the strategy's per-replica value."""
    if strategy.num_replicas_in_sync == 1:
        return values[0]
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: values[ctx.replica_id_in_sync_group - first_replica]
    )
