"""Sun Grid Engine job environment, and the port convention for workers of SGE/MPI jobs.

SGE sets ``JOB_ID``, ``SGE_TASK_ID`` (``"undefined"`` outside array jobs), ``NSLOTS`` and, for
parallel environments (``qsub -pe mpi N``), ``PE_HOSTFILE``. The hostfile is only visible on the
master node, so ranks learn their peers over MPI (:mod:`returnn_tpu.cluster.mpi`); here it is
read for logging.

Several jobs share a node on SGE, so a fixed port collides. :func:`conventional_port` derives a
port from the job id, the array task id and the local rank; :func:`choose_port` starts there and
moves on while the port is taken.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import List, Mapping, Optional, Tuple

PORT_RANGE = (20000, 60000)


@dataclasses.dataclass(frozen=True)
class SGEJob:
    """What SGE tells a job about itself."""

    job_id: int
    task_id: Optional[int]
    num_slots: Optional[int]
    hosts: Tuple[Tuple[str, int], ...]  # (host, slots) from PE_HOSTFILE

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Optional["SGEJob"]:
        """The job described by ``environ``, or None when not running under SGE."""
        if "JOB_ID" not in environ:
            return None
        task = environ.get("SGE_TASK_ID", "undefined")
        hosts: List[Tuple[str, int]] = []
        hostfile = environ.get("PE_HOSTFILE")
        if hostfile:
            with open(hostfile) as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 2:
                        hosts.append((fields[0], int(fields[1])))
        return cls(
            job_id=int(environ["JOB_ID"]),
            task_id=int(task) if task.isdigit() else None,
            num_slots=int(environ["NSLOTS"]) if environ.get("NSLOTS", "").isdigit() else None,
            hosts=tuple(hosts),
        )

    def describe(self) -> str:
        task = f", array task {self.task_id}" if self.task_id is not None else ""
        hosts = ", ".join(f"{host}:{slots}" for host, slots in self.hosts) or "no PE_HOSTFILE"
        return f"SGE job {self.job_id}{task}, {self.num_slots} slots ({hosts})"


def conventional_port(job_id: int, task_id: Optional[int], local_rank: int) -> int:
    """The first port a worker tries: spread over PORT_RANGE by job and task, one per local rank."""
    low, high = PORT_RANGE
    span = (high - low) // 64  # room for 64 local ranks per job
    base = (job_id * 7919 + (task_id or 0) * 104729) % span
    return low + base * 64 + local_rank % 64


def port_is_free(port: int, host: str = "") -> bool:
    """Whether a TCP server could bind ``port`` now (the TF server binds it a moment later). As
    gRPC binds with ``SO_REUSEADDR``, so does this check: a port in TIME_WAIT (what a crashed
    server leaves) is free for it, one that a process listens on is not (FACTS.md, "Ports in
    TIME_WAIT")."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(first: int, attempt: int = 0) -> int:
    """The first free port at or after ``first`` (skipping ``attempt`` blocks, see re-agreement)
    among those of ``first``'s local rank: in steps of 64, so that a rank whose port is taken
    never moves onto the port of the local rank after it (which checks its own at the same time)."""
    low, high = PORT_RANGE
    port = first + attempt * 64
    for _ in range((high - low) // 64):
        if port >= high:
            port = low + (port - low) % (high - low)
        if port_is_free(port):
            return port
        port += 64
    raise RuntimeError(f"no free TCP port in {low}..{high} for local rank {(first - low) % 64}")
