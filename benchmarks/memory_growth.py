"""Resident memory over many short epochs: how much each process grows per epoch.

Trains RETURNN's 12AX demo config (``demos/demo-local-sgd.12ax.config``, 20 sequences per epoch,
a dev set of 20) for ``--epochs`` epochs with ``returnn-tpu --local-workers N``, samples every
0.5 s the resident memory (``VmRSS``) of each worker's trainer and of its data producer, and the
epoch the run is in (the learning-rate file's newest entry). Prints, per process, the least-squares
growth in MB per epoch over the epochs after the first fifth (start-up and first traces left
out), for each ``--variant``: an environment setting such as glibc's malloc tunables, to tell
memory the program holds from memory the allocator keeps.

    python benchmarks/memory_growth.py [--epochs 120] [--workers 2] [--sync-step 1] \\
        [--variant default --variant GLIBC_TUNABLES=glibc.malloc.arena_max=2]

``--collectives N`` measures what one cross-worker collective call keeps instead, without RETURNN:
two processes on 127.0.0.1 (``TF_CONFIG``, ``MultiWorkerMirroredStrategy``) make N all-gathers of
two floats, traced (one ``tf.function``) and eager, and print each one's resident memory at
500 calls and at N, and the kB kept per call (TensorFlow issue #42616; docs/FACTS.md).
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
from typing import Dict, List, Tuple

import numpy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "demos", "demo-local-sgd.12ax.config")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from memory import _children, rss_bytes  # noqa: E402  (benchmarks/memory.py)


def _rss_mb(pid: int) -> float:
    """Resident MB of ``pid``; NaN if it ended meanwhile (left out of the fit)."""
    return rss_bytes(pid) / 2**20 or float("nan")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _processes(launcher: int) -> Dict[str, int]:
    """``{"worker N": pid, "worker N producer": pid}`` under the launcher ``launcher``."""
    children = _children()
    named = {}
    for index, worker in enumerate(sorted(children.get(launcher, []))):
        named[f"worker {index}"] = worker
        for child in children.get(worker, []):
            if "multiprocessing" in _cmdline(child) and "resource_tracker" not in _cmdline(child):
                named[f"worker {index} producer"] = child
    return named


def _epoch(lr_file: str) -> int:
    try:
        with open(lr_file) as f:
            return max((int(m) for m in re.findall(r"^\s*(\d+):", f.read(), re.M)), default=0)
    except OSError:
        return 0


def run(variant: str, epochs: int, workers: int, sync_step: int) -> Dict[str, Tuple[float, float]]:
    """One run; per process: (growth MB per epoch, RSS MB at the end)."""
    folder = tempfile.mkdtemp(prefix="returnn_tpu_memory_growth_")
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    if variant != "default":
        key, value = variant.split("=", 1)
        env[key] = value
    settings = ["++num_epochs", str(epochs), "++train", "{'class': 'Task12AXDataset', 'num_seqs': 20}",
                "++dev", "{'class': 'Task12AXDataset', 'num_seqs': 20, 'fixed_random_seed': 1}",
                "++distribute_options", repr({"param_sync_step": sync_step, "num_replicas": 1}),
                "++model", "out/model", "++learning_rate_file", "out/lr", "++log", "out/log"]
    samples: Dict[str, List[Tuple[int, float]]] = {}
    try:
        with open(os.path.join(folder, "stderr"), "w+") as stderr:
            process = subprocess.Popen([sys.executable, "-m", "returnn_tpu.cli", "--local-workers", str(workers),
                                        CONFIG, *settings], cwd=folder, env=env, stdout=subprocess.DEVNULL,
                                       stderr=stderr)
            while process.poll() is None:
                epoch = _epoch(os.path.join(folder, "out", "lr"))
                for name, pid in _processes(process.pid).items():
                    samples.setdefault(name, []).append((epoch, _rss_mb(pid)))
                time.sleep(0.5)
            if process.returncode != 0:
                stderr.seek(0)
                sys.exit(f"memory_growth.py: the run ({variant}) failed, status {process.returncode}:\n"
                         f"{stderr.read()[-3000:]}")
    finally:
        shutil.rmtree(folder)
    growth = {}
    for name, points in sorted(samples.items()):
        kept = [p for p in points if p[0] >= epochs // 5 and p[1] == p[1]]
        if not kept:  # a process seen only during start-up (e.g. a short-lived helper): no growth to fit
            continue
        xs, ys = numpy.array(kept).T
        slope = float(numpy.polyfit(xs, ys, 1)[0]) if len(set(xs)) > 2 else float("nan")
        growth[name] = (slope, float(ys[-1]))
    return growth


def collective_worker(index: int, ports: List[int], calls: int, traced: bool):
    """One of the two ``--collectives`` processes: prints ``RSS MB at 500 calls, at calls``."""
    import json

    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": index}})
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")  # its note on eager collectives' overhead, at every call
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    def gather():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_gather(tf.constant([1.0, 2.0]), axis=0))

    call = tf.function(gather) if traced else gather
    marks = []
    for done in range(1, calls + 1):
        call()
        if done in (500, calls):
            marks.append(_rss_mb(os.getpid()))
    print(*marks)


def per_collective(calls: int):
    from returnn_tpu.launcher import free_local_ports

    print(f"{'collective':<10s} {'worker':>6s} {'MB at 500':>10s} {f'MB at {calls}':>12s} {'kB / call':>10s}")
    for mode in ("traced", "eager"):
        ports = free_local_ports(2)
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
        workers = [subprocess.Popen([sys.executable, __file__, "--collective-worker", str(index), mode, str(calls),
                                     *map(str, ports)], env=env, stdout=subprocess.PIPE, text=True)
                   for index in range(2)]
        for index, worker in enumerate(workers):
            out, _ = worker.communicate(timeout=1800)
            if worker.returncode != 0:
                sys.exit(f"memory_growth.py: collective worker {index} ({mode}) failed, status {worker.returncode}")
            first, last = map(float, out.split())
            print(f"{mode:<10s} {index:6d} {first:10.1f} {last:12.1f} {(last - first) * 1024 / (calls - 500):10.2f}",
                  flush=True)


def main():
    if sys.argv[1:2] == ["--collective-worker"]:
        index, mode, calls, *ports = sys.argv[2:]
        return collective_worker(int(index), [int(p) for p in ports], int(calls), mode == "traced")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=120)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sync-step", type=int, default=1, help="param_sync_step")
    parser.add_argument("--variant", action="append", help="default, or KEY=VALUE set in the environment")
    parser.add_argument("--collectives", type=int, help="measure N cross-worker collective calls instead")
    parser.add_argument("--smoke", action="store_true", help="a few epochs, one worker (tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.collectives:
        return per_collective(max(args.collectives, 501))
    if args.smoke:
        args.epochs, args.workers = 6, 1
    variants = args.variant or ["default"]
    print(f"{args.epochs} epochs, --local-workers {args.workers}, param_sync_step {args.sync_step}")
    print(f"{'variant':<50s} {'process':<20s} {'MB / epoch':>10s} {'MB at end':>10s}")
    for variant in variants:
        for name, (slope, last) in run(variant, args.epochs, args.workers, args.sync_step).items():
            print(f"{variant:<50s} {name:<20s} {slope:10.3f} {last:10.0f}", flush=True)


if __name__ == "__main__":
    main()
