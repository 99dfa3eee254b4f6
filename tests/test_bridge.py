"""The RETURNN bridge: every parameter gets a gradient, replicas get their own dropout masks."""

import numpy
import pytest
import tensorflow as tf

from conftest import make_trainer, random_step_batches

LAYER_NETWORKS = {
    "linear": {
        "l": {"class": "linear", "activation": "relu", "n_out": 8, "from": "data"},
        "output": {"class": "softmax", "loss": "ce", "from": "l"},
    },
    "standardlstm": {
        "l": {"class": "rec", "unit": "standardlstm", "n_out": 8, "from": "data"},
        "output": {"class": "softmax", "loss": "ce", "from": "l"},
    },
    "nativelstm2": {
        "l": {"class": "rec", "unit": "nativelstm2", "n_out": 8, "from": "data"},
        "output": {"class": "softmax", "loss": "ce", "from": "l"},
    },
    "conv": {
        "l": {"class": "conv", "filter_size": (3,), "padding": "same", "n_out": 8, "activation": "relu", "from": "data"},
        "output": {"class": "softmax", "loss": "ce", "from": "l"},
    },
    "self_attention": {
        "l": {"class": "self_attention", "num_heads": 2, "total_key_dim": 8, "n_out": 8, "from": "data"},
        "output": {"class": "softmax", "loss": "ce", "from": "l"},
    },
    "layer_norm": {
        "lin": {"class": "linear", "activation": None, "n_out": 8, "from": "data"},
        "l": {"class": "layer_norm", "from": "lin"},
        "output": {"class": "softmax", "loss": "ce", "from": "l"},
    },
    # Weight noise and weight dropout make the parameter a tensor; RETURNN finds the variable behind
    # it by its handle (without which it silently gets no gradient).
    "weight_noise": {
        "l": {"class": "linear", "activation": "tanh", "n_out": 8, "from": "data", "param_variational_noise": 0.1,
              "param_dropout": 0.1},
        "output": {"class": "softmax", "loss": "ce", "from": "l"},
    },
    "dropout": {
        "lin": {"class": "linear", "activation": "tanh", "n_out": 8, "from": "data"},
        "l": {"class": "dropout", "dropout": 0.3, "from": "lin"},
        "output": {"class": "softmax", "loss": "ce", "from": "l"},
    },
}


@pytest.mark.parametrize("layer", sorted(LAYER_NETWORKS))
def test_every_parameter_gets_a_gradient(tmp_path, rng, layer):
    trainer = make_trainer(tmp_path, LAYER_NETWORKS[layer], strategy="mirrored", num_replicas=2)
    grads, _ = trainer.steps.replica_gradients(trainer.steps.distribute(random_step_batches(rng, 2)))
    expected_layers = set(LAYER_NETWORKS[layer]) - {"l"} if layer == "dropout" else set(LAYER_NETWORKS[layer])
    assert {name.split("/")[0] for name in grads} == expected_layers
    for name, grad in grads.items():
        for replica_grad in trainer.strategy.experimental_local_results(grad):
            assert replica_grad is not None, name
            assert numpy.abs(replica_grad.numpy()).max() > 0, f"{name}: zero gradient"


def test_parameter_count_matches_plain_returnn(tmp_path):
    """Parameters are created once (not per trace or per replica) and are exactly RETURNN's."""
    trainer = make_trainer(tmp_path, LAYER_NETWORKS["standardlstm"], num_replicas=2)
    trainer.train_step(random_step_batches(numpy.random.RandomState(0), 2), 0.1)
    trainer.train_step(random_step_batches(numpy.random.RandomState(1), 2, time=11), 0.1)
    assert sorted(trainer.steps.parameter_copies()) == [
        "l/rec/lstm_cell/bias", "l/rec/lstm_cell/kernel", "output/W", "output/b"
    ]


def test_replicas_drop_different_units(tmp_path):
    network = {
        "l": {"class": "dropout", "dropout": 0.5, "dropout_noise_shape": {"*": None}, "from": "data"},
        "output": {"class": "copy", "from": "l"},
        "loss": {"class": "copy", "from": "l", "loss": "mse", "target": "data"},  # a trainer needs a loss
    }
    trainer = make_trainer(tmp_path, network, strategy="mirrored", num_replicas=2, train={"class": "Task12AXDataset", "num_seqs": 2})
    ones = {"data": numpy.ones((2, 50, 9), "float32"), "size:data:0": numpy.array([50, 50], "int32")}

    @tf.function(autograph=False)
    def dropout_masks(batch):
        def replica(b):
            from returnn_tpu.returnn_side.returnn_bridge import static_replica_id

            net, _ = trainer.builder.build(b, train=True, replica_id=static_replica_id())
            return tf.cast(net.get_default_output_layer().output.placeholder > 0, tf.float32)

        return trainer.strategy.run(replica, args=(batch,))

    masks = [m.numpy() for m in trainer.strategy.experimental_local_results(dropout_masks(trainer.steps.distribute([ones, ones])))]
    assert 0.3 < masks[0].mean() < 0.7 and 0.3 < masks[1].mean() < 0.7
    assert (masks[0] != masks[1]).mean() > 0.3


def test_returnn_gradient_definitions_reach_the_tape(tmp_path, rng):
    """RETURNN's own gradient definitions hold under the GradientTape (FACTS.md, "Gradients under a
    tape"): a scaled_grad layer with scale 0 and shift 0 (gradient_override_map) gives the layers
    below it a zero gradient (the plain identity gradient would not be zero), and a cross-entropy computed without the fused op (safe_log rewrites the
    softmax with copy_op) gives the output layer a gradient, as in a TF1 graph."""
    network = {
        "below": {"class": "linear", "activation": "tanh", "n_out": 8, "from": "data"},
        "scaled": {"class": "scaled_grad", "scale": 0.0, "shift": 0.0, "from": "below"},
        "above": {"class": "linear", "activation": "tanh", "n_out": 8, "from": "scaled"},
        "output": {"class": "softmax", "loss": "ce", "loss_opts": {"use_fused": False}, "from": "above"},
    }
    trainer = make_trainer(tmp_path, network, strategy="single", num_replicas=1)
    grads, _ = trainer.steps.replica_gradients(trainer.steps.distribute(random_step_batches(rng, 1)))
    for name, grad in grads.items():
        norm = float(tf.linalg.norm(grad))
        assert (norm == 0.0) if name.startswith("below/") else (norm > 0.0), (name, norm)


def test_unrolled_recurrence_is_traced_without_branches():
    """``static_rnn`` with sequence lengths (RETURNN's ``"unroll": True``) selects per step instead
    of branching (patches.py): no ``If`` in the trace, and the same values as TensorFlow's branches
    (outputs zero and states held from each sequence's end)."""
    from returnn_tpu.patches import setup_returnn

    setup_returnn()
    from tensorflow.python.ops import rnn, rnn_cell_impl

    cell = rnn_cell_impl.BasicRNNCell(3)
    inputs = [tf.constant(numpy.random.RandomState(step).randn(2, 4), tf.float32) for step in range(5)]
    lengths = tf.constant([2, 5])

    @tf.function(autograph=False)
    def unrolled():
        outputs, state = rnn.static_rnn(cell, inputs, sequence_length=lengths, dtype=tf.float32)
        return tf.stack(outputs), state

    op_types = {op.type for op in unrolled.get_concrete_function().graph.get_operations()}
    assert not op_types & {"If", "StatelessIf"}, op_types
    outputs, state = (t.numpy() for t in unrolled())
    assert not outputs[2:, 0].any() and outputs[:2, 0].all()  # sequence 0 ends after 2 steps
    numpy.testing.assert_allclose(state[0], outputs[1, 0], rtol=1e-6)  # its state is its last output
    numpy.testing.assert_allclose(state[1], outputs[4, 1], rtol=1e-6)
