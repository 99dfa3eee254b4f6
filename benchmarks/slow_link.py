"""Two workers on a slow link: what each way of syncing costs when the network is 1 Gbit/s or
100 Mbit/s (1 ms latency per direction), measured in one run.

Every connection between the two worker processes goes through :mod:`relay` (a user-space TCP
relay with a rate limit per direction; this machine cannot shape traffic in the kernel). Each
worker trains the wide feed-forward net of ``multi_worker.py`` (``--hidden 2304``: 10.6M
parameters; 16 sequences of 25 frames per step) on one core, with

  * ``multi_worker_mirrored``: a gradient all-reduce in every step,
  * local SGD syncing every 16 and every 64 updates,
  * DiLoCo (``nesterov`` 0.7 / 0.5) every 64 updates in 4 fragments, immediately and overlapped
    (``sync_delay`` 1 and 4, ``sync_mix`` 0.5), and overlapped with ``int8`` / ``int4`` syncs.

Prints per setting: seconds per update, and the "exposed sync": the share of a replica's time
spent waiting in syncs (local SGD: the loop's seconds in a sync, of the run's; synchronous
training: the step time beyond the local-SGD runs' median compute time per update, of the step
time), MB each worker handed to collectives per update (``sync_bytes``), and MB that crossed the
relays per update (both directions, all traffic between the workers, start-up included).

    python benchmarks/slow_link.py [--steps 128] [--hidden 2304] [--batch 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multi_worker import run_setting  # noqa: E402
from relay import relayed_tf_configs  # noqa: E402

DILOCO = {"outer_optimizer": {"class": "nesterov", "learning_rate": 0.7, "momentum": 0.5}, "sync_fragments": 4}
SETTINGS = [  # name, strategy, param_sync_step, more distribute_options
    ("multi_worker_mirrored", "multi_worker_mirrored", None, {}),
    ("local SGD, N=16", "local_sgd", 16, {}),
    ("local SGD, N=64", "local_sgd", 64, {}),
    ("DiLoCo N=64, 4 fragments", "local_sgd", 64, DILOCO),
    ("  + tau=1", "local_sgd", 64, dict(DILOCO, sync_delay=1)),
    ("  + tau=4", "local_sgd", 64, dict(DILOCO, sync_delay=4)),
    ("  + tau=1, int8", "local_sgd", 64, dict(DILOCO, sync_delay=1, sync_dtype="int8")),
    ("  + tau=1, int4", "local_sgd", 64, dict(DILOCO, sync_delay=1, sync_dtype="int4")),
    ("  + tau=4, int4", "local_sgd", 64, dict(DILOCO, sync_delay=4, sync_dtype="int4")),
]
RATES = (1e9, 1e8)
LATENCY = 0.001


def measure(rate: float, steps: int, hidden: int, batch: int, settings) -> list:
    rows = []
    for name, strategy, sync_step, options in settings:
        configs, relays, links = relayed_tf_configs(2, rate, LATENCY)
        # Synchronous training: a few steps show its cost per step (each is one all-reduce).
        run_steps = max(4, steps // 8) if strategy == "multi_worker_mirrored" else steps
        # Warm-up: the first step and the first sync of each fragment trace their functions.
        warmup = 5 + (sync_step or 0) + options.get("sync_delay", 0)
        result = run_setting(strategy, 2, run_steps, hidden, sync_step=sync_step or 1, options=options,
                             tf_configs=configs, batch=batch, warmup=warmup)
        for relay in relays:
            relay.close()
        result.update(name=name, strategy=strategy, steps=run_steps, relayed=sum(link.sent for link in links.values()))
        rows.append(result)
    compute = statistics.median(r["seconds_per_update"] - r["sync_seconds"] / r["steps"] for r in rows
                                if r["strategy"] == "local_sgd")
    for r in rows:
        if r["strategy"] == "local_sgd":
            r["exposed"] = r["sync_seconds"] / (r["seconds_per_update"] * r["steps"])
        else:
            r["exposed"] = max(0.0, 1 - compute / r["seconds_per_update"])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=128, help="updates measured per local-SGD setting")
    parser.add_argument("--hidden", type=int, default=2304)
    parser.add_argument("--batch", type=int, default=16, help="sequences of 25 frames per step")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: only that the script runs")
    args = parser.parse_args()
    settings, rates = SETTINGS, RATES
    if args.smoke:
        args.steps, args.hidden, args.batch = 8, 16, 2
        settings = [("DiLoCo N=4, 2 fragments, tau=1, int4", "local_sgd", 4,
                     dict(DILOCO, sync_fragments=2, sync_delay=1, sync_dtype="int4"))]
        rates = (1e8,)
    for rate in rates:
        rows = measure(rate, args.steps, args.hidden, args.batch, settings)
        print(f"{rate / 1e6:g} Mbit/s per direction, {LATENCY * 1e3:g} ms latency; "
              f"{rows[0]['parameters'] / 1e6:.1f}M parameters, {args.batch}x25 frames per step, 2 workers, "
              f"{args.steps} updates per local-SGD setting (after one cycle of syncs)")
        print(f"{'setting':36s} {'s/update':>9s} {'exposed sync':>13s} {'MB sent/update':>15s} {'MB relayed/update':>18s}")
        for r in rows:
            sent, relayed = r["sync_bytes"] / r["steps"] / 1e6, r["relayed"] / r["steps"] / 1e6
            print(f"{r['name']:36s} {r['seconds_per_update']:9.3f} {r['exposed'] * 100:12.1f}% {sent:15.3f} "
                  f"{relayed:18.3f}")


if __name__ == "__main__":
    main()
