"""``LocalSGDStrategy`` in a TF2 program: TensorFlow's custom-loop tutorial code and Keras 3's
``compile`` / ``fit`` / ``evaluate`` / ``save``, with only the strategy's constructor changed."""

import numpy
import pytest
import tensorflow as tf

import keras
from returnn_tpu.errors import ConfigError
from returnn_tpu.strategies import LocalSGDStrategy, SyncCallback

DEVICES = ["/cpu:0", "/cpu:1"]
GLOBAL_BATCH = 8


def _data(seed=0):
    rng = numpy.random.RandomState(seed)
    x = rng.randn(64, 4).astype("float32")
    return x, (x @ numpy.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")


def _custom_loop(strategy, steps: int, optimizer=lambda: keras.optimizers.SGD(0.05)):
    """TensorFlow's "Custom training with tf.distribute.Strategy" loop; the kernel's copies after
    each step (one array per replica)."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])
        optimizer = optimizer()
        # Its slots made here: made in the first traced step, Keras' momentum slots under
        # MirroredStrategy fail ("You must feed a value for placeholder tensor 'cond/...'").
        optimizer.build(model.trainable_variables)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(_data()).batch(GLOBAL_BATCH).repeat())

    @tf.function
    def train_step(inputs):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                per_example_loss = tf.square(model(x, training=True) - y)[:, 0]
                loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(step_fn, args=inputs), axis=None)

    batches, copies = iter(dataset), []
    for _ in range(steps):
        train_step(next(batches))
        kernel = model.trainable_variables[0]
        copies.append([c.numpy().copy() for c in strategy.experimental_local_results(getattr(kernel, "value", kernel))])
    return copies


def test_the_custom_training_loop_trains_local_copies_and_averages_every_n_updates():
    strategy = LocalSGDStrategy(DEVICES, param_sync_step=3)
    copies = _custom_loop(strategy, 6)
    for step, (first, second) in enumerate(copies, start=1):
        if step % 3:  # each replica applied its own batch's gradient to its own copy
            assert not numpy.allclose(first, second), step
        else:  # the sync after update 3 and 6
            numpy.testing.assert_array_equal(first, second)
    assert strategy.extended.sync_stats == {"updates": 6, "syncs": 2, "bytes": 2 * 2 * (4 + 1) * 4}


def test_local_sgd_of_one_update_is_synchronous_sgd():
    """The mean of each replica's SGD step from one model is SGD on the mean gradient: N = 1
    gives MirroredStrategy's parameters (the loss scaling to the global batch is undone right)."""
    ours = _custom_loop(LocalSGDStrategy(DEVICES, param_sync_step=1), 3)
    theirs = _custom_loop(tf.distribute.MirroredStrategy(DEVICES), 3)
    for (our_copy, _), (their_copy, _) in zip(ours, theirs):
        numpy.testing.assert_allclose(our_copy, their_copy, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_diloco_with_a_sync_every_update_is_synchronous_sgd_with_the_outer_step(momentum):
    """N = 1, inner SGD at 0.05, DiLoCo's Nesterov outer step (learning rate 0.5): the outer
    gradient is 0.05 times the mean gradient, so the outer step is Keras' Nesterov SGD at
    0.5 * 0.05 on the mean gradient: MirroredStrategy with that optimizer, to 1e-5."""
    outer = {"class": "nesterov", "learning_rate": 0.5, "momentum": momentum}
    ours = _custom_loop(LocalSGDStrategy(DEVICES, param_sync_step=1, outer_optimizer=outer), 4)
    theirs = _custom_loop(tf.distribute.MirroredStrategy(DEVICES), 4,
                          optimizer=lambda: keras.optimizers.SGD(0.025, momentum=momentum, nesterov=True))
    for (our_copy, _), (their_copy, _) in zip(ours, theirs):
        numpy.testing.assert_allclose(our_copy, their_copy, rtol=1e-5, atol=1e-6)


def test_keras_compile_fit_evaluate_and_save(tmp_path):
    strategy = LocalSGDStrategy(DEVICES, param_sync_step=4)
    x, y = _data(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, verbose=0, validation_data=(x, y),
                        callbacks=[SyncCallback(strategy)])  # combined for validation and at the end
    assert history.history["loss"][-1] < history.history["loss"][0]
    stats = strategy.extended.sync_stats
    assert stats["updates"] == 3 * 64 // GLOBAL_BATCH
    # 6 scheduled syncs, and the callback's: 3 validations, 3 epoch ends, the end of training
    assert stats["syncs"] == 6 + 7 and stats["bytes"] == stats["syncs"] * 2 * (4 + 1) * 4
    kernel = model.trainable_variables[0]
    first, second = (c.numpy() for c in strategy.experimental_local_results(getattr(kernel, "value", kernel)))
    numpy.testing.assert_array_equal(first, second)
    assert model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0) < history.history["loss"][0]
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    numpy.testing.assert_array_equal(loaded.get_weights()[0], first)


@pytest.mark.parametrize("options,message", [
    ({"param_sync_step": 0}, "param_sync_step'] must be an int >= 1"),
    ({"param_sync_stepp": 4}, "LocalSGDStrategy has no option 'param_sync_stepp'"),
    ({"sync_dtype": "int8"}, "'sync_dtype' is not supported for TF2 programs yet"),
    ({"outer_optimizer": {"class": "slowmo"}}, "outer_optimizer class 'slowmo' is not supported for TF2 programs"),
])
def test_bad_options_are_one_line(options, message):
    with pytest.raises(ConfigError, match=message.replace("[", "\\[").replace("(", "\\(")):
        LocalSGDStrategy(DEVICES, **options)


WORKER_PROGRAM = """
import json, sys
import numpy, tensorflow as tf, keras
from returnn_tpu.strategies import MultiWorkerLocalSGDStrategy

strategy = MultiWorkerLocalSGDStrategy(param_sync_step=3)  # TF_CONFIG
worker = json.loads(__import__("os").environ["TF_CONFIG"])["task"]["index"]
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    optimizer = keras.optimizers.SGD(0.05)
rng = numpy.random.RandomState(worker)  # each worker its own data
x = rng.randn(64, 4).astype("float32")
y = x @ numpy.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
dataset = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()))

@tf.function
def train_step(inputs):
    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(tf.square(model(xb, training=True) - yb)[:, 0], global_batch_size=16)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss
    return strategy.reduce("SUM", strategy.run(step_fn, args=inputs), axis=None)

for step in range(1, 7):
    train_step(next(dataset))
    print("step", step, json.dumps(model.get_weights()[0][:, 0].tolist()), flush=True)
print("stats", json.dumps(strategy.extended.sync_stats), flush=True)
"""


@pytest.mark.slow
def test_two_workers_train_local_copies_and_average_every_n_updates(tmp_path):
    """``MultiWorkerLocalSGDStrategy`` in two processes (``TF_CONFIG`` on 127.0.0.1), each on its
    own data: their kernels differ between syncs and are equal after updates 3 and 6."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO
    from returnn_tpu.launcher import free_local_ports

    (tmp_path / "worker.py").write_text(WORKER_PROGRAM)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_local_ports(2)]}
    workers = [subprocess.Popen([sys.executable, "worker.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
                                         TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})))
               for i in range(2)]
    outputs = [worker.communicate(timeout=300)[0] for worker in workers]
    assert all(worker.returncode == 0 for worker in workers), outputs[0][-3000:] + outputs[1][-3000:]
    kernels = [{int(line.split()[1]): json.loads(line.split(" ", 2)[2]) for line in output.splitlines()
                if line.startswith("step ")} for output in outputs]
    for step in range(1, 7):
        if step % 3:
            assert not numpy.allclose(kernels[0][step], kernels[1][step]), step
        else:
            numpy.testing.assert_allclose(kernels[0][step], kernels[1][step], rtol=1e-6)
    assert all('stats {"updates": 6, "syncs": 2, "bytes": 40}' in output for output in outputs)
