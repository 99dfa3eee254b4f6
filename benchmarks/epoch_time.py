"""Epoch time of returnn-tpu with one replica against plain RETURNN, on the same config.

Runs ``python -m returnn CONFIG`` and ``returnn-tpu CONFIG ++distribute_strategy single
++distribute_options {}`` (returnn-tpu's defaults), each in a folder of its own with ``model``
and ``log`` pointed there, one after the other, and timestamps each ``train epoch N, finished after ...`` line as it appears in the log (RETURNN's
own log lines round to whole seconds). An epoch's time is the time from one such line to the
next: the evaluation and checkpoint of the epoch before, then the epoch's training. Prints the
mean over the epochs after the first, and their ratio.

    python benchmarks/epoch_time.py CONFIG [--epochs 5] [--runs 2]

``--runs`` alternates the two that many times (the mean of the runs is printed, and each run).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCH_LINE = re.compile(r"train epoch (\d+), finished after (\d+) steps, \d+:\d\d:\d\d elapsed "
                        r"\((\d+\.\d)% computing time\)")


def timed_run(command, folder: str, log_path: str, epochs: int) -> dict:
    """Runs ``command`` in ``folder``, noting when each epoch's finishing line reaches
    ``log_path``. Returns the later epochs' mean time, steps per second and computing-time
    share (RETURNN's figure), and the whole run's wall time; exits naming the run if it fails."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    finished = {}  # epoch -> (seconds since start, steps, computing-time share)
    seen = ""
    while True:
        running = process.poll() is None
        if os.path.exists(log_path):
            with open(log_path) as f:
                seen = f.read()
            now = time.perf_counter() - start
            for match in EPOCH_LINE.finditer(seen):
                finished.setdefault(int(match.group(1)), (now, int(match.group(2)), float(match.group(3))))
        if not running:
            break
        time.sleep(0.01)
    wall = time.perf_counter() - start
    stderr = process.stderr.read()
    if process.returncode != 0 or sorted(finished) != list(range(1, epochs + 1)):
        sys.exit(f"{' '.join(command)} failed (status {process.returncode}):\n{stderr[-3000:]}\n{seen[-2000:]}")
    later = range(2, epochs + 1)
    seconds = (finished[epochs][0] - finished[1][0]) / len(later)
    return {"epoch_seconds": seconds, "steps_per_second": sum(finished[e][1] for e in later) / (seconds * len(later)),
            "share": sum(finished[e][2] for e in later) / len(later), "wall": wall}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: only that the script runs (tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.runs = 2, 1
    config = os.path.abspath(args.config)
    work = tempfile.mkdtemp(prefix="returnn_tpu_epoch_time_")
    settings = ["++model", "out/model", "++log", "out/train.log", "++num_epochs", str(args.epochs),
                "++learning_rate_file", "out/lr"]
    commands = {
        "plain RETURNN (python -m returnn)": [sys.executable, "-m", "returnn", config, *settings],
        "returnn-tpu, single": [sys.executable, "-m", "returnn_tpu.cli", config, *settings,
                                "++distribute_strategy", "single", "++distribute_options", "{}"],
    }
    results = {name: [] for name in commands}
    for run in range(args.runs):
        for name, command in commands.items():
            folder = os.path.join(work, f"{len(results[name])}-{name.split()[0]}")
            os.makedirs(os.path.join(folder, "out"))
            results[name].append(timed_run(command, folder, os.path.join(folder, "out", "train.log"), args.epochs))
            shutil.rmtree(folder)
    base = sum(r["epoch_seconds"] for r in results["plain RETURNN (python -m returnn)"]) / args.runs
    print(f"{os.path.basename(config)}: epochs 2-{args.epochs}, {args.runs} runs each, alternating")
    print(f"{'run':36s} {'s/epoch':>8s} {'vs plain':>9s} {'steps/s':>8s} {'computing':>10s}  each run (s/epoch)")
    for name, rows in results.items():
        seconds = sum(r["epoch_seconds"] for r in rows) / len(rows)
        rate = sum(r["steps_per_second"] for r in rows) / len(rows)
        share = sum(r["share"] for r in rows) / len(rows)
        each = " ".join(f"{r['epoch_seconds']:.2f}" for r in rows)
        print(f"{name:36s} {seconds:8.2f} {seconds / base:8.2f}x {rate:8.1f} {share:9.1f}%  {each}")


if __name__ == "__main__":
    main()
