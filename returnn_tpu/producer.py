"""The dataset producer: RETURNN dataset iteration, batching and padding in a process of its own.

With ``distribute_options["data_producer"] = "process"`` (the default), each worker starts one
producer process. It loads the same config (the same file and ``++`` overrides), creates the
same training datasets and runs the same :class:`returnn_tpu.data.EpochBatches` as training in
the process would, so its batches are those batches, bit for bit. Training then spends its
time in steps, not in Python reading and padding data, which shares a core with the step's
dispatch.

Per epoch the trainer sends what the batches depend on (the network's data keys, whether it is
recurrent, RETURNN's batching options, the replicas' slots); the producer starts the epoch
(RETURNN's ``init_seq_order``) and says so, then, after the trainer's ``go`` (the step to begin
at), makes the steps as they are taken and writes each step's arrays into a new POSIX shared
memory block, at most ``data_prefetch`` steps ahead, until the data ends (``end``) or the trainer
says ``stop`` (where all workers agreed the epoch ends: :class:`returnn_tpu.epochs.TrainEpoch`). Only the block's
name and the arrays' layout travel through the queue; the trainer copies the arrays out (one
``memcpy``) and frees the block.

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
"""

from __future__ import annotations

import atexit
import glob
import itertools
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy

BLOCK_PREFIX = "returnn_tpu_"  # shared memory blocks are named returnn_tpu_<producer pid>_<n>
LIVENESS_SECONDS = 1.0  # how often a waiting trainer checks that its producer still runs
WAIT_REPORT_SECONDS = 60.0  # a trainer waiting this long for its producer says so, and again each time
HEARTBEAT_SECONDS = 2.0  # how often worker 0's producer tells the other workers that it still runs
REMOTE_SILENCE_SECONDS = 30.0  # a worker that hears nothing of worker 0's producer this long stops
CONNECT_SECONDS = 120.0  # how long worker 0's producer waits for the other workers to connect
SHM_RESERVE_BYTES = 16 * 1024 * 1024  # room left in /dev/shm for others when a block is made
STOPPED_SECONDS = 30.0  # a producer stopped by a signal this long while training waits is an error
HANDSHAKE_SECONDS = 10.0  # how long a connecting client may take to prove the key and say hello


class ProducerError(RuntimeError):
    """The dataset producer failed or died."""


def expect(message: tuple, kind: str, what: str) -> tuple:
    """The fields of ``message`` (a ``(kind, *fields)`` tuple of the protocol), which must be of
    ``kind``; else a :class:`ProducerError` naming what came instead of ``what``."""
    if not message or message[0] != kind:
        raise ProducerError(f"the data producer's protocol is out of step: {message[:1]!r} came where {kind!r} "
                            f"({what}) was due")
    return tuple(message[1:])


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (Linux's process state ``T``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def raise_error(message: tuple, producer: str):
    """Raises the error of an ``("error", text, bad_input)`` message: bad input that the producer
    found as the :class:`ConfigError` it was (one line, exit status 2), a failure as
    :class:`ProducerError`."""
    from returnn_tpu.errors import ConfigError

    _, text, bad_input = message
    if bad_input:
        raise ConfigError(text)
    raise ProducerError(f"{producer} failed: {text}")


class DataProducer:
    """One producer process for the training dataset of ``config_filename`` (with
    ``overrides``); created once per worker, ended by :meth:`close` or with the trainer's process."""

    def __init__(self, config_filename: str, overrides: Sequence[str], *, dataset_key: str, num_replicas: int,
                 first_replica: int, distribution: str, prefetch: int, all_replicas: Optional[int] = None,
                 serve: Optional["ServeOptions"] = None):
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
        setup = dict(config_filename=config_filename, overrides=list(overrides), dataset_key=dataset_key,
                     num_replicas=num_replicas, first_replica=first_replica, distribution=distribution,
                     all_replicas=all_replicas, serve=serve)
        # Not daemonic: a dataset may start processes of its own (DistributeFilesDataset's sub-epoch
        # workers), which a daemonic process may not. close() ends it, also at exit: registered
        # after multiprocessing's own exit handler, it runs before it (which would join the producer).
        self._process = context.Process(target=_serve, args=(setup, commands_end, self._results),
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
        """Asks for an epoch's batches (the arguments of :class:`returnn_tpu.data.EpochBatches`,
        with ``templates`` from :func:`returnn_tpu.data.template_shapes` for its ``extern_data``);
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

    @staticmethod
    def unpack(message) -> List[dict]:
        """The batches of a ``step`` message (taken out of its shared memory block)."""
        return _take_block(*message[1:3])

    @staticmethod
    def discard(message):
        """Frees what a ``step`` message that training does not take holds."""
        _free_block(message[1])

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
        """Ends the producer process (also called at the trainer's exit) and frees the blocks
        it made that training did not take."""
        if self._process.is_alive():
            self._process.kill()  # it holds nothing to save
        self._process.join()
        while True:
            try:
                message = self._results.get_nowait()
            except Exception:  # noqa: BLE001 (empty, or cut off by the kill)
                break
            if message[0] == "step":
                self.discard(message)
        for path in glob.glob(f"/dev/shm/{BLOCK_PREFIX}{self.pid}_*"):  # made, not yet handed over
            os.remove(path)


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
    :class:`returnn_tpu.data.EpochBatches` that training uses (``start_seconds``, ``start_at``,
    ``steps``)."""

    def __init__(self, producer, batching, start_seconds: float):
        self.producer = producer
        self.batching = batching
        self.start_seconds = start_seconds  # the producer's init_seq_order
        self.first_step = 0
        self.batch_offset = 0

    @classmethod
    def started(cls, producer, epoch: int, batching, while_waiting=None) -> "ProducedEpoch":
        """Epoch ``epoch``, once ``producer`` (asked for it) says that it has started it."""
        what = f"the start of epoch {epoch}"
        (start_seconds,) = expect(producer.receive(what=what, while_waiting=while_waiting), "started", what)
        return cls(producer, batching, start_seconds)

    def start_at(self, step: int, batch_offset: int = 0):
        self.first_step, self.batch_offset = step, batch_offset

    def steps(self) -> Iterator[Tuple[List[dict], List[float]]]:
        """The steps, as the producer sends them, to the end of its data; stopped early, the
        producer is told to stop and what it made ahead is freed."""
        producer = self.producer
        producer.send("go", (self.first_step, self.batch_offset))
        finished = False
        try:
            for step in itertools.count(self.first_step):
                message = producer.receive(what=f"step {step + 1}")
                if message[0] == "end":
                    (counters,) = message[1:]
                    self.batching.add_counters(counters)
                    finished = True
                    return
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


class ServeOptions(NamedTuple):
    """Where worker 0's producer (``data_producer = "chief"``) serves the other workers."""

    host: str  # worker 0's host in the cluster spec
    authkey: bytes  # what each connection must prove (random, told to the workers by the collective)
    num_workers: int
    replicas_per_worker: int


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


def _receive_timeout(sock: socket.socket, seconds: float):
    """The kernel's bound on each blocking read of ``sock`` (0: none), which ``Connection`` reads obey."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), 0))


class _Workers:
    """Worker 0's producer's connections to the other workers, in worker order, and a heartbeat
    thread that keeps them from taking silence for death."""

    def __init__(self, listener: socket.socket, serve: ServeOptions):
        connected = {}

        def handshake(sock: socket.socket, address):
            """One client's key check and hello, on a thread of its own: a client that connects
            and then says nothing holds up only this thread, not the other workers' handshakes
            (FACTS.md, "Serving other workers")."""
            from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

            _receive_timeout(sock, HANDSHAKE_SECONDS)  # a silent client's reads end (the fd stays blocking)
            connection = Connection(sock.detach())
            try:
                deliver_challenge(connection, serve.authkey)
                answer_challenge(connection, serve.authkey)
                kind, worker = connection.recv()
                if kind != "hello" or worker not in range(1, serve.num_workers):
                    raise ValueError(f"not a worker's hello: {kind!r} {worker!r}")
            except (multiprocessing.AuthenticationError, OSError, EOFError, ValueError, TypeError) as exc:
                print(f"returnn-tpu: data producer: refused a connection from {address}: {exc}", file=sys.stderr,
                      flush=True)
                connection.close()
                return
            with socket.socket(fileno=os.dup(connection.fileno())) as same:
                _receive_timeout(same, 0)  # from here on, heartbeats and bounds of their own
            connected[worker] = connection

        def accept():
            while len(connected) < serve.num_workers - 1:
                try:
                    sock, address = listener.accept()
                except OSError:
                    return  # closed
                threading.Thread(target=handshake, args=(sock, address), name="returnn_tpu producer handshake",
                                 daemon=True).start()

        threading.Thread(target=accept, name="returnn_tpu producer accept", daemon=True).start()
        deadline = time.monotonic() + CONNECT_SECONDS
        while len(connected) < serve.num_workers - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        missing = [f"worker {w}" for w in range(1, serve.num_workers) if w not in connected]
        if missing:
            raise ProducerError(f"{', '.join(missing)} did not connect to the data producer at "
                                f"{serve.host}:{listener.getsockname()[1]} within {CONNECT_SECONDS:.0f} s")
        self.connections = [connected[w] for w in range(1, serve.num_workers)]
        self.replicas_per_worker = serve.replicas_per_worker
        self._lock = threading.Lock()
        threading.Thread(target=self._heartbeat, name="returnn_tpu producer heartbeat", daemon=True).start()

    def _heartbeat(self):
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            try:
                self.send_all(("alive",))
            except ProducerError:
                return  # a worker is gone: the next step's send reports it

    def send(self, worker: int, message):
        """Sends ``message`` to worker ``worker`` (>= 1); ProducerError naming it if it is gone."""
        try:
            with self._lock:
                self.connections[worker - 1].send(message)
        except OSError as exc:
            raise ProducerError(f"worker {worker} closed its connection to the data producer: {exc}") from None

    def send_all(self, message):
        for worker in range(1, len(self.connections) + 1):
            self.send(worker, message)

    def receive(self, worker: int, expected: str):
        """The payload of worker ``worker``'s next command, which must be ``expected``. A worker's
        ``stop`` is passed over: workers stop at the same step, and worker 0's ends the epoch."""
        connection, kind = self.connections[worker - 1], "stop"
        while kind == "stop":
            try:
                if not connection.poll(CONNECT_SECONDS):
                    raise ProducerError(f"worker {worker} sent the data producer no {expected!r} within "
                                        f"{CONNECT_SECONDS:.0f} s")
                kind, payload = connection.recv()
            except (EOFError, OSError):
                raise ProducerError(f"worker {worker} closed its connection to the data producer") from None
        if kind != expected:
            raise ProducerError(f"worker {worker} sent {kind!r} to the data producer, expected {expected!r}")
        return payload

    def own_part(self, step_batches: list, weights: list, worker: int) -> Tuple[list, list]:
        """Worker ``worker``'s replicas' part of a step's batches of all replicas (0: this one's)."""
        part = slice(worker * self.replicas_per_worker, (worker + 1) * self.replicas_per_worker)
        return step_batches[part], weights[part]


def _take_block(name: str, layout) -> List[dict]:
    """The batches of one step, copied out of shared memory block ``name``, which is freed."""
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(name=name)
    try:
        batches = []
        for arrays in layout:
            batch = {}
            for key, (dtype, shape, offset, value) in arrays.items():
                if value is not None:  # not an array: sent as is
                    batch[key] = value
                else:
                    view = numpy.ndarray(shape, dtype=numpy.dtype(dtype), buffer=block.buf, offset=offset)
                    batch[key] = view.copy()
                    del view
            batches.append(batch)
        return batches
    finally:
        block.close()
        block.unlink()


def _free_block(name: str):
    from multiprocessing import shared_memory

    try:
        block = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    block.close()
    block.unlink()


_blocks_made = itertools.count()


def remove_stale_blocks(log_file=None):
    """Removes the shared memory blocks of producers whose process is gone (a trainer killed by
    SIGKILL or the OOM killer cannot free what its producer made ahead), as stale checkpoint
    temporaries are removed. The line goes to ``log_file``, by default the ``sys.stderr`` of the
    moment (not of import time: a test harness or a redirected log may have replaced it)."""
    removed = 0
    for path in glob.glob(f"/dev/shm/{BLOCK_PREFIX}*_*"):
        pid = os.path.basename(path)[len(BLOCK_PREFIX):].split("_")[0]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        try:
            os.remove(path)
            removed += 1
        except OSError:
            pass  # another user's, or removed meanwhile
    if removed:
        print(f"returnn-tpu: removed {removed} shared memory blocks of data producers that are gone",
              file=log_file or sys.stderr)


def _put_block(batches: List[dict]):
    """``(name, layout)`` of a new shared memory block holding the arrays of ``batches``."""
    from multiprocessing import resource_tracker, shared_memory

    layout, arrays, size = [], [], 0
    for batch in batches:
        entry = {}
        for key, value in batch.items():
            if isinstance(value, numpy.ndarray) and value.dtype != object:
                value = numpy.ascontiguousarray(value)
                entry[key] = (value.dtype.str, value.shape, size, None)
                arrays.append((size, value))
                size += -(-value.nbytes // 64) * 64  # aligned
            else:
                entry[key] = (None, None, None, value)
        layout.append(entry)
    # tmpfs gives a block its pages only when they are written, and a full one answers with SIGBUS:
    # check the room first.
    free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
    try:
        if free is not None and free < size + SHM_RESERVE_BYTES:
            raise OSError(28, "not enough room left")
        block = shared_memory.SharedMemory(name=f"{BLOCK_PREFIX}{os.getpid()}_{next(_blocks_made)}", create=True,
                                           size=max(size, 1))
    except OSError as exc:
        raise ProducerError(f"cannot make a shared memory block of {size / 1e6:.1f} MB for a step's batches in "
                            f"/dev/shm ({(free or 0) / 1e6:.1f} MB free there): {exc.strerror or exc}; make /dev/shm "
                            "larger (docker: --shm-size), or set distribute_options['data_producer'] = 'thread'") from None
    # The trainer frees the block; this process's resource tracker must not free it again.
    resource_tracker.unregister(block._name, "shared_memory")  # noqa: SLF001 (CPython's own name for it)
    for offset, value in arrays:
        numpy.ndarray(value.shape, dtype=value.dtype, buffer=block.buf, offset=offset)[...] = value
    name = block.name
    block.close()
    return name, layout


def _serve(setup: dict, commands, results):
    """The producer process: answers the trainer's commands until ``exit`` (or its death)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before TensorFlow looks: the producer computes nothing on a GPU
    from returnn_tpu.launcher import STOP_SIGNALS, die_with_parent

    die_with_parent()
    for signum in STOP_SIGNALS:  # the trainer decides when to stop
        signal.signal(signum, signal.SIG_IGN)
    workers = None
    try:
        serve: Optional[ServeOptions] = setup["serve"]
        if serve:
            listener = socket.create_server((serve.host, 0))
            results.put(("listening", listener.getsockname()[1]))
        epochs = _EpochMaker(setup)
        if serve:
            workers = _Workers(listener, serve)
        while True:
            kind, payload = commands.recv()  # closed by the trainer: EOFError
            if kind == "epoch":
                _produce_epoch(epochs, payload, commands, results, workers)
    except (EOFError, KeyboardInterrupt):
        return  # the trainer is gone
    except BaseException as exc:  # noqa: BLE001 (every failure goes to the trainer, which stops)
        from returnn_tpu.errors import ConfigError

        if isinstance(exc, ConfigError):  # bad input: the trainer reports it as its own
            error = ("error", str(exc), True)
        else:
            lines = traceback.format_exception_only(type(exc), exc)
            error = ("error", lines[-1].strip() if lines else type(exc).__name__, False)
        results.put(error)
        if workers:
            try:
                workers.send_all(error)
            except ProducerError:
                pass  # that worker is gone already


class _EpochMaker:
    """The producer's training datasets (one per replica it feeds with ``random_seed_offset``) and
    their :class:`returnn_tpu.data.EpochBatches`.

    No TensorFlow here (FACTS.md, "A producer without TensorFlow"): the trainer sends with each
    request the shapes of the network's ``extern_data`` (:func:`returnn_tpu.data.template_shapes`).
    """

    def __init__(self, setup: dict):
        from returnn_tpu.data import init_datasets
        from returnn_tpu.startup import load_config

        config = load_config(setup["config_filename"], setup["overrides"])
        self.datasets = init_datasets(config, setup["dataset_key"], setup["num_replicas"], setup["first_replica"],
                                      setup["distribution"], all_replicas=setup["all_replicas"])

    def start(self, request: dict):
        """The EpochBatches of ``request`` (its epoch started: RETURNN's ``init_seq_order``)."""
        from returnn_tpu.data import EpochBatches, templates_from_shapes

        request = dict(request)
        extern_data = templates_from_shapes(request.pop("templates"))
        return EpochBatches(self.datasets, extern_data=extern_data, prefetch=1, **request)


def _produce_epoch(epochs: _EpochMaker, request: dict, commands, results, workers: Optional[_Workers]):
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
    ((first_step, batch_offset),) = expect(commands.recv(), "go", "the step to begin at")
    for worker in others:
        if workers.receive(worker, "go") != (first_step, batch_offset):
            raise ProducerError(f"worker {worker} and worker 0 asked for different steps of epoch {request['epoch']}")
    batches.start_at(first_step, batch_offset)
    for step_batches, weights in batches:
        if commands.poll() and commands.recv()[0] == "stop":
            break
        if workers:
            own_batches, own_weights = workers.own_part(step_batches, weights, 0)
            results.put(("step", *_put_block(own_batches), own_weights))
            for worker in others:
                workers.send(worker, ("step", None, *workers.own_part(step_batches, weights, worker)))
        else:
            results.put(("step", *_put_block(step_batches), weights))
    results.put(("end", batches.batching.take_counters()))
    for worker in others:
        workers.send(worker, ("end", {}))
