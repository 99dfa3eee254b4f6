"""Test setup: four logical CPU devices (before TensorFlow initialises) and RETURNN's TF backend."""

import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

NUM_LOGICAL_CPUS = 4
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
)
assert len(tf.config.list_logical_devices("CPU")) == NUM_LOGICAL_CPUS  # initialises TF: fixed from here on

from returnn_tpu.patches import setup_returnn  # noqa: E402

setup_returnn()

from returnn.util.basic import BackendEngine  # noqa: E402

BackendEngine.select_engine(engine=BackendEngine.TensorFlowNetDict)  # for tests that build without a trainer

from returnn.log import log  # noqa: E402

log.initialize(logs=[], verbosity=[0])  # in-process trainers log nothing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TWELVE_AX = {  # the tests' run: RETURNN's 12AX task (9 inputs, 2 classes) on a small LSTM, 2 replicas
    "task": "train",
    "train": {"class": "Task12AXDataset", "num_seqs": 40},
    "dev": {"class": "Task12AXDataset", "num_seqs": 10, "fixed_random_seed": 1},
    "num_inputs": 9,
    "num_outputs": 2,
    "batch_size": 300,
    "max_seqs": 5,
    "network": {
        "fw0": {"class": "rec", "unit": "standardlstm", "n_out": 8, "from": "data"},
        "output": {"class": "softmax", "loss": "ce", "from": "fw0"},
    },
    "optimizer": {"class": "adam"},
    "learning_rate": 0.01,
    "model": "out/model",
    "learning_rate_file": "out/lr",
    "num_epochs": 3,
    "log_verbosity": 3,
    "distribute_strategy": "local_sgd",
    "distribute_options": {"num_replicas": 2, "param_sync_step": 2},
}


def config_12ax(prelude: str = "", **values) -> str:
    """The text of a config file: :data:`TWELVE_AX` with ``values`` in place of its own (a value of
    None leaves the key out; a :class:`Code` value is written as the Python it holds), after the
    Python lines of ``prelude``."""
    merged = {**TWELVE_AX, **values}
    lines = [f"{key} = {value!r}" for key, value in merged.items() if value is not None]
    return "\n".join(["#!returnn-tpu", *([prelude.rstrip("\n")] if prelude else []), *lines, ""])


class Code(str):
    """A config value written as the Python expression it holds (e.g. one that depends on the worker)."""

    def __repr__(self):
        return str(self)


def make_trainer(tmp_path, network, *, strategy="local_sgd", num_replicas=2, **config_values):
    """A Trainer for the 12AX task (9 inputs, 2 classes), with checkpoints under tmp_path."""
    from returnn_tpu.options import DistributeOptions
    from returnn_tpu.returnn_side.returnn_bridge import in_process_config
    from returnn_tpu.trainer import Trainer

    values = {
        "task": "train",
        "train": {**TWELVE_AX["train"], "num_seqs": 20},
        "extern_data": {"data": {"dim": TWELVE_AX["num_inputs"]},
                        "classes": {"dim": TWELVE_AX["num_outputs"], "sparse": True}},
        "network": network,
        "batch_size": 200,
        "max_seqs": 4,
        "optimizer": {"class": "sgd"},
        "learning_rate": 0.1,
        "model": str(tmp_path / "model"),
        "learning_rate_file": str(tmp_path / "lr"),
        "num_epochs": 1,
        "log": [],
        "log_verbosity": 0,
    }
    values.update(config_values)
    options = values.pop("distribute_options", {})
    config = in_process_config(values)
    return Trainer(config, DistributeOptions(strategy=strategy, num_replicas=num_replicas, **options))


def random_step_batches(rng, num_replicas, *, batch=3, time=7, dim=9, classes=2):
    """One padded 12AX-shaped batch per replica, with unequal sequence lengths."""
    step = []
    for _ in range(num_replicas):
        lengths = rng.randint(2, time + 1, size=(batch,)).astype("int32")
        lengths[0] = time
        step.append(
            {
                "data": rng.randn(batch, time, dim).astype("float32"),
                "size:data:0": lengths,
                "classes": rng.randint(0, classes, size=(batch, time)).astype("int32"),
                "size:classes:0": lengths.copy(),
            }
        )
    return step


def replica_values(strategy, var):
    """Every replica's copy of a variable as NumPy arrays."""
    return [c.numpy() for c in strategy.experimental_local_results(var)]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a long run (several processes, or whole epochs); `-m 'not slow'` is the quick suite, "
        ".ci/run runs both")


@pytest.fixture
def rng():
    import numpy

    return numpy.random.RandomState(42)


def run_cli(args, cwd, timeout=600, env=None):
    """Runs ``returnn-tpu`` as a user would, in a fresh process."""
    import subprocess

    full_env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "returnn_tpu.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def speech_corpus_dir(tmp_path_factory):
    """benchmarks/speech_corpus.py's tiny corpus: 12 train and 4 dev utterances of espeak-ng speech
    in OggZipDataset's zips (made once per test process). Skips where Debian's espeak-ng is not
    installed (.ci/run installs it)."""
    import shutil

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (.ci/run installs it)")
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import speech_corpus

    folder = tmp_path_factory.mktemp("speech")
    speech_corpus.make_tiny(str(folder))
    return str(folder)
