"""Can the survivors of a lost worker go on in the same process, without a restart? (TF 2.21: no.)

Two workers make a ``MultiWorkerMirroredStrategy`` (the package's, with its peer health check)
and all-reduce once; worker 1 then exits. Worker 0, in the same process, tries
  1. another all-reduce on the same strategy,
  2. a new strategy whose cluster is worker 0 alone,
  3. a new strategy that regroups with a replacement worker (a new process on a new port),
  4. ``configure_collective_ops`` once more,
each with a bound, and prints what happened. docs/FACTS.md ("Regrouping after a lost worker")
states the result; the restart path (``--max-restarts``, a job script's loop) is what follows.

    python benchmarks/regroup.py [--bound 30]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_cluster(ports, index):
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
                                          "task": {"type": "worker", "index": index}})


def strategy_and_all_reduce(bound: float):
    """A new strategy over TF_CONFIG's cluster and a function that all-reduces a 1 over it."""
    import tensorflow as tf

    from returnn_tpu.strategies.multi_worker import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy(None, collective_timeout=bound, bucket_bytes=1 << 20, startup_timeout=bound)
    return tf.function(lambda: strategy.reduce("SUM", strategy.run(tf.ones, args=([],)), axis=None), autograph=False)


def attempt(name: str, action, results: dict):
    try:
        results[name] = f"works: {action()}"
    except Exception as exc:  # noqa: BLE001 (what TensorFlow raises is the finding)
        results[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    print(f"worker 0: {name}: {results[name]}", flush=True)


def worker(role: str, ports, bound: float):
    sys.path.insert(0, REPO)
    if role == "replacement":
        use_cluster([ports[0], ports[2]], 1)
        results = {}
        attempt("replacement joins the survivor", lambda: float(strategy_and_all_reduce(bound)()), results)
        return
    use_cluster(ports[:2], 0 if role == "survivor" else 1)
    all_reduce = strategy_and_all_reduce(bound)
    print(f"{role}: first all-reduce {float(all_reduce())}", flush=True)
    if role == "lost":
        os._exit(0)
    time.sleep(3)
    results = {}
    attempt("the same strategy again", lambda: float(all_reduce()), results)
    use_cluster(ports[:1], 0)
    attempt("a new strategy of the survivor alone", lambda: float(strategy_and_all_reduce(bound)()), results)
    use_cluster([ports[0], ports[2]], 0)
    attempt("a new strategy with a replacement worker", lambda: float(strategy_and_all_reduce(bound)()), results)

    from tensorflow.python.eager import context

    attempt("configure_collective_ops again",
            lambda: context.context().configure_collective_ops(collective_leader="/job:worker/replica:0/task:0"),
            results)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bound", type=float, default=30.0, help="seconds each attempt may take")
    parser.add_argument("--smoke", action="store_true", help="the same experiment with a bound of 8 s")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        return worker(args.role, args.ports.split(","), args.bound)
    if args.smoke:
        args.bound = 8.0
    sockets = [socket.socket() for _ in range(3)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = ",".join(str(sock.getsockname()[1]) for sock in sockets)
    for sock in sockets:
        sock.close()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")

    def start(role):
        command = [sys.executable, __file__, "--role", role, "--ports", ports, "--bound", str(args.bound)]
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    survivor, lost = start("survivor"), start("lost")
    lost.wait(timeout=300)
    replacement = start("replacement")
    for name, proc in (("survivor", survivor), ("replacement", replacement)):
        try:
            output, _ = proc.communicate(timeout=4 * args.bound + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            output += f"{name}: still running after {4 * args.bound + 120:.0f} s (hangs); killed\n"
        print(output + f"{name}: exit status {proc.returncode}", flush=True)


if __name__ == "__main__":
    main()
