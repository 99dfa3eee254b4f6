"""Computing-time share and steps/s when the dataset is slow to produce: plain RETURNN,
returnn-tpu reading data on a thread, and returnn-tpu with the dataset producer process.

The benchmark writes an HDF file (RETURNN's ``SimpleHDFWriter``) of long sequences of wide
frames and trains a small convolutional network on it, so that reading and padding a batch
costs about as much as its step:

* ``--dataset hdf``: RETURNN's ``HDFDataset`` on the file (lengths come from the file's index,
  the frames are read when a batch is made);
* ``--dataset features``: a ``PostprocessingDataset`` around it whose ``map_seq`` (a function in
  the config) computes log band energies from the frames, as a feature pipeline would (such
  datasets know a sequence's length only once it is processed, so making an epoch's batch
  lists processes all of it, before the first step, in every variant).

Each run trains the same config for ``--epochs`` epochs with ``single`` (one device); the
figures are of the last epoch: RETURNN's own log line (``... (N% computing time)``) and the
epoch's time from returnn-tpu's ``metrics.jsonl`` or RETURNN's log.

    python benchmarks/data_pipeline.py [--dataset hdf|features] [--seqs 300] [--epochs 2]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES_PER_FRAME, CLASSES = 200, 10

CONFIG = """#!rnn.py
import numpy
from returnn.tensor import Dim, Tensor

_time, _bands, _classes = Dim(None, name="time"), Dim(40, name="bands"), Dim({classes}, name="classes")

def _features(data, **_):
    # Log energies in 40 bands of the power spectrum of each frame of the signal, over a window of
    # 3 frames (a 512-point FFT): a feature extraction done while reading.
    signal = data["data"].raw_tensor
    padded = numpy.concatenate([signal[:1], signal, signal[-1:]])
    windows = numpy.concatenate([padded[:-2], padded[1:-1], padded[2:]], axis=1) * numpy.hanning(3 * {spf})
    spectrum = numpy.abs(numpy.fft.rfft(windows, n=512)) ** 2
    bands = numpy.log(spectrum[:, :240].reshape(len(signal), 40, 6).sum(axis=2) + 1e-6).astype("float32")
    data.data["data"] = Tensor("data", dims=[data["data"].dims[0], _bands], dtype="float32", raw_tensor=bands)
    return data

_hdf = {{"class": "HDFDataset", "files": [{hdf!r}]}}
train = _hdf if {dataset!r} == "hdf" else {{
    "class": "PostprocessingDataset",
    "dataset": _hdf,
    "map_seq": _features,
    "map_outputs": {{"data": {{"dims": [_time, _bands], "dtype": "float32"}},
                    "classes": {{"dims": [_time], "dtype": "int32", "sparse_dim": _classes}}}},
}}
num_inputs = {spf} if {dataset!r} == "hdf" else 40
num_outputs = {classes}
batch_size = 10000
max_seqs = 20
network = {{
    "h1": {{"class": "conv", "filter_size": (3,), "padding": "same", "activation": "relu", "n_out": 32,
            "from": "data"}},
    "output": {{"class": "softmax", "loss": "ce", "from": "h1"}},
}}
optimizer = {{"class": "adam"}}
learning_rate = 0.001
model = "out/model"
learning_rate_file = "out/lr"
num_epochs = {epochs}
log = "out/train.log"
log_verbosity = 4
use_tensorflow = True
distribute_strategy = "single"
distribute_options = {{"data_producer": {producer!r}}}
"""


def write_hdf(path: str, num_seqs: int):
    """Sequences of 500-1500 frames of random values with random class labels."""
    import numpy
    from returnn.datasets.hdf import SimpleHDFWriter

    rng = numpy.random.RandomState(1)
    writer = SimpleHDFWriter(path, dim=SAMPLES_PER_FRAME, ndim=2, extra_type={"classes": (CLASSES, 1, "int32")},
                             extra_labels={"classes": [str(i) for i in range(CLASSES)]})
    for seq in range(num_seqs):
        frames = int(rng.randint(500, 1500))
        signal = rng.randn(1, frames, SAMPLES_PER_FRAME).astype("float32")
        classes = rng.randint(0, CLASSES, (1, frames)).astype("int32")
        writer.insert_batch(signal, seq_len=[frames], seq_tag=[f"seq-{seq}"], extra={"classes": classes})
    writer.close()


def run(name: str, command, folder: str, epochs: int):
    start = time.perf_counter()
    result = subprocess.run(command, cwd=folder, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    wall = time.perf_counter() - start
    with open(os.path.join(folder, "out", "train.log")) as f:
        log = f.read()
    match = re.findall(r"train epoch %d, finished after (\d+) steps, (\d+):(\d\d):(\d\d) elapsed "
                       r"\((\d+\.\d)%% computing time\)" % epochs, log)
    if result.returncode != 0 or not match:
        sys.exit(f"{name} failed (status {result.returncode}):\n{result.stderr[-3000:]}")
    steps, hours, minutes, seconds, share = match[-1]
    elapsed = 3600 * int(hours) + 60 * int(minutes) + int(seconds)
    return {"name": name, "steps": int(steps), "elapsed": elapsed, "share": float(share), "wall": wall}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=("hdf", "features"), default="hdf")
    parser.add_argument("--seqs", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="returnn_tpu_data_pipeline_")
    hdf = os.path.join(work, "signal.hdf")
    write_hdf(hdf, args.seqs)
    rows = []
    for name, producer, command in [
        ("plain RETURNN (python -m returnn)", "process", [sys.executable, "-m", "returnn", "train.config"]),
        ("returnn-tpu, data on a thread", "thread", [sys.executable, "-m", "returnn_tpu.cli", "train.config"]),
        ("returnn-tpu, producer process", "process", [sys.executable, "-m", "returnn_tpu.cli", "train.config"]),
    ]:
        folder = os.path.join(work, producer + ("-plain" if "returnn_tpu" not in command[2] else ""))
        os.makedirs(os.path.join(folder, "out"))
        with open(os.path.join(folder, "train.config"), "w") as f:
            f.write(CONFIG.format(spf=SAMPLES_PER_FRAME, classes=CLASSES, hdf=hdf, epochs=args.epochs,
                                  producer=producer, dataset=args.dataset))
        rows.append(run(name, command, folder, args.epochs))
    base = rows[0]
    print(f"--dataset {args.dataset}: epoch {args.epochs} of {args.seqs} sequences:")
    print(f"{'run':38s} {'computing time':>15s} {'steps/s':>8s} {'vs plain':>9s} {'whole run':>10s}")
    for row in rows:
        rate = row["steps"] / max(row["elapsed"], 1)
        base_rate = base["steps"] / max(base["elapsed"], 1)
        print(f"{row['name']:38s} {row['share']:14.1f}% {rate:8.2f} {rate / base_rate:8.2f}x {row['wall']:9.1f}s")


if __name__ == "__main__":
    main()
