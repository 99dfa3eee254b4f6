"""Peak memory of a returnn-tpu worker against plain RETURNN, on the same config.

Runs ``python -m returnn CONFIG`` and ``returnn-tpu CONFIG`` (``distribute_strategy = "local_sgd"``
with ``distribute_options = {"num_replicas": 1}``: the default path with one replica, its data
producer process) one after the other, one epoch each, and samples
every 50 ms the resident memory (``VmRSS`` in ``/proc``) of the command's process and all its
descendants (returnn-tpu's worker is its trainer and its data producer). Prints each peak and the
ratio returnn-tpu / plain RETURNN.

    python benchmarks/memory.py CONFIG [CONFIG ...] [--set KEY VALUE ...]

``--set`` adds ``++KEY VALUE`` to both commands (e.g. ``--set num_epochs 2``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _children() -> dict:
    """Parent pid -> child pids, of every process now."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
            children.setdefault(parent, []).append(int(entry))
    return children


def rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` (0 if it ended meanwhile, or is a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants."""
    children, total, todo = _children(), 0, [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        total += rss_bytes(current)
    return total


def peak_rss(command, folder: str) -> int:
    """Runs ``command`` in ``folder``; its process tree's peak resident bytes (exits naming it on failure)."""
    os.makedirs(os.path.join(folder, "out"))
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", DISABLE_CUDA="1")  # FACTS.md, "Native ops"
    with open(os.path.join(folder, "stderr"), "w+") as stderr:
        process = subprocess.Popen(command, cwd=folder, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
        peak = 0
        while process.poll() is None:
            peak = max(peak, tree_rss_bytes(process.pid))
            time.sleep(0.05)
        if process.returncode != 0:
            stderr.seek(0)
            sys.exit(f"{' '.join(command)} failed (status {process.returncode}):\n{stderr.read()[-3000:]}")
    return peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--set", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    args = parser.parse_args()
    settings = ["++model", "out/model", "++num_epochs", "1", "++learning_rate_file", "out/lr", "++log", "out/log"]
    for key, value in args.set:
        settings += [f"++{key}", value]
    print(f"{'config':<44s} {'plain MB':>9s} {'returnn-tpu MB':>15s} {'ratio':>7s}")
    for config in args.configs:
        config = os.path.abspath(config)
        work = tempfile.mkdtemp(prefix="returnn_tpu_memory_")
        plain = peak_rss([sys.executable, "-m", "returnn", config, *settings], os.path.join(work, "plain"))
        ours = peak_rss([sys.executable, "-m", "returnn_tpu.cli", config, *settings,
                         "++distribute_strategy", "local_sgd", "++distribute_options", "{'num_replicas': 1}"],
                        os.path.join(work, "returnn_tpu"))
        print(f"{os.path.basename(config):<44s} {plain / 2**20:9.0f} {ours / 2**20:15.0f} {ours / plain:6.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
