"""Local SGD against synchronous SGD, on logical CPU devices, through the real trainer."""

import doctest

import numpy
import pytest
import tensorflow as tf

from conftest import make_trainer, random_step_batches

FEED_FORWARD = {
    "hidden": {"class": "linear", "activation": "tanh", "n_out": 16, "from": "data"},
    "output": {"class": "softmax", "loss": "ce", "from": "hidden"},
}
LSTM = {
    "lstm": {"class": "rec", "unit": "standardlstm", "n_out": 8, "from": "data"},
    "output": {"class": "softmax", "loss": "ce", "from": "lstm"},
}


@pytest.mark.parametrize("module", ["returnn_tpu.strategies.local_sgd", "returnn_tpu.strategies.sync.averaging",
                                    "returnn_tpu.strategies.sync.fragments"])
def test_docstring_example(module):
    import importlib

    result = doctest.testmod(importlib.import_module(module), extraglobs={"tf": tf})
    assert result.attempted > 0 and result.failed == 0


def _final_params(tmp_path, network, strategy, steps, seed, **options):
    trainer = make_trainer(tmp_path / strategy, network, strategy=strategy, num_replicas=2, **options)
    rng = numpy.random.RandomState(seed)
    for _ in range(steps):
        trainer.train_step(random_step_batches(rng, 2), 0.1)
    return trainer, trainer.steps.parameter_copies()


@pytest.mark.parametrize(
    "network,outer",
    [(FEED_FORWARD, None), (LSTM, None), (FEED_FORWARD, {"class": "nesterov", "learning_rate": 1.0, "momentum": 0.0})],
    ids=["feed_forward", "lstm", "feed_forward_outer_lr_1"],
)
def test_sync_every_step_equals_mirrored(tmp_path, network, outer):
    tf.random.set_seed(1)
    _, local = _final_params(
        tmp_path, network, "local_sgd", 20, seed=3, distribute_options={"param_sync_step": 1, "outer_optimizer": outer}
    )
    tf.random.set_seed(1)
    _, mirrored = _final_params(tmp_path, network, "mirrored", 20, seed=3)
    assert local.keys() == mirrored.keys()
    for name in local:
        for local_copy, mirrored_copy in zip(local[name], mirrored[name]):
            numpy.testing.assert_allclose(local_copy, mirrored_copy, atol=1e-5, rtol=0, err_msg=name)


def test_without_sync_the_result_differs_from_mirrored(tmp_path):
    """The comparison above can fail: averaging less often gives other parameters."""
    _, local = _final_params(tmp_path, FEED_FORWARD, "local_sgd", 20, seed=3, distribute_options={"param_sync_step": 7})
    _, mirrored = _final_params(tmp_path, FEED_FORWARD, "mirrored", 20, seed=3)
    assert numpy.abs(local["hidden/W"][0] - mirrored["hidden/W"][0]).max() > 1e-4


def test_copies_differ_between_syncs_and_agree_after(tmp_path, rng):
    trainer = make_trainer(tmp_path, FEED_FORWARD, distribute_options={"param_sync_step": 5})
    weights = lambda: trainer.steps.parameter_copies()["hidden/W"]  # noqa: E731
    for _ in range(3):
        trainer.train_step(random_step_batches(rng, 2), 0.1)
    after_3 = weights()
    assert numpy.abs(after_3[0] - after_3[1]).max() > 1e-4
    for _ in range(2):
        trainer.train_step(random_step_batches(rng, 2), 0.1)
    after_5 = weights()
    numpy.testing.assert_array_equal(after_5[0], after_5[1])
    assert numpy.abs(after_5[0] - after_3[0]).max() > 1e-4


@pytest.mark.parametrize("strategy", ["local_sgd", "local_sgd_tpu"])
def test_sync_warmup_is_synchronous_then_local_sgd_starts_from_its_model(tmp_path, strategy):
    """``sync_warmup_steps`` W (post-local SGD): with Adam, where averaging the copies every step is
    not synchronous training, the first W updates equal ``mirrored``'s; after them the copies
    part, the outer optimizer's anchor is the warm-up's model, and the first sync is N updates later."""
    warmup, sync_step = 4, 3
    adam = {"optimizer": {"class": "adam"}, "learning_rate": 0.01}
    outer = {"class": "nesterov", "learning_rate": 0.5, "momentum": 0.5}
    tf.random.set_seed(1)
    in_step = {"cluster_resolver": "local", "jit_compile": False} if strategy == "local_sgd_tpu" else {}
    trainer, local = _final_params(tmp_path, FEED_FORWARD, strategy, warmup, seed=3, **adam, distribute_options={
        "param_sync_step": sync_step, "outer_optimizer": outer, "sync_warmup_steps": warmup, **in_step})
    tf.random.set_seed(1)
    _, mirrored = _final_params(tmp_path, FEED_FORWARD, "mirrored", warmup, seed=3, **adam)
    for name in local:
        for local_copy, mirrored_copy in zip(local[name], mirrored[name]):
            numpy.testing.assert_allclose(local_copy, mirrored_copy, atol=1e-6, rtol=0, err_msg=name)
    strategy = trainer.steps.strategy
    for name, anchor in trainer.strategy.extended.averaging.anchors.items():
        for copy in strategy.experimental_local_results(anchor):
            numpy.testing.assert_array_equal(copy.numpy(), local[name][0], err_msg=name)
    rng = numpy.random.RandomState(4)
    weights = lambda: trainer.steps.parameter_copies()["hidden/W"]  # noqa: E731
    for update in range(1, sync_step + 1):
        trainer.train_step(random_step_batches(rng, 2), 0.1)
        copies = weights()
        if update < sync_step:
            assert numpy.abs(copies[0] - copies[1]).max() > 1e-5, update
        else:
            numpy.testing.assert_array_equal(copies[0], copies[1])
