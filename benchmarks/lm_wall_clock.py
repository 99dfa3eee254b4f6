"""Time to quality, measured: the Brown LM's rows as two worker processes on a throttled link.

Every run trains ``benchmarks/configs/brown_lm.config`` (the character LSTM LM of
``lm_quality.py``) for ``--sub-epochs`` sub-epochs of 1/50 of a pass over the training text
(``BROWN_LM_PARTITION_EPOCH=50``; dev perplexity after each, no test set). The returnn-tpu rows
run as two worker processes, one per core of this machine with one replica each
(``dataset_distribution = "shard"``), whose every connection goes through ``relay.py``'s
throttled link (or none: ``unthrottled``). Plain RETURNN runs in one process, once. Rows:

* ``plain``: plain RETURNN, one device;
* ``multi_worker_mirrored``: a gradient all-reduce in every update;
* ``local_sgd_16``; ``diloco_64`` (Nesterov 0.7 / 0.5, docs/local_sgd.md's recommendation);
* ``diloco_64_int4_delay``: ``diloco_64`` with ``sync_dtype = "int4"`` and ``sync_delay = 4``;
* ``diloco_64_warmup``: ``diloco_64`` after a synchronous warm-up of the first sub-epoch
  (``sync_warmup_steps``; the best setting of ``lm_quality.py``'s table).

Per run, from the processes' own records: the wall seconds from the launch to each sub-epoch's
dev score (start-up and evaluation included, polled from the learning-rate file), the training
seconds of each sub-epoch with those of its syncs and of its agreements on where the epoch ends
(``metrics.jsonl``: one small all-gather, timed, whose cost on each link calibrates
``time_to_quality.py``'s small exchanges), the bytes each worker
handed to collectives, and the compute seconds per update (training seconds outside syncs).
Each run is a JSON file in ``--out``/runs (a second start skips those); at the end
``wall_clock.json`` (all runs) and ``dev_ppl_vs_wall.png`` (one panel per link), and the table
of time to the target perplexity (plain RETURNN's after its first sub-epoch) and perplexity at
the wall budget (the shortest run's end) per link. ``time_to_quality.py --check`` compares these
runs with what its model predicts.

    python benchmarks/corpus.py                     # once
    python benchmarks/lm_wall_clock.py [--out lm_wall_clock] [--links 100mbit_20ms] [--only diloco_64]

``--smoke``: two short rows on one throttled link, on a tiny corpus (the test of this code).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "benchmarks", "configs", "brown_lm.config")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import corpus  # noqa: E402  (benchmarks/corpus.py)
from lm_quality import RECOMMENDED, _score  # noqa: E402
from relay import relayed_tf_configs  # noqa: E402

PARTITION_EPOCH = 50  # sub-epochs per pass: dev perplexity after every 1/50 pass
WORKERS = 2
LINKS = {  # name -> (bits per second, latency per direction in seconds); None: no relay
    "unthrottled": None,
    "1gbit": (1e9, 0.001),
    "100mbit_20ms": (1e8, 0.020),
}


def rows(warmup_updates: int) -> Dict[str, Optional[dict]]:
    """Row name -> (strategy, distribute options); None: plain RETURNN. ``warmup_updates``: the
    updates of a worker in the first sub-epoch (the warm-up row's synchronous start)."""
    shard = {"dataset_distribution": "shard"}
    diloco_64 = dict(shard, param_sync_step=64, outer_optimizer=RECOMMENDED)
    return {
        "plain": None,
        "multi_worker_mirrored": ("multi_worker_mirrored", shard),
        "local_sgd_16": ("local_sgd", dict(shard, param_sync_step=16)),
        "diloco_64": ("local_sgd", diloco_64),
        "diloco_64_int4_delay": ("local_sgd", dict(diloco_64, sync_dtype="int4", sync_delay=4)),
        "diloco_64_warmup": ("local_sgd", dict(diloco_64, sync_warmup_steps=warmup_updates)),
    }


def _dev_scores(folder: str) -> Dict[int, float]:
    """Epoch -> dev perplexity, as far as the learning-rate file holds them now."""
    from returnn.learning_rate_control import LearningRateControl

    path = os.path.join(folder, "out", "learning_rates")
    if not os.path.exists(path):
        return {}
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # RETURNN prints each load
            control = LearningRateControl(default_learning_rate=1.0, filename=path)
    except Exception:  # caught while RETURNN rewrites it: read it at the next poll
        return {}
    scores = {}
    for epoch, data in control.epoch_data.items():
        if any(key.startswith("dev_score") for key in data.error):
            scores[epoch] = math.exp(_score(data.error, "dev"))
    return scores


def _plain_records(folder: str) -> List[dict]:
    """Plain RETURNN's epochs in the fields of returnn-tpu's ``metrics.jsonl`` that :func:`run`
    reads: its updates and training seconds (RETURNN rounds them to whole seconds), no syncs."""
    from returnn.learning_rate_control import LearningRateControl

    with contextlib.redirect_stdout(io.StringIO()):
        control = LearningRateControl(default_learning_rate=1.0, filename=os.path.join(folder, "out", "learning_rates"))
    return [{"epoch": epoch, "steps": int(data.meta["epoch_num_train_steps"]),
             "seconds": float(data.meta["epoch_train_time_secs"]), "sync_seconds": 0.0, "syncs": 0, "sync_bytes": 0}
            for epoch, data in sorted(control.epoch_data.items())]


def run(name: str, row: Optional[tuple], link: Optional[tuple], folder: str, corpus_dir: str,
        extra: List[str]) -> dict:
    """Trains one row in ``folder`` (its workers through a relay of ``link``); its curve."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.join(folder, "out"))
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", DISABLE_CUDA="1", BROWN_LM_CORPUS=corpus_dir,
               BROWN_LM_PARTITION_EPOCH=str(PARTITION_EPOCH), BROWN_LM_TEST="0")
    relays = []
    if row is None:
        commands = [[sys.executable, "-m", "returnn", CONFIG, *extra]]
        envs = [env]
    else:
        strategy, options = row
        options = dict(options, num_replicas=1)
        command = [sys.executable, "-m", "returnn_tpu.cli", CONFIG, *extra, "++distribute_strategy", strategy,
                   "++distribute_options", repr(options)]
        if link is None:
            from returnn_tpu.launcher import free_local_ports

            ports = free_local_ports(WORKERS)
            configs = [json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                   "task": {"type": "worker", "index": i}}) for i in range(WORKERS)]
        else:
            configs, relays, _ = relayed_tf_configs(WORKERS, *link)
        commands = [command] * WORKERS
        envs = [dict(env, TF_CONFIG=config) for config in configs]
    start = time.monotonic()
    logs = [open(os.path.join(folder, f"log.{i}.txt"), "w") for i in range(len(commands))]
    procs = [subprocess.Popen(c, cwd=folder, env=e, stdout=log, stderr=subprocess.STDOUT)
             for c, e, log in zip(commands, envs, logs)]
    wall: Dict[int, float] = {}
    while any(proc.poll() is None for proc in procs):
        for epoch in _dev_scores(folder):
            wall.setdefault(epoch, time.monotonic() - start)
        time.sleep(0.2)
    for relay in relays:
        relay.close()
    for log in logs:
        log.close()
    statuses = [proc.returncode for proc in procs]
    if any(statuses):
        raise SystemExit(f"lm_wall_clock.py: {name} failed with status {statuses}; see {folder}/log.*.txt")
    dev = _dev_scores(folder)
    for epoch in dev:
        wall.setdefault(epoch, time.monotonic() - start)
    records = []
    if os.path.exists(os.path.join(folder, "out", "metrics.jsonl")):
        with open(os.path.join(folder, "out", "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    else:  # plain RETURNN: its learning-rate file's meta data (whole training seconds)
        records = _plain_records(folder)
    curve, updates, train_seconds, sent = [], 0, 0.0, 0
    for epoch in sorted(dev):
        record = next((r for r in records if r["epoch"] == epoch), None)
        if record is not None:
            updates += record["steps"]
            train_seconds += record["seconds"]
            sent += record["sync_bytes"]
        curve.append({"epoch": epoch, "wall": wall[epoch], "updates": updates, "train_seconds": train_seconds,
                      "bytes": sent, "dev_ppl": dev[epoch]})
    compute = [(r["seconds"] - r["sync_seconds"]) / r["steps"] for r in records if r["steps"]]
    return {"row": name, "options": row and row[1], "link": link, "curve": curve,
            "compute_seconds_per_update": sorted(compute)[len(compute) // 2] if compute else None,
            "sync_seconds": sum(r["sync_seconds"] for r in records), "syncs": sum(r["syncs"] for r in records),
            "agreements": sum(r.get("agreements", 0) for r in records),
            "agree_seconds": sum(r.get("agree_seconds", 0.0) for r in records),
            "trace_seconds": sum(r.get("trace_seconds", 0.0) for r in records),
            "bytes_per_update": sent / updates if updates else 0,
            "startup_seconds": records[0].get("startup_seconds") if records else None}


def time_to(curve: List[dict], target: float, key: str = "wall") -> Optional[float]:
    """``key`` (wall seconds, updates, ...) at which the curve first reaches ``target``
    perplexity, linear between its points (None: not reached)."""
    before = None
    for point in curve:
        if point["dev_ppl"] <= target:
            if before is None:
                return point[key]
            share = (before["dev_ppl"] - target) / (before["dev_ppl"] - point["dev_ppl"])
            return before[key] + share * (point[key] - before[key])
        before = point
    return None


def ppl_at(curve: List[dict], budget: float, key: str = "wall") -> Optional[float]:
    """The dev perplexity of the last point within ``budget`` (None: none)."""
    within = [p["dev_ppl"] for p in curve if p[key] <= budget]
    return within[-1] if within else None


def table(results: List[dict], target: float) -> str:
    budget = min(r["curve"][-1]["wall"] for r in results)
    lines = [f"target: dev perplexity {target:.3f} (plain RETURNN after its first sub-epoch); wall budget "
             f"{budget:.0f} s (the shortest run)",
             "| link | row | s to target | updates to target | ppl at budget | final ppl | compute s / update "
             "| MB sent / update | s in sync |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(results, key=lambda r: (r["link_name"], list(rows(0)).index(r["row"]))):
        seconds, updates = time_to(r["curve"], target), time_to(r["curve"], target, "updates")
        at_budget = ppl_at(r["curve"], budget)
        compute = r["compute_seconds_per_update"]
        lines.append(f"| {r['link_name']} | {r['row']} | {'not reached' if seconds is None else f'{seconds:.0f}'} | "
                     f"{'' if updates is None or r['row'] == 'plain' else f'{updates:.0f}'} | "
                     f"{'' if at_budget is None else f'{at_budget:.3f}'} | {r['curve'][-1]['dev_ppl']:.3f} | "
                     f"{'' if compute is None else f'{compute:.3f}'} | {r['bytes_per_update'] / 1e6:.3f} | "
                     f"{r['sync_seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(results: List[dict], target: float, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({r["link_name"] for r in results if r["row"] != "plain"})
    figure, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4.2), sharey=True, squeeze=False)
    names = list(rows(0))
    for ax, link in zip(axes[0], links):
        for r in results:
            if r["link_name"] == link or r["row"] == "plain":
                ax.plot([p["wall"] for p in r["curve"]], [p["dev_ppl"] for p in r["curve"]], marker="o", markersize=3,
                        color=plt.cm.tab10(names.index(r["row"])), label=r["row"])
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_title(link)
        ax.set_xlabel("wall seconds from the launch")
    axes[0][0].set_ylabel("dev perplexity per character")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="lm_wall_clock", help="runs, table and plot (a second start resumes)")
    parser.add_argument("--corpus-dir", default=corpus.DEFAULT_OUT, help="the prepared corpus (benchmarks/corpus.py)")
    parser.add_argument("--links", nargs="*", default=list(LINKS), help=f"of {', '.join(LINKS)}")
    parser.add_argument("--only", nargs="*", help="these rows only")
    parser.add_argument("--sub-epochs", type=int, default=5, help="sub-epochs of 1/50 pass each run trains")
    parser.add_argument("--smoke", action="store_true", help="two rows, a few steps, a tiny corpus")
    args = parser.parse_args()
    extra = ["++num_epochs", str(args.sub_epochs)]
    # A worker's updates in the first sub-epoch: a pass is about 8,800 batches (lm_quality.py's runs:
    # 2,208 updates of 4 replicas), 1/50 of it over 2 workers.
    warmup = 88
    names = args.only or list(rows(warmup))
    if args.smoke:
        args.out = tempfile.mkdtemp(prefix="lm_wall_clock_smoke_")
        args.corpus_dir = os.path.join(args.out, "corpus")
        corpus.write_tiny_corpus(os.path.join(args.out, "tiny"))
        corpus.prepare(os.path.join(args.out, "tiny"), args.corpus_dir, vocab_size=100)
        names, args.links, warmup = args.only or ["plain", "diloco_64_warmup"], ["100mbit_20ms"], 2
        extra = ["++num_epochs", "2", "++batch_size", "200", "++max_seqs", "2"]
    if not os.path.exists(os.path.join(args.corpus_dir, "vocab.chars.txt")):
        raise SystemExit(f"lm_wall_clock.py: no prepared corpus in {args.corpus_dir}; run benchmarks/corpus.py first")
    table_rows = rows(warmup)
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    for name in names:
        if name not in table_rows:
            raise SystemExit(f"lm_wall_clock.py: no row {name!r}; rows: {', '.join(table_rows)}")
        for link_name in (["-"] if name == "plain" else args.links):
            done = os.path.join(args.out, "runs", f"{link_name}-{name}.json")
            if os.path.exists(done):
                continue
            result = run(name, table_rows[name], LINKS.get(link_name), os.path.join(args.out, "work", f"{link_name}-{name}"),
                         os.path.abspath(args.corpus_dir), extra)
            result["link_name"] = link_name
            with open(done, "w") as f:
                json.dump(result, f, indent=1)
            last = result["curve"][-1]
            print(f"{link_name} {name}: dev ppl {last['dev_ppl']:.3f} after {last['wall']:.0f} s", flush=True)
    results = []
    for path in sorted(glob.glob(os.path.join(args.out, "runs", "*.json"))):
        with open(path) as f:
            results.append(json.load(f))
    with open(os.path.join(args.out, "wall_clock.json"), "w") as f:
        json.dump(results, f, indent=1)
    plain = [r for r in results if r["row"] == "plain"]
    if not plain:
        raise SystemExit("lm_wall_clock.py: the target is plain RETURNN's first sub-epoch; run the row 'plain'")
    target = plain[0]["curve"][0]["dev_ppl"]
    markdown = table(results, target)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(markdown)
    plot(results, target, os.path.join(args.out, "dev_ppl_vs_wall.png"))
    print(markdown)


if __name__ == "__main__":
    main()
