"""Keras ``model.fit`` steps per second: ``LocalSGDStrategy(param_sync_step=16)`` against
``tf.distribute.MirroredStrategy`` on the same devices, in one process, in turns.

The model and data are examples/keras_local_sgd.py's; ``--width`` sets its hidden layers (the
parameters each synchronous step all-reduces). Each round trains one strategy for ``--epochs``
epochs; the first epoch (tracing) is not timed. Prints each round's steps per second and the
ratio of each round's pair and of the medians (local SGD / mirrored).

    python benchmarks/keras_local_sgd.py [--devices 4] [--rounds 3] [--width 512] [--smoke]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example():
    spec = importlib.util.spec_from_file_location("keras_local_sgd", os.path.join(REPO, "examples", "keras_local_sgd.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def steps_per_second(example, strategy, *, epochs: int, num_examples: int, batch_size: int, width: int) -> float:
    """Steps per second of ``fit`` after its first epoch."""
    import keras
    import tensorflow as tf

    from returnn_tpu.strategies import LocalSGDStrategy, SyncCallback

    class EpochClock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if epoch > 0:
                seconds.append(time.perf_counter() - self.started)

    seconds = []
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input(shape=(example.FEATURES,))
        hidden = keras.layers.Dense(width, activation="relu")(inputs)
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(example.NUM_CLASSES)(hidden))
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices(example.make_data(num_examples, seed=1)).batch(batch_size).cache()
    callbacks = [EpochClock()]
    if isinstance(strategy, LocalSGDStrategy):
        callbacks.insert(0, SyncCallback(strategy))  # as users run it: a sync at each epoch's end
    model.fit(data, epochs=epochs, verbose=0, callbacks=callbacks)
    steps = -(-num_examples // batch_size)
    return steps * len(seconds) / sum(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--examples", type=int, default=16384)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="2 devices, 1 round, a tiny model")
    args = parser.parse_args()
    if args.smoke:
        args.devices, args.rounds, args.epochs, args.width, args.examples = 2, 1, 2, 16, 1024
    example = load_example()
    devices = example.local_devices(args.devices)

    import tensorflow as tf

    from returnn_tpu.strategies import LocalSGDStrategy, with_own_collective_keys

    sizes = dict(epochs=args.epochs, num_examples=args.examples, batch_size=args.batch_size, width=args.width)
    rates = {"mirrored": [], "local_sgd_16": []}
    for round_ in range(1, args.rounds + 1):
        for name in rates:
            strategy = with_own_collective_keys(tf.distribute.MirroredStrategy, devices) if name == "mirrored" else \
                LocalSGDStrategy(devices, param_sync_step=16)
            rates[name].append(steps_per_second(example, strategy, **sizes))
            print(f"round {round_}: {name} {rates[name][-1]:.1f} steps/s", flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    pairs = [ours / theirs for ours, theirs in zip(rates["local_sgd_16"], rates["mirrored"])]
    print("ratio per round (local_sgd_16 / mirrored):", ", ".join(f"{ratio:.2f}x" for ratio in pairs))
    print(f"{len(devices)} devices, width {args.width}, global batch {args.batch_size}: median steps/s "
          f"mirrored {medians['mirrored']:.1f}, local_sgd_16 {medians['local_sgd_16']:.1f}; "
          f"ratio {medians['local_sgd_16'] / medians['mirrored']:.2f}x")


if __name__ == "__main__":
    main()
