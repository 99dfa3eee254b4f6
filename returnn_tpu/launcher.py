"""``returnn-tpu --local-workers N CONFIG ...``: N worker processes on 127.0.0.1, for development.

Each worker gets a ``TF_CONFIG`` for a cluster of N workers on free local ports. Their output
is streamed with a ``[worker i]`` prefix. When one worker fails, the others are stopped; the
exit status is the first non-zero status of a worker (0 if all succeed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import List


def free_local_ports(count: int) -> List[int]:
    """``count`` distinct ports that are free on 127.0.0.1 right now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _stream(prefix: str, pipe, out):
    for line in iter(pipe.readline, ""):
        out.write(prefix + line)
        out.flush()


def run_local_workers(num_workers: int, args: List[str]) -> int:
    """Runs ``returnn-tpu ARGS`` as ``num_workers`` workers of one cluster; returns the exit status."""
    ports = free_local_ports(num_workers)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    workers = []
    for index in range(num_workers):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        proc = subprocess.Popen(
            [sys.executable, "-m", "returnn_tpu.cli", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        thread = threading.Thread(target=_stream, args=(f"[worker {index}] ", proc.stdout, sys.stdout), daemon=True)
        thread.start()
        workers.append((proc, thread))
    status = 0
    try:
        while any(proc.poll() is None for proc, _ in workers):
            failed = [proc.returncode for proc, _ in workers if proc.returncode not in (None, 0)]
            if failed:
                status = failed[0]
                for proc, _ in workers:
                    if proc.poll() is None:
                        proc.terminate()
                break
            time.sleep(0.2)
    finally:
        for proc, thread in workers:
            proc.wait()
            thread.join()
    return status or next((proc.returncode for proc, _ in workers if proc.returncode), 0)
