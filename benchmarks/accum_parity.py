"""``accum_grad_multiple_step`` in plain RETURNN and in returnn-tpu, against its definition.

N micro-batches' gradients, summed, make one update. At a learning rate small enough that the
gradient barely changes over an epoch, the parameters then move as far with N = 2 as with N = 1
(every micro-batch an update). Each program trains tests/test_accumulation.py's config (12AX,
plain SGD at 1e-4) for one epoch with N = 1 and N = 2 from the same initial model; printed per
program: how far N = 2 moved the parameters, projected on N = 1's move (1: as defined), and the
relative difference of the two moves.

    python benchmarks/accum_parity.py [--seqs 16] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = {"plain RETURNN": [sys.executable, "-m", "returnn"], "returnn-tpu": [sys.executable, "-m", "returnn_tpu.cli"]}


def config_text(num_seqs: int) -> str:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_accumulation import CONFIG

    return CONFIG.replace('"num_seqs": 8', f'"num_seqs": {num_seqs}')


def train(program: str, folder: str, *settings: str) -> dict:
    from returnn_tpu import checkpoints

    os.makedirs(folder)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    subprocess.run([*PROGRAMS[program], os.path.join(os.path.dirname(folder), "train.config"), "++model",
                    os.path.join(folder, "model"), "++learning_rate_file", os.path.join(folder, "lr"), *settings],
                   cwd=folder, env=env, check=True, capture_output=True)
    saved = checkpoints.load(os.path.join(folder, "model" if "initialize_model" in settings else "model.001"))
    return {key: value for key, value in saved.items() if key.startswith(("hidden/", "output/"))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=16, help="training sequences (one per micro-batch)")
    parser.add_argument("--smoke", action="store_true", help="4 sequences")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="accum_parity_")
    with open(os.path.join(work, "train.config"), "w") as f:
        f.write(config_text(4 if args.smoke else args.seqs))
    start = train("plain RETURNN", os.path.join(work, "start"), "++task", "initialize_model")
    for program in PROGRAMS:
        moved = {}
        for accum in (1, 2):
            end = train(program, os.path.join(work, f"{program.replace(' ', '_')}_{accum}"),
                        "++accum_grad_multiple_step", str(accum))
            moved[accum] = numpy.concatenate([(end[key] - start[key]).ravel() for key in sorted(start)])
        projection = numpy.dot(moved[2], moved[1]) / numpy.dot(moved[1], moved[1])
        difference = numpy.linalg.norm(moved[2] - moved[1]) / numpy.linalg.norm(moved[1])
        print(f"{program}: N = 2 moved {projection:.3f}x N = 1's move (relative difference {difference:.3f})")


if __name__ == "__main__":
    main()
