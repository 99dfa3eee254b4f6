"""Plain RETURNN and returnn-tpu on the same config, for the parity tests and by hand.

``python tests/parity.py CONFIG`` prints the comparison for one config.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "tests", "configs")
# The data producer process is not what parity tests; on a thread, a run starts one process fewer.
DATA_ON_A_THREAD = ["++distribute_options", "{'data_producer': 'thread'}"]
STEP_COST = re.compile(r"^(?:pre)?train epoch 1, step 0, (.*?), [0-9.]+ sec/step", re.M)


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", DISABLE_CUDA="1", **(extra or {}))


def run(tool: str, config: str, workdir: str, args: List[str], env=None, timeout=600) -> subprocess.CompletedProcess:
    """Runs ``tool`` ("returnn" or "returnn_tpu") on ``config`` in ``workdir``; raises on failure."""
    module = "returnn" if tool == "returnn" else "returnn_tpu.cli"
    os.makedirs(workdir, exist_ok=True)
    result = subprocess.run([sys.executable, "-m", module, config, *args], cwd=workdir, env=_env(env),
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{tool} failed on {config} (exit {result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
    return result


def initial_params(workdir: str) -> Dict[str, "numpy.ndarray"]:
    """The parameters that ``save_epoch1_initial_model`` wrote before the first update."""
    import glob

    found = glob.glob(os.path.join(workdir, "out", "model*.000.index"))
    assert len(found) == 1, found
    return initial_params_of(found[0][: -len(".index")])


def initial_params_of(prefix: str) -> Dict[str, "numpy.ndarray"]:
    """A checkpoint's parameters, optimizer state and plain RETURNN's random generator state (which
    returnn-tpu does not have, see ``returnn_bridge.StepRandomSource``) left out."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name != "global_step" and not name.startswith(("optimize/", "global_random_generator/"))
            and "/Adam" not in name and "/Momentum" not in name}


def train_epoch(tool: str, config: str, workdir: str, strategy_args: List[str] = (), env=None):
    """One epoch (or as many as ``strategy_args`` say) at log_verbosity 5, the initial model
    saved: ``(first step's costs, learning_rate_file scores of epoch 1 with its ":meta:" entries, log)``."""
    from returnn.learning_rate_control import LearningRateControl

    result = run(tool, config, workdir, ["++log_verbosity", "5", "++model", "out/model", "++save_epoch1_initial_model", "True",
                                         "++learning_rate_file", "out/lr", "++log", os.path.join(workdir, "train.log"), *strategy_args],
                 env=env)
    match = STEP_COST.search(result.stdout)
    assert match, f"{tool}: no step-0 line in the log:\n{result.stdout[-2000:]}"
    step0 = {}
    for part in match.group(1).split(", "):
        key, value = part.rsplit(" ", 1)
        step0[key] = float(value)
    control = LearningRateControl(default_learning_rate=1.0, filename=os.path.join(workdir, "out", "lr"))
    scores = dict(control.epoch_data[1].error, **{f":meta:{k}": v for k, v in control.epoch_data[1].meta.items()})
    scores[":learning_rate"] = control.epoch_data[1].learning_rate
    return step0, scores, result.stdout


def compare(config: str, workdir: str, env=None, args: List[str] = ()) -> Dict[str, object]:
    """Runs both tools (with ``args``, e.g. more epochs) and returns what the parity test checks."""
    plain_step, plain_scores, _ = train_epoch("returnn", config, os.path.join(workdir, "plain"), list(args), env=env)
    our_step, our_scores, _ = train_epoch("returnn_tpu", config, os.path.join(workdir, "ours"),
                                          [*args, "++distribute_strategy", "single", *DATA_ON_A_THREAD], env=env)
    plain = initial_params(os.path.join(workdir, "plain"))
    ours = initial_params(os.path.join(workdir, "ours"))
    return {"plain_params": plain, "our_params": ours, "plain_step": plain_step, "our_step": our_step,
            "plain_scores": plain_scores, "our_scores": our_scores}


if __name__ == "__main__":
    import tempfile

    import numpy

    out = compare(os.path.abspath(sys.argv[1]), tempfile.mkdtemp())
    p, o = out["plain_params"], out["our_params"]
    print("params only in plain:", sorted(set(p) - set(o)), "only in ours:", sorted(set(o) - set(p)))
    for name in sorted(set(p) & set(o)):
        diff = numpy.max(numpy.abs(p[name] - o[name])) if p[name].shape == o[name].shape else "shape"
        print(f"  {name}: {p[name].shape} {diff}")
    print("step 0:", out["plain_step"], out["our_step"])
    print("scores:", out["plain_scores"], out["our_scores"])
