"""Start-up cost of returnn-tpu by replica count, against plain RETURNN, on the same config.

Runs ``python -m returnn CONFIG`` once and ``returnn-tpu CONFIG`` with ``local_sgd`` on 1, 2, 4, ...
logical CPU devices (the data on a thread), ``--epochs`` epochs each (default 1), one after the
other, both with ``log_verbosity`` 5 (a line per step), and prints for each: the whole process's
wall time; the seconds from the command to the end of the first train step (when its line is
printed); for each network change (``pretrain``, ``get_network``), the seconds from the line
``reinit because network description differs`` (which both print) to the end of the new network's
first step; and from returnn-tpu's ``metrics.jsonl`` the seconds building the network and tracing
the train step at the start (``trace_seconds`` of epoch 1); and the steps per second from the first
step's line to the last (all the run's steps; with several replicas a step trains a batch on each).
Ratios are against plain RETURNN and against one replica.

    python benchmarks/startup.py CONFIG [--replicas 1 2 4 8] [--epochs 2] [--set KEY VALUE ...]

``--single`` runs ``distribute_strategy = "single"`` instead, with returnn-tpu's defaults (its data
producer process): the whole-process comparison with plain RETURNN on one device. ``--set``
adds ``++KEY VALUE`` to every command.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# A train step's line at log_verbosity 5 (an eval's says "eval, step 0").
FIRST_STEP = re.compile(r"epoch \d+, step 0,")
ANY_STEP = re.compile(r"train epoch \d+, step \d+,")
NETWORK_CHANGE = "reinit because network description differs"


def run(command, folder: str) -> Tuple[float, float, List[float], float]:
    """Runs ``command`` in ``folder``: its wall time, the seconds to its first train step's line,
    per network change the seconds from its announcement to the new network's first step, and the
    steps per second from the first step's line to the last; or an exit naming the command if it
    fails."""
    os.makedirs(os.path.join(folder, "out"))
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", DISABLE_CUDA="1"))  # plain RETURNN: FACTS.md, "Native ops"
    first_step, changes, change_start, tail = None, [], None, []
    steps, last_step = 0, None
    for line in process.stdout:
        now = time.perf_counter() - start
        tail = (tail + [line])[-40:]
        if ANY_STEP.search(line):
            steps, last_step = steps + 1, now
        if NETWORK_CHANGE in line:
            change_start = now
        elif FIRST_STEP.search(line):
            if first_step is None:
                first_step = now
            elif change_start is not None:
                changes.append(now - change_start)
            change_start = None
    if process.wait() != 0 or first_step is None:
        sys.exit(f"{' '.join(command)} failed (status {process.returncode}):\n{''.join(tail)}")
    rate = (steps - 1) / (last_step - first_step) if steps > 1 and last_step > first_step else float("nan")
    return time.perf_counter() - start, first_step, changes, rate


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--single", action="store_true", help="distribute_strategy 'single', defaults")
    parser.add_argument("--set", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: only that the script runs (tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.smoke:
        args.replicas, args.epochs = [1, 2], 1
    config = os.path.abspath(args.config)
    work = tempfile.mkdtemp(prefix="returnn_tpu_startup_")
    settings = ["++model", "out/model", "++num_epochs", str(args.epochs), "++learning_rate_file", "out/lr",
                "++log", "out/log", "++log_verbosity", "5"]
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
        measured = run([sys.executable, "-m", "returnn_tpu.cli", config, *settings, *strategy], folder)
        with open(os.path.join(folder, "out", "metrics.jsonl")) as f:
            trace = json.loads(f.readline())["trace_seconds"]
        rows[replicas] = (*measured, trace)
    epochs = "one epoch" if args.epochs == 1 else f"{args.epochs} epochs"
    print(f"{os.path.basename(config)}: {epochs}; plain RETURNN (python -m returnn): {plain[0]:.1f} s wall, "
          f"first step after {plain[1]:.1f} s, {plain[3]:.2f} steps/s, network changes "
          f"{' '.join(f'{s:.1f}' for s in plain[2])} s")
    print(f"{'replicas':>8s} {'wall s':>7s} {'vs plain':>9s} {'to 1st step s':>14s} {'vs plain':>9s} "
          f"{'vs 1 replica':>13s} {'trace s':>8s} {'vs 1 replica':>13s} {'steps/s':>8s} {'vs plain':>9s}  "
          "network changes s (vs plain, vs 1 replica)")
    one = rows[args.replicas[0]]
    for replicas, (wall, first_step, changes, rate, trace) in rows.items():
        change_text = " ".join(f"{seconds:.1f} ({seconds / base:.2f}x, {seconds / single:.2f}x)"
                               for seconds, base, single in zip(changes, plain[2], one[2]))
        print(f"{replicas:8d} {wall:7.1f} {wall / plain[0]:8.2f}x {first_step:14.1f} {first_step / plain[1]:8.2f}x "
              f"{first_step / one[1]:12.2f}x {trace:8.1f} {trace / one[4]:12.2f}x {rate:8.2f} {rate / plain[3]:8.2f}x  "
              f"{change_text}")


if __name__ == "__main__":
    main()
