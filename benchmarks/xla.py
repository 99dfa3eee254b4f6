"""XLA (``jit_compile``) against the plain step, on CPU, measured in one process.

1. Step time at bucketed shapes (16 sequences x 32 and x 64 frames, 256 units) for a
   feed-forward, a self-attention and a ``standardlstm`` network, with and without
   ``jit_compile`` (same batches, alternating rounds, median ratio), plus the compile time
   (first step of a shape minus a steady step) and the compilations per bucket.
2. End to end: two epochs of the 12AX task (a few hundred steps each, bucketed into 16x32,
   16x64 and 8x128 batches: a budget of 1024 frames) with the ``standardlstm`` and the
   self-attention network, with and without ``jit_compile``: the first epoch (compilations
   included) and the second (all compiled) separately; and where the first epoch's time goes:
   the first step of each shape (trace + compile) and the median step per shape.

    python benchmarks/xla.py [--rounds 5] [--steps 20] [--epoch-seqs 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy  # noqa: E402

from returnn_tpu.returnn_bridge import setup_returnn  # noqa: E402

UNITS, SEQS, BUCKETS, FEATURES = 256, 16, (32, 64), 9

NETWORKS = {
    "feed_forward": {
        "h1": {"class": "linear", "activation": "relu", "n_out": UNITS, "from": "data"},
        "h2": {"class": "linear", "activation": "relu", "n_out": UNITS, "from": "h1"},
        "output": {"class": "softmax", "loss": "ce", "from": "h2"},
    },
    "self_attention": {
        "in": {"class": "linear", "activation": None, "n_out": UNITS, "from": "data"},
        "att": {"class": "self_attention", "num_heads": 4, "total_key_dim": UNITS, "n_out": UNITS, "from": "in"},
        "output": {"class": "softmax", "loss": "ce", "from": "att"},
    },
    "standardlstm": {
        "lstm": {"class": "rec", "unit": "standardlstm", "n_out": UNITS, "from": "data"},
        "output": {"class": "softmax", "loss": "ce", "from": "lstm"},
    },
}


def make_trainer(network, jit: bool, model_dir: str, boundaries=BUCKETS, **config_values):
    from returnn.config import Config, set_global_config

    from returnn_tpu.options import DistributeOptions
    from returnn_tpu.trainer import Trainer

    values = {
        "task": "train",
        "train": {"class": "Task12AXDataset", "num_seqs": 10},
        "extern_data": {"data": {"dim": FEATURES}, "classes": {"dim": 2, "sparse": True}},
        "network": network,
        "optimizer": {"class": "adam"},
        "learning_rate": 0.001,
        "model": os.path.join(model_dir, "jit" if jit else "plain", "model"),
        "log": [],
        "log_verbosity": 0,
        **config_values,
    }
    config = Config(values)
    set_global_config(config)
    options = DistributeOptions(strategy="single", jit_compile=jit, bucket_boundaries=boundaries)
    trainer = Trainer(config, options)
    if not jit:  # the same bucketed batches as the XLA run
        from returnn_tpu.data import BucketBatching

        trainer.batching = BucketBatching(config, boundaries, "data")
    return trainer


def bucket_batches(rng, count):
    """``count`` batches per bucket, full length (the padded shapes the bucketing batcher makes)."""
    batches = []
    for frames in BUCKETS:
        lengths = numpy.full((SEQS,), frames, "int32")
        for _ in range(count):
            batches.append({
                "data": rng.randn(SEQS, frames, FEATURES).astype("float32"),
                "size:data:0": lengths,
                "classes": rng.randint(0, 2, (SEQS, frames)).astype("int32"),
                "size:classes:0": lengths,
            })
    return batches


def timed(trainer, batches):
    times = []
    for batch in batches:
        start = time.perf_counter()
        trainer.train_step([batch], 0.001)
        times.append(time.perf_counter() - start)
    return times


def step_times(name, rounds, steps, model_dir):
    batches = bucket_batches(numpy.random.RandomState(0), steps)
    trainers = {jit: make_trainer(NETWORKS[name], jit, os.path.join(model_dir, name)) for jit in (False, True)}
    first = {}
    for jit, trainer in trainers.items():  # first step per bucket: trace (+ XLA compile)
        trainer.train_step([batches[0]], 0.001)  # builds variables
        first[jit] = [timed(trainer, [batches[i * steps]])[0] for i in range(len(BUCKETS))]
    times = {False: [], True: []}
    for _ in range(rounds):
        for jit, trainer in trainers.items():
            times[jit] += timed(trainer, batches)
    plain, jitted = statistics.median(times[False]), statistics.median(times[True])
    compile_seconds = statistics.median(first[True]) - jitted
    per_bucket = len(trainers[True].steps.compiled_shapes) / len(BUCKETS)
    return plain, jitted, compile_seconds, per_bucket


def epoch_times(network: str, jit: bool, num_seqs: int, model_dir: str):
    """Seconds of epochs 1 and 2, and the first epoch's step times per shape."""
    trainer = make_trainer(
        NETWORKS[network], jit, os.path.join(model_dir, f"epoch-{network}-{jit}"), boundaries=BUCKETS + (128,),
        train={"class": "Task12AXDataset", "num_seqs": num_seqs}, batch_size=1024, max_seqs=16,
    )
    seconds, per_shape = [], {}  # (seqs, frames) -> step times in order
    for epoch in (1, 2):
        start = time.perf_counter()
        for step_batches, _ in trainer.epoch_batches(trainer.train_datasets, epoch, train=True):
            step_start = time.perf_counter()
            trainer.train_step(step_batches, 0.001)
            if epoch == 1:
                per_shape.setdefault(step_batches[0]["data"].shape[:2], []).append(time.perf_counter() - step_start)
        seconds.append(time.perf_counter() - start)
    return seconds, per_shape, len(trainer.steps.compiled_shapes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per bucket per round")
    parser.add_argument("--epoch-seqs", type=int, default=2000)
    args = parser.parse_args()
    setup_returnn()
    with tempfile.TemporaryDirectory() as model_dir:
        print(f"step time, {SEQS} seqs x {BUCKETS} frames, {UNITS} units, {args.rounds} rounds x "
              f"{args.steps} steps per bucket")
        print(f"{'network':16s} {'plain ms':>9s} {'xla ms':>8s} {'xla/plain':>10s} {'compile s':>10s} "
              f"{'compiles/bucket':>16s}")
        for name in NETWORKS:
            plain, jitted, compile_seconds, per_bucket = step_times(name, args.rounds, args.steps, model_dir)
            print(f"{name:16s} {plain * 1000:9.2f} {jitted * 1000:8.2f} {jitted / plain:10.3f} "
                  f"{compile_seconds:10.2f} {per_bucket:16.1f}")
        for network in ("standardlstm", "self_attention"):
            plain, plain_shapes, _ = epoch_times(network, False, args.epoch_seqs, model_dir)
            jitted, jit_shapes, compiled = epoch_times(network, True, args.epoch_seqs, model_dir)
            steps = sum(len(times) for times in plain_shapes.values())
            print(f"{network}, epochs of {steps} steps (12AX, buckets {BUCKETS + (128,)}): XLA / plain epoch time: "
                  f"epoch 1 {jitted[0]:.1f} / {plain[0]:.1f} s = {jitted[0] / plain[0]:.3f} (incl. {compiled} "
                  f"compilations), epoch 2 {jitted[1]:.1f} / {plain[1]:.1f} s = {jitted[1] / plain[1]:.3f}")
            print(f"  {'shape (seqs, frames)':22s} {'steps':>6s} {'plain median ms':>16s} {'xla median ms':>14s} "
                  f"{'xla first step s':>17s}")
            for shape in sorted(plain_shapes):
                print(f"  {str(shape):22s} {len(plain_shapes[shape]):6d} "
                      f"{statistics.median(plain_shapes[shape]) * 1000:16.1f} "
                      f"{statistics.median(jit_shapes[shape]) * 1000:14.1f} {jit_shapes[shape][0]:17.2f}")

if __name__ == "__main__":
    main()
