"""The dataset producer: RETURNN dataset iteration, batching and padding in a process of its own.

With ``distribute_options["data_producer"] = "process"`` (the default), each worker starts one
producer process. It loads the same config (the same file and ``++`` overrides), creates the
same training datasets and runs the same :class:`returnn_tpu.datapath.data.EpochBatches` as training in
the process would, so its batches are those batches, bit for bit. Training then spends its
time in steps, not in Python reading and padding data, which shares a core with the step's
dispatch.

Per epoch the trainer sends what the batches depend on (the network's data keys, whether it is
recurrent, RETURNN's batching options, the replicas' slots); the producer starts the epoch
(RETURNN's ``init_seq_order``) and says so, then, after the trainer's ``go`` (the step to begin
at), makes the steps as they are taken and writes each step's arrays into a POSIX shared memory
block of a ring it reuses, at most ``data_prefetch`` steps ahead, until the data ends (``end``) or
the trainer says ``stop`` (where all workers agreed the epoch ends:
:class:`returnn_tpu.datapath.epochs.TrainEpoch`). Only the block's name and the arrays' layout travel
through the queue; the trainer copies the arrays out (one ``memcpy``) and releases the block.

With ``data_producer = "chief"`` and several workers, only worker 0 starts a producer. It makes
the batches of all replicas of all workers (the same ones each worker's own producer would make,
so training is the same) and sends the other workers theirs over TCP (:class:`RemoteProducer`):
the dataset is read once per epoch across the cluster. It listens on worker 0's address of the
cluster spec (not on every interface), on a port it picks, which worker 0 tells the others
through the workers' collective, together with a random key that every connection must prove
(``multiprocessing.connection``'s HMAC challenge) before anything is unpickled.

A producer that raises ends training with its error (the last line of its traceback; bad input
it finds, such as a dataset that refuses its options, is the one-line error of bad input); one
that dies (killed, out of memory) is found within :data:`LIVENESS_SECONDS`, a remote one within
:data:`REMOTE_SILENCE_SECONDS` (it sends a heartbeat while it has nothing else to send).

This module is the trainer's side (:class:`DataProducer`, :class:`ProducedEpoch`,
:class:`RemoteProducer`). The process itself is :mod:`returnn_tpu.datapath.producer_process`, worker 0's
serving of the other workers :mod:`returnn_tpu.datapath.producer_serving`, the shared memory blocks
:mod:`returnn_tpu.datapath.producer_blocks`, and the messages' checks :mod:`returnn_tpu.datapath.producer_protocol`.
"""


import atexit
import glob
import itertools
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import time
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from returnn_tpu.datapath.positions import StepPoints
from returnn_tpu.datapath.producer_blocks import BLOCK_PREFIX, BlockReader, remove_stale_blocks
from returnn_tpu.datapath.producer_process import run_producer
from returnn_tpu.datapath.producer_protocol import ProducerError, expect, raise_error
from returnn_tpu.datapath.producer_serving import ServeOptions

LIVENESS_SECONDS = 1.0  # how often a waiting trainer checks that its producer still runs
WAIT_REPORT_SECONDS = 60.0  # a trainer waiting this long for its producer says so, and again each time
REMOTE_SILENCE_SECONDS = 30.0  # a worker that hears nothing of worker 0's producer this long stops
STOPPED_SECONDS = 30.0  # a producer stopped by a signal this long while training waits is an error
CLOSE_SECONDS = 5.0  # how long a producer told to end may take before it is killed


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (Linux's process state ``T``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


class DataProducer:
    """One producer process for the training dataset of ``config_filename`` (with
    ``overrides``); created once per worker, ended by :meth:`close` or with the trainer's process.
    With ``loaders`` > 1 its datasets load their sequences in that many processes of their own
    (:func:`returnn_tpu.datapath.datasets.with_loaders`), which end with it."""

    def __init__(self, config_filename: str, overrides: Sequence[str], *, dataset_key: str, num_replicas: int,
                 first_replica: int, distribution: str, prefetch: int, all_replicas: Optional[int] = None,
                 serve: Optional["ServeOptions"] = None, loaders: int = 1):
        remove_stale_blocks()
        context = multiprocessing.get_context("spawn")  # no fork of a process that runs TensorFlow
        self._commands, commands_end = context.Pipe()
        try:
            self._results = context.Queue(maxsize=prefetch)  # named semaphores in /dev/shm
        except OSError as exc:  # the machine's setting: a restart on it cannot help, so status 2 as bad input
            from returnn_tpu.errors import ConfigError

            free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
            raise ConfigError(f"cannot make the data producer's queue in /dev/shm ({free / 1e3:.0f} kB free there): "
                              f"{exc.strerror or exc}; make /dev/shm larger (docker: --shm-size), or set "
                              "distribute_options['data_producer'] = 'thread'") from None
        ring = prefetch + 2  # the queue's steps, the one the trainer copies and the one being written
        released = context.RawValue("q", 0)
        self._blocks = BlockReader(released, ring)
        setup = dict(config_filename=config_filename, overrides=list(overrides), dataset_key=dataset_key,
                     num_replicas=num_replicas, first_replica=first_replica, distribution=distribution,
                     all_replicas=all_replicas, serve=serve, loaders=loaders, ring=ring)
        # Not daemonic: a dataset may start processes of its own (DistributeFilesDataset's sub-epoch
        # workers), which a daemonic process may not. close() ends it, also at exit: registered
        # after multiprocessing's own exit handler, it runs before it (which would join the producer).
        self._process = context.Process(target=run_producer, args=(setup, commands_end, self._results, released),
                                        name="returnn_tpu data producer", daemon=False)
        self._process.start()
        self._names_dropped = False
        atexit.register(self.close)

    @property
    def pid(self) -> int:
        return self._process.pid

    def port(self) -> int:
        """With ``serve``: the port the producer listens on for the other workers."""
        (port,) = expect(self.receive(what="the port it listens on"), "listening", "the port it listens on")
        return port

    def epoch(self, *, epoch: int, batching, data_keys: Sequence[str], templates: dict, recurrent: bool,
              train: bool, slots: Optional[range], num_slots: Optional[int], pad_last: bool,
              while_waiting: Optional[Callable[[], None]] = None) -> "ProducedEpoch":
        """Asks for an epoch's batches (the arguments of :class:`returnn_tpu.datapath.data.EpochBatches`,
        with ``templates`` from :func:`returnn_tpu.datapath.batching.template_shapes` for its ``extern_data``);
        returns once the producer has started the epoch (``while_waiting`` is called about every
        second meanwhile, and may raise)."""
        self.send("epoch", dict(epoch=epoch, batching=batching, data_keys=list(data_keys), templates=templates,
                                recurrent=recurrent, train=train, slots=slots, num_slots=num_slots,
                                pad_last=pad_last))
        return ProducedEpoch.started(self, epoch, batching, while_waiting)

    # What ProducedEpoch needs of a producer (RemoteProducer has the same).

    def send(self, kind: str, payload):
        try:
            self._commands.send((kind, payload))
        except OSError as exc:  # it exited (after an error it sent, or killed)
            raise ProducerError(f"data producer (pid {self.pid}) is gone: {exc}") from None

    def alive(self) -> bool:
        return self._process.is_alive()

    def unpack(self, message) -> List[dict]:
        """The batches of a ``step`` message (copied out of its shared memory block)."""
        return self._blocks.take(*message[1:3])

    def discard(self, message):
        """Releases the block of a ``step`` message that training does not take."""
        self._blocks.release()

    def receive(self, what: str = "a batch", while_waiting: Optional[Callable[[], None]] = None):
        """The next message from the producer; :class:`ProducerError` if it failed, died, or was
        stopped (SIGSTOP) for STOPPED_SECONDS. A long wait is reported every WAIT_REPORT_SECONDS
        (a hung dataset is then seen, not silent)."""
        waited = stopped = 0.0
        while True:
            try:
                message = self._results.get(timeout=LIVENESS_SECONDS)
            except queue.Empty:
                waited += LIVENESS_SECONDS
                if not self._process.is_alive():
                    bus = " (SIGBUS: is /dev/shm full?)" if self._process.exitcode == -signal.SIGBUS else ""
                    raise ProducerError(f"data producer (pid {self.pid}) died (exit status "
                                        f"{self._process.exitcode}{bus}) while training waited for {what}") from None
                stopped = stopped + LIVENESS_SECONDS if _is_stopped(self.pid) else 0.0
                if stopped >= STOPPED_SECONDS:
                    raise ProducerError(f"data producer (pid {self.pid}) has been stopped (SIGSTOP) for "
                                        f"{stopped:.0f} s while training waited for {what}")
                if while_waiting:
                    while_waiting()
                if waited % WAIT_REPORT_SECONDS < LIVENESS_SECONDS:
                    print(f"returnn-tpu: waiting {waited:.0f} s for the data producer (pid {self.pid}): {what}",
                          file=sys.stderr, flush=True)
                continue
            if not self._names_dropped:  # the producer runs: it has opened the queue's semaphores
                drop_semaphore_names(self._results)
                self._names_dropped = True
            if message[0] == "error":
                raise_error(message, f"data producer (pid {self.pid})")
            return message

    def close(self):
        """Ends the producer process (also called at the trainer's exit) and removes its blocks.

        Its command pipe is closed first: the producer then returns, and its datasets end the
        processes they started in order (``DistributeFilesDataset``'s sub-epoch loader, the
        loaders of ``data_loaders``; one whose parent is killed prints a traceback of its own).
        What it made meanwhile is taken and freed, so that it does not wait to hand it over. One
        still running after :data:`CLOSE_SECONDS` is killed: it holds nothing to save."""
        self._commands.close()
        deadline = time.monotonic() + CLOSE_SECONDS
        while self._process.is_alive() and time.monotonic() < deadline:
            self._discard_results()
            self._process.join(timeout=0.05)
        if self._process.is_alive():
            self._process.kill()
        self._process.join()
        self._discard_results()
        self._blocks.close()
        for path in glob.glob(f"/dev/shm/{BLOCK_PREFIX}{self.pid}_*"):  # the producer's ring
            os.remove(path)

    def _discard_results(self):
        """Takes what the producer has put on its queue, freeing the blocks of its steps."""
        while True:
            try:
                message = self._results.get_nowait()
            except Exception:  # noqa: BLE001 (empty, or cut off by a kill)
                return
            if message[0] == "step":
                self.discard(message)


def drop_semaphore_names(results) -> None:
    """Unlinks the names of a spawn-context queue's POSIX semaphores (``/dev/shm/sem.mp-*``), once
    every process that uses it has opened them. They are named only so that a spawned child can
    open them; multiprocessing unlinks them at exit (a finalizer per lock, and its resource
    tracker), but not when a SIGKILL (``mpirun`` ending a job) takes the tracker too, and they
    stayed behind (FACTS.md, "Semaphores of multiprocessing"). Here those finalizers run now; open
    handles keep working, as an unlinked file's do."""
    from multiprocessing import synchronize, util

    locks = (results._rlock, results._wlock, results._sem)  # noqa: SLF001 (CPython's Queue)
    names = {lock._semlock.name for lock in locks if lock is not None and lock._semlock.name}
    for finalizer in list(util._finalizer_registry.values()):  # noqa: SLF001 (multiprocessing's own clean-up)
        if finalizer._callback is synchronize.SemLock._cleanup and finalizer._args[0] in names:
            finalizer()  # unlinks the name, tells the tracker, and is not run again


class ProducedEpoch:
    """An epoch's batches from the producer, with the interface of
    :class:`returnn_tpu.datapath.data.EpochBatches` that training uses (``start_seconds``, ``start_at``,
    ``steps``, ``positions``)."""

    def __init__(self, producer, batching, start_seconds: float):
        self.producer = producer
        self.batching = batching
        self.start_seconds = start_seconds  # the producer's init_seq_order
        self.first_step = 0
        self.batch_offset = 0
        self.points = None
        self.positions = StepPoints()  # as the producer sends them with each step

    @classmethod
    def started(cls, producer, epoch: int, batching, while_waiting=None) -> "ProducedEpoch":
        """Epoch ``epoch``, once ``producer`` (asked for it) says that it has started it."""
        what = f"the start of epoch {epoch}"
        (start_seconds,) = expect(producer.receive(what=what, while_waiting=while_waiting), "started", what)
        return cls(producer, batching, start_seconds)

    def start_at(self, step: int, batch_offset: int = 0, points=None):
        self.first_step, self.batch_offset, self.points = step, batch_offset, points

    def steps(self) -> Iterator[Tuple[List[dict], List[float]]]:
        """The steps, as the producer sends them, to the end of its data; stopped early, the
        producer is told to stop and what it made ahead is freed."""
        producer = self.producer
        producer.send("go", (self.first_step, self.batch_offset, self.points))
        finished = False
        try:
            for step in itertools.count(self.first_step):
                message = producer.receive(what=f"step {step + 1}")
                if message[0] == "end":
                    (counters,) = message[1:]
                    self.batching.add_counters(counters)
                    finished = True
                    return
                self.positions.record(step, message[4])
                yield producer.unpack(message), message[3]
        finally:
            if not finished and producer.alive():  # stopped early: drain and free the blocks
                try:
                    producer.send("stop", None)
                    while True:
                        message = producer.receive(what="the end of the epoch")
                        if message[0] != "step":
                            break
                        producer.discard(message)
                except ProducerError:
                    pass  # gone meanwhile: what stopped the epoch is the error to report


class RemoteProducer:
    """The producer of worker 0, as another worker sees it (``data_producer = "chief"``): the same
    interface as :class:`DataProducer`, over a TCP connection."""

    def __init__(self, address: Tuple[str, int], authkey: bytes, worker_index: int):
        from multiprocessing.connection import Client

        self.address = f"{address[0]}:{address[1]}"
        try:
            self._connection = Client(address, authkey=authkey)
        except (OSError, EOFError, multiprocessing.AuthenticationError) as exc:
            raise ProducerError(f"cannot connect to worker 0's data producer at {self.address}: {exc}") from None
        self._connection.send(("hello", worker_index))

    def epoch(self, *, epoch: int, batching, while_waiting: Optional[Callable[[], None]] = None,
              **_request) -> ProducedEpoch:
        """Epoch ``epoch``'s batches for this worker (worker 0 asks for all workers' batches)."""
        self.send("epoch", epoch)
        return ProducedEpoch.started(self, epoch, batching, while_waiting)

    def send(self, kind: str, payload):
        try:
            self._connection.send((kind, payload))
        except OSError as exc:
            raise ProducerError(f"worker 0's data producer ({self.address}) is gone: {exc}") from None

    def alive(self) -> bool:
        return not self._connection.closed

    @staticmethod
    def unpack(message) -> List[dict]:
        return message[2]

    @staticmethod
    def discard(message):
        pass  # arrives as arrays

    def receive(self, what: str = "a batch", while_waiting: Optional[Callable[[], None]] = None):
        """The next message from worker 0's producer; :class:`ProducerError` if it failed, closed
        the connection, or sent nothing (not even its heartbeat) for REMOTE_SILENCE_SECONDS."""
        silent = 0.0
        while True:
            try:
                if not self._connection.poll(LIVENESS_SECONDS):
                    if while_waiting:
                        while_waiting()
                    silent += LIVENESS_SECONDS
                    if silent >= REMOTE_SILENCE_SECONDS:
                        raise ProducerError(f"worker 0's data producer ({self.address}) sent nothing for "
                                            f"{silent:.0f} s while training waited for {what}")
                    continue
                message = self._connection.recv()
            except (EOFError, OSError):
                raise ProducerError(f"worker 0's data producer ({self.address}) closed the connection while "
                                    f"training waited for {what}") from None
            silent = 0.0
            if message[0] == "alive":
                continue
            if message[0] == "error":
                raise_error(message, "data producer of worker 0")
            return message

    def close(self):
        self._connection.close()
