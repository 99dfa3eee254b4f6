"""Start-up cost of returnn-tpu by replica count, against plain RETURNN, on the same config.

Runs ``python -m returnn CONFIG`` once and ``returnn-tpu CONFIG`` with ``local_sgd`` on 1, 2, 4, ...
logical CPU devices (the data on a thread), ``--epochs`` epochs each (default 1), one after the
other, and prints for each: the whole process's wall time, and from returnn-tpu's
``metrics.jsonl`` the seconds from its start to the end of its first train step
(``startup_seconds``), the seconds building the network and tracing the train step at the start
(``trace_seconds`` of epoch 1) and in the later epochs whose network changed (``pretrain``,
``get_network``), with their ratio to one replica.

    python benchmarks/startup.py CONFIG [--replicas 1 2 4 8] [--epochs 2] [--set KEY VALUE ...]

``--single`` runs ``distribute_strategy = "single"`` instead, with returnn-tpu's defaults (its data
producer process): the whole-process comparison with plain RETURNN on one device. ``--set``
adds ``++KEY VALUE`` to every command.
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


def run(command, folder: str) -> float:
    """Runs ``command`` in ``folder``; its wall time, or an exit naming it if it fails."""
    os.makedirs(os.path.join(folder, "out"))
    start = time.perf_counter()
    result = subprocess.run(command, cwd=folder, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", DISABLE_CUDA="1"))  # plain RETURNN: FACTS.md, "Native ops"
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed (status {result.returncode}):\n{result.stderr[-3000:]}")
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--single", action="store_true", help="distribute_strategy 'single', defaults")
    parser.add_argument("--set", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    args = parser.parse_args()
    config = os.path.abspath(args.config)
    work = tempfile.mkdtemp(prefix="returnn_tpu_startup_")
    settings = ["++model", "out/model", "++num_epochs", str(args.epochs), "++learning_rate_file", "out/lr",
                "++log", "out/log"]
    for key, value in args.set:
        settings += [f"++{key}", value]
    if args.single:
        args.replicas = [1]
    plain = run([sys.executable, "-m", "returnn", config, *settings], os.path.join(work, "plain"))
    rows = {}
    for replicas in args.replicas:
        folder = os.path.join(work, f"replicas-{replicas}")
        strategy = ["++distribute_strategy", "single", "++distribute_options", "{}"] if args.single else [
            "++distribute_strategy", "local_sgd",
            "++distribute_options", repr({"num_replicas": replicas, "data_producer": "thread"})]
        wall = run([sys.executable, "-m", "returnn_tpu.cli", config, *settings, *strategy], folder)
        with open(os.path.join(folder, "out", "metrics.jsonl")) as f:
            first, *later = [json.loads(line) for line in f]
        changes = [epoch["trace_seconds"] for epoch in later if epoch.get("trace_seconds")]
        rows[replicas] = (wall, first["startup_seconds"], first["trace_seconds"], changes)
    epochs = "one epoch" if args.epochs == 1 else f"{args.epochs} epochs"
    print(f"{os.path.basename(config)}: {epochs}; plain RETURNN (python -m returnn): {plain:.1f} s wall")
    print(f"{'replicas':>8s} {'wall s':>8s} {'vs plain':>9s} {'to 1st step s':>14s} {'vs 1 replica':>13s} "
          f"{'trace s':>8s} {'vs 1 replica':>13s}  network changes s (vs 1 replica)")
    base = rows[args.replicas[0]]
    for replicas, (wall, startup, trace, changes) in rows.items():
        change_text = " ".join(f"{seconds:.1f} ({seconds / one:.2f}x)" for seconds, one in zip(changes, base[3]))
        print(f"{replicas:8d} {wall:8.1f} {wall / plain:8.2f}x {startup:14.1f} {startup / base[1]:12.2f}x "
              f"{trace:8.1f} {trace / base[2]:12.2f}x  {change_text}")


if __name__ == "__main__":
    main()
