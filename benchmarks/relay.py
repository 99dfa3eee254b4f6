"""A throttled link between local workers: a user-space TCP relay with a bandwidth limit and a
latency per direction, for measuring on one machine what a slow cluster network does.

This machine cannot shape traffic in the kernel (``tc qdisc ... netem`` is refused), so every
connection from one worker to another goes through a :class:`Relay`: the cluster spec each
worker gets (:func:`relayed_tf_configs`) names, for every peer, the port of a relay that
forwards to that peer's gRPC server. All connections from worker a to worker b share one
:class:`Link` per direction, as they would share a network card: a chunk leaves ``latency``
seconds after it arrived, and no sooner than the link has sent what came before it at
``bits_per_second``.

``python benchmarks/relay.py`` checks that a relay delivers the rate it is set to (prints the
measured rate of a bulk transfer through it at 1 Gbit/s and 100 Mbit/s and the round trip of a
small message at 1 ms latency).
"""

from __future__ import annotations

import argparse
import collections
import json
import queue
import socket
import threading
import time
from typing import Dict, List, Tuple

CHUNK = 64 * 1024


class Link:
    """One direction of a link between two machines: its rate and latency, and when it is next free."""

    def __init__(self, bits_per_second: float, latency: float):
        self.bytes_per_second = bits_per_second / 8
        self.latency = latency
        self.next_free = 0.0
        self.lock = threading.Lock()
        self.sent = 0

    def departure(self, arrived: float, size: int) -> float:
        """When a chunk of ``size`` bytes that arrived at ``arrived`` has been sent over the link."""
        with self.lock:
            start = max(arrived, self.next_free)
            self.next_free = start + size / self.bytes_per_second
            self.sent += size
            return self.next_free + self.latency


def _pump(source: socket.socket, target: socket.socket, link: Link):
    """Forwards ``source`` to ``target`` as ``link`` allows; a reader thread and a sender thread,
    so that the bytes in flight on the link (rate times latency) keep arriving meanwhile."""
    chunks: "queue.Queue" = queue.Queue()

    def send():
        while True:
            due, data = chunks.get()
            if data is None:
                break
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                target.sendall(data)
            except OSError:
                break
        try:
            target.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    while True:
        try:
            data = source.recv(CHUNK)
        except OSError:
            data = b""
        if not data:
            chunks.put((0.0, None))
            break
        chunks.put((link.departure(time.monotonic(), len(data)), data))


class Relay:
    """Listens on 127.0.0.1 (a free port, :attr:`port`) and forwards each connection to
    ``target_port``: client to server over ``forward``, server to client over ``backward``."""

    def __init__(self, target_port: int, forward: Link, backward: Link):
        self.target_port = target_port
        self.forward, self.backward = forward, backward
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the peer's server is not up yet: the client retries, as over a network
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_pump, args=(client, server, self.forward), daemon=True).start()
            threading.Thread(target=_pump, args=(server, client, self.backward), daemon=True).start()

    def close(self):
        self.server.close()


def free_ports(count: int) -> List[int]:
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def relayed_tf_configs(num_workers: int, bits_per_second: float, latency: float
                       ) -> Tuple[List[str], List[Relay], Dict[Tuple[int, int], Link]]:
    """A ``TF_CONFIG`` per worker in which every peer's address is a relay to it, the relays,
    and the links by (from worker, to worker)."""
    ports = free_ports(num_workers)
    links = {(a, b): Link(bits_per_second, latency) for a in range(num_workers) for b in range(num_workers) if a != b}
    relays, configs = [], []
    for me in range(num_workers):
        addresses = []
        for peer in range(num_workers):
            if peer == me:
                addresses.append(f"localhost:{ports[me]}")
                continue
            relay = Relay(ports[peer], forward=links[(me, peer)], backward=links[(peer, me)])
            relays.append(relay)
            addresses.append(f"localhost:{relay.port}")
        configs.append(json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": me}}))
    return configs, relays, links


def _bulk_rate(bits_per_second: float, size: int) -> float:
    """Sends ``size`` bytes through a relay at ``bits_per_second`` (1 ms latency); the bits per
    second that arrived."""
    sink = socket.create_server(("127.0.0.1", 0))
    received = collections.Counter()

    def drain():
        conn, _ = sink.accept()
        while True:
            data = conn.recv(1 << 20)
            if not data:
                break
            received["bytes"] += len(data)
        received["end"] = time.monotonic()

    reader = threading.Thread(target=drain)
    reader.start()
    relay = Relay(sink.getsockname()[1], Link(bits_per_second, 0.001), Link(bits_per_second, 0.001))
    sender = socket.create_connection(("127.0.0.1", relay.port))
    payload = b"\0" * (1 << 20)
    start = time.monotonic()
    for _ in range(size // len(payload)):
        sender.sendall(payload)
    sender.close()
    reader.join()
    relay.close()
    sink.close()
    return received["bytes"] * 8 / (received["end"] - start)


def _round_trip(latency: float) -> float:
    """Seconds for a 1-byte message to go to an echo server through a relay and back."""
    echo = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = echo.accept()
        while True:
            data = conn.recv(16)
            if not data:
                break
            conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    relay = Relay(echo.getsockname()[1], Link(1e9, latency), Link(1e9, latency))
    client = socket.create_connection(("127.0.0.1", relay.port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(20):
        start = time.monotonic()
        client.sendall(b"x")
        client.recv(16)
        times.append(time.monotonic() - start)
    client.close()
    relay.close()
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small transfers only (the test suite's run)")
    args = parser.parse_args()
    size = (8 if args.smoke else 200) << 20
    for rate in (1e9, 1e8):
        measured = _bulk_rate(rate, size if rate == 1e9 else size // 10)
        print(f"relay set to {rate / 1e6:g} Mbit/s: {size if rate == 1e9 else size // 10} bytes arrived at "
              f"{measured / 1e6:.1f} Mbit/s ({measured / rate:.2f} of the set rate)")
    print(f"relay set to 1 ms per direction: round trip {_round_trip(0.001) * 1e3:.2f} ms (median of 20)")


if __name__ == "__main__":
    main()
