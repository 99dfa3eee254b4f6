"""Time to the first step of an epoch resumed at 10%, 50% and 90% of its steps, against a fresh
start, with the data continued from where it stood (the default) and by making the batches passed
over (as before; the points beside the interrupted checkpoint removed).

For each corpus, one chain of ``returnn-tpu`` runs (one replica, the producer process, as users
run it): a fresh start stopped by SIGTERM at the first position; then, from each interrupted
checkpoint, a copy of the model folder without the recorded points resumed (the replay, ended at
its first step) and the folder itself resumed and stopped at the next position (the last ends at
its first step). A run's first step is the seconds from its process's start to its first step's
line (RETURNN's ``train epoch 1, step N``, ``log_verbosity`` 5). Corpora (benchmarks/data_scale.py's
configs: a feed-forward network, 5,000-frame batches):

- ``12ax``: RETURNN's ``Task12AXDataset`` (``--12ax-seqs`` sequences, made when asked for);
- ``hdf``: an HDF file of ``--hdf-seqs`` sequences of 80-dimensional features (its index holds
  every length, so passing over costs the batch generator only);
- ``ogg``: the espeak-ng speech of benchmarks/speech_corpus.py (``--speech-dir``) through
  ``OggZipDataset`` with 40 MFCCs and CTC, an epoch of ``--ogg-epoch-seqs`` utterances
  (``partition_epoch``): passing over decodes and extracts the features of every utterance.

    python benchmarks/resume.py [--kinds 12ax hdf ogg] [--speech-dir DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from data_scale import CONFIG, STEP_LINE, config_text, write_hdf  # noqa: E402

FRACTIONS = (0.1, 0.5, 0.9)
STOP_SECONDS = 600  # a run that neither reaches its step nor ends within this is a failure
CONTINUED = "no sequence before it is made"  # the resumed run's line when its data continues from the points


def run_until(folder: str, stop_at: int, stop=signal.SIGTERM) -> dict:
    """Runs ``returnn-tpu`` in ``folder`` until it logs step ``stop_at`` of the epoch (RETURNN's
    number; at most: its first), then sends ``stop``; its first step's number and seconds after
    the start, and whether it continued its data from the recorded points."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "returnn_tpu.cli", "train.config"], cwd=folder,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1"))
    first, from_points, tail = None, False, []
    for line in process.stdout:
        tail = (tail + [line])[-30:]
        from_points |= CONTINUED in line
        match = STEP_LINE.match(line)
        if match:
            step = int(match.group(1))
            if first is None:
                first = (step, time.perf_counter() - start)
            if step >= stop_at:
                os.killpg(process.pid, stop) if stop == signal.SIGKILL else process.send_signal(stop)
                break
        if time.perf_counter() - start > STOP_SECONDS:
            os.killpg(process.pid, signal.SIGKILL)
            break
    process.communicate(timeout=STOP_SECONDS)
    settle(process.pid)
    if first is None:
        sys.exit(f"returnn-tpu in {folder} made no step (status {process.returncode}):\n{''.join(tail)}")
    return {"step": first[0], "seconds": first[1], "from_points": from_points}


def settle(group: int, seconds: float = 30.0):
    """Waits until every process of the run's group (its data producer too) is gone, and a second
    more, so that the next run's start has the machine to itself."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    time.sleep(1.0)


def steps_of_epoch(folder: str) -> int:
    """The steps of epoch 1 of a finished run in ``folder`` (its log)."""
    with open(os.path.join(folder, "out", "train.log")) as f:
        for line in f:
            if "train epoch 1, finished after" in line:
                return int(line.split("finished after")[1].split()[0])
    sys.exit(f"no end of epoch 1 in {folder}/out/train.log")


def chain(kind: str, files: dict, size: int, partition: int, work: str, fractions=FRACTIONS) -> list:
    """The rows of one corpus: a fresh start, then each position resumed from its points and by
    replay."""
    folder = os.path.join(work, kind)
    os.makedirs(folder)
    with open(os.path.join(folder, "train.config"), "w") as f:
        if kind == "12ax":
            f.write(CONFIG.format(prelude="", train=repr({"class": "Task12AXDataset", "num_seqs": size}), num_inputs=9,
                                  num_outputs=2, loss='"loss": "ce"', input="data", target="classes", extern_data="",
                                  strategy="single", options={}))
        else:
            f.write(config_text(kind, files, size, 80, partition, "single", {}))
    probe = os.path.join(work, f"{kind}-probe")
    shutil.copytree(folder, probe)
    subprocess.run([sys.executable, "-m", "returnn_tpu.cli", "train.config"], cwd=probe, check=True,
                   capture_output=True, env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    steps = steps_of_epoch(probe)
    shutil.rmtree(probe)
    targets = [max(1, int(steps * fraction)) for fraction in fractions]
    fresh = run_until(folder, targets[0])
    rows = []
    for index, target in enumerate(targets):
        replay = os.path.join(work, f"{kind}-replay")
        shutil.copytree(folder, replay)
        for path in glob.glob(os.path.join(replay, "out", "*.streams-worker*.json")):
            os.remove(path)
        replayed = run_until(replay, 0, signal.SIGKILL)
        shutil.rmtree(replay)
        last = index + 1 == len(targets)
        resumed = run_until(folder, 0 if last else targets[index + 1], signal.SIGKILL if last else signal.SIGTERM)
        rows.append({"kind": kind, "steps": steps, "at": resumed["step"], "fresh": fresh["seconds"],
                     "continued": resumed["seconds"], "replayed": replayed["seconds"],
                     "from_points": resumed["from_points"] and not replayed["from_points"]})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["12ax", "hdf", "ogg"], choices=["12ax", "hdf", "ogg"])
    parser.add_argument("--12ax-seqs", dest="seqs_12ax", type=int, default=20000)
    parser.add_argument("--hdf-seqs", type=int, default=10000)
    parser.add_argument("--speech-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "returnn_tpu", "speech"))
    parser.add_argument("--ogg-epoch-seqs", type=int, default=2000)
    parser.add_argument("--smoke", action="store_true", help="12ax of 1,500 sequences, resumed halfway only")
    args = parser.parse_args()
    if args.smoke:
        args.kinds, args.seqs_12ax = ["12ax"], 1500
    work = tempfile.mkdtemp(prefix="resume_")
    rows = []
    try:
        for kind in args.kinds:
            files, size, partition = {}, args.seqs_12ax, 1
            if kind == "hdf":
                files["hdf"], size = os.path.join(work, "corpus.hdf"), args.hdf_seqs
                write_hdf(files["hdf"], size, 80)
            elif kind == "ogg":
                files["ogg"] = args.speech_dir
                with open(os.path.join(args.speech_dir, "stats.json")) as f:  # benchmarks/speech_corpus.py's
                    size = json.load(f)["train"]["utterances"]
                partition = max(1, size // args.ogg_epoch_seqs)
            rows += chain(kind, files, size, partition, work, (0.5,) if args.smoke else FRACTIONS)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("first step, seconds from the process's start; ratio: to the fresh start's")
    print(f"{'corpus':6} {'steps':>6} {'resumed at':>10} {'fresh s':>8} {'continued s':>11} {'ratio':>6} "
          f"{'replayed s':>10} {'ratio':>6}  from the points")
    for row in rows:
        print(f"{row['kind']:6} {row['steps']:6} {row['at']:10} {row['fresh']:8.1f} {row['continued']:11.1f} "
              f"{row['continued'] / row['fresh']:6.2f} {row['replayed']:10.1f} {row['replayed'] / row['fresh']:6.2f}"
              f"  {'yes' if row['from_points'] else 'NO'}")


if __name__ == "__main__":
    main()
