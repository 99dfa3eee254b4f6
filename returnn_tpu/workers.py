"""The small collectives between workers that the training loop needs: every worker's value of a
number (start epochs, step counts), and element-wise sums (epoch scores).

Each is one all-gather over the strategy's replicas (no separate channel); with one worker they
are free and local.
"""

from __future__ import annotations

from typing import List

import numpy
import tensorflow as tf

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
        rows = [tf.constant([values], tf.float64)] * self.local_replicas
        per_replica = distribute_local_values(self.strategy, rows, self.first_replica)
        return self._gather(per_replica).numpy()[:: self.local_replicas]

    def all_workers(self, value: int) -> List[int]:
        """``value`` of every worker, in worker order; just ``[value]`` alone."""
        return [int(row[0]) for row in self.rows([float(value)])]

    def sum(self, values: List[float]) -> List[float]:
        """Element-wise sums of ``values`` over all workers."""
        return [float(x) for x in numpy.sum(self.rows(values), axis=0)]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any worker."""
        return self.sum([float(flag)])[0] > 0
