"""Two workers on 127.0.0.1: what local SGD saves in communication, measured in one run.

A wide feed-forward network (about 8.4M parameters, little compute per step) is trained on the
same synthetic batches by
  * one worker alone ("single"); twice its samples/s is the no-communication limit of two workers,
  * two workers with ``local_sgd`` and ``param_sync_step`` 1, 10 and 100,
  * two workers with ``multi_worker_mirrored`` (a gradient all-reduce every step),
"Two independent workers at once" (no cluster, no communication, sharing the machine) shows
what the machine itself costs when two processes run side by side.

Each worker uses one thread (one core of a 2-core machine), so that twice the samples/s of one
worker alone is a limit two workers can reach without communication. Also measured: the time
of one bucketed parameter sync is compared with one raw all-reduce of a single
tensor of the same number of bytes, inside the ``param_sync_step = 100`` run.

    python benchmarks/multi_worker.py [--steps 200] [--hidden 2048]

Prints samples/s (sequences of 25 frames) per setting and the ratios docs/measured.md quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
BATCH, FRAMES, FEATURES = 4, 25, 9


def worker_main(args):
    """One worker: train ``args.steps`` steps, print a JSON line with its measurements."""
    import numpy
    import tensorflow as tf

    from returnn_tpu.cluster import resolve_cluster
    from returnn_tpu.options import DistributeOptions
    from returnn_tpu.reporting import EpochStats
    from returnn_tpu.returnn_side.returnn_bridge import in_process_config
    from returnn_tpu.trainer import Trainer

    # One core per worker: the machine's cores are shared out, so "one worker alone, x2" is a
    # limit two workers can reach without communication.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hidden = {"class": "linear", "activation": "relu", "n_out": args.hidden}
    config = in_process_config(
        {
            "task": "train",
            "train": {"class": "Task12AXDataset", "num_seqs": 4},
            "extern_data": {"data": {"dim": FEATURES}, "classes": {"dim": 2, "sparse": True}},
            "network": {
                "h1": dict(hidden, **{"from": "data"}),
                "h2": dict(hidden, **{"from": "h1"}),
                "h3": dict(hidden, **{"from": "h2"}),
                "output": {"class": "softmax", "loss": "ce", "from": "h3"},
            },
            "optimizer": {"class": "sgd"},
            "learning_rate": 0.01,
            "model": os.path.join(args.model_dir, "model"),
            "log": [],
            "log_verbosity": 0,
        }
    )
    extra = {"param_sync_step": args.sync_step} if args.strategy == "local_sgd" else {}
    options = DistributeOptions.from_config_values(args.strategy, {"startup_timeout": 120, **extra,
                                                                   **json.loads(args.options)})
    cluster = resolve_cluster("auto") if args.strategy != "single" else None
    trainer = Trainer(config, options, cluster)
    rng = numpy.random.RandomState(trainer.cluster.worker_index)
    lengths = numpy.full((args.batch,), FRAMES, "int32")
    batches = [
        {
            "data": rng.randn(args.batch, FRAMES, FEATURES).astype("float32"),
            "size:data:0": lengths,
            "classes": rng.randint(0, 2, (args.batch, FRAMES)).astype("int32"),
            "size:classes:0": lengths,
        }
        for _ in range(8)
    ]
    for i in range(args.warmup):  # warm-up: traces, first collectives (and syncs)
        trainer.train_step([batches[i % 8]], 0.01)
    trainer.workers.all_workers(0)  # barrier
    stats = EpochStats()
    start = time.perf_counter()
    for i in range(args.steps):
        trainer.train_step([batches[i % 8]], 0.01, stats)
    trainer.workers.all_workers(0)
    seconds = time.perf_counter() - start
    result = {
        "samples_per_second": trainer.steps.num_replicas * args.batch * args.steps / seconds,
        "seconds_per_update": seconds / args.steps,
        "sync_seconds": stats.sync_seconds,  # the loop's wait in local-SGD syncs
        "sync_bytes": stats.sync_bytes,
        "parameters": int(sum(numpy.prod(v.shape) for v in trainer.builder.variables.by_name.values())),
    }
    if args.measure_sync:
        result.update(measure_sync(trainer, tf))
    if trainer.cluster.is_chief:
        print("RESULT " + json.dumps(result), flush=True)


def measure_sync(trainer, tf):
    """Median seconds of one bucketed parameter sync and of one raw all-reduce of as many bytes."""
    strategy = trainer.strategy
    variables = list(trainer.steps.replica.trainable().values())
    num_floats = sum(int(v.shape.num_elements()) for v in variables)
    with strategy.scope():
        flat = tf.Variable(tf.zeros([num_floats]))

    @tf.function
    def raw_all_reduce():
        value = strategy.experimental_local_results(flat)[0]
        per_replica = strategy.experimental_distribute_values_from_function(lambda ctx: tf.identity(value))
        return strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.MEAN, [(per_replica, per_replica)])[0]

    sync_times, raw_times = [], []
    for _ in range(12):
        trainer.workers.all_workers(0)
        start = time.perf_counter()
        trainer.sync()
        sync_times.append(time.perf_counter() - start)
        trainer.workers.all_workers(0)
        start = time.perf_counter()
        strategy.experimental_local_results(raw_all_reduce())[0].numpy()
        raw_times.append(time.perf_counter() - start)
    return {"sync_seconds": statistics.median(sync_times[2:]), "raw_all_reduce_seconds": statistics.median(raw_times[2:])}


def run_setting(strategy, num_workers, steps, hidden, sync_step=1, measure_sync=False, independent=False,
                options=None, tf_configs=None, batch=BATCH, warmup=5):
    """Runs ``num_workers`` processes (one cluster, or ``independent`` ones); returns worker 0's result,
    with ``samples_per_second`` summed over the processes when they are independent. ``options``:
    more ``distribute_options``; ``tf_configs``: each worker's ``TF_CONFIG`` (default: one cluster
    on 127.0.0.1); ``batch``: sequences per step; ``warmup``: steps before the measured ones."""
    from returnn_tpu.launcher import free_local_ports

    if tf_configs is None and num_workers > 1 and not independent:
        ports = free_local_ports(num_workers)
        tf_configs = [json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                  "task": {"type": "worker", "index": index}}) for index in range(num_workers)]
    procs = []
    with tempfile.TemporaryDirectory() as model_dir:
        for index in range(num_workers):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
            if tf_configs:
                env["TF_CONFIG"] = tf_configs[index]
            cmd = [sys.executable, __file__, "--worker", "--strategy", strategy, "--steps", str(steps),
                   "--hidden", str(hidden), "--sync-step", str(sync_step), "--model-dir", model_dir,
                   "--options", json.dumps(options or {}), "--batch", str(batch), "--warmup", str(warmup)]
            if measure_sync:
                cmd.append("--measure-sync")
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [proc.communicate(timeout=1800) for proc in procs]
    errors = [err for _, err in outputs]
    outputs = [out for out, _ in outputs]
    results = [json.loads(line[len("RESULT "):]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    if not results:
        raise RuntimeError(f"{strategy} x{num_workers} gave no result:\n{outputs[0][-2000:]}{errors[0][-3000:]}")
    if independent:
        results[0]["samples_per_second"] = sum(r["samples_per_second"] for r in results)
    return results[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="single", help=argparse.SUPPRESS)
    parser.add_argument("--sync-step", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--measure-sync", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: only that the script runs (tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.hidden = 3, 16
    if args.worker:
        return worker_main(args)
    alone = run_setting("single", 1, args.steps, args.hidden)
    limit = 2 * alone["samples_per_second"]
    print(f"wide feed-forward net, {alone['parameters'] / 1e6:.1f}M parameters, {BATCH}x{FRAMES} frames per replica, "
          f"{args.steps} steps, 2 workers on 127.0.0.1")
    print(f"{'setting':32s} {'samples/s':>10s} {'of no-comm limit':>17s}")
    print(f"{'one worker alone, x2 (limit)':32s} {limit:10.1f} {1.0:17.3f}")
    if not args.smoke:  # the smoke run: one setting of each kind
        both = run_setting("single", 2, args.steps, args.hidden, independent=True)["samples_per_second"]
        print(f"{'two independent workers at once':32s} {both:10.1f} {both / limit:17.3f}")
    for sync_step in (100,) if args.smoke else (1, 10, 100):
        result = run_setting("local_sgd", 2, args.steps, args.hidden, sync_step, measure_sync=sync_step == 100)
        print(f"{'local_sgd, param_sync_step ' + str(sync_step):32s} {result['samples_per_second']:10.1f} "
              f"{result['samples_per_second'] / limit:17.3f}")
        if sync_step == 100:
            sync = result
    mirrored = run_setting("multi_worker_mirrored", 2, args.steps, args.hidden)
    print(f"{'multi_worker_mirrored':32s} {mirrored['samples_per_second']:10.1f} "
          f"{mirrored['samples_per_second'] / limit:17.3f}")
    print(f"one bucketed parameter sync: {sync['sync_seconds'] * 1000:.1f} ms; one raw all-reduce of the same bytes: "
          f"{sync['raw_all_reduce_seconds'] * 1000:.1f} ms; ratio {sync['sync_seconds'] / sync['raw_all_reduce_seconds']:.2f}")


if __name__ == "__main__":
    main()
