"""Computing-time share and steps/s when the dataset is slow to produce: plain RETURNN,
returnn-tpu reading data on a thread, and returnn-tpu with the dataset producer process.

The benchmark writes an HDF file (RETURNN's ``SimpleHDFWriter``) of raw "signal" frames and
trains a feed-forward network (two hidden layers of ``--units``) through a ``PostprocessingDataset`` whose ``map_seq`` (a
function in the config) computes log band energies from the signal, as a feature pipeline
would, so that producing the data costs about as much as training on it. Such a dataset
(``CachedDataset2``) knows a sequence's length only once it is processed: batches are made as
they are taken, and a producer process makes them beside training. A dev set (a part of the same
file) is evaluated after each epoch.

Each run trains the same config for ``--epochs`` epochs with ``single`` (one device); the
figures are the mean over the epochs after the first: RETURNN's own log line
(``train epoch N, finished after S steps, H:MM:SS elapsed (P% computing time)``) for the
computing time, and the times at which those lines appear for steps/s
(:func:`epoch_time.timed_run`).

With ``--workers N``, the rows are instead ``local_sgd`` on N local workers (``--local-workers
N``, sharded data) with a producer per worker, against one producer on worker 0 serving all
(``data_producer = "chief"``), which has to make N times the batches: the baseline is then the
producer per worker.

``--precomputed`` writes the features into the file and reads it with ``HDFDataset`` alone, which
knows the lengths without reading: each worker's own producer then reads only its own part.

``--serve`` measures worker 0's producer (``data_producer = "chief"``) alone, without training:
it makes the batches of 2 workers (one replica each) from the precomputed features, hands worker
0 its own through shared memory and worker 1 its own over TCP on 127.0.0.1, each taking them as
fast as it can: batches per second and MB per second (of arrays) delivered, per worker and in all.

``--loaders`` sizes a machine for speech (``data_loaders``): on the espeak-ng corpus of
benchmarks/speech_corpus.py, read as benchmarks/configs/speech_ctc.config reads it
(``OggZipDataset``: Vorbis decoding and 40 MFCCs from ``ExtractAudioFeatures``, 5,000 frames per
batch), it measures the CPU seconds one batch costs when this process makes the batches itself
(RETURNN's batching and padding included), then the batches per second a producer delivers with
1, 2, ... loader processes while the consumer only takes them (``--batches`` per row, after the
first 4), each against 1 loader; and from the CPU cost, how many accelerators one core feeds at a
given step time (one batch per replica and step).

    python benchmarks/data_pipeline.py [--seqs 1500] [--epochs 4] [--units 256 ...] [--workers N] [--precomputed]
    python benchmarks/data_pipeline.py --serve [--seqs 1500] [--epochs 4]
    python benchmarks/speech_corpus.py && python benchmarks/data_pipeline.py --loaders 1 2 [--batches 120]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from epoch_time import timed_run  # this script's folder is on the path

SAMPLES_PER_FRAME, CLASSES = 80, 10

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

def _features_of(hdf_options):
    hdf = dict(hdf_options, **{{"class": "HDFDataset", "files": [{hdf!r}]}})
    if {precomputed}:  # the file holds the features; HDFDataset knows the lengths without reading
        return hdf
    return {{
        "class": "PostprocessingDataset",
        "seq_ordering": "default",  # RETURNN would sort a dev set; the wrapped dataset orders
        "dataset": hdf,
        "map_seq": _features,
        "map_outputs": {{"data": {{"dims": [_time, _bands], "dtype": "float32"}},
                        "classes": {{"dims": [_time], "dtype": "int32", "sparse_dim": _classes}}}},
    }}

train = _features_of({{}})
dev = _features_of({{"partition_epoch": 4}})
num_inputs = 40
num_outputs = {classes}
batch_size = 5000
max_seqs = 20
network = {{
    "h1": {{"class": "linear", "activation": "relu", "n_out": {units}, "from": "data"}},
    "h2": {{"class": "linear", "activation": "relu", "n_out": {units}, "from": "h1"}},
    "output": {{"class": "softmax", "loss": "ce", "from": "h2"}},
}}
optimizer = {{"class": "adam"}}
learning_rate = 0.001
model = "out/model"
learning_rate_file = "out/lr"
num_epochs = {epochs}
log = "out/train.log"
log_verbosity = 4
use_tensorflow = True
distribute_strategy = {strategy!r}
distribute_options = {{"data_producer": {producer!r}, "dataset_distribution": "shard", "startup_timeout": 300}}
"""


def write_hdf(path: str, num_seqs: int, dim: int):
    """Sequences of 100-400 frames of ``dim`` random values (signal, or features) with random class labels."""
    import numpy
    from returnn.datasets.hdf import SimpleHDFWriter

    rng = numpy.random.RandomState(1)
    writer = SimpleHDFWriter(path, dim=dim, ndim=2, extra_type={"classes": (CLASSES, 1, "int32")},
                             extra_labels={"classes": [str(i) for i in range(CLASSES)]})
    for seq in range(num_seqs):
        frames = int(rng.randint(100, 400))
        signal = rng.randn(1, frames, dim).astype("float32")
        classes = rng.randint(0, CLASSES, (1, frames)).astype("int32")
        writer.insert_batch(signal, seq_len=[frames], seq_tag=[f"seq-{seq}"], extra={"classes": classes})
    writer.close()


def run_config(work: str, name: str, producer: str, command, units: int, args) -> dict:
    """Trains the benchmark's config with ``data_producer = producer`` by ``command`` in a folder of
    its own; returnn-tpu's runs add the later epochs' mean seconds waiting for data, in steps, and
    between two epochs' training (the evaluation and checkpoint of the epoch before), from
    ``metrics.jsonl``."""
    folder = tempfile.mkdtemp(dir=work)
    os.makedirs(os.path.join(folder, "out"))
    with open(os.path.join(folder, "train.config"), "w") as f:
        f.write(CONFIG.format(spf=SAMPLES_PER_FRAME, classes=CLASSES, hdf=os.path.join(work, "signal.hdf"),
                              epochs=args.epochs, producer=producer, units=units, precomputed=args.precomputed,
                              strategy="local_sgd" if args.workers > 1 else "single"))
    row = timed_run(command + ["train.config"], folder, os.path.join(folder, "out", "train.log"), args.epochs)
    row.update(name=name, waiting="", steps="", between="")
    metrics_path = os.path.join(folder, "out", "metrics.jsonl")
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            later = [json.loads(line) for line in f][1:]
        row["waiting"] = f"{sum(m['data_wait_seconds'] for m in later) / len(later):.2f}"
        row["steps"] = f"{sum(m['seconds'] * m['computing_time_share'] for m in later) / len(later):.2f}"
        row["between"] = f"{row['epoch_seconds'] - sum(m['seconds'] for m in later) / len(later):.2f}"
    return row


def serving_rate(work: str, args):
    """The chief producer's serving rate to 2 workers (``--serve``): a table row per worker."""
    import threading
    import time

    from returnn.config import Config

    from returnn_tpu.datapath.batching import BatchingOptions
    from returnn_tpu.datapath.producer import DataProducer, RemoteProducer
    from returnn_tpu.datapath.producer_serving import ServeOptions

    features = os.path.join(work, "features.hdf")
    write_hdf(features, args.seqs, dim=40)
    path = os.path.join(work, "serve.config")
    with open(path, "w") as f:
        f.write(CONFIG.format(spf=SAMPLES_PER_FRAME, classes=CLASSES, hdf=features,
                              epochs=args.epochs, producer="chief", units=16, precomputed=True, strategy="local_sgd"))
    config = Config()
    config.load_file(path)
    templates = {"data": {"shape": (None, 40), "dtype": "float32", "batch_dim_axis": 0},
                 "classes": {"shape": (None,), "dtype": "int32", "batch_dim_axis": 0}}
    request = dict(batching=BatchingOptions(config), data_keys=["data", "classes"], recurrent=False, train=True,
                   slots=range(2), num_slots=2, pad_last=False)
    key = os.urandom(16)
    producer = DataProducer(path, [], dataset_key="train", num_replicas=2, first_replica=0, distribution="shard",
                            prefetch=4, all_replicas=2, serve=ServeOptions("127.0.0.1", key, 2, 1))
    taken = {0: [0, 0], 1: [0, 0]}  # worker -> [batches, bytes]

    def take(worker, epoch):
        for batches, _ in epoch.steps():
            taken[worker][0] += len(batches)
            taken[worker][1] += sum(v.nbytes for batch in batches for v in batch.values())

    try:
        remote = RemoteProducer(("127.0.0.1", producer.port()), key, worker_index=1)
        start = time.perf_counter()
        for epoch in range(1, args.epochs + 1):
            other = threading.Thread(target=lambda: take(1, remote.epoch(epoch=epoch, **request)))
            other.start()
            take(0, producer.epoch(epoch=epoch, templates=templates, **request))
            other.join()
        seconds = time.perf_counter() - start
        remote.close()
    finally:
        producer.close()
    print(f"worker 0's producer serving 2 workers, {args.epochs} epochs of {args.seqs} sequences "
          f"({seconds:.1f} s in all, without training):")
    print(f"{'worker':30s} {'batches/s':>10s} {'MB/s':>8s}")
    for worker, how in ((0, "worker 0 (shared memory)"), (1, "worker 1 (TCP, 127.0.0.1)")):
        print(f"{how:30s} {taken[worker][0] / seconds:10.1f} {taken[worker][1] / seconds / 1e6:8.1f}")
    total = [sum(t[i] for t in taken.values()) for i in (0, 1)]
    print(f"{'both':30s} {total[0] / seconds:10.1f} {total[1] / seconds / 1e6:8.1f}", flush=True)


def _speech_request(config_path: str, overrides):
    """The speech config's training batches for one replica: (config, EpochBatches arguments, templates)."""
    from returnn_tpu.datapath.batching import BatchingOptions, template_shapes
    from returnn_tpu.returnn_side.network_inputs import extern_data_template
    from returnn_tpu.startup import load_config

    config = load_config(config_path, overrides)
    extern_data = extern_data_template(config)
    request = dict(epoch=1, batching=BatchingOptions(config), data_keys=["classes", "data"], recurrent=True,
                   train=True, slots=None, num_slots=None, pad_last=False)
    return config, request, extern_data, template_shapes(extern_data, ["classes", "data"])


def loader_rates(args):
    """``--loaders``: CPU seconds per speech batch in one process, then a producer's batches per
    second with each number of loader processes (the consumer only taking them)."""
    import itertools
    import statistics
    import time

    from returnn_tpu.datapath.data import EpochBatches
    from returnn_tpu.datapath.datasets import init_datasets
    from returnn_tpu.datapath.producer import DataProducer
    from returnn_tpu.datapath.producer_process import one_math_thread
    from threadpoolctl import threadpool_info, threadpool_limits

    os.environ["SPEECH_CORPUS"] = args.speech_dir
    config_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "speech_ctc.config")
    overrides = ["++max_seqs", "1"] if args.smoke else []  # smoke: enough batches in the tiny corpus
    config, request, extern_data, templates = _speech_request(config_path, overrides)
    skip = 4  # the first batches: the loaders' start and read-ahead, not their rate

    def one_process(threads):
        """CPU and wall seconds per batch, made in this process with ``threads`` BLAS threads."""
        with threadpool_limits(threads):
            batches = EpochBatches(init_datasets(config, "train"), extern_data=extern_data, prefetch=1, **request)
            steps = batches.steps()
            for _ in range(skip):
                next(steps)
            cpu, wall = time.process_time(), time.perf_counter()
            frames = sum(int(batch["data"].shape[1]) * int(batch["data"].shape[0])
                         for step, _ in itertools.islice(steps, args.batches) for batch in step)
            steps.close()
        return (time.process_time() - cpu) / args.batches, (time.perf_counter() - wall) / args.batches, frames

    default_threads = max(pool["num_threads"] for pool in threadpool_info())
    for threads in (default_threads, 1):
        cpu_per_batch, wall_per_batch, frames = one_process(threads)
        print(f"speech corpus {args.speech_dir}: one process with {threads} BLAS thread(s) makes a batch "
              f"({frames / args.batches:.0f} padded frames on average) in {cpu_per_batch * 1e3:.0f} ms of CPU "
              f"({wall_per_batch * 1e3:.0f} ms wall), {args.batches} batches after the first {skip}")
    one_math_thread()  # as the producer does: the rows below have one BLAS thread per process

    def producer_rate(loaders):
        """A producer's batches per second with ``loaders`` loader processes, the consumer only taking them."""
        producer = DataProducer(config_path, overrides, dataset_key="train", num_replicas=1, first_replica=0,
                                distribution="shard", prefetch=2, loaders=loaders)
        try:
            taken = producer.epoch(**request, templates=templates).steps()
            for _ in range(skip):
                next(taken)
            start = time.perf_counter()
            for _ in itertools.islice(taken, args.batches):
                pass
            rate = args.batches / (time.perf_counter() - start)
            taken.close()
        finally:
            producer.close()
        return rate

    rates = {loaders: [] for loaders in args.loaders}
    for _ in range(args.repeats):  # in turn, so that the machine's load falls on every row alike
        for loaders in args.loaders:
            rates[loaders].append(producer_rate(loaders))
    print(f"{'loaders':>8s} {'batches/s':>10s} {'vs ' + str(args.loaders[0]):>6s}   (median of {args.repeats}; each)")
    base = statistics.median(rates[args.loaders[0]])
    for loaders, each in rates.items():
        rate = statistics.median(each)
        print(f"{loaders:8d} {rate:10.2f} {rate / base:5.2f}x   {' '.join(f'{r:.2f}' for r in each)}", flush=True)
    print("accelerators fed per core (one batch per replica and step, from the CPU cost above):")
    for step_ms in (50, 100, 200, 500):
        print(f"  {step_ms:4d} ms steps: {step_ms / 1e3 / cpu_per_batch:5.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=1500)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--units", type=int, nargs="+", default=[256],
                        help="width of the two hidden layers (the step's cost); several: a table for each")
    parser.add_argument("--workers", type=int, default=1, help="> 1: producer per worker against one on worker 0")
    parser.add_argument("--precomputed", action="store_true",
                        help="the HDF file holds the features (read directly, no PostprocessingDataset)")
    parser.add_argument("--serve", action="store_true", help="the chief producer's serving rate to 2 workers alone")
    parser.add_argument("--loaders", type=int, nargs="+",
                        help="speech: a producer's batches per second with these numbers of loader processes")
    parser.add_argument("--batches", type=int, default=120, help="--loaders: batches timed per row")
    parser.add_argument("--repeats", type=int, default=3, help="--loaders: runs of each row, in turn")
    parser.add_argument("--speech-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "returnn_tpu", "speech"),
                        help="--loaders: benchmarks/speech_corpus.py's folder")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: only that the script runs (tests/test_benchmarks.py)")
    args = parser.parse_args()
    if args.smoke:
        args.seqs, args.epochs, args.units = 40, 2, [16]
    work = tempfile.mkdtemp(prefix="returnn_tpu_data_pipeline_")
    if args.loaders or args.smoke:
        if args.smoke:  # the tiny corpus, 2 utterances per batch
            import speech_corpus

            args.speech_dir, args.loaders, args.batches, args.repeats = os.path.join(work, "speech"), [1, 2], 2, 1
            speech_corpus.make_tiny(args.speech_dir)
        loader_rates(args)
        if args.loaders and not args.smoke:
            shutil.rmtree(work)
            return
    if args.serve or args.smoke:  # the smoke run: both parts of the script
        try:
            serving_rate(work, args)
        finally:
            if args.serve:
                shutil.rmtree(work)
        if args.serve:
            return
    write_hdf(os.path.join(work, "signal.hdf"), args.seqs, dim=40 if args.precomputed else SAMPLES_PER_FRAME)
    ours = [sys.executable, "-m", "returnn_tpu.cli"]
    if args.workers > 1:
        ours += ["--local-workers", str(args.workers)]
        runs = [(f"{args.workers} workers, a producer per worker", "process", ours),
                (f"{args.workers} workers, one producer on worker 0", "chief", ours)]
    else:
        runs = [("plain RETURNN (python -m returnn)", "process", [sys.executable, "-m", "returnn"]),
                ("returnn-tpu, data on a thread", "thread", ours),
                ("returnn-tpu, producer process", "process", ours)]
    made = "features read from the file" if args.precomputed else "features made while reading"
    try:
        for units in args.units:
            rows = [run_config(work, name, producer, command, units, args) for name, producer, command in runs]
            base = rows[0]
            print(f"{units} units, epochs 2-{args.epochs} of {args.seqs} sequences, {made} "
                  "(mean over those epochs; steps/s of worker 0; waiting: for data, s; between: "
                  "from one epoch's training to the next, s):")
            print(f"{'run':38s} {'computing time':>15s} {'steps/s':>8s} {'vs first':>9s} {'waiting s':>9s} "
                  f"{'steps s':>8s} {'between s':>10s} {'whole run':>10s}")
            for row in rows:
                print(f"{row['name']:38s} {row['share']:14.1f}% {row['steps_per_second']:8.2f} "
                      f"{row['steps_per_second'] / base['steps_per_second']:8.2f}x {row['waiting']:>9s} "
                      f"{row['steps']:>8s} {row['between']:>10s} {row['wall']:9.1f}s", flush=True)
    finally:
        shutil.rmtree(work)  # the HDF file is large


if __name__ == "__main__":
    main()
