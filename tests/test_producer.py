"""The dataset producer process: the same batches as reading in the training process, bit for
bit; every sequence once per epoch across replicas (shard); its failure and death end training."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, Code, config_12ax, run_cli
from returnn_tpu.datapath.producer_blocks import BLOCK_PREFIX, remove_stale_blocks


def producer_config(num_seqs: int = 37, map_seq: str = "") -> str:
    """The tests' 12AX config with ``num_seqs`` training sequences on the default strategy's
    options; with ``map_seq`` (the Python lines of a function ``_map_seq``), the sequences pass
    through it in a ``PostprocessingDataset``."""
    train = {"class": "Task12AXDataset", "num_seqs": num_seqs}
    if map_seq:
        train = Code(f'{{"class": "PostprocessingDataset", "dataset": {train!r}, "map_seq": _map_seq}}')
    return config_12ax(map_seq, train=train, distribute_options={})


PRODUCER_CONFIG = producer_config()


def _setup(tmp_path, text=PRODUCER_CONFIG):
    from returnn.config import Config

    from returnn_tpu.returnn_side.network_inputs import extern_data_template

    path = tmp_path / "train.config"
    path.write_text(text)
    config = Config()
    config.load_file(str(path))
    return str(path), config, extern_data_template(config)


def _templates(extern_data):
    from returnn_tpu.datapath.batching import template_shapes

    return template_shapes(extern_data, ["classes", "data"])


def _in_process(config, extern_data, distribution, request):
    from returnn_tpu.datapath.data import EpochBatches
    from returnn_tpu.datapath.datasets import init_datasets

    datasets = init_datasets(config, "train", 2, 0, distribution)
    return list(EpochBatches(datasets, extern_data=extern_data, **request))


@pytest.mark.parametrize("distribution,buckets,loaders", [
    ("shard", None, 1), ("random_seed_offset", None, 1), ("shard", [50, 100, 300], 1),
    ("shard", None, 3), ("random_seed_offset", None, 4)],
    ids=["shard", "random_seed_offset", "shard_buckets", "shard_3_loaders", "random_seed_offset_4_loaders"])
def test_producer_batches_equal_in_process_batches_bit_for_bit(tmp_path, distribution, buckets, loaders):
    """Also with ``data_loaders``: RETURNN's MultiProcDataset loading the sequences in 3 processes
    (one dataset), or in 2 for each replica's copy, gives today's batches."""
    from returnn_tpu.datapath.batching import BatchingOptions, BucketBatching
    from returnn_tpu.datapath.producer import DataProducer

    path, config, extern_data = _setup(tmp_path)
    batching = BucketBatching(config, buckets, "data") if buckets else BatchingOptions(config)
    shard = distribution == "shard"
    producer = DataProducer(path, [], dataset_key="train", num_replicas=2, first_replica=0, distribution=distribution,
                            prefetch=2, loaders=loaders)
    # The queue's semaphores are named (a spawned child opens them by name) until the producer
    # runs; then the names go, so that no SIGKILL can leave them in /dev/shm.
    names = [lock._semlock.name for lock in (producer._results._rlock, producer._results._wlock,
                                             producer._results._sem)]
    assert all(os.path.exists(f"/dev/shm/sem.{name.lstrip('/')}") for name in names), names
    try:
        for epoch in (1, 2):
            request = dict(epoch=epoch, batching=batching, data_keys=["classes", "data"], recurrent=True, train=True,
                           slots=range(2) if shard else None, num_slots=2 if shard else None, pad_last=False)
            expected = _in_process(config, extern_data, distribution, request)
            expected_counters = batching.take_counters()
            produced_epoch = producer.epoch(**request, templates=_templates(extern_data))
            assert not any(os.path.exists(f"/dev/shm/sem.{name.lstrip('/')}") for name in names)
            produced = list(produced_epoch.steps())
            assert len(expected) > 3
            assert len(produced) == len(expected)
            for (ours, our_weights), (theirs, their_weights) in zip(produced, expected):
                assert our_weights == their_weights and len(ours) == len(theirs) == 2
                for our_batch, their_batch in zip(ours, theirs):
                    assert sorted(our_batch) == sorted(their_batch)
                    for key, value in their_batch.items():
                        assert our_batch[key].dtype == value.dtype and our_batch[key].shape == value.shape, key
                        assert our_batch[key].tobytes() == value.tobytes(), key
            assert batching.take_counters() == expected_counters  # the producer's padding counts come back
            assert 1 <= len(_blocks_of(producer)) <= 2 + 2  # one ring (prefetch + 2), reused step after step
        with open(f"/proc/{producer.pid}/maps") as maps:  # its memory is the data's, not TensorFlow's
            assert "libtensorflow" not in maps.read()
        loader_pids = _spawned_children(producer.pid)
        assert len(loader_pids) == (loaders if loaders > 1 else 0), loader_pids
    finally:
        producer.close()
    assert not _blocks_of(producer)
    assert not _running(loader_pids, within=10)  # they end with the producer (killed by close)


def _spawned_children(pid: int) -> list:
    """The pids of the processes that process ``pid`` spawned with multiprocessing (Linux): a
    MultiProcDataset's loaders, not multiprocessing's resource tracker."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(child) for child in f.read().split()]
    return [child for child in children if b"spawn_main" in _cmdline(child)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _running(pids: list, within: float) -> list:
    """Those of ``pids`` still running after up to ``within`` seconds."""
    deadline = time.time() + within
    while True:
        running = [pid for pid in pids if os.path.exists(f"/proc/{pid}") and b"spawn_main" in _cmdline(pid)]
        if not running or time.time() > deadline:
            return running
        time.sleep(0.2)


@pytest.mark.parametrize("distribution", ["shard", "random_seed_offset"])
def test_data_loaders_give_one_producers_speech_batches_also_resumed(tmp_path, monkeypatch, speech_corpus_dir,
                                                                     distribution):
    """The speech benchmark's ``OggZipDataset`` (MFCCs from ``ExtractAudioFeatures``, ``laplace``
    order, 2 sub-epochs) read by 2 loader processes per dataset: the producer's batches are those
    made in this process without loaders, bit for bit, for a whole sub-epoch and for the next one
    continued at step 2 (a resume), which starts without the loaders being started again."""
    from returnn_tpu.datapath.batching import BatchingOptions
    from returnn_tpu.datapath.data import EpochBatches
    from returnn_tpu.datapath.datasets import init_datasets
    from returnn_tpu.returnn_side.network_inputs import extern_data_template
    from returnn_tpu.datapath.producer import DataProducer
    from returnn_tpu.startup import load_config

    monkeypatch.setenv("SPEECH_CORPUS", speech_corpus_dir)
    monkeypatch.setenv("SPEECH_PARTITION_EPOCH", "2")
    path = os.path.join(REPO, "benchmarks", "configs", "speech_ctc.config")
    overrides = ["++batch_size", "700", "++max_seqs", "2"]
    config = load_config(path, overrides)
    extern_data = extern_data_template(config)
    batching = BatchingOptions(config)
    shard = distribution == "shard"
    loaders = 2 * (1 if shard else 2)
    producer = DataProducer(path, overrides, dataset_key="train", num_replicas=2, first_replica=0,
                            distribution=distribution, prefetch=2, loaders=loaders)
    try:
        for epoch, first_step in ((1, 0), (2, 2)):
            request = dict(epoch=epoch, batching=batching, data_keys=["classes", "data"], recurrent=True, train=True,
                           slots=range(2) if shard else None, num_slots=2 if shard else None, pad_last=False)
            in_process = EpochBatches(init_datasets(config, "train", 2, 0, distribution), extern_data=extern_data,
                                      **request)
            in_process.start_at(first_step)
            expected = list(in_process)
            produced_epoch = producer.epoch(**request, templates=_templates(extern_data))
            produced_epoch.start_at(first_step)
            produced = list(produced_epoch.steps())
            assert len(expected) >= 1 and len(produced) == len(expected)
            for (ours, our_weights), (theirs, their_weights) in zip(produced, expected):
                assert our_weights == their_weights and len(ours) == len(theirs) == 2
                for our_batch, their_batch in zip(ours, theirs):
                    _assert_same_batches(our_batch, their_batch)
            if epoch == 1:
                loader_pids = _spawned_children(producer.pid)
                assert len(loader_pids) == loaders, loader_pids
        assert _spawned_children(producer.pid) == loader_pids
    finally:
        producer.close()
    assert not _running(loader_pids, within=10)


def _blocks_of(producer):
    """The shared memory blocks the producer made that are still there."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"returnn_tpu_{producer.pid}_")]


def test_a_killed_producer_ends_the_epoch_with_an_error_within_a_bound(tmp_path):
    from returnn_tpu.datapath.batching import BatchingOptions
    from returnn_tpu.datapath.producer import LIVENESS_SECONDS, DataProducer
    from returnn_tpu.datapath.producer_protocol import ProducerError

    path, config, extern_data = _setup(tmp_path, producer_config(400))
    producer = DataProducer(path, [], dataset_key="train", num_replicas=2, first_replica=0, distribution="shard",
                            prefetch=2)
    epoch = producer.epoch(epoch=1, batching=BatchingOptions(config), data_keys=["classes", "data"], recurrent=True,
                           templates=_templates(extern_data), train=True, slots=range(2), num_slots=2, pad_last=False)
    steps = epoch.steps()
    next(steps)
    time.sleep(1)  # the producer fills the queue
    os.kill(producer.pid, signal.SIGKILL)
    start = time.time()
    with pytest.raises(ProducerError, match=rf"data producer \(pid {producer.pid}\) died \(exit status -9\)"):
        for _ in steps:  # what the queue still held, then the error
            pass
    assert time.time() - start < 3 * LIVENESS_SECONDS + 2
    producer.close()
    assert not _blocks_of(producer)


def test_a_failing_producer_stops_training_with_its_error(tmp_path):
    """A dataset that raises in the producer (a config function of PostprocessingDataset):
    training stops with that error, exit status 1, and the epoch is not saved."""
    config = producer_config(map_seq=(
        '_calls = []\n'
        'def _map_seq(data, **_):\n'
        '    _calls.append(1)\n'
        '    if len(_calls) == 25:\n'
        '        raise ValueError("corrupt feature file for sequence 25")\n'
        '    return data\n'))
    (tmp_path / "train.config").write_text(config)
    result = run_cli(["train.config"], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("returnn-tpu: error:")]
    assert len(errors) == 1 and ("failed: train: RETURNN's PostprocessingDataset failed in epoch 1: ValueError: "
                                 "corrupt feature file for sequence 25") in errors[0], \
        result.stderr[-3000:]
    assert not os.path.exists(tmp_path / "out" / "model.001.index")


def test_a_failing_dev_dataset_stops_training_in_one_line(tmp_path):
    """A dev dataset that raises at its 9th sequence (a config-defined dataset class): one line
    naming the dataset, the epoch and the error, exit status 1, no traceback."""
    prelude = ('from returnn.datasets.generating import Task12AXDataset\n'
               'class _Corrupt(Task12AXDataset):\n'
               '    def generate_seq(self, seq_idx):\n'
               '        if seq_idx == 9:\n'
               '            raise ValueError("corrupt dev file at sequence 9")\n'
               '        return super().generate_seq(seq_idx)\n')
    config = config_12ax(prelude, dev=Code('{"class": _Corrupt, "num_seqs": 20, "fixed_random_seed": 1}'),
                         num_epochs=1, distribute_options={})
    (tmp_path / "train.config").write_text(config)
    result = run_cli(["train.config"], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("returnn-tpu: error:")]
    assert errors == ["returnn-tpu: error: dev: RETURNN's _Corrupt failed in epoch 1: ValueError: corrupt dev file at "
                      "sequence 9"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_a_killed_data_loader_stops_training_in_one_line_and_leaves_nothing(tmp_path):
    """``data_loaders = 2`` (RETURNN's MultiProcDataset in the producer): a loader process killed
    at its 10th sequence ends training with one line naming it (exit status 1, the epoch not
    saved), and no process or shared memory block of the run is left."""
    config = producer_config(num_seqs=400, map_seq=(
        'import multiprocessing, os, signal\n'
        '_calls = []\n'
        'def _map_seq(data, **_):\n'
        '    _calls.append(1)\n'
        '    if len(_calls) == 10 and "worker proc 2/2" in multiprocessing.current_process().name:\n'
        '        os.kill(os.getpid(), signal.SIGKILL)\n'
        '    return data\n'))
    (tmp_path / "train.config").write_text(config)
    result = run_cli(["train.config", "++distribute_options", "{'data_loaders': 2}"], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("returnn-tpu: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    named = re.search(r"data producer \(pid (\d+)\) failed: its data loader process \d+ \(train worker proc 2/2\) "
                      r"died \(exit status -9\)$", errors[0])
    assert named, errors
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not os.path.exists(tmp_path / "out" / "model.001.index")
    deadline = time.time() + 10
    while _processes_in(tmp_path) and time.time() < deadline:
        time.sleep(0.2)
    assert not _processes_in(tmp_path)  # the producer and the other loader (all started in tmp_path)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"{BLOCK_PREFIX}{named[1]}_")]


def _processes_in(folder) -> list:
    """The pids of the running processes whose working directory is ``folder``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(folder) and _cmdline(int(pid)):  # not a zombie
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_speech_trains_with_data_loaders_through_the_producer(tmp_path, speech_corpus_dir):
    """tests/configs' OggZipDataset config, as its MultiProcDataset (2 processes) and unwrapped, each
    trained by local SGD on 2 replicas through the producer with ``data_loaders = 2``: the
    unwrapped dataset gets 2 loaders (the log says so), the wrapped one is not wrapped again, and
    both train their sub-epoch with the same batches (the same steps and train score). The
    unwrapped one also trains on 2 local workers (``--local-workers 2``). No process is left."""
    from parity import CONFIGS

    config = (open(os.path.join(CONFIGS, "ogg_zip_multi_proc_ctc.config")).read())
    (tmp_path / "wrapped.config").write_text(config)
    (tmp_path / "unwrapped.config").write_text(config + '\ntrain = train["dataset"]  # OggZipDataset alone\n')
    scores = {}
    for name in ("wrapped", "unwrapped"):
        result = run_cli([f"{name}.config", "++model", f"{name}/model", "++learning_rate_file", f"{name}/lr",
                          "++log_verbosity", "4", "++distribute_strategy", "local_sgd", "++distribute_options",
                          "{'num_replicas': 2, 'param_sync_step': 2, 'data_loaders': 2}"], cwd=tmp_path,
                         env={"PARITY_SPEECH": speech_corpus_dir})
        assert result.returncode == 0, result.stderr[-3000:]
        noted = "the training sequences are loaded by 2 processes (distribute_options['data_loaders']" in result.stdout
        assert noted == (name == "unwrapped"), result.stdout[-3000:]
        assert os.path.exists(tmp_path / name / "model.001.index")
        scores[name] = {key: value for key, value in re.findall(r"'([^']+)': ([-0-9.e]+)", (tmp_path / name / "lr").read_text())
                        if not key.endswith("_time_secs")}
    assert any(key.startswith("train_score") for key in scores["wrapped"]) and scores["wrapped"] == scores["unwrapped"]
    # And on two local workers, a producer with 2 loaders each.
    result = run_cli(["--local-workers", "2", "unwrapped.config", "++model", "workers/model", "++distribute_strategy",
                      "local_sgd", "++distribute_options", "{'num_replicas': 1, 'param_sync_step': 2, 'data_loaders': 2, "
                      "'dataset_distribution': 'shard', 'startup_timeout': 120}"], cwd=tmp_path,
                     env={"PARITY_SPEECH": speech_corpus_dir})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert os.path.exists(tmp_path / "workers" / "model.001.index")
    assert not _processes_in(tmp_path)


def test_a_dataset_slower_than_training_is_named_in_the_log(tmp_path):
    """A ``PostprocessingDataset`` that takes 30 ms per sequence (1.2 s per epoch, more than the
    epoch's steps): ``metrics.jsonl`` has each epoch's wait for data and the producer's start of
    the epoch, and where an epoch waited, the log says after the computing-time line that the
    dataset is the limit."""
    config = producer_config(map_seq=(
        'import time\n'
        'def _map_seq(data, **_):\n'
        '    time.sleep(0.03)\n'
        '    return data\n'))
    (tmp_path / "train.config").write_text(config)
    result = run_cli(["train.config", "++log", "out/train.log"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # The trainer opened the producer's blocks, but did not leave its resource tracker to remove them.
    assert "resource_tracker" not in result.stderr, result.stderr[-3000:]
    from test_cli import read_metrics

    metrics = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert len(metrics) == 3 and all(0 <= m["data_start_seconds"] < 1 for m in metrics), metrics
    assert all(m["data_wait_seconds"] > 0.5 for m in metrics[1:]), metrics  # 40 sequences of 30 ms each
    log = (tmp_path / "out" / "train.log").read_text()
    assert re.search(r"train epoch 3: \d+\.\d s waiting for data, 0\.\d s in its steps: the dataset is slower "
                     r"than the training", log), log[-3000:]
    assert "train epoch 1: " not in log  # waiting for the producer to start, not for the dataset


def _assert_same_batches(ours, theirs):
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and ours[key].tobytes() == value.tobytes(), key


def test_worker_0s_producer_serves_another_worker_its_batches_over_tcp(tmp_path):
    """``data_producer = "chief"``: worker 0's producer makes both replicas' batches (one per
    worker), its sequences loaded by 2 loader processes (``data_loaders``), and sends worker 1
    its own over a TCP connection that must prove the key; each worker's part is that of the
    in-process batches, bit for bit. A client that connects and says nothing does not hold up the
    others' handshakes, a wrong key is refused, and worker 1 learns within a bound that the
    producer is gone."""
    import threading

    from returnn_tpu.datapath.batching import BatchingOptions
    from returnn_tpu.datapath.producer import DataProducer, RemoteProducer
    from returnn_tpu.datapath.producer_protocol import ProducerError
    from returnn_tpu.datapath.producer_serving import ServeOptions

    path, config, extern_data = _setup(tmp_path)
    key = os.urandom(16)
    producer = DataProducer(path, [], dataset_key="train", num_replicas=2, first_replica=0, distribution="shard",
                            prefetch=2, serve=ServeOptions("127.0.0.1", key, num_workers=2, replicas_per_worker=1),
                            loaders=2)
    try:
        port = producer.port()
        idle = socket.create_connection(("127.0.0.1", port))  # connects, then says nothing: must not hold up others
        with pytest.raises(ProducerError, match=f"cannot connect to worker 0's data producer at 127.0.0.1:{port}"):
            RemoteProducer(("127.0.0.1", port), os.urandom(16), worker_index=1)
        remote = RemoteProducer(("127.0.0.1", port), key, worker_index=1)
        request = dict(epoch=1, batching=BatchingOptions(config), data_keys=["classes", "data"], recurrent=True,
                       train=True, slots=range(2), num_slots=2, pad_last=False)
        expected = _in_process(config, extern_data, "shard", request)
        received = {}

        def worker_1():
            received["epoch"] = epoch = remote.epoch(**dict(request, batching=BatchingOptions(config)))
            received["steps"] = list(epoch.steps())

        thread = threading.Thread(target=worker_1)
        thread.start()
        own = list(producer.epoch(**request, templates=_templates(extern_data)).steps())
        thread.join(timeout=60)
        assert len(own) == len(received["steps"]) == len(expected) > 3
        for (chief, chief_weights), (other, other_weights), (both, weights) in zip(own, received["steps"], expected):
            assert chief_weights + other_weights == weights
            _assert_same_batches(chief[0], both[0])
            _assert_same_batches(other[0], both[1])
        assert len(_spawned_children(producer.pid)) == 2
        producer.close()
        start = time.time()
        with pytest.raises(ProducerError, match=r"worker 0's data producer \(127.0.0.1:\d+\) closed the connection"):
            remote.epoch(**request)
        assert time.time() - start < 5
        remote.close()
        idle.close()
    finally:
        producer.close()


def test_a_slow_dataset_streams_its_first_step_and_sigterm_saves_it(tmp_path):
    """A dataset of 1,000 sequences that takes 100 ms per sequence (100 s per epoch) through the
    default producer process: the first step comes after its batches (5 sequences per replica),
    not after the epoch; SIGTERM then ends the run within seconds, status 143, with the
    interrupted epoch saved."""
    import subprocess
    import sys

    from conftest import REPO

    config = producer_config(1000, map_seq=(
        'import time\n'
        'def _map_seq(data, **_):\n'
        '    time.sleep(0.1)\n'
        '    return data\n'))
    (tmp_path / "train.config").write_text(config)
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([sys.executable, "-m", "returnn_tpu.cli", "train.config", "++log_verbosity", "5"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = None
    for line in proc.stdout:
        if "start training at epoch 1" in line:
            started = time.time()
        if line.startswith("train epoch 1, step 1,"):
            break
    assert started and time.time() - started < 50, "the first steps waited for the epoch"
    proc.send_signal(signal.SIGTERM)
    start = time.time()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert time.time() - start < 10
    assert "the combined model is in" in stderr and "run the same command to continue epoch 1" in stderr, \
        stderr[-3000:]
    assert os.path.exists(tmp_path / "out" / "model.001.interrupted.index")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a full /dev/shm of its own needs root and unshare")
def test_a_full_dev_shm_is_one_line(tmp_path):
    """/dev/shm with no room (8 kB, full) for the producer's queue: one line naming it and what to
    do, not multiprocessing's traceback; status 2 (a restart on this machine cannot help), nothing
    written."""
    from conftest import REPO, config_12ax

    (tmp_path / "train.config").write_text(config_12ax())
    script = ("mount -t tmpfs -o size=8k tmpfs /dev/shm && dd if=/dev/zero of=/dev/shm/fill bs=1k count=8 2>/dev/null; "
              f"exec {sys.executable} -m returnn_tpu.cli train.config")
    result = subprocess.run(["unshare", "--mount", "sh", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("returnn-tpu: error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["train.config"]  # nothing written (the begun log removed)
    assert errors == ["returnn-tpu: error: cannot make the data producer's queue in /dev/shm (0 kB free there): No "
                      "space left on device; make /dev/shm larger (docker: --shm-size), or set "
                      "distribute_options['data_producer'] = 'thread'"], errors


def test_a_ring_block_is_reused_only_once_the_trainer_has_released_its_step():
    """The producer writes step n into the block of step n - ring only after the trainer has
    copied that one out; a step larger than its slot's block gets a new block, the old one
    unlinked; what the trainer copied stays as it was."""
    import multiprocessing
    import threading

    import numpy

    from returnn_tpu.datapath.producer_blocks import BlockReader, BlockWriter

    released = multiprocessing.get_context("spawn").RawValue("q", 0)
    writer, reader = BlockWriter(released, ring=2), BlockReader(released, ring=2)
    ours = f"{BLOCK_PREFIX}{os.getpid()}_"
    try:
        steps = [[{"data": numpy.full((2, frames), step, dtype="float32"), "n": step}]
                 for step, frames in enumerate([3, 3, 2, 50])]
        handed = [writer.put(steps[0]), writer.put(steps[1])]
        names = {name for name, _ in handed}
        assert len(names) == 2 and names == {n for n in os.listdir("/dev/shm") if n.startswith(ours)}
        third = threading.Thread(target=lambda: handed.append(writer.put(steps[2])))
        third.start()
        third.join(timeout=0.3)
        assert third.is_alive()  # step 0's block is not yet released
        taken = [reader.take(*handed[0])]
        third.join(timeout=5)
        assert not third.is_alive() and handed[2][0] == handed[0][0]  # step 0's block again
        taken += [reader.take(*handed[1]), reader.take(*handed[2])]
        handed.append(writer.put(steps[3]))  # 50 frames: step 1's block is too small
        assert handed[3][0] not in names and handed[1][0] not in os.listdir("/dev/shm")
        taken.append(reader.take(*handed[3]))
        for step, batches in zip(steps, taken):
            assert batches[0]["n"] == step[0]["n"]
            numpy.testing.assert_array_equal(batches[0]["data"], step[0]["data"])
    finally:
        reader.close()
        for name in os.listdir("/dev/shm"):
            if name.startswith(ours):
                os.remove(f"/dev/shm/{name}")


def test_blocks_of_a_gone_producer_are_removed_with_one_line_to_the_current_stderr(capsys):
    """A trainer killed by SIGKILL leaves its producer's blocks in /dev/shm; the next start removes
    them and says so on the stderr of that moment (a redirected or captured one, not the one of
    import time, which may be closed by then)."""
    dead_pid = 2 ** 22 + 17  # above Linux's pid_max default: no process has it
    stale = f"/dev/shm/{BLOCK_PREFIX}{dead_pid}_0"
    live = f"/dev/shm/{BLOCK_PREFIX}{os.getpid()}_0"
    for path in (stale, live):
        with open(path, "wb") as block:
            block.write(b"\0" * 16)
    try:
        remove_stale_blocks()
        assert not os.path.exists(stale)
        assert os.path.exists(live)  # this process's own block is not touched
        assert re.search(r"removed \d+ shared memory blocks", capsys.readouterr().err)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.remove(path)


_REPORT_BLAS_THREADS = """
import multiprocessing, numpy
from threadpoolctl import threadpool_info
from returnn_tpu.datapath.producer_process import one_math_thread

def threads(_=None):
    return max(pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas")

if __name__ == "__main__":
    one_math_thread()
    with multiprocessing.get_context("spawn").Pool(1) as loader:  # as MultiProcDataset starts its loaders
        print(threads(), loader.apply(threads))
"""


@pytest.mark.parametrize("user_setting", [None, "2"])
def test_the_producer_and_its_loaders_compute_with_one_blas_thread_unless_the_user_said(tmp_path, user_setting):
    """FACTS.md, "BLAS threads in data processes": the producer and the loaders it spawns later
    have one BLAS thread each (numpy is loaded in the producer before it runs); a user's
    ``OPENBLAS_NUM_THREADS`` is kept."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    if user_setting:
        env["OPENBLAS_NUM_THREADS"] = user_setting
    (tmp_path / "report.py").write_text(_REPORT_BLAS_THREADS)
    result = subprocess.run([sys.executable, "report.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=dict(env, PYTHONPATH=REPO))
    assert result.returncode == 0, result.stderr
    expected = user_setting or "1"
    assert result.stdout.split() == [expected, expected], result.stdout
