"""Overlapped syncs (``sync_delay``, ``sync_mix``) and quantized syncs (``sync_dtype`` int8/int4,
error feedback), against NumPy computations of their rules, on logical CPU devices."""

import hashlib

import numpy
import pytest
import tensorflow as tf

from conftest import make_trainer, random_step_batches, replica_values
from test_sync import DILOCO, FEED_FORWARD, _epochs, _metrics, assert_params_close, params

IN_STEP = {"cluster_resolver": "local", "jit_compile": False}


def _strategy(in_step: bool):
    from returnn_tpu.options import DistributeOptions
    from returnn_tpu.strategies import make_strategy

    return make_strategy(DistributeOptions(strategy="local_sgd_tpu", num_replicas=2, **IN_STEP) if in_step
                         else DistributeOptions(strategy="local_sgd", num_replicas=2))


def _set_copies(strategy, var, copies):
    strategy.extended.update(var, lambda copy, value: copy.assign(value), args=(
        strategy.experimental_distribute_values_from_function(lambda ctx: copies[ctx.replica_id_in_sync_group]),))


def _three_syncs_digest(in_step, **options):
    """The bits of both copies after each of three immediate syncs of random copies."""
    from returnn_tpu.options import DistributeOptions
    from returnn_tpu.strategies.sync import make_averaging, mean_over_all_replicas

    strategy = _strategy(in_step)
    averaging = make_averaging(DistributeOptions(strategy="local_sgd", **options), keep_synced_model=True)
    with strategy.scope():
        w = tf.Variable(tf.zeros([5, 3]))
    averaging.create_state(strategy, {"w": w})
    sync = tf.function(lambda: strategy.run(lambda: averaging.sync_in_replica(
        strategy, {"w": w}, mean_over_all_replicas, learning_rate=tf.constant(0.25))), autograph=False)
    rng = numpy.random.RandomState(0)
    digest = hashlib.sha256()
    for _ in range(3):
        _set_copies(strategy, w, [rng.normal(size=(5, 3)).astype(numpy.float32) for _ in range(2)])
        sync()
        for copy in replica_values(strategy, w):
            digest.update(copy.tobytes())
    return digest.hexdigest()[:16]


@pytest.mark.parametrize("in_step", [False, True], ids=["host", "in_step"])
@pytest.mark.parametrize("options,bits", [
    ({}, "da6e922d1cae7ba7"),
    ({"sync_dtype": "bfloat16"}, "8dc2c8d6514405e7"),
    ({"outer_optimizer": DILOCO}, "691aa243e111a19a"),
    ({"outer_optimizer": DILOCO, "sync_delay": 0}, "691aa243e111a19a"),
], ids=["plain", "bfloat16", "diloco", "diloco_delay_0"])
def test_syncs_without_delay_are_bit_for_bit_those_before_it_existed(in_step, options, bits):
    """The digests were recorded with the code before ``sync_delay`` and int types existed
    (commit a895020); elementwise float32 ops and a mean of two copies round alike on any CPU."""
    assert _three_syncs_digest(in_step, **options) == bits


@pytest.mark.parametrize("strategy", ["local_sgd", "local_sgd_tpu"])
def test_an_overlapped_sync_is_applied_tau_updates_later_mixed_into_each_copy(tmp_path, strategy):
    """DiLoCo, ``param_sync_step`` 4, ``sync_delay`` 2, ``sync_mix`` 0.5: the sync after update 4
    takes each replica's change; after update 6 (at learning rate 0, so the copies are those
    after update 5) each copy is ``0.5 * copy + 0.5 * (DiLoCo's step from the anchor with the mean
    change at update 4)``; the anchor moves then, not before."""
    options = {"param_sync_step": 4, "sync_delay": 2, "sync_mix": 0.5, "outer_optimizer": DILOCO,
               **(IN_STEP if strategy == "local_sgd_tpu" else {})}
    trainer = make_trainer(tmp_path, FEED_FORWARD, strategy=strategy, distribute_options=options)
    rng = numpy.random.RandomState(0)
    averaging = trainer.strategy.extended.averaging
    seen = {}
    for update in range(1, 7):
        trainer.train_step(random_step_batches(rng, 2), 0.0 if update == 6 else 0.1)
        seen[update] = params(trainer)
        if update == 1:
            anchor = {name: var.numpy() for name, var in averaging.anchors.items()}
        if update == 5:
            assert all(numpy.array_equal(averaging.anchors[name].numpy(), anchor[name]) for name in anchor)
    lr, mu, mix = DILOCO["learning_rate"], DILOCO["momentum"], 0.5
    for name, copies in seen[6].items():
        g = anchor[name] - numpy.mean(seen[4][name], axis=0)  # the outer gradient of update 4's copies
        synced = anchor[name] - lr * (g + mu * g)  # Nesterov's first step: m = g
        numpy.testing.assert_allclose(averaging.anchors[name].numpy(), synced, atol=1e-6, rtol=0, err_msg=name)
        for copy, before in zip(copies, seen[5][name]):
            numpy.testing.assert_allclose(copy, mix * before + (1 - mix) * synced, atol=1e-6, rtol=0, err_msg=name)
    assert not numpy.allclose(seen[6]["hidden/W"][0], seen[6]["hidden/W"][1])  # mixed: the copies still differ


@pytest.mark.parametrize("strategy", ["local_sgd", "local_sgd_tpu"])
def test_each_fragment_reaches_every_replica_tau_updates_after_its_sync_starts(tmp_path, strategy):
    """Four fragments, ``param_sync_step`` 8, ``sync_delay`` 1, ``sync_mix`` 0: fragment i's sync
    starts after update 2(i + 1) of each cycle, and all copies of it are equal one update later."""
    options = {"param_sync_step": 8, "sync_fragments": 4, "sync_delay": 1, "sync_mix": 0.0,
               **(IN_STEP if strategy == "local_sgd_tpu" else {})}
    trainer = make_trainer(tmp_path, FEED_FORWARD, strategy=strategy, distribute_options=options)
    rng = numpy.random.RandomState(0)
    for update in range(1, 17):
        trainer.train_step(random_step_batches(rng, 2), 0.1)
        values = params(trainer)
        equal = [i for i, names in enumerate(trainer.strategy.extended.engine.fragments)
                 if all(numpy.array_equal(*values[name]) for name in names)]
        assert equal == ([((update - 1) // 2 - 1) % 4] if update % 2 == 1 and update > 1 else []), (update, equal)


def _quantized_means(dtype, copies, rounds=1, error_feedback=True, in_step=False):
    """``rounds`` syncs of plain averaging in ``dtype`` where each replica's copy is the anchor
    plus its change in ``copies``; the anchor after each (the sum of what was applied)."""
    from returnn_tpu.strategies.sync import ParameterAveraging, mean_over_all_replicas

    strategy = _strategy(in_step)
    averaging = ParameterAveraging(sync_dtype=dtype, error_feedback=error_feedback)
    with strategy.scope():
        w = tf.Variable(tf.zeros(copies[0].shape))
    averaging.create_state(strategy, {"w": w})
    sync = tf.function(lambda: strategy.run(lambda: averaging.sync_in_replica(
        strategy, {"w": w}, mean_over_all_replicas, learning_rate=tf.constant(0.1))), autograph=False)
    anchors = []
    for _ in range(rounds):
        anchor = averaging.anchors["w"].numpy()
        _set_copies(strategy, w, [anchor + change for change in copies])
        sync()
        anchors.append(averaging.anchors["w"].numpy())
    return anchors, averaging, strategy


def _step(dtype, values):
    """The quantization step (the block's scale) of each of ``values``' blocks of 64, per value."""
    from returnn_tpu.strategies.sync.quantized import BLOCK, QuantizedWire

    qmax = QuantizedWire(dtype).qmax
    padded = numpy.pad(values, (0, -len(values) % BLOCK)).reshape(-1, BLOCK)
    return numpy.repeat(numpy.abs(padded).max(axis=1) / qmax, BLOCK)[:len(values)]


@pytest.mark.parametrize("in_step", [False, True], ids=["host", "in_step"])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_quantized_sync_decodes_within_half_a_step_of_the_float32_mean(dtype, in_step):
    rng = numpy.random.RandomState(1)
    changes = [rng.normal(scale=10.0 ** rng.randint(-3, 1), size=150).astype(numpy.float32) for _ in range(2)]
    (anchor,), averaging, strategy = _quantized_means(dtype, changes, in_step=in_step)
    error = numpy.abs(anchor - numpy.mean(changes, axis=0))
    bound = numpy.mean([_step(dtype, change) / 2 for change in changes], axis=0)
    print(f"{dtype}: largest error {error.max():.3g}, {float((error / bound).max()):.2f} of the bound")
    assert numpy.all(error <= bound * (1 + 1e-5)) and error.max() > 0
    residuals = replica_values(strategy, averaging.residuals["w"])  # what each replica keeps for next time
    for change, residual in zip(changes, residuals):
        assert numpy.all(numpy.abs(residual) <= _step(dtype, change) / 2 * (1 + 1e-5))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_error_feedback_keeps_the_sum_of_syncs_within_one_step_and_without_it_drifts(dtype):
    """Eight syncs of the same changes: with error feedback the anchor (the sum of what was
    applied) is within one quantization step of eight float32 means; without it, each sync
    rounds the same way and the error grows with every sync."""
    rng = numpy.random.RandomState(2)
    changes = [rng.uniform(-1, 1, size=128).astype(numpy.float32) for _ in range(2)]
    exact = 8 * numpy.mean(changes, axis=0)
    step = numpy.max([_step(dtype, change) for change in changes], axis=0)
    with_feedback = numpy.abs(_quantized_means(dtype, changes, rounds=8)[0][-1] - exact)
    without = numpy.abs(_quantized_means(dtype, changes, rounds=8, error_feedback=False)[0][-1] - exact)
    print(f"{dtype}: after 8 syncs, largest error {with_feedback.max():.3g} with error feedback, "
          f"{without.max():.3g} without ({step.max():.3g} per step)")
    assert numpy.all(with_feedback <= step * (1 + 1e-4))
    assert without.max() > 2 * step.max()


def test_sync_bytes_count_what_a_quantized_sync_sends(tmp_path):
    """int4 of 64-value blocks: 4.5 bits per value (half a byte and a 4-byte scale per block)."""
    trainer = make_trainer(tmp_path, FEED_FORWARD, num_epochs=1, train={"class": "Task12AXDataset", "num_seqs": 22},
                           batch_size=150, max_seqs=3, distribute_options={"param_sync_step": 3, "sync_dtype": "int4"})
    trainer.train()
    values = sum(var.shape.num_elements() for var in trainer.steps.replica.trainable().values())
    blocks = -(-values // 64)
    metrics = _metrics(tmp_path)[0]
    assert metrics["sync_bytes"] == metrics["syncs"] * 2 * blocks * (32 + 4)  # 2 replicas, 32 bytes of values


@pytest.mark.parametrize("options", [
    {"sync_delay": 1, "outer_optimizer": DILOCO, "sync_fragments": 2, "sync_dtype": "int8"},
    {"sync_delay": 2, "sync_mix": 0.25, "sync_dtype": "int4", "sync_error_feedback": False},
], ids=["diloco_fragments_delay_int8", "plain_delay_int4"])
def test_in_step_overlapped_quantized_syncs_equal_the_host_path(tmp_path, options):
    """Over two epochs whose ends fall while a sync is in flight (it is applied before the
    epoch's final sync)."""
    options = dict(options, param_sync_step=5)
    host = _epochs(tmp_path / "host", 2, **options)
    in_step = _epochs(tmp_path / "in_step", 2, strategy="local_sgd_tpu", **IN_STEP, **options)
    assert in_step.syncs.updates_in_replica and not host.syncs.updates_in_replica
    assert_params_close(params(in_step), params(host), atol=1e-5)
    assert [m["syncs"] for m in _metrics(tmp_path / "in_step")] == [m["syncs"] for m in _metrics(tmp_path / "host")]
    assert [m["sync_bytes"] for m in _metrics(tmp_path / "in_step")] == [m["sync_bytes"] for m in _metrics(tmp_path / "host")]


def test_the_schedule_applies_an_overlapped_sync_tau_updates_after_it_starts():
    """And one sync is in flight at a time: a sync due earlier (by time) applies it first."""
    from returnn_tpu.strategies.sync import SyncDue, SyncSchedule

    by_steps = SyncSchedule(8, fragments=2, delay=3)
    due = [by_steps.step() for _ in range(10)]
    assert due == [None, None, None, SyncDue(fragments=(0,)), None, None, SyncDue(applied=(0,)),
                   SyncDue(fragments=(1,)), None, None]
    by_steps.synced()  # the phase restarts, a sync is still in flight (the epoch's end applies it)
    assert by_steps.pending() and by_steps.take_in_flight() == (1,) and not by_steps.pending()
    by_time = SyncSchedule(8, time_diff=0.0, delay=3)
    assert [by_time.step() for _ in range(2)] == [SyncDue(fragments=(0,)), SyncDue(fragments=(0,), applied=(0,))]
