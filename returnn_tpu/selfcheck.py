"""``returnn-tpu --check``: what this machine's devices can run, in one table.

Lists the devices TensorFlow sees, then runs a few training steps of a built-in tiny network
(an LSTM on RETURNN's 12AX task) with every strategy that can run here, each in a fresh
process (device set-up happens once per process): ``single``, ``mirrored`` and ``local_sgd``,
with and without XLA; ``local_sgd_tpu``'s in-step program on local devices; ``tpu`` and
``local_sgd_tpu`` where a TPU is found; and two local workers (``--local-workers 2``). For each:
devices, median step time, whether the replicas' parameters are equal after a sync (for
synchronous strategies: after the steps), pass or fail. The exit status is 1 if any row fails.
It is what to run first on new hardware.
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

STEPS = 12  # train steps per row
TIMEOUT_SECONDS = 600  # per row

TINY_CONFIG = {  # an LSTM on RETURNN's 12AX task; local SGD for the two-worker row
    "train": {"class": "Task12AXDataset", "num_seqs": 80},
    "num_inputs": 9,
    "num_outputs": 2,
    "batch_size": 300,
    "max_seqs": 5,
    "network": {
        "fw0": {"class": "rec", "unit": "standardlstm", "n_out": 16, "from": "data"},
        "output": {"class": "softmax", "loss": "ce", "from": "fw0"},
    },
    "optimizer": {"class": "adam"},
    "learning_rate": 0.01,
    "model": "out/model",
    "num_epochs": 1,
    "log_verbosity": 3,
    "distribute_strategy": "local_sgd",
    "distribute_options": {"param_sync_step": 3, "startup_timeout": 120},
}


def tpu_present() -> bool:
    """A TPU runtime (Colab's or a Cloud TPU VM's devices, or a named TPU)."""
    return bool(os.environ.get("COLAB_TPU_ADDR") or os.environ.get("TPU_NAME")
                or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def rows() -> List[tuple]:
    """(label, strategy, distribute_options) of every in-process row this machine can run."""
    replicas = {} if _gpu_count() else {"num_replicas": 2}  # without GPUs: 2 logical CPU devices
    found = [
        ("single", "single", {}),
        ("single + XLA", "single", {"jit_compile": True}),
        ("mirrored", "mirrored", dict(replicas)),
        ("mirrored + XLA", "mirrored", dict(replicas, jit_compile=True)),
        ("local_sgd", "local_sgd", dict(replicas, param_sync_step=3)),
        ("local_sgd + XLA", "local_sgd", dict(replicas, param_sync_step=3, jit_compile=True)),
        ("local_sgd_tpu program, local devices", "local_sgd_tpu",
         dict(replicas, param_sync_step=3, cluster_resolver="local")),
    ]
    if tpu_present():
        found += [("tpu", "tpu", {}), ("local_sgd_tpu", "local_sgd_tpu", {"param_sync_step": 3})]
    return found


def _gpu_count() -> int:
    """GPUs as the driver lists them (without importing TensorFlow in the checking process)."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0


def run_row(strategy: str, options: dict) -> dict:
    """In this (fresh) process: STEPS train steps of the tiny network, then a sync; the figures."""
    import numpy
    from returnn.config import Config, set_global_config
    from returnn.log import log

    from returnn_tpu.options import DistributeOptions
    from returnn_tpu.returnn_bridge import setup_returnn
    from returnn_tpu.startup import select_backend
    from returnn_tpu.trainer import Trainer

    setup_returnn()  # before RETURNN's config module turns eager execution off
    folder = tempfile.mkdtemp(prefix="returnn_tpu_check_")
    config = Config(dict(TINY_CONFIG, model=os.path.join(folder, "model"), log=[], log_verbosity=0))
    set_global_config(config)
    select_backend(config)
    log.initialize(logs=[], verbosity=[0])
    trainer = Trainer(config, DistributeOptions.from_config_values(strategy, options))
    trainer.use_network_of_epoch(1)
    times = []
    for step, (step_batches, _) in enumerate(trainer.epoch_batches(trainer.train_datasets, 1, train=True)):
        if step == STEPS:
            break
        compilations, start = trainer.steps.compilations, time.perf_counter()
        trainer.local_sums(trainer.train_step(step_batches, 0.01))  # reads the metrics back: the step is done
        if trainer.steps.compilations == compilations:  # a step that compiled (XLA, new shape) is no step time
            times.append(time.perf_counter() - start)
    if trainer.averaging:
        trainer.sync()
    difference = 0.0
    for var in trainer.builder.variables.by_name.values():
        copies = [copy.numpy() for copy in trainer.strategy.experimental_local_results(var)]
        difference = max([difference] + [float(numpy.abs(c - copies[0]).max()) for c in copies[1:]])
    return {"devices": [str(d) for d in trainer.strategy.extended.worker_devices],
            "step_seconds": statistics.median(times[1:] or times), "max_difference": difference}


def _row_in_subprocess(strategy: str, options: dict) -> dict:
    command = [sys.executable, "-m", "returnn_tpu.selfcheck", "--row", strategy, json.dumps(options)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {TIMEOUT_SECONDS} s"}
    found = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not found:
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        return {"error": errors[-1] if errors else f"exit status {result.returncode}"}
    return json.loads(found[-1])


def _two_local_workers() -> dict:
    """``returnn-tpu --local-workers 2`` on the tiny config: both end with the same parameters."""
    folder = tempfile.mkdtemp(prefix="returnn_tpu_check_")
    with open(os.path.join(folder, "train.config"), "w") as f:
        f.write("#!returnn-tpu\n" + "".join(f"{key} = {value!r}\n" for key, value in TINY_CONFIG.items()))
    start = time.perf_counter()
    try:
        result = subprocess.run([sys.executable, "-m", "returnn_tpu.cli", "--local-workers", "2", "train.config"],
                                cwd=folder, capture_output=True, text=True, timeout=TIMEOUT_SECONDS,
                                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {TIMEOUT_SECONDS} s"}
    sums = dict(re.findall(r"\[worker (\d)\] epoch 1: parameter checksum (\S+)", result.stdout))
    steps = re.findall(r"\[worker 0\] epoch 1: (\d+) steps, (\S+) s", result.stdout)
    if result.returncode != 0 or len(sums) != 2 or not steps:
        lines = [line for line in result.stdout.splitlines() if "error" in line] or result.stdout.splitlines()[-1:]
        return {"error": lines[-1] if lines else f"exit status {result.returncode}"}
    return {"devices": ["worker 0 CPU:0", "worker 1 CPU:0"], "step_seconds": float(steps[0][1]) / int(steps[0][0]),
            "max_difference": abs(float(sums["0"]) - float(sums["1"])), "seconds": time.perf_counter() - start}


def check(out=sys.stdout) -> int:
    """Prints the device list and the table; returns the exit status."""
    listed = subprocess.run([sys.executable, "-c", "import tensorflow as tf; "
                             "print('\\n'.join(str(d) for d in tf.config.list_physical_devices()))"],
                            capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    print("devices TensorFlow sees:", file=out)
    for line in listed.stdout.splitlines():
        print(f"  {line}", file=out)
    if not tpu_present():
        print("no TPU found: the rows 'tpu' and 'local_sgd_tpu' are left out", file=out)
    print(f"\n{'strategy':40s} {'devices':>8s} {'step time':>10s} {'replicas equal':>15s}  result", file=out, flush=True)
    failed = 0
    results = [(label, _row_in_subprocess(strategy, options)) for label, strategy, options in rows()]
    results.append(("two local workers (--local-workers 2)", _two_local_workers()))
    for label, result in results:
        if "error" in result:
            failed += 1
            print(f"{label:40s} {'':>8s} {'':>10s} {'':>15s}  FAIL: {result['error']}", file=out)
            continue
        equal = result["max_difference"] <= 1e-5
        failed += not equal
        print(f"{label:40s} {len(result['devices']):8d} {1000 * result['step_seconds']:8.1f}ms "
              f"{'yes' if equal else 'NO (%.2g)' % result['max_difference']:>15s}  {'pass' if equal else 'FAIL'}",
              file=out, flush=True)
    print(f"\n{len(results) - failed} of {len(results)} passed", file=out)
    return 1 if failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "--row":
        print(json.dumps(run_row(argv[1], json.loads(argv[2]))))
        return 0
    return check()


if __name__ == "__main__":
    sys.exit(main())
