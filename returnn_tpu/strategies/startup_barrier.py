"""Waiting for the other workers in Python, before TensorFlow's multi-worker start-up.

TensorFlow's start-up blocks in C++ holding the GIL until every worker has joined, so a worker
whose peer never comes cannot raise anything there (FACTS.md, "A refusal under TF_CONFIG"): only
the start-up watchdog's signal ends it. :func:`wait_for_workers` is a barrier run first, on each
worker's own cluster port, that ends in :class:`ClusterDidNotComeUp`, an exception a TF2 program
can catch (and retry), naming the workers that are missing.

Why it cannot deadlock: each worker listens on its own port, then connects to every peer's port
and says its name. It leaves once it has reached every peer *and* every peer has reached it; a
peer that has reached it needs its port no more, so it closes the port then, and TensorFlow's
server binds it. A peer whose port answers with something else (TensorFlow's gRPC server: it left
this barrier already, e.g. a worker restarted while the others wait inside TensorFlow) counts as
there. After the barrier the watchdog still bounds TensorFlow's own start-up, for a peer that
dies in between.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Dict, List

HELLO = b"returnn-tpu barrier "  # followed by the sender's name and a newline
ANSWER = b"returnn-tpu barrier ok\n"
CONNECT_TIMEOUT_SECONDS = 1.0
RETRY_SECONDS = 0.2


class ClusterDidNotComeUp(TimeoutError):
    """The workers of a multi-worker cluster did not all come up within the start-up timeout.

    :ivar missing: the workers (``"worker 1 (host:port)"``) this worker did not meet.
    """

    def __init__(self, own: str, timeout: float, option: str, missing: List[str]):
        self.missing = missing
        super().__init__(f"{own}: the cluster did not come up within {timeout:g} s ({option}); "
                         f"no answer from {', '.join(missing) or 'a worker that has not joined'}")


def task_addresses(cluster_resolver) -> Dict[str, str]:
    """Every task of the resolver's cluster: ``"worker 1"`` -> ``"host:port"``."""
    spec = cluster_resolver.cluster_spec()
    return {f"{job} {task_id}": address for job in spec.jobs for task_id, address in enumerate(spec.job_tasks(job))}


def own_task(cluster_resolver) -> str:
    return f"{cluster_resolver.task_type} {cluster_resolver.task_id}"


def _host_port(address: str):
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _listen(address: str) -> socket.socket:
    """A listener on this worker's own cluster port: on the loopback address if the cluster is
    on this machine's loopback, else on all interfaces (IPv4 and IPv6), as TensorFlow's server
    will listen (a host name may resolve to another address here than on the peers: Debian's
    127.0.1.1, NAT)."""
    host, port = _host_port(address)
    try:
        family, _, _, _, (ip, *_) = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        loopback = ipaddress.ip_address(ip).is_loopback and host != socket.gethostname()
    except (OSError, ValueError):
        loopback = False
    if loopback:
        listener = socket.create_server((ip, port), family=family, backlog=64)
    elif socket.has_dualstack_ipv6():
        listener = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64)
    else:
        listener = socket.create_server(("", port), backlog=64)
    listener.settimeout(RETRY_SECONDS)
    return listener


def _serve(listener: socket.socket, met_us: set, done: threading.Event):
    """Answers every peer that says its name, until ``done``; the peer closes first (no TIME_WAIT
    here on the port TensorFlow binds next)."""
    while not done.is_set():
        try:
            connection, _ = listener.accept()
        except (socket.timeout, OSError):
            continue
        with connection, connection.makefile("rb") as reader:
            connection.settimeout(5.0)
            try:
                line = reader.readline(200)
                if line.startswith(HELLO):
                    connection.sendall(ANSWER)
                    met_us.add(line[len(HELLO):].strip().decode())
                    connection.recv(1)  # until the peer closes
            except OSError:
                pass  # a port probe (the watchdog, a refusing worker) or a peer that went away


def _reach(address: str, own: str) -> str:
    """``"ours"`` if the barrier at ``address`` answered, ``"past"`` if another server did
    (TensorFlow's: the peer left the barrier), ``""`` if nothing answers yet."""
    try:
        with socket.create_connection(_host_port(address), timeout=CONNECT_TIMEOUT_SECONDS) as connection:
            connection.sendall(HELLO + own.encode() + b"\n")
            answer = connection.recv(len(ANSWER))
    except OSError:
        return ""
    if answer == ANSWER:
        return "ours"
    return "past" if answer else ""


def wait_for_workers(cluster_resolver, timeout: float, option: str) -> float:
    """Returns once every worker of the cluster is up (see module doc); the seconds it took.

    :raises ClusterDidNotComeUp: after ``timeout`` seconds, naming the workers not met; ``option``
        is where the user set the timeout.
    """
    start = time.monotonic()
    tasks = task_addresses(cluster_resolver)
    own = own_task(cluster_resolver)
    peers = {name: address for name, address in tasks.items() if name != own}
    reached, met_us, done = set(), set(), threading.Event()
    listener = _listen(tasks[own])
    server = threading.Thread(target=_serve, args=(listener, met_us, done), name="startup-barrier", daemon=True)
    server.start()
    try:
        while True:
            for name, address in peers.items():
                if name not in reached:
                    answer = _reach(address, own)
                    if answer:
                        reached.add(name)
                    if answer == "past":
                        met_us.add(name)
            missing = [name for name in peers if name not in reached or name not in met_us]
            if not missing:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise ClusterDidNotComeUp(own, timeout, option, [
                    f"{name} ({peers[name]})" if name not in reached
                    else f"{name} ({peers[name]}), which answers but has not reached this worker at {tasks[own]}"
                    for name in missing])
            time.sleep(RETRY_SECONDS)
    finally:
        done.set()
        server.join()
        listener.close()
