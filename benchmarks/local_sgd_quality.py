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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

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
}


def run_variant(name: str, strategy: str, options: dict, args) -> dict:
    folder = tempfile.mkdtemp(prefix=f"local_sgd_quality_{name}_")
    options = dict(options, num_replicas=4, dataset_distribution="shard")
    with open(os.path.join(folder, "train.config"), "w") as f:
        f.write(CONFIG.format(num_seqs=args.num_seqs, epochs=args.epochs, strategy=strategy, options=options))
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
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-seqs", type=int, default=3000)
    parser.add_argument("--only", nargs="*", help="variants to run besides sync_sgd (default: all)")
    args = parser.parse_args()
    names = ["sync_sgd"] + [n for n in VARIANTS if n != "sync_sgd" and (not args.only or n in args.only)]
    rows = []
    for name in names:
        strategy, options = VARIANTS[name]
        rows.append(run_variant(name, strategy, options, args))
        print(f"done: {name} ({rows[-1]['seconds']:.0f} s)", file=sys.stderr, flush=True)
    base = rows[0]
    print(f"{args.epochs} epochs, {base['steps']} steps of 4 replicas each, 12AX LSTM (32 units), Adam 0.003")
    print(f"{'variant':<24}{'dev score':>10}{'vs sync':>9}{'dev FER':>9}{'syncs':>7}{'bytes/step':>12}"
          f"{'vs sync':>10}{'seconds':>9}")
    for row in rows:
        assert row["steps"] == base["steps"], (row["name"], row["steps"], base["steps"])
        relative = row["dev_score"] / base["dev_score"] - 1
        ratio = row["bytes_per_step"] / base["bytes_per_step"]
        print(f"{row['name']:<24}{row['dev_score']:>10.4f}{relative:>+9.1%}{row['dev_error']:>9.4f}"
              f"{row['syncs']:>7}{row['bytes_per_step']:>12.0f}{'1/%.0f' % (1 / ratio):>10}{row['seconds']:>9.0f}")


if __name__ == "__main__":
    main()
