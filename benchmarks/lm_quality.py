"""Local SGD's quality on real text: the DiLoCo table, with RETURNN on the Brown corpus.

Every row trains ``benchmarks/configs/brown_lm.config`` (a character-level LSTM LM, Adam with
newbob; corpus from ``benchmarks/corpus.py``) on the same sequences: one pass over the training
text in 5 sub-epochs, ``dataset_distribution = "shard"`` (the 4 replicas of a step take the next 4
batches of the one order plain RETURNN walks through alone), so rows differ only in how replicas
are combined. Rows:

* ``plain``: plain RETURNN (``python -m returnn``), one device;
* ``plain_accum_4``: plain RETURNN with ``accum_grad_multiple_step = 4`` (meant as the updates
  ``sync_4`` makes, on one device; RETURNN's TF backend does not sum as documented:
  benchmarks/accum_parity.py);
* ``single_accum_4``: returnn-tpu's ``single`` with ``accum_grad_multiple_step = 4``: 4 batches'
  summed gradients per update on one device, what ``sync_4`` computes on 4;
* ``sync_4``: ``mirrored``, 4 replicas (synchronous);
* ``local_sgd_N`` for N = 4, 16, 64;
* ``diloco_N_paper`` (outer Nesterov 0.7 / momentum 0.9) and ``diloco_N`` (0.7 / 0.5, docs/local_sgd.md's
  recommendation) for N = 16, 64;
* ``diloco_64_fragments`` (4 fragments, ``sync_delay`` 2), ``diloco_64_int8``,
  ``diloco_64_int4`` and ``diloco_64_int4_no_ef`` (error feedback off);
* ``..._warmup``: ``local_sgd_16`` and ``diloco_64`` after a synchronous warm-up of one
  sub-epoch (``sync_warmup_steps``, post-local SGD), and ``diloco_64_warmup_half`` after half of one;
* ``..._ramp``: ``local_sgd_16`` and ``diloco_64`` with sync intervals that grow from 1 update to N
  over the first sub-epoch (``param_sync_step_ramp``);
* ``diloco_64_lr1.0`` and ``diloco_64_lr1.4``: the outer learning rate raised from 0.7 (momentum
  0.5): outer steps of 2x and 2.8x the replicas' mean change once the momentum has built up;
* ``slowmo_64``: SlowMo's outer step (learning rate 1.0, momentum 0.5) at N = 64, which follows
  the inner learning rate: newbob's cuts shrink the outer step and rescale its momentum.

``sync_4``, ``diloco_64`` and ``diloco_64_int4`` run with 3 seeds (``random_seed``: the
initialization), the others with 1. For each run: dev and test perplexity per character (the
config evaluates both after every sub-epoch), bits per character, the bytes handed to the
collectives per update (``metrics.jsonl``) and updates per second. Each finished run is a JSON
file in ``--out``/runs; a second start skips those (resume per row). At the end: ``table.md``,
``runs.json`` and two plots (dev perplexity against updates, and against bytes sent).

    python benchmarks/corpus.py                      # once: fetch and prepare the corpus
    python benchmarks/lm_quality.py [--out lm_quality] [--only sync_4 diloco_64] [--seeds 3]

``--smoke`` runs two rows for a few steps on a tiny corpus of its own (the test of this code).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "benchmarks", "configs", "brown_lm.config")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import corpus  # noqa: E402  (benchmarks/corpus.py)

REPLICAS = 4
PLAIN_ROWS = ("plain", "plain_accum_4")  # plain RETURNN's rows
ACCUMULATE_4 = ["++accum_grad_multiple_step", "4"]  # the setting of the rows named ..._accum_4
PAPER = {"class": "nesterov", "learning_rate": 0.7, "momentum": 0.9}
RECOMMENDED = {"class": "nesterov", "learning_rate": 0.7, "momentum": 0.5}
SEEDED_ROWS = ("sync_4", "diloco_64", "diloco_64_int4")
WARMUP_UPDATES = 440  # one sub-epoch of the 2,208 updates of one pass


def rows() -> Dict[str, Optional[dict]]:
    """Row name -> returnn-tpu's distribute options (None: plain RETURNN)."""
    local = {"num_replicas": REPLICAS, "dataset_distribution": "shard"}
    table: Dict[str, Optional[dict]] = {name: None for name in PLAIN_ROWS}
    table["single_accum_4"] = {}
    table["sync_4"] = dict(local)
    for n in (4, 16, 64):
        table[f"local_sgd_{n}"] = dict(local, param_sync_step=n)
    for n in (16, 64):
        table[f"diloco_{n}_paper"] = dict(local, param_sync_step=n, outer_optimizer=PAPER)
        table[f"diloco_{n}"] = dict(local, param_sync_step=n, outer_optimizer=RECOMMENDED)
    diloco_64 = table["diloco_64"]
    table["diloco_64_fragments"] = dict(diloco_64, sync_fragments=4, sync_delay=2)
    table["diloco_64_int8"] = dict(diloco_64, sync_dtype="int8")
    table["diloco_64_int4"] = dict(diloco_64, sync_dtype="int4")
    table["diloco_64_int4_no_ef"] = dict(diloco_64, sync_dtype="int4", sync_error_feedback=False)
    table["local_sgd_16_warmup"] = dict(table["local_sgd_16"], sync_warmup_steps=WARMUP_UPDATES)
    table["diloco_64_warmup"] = dict(diloco_64, sync_warmup_steps=WARMUP_UPDATES)
    table["diloco_64_warmup_half"] = dict(diloco_64, sync_warmup_steps=WARMUP_UPDATES // 2)
    table["local_sgd_16_ramp"] = dict(table["local_sgd_16"], param_sync_step_ramp=WARMUP_UPDATES)
    table["diloco_64_ramp"] = dict(diloco_64, param_sync_step_ramp=WARMUP_UPDATES)
    for outer_lr in (1.0, 1.4):
        table[f"diloco_64_lr{outer_lr}"] = dict(diloco_64, outer_optimizer=dict(RECOMMENDED, learning_rate=outer_lr))
    table["slowmo_64"] = dict(diloco_64, outer_optimizer={"class": "slowmo", "learning_rate": 1.0, "momentum": 0.5})
    return table


def command(name: str, options: Optional[dict], seed: int, extra: List[str], config: str = CONFIG) -> List[str]:
    """The command line of one row training ``config``: plain RETURNN, or returnn-tpu with the
    row's strategy and options."""
    settings = ["++random_seed", str(seed), *extra, *(ACCUMULATE_4 if name.endswith("_accum_4") else [])]
    if options is None:
        return [sys.executable, "-m", "returnn", config, *settings]
    strategy = "single" if name.startswith("single") else "mirrored" if name.startswith("sync") else "local_sgd"
    return [sys.executable, "-m", "returnn_tpu.cli", config, *settings, "++distribute_strategy", strategy,
            "++distribute_options", repr(options)]


def run(name: str, options: Optional[dict], seed: int, corpus_dir: str, folder: str, extra: List[str]) -> dict:
    """Trains one row in ``folder``; its figures (raises SystemExit naming it if it fails)."""
    start = time.time()
    train(f"{name} (seed {seed})", command(name, options, seed, extra), folder, BROWN_LM_CORPUS=corpus_dir)
    accumulated = int(ACCUMULATE_4[1]) if name.endswith("_accum_4") else 1  # micro-batches per update
    records, train_seconds = epoch_records(os.path.join(folder, "out"), accumulated)
    curve = [{"epoch": r["epoch"], "updates": r["updates"], "bytes": r["bytes"],
              "dev_ppl": math.exp(_score(r["errors"], "dev")), "test_ppl": math.exp(_score(r["errors"], "eval"))}
             for r in records]
    last = curve[-1]
    updates = last["updates"]
    return {"row": name, "seed": seed, "options": options, "dev_ppl": last["dev_ppl"], "test_ppl": last["test_ppl"],
            "dev_bpc": math.log2(last["dev_ppl"]), "test_bpc": math.log2(last["test_ppl"]), "updates": updates,
            "bytes_per_update": last["bytes"] / max(1, updates),
            "updates_per_second": updates / train_seconds if train_seconds else None,
            "wall_seconds": time.time() - start, "curve": curve}


def train(label: str, cmd: List[str], folder: str, **env: str):
    """Runs ``cmd`` in a fresh ``folder`` (its output in ``log.txt``, the config's files in
    ``out/``), with ``env`` added to the environment; SystemExit naming ``label`` if it fails."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.join(folder, "out"))
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", DISABLE_CUDA="1", **env)
    with open(os.path.join(folder, "log.txt"), "w") as log:
        status = subprocess.run(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if status != 0:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: {label} failed with status {status}; see {folder}/log.txt")


def epoch_records(out: str, accumulated: int = 1) -> Tuple[List[dict], float]:
    """A finished run's sub-epochs from its ``learning_rates`` file and ``metrics.jsonl`` in
    ``out``: per sub-epoch its number, the updates so far (``accumulated`` micro-batches each),
    the bytes handed to the collectives so far (syncs, or gradients) and RETURNN's scores
    (``errors``: ``dev_score``, ``dev_error``, ...); and the training seconds of all of them."""
    from returnn.learning_rate_control import LearningRateControl

    control = LearningRateControl(default_learning_rate=1.0, filename=os.path.join(out, "learning_rates"))
    epochs = sorted(control.epoch_data)
    metrics = []
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    steps, records = 0, []
    for epoch in epochs:
        data = control.epoch_data[epoch]
        steps += int(data.meta.get("epoch_num_train_steps", 0))  # micro-batches, with accumulation
        records.append({"epoch": epoch, "updates": steps // accumulated, "errors": data.error,
                        "bytes": sum(m["sync_bytes"] for m in metrics if m["epoch"] <= epoch)})
    train_seconds = sum(float(control.epoch_data[e].meta.get("epoch_train_time_secs", 0)) for e in epochs)
    return records, train_seconds


def _score(errors: Dict[str, float], dataset: str) -> float:
    """The dataset's score (nats per character) in a learning-rate file's entry: ``dev_score``, or
    ``dev_score_output`` where RETURNN names the loss's layer."""
    return next(value for key, value in sorted(errors.items()) if key.startswith(f"{dataset}_score"))


def table(results: List[dict]) -> str:
    """The markdown table: per row the mean dev and test perplexity (with several seeds: ± half
    their range, and each seed's), relative to ``sync_4``'s mean, bytes per update and updates
    per second."""
    by_row: Dict[str, List[dict]] = {}
    for result in results:
        by_row.setdefault(result["row"], []).append(result)
    reference = by_row.get("sync_4")
    ref_dev = sum(r["dev_ppl"] for r in reference) / len(reference) if reference else None
    lines = ["| row | dev ppl (seeds) | vs sync_4 | test ppl | dev bpc | bytes / update | updates / s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in rows():
        runs = by_row.get(name)
        if not runs:
            continue
        dev = sum(r["dev_ppl"] for r in runs) / len(runs)
        test = sum(r["test_ppl"] for r in runs) / len(runs)
        each = " ".join(f"{r['dev_ppl']:.3f}" for r in runs)
        spread = max(r["dev_ppl"] for r in runs) - min(r["dev_ppl"] for r in runs)
        seeds = f" ± {spread / 2:.3f} ({each})" if len(runs) > 1 else ""
        relative = f"{100 * (dev / ref_dev - 1):+.1f}%" if ref_dev else ""
        lines.append(f"| {name} | {dev:.3f}{seeds} | {relative} | {test:.3f} | {math.log2(dev):.3f} | "
                     f"{runs[0]['bytes_per_update']:.0f} | {_mean_rate(runs)} |")
    return "\n".join(lines) + "\n"


def _mean_rate(runs: List[dict]) -> str:
    rates = [r["updates_per_second"] for r in runs if r["updates_per_second"]]
    return f"{sum(rates) / len(rates):.2f}" if rates else ""


def plots(results: List[dict], out: str):
    """dev perplexity against updates and against bytes sent, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, label, name in (("updates", "updates", "dev_ppl_vs_updates.png"),
                             ("bytes", "bytes sent by a worker", "dev_ppl_vs_bytes.png")):
        figure, axes = plt.subplots(figsize=(7, 4.5))
        names = list(rows())
        for result in results:
            points = [(p[key], p["dev_ppl"]) for p in result["curve"] if key != "bytes" or p["bytes"] > 0]
            if points:  # a colour per row, a marker per seed
                axes.plot(*zip(*points), color=plt.cm.tab20(names.index(result["row"]) % 20),
                          marker="osd^v"[(result["seed"] - 1) % 5], label=f"{result['row']} s{result['seed']}")
        axes.set_xlabel(label)
        axes.set_ylabel("dev perplexity per character")
        if key == "bytes":
            axes.set_xscale("log")
        axes.legend(fontsize=6)
        figure.tight_layout()
        figure.savefig(os.path.join(out, name), dpi=120)
        plt.close(figure)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="lm_quality", help="runs, table and plots (a second start resumes)")
    parser.add_argument("--corpus-dir", default=corpus.DEFAULT_OUT, help="the prepared corpus (benchmarks/corpus.py)")
    parser.add_argument("--only", nargs="*", help="these rows only")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the rows that run with several")
    parser.add_argument("--passes", type=int, default=1,
                        help="passes over the training text (5 sub-epochs each; the table's runs: 1)")
    parser.add_argument("--smoke", action="store_true", help="two rows, a few steps, a tiny corpus")
    args = parser.parse_args()
    extra: List[str] = ["++num_epochs", str(5 * args.passes)] if args.passes != 1 else []
    names = args.only or list(rows())
    if args.smoke:
        args.out = tempfile.mkdtemp(prefix="lm_quality_smoke_")
        args.corpus_dir = os.path.join(args.out, "corpus")
        corpus.write_tiny_corpus(os.path.join(args.out, "tiny"))
        corpus.prepare(os.path.join(args.out, "tiny"), args.corpus_dir, vocab_size=100)
        names, args.seeds = ["plain", "diloco_64_int4"], 1
        extra = ["++num_epochs", "1", "++batch_size", "200"]
    if not os.path.exists(os.path.join(args.corpus_dir, "vocab.chars.txt")):
        raise SystemExit(f"lm_quality.py: no prepared corpus in {args.corpus_dir}; run benchmarks/corpus.py first")
    table_rows = rows()
    for name in names:
        if name not in table_rows:
            raise SystemExit(f"lm_quality.py: no row {name!r}; rows: {', '.join(table_rows)}")
    runs = [(name, seed) for name in names for seed in range(1, (args.seeds if name in SEEDED_ROWS else 1) + 1)]
    results = run_rows(
        args.out, runs,
        lambda name, seed, folder: run(name, table_rows[name], seed, os.path.abspath(args.corpus_dir), folder, extra),
        lambda r: f"dev ppl {r['dev_ppl']:.3f}, test ppl {r['test_ppl']:.3f}, {r['updates']} updates, "
                  f"{r['wall_seconds']:.0f} s")
    plots(results, args.out)
    write_table(args.out, table(results))


def run_rows(out: str, runs: List[Tuple[str, int]], train_one: Callable[[str, int, str], dict],
             summary: Callable[[dict], str]) -> List[dict]:
    """Trains each (row, seed) of ``runs`` that has no result in ``out``/runs yet
    (``train_one(row, seed, work folder)``, printing ``summary(result)``), so that a second start
    resumes; returns every result there, also written to ``out``/runs.json."""
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    for name, seed in runs:
        done = os.path.join(out, "runs", f"{name}-seed{seed}.json")
        if os.path.exists(done):
            continue
        result = train_one(name, seed, os.path.join(out, "work", f"{name}-seed{seed}"))
        with open(done, "w") as f:
            json.dump(result, f, indent=1)
        print(f"{name} seed {seed}: {summary(result)}", flush=True)
    results = []
    for path in sorted(glob.glob(os.path.join(out, "runs", "*.json"))):
        with open(path) as f:
            results.append(json.load(f))
    with open(os.path.join(out, "runs.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


def write_table(out: str, markdown: str):
    """``markdown`` into ``out``/table.md, and printed."""
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
