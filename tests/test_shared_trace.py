"""One trace for all replicas: the network is built once for the train step (and once for the eval
step) whatever the number of local replicas; each replica calls that function with its own
variables and seed (FACTS.md, "One trace for all replicas")."""

import numpy
import pytest
import tensorflow as tf

from conftest import make_trainer, random_step_batches

LSTM = {  # with a layer that shares another's parameters (RETURNN finds them by name)
    "l": {"class": "rec", "unit": "standardlstm", "n_out": 8, "from": "data"},
    "proj": {"class": "linear", "activation": "tanh", "n_out": 8, "from": "l"},
    "proj_shared": {"class": "linear", "activation": "tanh", "n_out": 8, "from": "proj", "reuse_params": "proj"},
    "output": {"class": "softmax", "loss": "ce", "from": "proj_shared"},
}


def count_builds(trainer):
    """Counts the RETURNN network constructions of ``trainer``'s builder from now on."""
    builds = []
    build = trainer.builder.build

    def counted(*args, **kwargs):
        builds.append(kwargs.get("train"))
        return build(*args, **kwargs)

    trainer.builder.build = counted
    return builds


def train_and_read(trainer, steps=4):
    rng = numpy.random.RandomState(5)
    for _ in range(steps):
        trainer.train_step(random_step_batches(rng, 4), 0.1)
    return trainer.steps.parameter_copies()


@pytest.mark.parametrize("strategy,options", [("local_sgd", {"param_sync_step": 3}), ("mirrored", {})])
def test_one_trace_for_four_replicas_trains_as_one_trace_per_replica(tmp_path, strategy, options):
    """Parameters after 4 steps at 4 replicas equal those of per-replica traces (<= 1e-6), and the
    train step built the network twice (creating the variables, then the shared trace), not 1 + 4 times."""
    shared = make_trainer(tmp_path / "shared", LSTM, strategy=strategy, num_replicas=4, distribute_options=options)
    shared_builds = count_builds(shared)
    own = make_trainer(tmp_path / "own", LSTM, strategy=strategy, num_replicas=4, distribute_options=options)
    own.steps.replica.shared_trace = False
    own_builds = count_builds(own)
    ours, theirs = train_and_read(shared), train_and_read(own)
    assert len(shared_builds) == 2 and len(own_builds) == 1 + 4
    for name in theirs:
        for replica, (a, b) in enumerate(zip(ours[name], theirs[name])):
            numpy.testing.assert_allclose(a, b, atol=1e-6, rtol=0, err_msg=f"{name}, replica {replica}")
    # The eval step: one build for all replicas, too.
    rng = numpy.random.RandomState(6)
    shared.steps.evaluate(random_step_batches(rng, 4), [1.0] * 4)
    assert shared_builds[2:] == [False]


def test_a_network_change_builds_twice_for_four_replicas(tmp_path):
    def get_network(epoch, **_):
        net = {"l1": {"class": "linear", "activation": "tanh", "n_out": 8, "from": "data"}}
        if epoch > 1:
            net["l2"] = {"class": "linear", "activation": "tanh", "n_out": 8, "from": "l1"}
        net["output"] = {"class": "softmax", "loss": "ce", "from": "l2" if epoch > 1 else "l1"}
        return net

    trainer = make_trainer(tmp_path, None, num_replicas=4, get_network=get_network)
    rng = numpy.random.RandomState(0)
    trainer.network.use_epoch(1)
    trainer.train_step(random_step_batches(rng, 4), 0.1)
    builds = count_builds(trainer)
    trainer.network.use_epoch(2)
    trainer.train_step(random_step_batches(rng, 4), 0.1)
    assert len(builds) == 2  # the new variables, and the train step's one trace
    assert "l2/W" in trainer.steps.parameter_copies()


def test_a_random_op_without_a_stateless_form_gives_each_replica_its_own_trace(tmp_path):
    """``tf.random.shuffle`` has no stateless form: the shared trace is given up and each of the
    4 replicas builds its own (1 + 1 + 4 builds), and training goes on."""
    network = {
        "l": {"class": "linear", "activation": "tanh", "n_out": 8, "from": "data"},
        "shuffled": {"class": "eval", "eval": "tf.random.shuffle(source(0))", "from": "l"},
        "output": {"class": "softmax", "loss": "ce", "from": "shuffled"},
    }
    trainer = make_trainer(tmp_path, network, strategy="mirrored", num_replicas=4)
    builds = count_builds(trainer)
    metrics = trainer.train_step(random_step_batches(numpy.random.RandomState(0), 4), 0.1)
    assert len(builds) == 1 + 1 + 4
    losses = [float(v) for v in trainer.strategy.experimental_local_results(metrics["cost:output"])]
    assert all(numpy.isfinite(losses)) and all(loss > 0 for loss in losses)


def test_replicas_of_one_trace_drop_different_units(tmp_path):
    """Every replica's gradient differs on the same batch with dropout (each draws its own masks),
    and is the same without."""
    def network(dropout):
        return {
            "l": {"class": "linear", "activation": "tanh", "n_out": 16, "dropout": dropout, "from": "data"},
            "output": {"class": "softmax", "loss": "ce", "from": "l"},
        }

    for dropout in (0.5, 0.0):
        trainer = make_trainer(tmp_path / str(dropout), network(dropout), strategy="mirrored", num_replicas=4)
        trainer.train_step(random_step_batches(numpy.random.RandomState(0), 4), 0.1)  # builds
        same = random_step_batches(numpy.random.RandomState(1), 1) * 4
        grads, _ = trainer.steps.replica_gradients(trainer.steps.distribute(same))
        copies = [g.numpy() for g in trainer.strategy.experimental_local_results(grads["l/W"])]
        differing = [not numpy.allclose(copies[0], other) for other in copies[1:]]
        assert all(differing) if dropout else not any(differing), dropout


def test_random_numbers_of_a_shared_build_differ_by_seed_step_and_loop_iteration(tmp_path):
    """In a build shared by the replicas, TensorFlow's stateful random ops draw by (replica seed,
    update step, op, loop iteration): a dropout inside a rec loop gets a new mask every frame."""
    from returnn_tpu.returnn_side.returnn_bridge import SharedBuild

    network = {
        # "d" reads the loop's state, and its mask has the batch's shape: it is made in the loop
        "loop": {"class": "rec", "from": "data", "unit": {
            "sum": {"class": "combine", "kind": "add", "from": ["data:source", "prev:sum"]},
            "d": {"class": "dropout", "dropout": 0.5, "dropout_noise_shape": {"*": None}, "from": "sum"},
            "output": {"class": "copy", "from": "d"},
        }},
        "output": {"class": "copy", "from": "loop"},
        "loss": {"class": "copy", "from": "loop", "loss": "mse", "target": "data"},  # a trainer needs a loss
    }
    trainer = make_trainer(tmp_path, network, strategy="single", num_replicas=1)
    ones = {"data": tf.ones((1, 40, 9)), "size:data:0": tf.constant([40])}

    @tf.function(autograph=False)
    def masks(seed, step):
        net, _ = trainer.builder.build(ones, train=True, replica_id=0, global_step=step,
                                       shared=SharedBuild({}, tf.constant(seed, tf.int64)))
        return tf.cast(net.get_default_output_layer().output.copy_as_batch_major().placeholder > 0, tf.float32)

    first = masks(1, tf.constant(0, tf.int64)).numpy()[0]  # (time, 9)
    assert 0.3 < first.mean() < 0.7, first
    assert (first[0] != first[1]).mean() > 0.2  # a new mask every frame
    assert (first != masks(2, tf.constant(0, tf.int64)).numpy()[0]).mean() > 0.2  # another replica
    assert (first != masks(1, tf.constant(1, tf.int64)).numpy()[0]).mean() > 0.2  # the next update
    numpy.testing.assert_array_equal(first, masks(1, tf.constant(0, tf.int64)).numpy()[0])  # reproducible
