"""XLA-compiled replica steps, static shapes by bucketing, and the TPU path as far as a CPU shows it."""

import json
import os
import shutil

import numpy
import pytest

from conftest import make_trainer, random_step_batches, replica_values, run_cli
from test_bridge import LAYER_NETWORKS

DETERMINISTIC = ["linear", "conv", "self_attention", "layer_norm", "standardlstm"]


def _losses(trainer, steps, seed):
    """Training losses on one fixed batch (so that they fall)."""
    batches = random_step_batches(numpy.random.RandomState(seed), trainer.steps.local_replicas, time=9)
    losses = []
    for _ in range(steps):
        metrics = trainer.train_step(batches, 0.05)
        total = {k: sum(float(x) for x in trainer.strategy.experimental_local_results(v)) for k, v in metrics.items()}
        losses.append(total["cost:output"] / total["frames:output"])
    return losses


def _same_start(reference, other, rng):
    """Builds both trainers' variables and gives ``other`` the parameters of ``reference``."""
    first = random_step_batches(rng, reference.steps.local_replicas, time=9)
    reference.steps.create_variables(first)
    other.steps.create_variables(first)
    for name, var in other.builder.variables.by_name.items():
        var.assign(reference.builder.variables.by_name[name])


@pytest.mark.parametrize("layer", DETERMINISTIC + ["dropout"])
def test_compiled_step_trains_like_the_plain_step(tmp_path, layer):
    plain = make_trainer(tmp_path / "plain", LAYER_NETWORKS[layer], strategy="single", num_replicas=1)
    jit = make_trainer(tmp_path / "jit", LAYER_NETWORKS[layer], strategy="single", num_replicas=1,
                       distribute_options={"jit_compile": True, "bucket_boundaries": [16]})
    _same_start(plain, jit, numpy.random.RandomState(0))
    expected, got = _losses(plain, 6, seed=5), _losses(jit, 6, seed=5)
    assert len(jit.steps.replica.compiled_shapes) == 1  # one shape, compiled once
    assert got[-1] < got[0]
    if layer == "dropout":  # XLA draws other random numbers: same start, same trend, not the same masks
        assert got[0] == pytest.approx(expected[0], rel=0.2)
    else:
        numpy.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_one_compilation_per_bucket(tmp_path):
    trainer = make_trainer(
        tmp_path, LAYER_NETWORKS["standardlstm"], strategy="single", num_replicas=1,
        train={"class": "Task12AXDataset", "num_seqs": 60}, batch_size=400, max_seqs=6,
        distribute_options={"jit_compile": True, "bucket_boundaries": [20, 40, 80, 120]},
    )
    shapes, steps = set(), 0
    for step_batches, _ in trainer.data.train_batches(1):
        trainer.train_step(step_batches, 0.01)
        shapes.add(step_batches[0]["data"].shape)
        steps += 1
    assert {shape[1] for shape in shapes} <= {20, 40, 80, 120}
    assert len(trainer.steps.replica.compiled_shapes) == len(shapes) and steps > 2 * len(shapes)


def test_padding_is_masked(tmp_path, rng):
    from returnn_tpu.datapath.batching import BucketBatching

    trainer = make_trainer(tmp_path, LAYER_NETWORKS["standardlstm"], strategy="single", num_replicas=1)
    (batch,) = random_step_batches(rng, 1, batch=3, time=9)
    bucketing = BucketBatching(trainer.config, [16], "data")
    bucketing.batch_size, bucketing.max_seqs = 80, 5  # pad to 4 sequences (a power of two) of 16 frames
    padded = bucketing.pad(batch)
    assert padded["data"].shape == (4, 16, 9) and list(padded["size:data:0"][3:]) == [0]

    def loss(b):
        metrics = trainer.steps.evaluate([b], [1.0])
        return float(metrics["cost:output"]) / float(metrics["frames:output"]), float(metrics["frames:output"])

    assert loss(padded) == pytest.approx(loss(batch), rel=1e-5)


def test_empty_padding_sequences_keep_attention_finite(tmp_path, rng):
    """A bucket's last batch is filled with empty sequences. RETURNN masks attention energies with
    -inf, which over no frames makes the softmax, and so the gradient, NaN; with XLA the trainer
    masks with a finite value: the step on the padded batch is the step on the batch itself."""
    from returnn_tpu.datapath.batching import BucketBatching

    plain = make_trainer(tmp_path / "plain", LAYER_NETWORKS["self_attention"], strategy="single", num_replicas=1)
    jit = make_trainer(tmp_path / "jit", LAYER_NETWORKS["self_attention"], strategy="single", num_replicas=1,
                       distribute_options={"jit_compile": True, "bucket_boundaries": [16]})
    _same_start(plain, jit, rng)
    (batch,) = random_step_batches(rng, 1, batch=3, time=9)
    bucketing = BucketBatching(jit.config, [16], "data")
    bucketing.batch_size, bucketing.max_seqs = 80, 5  # pad to 4 sequences, the last one empty
    padded = bucketing.pad(batch)
    assert list(padded["size:data:0"][3:]) == [0]
    plain.train_step([batch], 0.05)
    jit.train_step([padded], 0.05)
    for name, var in jit.builder.variables.by_name.items():
        numpy.testing.assert_allclose(var.numpy(), plain.builder.variables.by_name[name].numpy(), rtol=1e-4,
                                      atol=1e-6, err_msg=name)


def test_local_sgd_tpu_step_logic_equals_local_sgd(tmp_path):
    """The in-step sync (step-counter branch, cross-replica mean) on logical CPU devices."""
    options = {"param_sync_step": 3}
    network = LAYER_NETWORKS["linear"]
    host = make_trainer(tmp_path / "host", network, optimizer={"class": "adam"}, learning_rate=0.01,
                        distribute_options=options)
    in_step = make_trainer(tmp_path / "in_step", network, strategy="local_sgd_tpu", optimizer={"class": "adam"},
                           learning_rate=0.01, distribute_options=dict(options, cluster_resolver="local",
                                                                       jit_compile=False))
    assert in_step.syncs.updates_in_replica and not host.syncs.updates_in_replica
    _same_start(host, in_step, numpy.random.RandomState(1))
    rng_a, rng_b = numpy.random.RandomState(7), numpy.random.RandomState(7)
    for step in range(1, 8):
        host.train_step(random_step_batches(rng_a, 2, time=9), 0.01)
        in_step.train_step(random_step_batches(rng_b, 2, time=9), 0.01)
        for name, var in host.builder.variables.by_name.items():
            ours = replica_values(in_step.strategy, in_step.builder.variables.by_name[name])
            theirs = replica_values(host.strategy, var)
            for a, b in zip(ours, theirs):
                numpy.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=f"{name} after step {step}")
        w = replica_values(in_step.strategy, in_step.builder.variables.by_name["l/W"])
        assert (numpy.abs(w[0] - w[1]).max() == 0) == (step % 3 == 0)


NATIVE_LSTM_CONFIG = """#!returnn-tpu
train = {"class": "Task12AXDataset", "num_seqs": 10}
num_inputs = 9
num_outputs = 2
network = {"fw0": {"class": "rec", "unit": "nativelstm2", "n_out": 8, "from": "data"},
           "output": {"class": "softmax", "loss": "ce", "from": "fw0"}}
model = "out/model"
"""


@pytest.mark.parametrize(
    "strategy,options,expected",
    [
        ("local_sgd", {"jit_compile": True}, "layer 'fw0': rec unit 'nativelstm2'"),
        ("tpu", {}, "no TPU found"),
        ("local_sgd_tpu", {}, "no TPU found"),
    ],
    ids=["nativelstm2_with_xla", "tpu_without_tpu", "local_sgd_tpu_without_tpu"],
)
def test_clear_error_before_training(tmp_path, strategy, options, expected):
    config = NATIVE_LSTM_CONFIG if "nativelstm2" in expected else NATIVE_LSTM_CONFIG.replace("nativelstm2", "standardlstm")
    (tmp_path / "train.config").write_text(
        config + f"distribute_strategy = {strategy!r}\ndistribute_options = {options!r}\n"
    )
    result = run_cli(["train.config"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("returnn-tpu: error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.config"]


@pytest.mark.slow
def test_compilations_are_counted_and_cached_for_the_next_run(tmp_path):
    """Each bucket compiles once (counted per epoch with its seconds); TensorFlow's persistent
    cache beside the checkpoints makes a second run of the config load them instead."""
    config = NATIVE_LSTM_CONFIG.replace("nativelstm2", "standardlstm").replace('"num_seqs": 10', '"num_seqs": 60') + (
        "num_epochs = 2\ndistribute_strategy = 'single'\n"
        "distribute_options = {'jit_compile': True, 'bucket_boundaries': [40, 80, 120]}\n")
    seconds = []
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "train.config").write_text(config)
        if run == "second":  # the same model folder's cache, as for a resumed run
            shutil.copytree(tmp_path / "first" / "out" / "xla_cache", tmp_path / run / "out" / "xla_cache")
        result = run_cli(["train.config"], cwd=tmp_path / run)
        assert result.returncode == 0, result.stderr[-3000:]
        with open(tmp_path / run / "out" / "metrics.jsonl") as f:
            metrics = [json.loads(line) for line in f]
        assert metrics[0]["xla_compilations"] == metrics[0]["xla_compiled_shapes"] >= 2, metrics[0]
        assert metrics[1]["xla_compilations"] == 0  # the second epoch compiles nothing
        seconds.append(metrics[0]["xla_compile_seconds"])
    assert os.listdir(tmp_path / "first" / "out" / "xla_cache")
    print(f"compile seconds of epoch 1: first run {seconds[0]:.2f}, with the cache {seconds[1]:.2f}")
    assert seconds[1] < 0.8 * seconds[0]


def test_evaluation_with_xla_on_buckets_equals_plain_evaluation(tmp_path, rng):
    """With ``jit_compile`` the dev set is evaluated compiled, on bucketed shapes, every sequence
    (also those longer than the largest bucket): the scores of RETURNN's batching without XLA."""
    from returnn_tpu.datapath.batching import BatchingOptions

    trainer = make_trainer(
        tmp_path, LAYER_NETWORKS["standardlstm"], strategy="single", num_replicas=1, batch_size=400, max_seqs=6,
        dev={"class": "Task12AXDataset", "num_seqs": 30, "fixed_random_seed": 1},
        distribute_options={"jit_compile": True, "bucket_boundaries": [16, 32]},
    )
    trainer.train_step(random_step_batches(rng, 1), 0.01)  # builds the variables
    compiled = trainer.evaluate(1)["dev"]
    shapes = {b[0]["data"].shape for b, _ in trainer.data.eval_batches(trainer.data.dev_datasets[0], 1)}
    assert {length for _, length, _ in shapes} <= {16, 32, 64, 96, 128, 160}  # the buckets, and multiples of 32
    assert any(length > 32 for _, length, _ in shapes)  # the longer sequences were evaluated
    trainer.steps.replica._jit_evaluate, trainer.data.eval_batching = None, BatchingOptions(trainer.config)
    plain = trainer.evaluate(1)["dev"]
    for kind in ("score", "error"):
        for key, value in plain[kind].items():
            assert compiled[kind][key] == pytest.approx(value, rel=1e-4), (kind, key)


def test_tpu_strategy_init_names_its_extended_by_the_module_global():
    """``TrainerLocalSGDTPUStrategy`` runs TensorFlow's ``TPUStrategyV2.__init__`` with the module's
    ``TPUExtended`` bound to its own extended (FACTS.md, "TPUStrategy's extended"): that works only
    while ``__init__`` makes the extended by that global name, and restores the name after."""
    import inspect

    from tensorflow.python.distribute import tpu_strategy

    from returnn_tpu.strategies.tpu import LocalSGDTPUExtended, _tpu_strategies_make

    source = inspect.getsource(tpu_strategy.TPUStrategyV2.__init__)
    assert "TPUExtended(" in source and "_enable_packed_variable_in_eager_mode = True" in source
    assert "TPUExtended" in tpu_strategy.TPUStrategyV2.__init__.__code__.co_names  # a global, not a local
    made = tpu_strategy.TPUExtended
    with _tpu_strategies_make(LocalSGDTPUExtended):
        assert tpu_strategy.TPUExtended is LocalSGDTPUExtended
    assert tpu_strategy.TPUExtended is made
