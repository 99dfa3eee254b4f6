"""Parity with plain RETURNN on configs in the styles real setups are written in.

Each config in ``tests/configs`` is run by plain RETURNN (``python -m returnn``) and by
returnn-tpu with ``distribute_strategy = "single"`` and the same seed: the initial parameters
(``task = "initialize_model"``) must be equal, the loss of the first step (RETURNN's per-step line
at ``log_verbosity = 5``) agree within 1e-4 relative, and the epoch-1 scores in
``learning_rate_file`` have the same keys and agree within 2%. Then ``local_sgd`` with two
replicas trains it. Plain RETURNN cannot train ``nadam`` on TF 2.21: that variant is trained by
returnn-tpu alone.
"""

import os

import numpy
import pytest

from parity import CONFIGS, compare, run, train_epoch

CONFIG_NAMES = sorted(name[: -len(".config")] for name in os.listdir(CONFIGS) if name.endswith(".config"))


def write_hdf(path, num_seqs=30, seed=1):
    """A RETURNN HDF file of 12AX-shaped sequences (9-dim features, 2 classes)."""
    from returnn.datasets.hdf import SimpleHDFWriter

    rng = numpy.random.RandomState(seed)
    writer = SimpleHDFWriter(str(path), dim=9, ndim=2)
    for i in range(num_seqs):
        length = rng.randint(5, 30)
        feats = rng.randn(1, length, 9).astype("float32")
        classes = (feats[:, :, 0] > 0).astype("int32")
        writer.insert_batch(feats, seq_len=[length], seq_tag=[f"seq-{i}"], extra={"classes": classes})
    writer.close()


@pytest.fixture
def env(tmp_path):
    hdf = tmp_path / "data.hdf"
    write_hdf(hdf)
    return {"PARITY_HDF": str(hdf)}


def test_there_are_enough_configs():
    assert len(CONFIG_NAMES) >= 12


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_same_as_plain_returnn(name, tmp_path, env):
    config = os.path.join(CONFIGS, name + ".config")
    out = compare(config, str(tmp_path), env=env)
    plain, ours = out["plain_params"], out["our_params"]
    assert sorted(plain) == sorted(ours)
    for key in plain:
        assert plain[key].shape == ours[key].shape, key
        numpy.testing.assert_allclose(ours[key], plain[key], atol=1e-6, rtol=0, err_msg=key)
    for key, value in out["plain_step"].items():
        if key.startswith("cost:"):
            assert out["our_step"][key] == pytest.approx(value, rel=1e-4), key
    assert sorted(out["our_scores"]) == sorted(out["plain_scores"])
    for key, value in out["plain_scores"].items():
        assert out["our_scores"][key] == pytest.approx(value, rel=0.02, abs=1e-3), key
    # Then it trains distributed.
    run("returnn_tpu", config, str(tmp_path / "local_sgd"),
        ["++model", "out/model", "++distribute_strategy", "local_sgd", "++distribute_options",
         "{'num_replicas': 2, 'param_sync_step': 2}"], env=env)
    assert os.path.exists(tmp_path / "local_sgd" / "out" / "model.001.index")
