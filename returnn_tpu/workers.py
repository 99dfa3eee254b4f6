"""The small collectives between workers that the training loop needs: every worker's value of a
number (start epochs, where an epoch ends), and element-wise sums (epoch scores).

Each is one all-gather over the strategy's replicas (no separate channel); with one worker they
are free and local.
"""

from __future__ import annotations

import zlib
from typing import Dict, List

import numpy
import tensorflow as tf

from returnn_tpu.errors import ConfigError
from returnn_tpu.strategies import distribute_local_values


class WorkerCollectives:
    """Collectives over the workers of ``strategy``; this one is ``worker_index``."""

    def __init__(self, strategy: tf.distribute.Strategy, worker_index: int):
        self.strategy = strategy
        self.local_replicas = len(strategy.extended.worker_devices)
        self.num_workers = strategy.num_replicas_in_sync // self.local_replicas
        self.first_replica = worker_index * self.local_replicas
        self._gather = tf.function(lambda value: strategy.gather(value, axis=0), autograph=False)

    def rows(self, values: List[float]) -> numpy.ndarray:
        """One row of ``values`` per worker, in worker order."""
        if self.num_workers == 1:
            return numpy.array([values], dtype=numpy.float64)
        # One more column: an all-gather of an empty tensor between workers crashes the process
        # (FACTS.md, "Empty all-gathers"), and an epoch continued at its end has no scores.
        rows = [tf.constant([list(values) + [0.0]], tf.float64)] * self.local_replicas
        per_replica = distribute_local_values(self.strategy, rows, self.first_replica)
        return self._gather(per_replica).numpy()[:: self.local_replicas, :-1]

    def row_bytes(self, num_values: int) -> int:
        """What this worker hands to the collective in one :meth:`rows` of ``num_values`` values."""
        return 0 if self.num_workers == 1 else self.local_replicas * (num_values + 1) * 8

    def all_workers(self, value: int) -> List[int]:
        """``value`` of every worker, in worker order; just ``[value]`` alone."""
        return [int(row[0]) for row in self.rows([float(value)])]

    def sum(self, values: List[float]) -> List[float]:
        """Element-wise sums of ``values`` over all workers."""
        return [float(x) for x in numpy.sum(self.rows(values), axis=0)]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any worker."""
        return self.sum([float(flag)])[0] > 0

    def check_same_network(self, param_shapes: Dict[str, tuple]):
        """Every worker's network has the same parameters (names and shapes), or a one-line error
        naming the workers whose network differs from worker 0's, before any collective on them
        (creating the variables broadcasts their initial values: TensorFlow's bare shape mismatch)."""
        described = "\n".join(f"{name} {shape}" for name, shape in param_shapes.items())
        fingerprints = self.all_workers(zlib.crc32(described.encode()))
        differ = [worker for worker, fingerprint in enumerate(fingerprints) if fingerprint != fingerprints[0]]
        if differ:
            raise ConfigError(
                f"worker{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} built another network than "
                f"worker 0 (parameter names and shapes differ; this worker has {len(param_shapes)} parameters): "
                "every worker must run the same config"
            )
