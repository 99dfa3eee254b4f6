"""Parity with plain RETURNN on configs in the styles real setups are written in.

Each config in ``tests/configs`` is run by plain RETURNN (``python -m returnn``) and by
returnn-tpu with ``distribute_strategy = "single"`` and the same seed: the initial parameters
(``save_epoch1_initial_model``) must be equal, the loss of the first step (RETURNN's per-step line
at ``log_verbosity = 5``) agree within 1e-4 relative, and the epoch-1 scores in
``learning_rate_file`` have the same keys, the train scores within 2% (errors and dev scores,
where dropout masks differ, within 10%). Then ``local_sgd`` with two
replicas trains it. Plain RETURNN cannot train ``nadam`` on TF 2.21: that variant is trained by
returnn-tpu alone.
"""

import json
import os

import numpy
import pytest

from parity import CONFIGS, compare, initial_params_of, run

CONFIG_NAMES = sorted(name[: -len(".config")] for name in os.listdir(CONFIGS) if name.endswith(".config"))


def write_hdf(path, num_seqs=30, seed=1):
    """A RETURNN HDF file of 12AX-shaped sequences (9-dim features, 2 classes)."""
    from returnn.datasets.hdf import SimpleHDFWriter

    rng = numpy.random.RandomState(seed)
    writer = SimpleHDFWriter(str(path), dim=9, ndim=2, extra_type={"classes": (2, 1, "int32")})
    for i in range(num_seqs):
        length = rng.randint(5, 30)
        feats = rng.randn(1, length, 9).astype("float32")
        classes = (feats[:, :, 0] > 0).astype("int32")
        writer.insert_batch(feats, seq_len=[length], seq_tag=[f"seq-{i}"], extra={"classes": classes})
    writer.close()


@pytest.fixture
def env(tmp_path, request):
    """The configs' data files: an HDF file, and for the speech config the tiny espeak-ng corpus."""
    hdf = tmp_path / "data.hdf"
    write_hdf(hdf)
    speech = {"PARITY_SPEECH": request.getfixturevalue("speech_corpus_dir")} if "ogg_zip" in request.node.name else {}
    return {"PARITY_HDF": str(hdf), **speech}


def test_there_are_enough_configs():
    assert len(CONFIG_NAMES) >= 12


# Configs whose network changes between epochs (get_network; pretrain over epochs 1-2, then the
# full network): trained for this many epochs, and checked in every epoch.
EPOCHS = {"get_network": 3, "enc_dec_attention_pretrain": 3}
# RETURNN's cleanup_old_models on those, which must keep the same files.
CLEANUP = ["++cleanup_old_models", "{'keep_last_n': 1, 'keep_best_n': 0, 'keep': [0]}"]


# Configs with frozen layers ("trainable": False): their parameters, which no run may change.
FROZEN = {"ctc_blstm": ["conv0/W"]}
# In the quick suite (the README's test command); the other configs run with the slow tests.
QUICK = {"old_style_12ax", "factored_hybrid_shared_dims"}


@pytest.mark.parametrize("name", [name if name in QUICK else pytest.param(name, marks=pytest.mark.slow)
                                  for name in CONFIG_NAMES])
def test_same_as_plain_returnn(name, tmp_path, env):
    config = os.path.join(CONFIGS, name + ".config")
    epochs = ["++num_epochs", str(EPOCHS[name]), *CLEANUP] if name in EPOCHS else []
    out = compare(config, str(tmp_path), env=env, args=epochs)
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
        if key in (":meta:epoch_num_train_steps", ":meta:global_train_step", ":learning_rate"):
            assert out["our_scores"][key] == value, key
        if key.startswith(":meta:"):  # RETURNN's other entries of the epoch (its time, learning rate)
            continue
        # Dropout masks come from other random streams, so errors and dev scores drift more.
        tolerance = 0.02 if key.startswith("train_score") else 0.1
        assert out["our_scores"][key] == pytest.approx(value, rel=tolerance, abs=1e-3), key
    if name in EPOCHS:
        assert_every_epoch_as_plain_returnn(config, tmp_path, EPOCHS[name])
    if name == "old_style_12ax":
        assert_plain_returnn_run_continues(config, tmp_path, env)
    # Then it trains distributed (the data on a thread: the producer is not what this tests).
    run("returnn_tpu", config, str(tmp_path / "local_sgd"),
        ["++model", "out/model", "++distribute_strategy", "local_sgd", "++distribute_options",
         "{'num_replicas': 2, 'param_sync_step': 2, 'data_producer': 'thread'}"], env=env)
    assert [f for f in os.listdir(tmp_path / "local_sgd" / "out") if f.endswith(".001.index")]  # (pretrain.)001
    with open(tmp_path / "local_sgd" / "out" / "metrics.jsonl") as f:
        assert json.loads(f.readline())["num_replicas"] == 2
    for run_name in ("plain", "ours", "local_sgd") if name in FROZEN else ():
        trained = initial_params_of(str(tmp_path / run_name / "out" / "model.001"))
        for key in FROZEN[name]:
            numpy.testing.assert_array_equal(trained[key], plain[key], err_msg=f"{run_name}: frozen {key} changed")


@pytest.mark.slow
def test_initialize_model_writes_what_plain_returnn_writes(tmp_path):
    """``task = "initialize_model"``: the parameters plain RETURNN's task writes, to ``model``."""
    config = os.path.join(CONFIGS, "old_style_12ax.config")
    params = {}
    for tool, extra in (("returnn", []), ("returnn_tpu", ["++distribute_strategy", "single"])):
        run(tool, config, str(tmp_path / tool), ["++task", "initialize_model", "++model", "init", *extra])
        params[tool] = initial_params_of(str(tmp_path / tool / "init"))
    assert sorted(params["returnn"]) == sorted(params["returnn_tpu"])
    for name, value in params["returnn"].items():
        numpy.testing.assert_allclose(params["returnn_tpu"][name], value, atol=1e-6, rtol=0, err_msg=name)


def assert_plain_returnn_run_continues(config, tmp_path, env):
    """A run that plain RETURNN trained (epoch 1, Adam) continues under returnn-tpu at epoch 2 in
    the same folder: its parameters load, the optimizer's slots, which plain RETURNN does not
    save, start fresh with a warning, and epoch 1's record stays as plain RETURNN wrote it."""
    before = lr_file_scores(tmp_path / "plain/out/lr")
    result = run("returnn_tpu", config, str(tmp_path / "plain"),
                 ["++model", "out/model", "++learning_rate_file", "out/lr", "++num_epochs", "2",
                  "++distribute_strategy", "single"], env=env)
    assert "start training at epoch 2" in result.stdout
    assert "has no optimizer state" in result.stdout and "slots start fresh" in result.stdout
    after = lr_file_scores(tmp_path / "plain/out/lr")
    assert sorted(after) == [1, 2] and after[1] == before[1]
    assert os.path.exists(tmp_path / "plain/out/model.002.index")


def lr_file_scores(path):
    from returnn.learning_rate_control import LearningRateControl

    control = LearningRateControl(default_learning_rate=1.0, filename=str(path))
    return {epoch: (data.learning_rate, dict(data.error)) for epoch, data in control.epoch_data.items()}


def assert_every_epoch_as_plain_returnn(config, tmp_path, epochs):
    """Networks that change between epochs: the same learning rates, score keys and close scores
    in every epoch, the same checkpoint names (``model.pretrain.NNN``), and RETURNN's
    cleanup_old_models keeps the same files; plain RETURNN evaluates our last checkpoint."""
    plain, ours = lr_file_scores(tmp_path / "plain/out/lr"), lr_file_scores(tmp_path / "ours/out/lr")
    assert sorted(plain) == sorted(ours) == list(range(1, epochs + 1))
    for epoch in plain:
        assert ours[epoch][0] == pytest.approx(plain[epoch][0])  # learning rate
        assert sorted(ours[epoch][1]) == sorted(plain[epoch][1])
        for key, value in plain[epoch][1].items():
            if key.startswith("train_score"):
                assert ours[epoch][1][key] == pytest.approx(value, rel=0.05, abs=1e-3), (epoch, key)
    checkpoint_files = lambda d: sorted(f for f in os.listdir(d) if ".index" in f)  # noqa: E731
    assert checkpoint_files(tmp_path / "ours/out") == checkpoint_files(tmp_path / "plain/out")
    with open(tmp_path / "ours/out/metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    assert all(isinstance(m["dev_score"], (float, dict)) for m in metrics), metrics  # numeric, not None
    # Plain RETURNN evaluates our last checkpoint (returnn-tpu hands it the task).
    result = run("returnn_tpu", config, str(tmp_path / "ours"), ["++model", "out/model", "++task", "eval",
                                                                   "++load_epoch", str(epochs)])
    assert "Evaluate epoch" in result.stdout and "dev: score" in result.stdout


@pytest.mark.slow
def test_nadam_trains_where_plain_returnn_cannot(tmp_path):
    """The hybrid config with nadam: plain RETURNN fails on TF 2.21 (Keras 3); returnn-tpu trains it."""
    config = os.path.join(CONFIGS, "hybrid_blstm_gradnoise.config")
    nadam = ["++adam", "0", "++nadam", "1", "++model", "out/model", "++learning_rate_file", "out/lr"]
    with pytest.raises(AssertionError, match="returnn failed"):
        run("returnn", config, str(tmp_path / "plain"), nadam)
    run("returnn_tpu", config, str(tmp_path / "ours"), nadam + ["++num_epochs", "2", "++distribute_strategy", "single"])
    scores = lr_file_scores(tmp_path / "ours/out/lr")
    assert scores[2][1]["train_score"] < scores[1][1]["train_score"]
