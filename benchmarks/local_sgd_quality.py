"""Model quality against communication: synchronous SGD, local SGD and DiLoCo, in one run.

Every variant trains the same RETURNN config (an LSTM on RETURNN's generated 12AX task, Adam,
constant learning rate) for the same number of steps on the same data: 4 replicas on logical
CPU devices, ``dataset_distribution = "shard"`` (each step takes the next 4 batches of one
order), so they differ only in how the replicas are combined. Prints, per variant, the final dev
score and frame error, its score relative to synchronous SGD, and the bytes handed to the
collectives per step (``metrics.jsonl``'s ``sync_bytes`` over all epochs / steps) relative to
synchronous SGD's gradient all-reduce.

    python benchmarks/local_sgd_quality.py [--epochs 2] [--num-seqs 3000] [--only diloco_64 ...]

Small batches (2 sequences) give many steps per epoch: an epoch ends in a full sync, so N = 64
needs epochs of several hundred steps to mean what it says.

``--task returnn_demo`` trains RETURNN's own ``demos/demo-tf-vanilla-lstm.12ax.config`` instead
(its data, network, batching and Adam at 0.01; 4 replicas with the default
``random_seed_offset``), at ``param_sync_step = 16``, with a grid of DiLoCo's outer learning
rate and momentum: which outer settings work at RETURNN's usual learning rates and few inner
steps between syncs.

    python benchmarks/local_sgd_quality.py --task returnn_demo [--epochs 3] [--seeds 1 2 3]

With ``--seeds``, every variant trains once per ``random_seed`` (the parameters' initialization)
and the table shows the mean and each seed's dev score: on the demo, whether a run leaves the
12AX task's plateau (dev score about 0.12) within the epochs decides most of its score.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = """#!returnn-tpu
task = "train"
train = {{"class": "Task12AXDataset", "num_seqs": {num_seqs}}}
dev = {{"class": "Task12AXDataset", "num_seqs": 200, "fixed_random_seed": 1}}
num_inputs = 9
num_outputs = 2
batch_size = 600
max_seqs = 2
network = {{
    "fw0": {{"class": "rec", "unit": "standardlstm", "n_out": 32, "from": "data"}},
    "output": {{"class": "softmax", "loss": "ce", "from": "fw0"}},
}}
optimizer = {{"class": "adam"}}
learning_rate = 0.003
learning_rate_control = "constant"
model = "out/model"
learning_rate_file = "out/learning_rates"
num_epochs = {epochs}
log_verbosity = 2
distribute_strategy = {strategy!r}
distribute_options = {options!r}
"""

# RETURNN's demos/demo-tf-vanilla-lstm.12ax.config, its training options unchanged.
RETURNN_DEMO_CONFIG = """#!returnn-tpu
use_tensorflow = True
task = "train"
train = {{"class": "Task12AXDataset", "num_seqs": 1000}}
dev = {{"class": "Task12AXDataset", "num_seqs": 100, "fixed_random_seed": 1}}
num_inputs = 9
num_outputs = 2
batching = "random"
batch_size = 5000
max_seqs = 10
chunking = "200:200"
network = {{
    "fw0": {{"class": "rec", "unit": "BasicLSTM", "n_out": 10}},
    "output": {{"class": "softmax", "loss": "ce", "from": ["fw0"]}},
}}
optimizer = {{"class": "adam"}}
learning_rate = 0.01
model = "out/model"
learning_rate_file = "out/learning_rates"
num_epochs = {epochs}
gradient_clip = 0
log_verbosity = 2
distribute_strategy = {strategy!r}
distribute_options = {options!r}
"""

DILOCO = {"class": "nesterov", "learning_rate": 0.7, "momentum": 0.9}  # the DiLoCo paper's outer optimizer
VARIANTS = {
    "sync_sgd": ("mirrored", {}),
    "local_sgd_4": ("local_sgd", {"param_sync_step": 4}),
    "local_sgd_16": ("local_sgd", {"param_sync_step": 16}),
    "local_sgd_64": ("local_sgd", {"param_sync_step": 64}),
    "diloco_16": ("local_sgd", {"param_sync_step": 16, "outer_optimizer": DILOCO}),
    "diloco_64": ("local_sgd", {"param_sync_step": 64, "outer_optimizer": DILOCO}),
    "diloco_64_bf16": ("local_sgd", {"param_sync_step": 64, "outer_optimizer": DILOCO, "sync_dtype": "bfloat16"}),
    "diloco_64_4_fragments": ("local_sgd", {"param_sync_step": 64, "outer_optimizer": DILOCO, "sync_fragments": 4}),
    # Overlapped syncs (Streaming DiLoCo's mixing factor 0.5) and quantized ones, +- error feedback.
    "diloco_64_tau1": ("local_sgd", {"param_sync_step": 64, "outer_optimizer": DILOCO, "sync_delay": 1}),
    "diloco_64_tau4": ("local_sgd", {"param_sync_step": 64, "outer_optimizer": DILOCO, "sync_delay": 4}),
    **{f"diloco_64_{dtype}{'' if feedback else '_no_ef'}": ("local_sgd", {
        "param_sync_step": 64, "outer_optimizer": DILOCO, "sync_dtype": dtype, "sync_error_feedback": feedback})
       for dtype in ("int8", "int4") for feedback in (True, False)},
}

# DiLoCo's outer (learning rate, momentum) on RETURNN's demo, 16 inner steps between syncs.
DEMO_VARIANTS = {
    "sync_sgd": ("mirrored", {}),
    "local_sgd_16": ("local_sgd", {"param_sync_step": 16}),
    **{f"diloco_16_lr{lr}_m{momentum}": ("local_sgd", {"param_sync_step": 16, "outer_optimizer": {
        "class": "nesterov", "learning_rate": lr, "momentum": momentum}})
       for lr in (0.7, 1.0) for momentum in (0.9, 0.5, 0.0) if (lr, momentum) != (1.0, 0.0)},  # 1, 0: averaging
}


def run_variant(name: str, strategy: str, options: dict, args, seed: Optional[int]) -> dict:
    folder = tempfile.mkdtemp(prefix=f"local_sgd_quality_{name}_")
    options = dict(options, num_replicas=4)
    if args.task == "lstm32":
        options["dataset_distribution"] = "shard"
        config = CONFIG.format(num_seqs=args.num_seqs, epochs=args.epochs, strategy=strategy, options=options)
    else:
        config = RETURNN_DEMO_CONFIG.format(epochs=args.epochs, strategy=strategy, options=options)
    if seed is not None:
        config += f"random_seed = {seed}\n"
    with open(os.path.join(folder, "train.config"), "w") as f:
        f.write(config)
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "returnn_tpu.cli", "train.config"], cwd=folder, env=env,
                            capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    with open(os.path.join(folder, "out", "metrics.jsonl")) as f:
        epochs = [json.loads(line) for line in f]
    steps = sum(e["steps"] for e in epochs)
    return {
        "name": name,
        "steps": steps,
        "dev_score": epochs[-1]["dev_score"],
        "dev_error": epochs[-1]["dev_error"],
        "bytes_per_step": sum(e["sync_bytes"] for e in epochs) / steps,
        "syncs": sum(e["syncs"] for e in epochs),
        "seconds": seconds,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=["lstm32", "returnn_demo"], default="lstm32")
    parser.add_argument("--epochs", type=int, default=None, help="default: 2 (lstm32), 3 (returnn_demo)")
    parser.add_argument("--num-seqs", type=int, default=3000, help="lstm32's training sequences")
    parser.add_argument("--only", nargs="*", help="variants to run besides sync_sgd (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[None], help="random_seed of each run (default: "
                        "the config's)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: only that the script runs (tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.smoke:
        args.task, args.epochs, args.num_seqs, args.only = "lstm32", 1, 40, ["local_sgd_4"]
    args.epochs = args.epochs or (2 if args.task == "lstm32" else 3)
    variants = VARIANTS if args.task == "lstm32" else DEMO_VARIANTS
    names = ["sync_sgd"] + [n for n in variants if n != "sync_sgd" and (not args.only or n in args.only)]
    rows = []
    for name in names:
        strategy, options = variants[name]
        runs = [run_variant(name, strategy, options, args, seed) for seed in args.seeds]
        rows.append(_mean(runs))
        print(f"done: {name} ({rows[-1]['seconds']:.0f} s)", file=sys.stderr, flush=True)
    base = rows[0]
    task = ("12AX LSTM (32 units), Adam 0.003" if args.task == "lstm32"
            else "RETURNN's demo-tf-vanilla-lstm.12ax.config (Adam 0.01)")
    seeds = "" if args.seeds == [None] else f", mean of random_seed {', '.join(map(str, args.seeds))}"
    print(f"{args.epochs} epochs, {base['steps']} steps of 4 replicas each, {task}{seeds}")
    print(f"{'variant':<24}{'dev score':>10}{'vs sync':>9}{'dev FER':>9}{'syncs':>7}{'bytes/step':>12}"
          f"{'vs sync':>10}{'seconds':>9}  {'dev score per seed' if len(args.seeds) > 1 else ''}")
    for row in rows:
        assert row["steps"] == base["steps"], (row["name"], row["steps"], base["steps"])
        relative = row["dev_score"] / base["dev_score"] - 1
        ratio = row["bytes_per_step"] / base["bytes_per_step"]
        per_seed = " ".join(f"{score:.4f}" for score in row["dev_scores"]) if len(args.seeds) > 1 else ""
        print(f"{row['name']:<24}{row['dev_score']:>10.4f}{relative:>+9.1%}{row['dev_error']:>9.4f}"
              f"{row['syncs']:>7}{row['bytes_per_step']:>12.0f}{'1/%.0f' % (1 / ratio):>10}{row['seconds']:>9.0f}"
              f"  {per_seed}")


def _mean(runs: List[dict]) -> dict:
    """One row for the runs of a variant (one per seed): mean scores, each seed's dev score."""
    row = dict(runs[0], dev_scores=[run["dev_score"] for run in runs], seconds=sum(r["seconds"] for r in runs))
    for key in ("dev_score", "dev_error"):
        row[key] = sum(run[key] for run in runs) / len(runs)
    return row


if __name__ == "__main__":
    main()
