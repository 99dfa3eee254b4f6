"""Several worker processes on 127.0.0.1: TF_CONFIG (the local launcher), mpirun, timeouts."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy
import pytest

from conftest import REPO, Code, config_12ax, run_cli
from returnn_tpu import checkpoints
from returnn_tpu.errors import RESUMABLE_STATUS

WORKER_INDEX = (  # the worker's index, for configs whose values differ between workers
    'import json, os\n_worker = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)\n')

OPTIMIZER_SLOTS = ("/Adam", "/Adam_1", "/Momentum")
LOCAL_SGD_STATE = ("/local_sgd_anchor", "/local_sgd_momentum")  # the model of the last sync, outer momentum


def write_config(path, *, strategy="local_sgd", num_seqs="60", num_epochs=2, optimizer="adam", learning_rate=0.01,
                 options=None):
    """The tests' 12AX config for workers; ``num_seqs`` is Python (it may depend on ``_worker``)."""
    options = options or {"param_sync_step": 3, "startup_timeout": 120, "collective_timeout": 120}
    path.write_text(config_12ax(
        WORKER_INDEX, train=Code(f'{{"class": "Task12AXDataset", "num_seqs": {num_seqs}}}'),
        dev={"class": "Task12AXDataset", "num_seqs": 20, "fixed_random_seed": 1}, optimizer={"class": optimizer},
        learning_rate=learning_rate, num_epochs=num_epochs, distribute_strategy=strategy, distribute_options=options))


def checkpoint_params(prefix):
    values = checkpoints.load(str(prefix))
    return {k: v for k, v in values.items() if k != "global_step" and not k.startswith("optimize/")
            and not k.endswith(OPTIMIZER_SLOTS + LOCAL_SGD_STATE)}


def checkpoint_checksum(prefix):
    return sum(float(numpy.abs(v.astype("float64")).sum()) for v in checkpoint_params(prefix).values())


def checksums(output, epoch):
    """{worker: checksum} from lines like "[worker 1] epoch 2: parameter checksum 12.5" (or mpirun's tags)."""
    found = {}
    for line in output.splitlines():
        match = re.match(r"^\[(?:worker (\d+)|1,(\d+)\]<stdout>:)\]? ?epoch %d: parameter checksum (\S+)" % epoch, line)
        if match:
            found[int(match.group(1) or match.group(2))] = float(match.group(3))
    return found


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def assert_trained_and_in_sync(tmp_path, output, num_epochs=2):
    sums = checksums(output, num_epochs)
    assert sorted(sums) == [0, 1], output[-3000:]
    expected = checkpoint_checksum(tmp_path / "out" / f"model.{num_epochs:03d}")
    assert sums[0] == pytest.approx(expected, rel=1e-6) and sums[1] == pytest.approx(expected, rel=1e-6)
    metrics = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [m["epoch"] for m in metrics] == list(range(1, num_epochs + 1))  # the chief alone wrote it
    assert all(m["num_workers"] == 2 and m["num_replicas"] == 2 for m in metrics)
    assert metrics[-1]["dev_score"] < metrics[0]["dev_score"]


@pytest.mark.parametrize(
    "schedule", [{"param_sync_step": 3}, {"param_sync_time_diff": 0.05},
                 {"param_sync_step": 4, "sync_fragments": 2, "sync_delay": 1, "sync_dtype": "int4",
                  "outer_optimizer": {"class": "nesterov", "learning_rate": 0.7, "momentum": 0.5}}],
    ids=["sync_step", "sync_time_diff", "diloco_overlapped_int4"]
)
def test_two_workers_local_sgd_via_tf_config(tmp_path, schedule):
    write_config(tmp_path / "train.config", num_seqs="200",  # > 20 steps: workers agree on time every 10
                 options=dict(schedule, startup_timeout=120, collective_timeout=120))
    result = run_cli(["--local-workers", "2", "train.config"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_trained_and_in_sync(tmp_path, result.stdout)
    assert all(m["syncs"] >= 2 for m in read_metrics(tmp_path / "out" / "metrics.jsonl"))  # not just the final one
    assert not os.path.exists(tmp_path / "out" / "lr.worker1")
    # random_seed_offset with one replica per worker: each worker walks its whole copy (not every
    # second batch of it), so an epoch has as many steps as the smaller copy has batches.
    batches = [own_copy_batches(tmp_path / "train.config", worker, epoch=1) for worker in (0, 1)]
    assert read_metrics(tmp_path / "out" / "metrics.jsonl")[0]["steps"] == min(batches), batches


def own_copy_batches(config_path, worker: int, epoch: int) -> int:
    """How many RETURNN batches worker ``worker``'s dataset copy has in ``epoch``."""
    from returnn.config import Config

    from returnn_tpu.datapath.batching import BatchingOptions
    from returnn_tpu.datapath.datasets import init_datasets

    config = Config()
    config.load_file(str(config_path))
    dataset, = init_datasets(config, "train", 1, worker, "random_seed_offset")
    dataset.init_seq_order(epoch=epoch)
    return len(list(BatchingOptions(config).stream(dataset, recurrent=True, used_data_keys=["data", "classes"],
                                                   train=True)))


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed (.ci/run installs it)")
def test_two_workers_local_sgd_via_mpirun(tmp_path):
    write_config(tmp_path / "train.config", options={"param_sync_step": 3, "cluster_resolver": "mpi",
                                                     "startup_timeout": 120})
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    result = subprocess.run(
        ["mpirun", "--oversubscribe", "--tag-output", "-np", "2", sys.executable, "-m", "returnn_tpu.cli",
         "train.config"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "MPI rank 0 of 2" in result.stdout
    assert_trained_and_in_sync(tmp_path, result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["mpirun", "local_workers", "tf_config"])
def test_a_refusal_on_one_worker_ends_the_whole_job_with_status_2(tmp_path, launcher):
    """The chief refuses to start (its model is locked by a live run); the other worker, which
    would wait for it in a collective, is ended too: the job exits with status 2 within seconds.
    ``tf_config``: two workers started one by one with their ``TF_CONFIG``, no launcher; the chief
    tells the other through TensorFlow's coordination service, and both exit 2."""
    if launcher == "mpirun" and shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed (.ci/run installs it)")
    resolver = {"cluster_resolver": "mpi"} if launcher == "mpirun" else {}
    write_config(tmp_path / "train.config", options={"param_sync_step": 3, "startup_timeout": 120, **resolver})
    (tmp_path / "out").mkdir()
    holder = subprocess.Popen(["sleep", "600"])  # a live process of this host holds the lock
    (tmp_path / "out" / "model.lock").write_text(f"{socket.gethostname()} {holder.pid} {time.time():.0f}\n")
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = (["mpirun", "--oversubscribe", "--tag-output", "-np", "2"] if launcher == "mpirun" else []) + \
        [sys.executable, "-m", "returnn_tpu.cli"] + (["--local-workers", "2"] if launcher == "local_workers" else []) + \
        ["train.config"]
    start = time.time()
    try:
        if launcher == "tf_config":
            result = _run_tf_config_workers(command, tmp_path, env)
        else:
            result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    finally:
        holder.kill()
    elapsed = time.time() - start
    print(f"{launcher}: a refusal of worker 0 ended the job after {elapsed:.1f} s, status {result.returncode}")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "is in use by another returnn-tpu run" in result.stdout + result.stderr
    if launcher == "tf_config":  # worker 1's one line: worker 0's refusal, as it reported it
        assert "returnn-tpu: error: worker 0: " in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert elapsed < 60  # (it waited 240 s in a collective, then exited 75)


def _run_tf_config_workers(command: list, cwd, env: dict) -> subprocess.CompletedProcess:
    """Runs ``command`` as two workers, each started with its own ``TF_CONFIG`` (as on machines
    without a launcher); the result's status is worker 0's, asserted equal to worker 1's, and its
    output both workers'."""
    from returnn_tpu.launcher import free_local_ports

    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_local_ports(2)]}
    procs = [subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(env, TF_CONFIG=json.dumps({"cluster": cluster,
                                                                  "task": {"type": "worker", "index": index}})))
             for index in range(2)]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    statuses = [proc.returncode for proc in procs]
    assert statuses[0] == statuses[1], (statuses, outputs)
    return subprocess.CompletedProcess(command, statuses[0], "".join(out for out, _ in outputs),
                                       "".join(err for _, err in outputs))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed (.ci/run installs it)")
def test_back_to_back_mpirun_starts_under_load_all_reach_their_first_steps(tmp_path):
    """3 starts of ``mpirun -np 2`` one after the other, as a job script's loop makes them (one
    SGE job id: the same ports each time, right after the last start let them go), with two
    busy processes beside them on this 2-core machine: every start reaches step 1."""
    write_config(tmp_path / "train.config", num_seqs="20", num_epochs=1,
                 options={"param_sync_step": 3, "cluster_resolver": "mpi", "startup_timeout": 120})
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", JOB_ID="4711",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for start in range(3):
            shutil.rmtree(tmp_path / "out", ignore_errors=True)
            began = time.time()
            result = subprocess.run(["mpirun", "--oversubscribe", "--tag-output", "-np", "2", sys.executable, "-m",
                                     "returnn_tpu.cli", "train.config", "++log_verbosity", "5"],
                                    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            print(f"start {start + 1}: status {result.returncode} after {time.time() - began:.1f} s")
            assert result.returncode == 0 and "[1,0]<stdout>:train epoch 1, step 1," in result.stdout, \
                f"start {start + 1}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    finally:
        for process in load:
            process.kill()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed (.ci/run installs it)")
def test_sigterm_to_mpirun_saves_the_last_sync_within_its_grace(tmp_path):
    """SIGTERM to ``mpirun -np 2`` (as ``qdel`` or a preemption sends it) mid-epoch, with a sync
    every 10 updates: ``mpirun`` forwards it and SIGKILLs the ranks about 1 s later, too soon to
    agree on a step; the ranks save the model of the last sync at once and say so, and the same
    command continues the epoch after that sync."""
    import signal

    write_config(tmp_path / "train.config", num_seqs="2000", num_epochs=1,
                 options={**SYNC_EVERY_10, "cluster_resolver": "mpi", "startup_timeout": 120})
    job, command, env = _mpirun_at_step(tmp_path, 25)
    job.send_signal(signal.SIGTERM)
    stopped = time.time()
    output, _ = job.communicate(timeout=120)
    print(f"SIGTERM to mpirun: it ended after {time.time() - stopped:.1f} s, status {job.returncode}")
    said = re.search(r"stopped by signal 15 in epoch 1 before step \d+; the model of the last sync is in "
                     r"out/model.001.interrupted: run the same command to continue epoch 1 at step (\d+)", output)
    assert said, output[-3000:]
    found = checkpoints.interrupted(str(tmp_path / "out" / "model"), 1)
    assert found and found.steps_done % 10 == 0 and found.steps_done + 1 == int(said.group(1)), found
    resumed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"start training at epoch 1, step {found.steps_done + 1} (interrupted there)" in resumed.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed (.ci/run installs it)")
def test_sigterm_to_mpirun_during_steps_longer_than_its_grace_finds_the_last_sync_on_disk(tmp_path):
    """SIGTERM to ``mpirun -np 2`` 0.2 s into a step of seconds (a
    product of two random 5500 x 5500 matrices in the network);
    ``mpirun`` SIGKILLs the ranks about 1 s after forwarding it, before the step ends. Each rank
    writes the model of the last sync at the signal, while its step runs (rank 0 first; rank 1
    finds it written), so it is on disk; the same command continues the epoch after that sync."""
    import signal

    # Seconds of work in each step of the interrupted run; the resumed run (no SLOW_STEPS) skips them.
    slow = "tf.reduce_mean(tf.linalg.matmul(tf.random.normal([5500, 5500]), tf.random.normal([5500, 5500])))"
    slow = f"({slow} if __import__('os').environ.get('SLOW_STEPS') else 0.0)"
    network = {"slow": {"class": "eval", "from": "data", "eval": f"source(0) + 0.0 * {slow}"},
               "fw0": {"class": "rec", "unit": "standardlstm", "n_out": 8, "from": "slow"},
               "output": {"class": "softmax", "loss": "ce", "from": "fw0"}}
    (tmp_path / "train.config").write_text(config_12ax(
        WORKER_INDEX, train={"class": "Task12AXDataset", "num_seqs": 25}, network=network, num_epochs=1,
        optimizer={"class": "sgd"},
        distribute_options={"param_sync_step": 2, "cluster_resolver": "mpi", "startup_timeout": 120}))
    job, command, env = _mpirun_at_step(tmp_path, 0, SLOW_STEPS="1")
    step_lines = []
    for line in job.stdout:  # a sync after update 2; the signal comes 0.2 s into step 4
        if line.startswith("[1,0]<stdout>:train epoch 1, step "):
            step_lines.append(time.time())
            if line.startswith("[1,0]<stdout>:train epoch 1, step 2,"):
                break
    time.sleep(0.2)
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=120)
    assert numpy.diff(step_lines).min() > 2.5, f"steps of {numpy.diff(step_lines)} s do not show it"
    assert ("at signal 15: the model of the last sync is in out/model.001.interrupted: run the same command to continue "
            "epoch 1 at step 3") in output, output[-3000:]
    found = checkpoints.interrupted(str(tmp_path / "out" / "model"), 1)
    assert found and found.steps_done == 2, (found, output[-3000:])
    resumed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "start training at epoch 1, step 3 (interrupted there)" in resumed.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed (.ci/run installs it)")
def test_kill_9_of_an_mpi_rank_costs_at_most_one_sync_period(tmp_path):
    """kill -9 of rank 1 under ``mpirun -np 2`` between two syncs (after updates 10 and 20; rank 0
    has logged step 13): the job ends non-zero within a bound, naming the lost rank; rank 0 saved
    the model of the sync after update 10 as epoch 1's interrupted checkpoint, which plain RETURNN
    loads (``++task eval ++load`` runs it); the same command continues epoch 1 at step 11."""
    import signal

    write_config(tmp_path / "train.config", num_seqs="300", num_epochs=2,
                 options={**SYNC_EVERY_10, "cluster_resolver": "mpi", "startup_timeout": 120})
    job, command, env = _mpirun_at_step(tmp_path, 12)
    rank1 = [pid for pid in _descendants(job.pid) if _environ(pid).get("OMPI_COMM_WORLD_RANK") == "1"
             and b"returnn_tpu.cli" in open(f"/proc/{pid}/cmdline", "rb").read()]  # not its data producer
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGKILL)
    killed = time.time()
    output, _ = job.communicate(timeout=120)
    print(f"kill -9 of MPI rank 1: mpirun ended after {time.time() - killed:.1f} s, status {job.returncode}")
    assert job.returncode not in (0, 2)  # 137 (rank 1's signal) or 75 (rank 0's abort), as mpirun sees first
    assert time.time() - killed < 60, output[-3000:]
    assert re.search(r"rank 1 with PID \d+ on node \S+ exited on signal 9", output), output[-3000:]
    found = checkpoints.interrupted(str(tmp_path / "out" / "model"), 1)
    assert found and (found.epoch, found.steps_done) == (1, 10), (found, output[-3000:])
    evaluated = run_cli(["train.config", "++task", "eval", "++load", "out/model.001.interrupted"], cwd=tmp_path)
    assert evaluated.returncode == 0 and "dev: score" in evaluated.stdout, evaluated.stderr[-3000:]
    resumed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "start training at epoch 1, step 11 (interrupted there)" in resumed.stdout
    assert os.path.exists(tmp_path / "out" / "model.002.index")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed (.ci/run installs it)")
def test_a_hung_mpi_rank_ends_the_job_within_a_bound(tmp_path):
    """SIGSTOP of rank 1 under ``mpirun -np 2``: rank 0 names it as lost and aborts the MPI job,
    so ``mpirun`` ends (a normal exit of rank 0 would wait in MPI_Finalize for the stopped rank)."""
    import signal

    from returnn_tpu.strategies.multi_worker import PEER_LOSS_BOUND_SECONDS

    write_config(tmp_path / "train.config", num_seqs="300", num_epochs=50,
                 options={"param_sync_step": 3, "cluster_resolver": "mpi", "startup_timeout": 120,
                          "data_producer": "thread"})
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    job = subprocess.Popen(["mpirun", "--oversubscribe", "--tag-output", "-np", "2", sys.executable, "-m",
                            "returnn_tpu.cli", "train.config", "++log_verbosity", "5"],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in job.stdout:
        if "train epoch 1, step 2," in line:
            break
    rank1 = [pid for pid in _descendants(job.pid) if _environ(pid).get("OMPI_COMM_WORLD_RANK") == "1"
             and b"returnn_tpu.cli" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGSTOP)
    stopped = time.time()
    output, _ = job.communicate(timeout=PEER_LOSS_BOUND_SECONDS + 60)
    print(f"SIGSTOP of MPI rank 1: mpirun ended after {time.time() - stopped:.1f} s")
    assert job.returncode != 0
    assert "lost worker 1" in output, output[-3000:]


def _descendants(pid):
    children = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    return children + [d for child in children for d in _descendants(child)]


def _environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {key.decode(): value.decode(errors="replace") for key, value in pairs}


@pytest.mark.slow
@pytest.mark.parametrize("producer", ["process", "chief"])
def test_multi_worker_mirrored_equals_mirrored(tmp_path, producer):
    """Two workers with sharded data train what one worker with two replicas trains: with a
    producer per worker, and with worker 0's producer serving both (worker 1's own dataset, a
    different one here, is then not read)."""
    options = {"dataset_distribution": "shard", "startup_timeout": 120}
    (tmp_path / "mw").mkdir()
    write_config(tmp_path / "mw" / "train.config", strategy="multi_worker_mirrored", num_epochs=1,
                 num_seqs="60" if producer == "process" else "60 if _worker == 0 else 30",
                 optimizer="sgd", learning_rate=0.5, options=dict(options, data_producer=producer))
    (tmp_path / "mirrored").mkdir()
    write_config(tmp_path / "mirrored" / "train.config", strategy="mirrored", num_epochs=1, optimizer="sgd",
                 learning_rate=0.5, options=dict(options, num_replicas=2))
    multi = run_cli(["--local-workers", "2", "train.config"], cwd=tmp_path / "mw")
    assert multi.returncode == 0, multi.stdout[-3000:]
    local = run_cli(["train.config"], cwd=tmp_path / "mirrored")
    assert local.returncode == 0, local.stderr[-3000:]
    ours = checkpoint_params(tmp_path / "mw" / "out" / "model.001")
    theirs = checkpoint_params(tmp_path / "mirrored" / "out" / "model.001")
    assert ours.keys() == theirs.keys()
    for name in ours:
        numpy.testing.assert_allclose(ours[name], theirs[name], atol=1e-5, rtol=0, err_msg=name)
    steps = [m["steps"] for m in read_metrics(tmp_path / "mw" / "out" / "metrics.jsonl")]
    assert steps[0] >= 3


@pytest.mark.slow
def test_workers_with_unequal_data_finish_the_epoch(tmp_path, monkeypatch):
    """Workers whose datasets differ in size do the same number of steps. The config says
    ``num_replicas: 1``, as a Horovod user's does: what each CPU worker has, so it is accepted."""
    write_config(tmp_path / "train.config", num_seqs="40 if _worker == 0 else 90",
                 options={"num_replicas": 1, "param_sync_step": 3, "startup_timeout": 120, "collective_timeout": 120})
    result = run_cli(["--local-workers", "2", "train.config"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    steps = re.findall(r"\[worker (\d)\] epoch 1: (\d+) steps", result.stdout)
    assert len(steps) == 2 and steps[0][1] == steps[1][1], steps  # both did the agreed number
    assert_trained_and_in_sync(tmp_path, result.stdout)
    # Each epoch has as many steps as the smaller copy has batches, agreed as the workers went.
    batches = []
    for worker in (0, 1):
        monkeypatch.setenv("TF_CONFIG", json.dumps({"task": {"type": "worker", "index": worker}}))
        batches.append([own_copy_batches(tmp_path / "train.config", worker, epoch) for epoch in (1, 2)])
    metrics = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [m["steps"] for m in metrics] == [min(pair) for pair in zip(*batches)], (batches, metrics)
    assert all(m["agreements"] >= 1 and m["agree_bytes"] > 0 for m in metrics), metrics


@pytest.mark.slow
def test_distribute_files_dataset_deals_its_files_to_the_workers(tmp_path):
    """RETURNN's ``DistributeFilesDataset`` with ``distrib_shard_files`` on two workers, each with
    its producer process, which loads the sub-epochs in processes of its own (the default): each
    worker reads its own files, together all of them, and both train the same steps; the
    sub-epoch loaders end in order, without a traceback after training's last line."""
    from test_data import write_hdf_parts

    paths = write_hdf_parts(tmp_path)
    prelude = 'def _sub_epoch(files):\n    return {"class": "HDFDataset", "files": files, "seq_ordering": "random"}\n'
    train = {"class": "DistributeFilesDataset", "files": paths, "partition_epoch": 1, "distrib_shard_files": True,
             "sharding_fix": True}
    (tmp_path / "train.config").write_text(config_12ax(
        prelude, train=Code(repr(train)[:-1] + ', "get_sub_epoch_dataset": _sub_epoch}'), num_epochs=1,
        dev=None, distribute_options={"num_replicas": 1, "param_sync_step": 3, "startup_timeout": 120,
                                      "collective_timeout": 120}))
    result = run_cli(["--local-workers", "2", "train.config"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    used = {int(worker): set(re.findall(r"part(\d)\.hdf", files)) for worker, files in
            re.findall(r"\[worker (\d)\] <DistributeFilesDataset 'train' epoch=1>: using files for epoch 1: (.*)",
                       output)}
    assert sorted(used) == [0, 1] and not used[0] & used[1] and used[0] | used[1] == set("0123"), output[-3000:]
    steps = re.findall(r"\[worker (\d)\] epoch 1: (\d+) steps", result.stdout)
    assert len(steps) == 2 and steps[0][1] == steps[1][1], steps
    assert "Traceback" not in output and "Error" not in output.split("finished training")[-1], output[-3000:]


def test_workers_with_different_networks_are_named(tmp_path):
    """Worker 1's config builds another network (its LSTM is wider): one line naming worker 1, exit 2,
    at the first step, not TensorFlow's shape mismatch in the first sync."""
    write_config(tmp_path / "train.config", num_epochs=1)
    config = (tmp_path / "train.config").read_text().replace("'n_out': 8,", "'n_out': 8 + _worker,")
    assert "8 + _worker" in config
    (tmp_path / "train.config").write_text(config)
    result = run_cli(["--local-workers", "2", "train.config"], cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr  # the launcher passes each worker's lines on, tagged
    errors = {line.split("returnn-tpu: error: ", 1)[1] for line in output.splitlines() if "returnn-tpu: error:" in line}
    assert errors and all(error.startswith("worker 1 built another network than worker 0") for error in errors), \
        output[-3000:]
    assert not os.path.exists(tmp_path / "out" / "model.001.index")


def test_missing_worker_is_named_within_the_timeout(tmp_path):
    from returnn_tpu.launcher import free_local_ports

    write_config(tmp_path / "train.config", options={"startup_timeout": 8})
    ports = free_local_ports(2)
    tf_config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": 0}}
    start = time.time()
    result = run_cli(["train.config"], cwd=tmp_path, env={"TF_CONFIG": json.dumps(tf_config)}, timeout=120)
    elapsed = time.time() - start
    assert result.returncode == 1, result.stderr[-2000:]  # docs/faults.md: a failure to look at, not 137
    errors = [line for line in result.stderr.splitlines() if line.startswith("returnn-tpu: error:")]
    assert len(errors) == 1 and f"worker 1 (127.0.0.1:{ports[1]})" in errors[0], result.stderr[-2000:]
    assert "startup_timeout" in errors[0]
    assert elapsed < 8 + 30  # the timeout plus start-up of Python and TensorFlow
    assert not os.path.exists(tmp_path / "out" / "model.001.index")


def test_worker_dying_during_training_is_named(tmp_path):
    from returnn_tpu.launcher import free_local_ports

    write_config(tmp_path / "train.config", num_seqs="100", num_epochs=50,
                 options={"param_sync_step": 3, "startup_timeout": 120, "collective_timeout": 60})
    ports = free_local_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for index in range(2):
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        procs.append(subprocess.Popen([sys.executable, "-m", "returnn_tpu.cli", "train.config"], cwd=tmp_path,
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    deadline = time.time() + 300
    while not os.path.exists(tmp_path / "out" / "model.001.index"):  # training is under way
        assert procs[0].poll() is None and time.time() < deadline
        time.sleep(0.2)
    procs[1].kill()
    killed = time.time()
    _, stderr = procs[0].communicate(timeout=120)
    print(f"kill -9 of worker 1: worker 0 exited after {time.time() - killed:.1f} s")
    assert procs[0].returncode == RESUMABLE_STATUS  # it saved the model of the last sync
    assert time.time() - killed < 90  # far below a hang, bounded by collective_timeout
    errors = [line for line in stderr.splitlines() if line.startswith("returnn-tpu: error:")]
    assert len(errors) == 1 and f"lost worker 1 (127.0.0.1:{ports[1]})" in errors[0], stderr[-2000:]


def _launch(tmp_path, num_seqs="300", num_epochs=50, launcher_args=(), until="step", step=2, **options):
    """``returnn-tpu --local-workers 2`` on a long run; returns the launcher once training is under
    way: the chief has logged step ``step`` (0-based; ``until="step"``: a fault injected there lands
    in the first steps) or written its first checkpoint (``until="checkpoint"``)."""
    (tmp_path / "out").mkdir(parents=True, exist_ok=True)
    write_config(tmp_path / "train.config", num_seqs=num_seqs, num_epochs=num_epochs,
                 options={"param_sync_step": 3, "startup_timeout": 120, **options})
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    verbose = ["++log_verbosity", "5"] if until == "step" else []  # the chief's step lines
    launcher = subprocess.Popen([sys.executable, "-m", "returnn_tpu.cli", "--local-workers", "2", *launcher_args,
                                 "train.config", *verbose],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    if until == "step":
        for line in launcher.stdout:
            if line.startswith(f"[worker 0] train epoch 1, step {step},"):
                return launcher
            assert time.time() < deadline, f"no step {step} within 300 s"
        raise AssertionError(f"the job ended before its step {step} (status {launcher.wait()})")
    while not os.path.exists(tmp_path / "out" / "model.001.index"):
        assert launcher.poll() is None and time.time() < deadline, launcher.stdout.read()[-3000:]
        time.sleep(0.2)
    return launcher


def _workers_of(launcher):
    children = f"/proc/{launcher.pid}/task/{launcher.pid}/children"
    return [int(pid) for pid in open(children).read().split()]


def _listening_ports(net_dir):
    """The TCP ports with a socket in LISTEN state in ``/proc/.../net/tcp`` and ``tcp6``, by address."""
    found = []
    for name in ("tcp", "tcp6"):
        with open(os.path.join(net_dir, name)) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # LISTEN
                    address, port = local.rsplit(":", 1)
                    found.append((address, int(port, 16)))
    return found


def _assert_reachable_only_inside(workers):
    """The workers' gRPC ports listen in a network namespace whose only interface is loopback,
    and no socket in this machine's namespace listens on them (TensorFlow binds the wildcard)."""
    ports = [int(address.rsplit(":", 1)[1]) for address in json.loads(_environ(workers[0])["TF_CONFIG"])["cluster"]["worker"]]
    for pid in workers:
        interfaces = [line.split(":")[0].strip() for line in open(f"/proc/{pid}/net/dev").readlines()[2:]]
        assert interfaces == ["lo"], interfaces
        inside = {port for _, port in _listening_ports(f"/proc/{pid}/net")}
        assert set(ports) <= inside  # the servers are up, in the workers' namespace
    outside = [(address, port) for address, port in _listening_ports("/proc/net") if port in ports]
    assert not outside, outside


def _gone(pid):
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] == "Z"  # a zombie waits only for its parent
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "worker 0", "worker 1"])
def test_sigterm_stops_every_worker_at_a_step_boundary(tmp_path, target):
    """SIGTERM to the launcher, the chief or another worker: all workers stop at one step
    boundary, the chief writes the combined model of the epoch in progress, all are gone within
    the grace period, and the same command continues that epoch. (Worker 1's case with worker 0's
    producer serving both: their stops end its epoch once.)"""
    import signal

    from returnn_tpu.launcher import GRACE_SECONDS

    launcher = _launch(tmp_path, data_producer="chief" if target == "worker 1" else "process")
    workers = _workers_of(launcher)
    assert len(workers) == 2
    _assert_reachable_only_inside(workers)
    os.kill(launcher.pid if target == "launcher" else workers[int(target[-1])], signal.SIGTERM)
    start = time.time()
    output, _ = launcher.communicate(timeout=60)
    elapsed = time.time() - start
    print(f"SIGTERM to the {target}: all gone after {elapsed:.1f} s")
    assert launcher.returncode == 128 + signal.SIGTERM
    assert all(_gone(pid) for pid in workers)
    assert elapsed < GRACE_SECONDS and "still running" not in output, output[-3000:]  # stopped, not killed
    stopped = [line for line in output.splitlines() if "returnn-tpu: stopped by signal 15" in line]
    assert len(stopped) == 2, output[-3000:]
    found = checkpoints.interrupted(str(tmp_path / "out" / "model"), 1)
    assert found and found.epoch == 1 and found.steps_done > 0, found  # in the first steps
    assert "the combined model is in out/model.001.interrupted" in stopped[0], output[-3000:]
    interrupted = set(checkpoint_params(found.prefix))
    resumed = run_cli(["train.config", "++num_epochs", "1"], cwd=tmp_path)  # one worker now
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"start training at epoch 1, step {found.steps_done + 1}" in resumed.stdout
    assert set(checkpoint_params(tmp_path / "out" / "model.001")) < interrupted  # it holds the position too


@pytest.mark.slow
def test_a_hung_worker_ends_the_job_within_a_bound(tmp_path):
    import signal

    from returnn_tpu.launcher import GRACE_SECONDS
    from returnn_tpu.strategies.multi_worker import PEER_LOSS_BOUND_SECONDS

    launcher = _launch(tmp_path)
    workers = _workers_of(launcher)
    os.kill(workers[1], signal.SIGSTOP)  # hangs: neither answers nor dies
    start = time.time()
    output, _ = launcher.communicate(timeout=300)
    elapsed = time.time() - start
    print(f"SIGSTOP of worker 1: the job ended after {elapsed:.1f} s")
    assert launcher.returncode == RESUMABLE_STATUS, output[-3000:]  # worker 0 saved, so the same command continues
    assert elapsed < PEER_LOSS_BOUND_SECONDS + GRACE_SECONDS + 10  # no collective_timeout is set
    assert "worker 1 still running" in output and "lost worker 1" in output, output[-3000:]
    assert all(_gone(pid) for pid in workers)


@pytest.mark.slow
def test_threads_stay_flat_with_a_sync_every_step(tmp_path):
    write_config(tmp_path / "train.config", num_seqs="200", num_epochs=4, options={"param_sync_step": 1})
    result = run_cli(["--local-workers", "2", "train.config"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    metrics = read_metrics(tmp_path / "out" / "metrics.jsonl")
    threads = [m["threads"] for m in metrics]
    print(f"threads after each epoch of {[m['syncs'] for m in metrics]} syncs: {threads}")
    assert all(m["syncs"] >= 50 for m in metrics)
    assert max(threads) - min(threads) <= 5, threads  # with a timeout per collective: +190 per epoch


@pytest.mark.slow
def test_max_restarts_resumes_the_job_after_a_lost_worker(tmp_path):
    """kill -9 of worker 1 between two syncs (after updates 10 and 20; the chief has logged step
    13): the job restarts by itself and continues epoch 1 at the last sync, so at most
    ``param_sync_step`` updates are lost."""
    import signal

    launcher = _launch(tmp_path, num_seqs="300", num_epochs=2, launcher_args=("--max-restarts", "1"), step=12,
                       **SYNC_EVERY_10)
    os.kill(_workers_of(launcher)[1], signal.SIGKILL)
    output, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, output[-3000:]
    assert "restarting all 2 workers from the newest checkpoint in 10 s (1 of 1 restarts)" in output
    assert "start training at epoch 1, step 11 (interrupted there)" in output, output[-3000:]  # 12+ done, 10 kept
    assert os.path.exists(tmp_path / "out" / "model.002.index")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local_workers", "mpirun"])
def test_every_worker_names_the_cause_of_a_stop(tmp_path, launcher):
    """Worker 0 reaches its time limit first (worker 1's is far away): both stop at the same step
    for the time limit, with its status 75; worker 1 does not call it a signal (under ``mpirun``
    too, which forwards no signal here)."""
    from conftest import Code, config_12ax

    if launcher == "mpirun" and shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed (.ci/run installs it)")
    resolver = ', "cluster_resolver": "mpi"' if launcher == "mpirun" else ""
    options = Code('{"param_sync_step": 3, "startup_timeout": 120, "time_limit": 30 if _worker == 0 else 3000, '
                   f'"stop_before_time_limit": 10{resolver}}}')
    worker_index = 'import os\n_worker = int(os.environ["OMPI_COMM_WORLD_RANK"])\n' if launcher == "mpirun" else WORKER_INDEX
    (tmp_path / "train.config").write_text(config_12ax(
        worker_index, train={"class": "Task12AXDataset", "num_seqs": 300}, num_epochs=100, distribute_options=options))
    if launcher == "mpirun":
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        result = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", sys.executable, "-m", "returnn_tpu.cli",
                                 "train.config"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    else:
        result = run_cli(["--local-workers", "2", "train.config"], cwd=tmp_path)
    assert result.returncode == 75, result.stdout[-3000:] + result.stderr[-3000:]
    stops = [line for line in (result.stdout + result.stderr).splitlines() if "returnn-tpu: stopped" in line]
    assert len(stops) == 2 and all("stopped before the time limit" in line for line in stops), stops
    assert "signal" not in " ".join(stops)


FAILING_DATASET = """
from returnn.datasets.generating import Task12AXDataset

class FailsAtSeq5(Task12AXDataset):
    \"\"\"A corpus with a sequence that never loads.\"\"\"
    def generate_seq(self, seq_idx):
        if seq_idx == 5:
            raise RuntimeError("sequence 5 is damaged")
        return super().generate_seq(seq_idx)
"""


@pytest.mark.slow
def test_max_restarts_backs_off_and_gives_up_on_bad_input(tmp_path):
    """A job that fails the same way at every start is restarted after 10 s, then 20 s (not at
    once); bad input (exit status 2), which no restart can fix, is not restarted at all."""
    from conftest import Code, config_12ax

    (tmp_path / "fails.config").write_text(config_12ax(FAILING_DATASET, train=Code('{"class": FailsAtSeq5, "num_seqs": 40}'),
                                                       distribute_options={"param_sync_step": 2}))
    start = time.time()
    result = run_cli(["--local-workers", "1", "--max-restarts", "2", "fails.config"], cwd=tmp_path)
    elapsed = time.time() - start
    assert result.returncode == 1, result.stderr[-3000:]
    assert (result.stdout + result.stderr).count("RuntimeError: sequence 5 is damaged") == 3, result.stdout[-3000:]
    assert "in 10 s (1 of 2 restarts)" in result.stderr and "in 20 s (2 of 2 restarts)" in result.stderr
    assert elapsed >= 30
    (tmp_path / "bad.config").write_text(config_12ax(train={"class": "Task12AXDataset", "num_seqs": 0}))
    result = run_cli(["--local-workers", "1", "--max-restarts", "2", "bad.config"], cwd=tmp_path)
    assert result.returncode == 2 and "restarting" not in result.stderr, result.stderr[-3000:]


def _mpirun_at_step(tmp_path, step: int, **job_env):
    """``mpirun -np 2 returnn-tpu train.config`` in ``tmp_path`` (with ``job_env`` added to its
    environment), once rank 0 has logged ``step``: the job, its command (to run again) and the
    environment without ``job_env``."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = ["mpirun", "--oversubscribe", "--tag-output", "-np", "2", sys.executable, "-m", "returnn_tpu.cli",
               "train.config"]
    job = subprocess.Popen(command + ["++log_verbosity", "5"], cwd=tmp_path, env=dict(env, **job_env),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    for line in job.stdout:
        if line.startswith(f"[1,0]<stdout>:train epoch 1, step {step},"):
            return job, command, env
        assert time.time() < deadline, f"no step {step} within 300 s"
    raise AssertionError(f"the job ended before its step {step} (status {job.wait()})")


SYNC_EVERY_10 = {"param_sync_step": 10, "dataset_distribution": "shard"}


def _plain_returnn_loads(config_path, prefix):
    """The parameters plain RETURNN's ``TFNetwork`` of the config loads from the checkpoint (as it
    does for search or forwarding), by name."""
    import tensorflow as tf
    from returnn.config import Config
    from returnn.tf.network import TFNetwork

    config = Config()
    config.load_file(str(config_path))
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
        net = TFNetwork(config=config, train_flag=False, eval_flag=False)
        net.construct_from_dict(config.typed_value("network"))
        net.load_params_from_file(str(prefix), session=session)
        return {var.op.name: session.run(var) for var in net.get_params_list()}


@pytest.mark.slow
def test_a_killed_worker_costs_at_most_one_sync_period(tmp_path):
    """kill -9 of worker 1 between two syncs (the syncs after updates S and S + 10; the chief has
    logged step S + 3): worker 0 saves the model of the sync after update S as epoch 1's
    interrupted checkpoint and exits with status 75. That model equals the one an undisturbed run
    of the same config holds there (a SIGTERM stops it at sync point S and saves it; <= 1e-6);
    plain RETURNN loads it; and it resumes on 1 worker and on 3, the rest of the epoch's batches
    dealt to their replicas."""
    import signal

    # The undisturbed run first: a SIGTERM takes effect where the workers next agree (every 10
    # steps), which a loaded machine may reach one agreement later; the kill then lands after it.
    stopped = _launch(tmp_path / "stopped", step=2, **SYNC_EVERY_10)
    stopped.send_signal(signal.SIGTERM)
    output, _ = stopped.communicate(timeout=300)
    assert stopped.returncode == 128 + signal.SIGTERM, output[-3000:]
    reference = checkpoints.interrupted(str(tmp_path / "stopped" / "out" / "model"), 1)
    synced = reference.steps_done
    assert synced > 0 and synced % 10 == 0, reference

    killed = _launch(tmp_path / "killed", step=synced + 2, **SYNC_EVERY_10)
    os.kill(_workers_of(killed)[1], signal.SIGKILL)
    output, _ = killed.communicate(timeout=300)
    assert killed.returncode == RESUMABLE_STATUS, output[-3000:]
    assert "lost worker 1" in output and ("the model of the last sync is in out/model.001.interrupted: run the same "
                                          f"command to continue epoch 1 at step {synced + 1}") in output, output[-3000:]
    found = checkpoints.interrupted(str(tmp_path / "killed" / "out" / "model"), 1)
    assert (found.epoch, found.steps_done, found.num_replicas) == (1, synced, 2), found
    assert int(checkpoints.load(found.prefix)["global_step"]) == synced  # the updates that count
    saved, undisturbed = checkpoint_params(found.prefix), checkpoint_params(reference.prefix)
    assert saved.keys() == undisturbed.keys()
    for name in saved:
        numpy.testing.assert_allclose(saved[name], undisturbed[name], atol=1e-6, rtol=0, err_msg=name)

    loaded = _plain_returnn_loads(tmp_path / "killed" / "train.config", found.prefix)
    assert loaded and all(numpy.array_equal(loaded[name], saved[name]) for name in loaded), sorted(loaded)

    batches = 2 * synced  # S steps of 2 replicas: for 3 replicas, 2S // 3 full steps and maybe a part of one
    for workers, continues_at in ((1, batches + 1), (3, batches // 3 + 1)):
        run = tmp_path / f"on_{workers}"
        shutil.copytree(tmp_path / "killed", run)
        args = ["train.config", "++num_epochs", "1"]
        resumed = run_cli(args if workers == 1 else ["--local-workers", str(workers), *args], cwd=run)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert (f"epoch 1 continues after {batches} of its batches ({synced} steps of 2 replicas) at step "
                f"{continues_at} of {workers} replica") in resumed.stdout, resumed.stdout[-3000:]
        assert os.path.exists(run / "out" / "model.001.index")
        assert not checkpoints.interrupted(str(run / "out" / "model"), 1)


@pytest.mark.slow
def test_two_workers_continue_an_epoch_at_its_very_end(tmp_path):
    """Two workers resume from the model of an epoch's last sync (a worker was lost during its
    dev evaluation): no step is left, and the epoch's scores, dev evaluation and checkpoint go
    through the workers' collectives all the same (an empty all-gather would end the process)."""
    import tensorflow as tf

    write_config(tmp_path / "train.config", num_seqs="60", num_epochs=1)
    first = run_cli(["--local-workers", "2", "train.config"], cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:]
    values = {name: tf.constant(value) for name, value in checkpoints.load(str(tmp_path / "out" / "model.001")).items()}
    checkpoints.save_interrupted(str(tmp_path / "out" / "model"), str(tmp_path / "out" / "model.002.interrupted"),
                                 values, epoch=2, steps_done=10_000, num_replicas=2)
    second = run_cli(["--local-workers", "2", "train.config", "++num_epochs", "2"], cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:]
    assert "start training at epoch 2, step 10001 (interrupted there)" in second.stdout
    assert checkpoint_checksum(tmp_path / "out" / "model.002") == checkpoint_checksum(tmp_path / "out" / "model.001")
