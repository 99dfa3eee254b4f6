"""Time to the first step, epoch time, steps/s and peak memory against the corpus's size: plain
RETURNN beside returnn-tpu, on corpora of 10^4 to 10^6 sequences.

The benchmark writes its corpora into a work folder (removed at the end):

- ``hdf``: an HDF file (RETURNN's ``SimpleHDFWriter``) of ``--dim``-dimensional features (80 by
  default), 50-500 frames per sequence, with a class label per frame; ``HDFDataset`` knows every
  length from the file's index, without reading the features;
- ``meta``: the same file through a ``MetaDataset`` (a ``CachedDataset2``: it knows a sequence's
  length only once it has made it);
- ``lm``: generated sentences (5-30 words of a 1,000-word vocabulary) in a text file, read by
  ``LmDataset`` (also a ``CachedDataset2``; it reads the whole text at its start, under plain
  RETURNN as here);
- ``dummy``: RETURNN's ``DummyDataset`` (sequences of 20 frames of ``--dim`` features, made when
  asked for; nothing on disk), the generated dataset of the issue that found the quadratic start.
- ``files``: the HDF corpus written as 8 files, read by RETURNN's ``DistributeFilesDataset``
  (its files dealt to the sub-epochs, each sub-epoch's ``HDFDataset`` loaded in a process of its
  own);
- ``ogg``: the espeak-ng speech of benchmarks/speech_corpus.py (``--speech-dir``; its size is the
  corpus's, whatever ``--sizes`` says) read by ``OggZipDataset`` with 40 MFCCs from
  ``ExtractAudioFeatures``, the network's loss CTC over its characters.

Every run trains one epoch of ``partition_epoch = size / --epoch-seqs`` (RETURNN's way to cut a
large corpus into sub-epochs), so that every size trains the same number of sequences and the
figures show what the corpus's size costs: a data path that reads or plans the whole corpus
before its first step, or holds it, grows with the size, one that streams does not. The network
is a small feed-forward one (hidden layer of 64 units) on ``batch_size`` 5,000 frames, so that the
data path, not the step, is what is measured.

Runs: ``plain`` (``python -m returnn``), ``single``, ``local_sgd`` on 2 local replicas (``shard``:
the same sequences as one device), ``workers`` (``--local-workers 2``, a producer per worker) and
``chief`` (``--local-workers 2``, one producer on worker 0 serving both). Figures, from the
runs' own per-step log lines (``log_verbosity`` 5, RETURNN's format, timed as they arrive):

- first step: seconds from the process's start to its first step's line;
- epoch: seconds from the start to the epoch's end line (RETURNN's ``finished after``);
- steps/s: between the first and the last step's line (with several workers, worker 0's);
- peak MB: the largest sum of resident memory (VmRSS) over the run's process tree, read every
  0.1 s (shared pages, e.g. TensorFlow's library, count once per process);
- waiting s (returnn-tpu): the epoch's seconds waiting for data, from ``metrics.jsonl``
  (``data_wait_seconds``; the first step's wait included): what the data path cost the loop.

    python benchmarks/data_scale.py [--sizes 10000 100000 1000000] [--kinds hdf meta lm]
        [--runs plain single local_sgd workers chief] [--epoch-seqs 2000] [--dim 80] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES, VOCAB = 10, 1000
FILE_PARTS = 8  # the files kind: HDF files of the corpus
STEP_LINE = re.compile(r"^(?:\[worker 0\] )?train epoch 1, step (\d+),")  # several workers: worker 0's
FINISHED_LINE = re.compile(r"^(?:\[worker 0\] )?train epoch 1, finished after (\d+) steps")

CONFIG = """#!rnn.py
{prelude}
train = {train}
num_inputs = {num_inputs}
num_outputs = {num_outputs}
batch_size = 5000
max_seqs = 40
network = {{
    "hidden": {{"class": "linear", "activation": "relu", "n_out": 64, "from": "{input}"}},
    "output": {{"class": "softmax", {loss}, "from": "hidden", "target": "{target}"}},
}}
{extern_data}
optimizer = {{"class": "adam"}}
learning_rate = 0.001
model = "out/model"
learning_rate_file = "out/lr"
num_epochs = 1
log = "out/train.log"
log_verbosity = 5
use_tensorflow = True
distribute_strategy = {strategy!r}
distribute_options = {options!r}
"""

RUNS = {  # name -> (command after the interpreter, distribute_strategy, distribute_options)
    "plain": (["-m", "returnn"], "single", {}),
    "single": (["-m", "returnn_tpu.cli"], "single", {}),
    "local_sgd": (["-m", "returnn_tpu.cli"], "local_sgd", {"num_replicas": 2, "dataset_distribution": "shard"}),
    "workers": (["-m", "returnn_tpu.cli", "--local-workers", "2"], "local_sgd",
                {"num_replicas": 1, "dataset_distribution": "shard"}),
    "chief": (["-m", "returnn_tpu.cli", "--local-workers", "2"], "local_sgd",
              {"num_replicas": 1, "dataset_distribution": "shard", "data_producer": "chief"}),
}


def write_hdf(path: str, num_seqs: int, dim: int):
    """``num_seqs`` sequences of 50-500 frames of ``dim`` features, a class per frame (one block of
    random values reused, so that writing, not drawing numbers, is the cost)."""
    import numpy
    from returnn.datasets.hdf import SimpleHDFWriter

    rng = numpy.random.RandomState(1)
    block = rng.randn(500, dim).astype("float32")
    labels = rng.randint(0, CLASSES, 500).astype("int32")
    writer = SimpleHDFWriter(path, dim=dim, ndim=2, extra_type={"classes": (CLASSES, 1, "int32")},
                             extra_labels={"classes": [str(i) for i in range(CLASSES)]})
    lengths = rng.randint(50, 501, num_seqs)
    for seq, frames in enumerate(lengths):
        writer.insert_batch(block[None, :frames], seq_len=[int(frames)], seq_tag=[f"seq-{seq}"],
                            extra={"classes": labels[None, :frames]})
    writer.close()


def write_lm(folder: str, num_seqs: int):
    """``num_seqs`` sentences of 5-30 words from a vocabulary of :data:`VOCAB` words (plus
    ``<s>``, ``</s>``, ``<unk>``); returns the corpus and vocabulary files."""
    import numpy

    rng = numpy.random.RandomState(2)
    corpus, vocab = os.path.join(folder, "corpus.txt"), os.path.join(folder, "vocab.txt")
    words = [f"w{i}" for i in range(VOCAB)]
    with open(vocab, "w") as f:
        for index, word in enumerate(["<s>", "</s>", "<unk>"] + words):
            f.write(f"{word} {index}\n")
    with open(corpus, "w") as f:
        for length in rng.randint(5, 31, num_seqs):
            f.write(" ".join(words[i] for i in rng.zipf(1.3, length) % VOCAB) + "\n")
    return corpus, vocab


def dataset_options(kind: str, files: dict, size: int, dim: int, partition: int) -> str:
    """The config's ``train`` for corpus ``kind`` of ``size`` sequences (``files``: those written)."""
    hdf = {"class": "HDFDataset", "files": [files.get("hdf")], "partition_epoch": partition, "cache_byte_size": 0}
    if kind == "hdf":
        return repr(hdf)
    if kind == "dummy":
        return repr({"class": "DummyDataset", "input_dim": dim, "output_dim": CLASSES, "num_seqs": size,
                     "seq_len": 20, "partition_epoch": partition})
    if kind == "meta":
        return repr({"class": "MetaDataset", "datasets": {"features": hdf},
                     "data_map": {"data": ("features", "data"), "classes": ("features", "classes")},
                     "seq_order_control_dataset": "features"})
    corpus, vocab = files["lm"]
    return repr({"class": "LmDataset", "corpus_file": corpus, "orth_symbols_map_file": vocab, "word_based": True,
                 "seq_end_symbol": "</s>", "unknown_symbol": "<unk>", "add_delayed_seq_data": True,
                 "delayed_seq_data_start_symbol": "<s>", "partition_epoch": partition})


FILES_PRELUDE = """
def _sub_epoch(files):
    return {"class": "HDFDataset", "files": files, "seq_ordering": "random", "cache_byte_size": 0}
"""
CTC_LOSS = '"loss": "ctc", "loss_opts": {"ctc_opts": {"ignore_longer_outputs_than_inputs": True}}'
OGG_AUDIO = {"features": "mfcc", "num_feature_filters": 40, "window_len": 0.025, "step_len": 0.010,
             "norm_mean": "per_seq", "norm_std_dev": "per_seq"}


def config_text(kind: str, files: dict, size: int, dim: int, partition: int, strategy: str, options: dict) -> str:
    common = dict(prelude="", loss='"loss": "ce"', strategy=strategy, options=options)
    if kind == "lm":
        extern = ('extern_data = {"data": {"dim": %d, "sparse": True}, "delayed": {"dim": %d, "sparse": True}}'
                  % (VOCAB + 3, VOCAB + 3))
        return CONFIG.format(train=dataset_options(kind, files, size, dim, partition), num_inputs=VOCAB + 3,
                             num_outputs=VOCAB + 3, input="data:delayed", target="data", extern_data=extern, **common)
    if kind == "files":
        train = (f'{{"class": "DistributeFilesDataset", "files": {files["parts"]!r}, '
                 f'"get_sub_epoch_dataset": _sub_epoch, "partition_epoch": {partition}}}')
        return CONFIG.format(train=train, num_inputs=dim, num_outputs=CLASSES, input="data", target="classes",
                             extern_data="", **dict(common, prelude=FILES_PRELUDE))
    if kind == "ogg":
        chars = os.path.join(files["ogg"], "chars.vocab")
        with open(chars, encoding="utf-8") as f:
            num_chars = len(eval(f.read()))  # noqa: S307 (the corpus script's own list of characters)
        train = repr({"class": "OggZipDataset", "path": os.path.join(files["ogg"], "train.zip"), "audio": OGG_AUDIO,
                      "targets": {"class": "CharacterTargets", "vocab_file": chars, "unknown_label": None},
                      "partition_epoch": partition, "seq_ordering": "laplace:.100"})
        extern = f'extern_data = {{"data": {{"dim": 40}}, "classes": {{"dim": {num_chars}, "sparse": True}}}}'
        return CONFIG.format(train=train, num_inputs=40, num_outputs=num_chars, input="data", target="classes",
                             extern_data=extern, **dict(common, loss=CTC_LOSS))
    return CONFIG.format(train=dataset_options(kind, files, size, dim, partition), num_inputs=dim, num_outputs=CLASSES,
                         input="data", target="classes", extern_data="", **common)


def tree_rss_mb(pid: int) -> float:
    """The resident memory of process ``pid`` and all its descendants, MB."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            with open(f"/proc/{current}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def timed_run(command, folder: str) -> dict:
    """Runs ``command`` in ``folder``; the times of its first and last step and epoch end lines
    (stdout), its steps, and the peak memory of its process tree. Exits naming it if it fails."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    peak = [0.0]

    def watch():
        while process.poll() is None:
            peak[0] = max(peak[0], tree_rss_mb(process.pid))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stderr_lines: list = []
    threading.Thread(target=lambda: stderr_lines.extend(process.stderr), daemon=True).start()
    first = last = finished = None
    steps, stdout_tail = 0, []
    for line in process.stdout:
        now = time.perf_counter() - start
        stdout_tail = (stdout_tail + [line])[-40:]
        if STEP_LINE.match(line):
            first = first if first is not None else now
            last, steps = now, steps + 1
        match = FINISHED_LINE.match(line)
        if match and finished is None:
            finished = now
    process.wait()
    watcher.join()
    if process.returncode != 0 or finished is None or steps < 2:
        sys.exit(f"{' '.join(command)} in {folder} failed (status {process.returncode}):\n"
                 f"{''.join(stderr_lines)[-3000:]}\n{''.join(stdout_tail)[-3000:]}")
    return {"first_step": first, "epoch": finished, "steps": steps,
            "steps_per_second": (steps - 1) / (last - first) if last > first else float("nan"), "peak_mb": peak[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--kinds", nargs="+", default=["hdf", "meta", "lm", "dummy"],
                        choices=["hdf", "meta", "lm", "dummy", "files", "ogg"])
    parser.add_argument("--speech-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "returnn_tpu", "speech"),
                        help="ogg: benchmarks/speech_corpus.py's folder")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--epoch-seqs", type=int, default=2000, help="sequences per (sub-)epoch trained")
    parser.add_argument("--dim", type=int, default=80, help="feature dimension of the HDF corpus")
    parser.add_argument("--max-hdf-gb", type=float, default=20.0, help="larger HDF corpora are left out (disk)")
    parser.add_argument("--json", help="also write every run's figures here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: only that the script runs (tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.epoch_seqs, args.dim, args.runs, args.kinds = [400], 200, 8, ["plain", "single"], ["lm", "ogg"]
    work = tempfile.mkdtemp(prefix="returnn_tpu_data_scale_")
    if args.smoke:  # the tiny speech corpus
        import speech_corpus

        args.speech_dir = os.path.join(work, "speech")
        speech_corpus.make_tiny(args.speech_dir)
    results = []
    started = time.perf_counter()
    try:
        for size in args.sizes:
            files = {}
            if "files" in args.kinds:
                files["parts"] = [os.path.join(work, f"part{part}.{size}.hdf") for part in range(FILE_PARTS)]
                for path in files["parts"]:
                    write_hdf(path, size // FILE_PARTS, args.dim)
            if "ogg" in args.kinds:
                files["ogg"] = args.speech_dir
            if {"hdf", "meta"} & set(args.kinds):
                gb = size * 275 * (args.dim + 1) * 4 / 1e9
                if gb <= args.max_hdf_gb:
                    files["hdf"] = os.path.join(work, f"features.{size}.hdf")
                    write_hdf(files["hdf"], size, args.dim)
                else:
                    print(f"{size} sequences: the HDF corpus would take {gb:.0f} GB (--max-hdf-gb {args.max_hdf_gb}): "
                          "hdf and meta left out", flush=True)
            if "lm" in args.kinds:
                files["lm"] = write_lm(work, size)
            disk = sum(os.path.getsize(os.path.join(work, f)) for f in os.listdir(work)
                       if os.path.isfile(os.path.join(work, f))) / 1e9
            for kind in args.kinds:
                if kind in ("hdf", "meta") and "hdf" not in files:
                    continue
                rows = []
                for name in args.runs:
                    command, strategy, options = RUNS[name]
                    folder = tempfile.mkdtemp(dir=work)
                    os.makedirs(os.path.join(folder, "out"))
                    with open(os.path.join(folder, "train.config"), "w") as f:
                        f.write(config_text(kind, files, size, args.dim, max(1, size // args.epoch_seqs), strategy,
                                            options))
                    smaller = ["++max_seqs", "2"] if args.smoke and kind == "ogg" else []  # steps from 12 utterances
                    row = dict(timed_run([sys.executable, *command, "train.config", *smaller], folder), run=name, kind=kind,
                               size=size, corpus_gb=round(disk, 2), waiting=None)
                    metrics = os.path.join(folder, "out", "metrics.jsonl")
                    if os.path.exists(metrics):
                        with open(metrics) as f:
                            row["waiting"] = json.loads(f.readline())["data_wait_seconds"]
                    shutil.rmtree(folder)
                    rows.append(row)
                    results.append(row)
                base = rows[0]
                print(f"\n{kind}, {size} sequences ({args.epoch_seqs} per epoch; corpus files {disk:.2f} GB):")
                print(f"{'run':10s} {'first step s':>12s} {'vs ' + base['run']:>9s} {'epoch s':>8s} {'steps/s':>8s} "
                      f"{'vs ' + base['run']:>9s} {'peak MB':>8s} {'vs ' + base['run']:>9s} {'waiting s':>9s}")
                for row in rows:
                    print(f"{row['run']:10s} {row['first_step']:12.1f} {row['first_step'] / base['first_step']:8.2f}x "
                          f"{row['epoch']:8.1f} {row['steps_per_second']:8.2f} "
                          f"{row['steps_per_second'] / base['steps_per_second']:8.2f}x {row['peak_mb']:8.0f} "
                          f"{row['peak_mb'] / base['peak_mb']:8.2f}x "
                          f"{'' if row['waiting'] is None else format(row['waiting'], '.2f'):>9s}", flush=True)
            for name in os.listdir(work):
                if os.path.isfile(os.path.join(work, name)):
                    os.remove(os.path.join(work, name))
    finally:
        shutil.rmtree(work)
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
