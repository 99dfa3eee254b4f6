"""Goodput of local SGD when workers die: a random worker is killed (SIGKILL) every T seconds.

``returnn-tpu --local-workers W --max-restarts K`` trains a 12AX LSTM (the bundled demo's network
and data at a tenth of its learning rate, so that it still learns after minutes; one replica per
worker) for the same wall time
  * undisturbed, and
  * with a random worker killed every T seconds, for each T given,
all in one run of this script. Each kill ends the job: the survivors save the model of the last
sync (at most ``param_sync_step`` updates of work are lost), the launcher starts all workers again
and they continue there. At the end each run is stopped with SIGTERM (it saves where it is).

Printed per run: the updates that count (the optimizer's global step in the newest checkpoint:
work lost to a failure is not in it), goodput (counted updates over the undisturbed run's), the
kills, and the seconds from each kill to the next training step. Then each disturbed run is
trained on, without kills, to the epoch the undisturbed run ended in, and the dev scores of that
epoch are compared (the same updates and data).

    python benchmarks/chaos.py [--workers 2] [--minutes 10] [--kill-every 120 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

CONFIG = """#!returnn-tpu
task = "train"
train = {"class": "Task12AXDataset", "num_seqs": 500}
dev = {"class": "Task12AXDataset", "num_seqs": 100, "fixed_random_seed": 1}
num_inputs = 9
num_outputs = 2
batching = "random"
batch_size = 5000
max_seqs = 10
chunking = "200:200"
network = {
    "fw0": {"class": "rec", "unit": "standardlstm", "dropout": 0.1, "n_out": 32, "from": "data"},
    "output": {"class": "softmax", "loss": "ce", "from": "fw0"},
}
optimizer = {"class": "adam"}
learning_rate = 0.001
gradient_clip_global_norm = 5.0
learning_rate_file = "out/learning_rates"
model = "out/model"
num_epochs = 10000
log_verbosity = 5
distribute_strategy = "local_sgd"
distribute_options = {"param_sync_step": 10, "startup_timeout": 120}
"""
STEP_LINE = re.compile(r"^\[worker 0\] train epoch \d+, step \d+,")


class Run:
    """One ``--local-workers`` job in its own folder; its output lines are timestamped on arrival."""

    def __init__(self, folder: str, workers: int, extra: List[str] = ()):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "train.config"), "w") as f:
            f.write(CONFIG)
        self.folder = folder
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "returnn_tpu.cli", "--local-workers", str(workers), "--max-restarts", "1000",
             "train.config", *extra],
            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: List[tuple] = []  # (time, line)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        with open(os.path.join(self.folder, "launcher.log"), "a") as log:
            for line in self.launcher.stdout:
                self.lines.append((time.time(), line))
                log.write(f"{time.time():.2f} {line}")

    def workers(self) -> List[int]:
        """The pids of the launcher's running worker processes."""
        children = f"/proc/{self.launcher.pid}/task/{self.launcher.pid}/children"
        try:
            return [int(pid) for pid in open(children).read().split()]
        except OSError:
            return []

    def training(self) -> bool:
        return any(STEP_LINE.match(line) for _, line in self.lines[-50:])

    def stop(self) -> int:
        self.launcher.send_signal(signal.SIGTERM)
        status = self.launcher.wait(timeout=600)
        self.reader.join()
        return status

    def wait(self) -> int:
        status = self.launcher.wait()
        self.reader.join()
        return status

    def counted_updates(self) -> int:
        """The global step of the newest checkpoint (an interrupted one, or an epoch's)."""
        from returnn_tpu import checkpoints

        out = os.path.join(self.folder, "out")
        prefixes = [os.path.join(out, name[: -len(".index")]) for name in os.listdir(out) if name.endswith(".index")]
        return max(int(checkpoints.load(prefix)["global_step"]) for prefix in prefixes)

    def training_again_after(self, moment: float) -> Optional[float]:
        """When the job trained again after a kill at ``moment``: the first step after the
        launcher's next restart (the survivors train on until they find the worker lost)."""
        restart = next((t for t, line in self.lines if t > moment and "restarting all" in line), None)
        if restart is None:
            return None
        return next((t for t, line in self.lines if t > restart and STEP_LINE.match(line)), None)

    def dev_scores(self) -> dict:
        with open(os.path.join(self.folder, "out", "metrics.jsonl")) as f:
            return {record["epoch"]: record["dev_score"] for record in map(json.loads, f)}


def timed_run(folder: str, workers: int, seconds: float, kill_every: Optional[float], rng: random.Random) -> dict:
    """Trains for ``seconds`` from the first step, killing a random worker every ``kill_every`` seconds."""
    run = Run(folder, workers)
    while not run.training():
        assert run.launcher.poll() is None, "".join(line for _, line in run.lines[-40:])
        time.sleep(0.2)
    start = time.time()
    kills = []
    while time.time() - start < seconds:
        if kill_every and time.time() - (kills[-1] if kills else start) >= kill_every:
            pids = run.workers()
            if pids:
                os.kill(rng.choice(pids), signal.SIGKILL)
                kills.append(time.time())
        time.sleep(0.1)
    print(f"  stopping at {time.time():.2f} (kills at {', '.join(f'{k:.2f}' for k in kills)})", flush=True)
    status = run.stop()
    recoveries = [run.training_again_after(kill) for kill in kills]
    return {"run": run, "status": status, "updates": run.counted_updates(), "kills": len(kills),
            "recovery_seconds": [round(found - kill, 1) for kill, found in zip(kills, recoveries) if found]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=10.0, help="training time of each run")
    parser.add_argument("--kill-every", type=float, nargs="+", default=[120.0, 60.0], metavar="T")
    parser.add_argument("--seed", type=int, default=0, help="which worker each kill picks")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes: only that the script runs (tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.smoke:
        args.minutes, args.kill_every = 0.15, [5.0]
    rng = random.Random(args.seed)
    seconds = args.minutes * 60
    root = tempfile.mkdtemp(prefix="returnn_tpu_chaos_")
    print(f"{args.workers} workers, {seconds:.0f} s of training per run, in {root}", flush=True)
    baseline = timed_run(os.path.join(root, "undisturbed"), args.workers, seconds, None, rng)
    print(f"undisturbed: {baseline['updates']} updates counted ({baseline['updates'] / seconds:.1f}/s)", flush=True)
    end_epoch = max(baseline["run"].dev_scores())
    base_score = baseline["run"].dev_scores()[end_epoch]
    for kill_every in args.kill_every:
        result = timed_run(os.path.join(root, f"kill_every_{kill_every:g}"), args.workers, seconds, kill_every, rng)
        recoveries = result["recovery_seconds"]
        mean_recovery = sum(recoveries) / len(recoveries) if recoveries else float("nan")
        print(f"kill every {kill_every:g} s: {result['kills']} kills, {result['updates']} updates counted, goodput "
              f"{result['updates'] / baseline['updates']:.3f} of undisturbed; seconds from a kill to training again: "
              f"{recoveries} (mean {mean_recovery:.1f})", flush=True)
        catch_up = Run(result["run"].folder, args.workers, ["++num_epochs", str(end_epoch)])
        status = catch_up.wait()
        score = catch_up.dev_scores().get(end_epoch)
        if status or score is None:
            print(f"  could not train on to epoch {end_epoch} (status {status})", flush=True)
            continue
        print(f"  dev score at epoch {end_epoch} (the undisturbed run's last): {score:.5f} against {base_score:.5f} "
              f"undisturbed, ratio {score / base_score:.3f} (the undisturbed run's last 5 epochs: "
              f"{', '.join(f'{v:.5f}' for v in list(baseline['run'].dev_scores().values())[-5:])})", flush=True)


if __name__ == "__main__":
    main()
