"""Step time of returnn-tpu against plain RETURNN's session engine, in one process, same batches.

Trains the same network on the same batches with
  * RETURNN's own TF1 session step (``TFNetwork`` + ``returnn.tf.updater.Updater``, as its engine runs it),
  * returnn-tpu with ``distribute_strategy = "single"``,
  * returnn-tpu with ``"local_sgd"`` and one replica,
alternating in rounds, and prints the ratio of median step times to the session step and the
minor page faults per step (FACTS.md, "from_generator").

    python benchmarks/overhead.py [--unit nativelstm2|standardlstm|ff] [--rounds 5] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy  # noqa: E402
import tensorflow as tf  # noqa: E402

from returnn_tpu.patches import setup_returnn  # noqa: E402

BATCH, FRAMES, FEATURES, CLASSES, UNITS = 16, 50, 9, 2, 256


def network(unit: str) -> dict:
    if unit == "ff":
        hidden = {"class": "linear", "activation": "relu", "n_out": UNITS, "from": "data"}
        return {"h1": hidden, "h2": dict(hidden, **{"from": "h1"}), "output": {"class": "softmax", "loss": "ce", "from": "h2"}}
    return {
        "lstm": {"class": "rec", "unit": unit, "n_out": UNITS, "from": "data"},
        "output": {"class": "softmax", "loss": "ce", "from": "lstm"},
    }


def make_config(unit: str, model_dir: str):
    from returnn_tpu.returnn_side.returnn_bridge import in_process_config

    return in_process_config(
        {
            "task": "train",
            "train": {"class": "Task12AXDataset", "num_seqs": 10},
            "extern_data": {"data": {"dim": FEATURES}, "classes": {"dim": CLASSES, "sparse": True}},
            "network": network(unit),
            "optimizer": {"class": "adam"},
            "learning_rate": 0.001,
            "model": os.path.join(model_dir, "model"),
            "log": [],
            "log_verbosity": 0,
        }
    )


def make_batches(count: int):
    rng = numpy.random.RandomState(0)
    lengths = numpy.full((BATCH,), FRAMES, "int32")
    return [
        {
            "data": rng.randn(BATCH, FRAMES, FEATURES).astype("float32"),
            "size:data:0": lengths,
            "classes": rng.randint(0, CLASSES, (BATCH, FRAMES)).astype("int32"),
            "size:classes:0": lengths,
        }
        for _ in range(count)
    ]


class SessionRunner:
    """RETURNN's session path: placeholders fed per step, loss and optimizer op fetched."""

    def __init__(self, config):
        from returnn.tf.network import TFNetwork
        from returnn.tf.updater import Updater

        from tensorflow.python.eager import context

        self.graph = tf.Graph()
        # graph_mode: RETURNN's init_scope-style helpers must land in this graph, not in eager.
        with context.graph_mode(), self.graph.as_default():
            self.net = TFNetwork(config=config, train_flag=True)
            self.net.construct_from_dict(config.typed_value("network"))
            updater = Updater(config=config, network=self.net, initial_learning_rate=0.001)
            updater.set_trainable_vars(self.net.get_trainable_params())
            self.fetches = {"loss": self.net.get_objective(), "optim": updater.get_optim_op()}
            self.session = tf.compat.v1.Session(graph=self.graph)
            self.session.run(tf.compat.v1.global_variables_initializer())
            self.session.run(self.net.global_train_step_var.initializer)  # only in the GLOBAL_STEP collection
            updater.init_optimizer_vars(self.session)

    def step(self, batch):
        ext = self.net.extern_data  # feeding as RETURNN's FeedDictDataProvider does
        feed = {ext.get_batch_info().dim: BATCH}
        for key in ("data", "classes"):
            feed[ext.data[key].placeholder] = batch[key]
            feed[ext.data[key].size_placeholder[0]] = batch[f"size:{key}:0"]
        self.session.run(self.fetches, feed_dict=feed)


class TrainerRunner:
    """returnn-tpu's trainer step (tf.function around strategy.run)."""

    def __init__(self, config, strategy: str):
        from returnn_tpu.options import DistributeOptions
        from returnn_tpu.trainer import Trainer

        self.trainer = Trainer(config, DistributeOptions(strategy=strategy, num_replicas=1, param_sync_step=10**9))

    def step(self, batch):
        self.trainer.train_step([batch], 0.001)


def timed_steps(runner, batches):
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = []
    for batch in batches:
        start = time.perf_counter()
        runner.step(batch)
        times.append(time.perf_counter() - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return times, faults / len(batches)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--unit", default="nativelstm2", choices=["nativelstm2", "standardlstm", "ff"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: only that the script runs (tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.smoke:
        args.unit, args.rounds, args.steps = "ff", 1, 3
    setup_returnn()
    batches = make_batches(args.steps)
    with tempfile.TemporaryDirectory() as model_dir:
        config = make_config(args.unit, model_dir)
        runners = {
            "returnn_session": SessionRunner(config),
            "single": TrainerRunner(config, "single"),
            "local_sgd_1": TrainerRunner(config, "local_sgd"),
        }
        for runner in runners.values():  # warm-up: traces, compiles, allocator
            timed_steps(runner, batches[:3])
        times = {name: [] for name in runners}
        faults = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, runner in runners.items():
                step_times, step_faults = timed_steps(runner, batches)
                times[name] += step_times
                faults[name].append(step_faults)
    base = statistics.median(times["returnn_session"])
    print(f"unit={args.unit} batch={BATCH}x{FRAMES} units={UNITS} rounds={args.rounds} steps/round={args.steps}")
    print(f"{'path':18s} {'median step ms':>15s} {'ratio to session':>17s} {'minor faults/step':>18s}")
    for name in runners:
        median = statistics.median(times[name])
        print(f"{name:18s} {median * 1000:15.2f} {median / base:17.3f} {statistics.median(faults[name]):18.1f}")


if __name__ == "__main__":
    main()
