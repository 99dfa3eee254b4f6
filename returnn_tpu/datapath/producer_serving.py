"""Worker 0's data producer serving the other workers over TCP (``data_producer = "chief"``).

Worker 0's producer makes the batches of all replicas of all workers and sends each other worker
its part (the client is :class:`returnn_tpu.datapath.producer.RemoteProducer`). It listens on worker 0's
address of the cluster spec on a port it picks (:class:`ServeOptions`); every connection must
prove the random key (``multiprocessing.connection``'s HMAC challenge) before anything is
unpickled, and a heartbeat keeps the other workers from taking silence for death
(:class:`WorkerConnections`). No TensorFlow (the producer process runs without it).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import struct
import sys
import threading
import time
from typing import NamedTuple

from returnn_tpu.datapath.producer_protocol import ProducerError

HEARTBEAT_SECONDS = 2.0  # how often worker 0's producer tells the other workers that it still runs
CONNECT_SECONDS = 120.0  # how long worker 0's producer waits for the other workers to connect
HANDSHAKE_SECONDS = 10.0  # how long a connecting client may take to prove the key and say hello


class ServeOptions(NamedTuple):
    """Where worker 0's producer (``data_producer = "chief"``) serves the other workers."""

    host: str  # worker 0's host in the cluster spec
    authkey: bytes  # what each connection must prove (random, told to the workers by the collective)
    num_workers: int
    replicas_per_worker: int


def _receive_timeout(sock: socket.socket, seconds: float):
    """The kernel's bound on each blocking read of ``sock`` (0: none), which ``Connection`` reads obey."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), 0))


class WorkerConnections:
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

    def own_part(self, items: list, worker: int) -> list:
        """Worker ``worker``'s replicas' part of a list with an item per replica of all workers (a
        step's batches, weights, stream points; 0: this one's)."""
        return items[worker * self.replicas_per_worker: (worker + 1) * self.replicas_per_worker]
