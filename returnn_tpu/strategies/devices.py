"""Which local devices the replicas run on, how their collectives are numbered, and per-replica
values made of one tensor per local replica."""

from __future__ import annotations

import itertools
import os
from typing import List, Optional

import tensorflow as tf
from tensorflow.python.distribute import values as values_lib

from returnn_tpu.errors import ConfigError


LOGICAL_DEVICES_PER_CORE = 16  # more replicas per core than that only slow down (each has its own copy)


def local_replica_devices(num_replicas: Optional[int]) -> List[str]:
    """Returns one device name per local replica.

    With GPUs: the first ``num_replicas`` GPUs (all of them if None).
    Without GPUs: the CPU split into ``num_replicas`` logical devices (at most
    :data:`LOGICAL_DEVICES_PER_CORE` per core), which must happen before
    TensorFlow initialises its runtime (before the first op runs); on an initialised runtime
    the split is accepted only if it already has that many CPU devices.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if num_replicas is not None and num_replicas > len(gpus):
            raise ConfigError(
                f"distribute_options['num_replicas'] is {num_replicas}, but this machine has {len(gpus)} GPUs"
            )
        return [f"/gpu:{i}" for i in range(num_replicas or len(gpus))]
    num_replicas = num_replicas or 1
    cores = len(os.sched_getaffinity(0))
    if num_replicas > LOGICAL_DEVICES_PER_CORE * cores:  # TensorFlow's start-up would grow without a word
        raise ConfigError(f"distribute_options['num_replicas'] is {num_replicas}, but this machine has no GPUs and "
                          f"{cores} cores: at most {LOGICAL_DEVICES_PER_CORE} logical CPU devices per core "
                          f"({LOGICAL_DEVICES_PER_CORE * cores})")
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        if num_replicas > 1:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * num_replicas)
    except RuntimeError:  # runtime already initialised (e.g. a second run in one process)
        pass
    available = len(tf.config.list_logical_devices("CPU"))
    if available < num_replicas:
        raise ConfigError(
            f"distribute_options['num_replicas'] is {num_replicas}, but TensorFlow was already initialised with "
            f"{available} CPU devices; start a new process"
        )
    return [f"/cpu:{i}" for i in range(num_replicas)]


_STRATEGIES_MADE = itertools.count()  # by this process, with a collective key base of their own
KEYS_PER_STRATEGY = 100_000


def own_collective_key_base() -> int:
    """A ``_collective_key_base`` no other strategy of this process has been given: 0 for the
    first (TensorFlow's own numbering), then steps of :data:`KEYS_PER_STRATEGY`.

    Mirrored strategies number their collective groups from ``_collective_key_base``, which
    TensorFlow means to be set in tests only; two strategies in one process would reuse the keys
    and TensorFlow, which keeps each collective instance's shape for the process's life, would
    match up unrelated all-reduces (FACTS.md, "Collective keys")."""
    return next(_STRATEGIES_MADE) * KEYS_PER_STRATEGY


def per_replica(values: list):
    """In cross-replica context (a ``merge_call``): the per-replica value whose component on each
    local replica is the tensor of ``values`` at its index (already on that replica's device)."""
    return values_lib.PerReplica(tuple(values))
