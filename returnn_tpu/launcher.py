"""``returnn-tpu --local-workers N CONFIG ...``: N worker processes on 127.0.0.1, for development.

Each worker gets a ``TF_CONFIG`` for a cluster of N workers on free local ports. Their output
is streamed with a ``[worker i]`` prefix. The launcher and its workers end together:

* when one worker fails (or is killed), the others are waited for: they find it lost at their next
  collective, save the model of the last sync and exit (status 75); when one stopped at a signal
  (status 128 + N), the others are stopping at the same step boundary and are waited for;
* SIGTERM, SIGINT or SIGHUP to the launcher is passed on to every worker;
* a worker still there :data:`GRACE_SECONDS` after its SIGTERM, or :data:`LOST_WORKER_SECONDS`
  after another failed (hung, or stopped with SIGSTOP), is killed;
* the workers get SIGKILL from the kernel if the launcher itself dies (``PR_SET_PDEATHSIG``).

TensorFlow's gRPC server listens on all interfaces and has no option to bind one address, and
it has no authentication. So the launcher first moves itself, and with it its workers, into a
network namespace of its own that has only a loopback interface (Linux; as root directly,
otherwise inside a user namespace): no other machine reaches the workers' ports, nor does
anything in the machine's own namespace. Where the kernel does not allow it, or with
``RETURNN_TPU_SHARE_NETWORK=1`` (a dataset that reads over the network), a warning says so.

With ``max_restarts`` K, a job that failed (a worker lost, killed or crashed; not bad input,
exit status 2, and not a stop by a signal) is started again, all workers on new ports, up to K
times; each start resumes from the newest checkpoint (the interrupted one the survivors wrote:
at most one sync period of work is lost), as torchrun's ``--max-restarts`` does. Restarts back
off (:func:`restart_delay`): a failure that comes back at once (a sequence that always fails to
load, a file system that is away) does not use up K in seconds.

Exit status: the first non-zero status of a worker (a worker ended by a signal counts as 1), 0 if
all succeed, 128 + the signal number when the launcher was stopped by a signal.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import List, Optional

from returnn_tpu.errors import RESUMABLE_STATUS

GRACE_SECONDS = 20.0  # from SIGTERM to SIGKILL
# From a worker's failure to SIGKILL of the others: they find it lost within the peer health
# check's bound (20 s, returnn_tpu.strategies.multi_worker) at their next collective (within
# 10 steps), then save the model of the last sync.
LOST_WORKER_SECONDS = 60.0
# The signals that stop training at a step boundary with the combined model saved (SIGHUP: a
# closed terminal or ssh session, and some batch systems' warning before a kill).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Set for the workers this launcher starts (it stops those that have not reached TensorFlow's start-up).
LAUNCHED_WORKER_ENV = "RETURNN_TPU_LAUNCHED_WORKER"
_PR_SET_PDEATHSIG = 1
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def isolate_network() -> Optional[str]:
    """Moves this process into a new network namespace with only the loopback interface, up
    (its children inherit it). Returns None, or why no namespace could be made (then nothing
    changed); raises RuntimeError if one was made but could not be set up. Must run before the
    process starts threads (the kernel refuses a new user namespace then)."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    try:
        failed = libc.unshare(_CLONE_NEWNET if uid == 0 else _CLONE_NEWUSER | _CLONE_NEWNET)
    except AttributeError:
        return "no unshare() on this system"
    if failed:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    try:
        if uid != 0:  # stay the same user inside the new user namespace
            for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            request = struct.pack("16sH", b"lo", 0)
            flags = struct.unpack("16sH", fcntl.ioctl(sock, _SIOCGIFFLAGS, request)[:18])[1]
            fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))
    except OSError as exc:
        raise RuntimeError(f"could not set up the workers' network namespace ({exc}); "
                           "set RETURNN_TPU_SHARE_NETWORK=1 to run them in this machine's network") from None
    return None

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


def die_with_parent():
    """In a child process (before exec, or at its start): SIGKILL when its parent dies (Linux;
    elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _stop(workers: List[subprocess.Popen], signum: Optional[int] = signal.SIGTERM, grace: float = GRACE_SECONDS):
    """Sends ``signum`` (None: nothing, they are stopping) to the running workers, then SIGKILL to
    any still running after ``grace`` seconds."""
    for proc in workers:
        if proc.poll() is None and signum is not None:
            proc.send_signal(signum)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(proc.poll() is None for proc in workers):
        time.sleep(0.1)
    for index, proc in enumerate(workers):
        if proc.poll() is None:
            print(f"returnn-tpu: worker {index} still running {grace:.0f} s after the job stopped; killed",
                  file=sys.stderr, flush=True)
            proc.kill()


def run_local_workers(num_workers: int, args: List[str], max_restarts: int = 0) -> int:
    """Runs ``returnn-tpu ARGS`` as ``num_workers`` workers of one cluster, restarted up to
    ``max_restarts`` times after a failure; returns the exit status."""
    try:
        why_not = "RETURNN_TPU_SHARE_NETWORK=1" if os.environ.get("RETURNN_TPU_SHARE_NETWORK") == "1" else isolate_network()
    except RuntimeError as exc:
        print(f"returnn-tpu: error: {exc}", file=sys.stderr)
        return 1
    if why_not:
        print(f"returnn-tpu: warning: the workers share this machine's network ({why_not}): their gRPC servers "
              "listen on all its interfaces", file=sys.stderr, flush=True)
    for attempt in range(max_restarts + 1):
        status = _run_once(num_workers, args)
        if status in (0, 2) or status > 128 or attempt == max_restarts:
            return status
        delay = restart_delay(attempt)
        print(f"returnn-tpu: the job failed (status {status}); restarting all {num_workers} workers from the newest "
              f"checkpoint in {delay:.0f} s ({attempt + 1} of {max_restarts} restarts)", file=sys.stderr, flush=True)
        time.sleep(delay)
    return status


def restart_delay(restarts_before: int) -> float:
    """Seconds to wait before a job's restart after ``restarts_before`` earlier ones: 10 s,
    doubling, at most 5 minutes."""
    return min(10.0 * 2 ** restarts_before, 300.0)


def _run_once(num_workers: int, args: List[str]) -> int:
    """One start of all workers; returns the job's exit status."""
    ports = free_local_ports(num_workers)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    received: List[int] = []  # signals sent to the launcher
    previous = {signum: signal.signal(signum, lambda signum, _: received.append(signum))
                for signum in STOP_SIGNALS}
    workers, threads = [], []
    try:
        for index in range(num_workers):
            task = {"type": "worker", "index": index}
            env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": task}), **{LAUNCHED_WORKER_ENV: "1"})
            proc = subprocess.Popen(
                [sys.executable, "-m", "returnn_tpu.cli", *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=die_with_parent,
            )
            thread = threading.Thread(target=_stream, args=(f"[worker {index}] ", proc.stdout, sys.stdout), daemon=True)
            thread.start()
            workers.append(proc)
            threads.append(thread)
        status: Optional[int] = None
        while any(proc.poll() is None for proc in workers):
            if received:
                _stop(workers, received[0])
                status = 128 + received[0]
                break
            failed = [proc.returncode for proc in workers if proc.returncode not in (None, 0)]
            if failed:
                status = failed[0] if failed[0] > 0 else 1
                if status == 2:  # bad input: the others stop now (saving what they trained), not when they find it lost
                    _stop(workers, signal.SIGTERM, GRACE_SECONDS)
                    break
                # Stopping at a signal, or a survivor that saved: the others are doing the same.
                others_stopping = status > 128 or status == RESUMABLE_STATUS
                _stop(workers, None, GRACE_SECONDS if others_stopping else LOST_WORKER_SECONDS)
                break
            time.sleep(0.2)
    finally:
        if any(proc.poll() is None for proc in workers):  # an exception in the launcher itself
            _stop(workers)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for proc, thread in zip(workers, threads):
            proc.wait()
            thread.join()
    if status is not None:
        return status
    first = next((proc.returncode for proc in workers if proc.returncode), 0)
    return 1 if first < 0 else first
