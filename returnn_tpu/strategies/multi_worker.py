"""Strategies across worker processes: TensorFlow's collective all-reduce over gRPC, with timeouts.

* :class:`TrainerMultiWorkerLocalSGDStrategy`: the RETURNN trainer's local SGD; steps need no
  communication, a sync is one bucketed collective all-reduce over all replicas of all workers
  (see :mod:`returnn_tpu.strategies.sync`).
* :class:`MultiWorkerLocalSGDStrategy`: local SGD for a TF2 or Keras program.
* :class:`MultiWorkerMirroredStrategy`: TensorFlow's synchronous multi-worker strategy.

Both wait at most ``startup_timeout`` seconds for the cluster and raise
:class:`~returnn_tpu.strategies.startup_barrier.ClusterDidNotComeUp`, naming the workers that did
not answer. A worker that dies or hangs later makes the others' collectives
fail within :data:`PEER_LOSS_BOUND_SECONDS` (TensorFlow's peer health check, tuned here; a
per-collective ``collective_timeout`` is optional, since each collective with one leaves threads
behind for that long: FACTS.md, "Peer health"). A dead worker is usually found within seconds ("connection refused" from
``/job:worker/replica:0/task:N``), which the command reports in one line. Parameters are reduced
in packs of ``bucket_bytes`` (few large all-reduces, not one per variable).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as car
from tensorflow.python.eager import context

from returnn_tpu.strategies import startup_watchdog
from returnn_tpu.strategies.startup_barrier import own_task, task_addresses, wait_for_workers
from returnn_tpu.strategies.extended import LocalSGDExtendedMixin
from returnn_tpu.strategies.local_sgd import ScheduledLocalSGDMixin


def joined_cluster() -> bool:
    """Whether this process has joined a multi-worker cluster (TensorFlow's coordination service
    is configured once it has)."""
    return context.context().coordination_service is not None


def report_error_to_cluster(message: str) -> bool:
    """Hands ``message`` to TensorFlow's coordination service as an error of this worker: every
    other worker's next (or pending) collective fails with it (FACTS.md, "A refusal under TF_CONFIG").
    False if the service holds an error already (another worker reported first)."""
    try:
        context.context().report_error_to_cluster(tf.errors.INVALID_ARGUMENT, message)
    except tf.errors.OpError:
        return False
    return True


def communication_options(collective_timeout, bucket_bytes: int):
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=bucket_bytes,
        timeout_seconds=collective_timeout,
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
    )


# After the barrier every worker is up: TensorFlow's own start-up gets at least this long.
TENSORFLOW_STARTUP_SECONDS = 60.0


@contextlib.contextmanager
def startup_deadline(cluster_resolver, startup_timeout: float, option: str):
    """Ends this process with an error naming the missing workers if TensorFlow's start-up takes
    longer than ``startup_timeout``; the error names ``option``, where the user set the timeout.

    See :mod:`returnn_tpu.strategies.startup_watchdog` for why this is a separate process. Meanwhile
    SIGHUP, the watchdog's signal, runs C's ``_exit(1)`` (signal number 1 as the status) without
    the GIL that TensorFlow holds; the process's own SIGHUP handler is back afterwards.
    """
    own = own_task(cluster_resolver)
    peers = [f"{name}={address}" for name, address in task_addresses(cluster_resolver).items() if name != own]
    # The file itself, not ``-m``: the package's __init__ would import TensorFlow (seconds of CPU).
    watchdog = subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(startup_watchdog.__file__), str(os.getpid()),
         str(startup_timeout), option, own, *peers],
        stdin=subprocess.PIPE,
    )
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    previous = libc.signal(signal.SIGHUP, ctypes.cast(libc._exit, ctypes.c_void_p))
    try:
        yield
    finally:
        watchdog.stdin.close()
        watchdog.wait()
        libc.signal(signal.SIGHUP, previous)


class TimedCollectiveExtended(car.CollectiveAllReduceExtended):
    """``CollectiveAllReduceExtended`` with a start-up timeout that names missing workers (first
    :func:`~returnn_tpu.strategies.startup_barrier.wait_for_workers`, whose exception a program can
    catch; then TensorFlow's start-up under :func:`startup_deadline`), and a
    peer health check every 5 s (TensorFlow's: 30 s) that gives up on a peer after 3 tries of 5 s,
    so that a dead or hung peer aborts all collectives within :data:`PEER_LOSS_BOUND_SECONDS`."""

    _check_health_interval = 5
    _check_health_timeout = 5
    _check_health_retry_limit = 3
    startup_option = "distribute_options['startup_timeout']"  # where the user sets it, for the error

    def __init__(self, container_strategy, cluster_resolver, options, startup_timeout: float):
        if cluster_resolver is None:
            cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        deadline = contextlib.nullcontext()
        if cluster_resolver.cluster_spec().jobs:  # else one process: nothing to wait for
            waited = wait_for_workers(cluster_resolver, startup_timeout, self.startup_option)
            deadline = startup_deadline(cluster_resolver, max(startup_timeout - waited, TENSORFLOW_STARTUP_SECONDS),
                                        self.startup_option)
        with deadline:
            super().__init__(container_strategy, cluster_resolver=cluster_resolver, communication_options=options)


PEER_LOSS_BOUND_SECONDS = (
    TimedCollectiveExtended._check_health_interval
    + TimedCollectiveExtended._check_health_retry_limit * TimedCollectiveExtended._check_health_timeout
)


class MultiWorkerLocalSGDExtended(LocalSGDExtendedMixin, TimedCollectiveExtended):
    """Local SGD over all replicas of all workers. All behaviour is in the two bases."""


class _MultiWorkerStrategy(car.CollectiveAllReduceStrategy):
    """Builds its extended itself (the base class would build a plain one)."""

    extended_class = TimedCollectiveExtended

    def __init__(self, cluster_resolver, *, collective_timeout, bucket_bytes: int, startup_timeout: float):
        options = communication_options(collective_timeout, bucket_bytes)
        extended = self.extended_class(self, cluster_resolver, options, startup_timeout)
        tf.distribute.Strategy.__init__(self, extended)  # skip CollectiveAllReduceStrategy.__init__


class MultiWorkerMirroredStrategy(_MultiWorkerStrategy):
    """TensorFlow's synchronous multi-worker strategy with start-up and collective timeouts."""


class TrainerMultiWorkerLocalSGDStrategy(_MultiWorkerStrategy):
    """Local SGD across workers for the RETURNN trainer: every worker trains its replicas' copies.

    Start one process per worker, each with the same ``TF_CONFIG`` cluster and its own task.
    """

    extended_class = MultiWorkerLocalSGDExtended


class ScheduledMultiWorkerLocalSGDExtended(ScheduledLocalSGDMixin, MultiWorkerLocalSGDExtended):
    """:class:`ScheduledLocalSGDMixin` over all replicas of all workers."""

    startup_option = "MultiWorkerLocalSGDStrategy(startup_timeout=...)"

    def __init__(self, container_strategy, cluster_resolver, communication, startup_timeout: float, local_sgd_options):
        super().__init__(container_strategy, cluster_resolver, communication, startup_timeout)
        self._start_schedule(local_sgd_options, keep_synced_model=True)  # a survivor of a lost peer saves it


class MultiWorkerLocalSGDStrategy(car.CollectiveAllReduceStrategy):
    """Local SGD across workers for a TF2 or Keras program: a drop-in replacement of
    ``tf.distribute.MultiWorkerMirroredStrategy`` (``TF_CONFIG``, or ``cluster_resolver``), whose
    copies are combined over all workers on local SGD's schedule
    (:class:`returnn_tpu.strategies.local_sgd.ScheduledLocalSGDMixin`).

    ``local_sgd_options`` are those of :class:`returnn_tpu.strategies.LocalSGDStrategy`, and
    ``sync_bucket_bytes`` (the size of the all-reduces between workers). A start-up that takes
    longer than ``startup_timeout`` seconds raises
    :class:`~returnn_tpu.strategies.startup_barrier.ClusterDidNotComeUp`, naming the missing workers.
    """

    def __init__(self, cluster_resolver=None, startup_timeout: float = 300.0, **local_sgd_options):
        from returnn_tpu.options import check_tf2_local_sgd_options

        options = check_tf2_local_sgd_options(local_sgd_options, "MultiWorkerLocalSGDStrategy", multi_worker=True)
        communication = communication_options(None, options.sync_bucket_bytes)
        extended = ScheduledMultiWorkerLocalSGDExtended(self, cluster_resolver, communication, startup_timeout, options)
        tf.distribute.Strategy.__init__(self, extended)  # skip CollectiveAllReduceStrategy.__init__

    def reduce(self, reduce_op, value, axis):
        """``Strategy.reduce`` as Keras 3's ``fit`` calls it on a multi-worker strategy, which
        TensorFlow's own cannot do (FACTS.md, "Keras fit across workers"): a nested structure of
        values is reduced value by value (``fit`` reduces its first ``(x, y)`` batch to build the
        model), and a scalar along ``axis`` 0 is the replicas' scalars reduced (``fit`` reduces
        each step's metrics so)."""
        if tf.nest.is_nested(value):
            return tf.nest.map_structure(lambda one: self.reduce(reduce_op, one, axis), value)
        one = value.values[0] if isinstance(value, tf.distribute.DistributedValues) else value
        if axis is not None and getattr(one, "shape", None) is not None and one.shape.rank == 0:
            axis = None
        return super().reduce(reduce_op, value, axis)
