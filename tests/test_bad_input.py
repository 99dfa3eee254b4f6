"""Bad input: one line naming the option and what is valid, exit status 2, nothing written.

Most rows run the command's entry point in this process (fast); the config is the tests' 12AX
one (conftest.config_12ax) plus one line, or the command line changed, or the environment.
"""

import json
import os
import socket

import pytest

from conftest import config_12ax

FILE = "a file, not a folder"

# (what is added to the config, extra command-line arguments (``++key value`` after the config,
# ``--flag value`` before it), environment, text the error must contain)
ROWS = [
    ('distribute_strategy = "allreduce"', [], {}, "distribute_strategy must be one of"),
    ('distribute_options = {"sync_every": 3}', [], {}, "unknown key 'sync_every'"),
    ('distribute_options = {"param_sync_step": 0}', [], {}, "param_sync_step'] must be an int >= 1"),
    ('distribute_options = {"param_sync_step": -1}', [], {}, "param_sync_step'] must be an int >= 1"),
    ('distribute_options = {"param_sync_step": "5"}', [], {}, "param_sync_step'] must be an int >= 1"),
    ('distribute_options = {"sync_warmup_steps": 0}', [], {}, "sync_warmup_steps'] must be an int >= 1"),
    ('distribute_options = {"param_sync_step": 8, "param_sync_step_ramp": 100, "sync_delay": 2}', [], {},
     "param_sync_step_ramp'] starts with a sync after every update"),
    ('distribute_options = {"num_replicas": 0}', [], {}, "num_replicas'] must be an int >= 1"),
    ('distribute_options = {"param_sync_step": 4, "param_sync_time_diff": 10}', [], {}, "not both"),
    ('distribute_options = {"param_sync_time_diff": -2}', [], {}, "param_sync_time_diff'] must be a number"),
    ('distribute_options = {"startup_timeout": 0}', [], {}, "startup_timeout'] must be a number"),
    ('distribute_options = {"cluster_resolver": "slurm"}', [], {}, "cluster_resolver'] must be one of"),
    ('distribute_options = {"cluster_resolver": "tpu"}', [], {}, "cluster_resolver'] must be one of"),
    ('distribute_options = {"dataset_distribution": "split"}', [], {}, "dataset_distribution'] must be one of"),
    ('distribute_options = {"jit_compile": "yes"}', [], {}, "jit_compile'] must be True or False"),
    ('distribute_options = {"bucket_boundaries": [0, 10]}', [], {}, "bucket_boundaries'] must be a list"),
    ('distribute_options = {"outer_optimizer": {"class": "adam"}}', [], {}, "outer_optimizer'] must be None or"),
    ('distribute_options = {"sync_dtype": "uint8"}', [], {}, "sync_dtype'] must be one of"),
    ('distribute_options = {"param_sync_step": 8, "sync_delay": 8}', [], {}, "['sync_delay'] must be less than"),
    ('distribute_options = {"skip_nonfinite_steps": 1}', [], {}, "skip_nonfinite_steps'] must be True or False"),
    ('distribute_options = {"num_replicas": 10**6}', [], {}, "['num_replicas'] is 1000000, but this machine has no GPUs"),
    ('distribute_options = {"data_loaders": 0}', [], {}, "['data_loaders'] must be an int >= 1, got 0"),
    ('distribute_options = {"data_loaders": 10**6}', [], {}, "['data_loaders'] is 1000000, more than 4 per core"),
    ('distribute_options = {"time_limit": "4h"}', [], {}, "['time_limit'] must be seconds > 0 or 'H:MM:SS'"),
    ('distribute_options = {"time_limit": "1:61:00"}', [], {}, "(minutes and seconds below 60), got '1:61:00'"),
    ('distribute_options = {"stop_before_time_limit": 60}', [], {}, "['stop_before_time_limit'] needs 'time_limit'"),
    ('distribute_options = {"outer_optimizer": {"class": "nesterov", "learning_rate": -1}}', [], {},
     "['outer_optimizer']['learning_rate'] must be a number > 0, got -1"),
    ('distribute_options = {"time_limit": "0:05:00", "stop_before_time_limit": 600}', [], {},
     "['stop_before_time_limit'] (600 s) must be less than 'time_limit' (300 s)"),
    ('distribute_strategy = "mirrored"\ndistribute_options = {"param_sync_step": 3}', [], {},
     "is an option of local SGD"),
    ('distribute_strategy = "single"\ndistribute_options = {"num_replicas": 2}', [], {}, "must be 1 with"),
    ("distribute_options = [1]", [], {}, "distribute_options must be a dict"),
    ("save_interval = 0", [], {}, "save_interval must be an int >= 1"),
    ("num_epochs = 0", [], {}, "num_epochs must be an int >= 1"),
    ("num_epochs = -3", [], {}, "num_epochs must be an int >= 1"),
    ("", ["++num_epochs", "abc"], {}, "++num_epochs abc: not a Python value"),
    ("", ["++learning_rate", "1e"], {}, "learning_rate must be a number > 0, got '1e'"),
    ("", ["++num_epochs"], {}, "give ++key value pairs"),
    ("", ["++num_epoch", "3"], {}, "++num_epoch: no such option (the config does not name it and RETURNN does not "
                                   "read it); did you mean ++num_epochs?"),
    ("", ["++num_epochs", "'x'"], {}, "num_epochs must be an int >= 1, got 'x'"),
    ('learning_rate = "fast"', [], {}, "learning_rate must be a number"),
    ("learning_rate = -0.1", [], {}, "learning_rate must be a number > 0"),
    ("learning_rate = 0", [], {}, "learning_rate must be a number > 0"),
    ("batch_size = 0", [], {}, "batch_size must be an int >= 1"),
    ("max_seqs = 0", [], {}, "max_seqs must be an int >= 1"),
    ("log_verbosity = 'loud'", [], {}, "log_verbosity must be an int"),
    ("accum_grad_multiple_step = 'two'", [], {},
     "accum_grad_multiple_step must be an int >= 0 (0 and 1: an update after every batch"),
    ("accum_grad_multiple_step = -1", [], {}, "accum_grad_multiple_step must be an int >= 0"),
    ('train = {"class": "Task12AXDatasett", "num_seqs": 40}', [], {}, "train: unknown dataset class 'Task12AXDatasett'"),
    ('dev = {"class": "HDFDatset", "files": []}', [], {}, "dev: unknown dataset class 'HDFDatset'"),
    ("del train", [], {}, "'train' (the training dataset) is missing"),
    ("del model", [], {}, "'model' (where checkpoints go) is missing"),
    (f'model = "{FILE}/model"', [], {}, "model: cannot write to"),
    (f'log = "{FILE}/sub/train.log"', [], {}, "log: cannot write to"),
    ('network["output"]["class"] = "softmaxx"', [], {}, "network['output']: unknown layer class 'softmaxx'"),
    ('network["fw0"]["class"] = "recc"', [], {}, "network['fw0']: unknown layer class 'recc'"),
    ('network["output"].pop("loss")', [], {}, "network has no layer with a 'loss'"),
    ('optimizer = {"class": "adagradd"}', [], {}, "optimizer class 'adagradd' is not supported"),
    ('optimizer = {"class": "adam", "beta_1": 0.9}', [], {}, "got unsupported options ['beta_1']"),
    ('class MyOptimizer:\n    pass\noptimizer = {"class": MyOptimizer}', [], {},
     "optimizer class MyOptimizer: returnn-tpu runs its own optimizers in each replica; use one of"),
    ('train = {"class": dict, "num_seqs": 40}', [], {}, "train: dataset class dict is not a subclass of RETURNN's Dataset"),
    ("use_horovod = True", [], {}, "'use_horovod' (Horovod (use distribute_strategy instead)) is not supported"),
    ("search_train_network_layers = ['output']", [], {},
     "config option 'search_train_network_layers' (training through search) is not supported by returnn-tpu yet"),
    ('backend = "torch"', [], {}, "backend 'torch' is not supported"),
    ('task = "train"\nif True:\nx = 1', [], {}, "Python syntax error in line"),
    ('raise RuntimeError("corpus not mounted")', [], {}, "raised RuntimeError: corpus not mounted (line"),
    ('extern_data = {"data": {"dim_tags": ["T"]}}', [], {}, "must be a list of Dim objects"),
    ("", [], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                       "task": {"type": "worker", "index": 5}})}, "TF_CONFIG task index must be"),
    ("", [], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]},
                                       "task": {"type": "ps", "index": 0}})}, "TF_CONFIG task type must be"),
    ("", [], {"TF_CONFIG": "{not json"}, "TF_CONFIG is not valid JSON"),
    # A worker of returnn-tpu's launcher (RETURNN_TPU_LAUNCHED_WORKER): it does not wait the 30 s a
    # worker started by hand waits for a peer to tell of the refusal (test_multi_worker.py tests that).
    ("", [], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                       "task": {"type": "worker", "index": 1}}),
              "RETURNN_TPU_LAUNCHED_WORKER": "1", "NUM_REPLICAS_LINE": "1"},
     "num_replicas'] must be 1 (or left out) with several CPU workers"),
    # Paths that os.access calls writable for root, and others that only trying shows.
    ('model = "/proc/no/such/model"', [], {}, "model: cannot write to '/proc/no/such' (creating a file in '/proc'"),
    ('log = "/proc/no/train.log"', [], {}, "log: cannot write to '/proc/no'"),
    ('model = "out/model/"', [], {}, "model must be a file name prefix for the checkpoints"),
    (f'model = "{"m" * 300}/model"', [], {}, "is longer than the 255 bytes the file system allows"),
    (f'model = "{"/".join(["m" * 200] * 25)}/model"', [], {}, "leaves no room for file names in the 4096 bytes"),
    ('chunking = "abc"', [], {}, "chunking must be 'size:step' (e.g. '100:50'), a size"),
    ('optimizer = {"class": "adam", "epsilon": "x"}', [], {}, "optimizer['epsilon'] must be a number, got 'x'"),
    ('gradient_clip = "x"', [], {}, "gradient_clip must be a number, got 'x'"),
    ('model = "dangling/model"', [], {}, "('{tmp}/dangling' is a symlink to nothing)"),
    ('learning_rate_file = "."', [], {}, "learning_rate_file must be a file"),
    ('learning_rate_file = "/proc/lr"', [], {}, "learning_rate_file: cannot write to '/proc'"),
    # Values of the wrong type that RETURNN's code would fail on later.
    ("num_epochs = 1.0", [], {}, "num_epochs must be an int >= 1, got 1.0"),
    ('batch_size = "5000"', [], {}, "batch_size must be an int >= 1, got '5000'"),
    ('learning_rate = float("inf")', [], {}, "learning_rate must be a number > 0, got inf"),
    ("", ["++learning_rate", "1e400"], {}, "learning_rate must be a number > 0, got inf"),
    ("", ["--max-restarts", "1"], {}, "--max-restarts needs --local-workers"),
    ("", ["--local-workers", "0"], {}, "--local-workers needs a number >= 1, got 0"),
    ("", ["--local-workers", "x"], {}, "argument --local-workers: invalid int value: 'x'"),
    ("", [], {"TF_CONFIG": "BUSY_PORT"}, "is in use by another process"),
    ("", [], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:70000", "127.0.0.1:2"]},
                                       "task": {"type": "worker", "index": 0}})}, "a port in 1..65535"),
    ("", [], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1", "127.0.0.1:2"]},
                                       "task": {"type": "worker", "index": 0}})}, "must be host:port"),
    ("", [], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:5", "127.0.0.1:5"]},
                                       "task": {"type": "worker", "index": 0}})}, "the same address as worker 0"),
    ("", [], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:5", "no-such-host.invalid:6"]},
                                       "task": {"type": "worker", "index": 0}})},
     "worker 1 ('no-such-host.invalid:6'): the host 'no-such-host.invalid' does not resolve"),
    ("", [], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["no-such-host.invalid:5", "127.0.0.1:6"]},
                                       "task": {"type": "worker", "index": 0}})},
     "this task's own host 'no-such-host.invalid' does not resolve"),
]


@pytest.mark.parametrize("line,args,env,message", ROWS, ids=[f"{i:02d}" for i in range(len(ROWS))])
def test_bad_input(tmp_path, monkeypatch, capsys, line, args, env, message):
    from returnn_tpu import cli

    assert len(ROWS) >= 40
    config = config_12ax(distribute_options=None)
    if env.pop("NUM_REPLICAS_LINE", None):
        line = 'distribute_options = {"num_replicas": 2}'
    log = "" if line.startswith("log =") else "log = 'out/train.log'\n"
    (tmp_path / "train.config").write_text(config + log + line + "\n")
    (tmp_path / FILE).write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    message = message.replace("{tmp}", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        if env.get("TF_CONFIG") == "BUSY_PORT":  # this worker's port is taken
            ports = [busy.getsockname()[1], 1]
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                           "task": {"type": "worker", "index": 0}})
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        own_flags = bool(args) and args[0].startswith("--")  # returnn-tpu's own, before the config
        status = cli.main([*args, "train.config"] if own_flags else ["train.config", *args])
    err = capsys.readouterr().err
    errors = [text for text in err.splitlines() if text.startswith("returnn-tpu: error:")]
    assert status == 2, err[-3000:]
    assert len(errors) == 1 and message in errors[0], err[-3000:]
    assert sorted(os.listdir(tmp_path)) == sorted(["train.config", FILE, "dangling"])  # nothing written, not even the log


def test_a_missing_file_of_distribute_files_dataset_is_one_line(tmp_path, monkeypatch, capsys):
    """``DistributeFilesDataset`` opens its first file when it is made and looks at the others'
    sizes when an epoch starts: a second file that is not there is one line naming it, status 2,
    nothing written (a job loop must not retry it as a crash)."""
    from test_parity import write_hdf

    from returnn_tpu import cli

    write_hdf(tmp_path / "part1.hdf")
    train = ('{"class": "DistributeFilesDataset", "files": ["part1.hdf", "part2.hdf"], "partition_epoch": 2, '
             '"get_sub_epoch_dataset": lambda files: {"class": "HDFDataset", "files": files, "seq_ordering": "default"}}')
    (tmp_path / "train.config").write_text(config_12ax(distribute_options=None) + f"log = 'out/train.log'\ntrain = {train}\n")
    monkeypatch.chdir(tmp_path)
    status = cli.main(["train.config"])
    errors = [text for text in capsys.readouterr().err.splitlines() if text.startswith("returnn-tpu: error:")]
    assert status == 2 and errors == ["returnn-tpu: error: train: RETURNN's DistributeFilesDataset cannot read its "
                                      "files at epoch 1: [Errno 2] No such file or directory: 'part2.hdf'"], errors
    assert sorted(os.listdir(tmp_path)) == ["part1.hdf", "train.config"]


def test_a_second_run_on_the_same_model_is_refused(tmp_path, monkeypatch, capsys):
    """A model folder in use (its lock names a running process on this host) stops a second run
    with one line naming the owner; a lock whose process is gone, or another host's that nobody
    refreshed, is taken over."""
    import subprocess
    import time

    from returnn_tpu import cli
    from returnn_tpu.errors import ConfigError
    from returnn_tpu import model_lock
    from returnn_tpu.model_lock import STALE_SECONDS, ModelLock

    (tmp_path / "train.config").write_text(config_12ax())
    (tmp_path / "out").mkdir()
    lock = tmp_path / "out" / "model.lock"
    owner = f"{socket.gethostname()} {os.getpid()} {time.time():.0f}\n"
    lock.write_text(owner)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train.config"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("returnn-tpu: error:")]
    assert len(errors) == 1 and f"is in use by another returnn-tpu run (host {socket.gethostname()}, pid " \
        f"{os.getpid()}, since" in errors[0], errors
    assert sorted(os.listdir(tmp_path / "out")) == ["model.lock"] and lock.read_text() == owner
    gone = subprocess.Popen(["true"])
    gone.wait()
    for text, age in ((f"{socket.gethostname()} {gone.pid} 0\n", 0), ("other-host 1 0\n", STALE_SECONDS + 1)):
        lock.write_text(text)
        os.utime(lock, (time.time() - age, time.time() - age))
        taken = ModelLock(str(tmp_path / "out" / "model"))
        assert lock.read_text().startswith(f"{socket.gethostname()} {os.getpid()} ")
        taken.release()
        assert not lock.exists()
    lock.write_text("other-host 1 0\n")  # refreshed just now: its owner may run
    with pytest.raises(ConfigError, match="in use by another returnn-tpu run \\(host other-host, pid 1"):
        ModelLock(str(tmp_path / "out" / "model"))
    # A pid that lives but is not the writer's process (pid 1 after a container restart): taken over;
    # the writer's own process (its start time and boot id recorded): honoured.
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    lock.write_text(f"{socket.gethostname()} 1 0 {boot}/999999999999\n")
    ModelLock(str(tmp_path / "out" / "model")).release()
    lock.write_text(f"{socket.gethostname()} {os.getpid()} 0 {model_lock._process_identity(os.getpid())}\n")
    with pytest.raises(ConfigError, match="in use by another returnn-tpu run"):
        ModelLock(str(tmp_path / "out" / "model"))
    # An older version's lock (no process identity) naming a live pid: honoured while refreshed,
    # taken over once it was not refreshed for STALE_SECONDS (its live pid may be another's).
    lock.write_text(f"{socket.gethostname()} 1 0\n")
    with pytest.raises(ConfigError, match="in use by another returnn-tpu run"):
        ModelLock(str(tmp_path / "out" / "model"))
    os.utime(lock, (time.time() - STALE_SECONDS - 1,) * 2)
    ModelLock(str(tmp_path / "out" / "model")).release()
    lock.mkdir()  # a folder where the lock goes: one line, no IsADirectoryError
    with pytest.raises(ConfigError, match="model.lock is a folder, not a lock file; remove it"):
        ModelLock(str(tmp_path / "out" / "model"))


def test_an_override_of_a_dict_names_the_keys_it_dropped(tmp_path, monkeypatch, capsys):
    """``++distribute_options "{...}"`` replaces the config's whole dict (RETURNN's overrides do
    not merge): one line names the keys of the file's dict that it dropped (here before a refusal,
    so that nothing trains)."""
    from returnn_tpu import cli

    (tmp_path / "train.config").write_text(
        config_12ax(distribute_options={"param_sync_step": 4, "sync_dtype": "bfloat16", "num_replicas": 2}))
    monkeypatch.chdir(tmp_path)
    status = cli.main(["train.config", "++distribute_options", "{'num_replicas': 0}"])
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("returnn-tpu: note:")]
    assert status == 2 and "num_replicas" in err.splitlines()[-1], err
    assert notes == ["returnn-tpu: note: ++distribute_options replaces the config's whole distribute_options "
                     "(RETURNN's overrides do not merge); it dropped param_sync_step, sync_dtype: give them in the "
                     "override too to keep them"], err
