"""Local SGD in a Keras 3 program: Keras' "Multi-GPU distributed training with TensorFlow" guide
with one line changed, ``tf.distribute.MirroredStrategy(devices)`` ->
``LocalSGDStrategy(devices, param_sync_step=16)``, and one callback added.

Each replica trains its own copy of the model on its share of every batch, with no communication
in a step; every 16 updates the copies are averaged (or, with ``--outer-lr``, combined by DiLoCo's
Nesterov outer step). ``SyncCallback`` combines them where Keras reads the model: before
validation, at each epoch's end and at the end of ``fit``, so ``evaluate`` and ``save`` see one
model.

    python examples/keras_local_sgd.py                  # local SGD on 4 devices
    python examples/keras_local_sgd.py --mirrored       # the same with MirroredStrategy

Without GPUs, the CPU is split into ``--devices`` logical devices. Imports no RETURNN.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy
import tensorflow as tf

import keras
from returnn_tpu.strategies import LocalSGDStrategy, SyncCallback

NUM_CLASSES = 10
FEATURES = 32


def make_data(num_examples: int, seed: int):
    """A 10-class problem that a small MLP learns to about 85% in a few epochs: Gaussian clusters
    (fixed centres, seed 0) with noise."""
    centres = numpy.random.RandomState(0).normal(size=(NUM_CLASSES, FEATURES)).astype("float32")
    rng = numpy.random.RandomState(seed)
    labels = rng.randint(NUM_CLASSES, size=num_examples)
    features = centres[labels] + rng.normal(scale=2.0, size=(num_examples, FEATURES)).astype("float32")
    return features.astype("float32"), labels.astype("int32")


def get_compiled_model() -> keras.Model:
    """The guide's model and ``compile``, for the data above."""
    inputs = keras.Input(shape=(FEATURES,))
    x = keras.layers.Dense(128, activation="relu")(inputs)
    x = keras.layers.Dense(128, activation="relu")(x)
    outputs = keras.layers.Dense(NUM_CLASSES)(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model


def train(strategy: tf.distribute.Strategy, *, epochs: int = 3, num_examples: int = 8192, batch_size: int = 128,
          model_path: str = "") -> float:
    """The guide's ``fit`` / ``evaluate`` / ``save`` under ``strategy``; the test accuracy."""
    keras.utils.set_random_seed(0)  # the same initial model under every strategy
    with strategy.scope():
        model = get_compiled_model()
    train_data = tf.data.Dataset.from_tensor_slices(make_data(num_examples, seed=1)).shuffle(4096, seed=1)
    callbacks = [SyncCallback(strategy)] if isinstance(strategy, LocalSGDStrategy) else []
    model.fit(train_data.batch(batch_size), epochs=epochs, verbose=0, callbacks=callbacks,
              validation_data=tf.data.Dataset.from_tensor_slices(make_data(1024, seed=2)).batch(batch_size))
    _, accuracy = model.evaluate(tf.data.Dataset.from_tensor_slices(make_data(2048, seed=3)).batch(batch_size),
                                 verbose=0)
    if model_path:
        model.save(model_path)
    return float(accuracy)


def local_devices(count: int) -> list:
    """``count`` GPUs, or the CPU split into ``count`` logical devices (before TensorFlow starts)."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return [f"/gpu:{i}" for i in range(min(count, len(gpus)))]
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    return [f"/cpu:{i}" for i in range(count)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--param-sync-step", type=int, default=16)
    parser.add_argument("--outer-lr", type=float, help="DiLoCo's outer learning rate (momentum 0.5); default: averaging")
    parser.add_argument("--mirrored", action="store_true", help="train with tf.distribute.MirroredStrategy instead")
    args = parser.parse_args()
    devices = local_devices(args.devices)
    if args.mirrored:
        strategy = tf.distribute.MirroredStrategy(devices)
    else:
        outer = {"outer_optimizer": {"class": "nesterov", "learning_rate": args.outer_lr, "momentum": 0.5}} \
            if args.outer_lr else {}
        strategy = LocalSGDStrategy(devices, param_sync_step=args.param_sync_step, **outer)
    path = os.path.join(tempfile.mkdtemp(prefix="keras_local_sgd_"), "model.keras")
    accuracy = train(strategy, epochs=args.epochs, model_path=path)
    reloaded = keras.models.load_model(path)  # under no strategy: one model, the combined one
    _, reloaded_accuracy = reloaded.evaluate(*make_data(2048, seed=3), batch_size=128, verbose=0)
    print(f"{type(strategy).__name__} on {len(devices)} devices: test accuracy {accuracy:.4f} "
          f"(saved and reloaded: {reloaded_accuracy:.4f})")
    if not args.mirrored:
        print("syncs:", strategy.extended.sync_stats)


if __name__ == "__main__":
    main()
