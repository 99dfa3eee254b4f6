"""Cluster from MPI: rank, size and every rank's host and port, exchanged with ``mpi4py``.

Used for jobs started by ``mpirun`` (SGE's ``qsub -pe mpi N`` included). MPI only sets the
cluster up; training traffic goes through TensorFlow's collectives over gRPC.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping, Optional

import tensorflow as tf

from returnn_tpu.cluster.sge import SGEJob, choose_port, conventional_port
from returnn_tpu.errors import ConfigError

MAX_PORT_ATTEMPTS = 8


def started_by_mpirun(environ: Mapping[str, str]) -> bool:
    """Whether Open MPI's or MPICH's (Hydra, PMI) launcher started this process."""
    return any(key in environ for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALRANKID"))


def mpirun_kill_grace(environ: Mapping[str, str]) -> Optional[float]:
    """Under ``mpirun``, the seconds between the stop signal it forwards to the ranks (its own
    SIGTERM, SGE's ``qdel``) and its SIGKILL: Open MPI's ``odls_base_sigkill_timeout`` (default
    1 s; ``mpirun --mca odls_base_sigkill_timeout 60`` or ``OMPI_MCA_odls_base_sigkill_timeout``
    gives more), taken as 1 s under other MPIs; None when ``mpirun`` did not start this process
    (FACTS.md, "MPI")."""
    if not started_by_mpirun(environ):
        return None
    try:
        return float(environ.get("OMPI_MCA_odls_base_sigkill_timeout", 1))
    except ValueError:
        return 1.0


def local_rank(environ: Mapping[str, str]) -> int:
    for key in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    return 0


def import_mpi():
    """mpi4py's ``MPI``; without mpi4py, or without an MPI library it can load, a
    :class:`ConfigError` saying what to install."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError(
            "cluster_resolver 'mpi'/'sge' needs mpi4py: pip install 'returnn_tpu[mpi]' "
            "(and an MPI library, e.g. Debian's openmpi-bin libopenmpi-dev)"
        ) from None
    except RuntimeError as exc:  # mpi4py >= 4 loads the library at import
        reason = " ".join(str(exc).split())
        raise ConfigError(
            f"cluster_resolver 'mpi'/'sge': mpi4py cannot load an MPI library ({reason}); install one, e.g. "
            "Debian's openmpi-bin libopenmpi-dev, or set MPI4PY_LIBMPI to its libmpi.so"
        ) from None
    return MPI


def mpi_cluster_resolver(environ: Mapping[str, str] = os.environ):
    """A ``SimpleClusterResolver`` with one ``worker`` task per MPI rank.

    Each rank picks a port by the SGE convention (job id, task id, local rank; a random job id
    outside SGE), checks it is free, and all ranks exchange ``(host, port, ok)`` by allgather. If
    any rank found no free port, all pick again. Returns ``(resolver, description)``.
    """
    mpi = import_mpi()
    comm = mpi.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    job = SGEJob.from_environ(environ)
    job_id = job.job_id if job else comm.bcast(int.from_bytes(os.urandom(2), "little"), root=0)
    host = socket.getfqdn() if job else socket.gethostname()
    first = conventional_port(job_id, job.task_id if job else None, local_rank(environ))
    for attempt in range(MAX_PORT_ATTEMPTS):
        try:
            port, ok = choose_port(first, attempt), True
        except RuntimeError:
            port, ok = 0, False
        peers = comm.allgather((host, port, ok))
        addresses = [(peer_host, peer_port) for peer_host, peer_port, _ in peers]
        if all(peer_ok for _, _, peer_ok in peers) and len(set(addresses)) == len(addresses):
            break  # (two ranks of one host on one port would be one server: agree again)
    else:
        raise RuntimeError(f"MPI ranks found no free ports after {MAX_PORT_ATTEMPTS} attempts: {peers}")
    workers = [f"{peer_host}:{peer_port}" for peer_host, peer_port, _ in peers]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": workers}), task_type="worker", task_id=rank, rpc_layer="grpc"
    )
    description = f"MPI rank {rank} of {size}, workers {workers}"
    if job:
        description += f"; {job.describe()}"
    return resolver, description
