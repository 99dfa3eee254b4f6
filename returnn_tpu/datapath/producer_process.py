"""The data producer process: it answers its trainer's commands with the steps' batches.

:func:`run_producer` is the process (spawned by :class:`returnn_tpu.datapath.producer.DataProducer`): it
loads the config, makes the training datasets and, for each epoch the trainer asks for, the same
:class:`returnn_tpu.datapath.data.EpochBatches` as training in the process would, and puts each step's
arrays into shared memory (:mod:`returnn_tpu.datapath.producer_blocks`) until the data ends or the trainer
says ``stop``. As worker 0's producer with ``data_producer = "chief"``, it also serves the other
workers their parts (:mod:`returnn_tpu.datapath.producer_serving`). Every failure goes to the trainer as an
``error`` message. No TensorFlow here (FACTS.md, "A producer without TensorFlow").
"""

from __future__ import annotations

import os
import signal
import socket
import time
import traceback
from typing import Optional

from returnn_tpu.datapath.producer_blocks import BlockWriter
from returnn_tpu.datapath.producer_protocol import ProducerError, expect
from returnn_tpu.datapath.producer_serving import ServeOptions, WorkerConnections

LOADER_EXIT_SECONDS = 1.0  # a loader whose pipe broke is found dead within this
# Where numpy's BLAS (and OpenMP) take their number of threads; one set by the user is kept.
MATH_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def run_producer(setup: dict, commands, results, released):
    """The producer process: answers the trainer's commands until ``exit`` (or its death).
    ``released``: how many steps the trainer has taken out of their blocks (:class:`BlockWriter`)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before TensorFlow looks: the producer computes nothing on a GPU
    from returnn_tpu.launcher import STOP_SIGNALS, die_with_parent

    die_with_parent()
    one_math_thread()
    for signum in STOP_SIGNALS:  # the trainer decides when to stop
        signal.signal(signum, signal.SIG_IGN)
    workers = None
    blocks = BlockWriter(released, setup["ring"])
    try:
        serve: Optional[ServeOptions] = setup["serve"]
        if serve:
            listener = socket.create_server((serve.host, 0))
            results.put(("listening", listener.getsockname()[1]))
        epochs = _EpochMaker(setup)
        if serve:
            workers = WorkerConnections(listener, serve)
        while True:
            kind, payload = commands.recv()  # closed by the trainer: EOFError
            if kind == "epoch":
                try:
                    _produce_epoch(epochs, payload, commands, results, workers, blocks)
                except (EOFError, OSError):  # the trainer's pipe closed, or a loader's (it died)
                    epochs.check_loaders()
                    raise
    except (EOFError, KeyboardInterrupt):
        return  # the trainer is gone
    except BaseException as exc:  # noqa: BLE001 (every failure goes to the trainer, which stops)
        from returnn_tpu.errors import ConfigError, DatasetError

        if isinstance(exc, ConfigError):  # bad input: the trainer reports it as its own
            error = ("error", str(exc), True)
        elif isinstance(exc, (ProducerError, DatasetError)):  # their own words
            error = ("error", str(exc), False)
        else:
            lines = traceback.format_exception_only(type(exc), exc)
            error = ("error", lines[-1].strip() if lines else type(exc).__name__, False)
        results.put(error)
        if workers:
            try:
                workers.send_all(error)
            except ProducerError:
                pass  # that worker is gone already


def one_math_thread():
    """Numpy's BLAS with one thread in this process and in the loader processes it starts later
    (FACTS.md, "BLAS threads in data processes"): a dataset's features are many small products, which
    BLAS's threads do not make faster, and with one producer or loader per core they only contend.
    Kept as the user set it if any of :data:`MATH_THREAD_VARIABLES` is set."""
    if any(name in os.environ for name in MATH_THREAD_VARIABLES):
        return
    for name in MATH_THREAD_VARIABLES:  # for the loaders: spawned, they read these when numpy loads
        os.environ[name] = "1"
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)  # this process: numpy is loaded already


class _EpochMaker:
    """The producer's training datasets (one per replica it feeds with ``random_seed_offset``) and
    their :class:`returnn_tpu.datapath.data.EpochBatches`.

    No TensorFlow here (FACTS.md, "A producer without TensorFlow"): the trainer sends with each
    request the shapes of the network's ``extern_data`` (:func:`returnn_tpu.datapath.batching.template_shapes`).
    """

    def __init__(self, setup: dict):
        from returnn_tpu.datapath.datasets import init_datasets
        from returnn_tpu.startup import load_config

        config = load_config(setup["config_filename"], setup["overrides"])
        self.datasets = init_datasets(config, setup["dataset_key"], setup["num_replicas"], setup["first_replica"],
                                      setup["distribution"], all_replicas=setup["all_replicas"],
                                      loaders=setup["loaders"])

    def check_loaders(self):
        """Raises a :class:`ProducerError` naming a loader process of ``data_loaders`` that has
        died (RETURNN's ``MultiProcDataset`` sees only its pipe close: FACTS.md, "MultiProcDataset").
        A dying process closes its pipes before it can be waited for: this waits up to
        :data:`LOADER_EXIT_SECONDS` in all for that."""
        loaders = [loader for dataset in self.datasets for loader in getattr(dataset, "_worker_procs", None) or ()]
        deadline = time.monotonic() + LOADER_EXIT_SECONDS
        for loader in loaders:
            loader.join(timeout=max(0.0, deadline - time.monotonic()))
            if not loader.is_alive():
                raise ProducerError(f"its data loader process {loader.pid} ({loader.name}) died (exit status "
                                    f"{loader.exitcode})") from None

    def start(self, request: dict):
        """The EpochBatches of ``request`` (its epoch started: RETURNN's ``init_seq_order``)."""
        from returnn_tpu.datapath.batching import templates_from_shapes
        from returnn_tpu.datapath.data import EpochBatches

        request = dict(request)
        extern_data = templates_from_shapes(request.pop("templates"))
        return EpochBatches(self.datasets, extern_data=extern_data, prefetch=1, **request)


def _produce_epoch(epochs: _EpochMaker, request: dict, commands, results, workers: Optional[WorkerConnections],
                   blocks: BlockWriter):
    """Epoch ``request["epoch"]``: started (and the other workers, which ask for the same epoch,
    told), then, after the trainer's ``go``, each step's batches, until the data ends or the
    trainer says ``stop``."""
    others = range(1, len(workers.connections) + 1) if workers else range(0)
    batches = epochs.start(request)
    for worker in others:
        asked = workers.receive(worker, "epoch")
        if asked != request["epoch"]:
            raise ProducerError(f"worker {worker} asked the data producer for epoch {asked}, worker 0 for "
                                f"{request['epoch']}")
    results.put(("started", batches.start_seconds))
    for worker in others:
        workers.send(worker, ("started", batches.start_seconds))
    ((first_step, batch_offset, points),) = expect(commands.recv(), "go", "the step to begin at")
    for worker in others:
        if workers.receive(worker, "go")[:2] != (first_step, batch_offset):
            raise ProducerError(f"worker {worker} and worker 0 asked for different steps of epoch {request['epoch']}")
    batches.start_at(first_step, batch_offset, points)
    for step, (step_batches, weights) in enumerate(batches, start=first_step):
        if commands.poll() and commands.recv()[0] == "stop":
            break
        step_points = batches.positions.take(step)
        if workers:
            results.put(("step", *blocks.put(workers.own_part(step_batches, 0)), workers.own_part(weights, 0),
                         workers.own_part(step_points, 0)))
            for worker in others:
                workers.send(worker, ("step", None, *(workers.own_part(items, worker)
                                                      for items in (step_batches, weights, step_points))))
        else:
            results.put(("step", *blocks.put(step_batches), weights, step_points))
    results.put(("end", batches.batching.take_counters()))
    for worker in others:
        workers.send(worker, ("end", {}))
