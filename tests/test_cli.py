"""The command as a user runs it: the demo, kill and resume, and bad input."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy
import pytest

from conftest import REPO, Code, config_12ax, run_cli

DEMO = os.path.join(REPO, "demos", "demo-local-sgd.12ax.config")



def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_demo_trains_and_dev_score_improves(tmp_path):
    """The bundled demo, for 3 of its 5 epochs (the test's time)."""
    result = run_cli([DEMO, "++model", str(tmp_path / "model"), "++learning_rate_file", str(tmp_path / "lr"),
                      "++log", str(tmp_path / "train.log"), "++num_epochs", "3"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["epoch"] for m in metrics] == [1, 2, 3]
    assert metrics[-1]["dev_score"] < metrics[0]["dev_score"]
    assert all(m["strategy"] == "local_sgd" and m["num_replicas"] == 4 and m["syncs"] >= 1 for m in metrics)
    for epoch in range(1, 4):
        assert os.path.exists(tmp_path / f"model.{epoch:03d}.index")
    # Each sync: every one of the 4 replicas hands all its float32 parameters to the all-reduce.
    from returnn_tpu import checkpoints

    saved = checkpoints.load(str(tmp_path / "model.003"))
    num_params = sum(v.size for k, v in saved.items() if "/" in k and not k.endswith(("/Adam", "/Adam_1"))
                     and not k.startswith("optimize/"))
    assert all(m["sync_bytes"] == m["syncs"] * 4 * 4 * num_params for m in metrics), (num_params, metrics[0])
    assert metrics[0]["distribute_options"]["param_sync_step"] == 10
    assert all(0.5 < m["computing_time_share"] <= 1 and m["data_wait_seconds"] >= 0
               and m["data_start_seconds"] >= 0 and m["agreements"] == m["agree_bytes"] == 0 for m in metrics), metrics
    with open(tmp_path / "train.log") as f:
        log = f.read()
    assert "epoch 3 score:" in log and "dev: score" in log
    assert re.search(r"train epoch 3, finished after \d+ steps, 0:00:\d\d elapsed \(\d+\.\d% computing time\)", log)
    assert "ignoring tf_session_opts['gpu_options']['per_process_gpu_memory_fraction']" in log
    # The start says what runs and what an epoch is; RETURNN's layer templates come once, as in plain
    # RETURNN (not once per replica and trace); the end says where everything is.
    assert "returnn-tpu: distribute_options in force: {'num_replicas': 4, 'param_sync_step': 10," in log
    assert "an epoch is 4 passes over the training data" in log and "'shard' makes an epoch one pass" in log
    assert log.count("layer /'output':") == 1, log.count("layer /'output':")
    assert f"returnn-tpu: finished training at epoch 3: model {tmp_path / 'model.003'}" in result.stdout
    updates, syncs = sum(m["steps"] for m in metrics), sum(m["syncs"] for m in metrics)
    sent = sum(m["sync_bytes"] for m in metrics) / 1e6
    assert f"this process: {updates} updates, {syncs} syncs, {sent:.3f} MB sent" in result.stdout, result.stdout[-500:]
    # TensorBoard, as RETURNN writes it beside the model: train-<time>/ and dev-<epoch>-<time>/.
    assert tensorboard_tags(tmp_path, "train-*") == {"loss_output", "error_output", "learning_rate", "sync_seconds"}
    assert tensorboard_tags(tmp_path, "dev-3-*") == {"loss_output", "error_output"}


def tensorboard_tags(folder, pattern):
    import glob

    from tensorflow.python.summary.summary_iterator import summary_iterator

    files = glob.glob(os.path.join(str(folder), pattern, "events.*"))
    assert files, f"no TensorBoard events in {folder}/{pattern}"
    return {value.tag for path in files for event in summary_iterator(path) for value in event.summary.value}


@pytest.mark.slow
def test_killed_run_resumes_from_last_checkpoint(tmp_path):
    (tmp_path / "train.config").write_text(config_12ax())
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([sys.executable, "-m", "returnn_tpu.cli", "train.config", "++num_epochs", "100"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not os.path.exists(tmp_path / "out" / "model.002.index"):
        assert proc.poll() is None, "training ended before the second checkpoint"
        assert time.time() < deadline, "no second checkpoint within 300 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = [m["epoch"] for m in read_metrics(tmp_path / "out" / "metrics.jsonl")]
    last = max(e for e in range(1, 100) if os.path.exists(tmp_path / "out" / f"model.{e:03d}.index"))
    assert last >= 2
    result = run_cli(["train.config", "++num_epochs", str(last + 1)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"start training at epoch {last + 1}" in result.stdout
    resumed = [m["epoch"] for m in read_metrics(tmp_path / "out" / "metrics.jsonl")]
    assert resumed == done + [last + 1]  # nothing trained twice, nothing skipped
    assert os.path.exists(tmp_path / "out" / f"model.{last + 1:03d}.index")
    assert not [f for f in os.listdir(tmp_path / "out") if ".tmp-" in f]


@pytest.mark.slow
def test_sigterm_saves_the_epoch_in_progress_and_resume_continues_it(tmp_path):
    """SIGTERM mid-epoch: a checkpoint of the combined model at the next step boundary, exit 143,
    and beside it where the data stood; running the command again continues that epoch at that
    step, its data from there (no sequence before it made), and ends where an uninterrupted run
    ends (``mirrored``: no sync at the stop that an uninterrupted run would not make)."""
    from returnn_tpu import checkpoints

    config = config_12ax(train={"class": "Task12AXDataset", "num_seqs": 250}, distribute_strategy="mirrored",
                         distribute_options={"num_replicas": 2}, num_epochs=1)
    for run in ("stopped", "uninterrupted"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "train.config").write_text(config)
    stopped = tmp_path / "stopped"
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([sys.executable, "-m", "returnn_tpu.cli", "train.config", "++log_verbosity", "5"],
                            cwd=stopped, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # RETURNN's progress lines: "train epoch 1, step 9, ..."
        if line.startswith("train epoch 1, step 9,"):
            break
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    prefix = str(stopped / "out" / "model.001.interrupted")
    assert "the combined model is in out/model.001.interrupted" in stderr.splitlines()[-1], stderr[-3000:]
    assert not os.path.exists(stopped / "out" / "model.001.index")
    assert not os.path.exists(stopped / "out" / "model.interrupted.lock")  # the writers' lock is gone
    found = checkpoints.interrupted(str(stopped / "out" / "model"), 1)
    assert found.epoch == 1 and found.steps_done > 0, found
    assert all(numpy.isfinite(v).all() for v in checkpoints.load(prefix).values())
    streams = checkpoints.read_stream_points(prefix, 1, found.steps_done)  # each replica's own walk through the data
    assert sorted(streams) == ["0", "1"] and all(streams[r][0] == found.steps_done for r in streams), streams
    resumed = run_cli(["train.config"], cwd=stopped)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"start training at epoch 1, step {found.steps_done + 1} (interrupted there)" in resumed.stdout
    assert (f"epoch 1 continues its data where it stood after step {found.steps_done} (no sequence before it is "
            "made)") in resumed.stdout, resumed.stdout[-3000:]
    assert not [f for f in os.listdir(stopped / "out") if ".interrupted" in f]  # epoch 1's checkpoint replaced it
    uninterrupted = run_cli(["train.config"], cwd=tmp_path / "uninterrupted")
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    ours = checkpoints.load(str(stopped / "out" / "model.001"))
    theirs = checkpoints.load(str(tmp_path / "uninterrupted" / "out" / "model.001"))
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        numpy.testing.assert_allclose(ours[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_sigint_and_sighup_save_the_epoch_and_exit_128_plus_n(tmp_path, signum):
    """docs/faults.md's exit statuses for the other stop signals: 130 for SIGINT, 129 for SIGHUP,
    the epoch in progress saved as the interrupted checkpoint, as for SIGTERM."""
    from returnn_tpu import checkpoints

    (tmp_path / "train.config").write_text(config_12ax(train={"class": "Task12AXDataset", "num_seqs": 250},
                                                       num_epochs=1))
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([sys.executable, "-m", "returnn_tpu.cli", "train.config", "++log_verbosity", "5"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("train epoch 1, step 5,"):
            break
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr[-3000:]
    assert "the combined model is in out/model.001.interrupted" in stderr.splitlines()[-1], stderr[-3000:]
    assert checkpoints.interrupted(str(tmp_path / "out" / "model"), 1).steps_done > 0


BAD_INPUT = [
    ('distribute_strategy = "allreduce"', "distribute_strategy"),
    ('distribute_options = {"num_replicas": 2, "sync_every": 3}', "sync_every"),
    ('distribute_options = {"param_sync_step": 0}', "param_sync_step"),
    ('distribute_options = {"param_sync_step": -1}', "param_sync_step"),
    ('distribute_options = {"param_sync_step": "5"}', "param_sync_step"),
    ('distribute_options = {"num_replicas": 0}', "num_replicas"),
    ('extern_data = {"data": {"dim_tags": ["T"]}}', "extern_data['data']['dim_tags'] must be a list of Dim objects"),
]


@pytest.mark.parametrize("line,option", BAD_INPUT, ids=[b[0].split("=", 1)[1].strip() for b in BAD_INPUT])
def test_bad_input_is_a_one_line_error(tmp_path, line, option):
    (tmp_path / "train.config").write_text(config_12ax() + line + "\nlog = 'out/train.log'\n")
    result = run_cli(["train.config"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [l for l in result.stderr.splitlines() if l.startswith("returnn-tpu: error:")]
    assert len(lines) == 1 and option in lines[0], result.stderr[-2000:]
    assert result.stderr.splitlines()[0] == lines[0]  # found before TensorFlow starts: no banner before it
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == ["train.config"]


LATE_BAD_INPUT = [  # found once TensorFlow or the datasets are up: still status 2, one line, nothing left behind
    ("num_inputs = 7", {}, "train: key 'data' dim mismatch: the network's extern_data['data'] (num_inputs/num_outputs) "
     "has dim 7"),
    ('distribute_options = {"cluster_resolver": "mpi"}', {"MPI4PY_LIBMPI": "/nonexistent/libmpi.so"},
     "mpi4py cannot load an MPI library (cannot load MPI library /nonexistent/libmpi.so"),
    # Found by the data producer process (the default path), reported as the trainer's own.
    ('train = {"class": "Task12AXDataset", "num_seqs": 0}', {},
     "train: RETURNN's Task12AXDataset refuses its options at epoch 1: assert num_seqs > 0"),
    # Found before the first step, not after epoch 1; a missing file; a typo in a "from".
    ('dev = {"class": "Task12AXDataset", "num_seqs": 0}', {},
     "dev: RETURNN's Task12AXDataset refuses its options at epoch 1: assert num_seqs > 0"),
    ('dev = {"class": "HDFDataset", "files": ["no-such.hdf"]}', {}, "dev: RETURNN's HDFDataset cannot read its files"),
    ('network["output"]["from"] = "fw1"', {}, "network: layer 'fw1' not found"),
    ('learning_rate_file = "garbage.txt"\nopen("garbage.txt", "w").write("{1: x y z}")', {},
     "learning_rate_file 'garbage.txt' is not a RETURNN learning-rate file"),
    # Whatever RETURNN raises while it builds the network's inputs, the network or a dataset.
    ('extern_data = {"data": {"dim": "9"}, "classes": {"dim": 2, "sparse": True}}', {},
     "extern_data: RETURNN cannot build the network's inputs from the config: TypeError: unexpected dimension type"),
    ('class MyLayer:\n    pass\nnetwork["output"]["class"] = MyLayer', {},
     "network: RETURNN cannot build the network from the config: Exception: unknown layer class"),
    ('dev = {"class": "PostprocessingDataset", "dataset": {"class": "Task12AXDataset", "num_seqs": 10},\n'
     '       "map_seq": lambda x, **_: x}\nbatching = "random"', {},
     "dev: RETURNN cannot build its PostprocessingDataset from the config: ValueError: "),
    # An order RETURNN does not know, given as the config's batching, found by the producer.
    ('batching = "bogus"', {}, "invalid seq_ordering 'bogus' (the dataset's seq_ordering, or the config's batching "
     "where the dataset sets none; valid: default,"),
    # A time limit that start-up uses up: each resubmission would stop before its first step again.
    ('distribute_options = {"time_limit": 10, "stop_before_time_limit": 9.5}', {},
     "distribute_options['time_limit']: the run reached its stop before the time limit (10 s minus "
     "stop_before_time_limit 9.5 s) after"),
]


@pytest.mark.parametrize("line,env,message", LATE_BAD_INPUT,
                         ids=["num_inputs", "no_mpi_library", "no_train_seqs", "no_dev_seqs", "no_hdf_file",
                              "missing_layer", "garbage_lr_file", "dim_string", "layer_class_object",
                              "postprocessing_dev", "batching_bogus", "time_limit_used_by_start_up"])
def test_bad_input_found_after_tensorflow_starts(tmp_path, line, env, message):
    config = config_12ax(num_inputs=None) if line.startswith("num_inputs") else config_12ax()
    (tmp_path / "train.config").write_text(config + line + "\nlog = 'out/train.log'\n")
    result = run_cli(["train.config"], cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [l for l in result.stderr.splitlines() if l.startswith("returnn-tpu: error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(["train.config"] + (["garbage.txt"] if "garbage" in line else []))
    # (the log it had begun is removed)


def test_a_resumed_run_says_what_it_changes(tmp_path):
    """Resumed with another number of replicas and another sync_dtype than the newest epoch was
    trained with: a line for each."""
    (tmp_path / "train.config").write_text(config_12ax(num_epochs=2))
    first = run_cli(["train.config", "++num_epochs", "1", "++distribute_options", "{'num_replicas': 2}"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_cli(["train.config", "++distribute_options", "{'num_replicas': 1, 'sync_dtype': 'bfloat16'}"],
                    cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "returnn-tpu: resuming with num_replicas 1; epoch 1 was trained with 2" in again.stdout
    assert "returnn-tpu: resuming with distribute_options['sync_dtype'] = 'bfloat16'; epoch 1 was trained with " \
           "'float32'" in again.stdout, again.stdout[-3000:]


CONFIG_DEFINED_OBJECTS = """
from returnn.datasets.generating import Task12AXDataset
import tensorflow as tf

class MyTask(Task12AXDataset):
    \"\"\"A dataset class of the config's own.\"\"\"

def dev_options():
    return {"class": MyTask, "num_seqs": 10, "fixed_random_seed": 1}
"""


def test_objects_defined_in_the_config_are_accepted_as_returnn_accepts_them(tmp_path):
    """What RETURNN's own code accepts beside names (a Dataset subclass as a dataset's class, a
    function that returns a dataset's options, an optimizer class of TensorFlow's or a function
    that returns an optimizer's name) trains here too, through the default producer path."""
    for optimizer in ("tf.compat.v1.train.AdamOptimizer", "lambda: 'adam'"):
        work = tmp_path / optimizer[:6]
        work.mkdir()
        config = config_12ax(CONFIG_DEFINED_OBJECTS, train=Code('{"class": MyTask, "num_seqs": 20}'),
                             dev=Code("dev_options"), optimizer=Code(f'{{"class": {optimizer}}}'), num_epochs=1)
        (work / "train.config").write_text(config)
        result = run_cli(["train.config"], cwd=work)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "dev: score" in result.stdout, result.stdout[-2000:]


@pytest.mark.slow
def test_other_tasks_run_plain_returnn_on_our_checkpoint(tmp_path):
    """``++task eval`` is handed to plain RETURNN, which loads the checkpoint returnn-tpu wrote."""
    (tmp_path / "train.config").write_text(config_12ax())
    assert run_cli(["train.config", "++num_epochs", "1"], cwd=tmp_path).returncode == 0
    result = run_cli(["train.config", "++task", "eval", "++load_epoch", "1"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RETURNN starting up" in result.stdout and "Evaluate epoch 1" in result.stdout
    assert "returnn-tpu: strategy" not in result.stdout  # our trainer did not run
    assert "dev: score" in result.stdout


@pytest.mark.slow
def test_check_runs_every_strategy_this_machine_allows(tmp_path):
    """``returnn-tpu --check``: the device list and one passing row per strategy (no TPU here)."""
    result = run_cli(["--check"], cwd=tmp_path, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = {line.split("  ")[0]: line for line in result.stdout.splitlines() if line.endswith("pass")}
    assert set(table) == {"single", "single + XLA", "mirrored", "mirrored + XLA", "local_sgd", "local_sgd + XLA",
                          "local_sgd_tpu program, local devices", "two local workers (--local-workers 2)"}, \
        result.stdout
    assert "no TPU found" in result.stdout and "8 of 8 passed" in result.stdout


def test_help_and_version(capsys):
    """``--help`` lists the flags, ``++key value`` and the environment variables; ``--version``
    names this package and what it runs on (both exit 0, as argparse's do)."""
    from returnn_tpu import cli

    for flag in ("--help", "--version"):
        with pytest.raises(SystemExit) as exited:
            cli.main([flag])
        assert exited.value.code == 0
    out = capsys.readouterr().out
    for text in ("--local-workers N", "--max-restarts K", "--check", "++key value", "TF_CONFIG",
                 "RETURNN_TPU_SHARE_NETWORK", "exit status"):
        assert text in out, text
    assert re.search(r"^returnn-tpu \d+\.\d+\.\d+ \(returnn [\d.]+, tensorflow", out, re.M), out


def test_distribute_options_given_on_the_command_line(tmp_path):
    """``++distribute_options "{...}"`` for a config that does not set it is the dict it says (RETURNN
    keeps such values as text); text that is no dict is bad input naming the option."""
    from returnn_tpu.cli import distribute_options_from_config
    from returnn_tpu.errors import ConfigError
    from returnn_tpu.startup import load_config

    (tmp_path / "train.config").write_text(config_12ax(distribute_options=None))
    config = load_config(str(tmp_path / "train.config"),
                         ["++distribute_options", "{'num_replicas': 3, 'data_producer': 'thread'}"])
    options = distribute_options_from_config(config)
    assert options.num_replicas == 3 and options.data_producer == "thread"
    config = load_config(str(tmp_path / "train.config"), ["++distribute_options", "num_replicas=3"])
    with pytest.raises(ConfigError, match=r"^\+\+distribute_options must be a Python dict"):
        distribute_options_from_config(config)


@pytest.mark.slow
def test_time_limit_stops_with_a_checkpoint_and_the_resubmission_status(tmp_path):
    """``time_limit`` 40 s, ``stop_before_time_limit`` 15 s: the run stops at a step boundary 25 s
    after its start with an interrupted checkpoint and exit status 75; the same command (a job
    script's loop) continues there."""
    import re

    from returnn_tpu.errors import RESUMABLE_STATUS

    (tmp_path / "train.config").write_text(config_12ax(
        train={"class": "Task12AXDataset", "num_seqs": 250}, num_epochs=50, distribute_strategy="mirrored",
        distribute_options={"num_replicas": 2, "time_limit": 40, "stop_before_time_limit": 15}))
    first = run_cli(["train.config"], cwd=tmp_path)
    assert first.returncode == RESUMABLE_STATUS, first.stderr[-3000:]
    stop = re.search(r"returnn-tpu: stopped before the time limit \(distribute_options\['time_limit'\]\) in epoch "
                     r"(\d+) before step (\d+); the combined model is in out/model\.\d+\.interrupted", first.stderr)
    assert stop, first.stderr[-3000:]
    again = run_cli(["train.config"], cwd=tmp_path)
    assert again.returncode == RESUMABLE_STATUS, again.stderr[-3000:]
    assert f"start training at epoch {stop.group(1)}, step {stop.group(2)} (interrupted there)" in again.stdout
