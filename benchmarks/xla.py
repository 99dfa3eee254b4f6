"""XLA (``jit_compile``) against the plain step, on CPU.

1. Step time, in one process, at the shapes of a 1024-frame budget's buckets (16 sequences x 32
   and x 64 frames, 8 x 128; or ``--shapes``) for a feed-forward, a self-attention and a ``standardlstm``
   network, with and without ``jit_compile`` (same batches, alternating rounds, median per
   shape), plus the compile time (first step of a shape minus a steady step) and the
   compilations per shape.
2. End to end, as a user runs it: ``returnn-tpu`` trains a config of the 12AX task (a few
   hundred steps per epoch, ``batch_size`` 1024, ``max_seqs`` 16) with the ``standardlstm`` and
   the self-attention network, once with ``distribute_options = {"jit_compile": True,
   "bucket_boundaries": [32, 64, 128]}`` and once with ``{}`` (RETURNN's batches); each
   epoch's training time from ``metrics.jsonl``: the first epoch (tracing and compilations
   included) and the later ones (all compiled) separately, with the compilations of each; and the
   first epoch of the next run of the config (a resumed or repeated run: TensorFlow's persistent
   XLA cache of the first run, which returnn-tpu keeps beside the checkpoints).

Each ``--units`` value (the networks' width) is measured in turn.

    python benchmarks/xla.py [--rounds 5] [--steps 20] [--epoch-seqs 2000] [--epochs 3] [--units 256 ...]
                             [--shapes 16x32 16x64 8x128] [--end-to-end standardlstm self_attention]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy  # noqa: E402

from returnn_tpu.patches import setup_returnn  # noqa: E402

SHAPES, FEATURES = ((16, 32), (16, 64), (8, 128)), 9  # (sequences, frames) of the buckets
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def networks(units: int) -> dict:
    """The benchmark's networks, ``units`` wide."""
    return {
        "feed_forward": {
            "h1": {"class": "linear", "activation": "relu", "n_out": units, "from": "data"},
            "h2": {"class": "linear", "activation": "relu", "n_out": units, "from": "h1"},
            "output": {"class": "softmax", "loss": "ce", "from": "h2"},
        },
        "self_attention": {
            "in": {"class": "linear", "activation": None, "n_out": units, "from": "data"},
            "att": {"class": "self_attention", "num_heads": 4, "total_key_dim": units, "n_out": units, "from": "in"},
            "output": {"class": "softmax", "loss": "ce", "from": "att"},
        },
        "standardlstm": {
            "lstm": {"class": "rec", "unit": "standardlstm", "n_out": units, "from": "data"},
            "output": {"class": "softmax", "loss": "ce", "from": "lstm"},
        },
    }


def make_trainer(network, jit: bool, model_dir: str, shapes=SHAPES):
    """A one-device trainer of ``network`` in this process, with or without ``jit_compile``."""
    from returnn_tpu.options import DistributeOptions
    from returnn_tpu.returnn_side.returnn_bridge import in_process_config
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
    }
    config = in_process_config(values)
    boundaries = tuple(sorted({frames for _, frames in shapes}))
    return Trainer(config, DistributeOptions(strategy="single", jit_compile=jit, bucket_boundaries=boundaries))


def shape_batches(rng, count, shapes):
    """``count`` full-length batches of each of ``shapes``."""
    batches = []
    for seqs, frames in shapes:
        lengths = numpy.full((seqs,), frames, "int32")
        for _ in range(count):
            batches.append({
                "data": rng.randn(seqs, frames, FEATURES).astype("float32"),
                "size:data:0": lengths,
                "classes": rng.randint(0, 2, (seqs, frames)).astype("int32"),
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


def step_times(network: dict, rounds: int, steps: int, model_dir: str, shapes):
    """Per shape: median plain and XLA step seconds and XLA's compile seconds; and XLA's
    compilations per shape."""
    batches = shape_batches(numpy.random.RandomState(0), steps, shapes)
    trainers = {jit: make_trainer(network, jit, model_dir, shapes) for jit in (False, True)}
    first = {}
    for jit, trainer in trainers.items():  # first step per shape: trace (+ XLA compile; the first builds variables)
        first[jit] = [timed(trainer, [batches[i * steps]])[0] for i in range(len(shapes))]
    times = {False: [], True: []}
    for _ in range(rounds):
        for jit, trainer in trainers.items():
            times[jit] += timed(trainer, batches)
    rows = []
    for i in range(len(shapes)):
        plain, jitted = (statistics.median(times[jit][i * steps + round_ * len(batches) + step]
                                           for round_ in range(rounds) for step in range(steps))
                         for jit in (False, True))
        rows.append((plain, jitted, first[True][i] - jitted))
    return rows, len(trainers[True].steps.replica.compiled_shapes) / len(shapes)


CLI_CONFIG = """#!returnn-tpu
task = "train"
train = {{"class": "Task12AXDataset", "num_seqs": {num_seqs}}}
extern_data = {{"data": {{"dim": {features}}}, "classes": {{"dim": 2, "sparse": True}}}}
batch_size = 1024
max_seqs = 16
network = {network!r}
optimizer = {{"class": "adam"}}
learning_rate = 0.001
model = "out/model"
num_epochs = {epochs}
log = "out/train.log"
log_verbosity = 3
distribute_strategy = "single"
distribute_options = {options!r}
"""


def cli_epochs(network: dict, jit: bool, num_seqs: int, epochs: int, folder: str,
               cache_of: Optional[str] = None) -> list:
    """``returnn-tpu`` trains ``network`` (with XLA and buckets, or RETURNN's batches), with the
    persistent XLA cache of the run in ``cache_of`` if given (the next run of a config); the
    records of ``metrics.jsonl``, one per epoch."""
    if cache_of:
        shutil.copytree(os.path.join(cache_of, "out", "xla_cache"), os.path.join(folder, "out", "xla_cache"))
    os.makedirs(os.path.join(folder, "out"), exist_ok=True)
    options = {"jit_compile": True, "bucket_boundaries": [frames for _, frames in SHAPES]} if jit else {}
    with open(os.path.join(folder, "train.config"), "w") as f:
        f.write(CLI_CONFIG.format(num_seqs=num_seqs, features=FEATURES, network=network, epochs=epochs,
                                  options=options))
    result = subprocess.run([sys.executable, "-m", "returnn_tpu.cli", "train.config"], cwd=folder,
                            env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"returnn-tpu failed in {folder} (status {result.returncode}):\n{result.stderr[-3000:]}")
    with open(os.path.join(folder, "out", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per shape per round")
    parser.add_argument("--epoch-seqs", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=3, help="of the end-to-end runs; 0: none")
    parser.add_argument("--shapes", nargs="+", default=[f"{seqs}x{frames}" for seqs, frames in SHAPES],
                        help="SEQSxFRAMES batch shapes of the step-time table")
    parser.add_argument("--units", type=int, nargs="+", default=[256], help="network widths, each measured in turn")
    parser.add_argument("--end-to-end", nargs="+", default=["standardlstm", "self_attention"], metavar="NETWORK",
                        help="the networks of the end-to-end runs")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: only that the script runs (tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.epoch_seqs, args.epochs, args.shapes, args.units = 1, 1, 40, 1, ["4x16"], [16]
        args.end_to_end = ["standardlstm"]  # the other network's runs take the same code path
    args.shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    setup_returnn()
    for units in args.units:
        with tempfile.TemporaryDirectory() as work:
            measure(networks(units), units, args, work)


def measure(nets: dict, units: int, args, work: str):
    """Prints the step-time table and the two networks' epoch comparison at one width."""
    print(f"step time, {units} units, {args.rounds} rounds x {args.steps} steps per shape (median ms)")
    print(f"{'network':16s} {'shape':>8s} {'plain ms':>9s} {'xla ms':>8s} {'xla/plain':>10s} {'compile s':>10s}")
    for name, network in nets.items():
        rows, per_shape = step_times(network, args.rounds, args.steps, os.path.join(work, name), args.shapes)
        for (seqs, frames), (plain, jitted, compile_seconds) in zip(args.shapes, rows):
            print(f"{name:16s} {f'{seqs}x{frames}':>8s} {plain * 1000:9.2f} {jitted * 1000:8.2f} "
                  f"{jitted / plain:10.3f} {compile_seconds:10.2f}", flush=True)
        print(f"{name:16s} XLA compilations per shape: {per_shape:.1f}")
    for name in args.end_to_end if args.epochs else ():
        plain = cli_epochs(nets[name], False, args.epoch_seqs, args.epochs, os.path.join(work, f"{name}-plain"))
        first_run = os.path.join(work, f"{name}-xla")
        jitted = cli_epochs(nets[name], True, args.epoch_seqs, args.epochs, first_run)
        again = cli_epochs(nets[name], True, args.epoch_seqs, 1, os.path.join(work, f"{name}-xla-again"), first_run)
        print(f"{name} ({units} units), returnn-tpu, 12AX epochs of {args.epoch_seqs} sequences: XLA "
              f"({jitted[0]['steps']} steps, buckets) / plain ({plain[0]['steps']} steps, RETURNN's batches):")
        rows = [(f"epoch {ours['epoch']}", ours, theirs) for ours, theirs in zip(jitted, plain)]
        rows.append(("epoch 1, next run", again[0], plain[0]))  # the persistent cache of the first run
        for label, ours, theirs in rows:
            print(f"  {label}: {ours['seconds']:.1f} / {theirs['seconds']:.1f} s = "
                  f"{ours['seconds'] / theirs['seconds']:.3f} ({ours['xla_compilations']} compilations, "
                  f"{ours['xla_compile_seconds']:.1f} s; padding {100 * ours['padding_fraction']:.1f}%; computing "
                  f"time {100 * ours['computing_time_share']:.1f}% / {100 * theirs['computing_time_share']:.1f}%)",
                  flush=True)


if __name__ == "__main__":
    main()
