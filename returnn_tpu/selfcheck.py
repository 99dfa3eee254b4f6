"""``returnn-tpu --check``: what this machine's devices can run, in one table.

Lists the devices TensorFlow sees, then runs a few training steps of a built-in tiny network
(an LSTM on RETURNN's 12AX task) with every strategy that can run here, one after the other in
one fresh process (the CPU split into logical devices once), each row printed as it ends:
``single``, ``mirrored`` and ``local_sgd``, with and without XLA; ``local_sgd_tpu``'s in-step program on local devices; ``tpu`` and
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
import threading
import time
from typing import Iterator, List, Optional

STEPS = 12  # train steps per row
TIMEOUT_SECONDS = 600  # per row (the process of all rows gets this times their number)

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
    # The data on a thread: the check is about devices and strategies, not the producer process.
    "distribute_options": {"param_sync_step": 3, "startup_timeout": 120, "data_producer": "thread"},
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
    from returnn_tpu.options import DistributeOptions
    from returnn_tpu.returnn_side.returnn_bridge import in_process_config
    from returnn_tpu.trainer import Trainer

    folder = tempfile.mkdtemp(prefix="returnn_tpu_check_")
    config = in_process_config(dict(TINY_CONFIG, model=os.path.join(folder, "model"), log=[], log_verbosity=0))
    trainer = Trainer(config, DistributeOptions.from_config_values(strategy, options))
    trainer.network.use_epoch(1)
    times = []
    for step, (step_batches, _) in enumerate(trainer.data.train_batches(1)):
        if step == STEPS:
            break
        compilations, start = trainer.steps.compilations, time.perf_counter()
        trainer.steps.local_sums(trainer.train_step(step_batches, 0.01))  # reads the metrics back: the step is done
        if trainer.steps.compilations == compilations:  # a step that compiled (XLA, new shape) is no step time
            times.append(time.perf_counter() - start)
    trainer.sync()
    difference = 0.0
    for var in trainer.builder.variables.by_name.values():
        copies = [copy.numpy() for copy in trainer.strategy.experimental_local_results(var)]
        difference = max([difference] + [float(numpy.abs(c - copies[0]).max()) for c in copies[1:]])
    return {"devices": [str(d) for d in trainer.strategy.extended.worker_devices],
            "step_seconds": statistics.median(times[1:] or times), "max_difference": difference}


def run_rows(selected: List[tuple], out=sys.stdout):
    """In this (fresh) process: the devices TensorFlow sees, then each row of ``selected`` (label,
    strategy, options), one JSON line each as it ends. The CPU is split into the most logical
    devices a row asks for before TensorFlow starts; every row then runs on the first of them."""
    import tensorflow as tf

    from returnn_tpu.strategies.devices import local_replica_devices

    print(json.dumps({"devices": [str(d) for d in tf.config.list_physical_devices()]}), file=out, flush=True)
    local_replica_devices(max(options.get("num_replicas", 1) for _, _, options in selected))
    for label, strategy, options in selected:
        start = time.perf_counter()
        try:
            result = run_row(strategy, options)
        except Exception as exc:  # noqa: BLE001 (a failing row is a row of the table, not the end of the check)
            result = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}
        result.update(label=label, seconds=time.perf_counter() - start)
        print(json.dumps(result), file=out, flush=True)


def _rows_in_subprocess(selected: List[tuple]) -> Iterator[dict]:
    """:func:`run_rows` in a fresh process: the device list first, then one result per row as it
    ends; rows not reached (the process died or hung) are failures naming why."""
    command = [sys.executable, "-m", "returnn_tpu.selfcheck", "--rows", json.dumps(selected)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    timer = threading.Timer(TIMEOUT_SECONDS * len(selected), proc.kill)
    timer.start()
    done = 0
    try:
        for line in proc.stdout:
            if line.startswith("{"):
                result = json.loads(line)
                done += "label" in result
                yield result
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
    errors = [line for line in proc.stderr.read().splitlines() if line.strip()]
    why = errors[-1] if errors else f"exit status {proc.returncode}"
    for label, _, _ in selected[done:]:
        yield {"label": label, "error": f"not run: the check's process ended ({why})"}


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
    """Prints the device list and the table, each row as it ends; returns the exit status."""
    selected = rows()
    print(f"running {len(selected) + 1} rows of {STEPS} steps each (one process for the rows on this machine's "
          "devices, then two local workers)", file=out, flush=True)
    failed = total = 0
    for result in _rows_in_subprocess(selected):
        if "label" not in result:
            print("devices TensorFlow sees:", file=out)
            for device in result["devices"]:
                print(f"  {device}", file=out)
            if not tpu_present():
                print("no TPU found: the rows 'tpu' and 'local_sgd_tpu' are left out", file=out)
            print(f"\n{'strategy':40s} {'devices':>8s} {'step time':>10s} {'replicas equal':>15s} {'took':>6s}  result",
                  file=out, flush=True)
            continue
        total += 1
        failed += not _print_row(result, out)
    total += 1
    failed += not _print_row(dict(_two_local_workers(), label="two local workers (--local-workers 2)"), out)
    print(f"\n{total - failed} of {total} passed", file=out)
    return 1 if failed else 0


def _print_row(result: dict, out) -> bool:
    """One row of the table; whether it passed."""
    label, took = result["label"], f"{result.get('seconds', 0):5.0f}s"
    if "error" in result:
        print(f"{label:40s} {'':>8s} {'':>10s} {'':>15s} {took:>6s}  FAIL: {result['error']}", file=out, flush=True)
        return False
    equal = result["max_difference"] <= 1e-5
    print(f"{label:40s} {len(result['devices']):8d} {1000 * result['step_seconds']:8.1f}ms "
          f"{'yes' if equal else 'NO (%.2g)' % result['max_difference']:>15s} {took:>6s}  {'pass' if equal else 'FAIL'}",
          file=out, flush=True)
    return equal


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--rows":
        run_rows([tuple(row) for row in json.loads(argv[1])])
        return 0
    return check()


if __name__ == "__main__":
    sys.exit(main())
