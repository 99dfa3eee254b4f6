"""``accum_grad_multiple_step``: N micro-batches' gradients, summed, make one update.

RETURNN documents this, and its TF backend at the version this package installs does not do it
(docs/FACTS.md, "Accumulated gradients"): there, the update moves about 5x as far as the summed
gradient says. The test pins returnn-tpu's behaviour to the documented one."""

import numpy

from returnn_tpu import checkpoints

CONFIG = """#!rnn.py
use_tensorflow = True
task = "train"
train = {"class": "Task12AXDataset", "num_seqs": 8, "fixed_random_seed": 1}
num_inputs = 9
num_outputs = 2
batch_size = 40
max_seqs = 1
network = {
    "hidden": {"class": "linear", "activation": "tanh", "n_out": 8, "from": "data"},
    "output": {"class": "softmax", "loss": "ce", "from": "hidden"},
}
optimizer = {"class": "GradientDescent"}
learning_rate = 0.0001
num_epochs = 1
random_seed = 1
distribute_strategy = "single"
distribute_options = {"data_producer": "thread"}
"""


def _parameters(tmp_path, name: str, *settings: str) -> dict:
    from returnn_tpu import cli

    folder = tmp_path / name
    folder.mkdir()
    (folder / "train.config").write_text(CONFIG)
    assert cli.main([str(folder / "train.config"), "++model", str(folder / "model"),
                     "++learning_rate_file", str(folder / "lr"), *settings]) == 0
    saved = checkpoints.load(str(folder / ("model" if "initialize_model" in settings else "model.001")))
    return {key: value for key, value in saved.items() if key.startswith(("hidden/", "output/"))}


def test_accumulated_micro_batches_make_one_update_of_their_summed_gradient(tmp_path):
    """At a learning rate small enough that the gradient barely changes over the epoch's 8
    sequences, 4 updates of 2 summed micro-batches move the parameters as 8 updates of one do
    (to 5%; RETURNN's TF backend moved them 4.97x as far)."""
    start = _parameters(tmp_path, "start", "++task", "initialize_model")
    moved = {}
    for accum in (1, 2):
        end = _parameters(tmp_path, f"accum_{accum}", "++accum_grad_multiple_step", str(accum))
        moved[accum] = numpy.concatenate([(end[key] - start[key]).ravel() for key in sorted(start)])
    ratio = numpy.dot(moved[2], moved[1]) / numpy.dot(moved[1], moved[1])
    difference = numpy.linalg.norm(moved[2] - moved[1]) / numpy.linalg.norm(moved[1])
    print(f"accumulated / plain updates: projection {ratio:.3f}, relative difference {difference:.3f}")
    assert numpy.linalg.norm(moved[1]) > 0 and abs(ratio - 1) < 0.05 and difference < 0.05
