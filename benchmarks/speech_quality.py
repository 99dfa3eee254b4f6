"""Local SGD's quality on speech: the main rows of the Brown table on a CTC ASR model.

Every row trains ``benchmarks/configs/speech_ctc.config`` (RETURNN's ``OggZipDataset`` over the
espeak-ng corpus of benchmarks/speech_corpus.py, 40 MFCCs from ``ExtractAudioFeatures``, a
2-layer BLSTM with CTC over characters, Adam with newbob) on the same utterances, as
benchmarks/lm_quality.py does on text: ``dataset_distribution = "shard"``, so the 4 replicas of
a step take the next 4 batches of the one order plain RETURNN walks alone, and rows differ only
in how replicas are combined. The batches are smaller than the config's (``batch_size`` 1000
frames, ``max_seqs`` 8: 1,080 batches per pass over the 2,000 utterances, 270 updates of 4
replicas), so that DiLoCo's N = 64 syncs several times per pass. Each pass is 2 sub-epochs
(``SPEECH_PARTITION_EPOCH``), each followed by a dev evaluation. Rows (options as in
benchmarks/lm_quality.py):

* ``plain``: plain RETURNN (``python -m returnn``), one device;
* ``sync_4``: ``mirrored``, 4 replicas (synchronous);
* ``local_sgd_16``; ``diloco_64`` (outer Nesterov 0.7 / momentum 0.5);
* ``diloco_64_warmup``: ``diloco_64`` after a synchronous warm-up of one sub-epoch
  (``sync_warmup_steps`` 135, post-local SGD).

For each run and sub-epoch: dev CTC loss per character (the config's ``dev_score``) and the
character error rate of greedy CTC decoding (``dev_error``). Each finished run is a JSON file in
``--out``/runs; a second start skips those. At the end: ``table.md``, ``runs.json`` and a plot
of dev CER against updates.

    python benchmarks/speech_corpus.py            # once: the corpus (2,000 + 200 utterances)
    python benchmarks/speech_quality.py [--out speech_quality] [--passes 3] [--seeds 1] [--only sync_4 diloco_64]

``--smoke`` trains two rows for one sub-epoch on a tiny corpus of its own (the test of this code).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "benchmarks", "configs", "speech_ctc.config")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import lm_quality  # noqa: E402  (benchmarks/lm_quality.py: the rows' options and the runner)
import speech_corpus  # noqa: E402

ROWS = ("plain", "sync_4", "local_sgd_16", "diloco_64", "diloco_64_warmup")
SUB_EPOCHS_PER_PASS = 2
BATCHES = ["++batch_size", "1000", "++max_seqs", "8"]
WARMUP_UPDATES = 135  # one sub-epoch: 1,080 batches per pass / 4 replicas / 2 sub-epochs


def rows() -> Dict[str, Optional[dict]]:
    """Row name -> returnn-tpu's distribute options (None: plain RETURNN): benchmarks/lm_quality.py's,
    with the warm-up one sub-epoch of this corpus."""
    text_rows = lm_quality.rows()
    table = {name: text_rows[name] for name in ROWS}
    table["diloco_64_warmup"] = dict(table["diloco_64"], sync_warmup_steps=WARMUP_UPDATES)
    return table


def run(name: str, options: Optional[dict], seed: int, corpus_dir: str, folder: str, extra: List[str]) -> dict:
    """Trains one row in ``folder``; its curve of dev CTC loss and CER per sub-epoch."""
    lm_quality.train(f"{name} (seed {seed})", lm_quality.command(name, options, seed, extra, config=CONFIG), folder,
                     SPEECH_CORPUS=corpus_dir, SPEECH_PARTITION_EPOCH=str(SUB_EPOCHS_PER_PASS))
    records, train_seconds = lm_quality.epoch_records(os.path.join(folder, "out"))
    curve = [{"epoch": r["epoch"], "updates": r["updates"], "bytes": r["bytes"],
              "dev_ctc": _value(r["errors"], "dev_score"), "dev_cer": _value(r["errors"], "dev_error")}
             for r in records]
    last = curve[-1]
    return {"row": name, "seed": seed, "options": options, "dev_ctc": last["dev_ctc"], "dev_cer": last["dev_cer"],
            "updates": last["updates"], "bytes_per_update": last["bytes"] / max(1, last["updates"]),
            "train_seconds": train_seconds, "curve": curve}


def _value(errors: Dict[str, float], key: str) -> float:
    """``dev_score`` or ``dev_error`` in a learning-rate file's entry (RETURNN may add the layer's name)."""
    return next(value for name, value in sorted(errors.items()) if name.startswith(key))


def table(results: List[dict]) -> str:
    """Per row and pass: dev CER and CTC loss (mean over seeds, ± half their range), the last pass's
    CER relative to ``sync_4``'s."""
    by_row: Dict[str, List[dict]] = {}
    for result in results:
        by_row.setdefault(result["row"], []).append(result)
    passes = max(len(r["curve"]) for r in results) // SUB_EPOCHS_PER_PASS or 1
    reference = by_row.get("sync_4")
    ref_cer = sum(r["dev_cer"] for r in reference) / len(reference) if reference else None
    header = " | ".join(f"pass {p + 1}: CER / CTC" for p in range(passes))
    lines = [f"| row | seeds | {header} | last CER vs sync_4 | updates | bytes / update |",
             "| --- | --- |" + " --- |" * passes + " --- | --- | --- |"]
    for name in rows():
        runs = by_row.get(name)
        if not runs:
            continue
        cells = []
        for p in range(passes):
            index = (p + 1) * SUB_EPOCHS_PER_PASS - 1
            points = [r["curve"][min(index, len(r["curve"]) - 1)] for r in runs]
            cer = [x["dev_cer"] for x in points]
            spread = f" ± {(max(cer) - min(cer)) / 2 * 100:.1f}" if len(runs) > 1 else ""
            cells.append(f"{100 * sum(cer) / len(cer):.1f}%{spread} / {sum(x['dev_ctc'] for x in points) / len(points):.3f}")
        cer = sum(r["dev_cer"] for r in runs) / len(runs)
        relative = f"{100 * (cer / ref_cer - 1):+.1f}%" if ref_cer else ""
        lines.append(f"| {name} | {len(runs)} | {' | '.join(cells)} | {relative} | {runs[0]['updates']} | "
                     f"{runs[0]['bytes_per_update']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: List[dict], out: str):
    """dev CER against updates, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    names = list(rows())
    for result in results:
        points = [(p["updates"], 100 * p["dev_cer"]) for p in result["curve"]]
        axes.plot(*zip(*points), color=plt.cm.tab10(names.index(result["row"]) % 10),
                  marker="osd^v"[(result["seed"] - 1) % 5], label=f"{result['row']} s{result['seed']}")
    axes.set_xlabel("updates (plain RETURNN: one batch each, 4 replicas: 4 batches)")
    axes.set_ylabel("dev CER, greedy CTC (%)")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(os.path.join(out, "dev_cer_vs_updates.png"), dpi=120)
    plt.close(figure)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="speech_quality", help="runs, table and plot (a second start resumes)")
    parser.add_argument("--corpus-dir", default=speech_corpus.DEFAULT_OUT, help="benchmarks/speech_corpus.py's folder")
    parser.add_argument("--only", nargs="*", help="these rows only")
    parser.add_argument("--seeds", type=int, default=1, help="seeds (random_seed: the initialization) per row")
    parser.add_argument("--passes", type=int, default=3, help="passes over the training utterances")
    parser.add_argument("--smoke", action="store_true", help="two rows, one sub-epoch, a tiny corpus")
    args = parser.parse_args()
    extra = [*BATCHES, "++num_epochs", str(SUB_EPOCHS_PER_PASS * args.passes)]
    names = args.only or list(ROWS)
    if args.smoke:
        args.out = tempfile.mkdtemp(prefix="speech_quality_smoke_")
        args.corpus_dir = os.path.join(args.out, "corpus")
        speech_corpus.make_tiny(args.corpus_dir)
        names, args.seeds = ["plain", "diloco_64"], 1
        extra = [*BATCHES, "++num_epochs", "1"]
    if not os.path.exists(os.path.join(args.corpus_dir, "train.zip")):
        raise SystemExit(f"speech_quality.py: no corpus in {args.corpus_dir}; run benchmarks/speech_corpus.py first")
    table_rows = rows()
    unknown = [name for name in names if name not in table_rows]
    if unknown:
        raise SystemExit(f"speech_quality.py: no row {unknown[0]!r}; rows: {', '.join(table_rows)}")
    runs = [(name, seed) for name in names for seed in range(1, args.seeds + 1)]
    results = lm_quality.run_rows(
        args.out, runs,
        lambda name, seed, folder: run(name, table_rows[name], seed, os.path.abspath(args.corpus_dir), folder, extra),
        lambda r: f"dev CER {100 * r['dev_cer']:.1f}%, CTC {r['dev_ctc']:.3f}, {r['updates']} updates, "
                  f"{r['train_seconds']:.0f} s training")
    plot(results, args.out)
    lm_quality.write_table(args.out, table(results))


if __name__ == "__main__":
    main()
