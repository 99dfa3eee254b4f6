"""``tf.distribute`` strategies, chosen by the config's ``distribute_strategy``.

Knows nothing of RETURNN: importable and testable without it.
"""

from __future__ import annotations

import tensorflow as tf

from returnn_tpu.errors import ConfigError
from returnn_tpu.options import DistributeOptions
from returnn_tpu.strategies.devices import local_replica_devices
from returnn_tpu.strategies.local_sgd import LocalSGDExtendedMixin, LocalSGDStrategy

__all__ = ["make_strategy", "is_local_sgd", "LocalSGDStrategy", "local_replica_devices"]


def make_strategy(options: DistributeOptions) -> tf.distribute.Strategy:
    """Builds the strategy that ``options.strategy`` names, over this machine's devices."""
    devices = local_replica_devices(options.num_replicas)
    if options.strategy == "single":
        return tf.distribute.OneDeviceStrategy(devices[0])
    if options.strategy == "mirrored":
        return tf.distribute.MirroredStrategy(devices)
    if options.strategy == "local_sgd":
        return LocalSGDStrategy(devices)
    raise ConfigError(f"distribute_strategy {options.strategy!r} is not implemented yet; use 'single', 'mirrored' or 'local_sgd'")


def is_local_sgd(strategy: tf.distribute.Strategy) -> bool:
    """Whether the replicas of ``strategy`` keep their own parameters until an explicit sync."""
    return isinstance(strategy.extended, LocalSGDExtendedMixin)
