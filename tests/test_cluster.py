"""Cluster resolvers: SGE environment, the port convention, and which resolver "auto" picks."""

import json
import socket

import pytest

from returnn_tpu.cluster import resolve_cluster
from returnn_tpu.cluster.mpi import started_by_mpirun
from returnn_tpu.cluster.sge import SGEJob, choose_port, conventional_port, port_is_free
from returnn_tpu.errors import ConfigError


def test_sge_environment(tmp_path):
    hostfile = tmp_path / "pe_hostfile"
    hostfile.write_text("node07.cluster 4 main.q@node07 UNDEFINED\nnode12.cluster 2 main.q@node12 UNDEFINED\n")
    job = SGEJob.from_environ(
        {"JOB_ID": "4711", "SGE_TASK_ID": "3", "NSLOTS": "6", "PE_HOSTFILE": str(hostfile)}
    )
    assert job == SGEJob(job_id=4711, task_id=3, num_slots=6, hosts=(("node07.cluster", 4), ("node12.cluster", 2)))
    assert "SGE job 4711, array task 3, 6 slots (node07.cluster:4, node12.cluster:2)" == job.describe()
    plain = SGEJob.from_environ({"JOB_ID": "12", "SGE_TASK_ID": "undefined"})
    assert plain.task_id is None and plain.hosts == ()
    assert SGEJob.from_environ({}) is None


def test_port_convention_separates_jobs_tasks_and_local_ranks():
    ports = {conventional_port(job, task, rank) for job in (1, 2, 4711) for task in (None, 1, 2) for rank in (0, 1, 2)}
    assert len(ports) == 27
    assert all(20000 <= p < 60000 for p in ports)
    assert conventional_port(4711, None, 1) == conventional_port(4711, None, 0) + 1


def test_taken_port_is_skipped():
    first = conventional_port(4711, 2, 0)
    while not port_is_free(first):
        first += 1
    with socket.socket() as taken:
        taken.bind(("", first))
        taken.listen()
        assert not port_is_free(first)
        chosen = choose_port(first)
        assert chosen != first and port_is_free(chosen)
        # Not the next local rank's port (first + 1), which that rank checks at the same time.
        assert (chosen - first) % 64 == 0
    assert choose_port(first, attempt=1) >= first + 64  # re-agreement moves to another block


def test_a_port_in_time_wait_is_free_for_a_restart():
    """What a crashed server leaves (a connection it closed, in TIME_WAIT) does not stop an
    immediate restart on its port: gRPC binds with SO_REUSEADDR, and so does the check."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's server socket has
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: it goes to TIME_WAIT
        client.close()
    with socket.socket() as plain:
        with pytest.raises(OSError):
            plain.bind(("", port))  # without SO_REUSEADDR the port looks taken
    assert port_is_free(port)


def test_auto_resolver_choice(monkeypatch):
    assert resolve_cluster("auto", {}).kind == "local"
    tf_config = {"cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]}, "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    cluster = resolve_cluster("auto", {"TF_CONFIG": json.dumps(tf_config)})
    assert (cluster.kind, cluster.worker_index, cluster.num_workers, cluster.is_chief) == ("tf_config", 1, 2, False)
    assert started_by_mpirun({"OMPI_COMM_WORLD_SIZE": "2"}) and started_by_mpirun({"PMI_SIZE": "2"})
    assert not started_by_mpirun({"JOB_ID": "1"})


def test_tf_config_without_cluster_is_an_error():
    with pytest.raises(ConfigError, match="TF_CONFIG"):
        resolve_cluster("tf_config", {"TF_CONFIG": "{}"})


def _resolver(ports, index):
    import tensorflow as tf

    spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{port}" for port in ports]})
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=index)


def test_the_start_up_barrier_lets_workers_started_one_by_one_through_together():
    """Three workers started 0.5 s apart each leave the barrier once all have met; the last one
    comes without waiting, and each port is free again afterwards (TensorFlow binds it next)."""
    import threading
    import time

    from returnn_tpu.launcher import free_local_ports
    from returnn_tpu.strategies.startup_barrier import wait_for_workers

    ports = free_local_ports(3)
    left = {}

    def worker(index):
        time.sleep(0.5 * index)
        wait_for_workers(_resolver(ports, index), 30, "test")
        left[index] = time.monotonic()

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(3)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(left) == [0, 1, 2]
    assert all(1.0 <= left[index] - start < 5 for index in range(3)), {i: t - start for i, t in left.items()}
    assert all(port_is_free(port) for port in ports)


def test_the_start_up_barrier_raises_naming_the_missing_worker_and_counts_tensorflows_server_as_there():
    """Worker 2 never comes: ``ClusterDidNotComeUp`` names it (and only it) after the timeout;
    worker 1's port is TensorFlow's own gRPC server (a worker already past the barrier), which
    counts as there."""
    import time

    import tensorflow as tf

    from returnn_tpu.launcher import free_local_ports
    from returnn_tpu.strategies.startup_barrier import ClusterDidNotComeUp, wait_for_workers

    ports = free_local_ports(3)
    spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{port}" for port in ports]})
    server = tf.distribute.Server(spec, job_name="worker", task_index=1, start=True)
    start = time.monotonic()
    with pytest.raises(ClusterDidNotComeUp) as raised:
        wait_for_workers(_resolver(ports, 0), 2, "the_option")
    assert 2 <= time.monotonic() - start < 6
    assert str(raised.value) == (f"worker 0: the cluster did not come up within 2 s (the_option); "
                                 f"no answer from worker 2 (127.0.0.1:{ports[2]})")
    assert raised.value.missing == [f"worker 2 (127.0.0.1:{ports[2]})"]
    assert server  # held until here
