"""Finding the other workers of a multi-machine run (no RETURNN import).

``distribute_options["cluster_resolver"]``:

* ``"tf_config"``: TensorFlow's ``TF_CONFIG`` environment variable (GCE, AWS, the local launcher).
* ``"mpi"`` / ``"sge"``: ranks from ``mpirun`` (SGE's ``qsub -pe mpi N`` too), via ``mpi4py``.
* ``"local"``: this process alone.
* ``"auto"`` (default): ``TF_CONFIG`` if set, else MPI if ``mpirun`` started the process, else local.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from typing import List, Mapping, Optional

import tensorflow as tf

from returnn_tpu.cluster.mpi import mpi_cluster_resolver, started_by_mpirun
from returnn_tpu.cluster.sge import port_is_free
from returnn_tpu.errors import ConfigError


@dataclasses.dataclass
class Cluster:
    """The workers of this run, as found by a resolver."""

    kind: str  # "local", "tf_config", "mpi"
    resolver: Optional[tf.distribute.cluster_resolver.ClusterResolver]
    worker_index: int = 0
    num_workers: int = 1
    description: str = "one local process"

    @property
    def is_chief(self) -> bool:
        """Worker 0 writes checkpoints, the learning-rate file, metrics and the main log."""
        return self.worker_index == 0

    @property
    def chief_host(self) -> str:
        """Worker 0's host in the cluster spec: where a service for all workers listens."""
        spec = self.resolver.cluster_spec()
        address = spec.job_tasks("chief" if "chief" in spec.jobs else "worker")[0]
        return address.rsplit(":", 1)[0].strip("[]")

    def workers_named_in(self, text: str) -> List[str]:
        """The other workers that ``text`` (e.g. a TensorFlow error) mentions, as ``"worker 1 (host:port)"``."""
        if self.resolver is None:
            return []
        spec = self.resolver.cluster_spec()
        named = []
        for job in spec.jobs:
            for task_id, address in enumerate(spec.job_tasks(job)):
                own = (job, task_id) == (self.resolver.task_type, self.resolver.task_id)
                if not own and (address in text or f"/job:{job}/replica:0/task:{task_id}" in text):
                    named.append(f"{job} {task_id} ({address})")
        return named


def resolve_cluster(kind: str = "auto", environ: Mapping[str, str] = os.environ) -> Cluster:
    """The cluster that ``kind`` (a ``cluster_resolver`` value) finds from ``environ``."""
    if kind == "auto":
        if environ.get("TF_CONFIG"):
            kind = "tf_config"
        elif started_by_mpirun(environ):
            kind = "mpi"
        else:
            kind = "local"
    if kind == "local":
        return Cluster("local", None)
    if kind == "tf_config":
        return _tf_config_cluster(environ)
    if kind in ("mpi", "sge"):
        resolver, description = mpi_cluster_resolver(environ)
        return Cluster("mpi", resolver, resolver.task_id, len(resolver.cluster_spec().job_tasks("worker")), description)
    raise AssertionError(f"unhandled cluster_resolver {kind!r}")  # options.py validated it


def _check_addresses(cluster: Mapping[str, list], own: tuple):
    """Every task of TF_CONFIG's cluster is ``host:port`` with a port in 1..65535, no two alike,
    every host resolves (found here, not after ``startup_timeout``)."""
    seen = {}
    for job, addresses in cluster.items():
        for index, address in enumerate(addresses if isinstance(addresses, list) else [addresses]):
            where = f"TF_CONFIG cluster {job} {index} ({address!r})"
            host, _, port = str(address).rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ConfigError(f"{where}: an address must be host:port with a port in 1..65535")
            if address in seen:
                raise ConfigError(f"{where}: the same address as {seen[address]}; every task needs its own port")
            seen[address] = f"{job} {index}"
            try:
                socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                whose = "this task's own host" if (job, index) == own else "the host"
                raise ConfigError(f"{where}: {whose} {host!r} does not resolve ({exc.strerror})") from None


def _tf_config_cluster(environ: Mapping[str, str]) -> Cluster:
    try:
        tf_config = json.loads(environ.get("TF_CONFIG") or "{}")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not tf_config.get("cluster") or not tf_config.get("task"):
        raise ConfigError("cluster_resolver 'tf_config' needs TF_CONFIG with 'cluster' and 'task'")
    task_type, task_index = tf_config["task"].get("type"), tf_config["task"].get("index", 0)
    if task_type not in ("worker", "chief"):
        raise ConfigError(f"TF_CONFIG task type must be 'worker' or 'chief' (returnn-tpu has no parameter servers "
                          f"or evaluators), got {task_type!r}")
    tasks = tf_config["cluster"].get(task_type) or []
    if not isinstance(task_index, int) or not 0 <= task_index < len(tasks):
        raise ConfigError(f"TF_CONFIG task index must be an int in 0..{len(tasks) - 1} (the cluster has {len(tasks)} "
                          f"{task_type} tasks), got {task_index!r}")
    _check_addresses(tf_config["cluster"], own=(task_type, task_index))
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = resolver.cluster_spec()
    own = spec.task_address(resolver.task_type, resolver.task_id)
    port = own.rsplit(":", 1)[-1]
    if port.isdigit() and not port_is_free(int(port)):
        raise ConfigError(f"TF_CONFIG: port {port} of this task ({resolver.task_type} {resolver.task_id}, {own}) is "
                          "in use by another process; end that process or give this task another port")
    workers = [f"{job}:{i}={address}" for job in spec.jobs for i, address in enumerate(spec.job_tasks(job))]
    num_workers = sum(len(spec.job_tasks(job)) for job in spec.jobs if job in ("chief", "worker"))
    index = resolver.task_id + (1 if resolver.task_type == "worker" and "chief" in spec.jobs else 0)
    return Cluster(
        "tf_config", resolver, index, num_workers, f"TF_CONFIG {resolver.task_type}:{resolver.task_id} of {workers}"
    )
