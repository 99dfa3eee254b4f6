"""``LocalSGDStrategy`` in a TF2 program: TensorFlow's custom-loop tutorial code and Keras 3's
``compile`` / ``fit`` / ``evaluate`` / ``save``, with only the strategy's constructor changed."""

import numpy
import pytest
import tensorflow as tf

import keras
from tensorflow.python.distribute import mirrored_strategy

from returnn_tpu.errors import ConfigError
from returnn_tpu.options import check_tf2_local_sgd_options
from returnn_tpu.strategies import LocalSGDStrategy, LocalSGDTPUStrategy, SyncCallback, with_own_collective_keys
from returnn_tpu.strategies.devices import KEYS_PER_STRATEGY, own_collective_key_base
from returnn_tpu.strategies.local_sgd import LocalSGDExtended
from returnn_tpu.strategies.tpu import ScheduledLocalSGDTPUMixin

DEVICES = [f"/cpu:{i}" for i in range(4)]  # the logical CPU devices of conftest.py
REPLICAS = len(DEVICES)
GLOBAL_BATCH = 8


def _data(seed=0):
    rng = numpy.random.RandomState(seed)
    x = rng.randn(64, 4).astype("float32")
    return x, (x @ numpy.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")


class _TutorialLoop:
    """TensorFlow's "Custom training with tf.distribute.Strategy" loop, with a linear model."""

    def __init__(self, strategy, optimizer=lambda: keras.optimizers.SGD(0.05), traced: bool = True):
        """``traced``: the step is a ``tf.function``, as in the guide (else eager)."""
        self.strategy = strategy
        with strategy.scope():
            self.model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])
            self.optimizer = optimizer()
            # Its slots made here: made in the first traced step, Keras' momentum slots under
            # MirroredStrategy fail ("You must feed a value for placeholder tensor 'cond/...'").
            self.optimizer.build(self.model.trainable_variables)
        self.batches = iter(strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices(_data()).batch(GLOBAL_BATCH).repeat()))
        model, optimizer = self.model, self.optimizer

        def train_step(inputs):
            def step_fn(x, y):
                with tf.GradientTape() as tape:
                    per_example_loss = tf.square(model(x, training=True) - y)[:, 0]
                    loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(step_fn, args=inputs), axis=None)

        self.train_step = tf.function(train_step) if traced else train_step

    def train(self, steps: int) -> list:
        """After each step, the copies of the kernel and the bias (``{"kernel": [replica 0's,
        replica 1's, ...], "bias": ...}``)."""
        copies = []
        for _ in range(steps):
            self.train_step(next(self.batches))
            copies.append(self.copies())
        return copies

    def copies(self) -> dict:
        return {name: [c.numpy().copy() for c in self.strategy.experimental_local_results(getattr(var, "value", var))]
                for name, var in zip(("kernel", "bias"), self.model.trainable_variables)}


def _custom_loop(strategy, steps: int, optimizer=lambda: keras.optimizers.SGD(0.05)):
    return _TutorialLoop(strategy, optimizer).train(steps)


@pytest.mark.parametrize("traced", [True, False], ids=["tf.function", "eager"])
def test_the_custom_training_loop_trains_local_copies_and_averages_every_n_updates(traced):
    strategy = LocalSGDStrategy(DEVICES, param_sync_step=3)
    copies = _TutorialLoop(strategy, traced=traced).train(6)
    for step, kernels in enumerate((each["kernel"] for each in copies), start=1):
        if step % 3:  # each replica applied its own batch's gradient to its own copy
            assert not any(numpy.allclose(kernels[0], other) for other in kernels[1:]), step
        else:  # the sync after update 3 and 6
            assert all(numpy.array_equal(kernels[0], other) for other in kernels[1:]), step
    assert strategy.extended.sync_stats == {"updates": 6, "syncs": 2, "local_syncs": 0,
                                            "bytes": 2 * REPLICAS * (4 + 1) * 4}


def test_local_sgd_of_one_update_is_synchronous_sgd():
    """The mean of each replica's SGD step from one model is SGD on the mean gradient: N = 1
    gives MirroredStrategy's parameters (the loss scaling to the global batch is undone right)."""
    ours = _custom_loop(LocalSGDStrategy(DEVICES, param_sync_step=1), 3)
    theirs = _custom_loop(with_own_collective_keys(tf.distribute.MirroredStrategy, DEVICES), 3)
    for our_step, their_step in zip(ours, theirs):
        numpy.testing.assert_allclose(our_step["kernel"][0], their_step["kernel"][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_diloco_with_a_sync_every_update_is_synchronous_sgd_with_the_outer_step(momentum):
    """N = 1, inner SGD at 0.05, DiLoCo's Nesterov outer step (learning rate 0.5): the outer
    gradient is 0.05 times the mean gradient, so the outer step is Keras' Nesterov SGD at
    0.5 * 0.05 on the mean gradient: MirroredStrategy with that optimizer, to 1e-5."""
    outer = {"class": "nesterov", "learning_rate": 0.5, "momentum": momentum}
    ours = _custom_loop(LocalSGDStrategy(DEVICES, param_sync_step=1, outer_optimizer=outer), 4)
    theirs = _custom_loop(with_own_collective_keys(tf.distribute.MirroredStrategy, DEVICES), 4,
                          optimizer=lambda: keras.optimizers.SGD(0.025, momentum=momentum, nesterov=True))
    for our_step, their_step in zip(ours, theirs):
        numpy.testing.assert_allclose(our_step["kernel"][0], their_step["kernel"][0], rtol=1e-5, atol=1e-6)


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
    assert stats["syncs"] == 6 + 7 and stats["bytes"] == stats["syncs"] * REPLICAS * (4 + 1) * 4
    kernel = model.trainable_variables[0]
    first, *others = (c.numpy() for c in strategy.experimental_local_results(getattr(kernel, "value", kernel)))
    assert all(numpy.array_equal(first, other) for other in others)
    assert model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0) < history.history["loss"][0]
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    numpy.testing.assert_array_equal(loaded.get_weights()[0], first)


def test_a_programs_own_all_reduce_of_other_values_reduces_and_is_no_update():
    """In ``step_fn``, a value all-reduced by the program itself (as a custom metric would: here
    each replica's number plus one) is the sum over the replicas, and only the optimizer's
    all-reduce counts an update."""
    strategy = LocalSGDStrategy(DEVICES, param_sync_step=2)
    loop = _TutorialLoop(strategy)

    @tf.function
    def count_step(inputs):
        def step_fn(x, y):
            context = tf.distribute.get_replica_context()
            return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(context.replica_id_in_sync_group + 1,
                                                                          tf.float32))

        return strategy.experimental_local_results(strategy.run(step_fn, args=inputs))

    assert [float(total) for total in count_step(next(loop.batches))] == [sum(range(1, REPLICAS + 1))] * REPLICAS
    loop.train(2)
    assert strategy.extended.sync_stats["updates"] == 2 and strategy.extended.sync_stats["syncs"] == 1


def test_a_checkpoint_after_sync_now_resumes_diloco_where_it_stopped(tmp_path):
    """``tf.train.Checkpoint`` of the model, the optimizer and the extended's
    ``checkpoint_state`` (DiLoCo's anchors and momenta), saved after ``sync_now``: a new program
    that restores it trains on exactly as the one that saved it (and without the state, not)."""
    options = {"param_sync_step": 4, "outer_optimizer": DILOCO}
    first = _TutorialLoop(LocalSGDStrategy(DEVICES, **options))
    first.train(6)
    first.strategy.extended.sync_now()
    checkpoint = tf.train.Checkpoint(model=first.model, optimizer=first.optimizer,
                                     local_sgd=first.strategy.extended.checkpoint_state)
    path = checkpoint.save(tmp_path / "ckpt")
    expected = first.train(6)[-1]
    for with_state in (True, False):
        resumed = _TutorialLoop(LocalSGDStrategy(DEVICES, **options))
        state = {"local_sgd": resumed.strategy.extended.checkpoint_state} if with_state else {}
        tf.train.Checkpoint(model=resumed.model, optimizer=resumed.optimizer, **state).restore(path)
        for _ in range(6):
            next(resumed.batches)
        got = resumed.train(6)[-1]
        same = all(numpy.allclose(got[name][r], expected[name][r], rtol=0, atol=1e-6) for name in got for r in range(REPLICAS))
        assert same == with_state


def test_synced_model_is_the_model_of_the_last_sync():
    """``synced_model()``: after 6 updates syncing every 4, the copies right after update 4 (what a
    worker that lost a peer saves); None for plain averaging on one machine, which keeps no such model."""
    loop = _TutorialLoop(LocalSGDStrategy(DEVICES, param_sync_step=4, outer_optimizer=DILOCO))
    after_sync = loop.train(6)[3]
    synced = [var.numpy() for var in loop.strategy.extended.synced_model()]
    numpy.testing.assert_array_equal(synced[0], after_sync["kernel"][0])
    numpy.testing.assert_array_equal(synced[1], after_sync["bias"][0])
    assert not numpy.array_equal(synced[0], loop.copies()["kernel"][0])
    assert LocalSGDStrategy(DEVICES, param_sync_step=4).extended.synced_model() is None


def _example():
    """examples/keras_local_sgd.py, imported (it splits no devices on import)."""
    import importlib.util
    import os

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("keras_local_sgd", os.path.join(REPO, "examples", "keras_local_sgd.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_keras_example_classifies_as_well_as_with_mirrored_strategy(tmp_path):
    """The example's classifier (Keras' guide: ``compile``, ``fit`` with validation,
    ``evaluate``, ``save``) with local SGD every 8 updates reaches the test accuracy of
    MirroredStrategy at equal epochs, to 2 points; the saved model reloads under no strategy and
    evaluates the same."""
    example = _example()
    local = LocalSGDStrategy(DEVICES, param_sync_step=8)
    ours = example.train(local, epochs=3, num_examples=4096, model_path=str(tmp_path / "local.keras"))
    theirs = example.train(with_own_collective_keys(tf.distribute.MirroredStrategy, DEVICES), epochs=3, num_examples=4096)
    print(f"test accuracy: local SGD {ours:.4f}, MirroredStrategy {theirs:.4f}")
    assert theirs > 0.7 and abs(ours - theirs) <= 0.02
    assert local.extended.sync_stats["syncs"] >= 3 * 4096 // 128 // 8
    reloaded = keras.models.load_model(tmp_path / "local.keras")
    _, reloaded_accuracy = reloaded.evaluate(*example.make_data(2048, seed=3), batch_size=128, verbose=0)
    assert reloaded_accuracy == pytest.approx(ours, abs=1e-6)


@pytest.mark.parametrize("options,message", [
    ({"param_sync_step": 0}, "param_sync_step'] must be an int >= 1"),
    ({"param_sync_stepp": 4}, "LocalSGDStrategy has no option 'param_sync_stepp'"),
    ({"param_sync_time_diff": 60}, "'param_sync_time_diff' is not supported for TF2 programs: a sync by time needs a clock"),
    ({"sync_warmup_steps": 100}, "'sync_warmup_steps' is not supported for TF2 programs"),
    ({"param_sync_step_ramp": 100}, "'param_sync_step_ramp' is not supported for TF2 programs"),
    ({"optimizer_state_at_sync": "reset"}, "optimizer_state_at_sync 'reset' is not supported for TF2 programs: the strategy does "
     "not see the program's optimizer"),
    ({"outer_optimizer": {"class": "slowmo"}}, "outer_optimizer class 'slowmo' is not supported for TF2 programs: SlowMo's outer step "
     "scales by the inner learning rate"),
    ({"sync_error_feedback": False}, "'sync_error_feedback'] applies to sync_dtype 'int8' or 'int4'"),
    ({"param_sync_step": 8, "sync_delay": 8}, "'sync_delay'] must be less than param_sync_step / sync_fragments"),
    ({"sync_bucket_bytes": 2 ** 20}, "LocalSGDStrategy has no option 'sync_bucket_bytes'"),
])
def test_bad_options_are_one_line(options, message):
    with pytest.raises(ConfigError, match=message.replace("[", "\\[").replace("(", "\\(")):
        LocalSGDStrategy(DEVICES, **options)


def _numpy_local_sgd(steps: int, n: int, outer=None, quantized_bits=None, error_feedback=True, fragments=(),
                     delay=0, mix=0.5, learning_rate=0.05, local_step=None):
    """The custom loop's training written out in NumPy: each of the replicas applies SGD on its
    share of each global batch of 8 (in replica order) to its own copy of ``y = x k + b``; fragment i (of ``fragments``,
    lists of "kernel"/"bias"; default one of both) is synced after update ``(i + 1) n / F`` of
    each cycle of ``n``: each replica's change since the anchor (quantized in blocks of 64 to
    ``quantized_bits``, with error feedback), their mean, DiLoCo's Nesterov step from the anchor
    (``outer``), applied at once or ``delay`` updates later mixed into each copy; with
    ``local_step`` L, after every L-th update of a cycle that syncs nothing, the copies' plain mean
    (the replicas of this one machine are one worker), the anchor untouched. The copies after
    each update, as ``_custom_loop`` returns them."""
    x, y = _data()
    copies = [{"kernel": numpy.zeros((4, 1), "float32"), "bias": numpy.zeros(1, "float32")} for _ in range(REPLICAS)]
    anchor = {name: value.copy() for name, value in copies[0].items()}
    momentum = {name: numpy.zeros_like(value) for name, value in anchor.items()}
    residual = [0.0] * REPLICAS
    fragments = list(fragments) or [["kernel", "bias"]]
    ends = [round((i + 1) * n / len(fragments)) for i in range(len(fragments))]

    def quantize(values):
        qmax = 2 ** (quantized_bits - 1) - 1
        blocks = numpy.pad(values, (0, -len(values) % 64)).reshape(-1, 64)
        scales = numpy.abs(blocks).max(axis=1, keepdims=True) / qmax
        levels = numpy.clip(numpy.round(numpy.divide(blocks, scales, out=numpy.zeros_like(blocks),
                                                     where=scales > 0)), -qmax, qmax)
        return (levels * scales).reshape(-1)[:len(values)]

    def mean_change(names):
        sent = []
        for replica, copy in enumerate(copies):
            change = numpy.concatenate([(copy[name] - anchor[name]).reshape(-1) for name in names])
            if quantized_bits:
                change = change + (residual[replica] if error_feedback else 0)
                decoded = quantize(change)
                residual[replica] = change - decoded
                change = decoded
            sent.append(change)
        flat, parts = numpy.mean(sent, axis=0), {}
        for name in names:
            parts[name], flat = flat[:anchor[name].size].reshape(anchor[name].shape), flat[anchor[name].size:]
        return parts

    def new_model(change):
        for name, value in change.items():
            if outer:
                lr, mu = outer["learning_rate"], outer["momentum"]
                momentum[name] = mu * momentum[name] - value
                anchor[name] = anchor[name] - lr * (-value + mu * momentum[name])
            else:
                anchor[name] = anchor[name] + value
        return {name: anchor[name].copy() for name in change}

    history, in_flight, per_replica = [], None, GLOBAL_BATCH // REPLICAS
    for step in range(steps):
        batch = slice(8 * (step % 8), 8 * (step % 8) + 8)
        for replica, copy in enumerate(copies):
            own = slice(per_replica * replica, per_replica * (replica + 1))
            xs, ys = x[batch][own], y[batch][own]
            error = xs @ copy["kernel"] + copy["bias"] - ys
            copy["kernel"] = copy["kernel"] - learning_rate * 2 * xs.T @ error / per_replica
            copy["bias"] = copy["bias"] - learning_rate * 2 * error.sum(axis=0) / per_replica
        due = [i for i, end in enumerate(ends) if end == step % n + 1]
        if in_flight is not None:
            in_flight[1] += 1
            if in_flight[1] >= delay or due:
                synced = new_model(in_flight[0])
                for copy in copies:
                    copy.update({name: mix * copy[name] + (1 - mix) * value for name, value in synced.items()})
                in_flight = None
        for fragment in (i for i in due if fragments[i]):  # an empty fragment syncs nothing
            change = mean_change(fragments[fragment])
            if delay:
                in_flight = [change, 0]
            else:
                synced = new_model(change)
                for copy in copies:
                    copy.update({name: value.copy() for name, value in synced.items()})
        if local_step and not due and (step % n + 1) % local_step == 0:
            means = {name: numpy.mean([copy[name] for copy in copies], axis=0) for name in anchor}
            for copy in copies:
                copy.update({name: value.copy() for name, value in means.items()})
        history.append({name: [copy[name].copy() for copy in copies] for name in anchor})
    return history


DILOCO = {"class": "nesterov", "learning_rate": 0.7, "momentum": 0.5}


@pytest.mark.parametrize("options,rules", [
    ({"param_sync_step": 4}, {}),
    ({"param_sync_step": 4, "outer_optimizer": DILOCO}, {"outer": DILOCO}),
    ({"param_sync_step": 4, "sync_dtype": "int4"}, {"quantized_bits": 4}),
    ({"param_sync_step": 4, "sync_dtype": "int4", "sync_error_feedback": False},
     {"quantized_bits": 4, "error_feedback": False}),
    ({"param_sync_step": 4, "outer_optimizer": DILOCO, "sync_dtype": "int8"}, {"outer": DILOCO, "quantized_bits": 8}),
    ({"param_sync_step": 4, "outer_optimizer": DILOCO, "sync_fragments": 2, "sync_delay": 1},
     {"outer": DILOCO, "fragments": [["kernel"], ["bias"]], "delay": 1}),
    ({"param_sync_step": 4, "sync_fragments": 4}, {"fragments": [["kernel"], ["bias"], [], []]}),
    ({"param_sync_step": 6, "local_param_sync_step": 2, "outer_optimizer": DILOCO}, {"outer": DILOCO, "local_step": 2}),
], ids=["average", "diloco", "int4", "int4_no_error_feedback", "diloco_int8", "diloco_fragments_delay",
        "more_fragments_than_variables", "diloco_local_rounds"])
def test_the_custom_loop_syncs_by_the_rules_in_numpy(options, rules):
    """Twelve updates of TensorFlow's custom loop against :func:`_numpy_local_sgd`: every copy
    after every update, to 1e-5 (the int4 and int8 rows round the same values alike)."""
    strategy = LocalSGDStrategy(DEVICES, **options)
    ours = _custom_loop(strategy, 12)
    theirs = _numpy_local_sgd(12, options["param_sync_step"], **rules)
    # Local rounds after updates 2 and 4 of each cycle of 6; two cycles.
    assert strategy.extended.sync_stats["local_syncs"] == (4 if "local_step" in rules else 0)
    for step, (our_step, their_step) in enumerate(zip(ours, theirs), start=1):
        for name in ("kernel", "bias"):
            for replica in range(REPLICAS):
                numpy.testing.assert_allclose(our_step[name][replica], their_step[name][replica], rtol=1e-5, atol=1e-5,
                                              err_msg=f"{name}, replica {replica}, after update {step}")


class _TPURunOnLocalDevices(LocalSGDExtended):
    """What a TPU extended's ``tpu_run`` does, stood in for by a mirrored run on the local CPU
    devices (no TPU here): ``fn`` in replica context on every replica, per-replica results."""

    def tpu_run(self, fn, args, kwargs, options=None):
        return mirrored_strategy.MirroredExtended._call_for_each_replica(self, fn, args, kwargs or {})


class _LocalTPUStandInExtended(ScheduledLocalSGDTPUMixin, _TPURunOnLocalDevices):
    def __init__(self, container_strategy, options):
        super().__init__(container_strategy, devices=DEVICES)
        self._start_schedule(options)


class _LocalSGDTPUStandIn(tf.distribute.Strategy):
    """``LocalSGDTPUStrategy``'s extended (its mixin) over the local CPU devices; ``run`` goes
    through ``tpu_run``, as ``TPUStrategy.run`` does."""

    def __init__(self, **options):
        self._collective_key_base = own_collective_key_base() + KEYS_PER_STRATEGY // 2
        super().__init__(_LocalTPUStandInExtended(self, check_tf2_local_sgd_options(options, "LocalSGDTPUStrategy", tpu=True)))

    def run(self, fn, args=(), kwargs=None, options=None):
        with self.scope():
            return self.extended.tpu_run(fn, args, kwargs, options)


@pytest.mark.parametrize("options", [
    {"param_sync_step": 3},
    {"param_sync_step": 4, "outer_optimizer": DILOCO, "sync_fragments": 2, "sync_delay": 1},
    {"param_sync_step": 4, "sync_dtype": "int4"},
], ids=["average", "diloco_fragments_delay", "int4"])
def test_the_tpu_strategys_syncs_around_its_runs_train_as_the_local_strategy(options):
    """``LocalSGDTPUStrategy``'s schedule (a run's program reports its update; the syncs due run
    after it as programs of their own), as far as local CPU devices show it: TensorFlow's custom
    loop gives every copy of ``LocalSGDStrategy`` after every update, and the same counts."""
    stand_in = _LocalSGDTPUStandIn(**options)
    ours = _custom_loop(stand_in, 12)
    local = LocalSGDStrategy(DEVICES, **options)
    theirs = _custom_loop(local, 12)
    for step, (our_step, their_step) in enumerate(zip(ours, theirs), start=1):
        for name in ("kernel", "bias"):
            numpy.testing.assert_allclose(our_step[name], their_step[name], rtol=0, atol=1e-6, err_msg=f"update {step}")
    assert stand_in.extended.sync_stats == local.extended.sync_stats and local.extended.sync_stats["syncs"] > 0


def test_the_tpu_strategy_under_keras_fit_and_an_eager_run():
    """Keras ``fit`` through ``tpu_run`` counts every update and syncs on the schedule; a run
    without an update (an eager ``strategy.run`` of a metric) counts none."""
    strategy = _LocalSGDTPUStandIn(param_sync_step=4)
    x, y = _data(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, callbacks=[SyncCallback(strategy)])
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert strategy.extended.sync_stats["updates"] == 2 * 64 // GLOBAL_BATCH
    assert strategy.extended.sync_stats["syncs"] == 4 + 3  # scheduled, and the callback's (2 epoch ends, the end)
    strategy.run(lambda: tf.constant(1.0))
    assert strategy.extended.sync_stats["updates"] == 2 * 64 // GLOBAL_BATCH


def test_the_tpu_strategy_checks_its_options_before_it_looks_for_a_tpu():
    with pytest.raises(ConfigError, match="LocalSGDTPUStrategy has no option 'param_sync_stepp'"):
        LocalSGDTPUStrategy(param_sync_stepp=4)
    with pytest.raises(ConfigError, match="LocalSGDTPUStrategy: 'local_param_sync_step' is not supported for TF2 "
                                          "programs: a worker-local round averages within each host's cores"):
        LocalSGDTPUStrategy(local_param_sync_step=2)


WORKER_PROGRAM = """
import json, sys
import numpy, tensorflow as tf, keras
from returnn_tpu.strategies import MultiWorkerLocalSGDStrategy

strategy = MultiWorkerLocalSGDStrategy(  # TF_CONFIG
    param_sync_step=3, sync_dtype="int8", outer_optimizer={"class": "nesterov", "learning_rate": 0.7, "momentum": 0.5})
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
def test_two_workers_train_local_copies_and_combine_them_every_n_updates(tmp_path):
    """``MultiWorkerLocalSGDStrategy`` (DiLoCo, int8 syncs) in two processes (``TF_CONFIG`` on
    127.0.0.1), each on its own data: their kernels differ between syncs and are equal after
    updates 3 and 6."""
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
    # int8: 5 values in one block of 16 words and a scale, 68 bytes a sync
    assert all('stats {"updates": 6, "syncs": 2, "local_syncs": 0, "bytes": 136}' in output for output in outputs)


def _start_worker(folder, cluster: dict, index: int):
    """``python worker.py INDEX`` in ``folder`` as worker ``index`` of ``cluster`` (its ``TF_CONFIG``),
    its output piped."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
    return subprocess.Popen([sys.executable, "worker.py", str(index)], cwd=folder, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=tf_config))


def test_a_tf2_programs_start_up_timeout_is_an_exception_it_can_catch_and_retry(tmp_path):
    """A TF2 program whose second worker is not there: ``MultiWorkerLocalSGDStrategy`` raises
    ``ClusterDidNotComeUp`` naming that worker and the constructor's ``startup_timeout`` (a TF2
    user never wrote ``distribute_options``). The program catches it, and once worker 1 has come
    its second try makes the strategy on both workers."""
    import time

    from returnn_tpu.launcher import free_local_ports

    (tmp_path / "worker.py").write_text(
        "import os, sys, time\n"
        "from returnn_tpu.strategies import ClusterDidNotComeUp, MultiWorkerLocalSGDStrategy\n"
        "if sys.argv[1] == '0':\n"
        "    try:\n"
        "        MultiWorkerLocalSGDStrategy(startup_timeout=3, param_sync_step=3)\n"
        "    except ClusterDidNotComeUp as exc:\n"
        "        print('caught:', exc, exc.missing, flush=True)\n"
        "    open('caught', 'w').close()\n"
        "strategy = MultiWorkerLocalSGDStrategy(startup_timeout=60, param_sync_step=3)\n"
        "print('replicas:', strategy.num_replicas_in_sync, flush=True)\n")
    ports = free_local_ports(2)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}

    def start(index):
        return _start_worker(tmp_path, cluster, index)

    first = start(0)
    deadline = time.time() + 120
    while not (tmp_path / "caught").exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    second = start(1)
    outputs = [process.communicate(timeout=180) for process in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], [error[-2000:] for _, error in outputs]
    assert outputs[0][0].splitlines()[0] == (
        f"caught: worker 0: the cluster did not come up within 3 s (MultiWorkerLocalSGDStrategy(startup_timeout=...)); "
        f"no answer from worker 1 (127.0.0.1:{ports[1]}) ['worker 1 (127.0.0.1:{ports[1]})']")
    assert all(output.splitlines()[-1] == "replicas: 2" for output, _ in outputs), outputs

def test_a_worker_lost_after_the_barrier_ends_tensorflows_start_up_by_the_watchdog(tmp_path):
    """Worker 1 meets worker 0 in the start-up barrier, then dies before TensorFlow's start-up:
    worker 0, held in TensorFlow's C++ start-up, is ended by the start-up watchdog with one line
    naming worker 1, and status 1 (docs/faults.md), not 137. (The watchdog's floor is lowered in
    the program from 60 s to 5 s.)"""

    from returnn_tpu.launcher import free_local_ports

    (tmp_path / "worker.py").write_text(
        "import sys\n"
        "from returnn_tpu.strategies import MultiWorkerLocalSGDStrategy, multi_worker, startup_barrier\n"
        "if sys.argv[1] == '1':\n"
        "    print('imported', flush=True)\n"
        "    startup_barrier.wait_for_workers(\n"
        "        multi_worker.tf.distribute.cluster_resolver.TFConfigClusterResolver(), 60, 'test')\n"
        "    sys.exit(0)\n"
        "multi_worker.TENSORFLOW_STARTUP_SECONDS = 5\n"
        "MultiWorkerLocalSGDStrategy(startup_timeout=3, param_sync_step=3)\n")
    ports = free_local_ports(2)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}

    def start(index):
        return _start_worker(tmp_path, cluster, index)

    second = start(1)
    assert second.stdout.readline() == "imported\n"  # worker 0's 3 s then start with worker 1 waiting
    workers = [start(0), second]
    outputs = [worker.communicate(timeout=180) for worker in workers]
    assert [worker.returncode for worker in workers] == [1, 0], [error[-2000:] for _, error in outputs]
    errors = [line for line in outputs[0][1].splitlines() if line.startswith("returnn-tpu: error:")]
    assert errors == ["returnn-tpu: error: worker 0: the cluster did not come up: all workers had met, then "
                      "TensorFlow's start-up took over 5 s (MultiWorkerLocalSGDStrategy(startup_timeout=...)); "
                      f"no answer from worker 1 (127.0.0.1:{ports[1]})"]


KERAS_MULTI_WORKER_TUTORIAL = """
# TensorFlow's "Multi-worker training with Keras" tutorial (mnist_setup.py and main.py) with the
# strategy's constructor swapped. Changed besides: made-up digits (no download here), a seeded
# shuffle and seeded initial weights (so that runs compare), fewer steps, an interruption after
# epoch 1 that BackupAndRestore recovers from, and a backup_dir per worker (the tutorial's workers
# run on machines of their own; Keras 3's callback is not aware of other workers on one machine).
import json, os, sys
import numpy as np
import tensorflow as tf
import keras
from returnn_tpu.strategies import MultiWorkerLocalSGDStrategy

keras.utils.set_random_seed(1)


def mnist_dataset(batch_size):
    rng = np.random.RandomState(0)
    x_train = rng.randint(0, 256, size=(600, 28, 28)).astype("uint8")
    y_train = (x_train[:, 14].astype(int).sum(axis=1) % 10).astype("uint8")
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(600, seed=1).repeat().batch(batch_size)


def build_and_compile_cnn_model():
    model = keras.Sequential([
        keras.layers.InputLayer(input_shape=(28, 28)),
        keras.layers.Reshape(target_shape=(28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation='relu'),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation='relu'),
        keras.layers.Dense(10)
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(learning_rate=0.1), metrics=['accuracy'])
    return model


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


per_worker_batch_size = 16
if sys.argv[1] == "one_process":  # the global batch on one device (under a strategy, as Keras' fit then
    # takes the first batch to build the model and trains from the second: FACTS.md, "Keras fit across workers")
    num_workers, task_id, strategy = 2, "_one_process", tf.distribute.OneDeviceStrategy("/cpu:0")
else:
    tf_config = json.loads(os.environ['TF_CONFIG'])
    num_workers, task_id = len(tf_config['cluster']['worker']), tf_config['task']['index']
    strategy = MultiWorkerLocalSGDStrategy(param_sync_step=int(sys.argv[1]))
multi_worker_dataset = mnist_dataset(per_worker_batch_size * num_workers)
with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()
backup = keras.callbacks.BackupAndRestore(backup_dir=f'backup{task_id}')
try:
    multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=4, callbacks=[backup, Interrupt()], verbose=0)
except RuntimeError:
    print("interrupted after epoch 1", flush=True)
history = multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=4, callbacks=[backup], verbose=0)
print("epochs after the restore:", len(history.history['loss']), flush=True)
np.save(f'weights{task_id}.npy', np.concatenate([w.ravel() for w in multi_worker_model.get_weights()]))
path = 'keras-model.keras' if task_id in (0, "_one_process") else os.path.join(f'workertemp_{task_id}', 'keras-model.keras')
os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
multi_worker_model.save(path)
"""


@pytest.mark.slow
def test_tensorflows_multi_worker_keras_tutorial_trains_with_the_constructor_swapped(tmp_path):
    """TensorFlow's multi-worker Keras tutorial (``fit`` with ``steps_per_epoch`` on a repeated
    dataset, ``BackupAndRestore``, the chief's ``model.save``), which fails under Keras 3 with
    TensorFlow's own ``MultiWorkerMirroredStrategy`` (keras-team/keras#20585), trains on 2
    workers over ``TF_CONFIG`` with ``MultiWorkerLocalSGDStrategy``. With ``param_sync_step = 1``
    and SGD both workers' weights equal one process's trained on the global batch, also after
    an interruption that BackupAndRestore recovers from."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO
    from returnn_tpu.launcher import free_local_ports

    (tmp_path / "main.py").write_text(KERAS_MULTI_WORKER_TUTORIAL)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_local_ports(2)]}
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    workers = [subprocess.Popen([sys.executable, "main.py", "1"], cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=dict(env, TF_CONFIG=json.dumps(
                                    {"cluster": cluster, "task": {"type": "worker", "index": i}})))
               for i in range(2)]
    outputs = [worker.communicate(timeout=300)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    one = subprocess.run([sys.executable, "main.py", "one_process"], cwd=tmp_path, capture_output=True, text=True,
                         env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    for output in outputs + [one.stdout]:
        assert "interrupted after epoch 1" in output and "epochs after the restore: 2" in output, output[-2000:]
    weights = [numpy.load(tmp_path / f"weights{i}.npy") for i in (0, 1, "_one_process")]
    numpy.testing.assert_array_equal(weights[0], weights[1])
    numpy.testing.assert_allclose(weights[0], weights[2], rtol=1e-4, atol=1e-4)  # a sum order of its own: 3e-5
    assert (tmp_path / "keras-model.keras").exists() and (tmp_path / "workertemp_1" / "keras-model.keras").exists()
