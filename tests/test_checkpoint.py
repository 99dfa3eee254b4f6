"""Checkpoints written by returnn-tpu load in plain RETURNN and give the same outputs."""

import os
import subprocess

import numpy
import pytest
import tensorflow as tf

from conftest import make_trainer, random_step_batches, run_cli
from returnn_tpu import checkpoints

NETWORK = {
    "lstm": {"class": "rec", "unit": "nativelstm2", "n_out": 8, "from": "data"},
    "output": {"class": "softmax", "loss": "ce", "from": "lstm"},
}


@pytest.mark.parametrize("kind", ["epoch", "interrupted"])
def test_checkpoint_loads_in_plain_returnn(tmp_path, rng, kind):
    """An epoch's checkpoint, and one of an epoch stopped by a signal (which holds two more
    numbers), load in plain RETURNN and give our model's outputs."""
    from returnn.tf.network import TFNetwork

    trainer = make_trainer(tmp_path, NETWORK, distribute_options={"param_sync_step": 100}, optimizer={"class": "adam"})
    for _ in range(3):
        trainer.train_step(random_step_batches(rng, 2), 0.05)
    trainer.sync()
    if kind == "epoch":
        prefix = str(tmp_path / "model.001")
        checkpoints.save(prefix, trainer.checkpoints.state())
    else:
        prefix = str(tmp_path / "model.001.interrupted")
        checkpoints.save_interrupted(str(tmp_path / "model"), prefix, trainer.checkpoints.state(), epoch=1, steps_done=3,
                                     num_replicas=2)
        assert checkpoints.interrupted(str(tmp_path / "model"), 1) == (prefix, 1, 3, 2)
    assert sorted(os.listdir(tmp_path)) == [f"{os.path.basename(prefix)}.data-00000-of-00001",
                                            f"{os.path.basename(prefix)}.index", f"{os.path.basename(prefix)}.meta"]
    # What plain RETURNN does with ``++load PREFIX`` (``python -m returnn CONFIG ++task eval ++load ...``).
    from returnn.config import Config
    from returnn.engine.base import EngineBase

    assert EngineBase.get_epoch_model(Config({"task": "eval", "load": prefix})) == (1, prefix)

    (batch,) = random_step_batches(rng, 1)

    @tf.function(autograph=False)
    def forward(b):
        def replica(x):
            net, _ = trainer.builder.build(x, train=False, replica_id=0)
            return net.get_default_output_layer().output.copy_as_batch_major().placeholder

        return trainer.strategy.run(replica, args=(b,))

    ours = trainer.strategy.experimental_local_results(forward(trainer.steps.distribute([batch, batch])))[0].numpy()

    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
        net = TFNetwork(config=trainer.config, train_flag=False, eval_flag=False)
        net.construct_from_dict(NETWORK)
        net.load_params_from_file(prefix, session=session)
        data = net.extern_data.data["data"]
        output = net.get_default_output_layer().output.copy_as_batch_major()
        theirs = session.run(
            output.placeholder,
            feed_dict={data.placeholder: batch["data"], data.size_placeholder[0]: batch["size:data:0"],
                       net.extern_data.get_batch_info().dim: len(batch["data"])},
        )
    lengths = batch["size:data:0"]
    for i, length in enumerate(lengths):  # padded frames are undefined in both
        numpy.testing.assert_allclose(ours[i, :length], theirs[i, :length], atol=1e-5, rtol=0)
    assert numpy.abs(ours[0] - 0.5).max() > 1e-3  # a trained model, not a constant


def test_checkpoint_holds_optimizer_state_and_restores(tmp_path, rng):
    trainer = make_trainer(tmp_path, NETWORK, optimizer={"class": "adam"})
    trainer.train_step(random_step_batches(rng, 2), 0.05)
    trainer.sync()
    state = trainer.checkpoints.state()
    assert "lstm/rec/W/Adam" in state and "lstm/rec/W/Adam_1" in state and "global_step" in state
    checkpoints.save(str(tmp_path / "ckpt"), state)
    saved = {name: var.numpy() for name, var in state.items()}
    trainer.train_step(random_step_batches(rng, 2), 0.05)
    checkpoints.restore(str(tmp_path / "ckpt"), state)
    for name, var in state.items():
        for copy in trainer.strategy.experimental_local_results(var):
            numpy.testing.assert_array_equal(copy.numpy(), saved[name], err_msg=name)


def test_checkpoint_without_slot_step_restores_it_from_the_global_step(tmp_path, rng):
    """Checkpoints written before ``optimize/slot_step`` existed still resume (its value is the global step)."""
    network = {"output": {"class": "softmax", "loss": "ce", "from": "data"}}
    trainer = make_trainer(tmp_path, network, strategy="single", num_replicas=1, optimizer={"class": "adam"})
    for _ in range(3):
        trainer.train_step(random_step_batches(rng, 1), 0.01)
    state = trainer.checkpoints.state()
    old_style = {name: var for name, var in state.items() if name != "optimize/slot_step"}
    checkpoints.save(str(tmp_path / "old"), old_style)
    state["optimize/slot_step"].assign(0)
    checkpoints.restore(str(tmp_path / "old"), state, fallbacks=trainer.optimizer.FALLBACKS)
    assert int(state["optimize/slot_step"].numpy()) == 3
    from returnn_tpu.errors import ConfigError

    with pytest.raises(ConfigError, match="has no variable 'optimize/slot_step'"):
        checkpoints.restore(str(tmp_path / "old"), state)


def test_resume_skips_stale_temporaries_and_an_unreadable_newest_checkpoint(tmp_path):
    network = {"output": {"class": "softmax", "loss": "ce", "from": "data"}}
    make_trainer(tmp_path, network, num_epochs=2).train()
    data = tmp_path / "model.002.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:20])  # truncated, as by a crash of the file system
    stale = tmp_path / "model.003.tmp-999999999.data-00000-of-00001"  # a save whose process is gone
    stale.write_bytes(b"partial")
    trainer = make_trainer(tmp_path, network, num_epochs=3)
    trainer.train()
    assert not stale.exists()
    assert (tmp_path / "model.002.index.unreadable").exists()
    for epoch in (2, 3):  # epoch 2 trained again, from model.001
        assert sorted(checkpoints.load(str(tmp_path / f"model.00{epoch}"))) == sorted(trainer.checkpoints.state())


@pytest.mark.parametrize("damage", ["truncated data", "random index"])
def test_a_damaged_interrupted_checkpoint_is_set_aside(tmp_path, damage):
    """An interrupted checkpoint that does not load (a crash of the file system, garbage) does not
    block every later start: its index is renamed with one line, and its epoch starts again from
    the epoch's checkpoint before it."""
    network = {"output": {"class": "softmax", "loss": "ce", "from": "data"}}
    first = make_trainer(tmp_path, network, num_epochs=1)
    first.train()
    prefix = str(tmp_path / "model.002.interrupted")
    checkpoints.save_interrupted(str(tmp_path / "model"), prefix, first.checkpoints.state(), epoch=2, steps_done=3,
                                 num_replicas=2)
    if damage == "truncated data":
        data = tmp_path / "model.002.interrupted.data-00000-of-00001"
        data.write_bytes(data.read_bytes()[:100])
    else:
        (tmp_path / "model.002.interrupted.index").write_bytes(numpy.random.RandomState(0).bytes(300))
    second = make_trainer(tmp_path, network, num_epochs=2)
    assert second.checkpoints.resume_point(lambda value: [value]) == (2, 0, str(tmp_path / "model.001"), False, None, None)
    assert (tmp_path / "model.002.interrupted.index.unreadable").exists()
    second.train()
    assert sorted(checkpoints.load(str(tmp_path / "model.002"))) == sorted(second.checkpoints.state())


def test_an_epoch_whose_record_fails_is_trained_again_and_recorded_once(tmp_path):
    """learning_rate_file cannot be written after epoch 2 (RETURNN's temporary file is a folder, as
    a full disk fails it): a one-line error and no checkpoint of epoch 2; continued, the run trains
    epoch 2 again, and learning_rate_file and metrics.jsonl have each epoch once."""
    import json

    from returnn.learning_rate_control import LearningRateControl

    from returnn_tpu.reporting import RecordWriteError

    network = {"output": {"class": "softmax", "loss": "ce", "from": "data"}}
    make_trainer(tmp_path, network, num_epochs=1).train()
    (tmp_path / "lr.new_tmp").mkdir()
    with pytest.raises(RecordWriteError, match=r"^could not write .*/lr \(.* MB free there\): Is a directory; epoch 2 is trained again"):
        make_trainer(tmp_path, network, num_epochs=2).train()
    assert not (tmp_path / "model.002.index").exists()
    (tmp_path / "lr.new_tmp").rmdir()
    make_trainer(tmp_path, network, num_epochs=2).train()
    assert (tmp_path / "model.002.index").exists()
    assert sorted(LearningRateControl(default_learning_rate=0.1, filename=str(tmp_path / "lr")).epoch_data) == [1, 2]
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["epoch"] for line in f] == [1, 2]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a full disk) needs root")
def test_a_full_disk_is_one_line_naming_the_file_and_the_free_space(tmp_path):
    from conftest import config_12ax

    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], check=True)
    try:
        with open(full / "filler", "wb", buffering=0) as f:  # fill it up
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        (tmp_path / "train.config").write_text(config_12ax(model="full/model"))
        result = run_cli(["train.config", "++num_epochs", "1"], cwd=tmp_path)
        assert result.returncode == 75, result.stderr[-3000:]  # a full disk: run the same command again (later)
        errors = [line for line in result.stderr.splitlines() if line.startswith("returnn-tpu: error:")]
        # The epoch's record comes before its checkpoint, and fails first.
        assert errors == [f"returnn-tpu: error: could not write {full}/metrics.jsonl (0.0 MB free there): No space "
                          "left on device; epoch 1 is trained again when the run is continued"], result.stderr[-3000:]
        assert os.listdir(full) == ["filler"]  # no half-written temporary left behind
        with pytest.raises(checkpoints.CheckpointWriteError, match=r"^could not write checkpoint .*/model\.001 \(0\.0 MB "
                           r"free there\): No space left on device$"):
            checkpoints.save(str(full / "model.001"), {"w": tf.Variable(tf.zeros([4096]))})
        assert os.listdir(full) == ["filler"]
    finally:
        subprocess.run(["umount", str(full)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount needs root")
def test_a_save_into_a_read_only_folder_is_one_line_naming_the_last_good_checkpoint(tmp_path):
    """A lost worker's save of the last sync, and an epoch's save, into a folder that became
    read-only: a CheckpointWriteError (one line: the checkpoint, why, where the last good
    checkpoint is) with exit status 2 (a person must make the folder writable), not tracebacks."""
    folder = tmp_path / "ro"
    folder.mkdir()
    trainer = make_trainer(folder, NETWORK, num_epochs=1)
    trainer.train()
    trainer.checkpoints.synced(epoch=2, steps_done=3, updates=5)
    # The folder seen through a read-only bind mount of itself (files the trainer holds open do not
    # keep the new mount from being read-only).
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)
        for save in (lambda: trainer.checkpoints.save_last_sync(None),
                     lambda: trainer.checkpoints.save_interrupted(2, 3, None)):
            with pytest.raises(checkpoints.CheckpointWriteError) as raised:
                save()
            assert raised.value.status == 2
            assert str(raised.value).startswith(f"could not write checkpoint {folder}/model.002.interrupted (")
            assert str(raised.value).endswith(f"Read-only file system; the last good checkpoint is {folder}/model.001")
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_an_epoch_continued_at_its_very_end_evaluates_and_saves_the_saved_model(tmp_path):
    """A run sent back to the sync after an epoch's last step (a worker lost during its dev
    evaluation) has no step left to train there: the network is built all the same, the epoch's
    dev scores are those of the saved model, and its checkpoint is that model."""
    first = make_trainer(tmp_path, NETWORK, num_epochs=1, dev={"class": "Task12AXDataset", "num_seqs": 8})
    first.train()
    saved = str(tmp_path / "model.002.interrupted")
    checkpoints.save_interrupted(str(tmp_path / "model"), saved, first.checkpoints.state(), epoch=2, steps_done=10_000,
                                 num_replicas=2)
    second = make_trainer(tmp_path, NETWORK, num_epochs=2, dev={"class": "Task12AXDataset", "num_seqs": 8})
    second.train()
    epoch_1, epoch_2 = checkpoints.load(str(tmp_path / "model.001")), checkpoints.load(str(tmp_path / "model.002"))
    names = [name for name in epoch_1 if name.startswith(("lstm/", "output/")) and "/Adam" not in name]
    assert names
    for name in names:
        numpy.testing.assert_array_equal(epoch_2[name], epoch_1[name])
    assert not checkpoints.interrupted(str(tmp_path / "model"), 2)  # replaced by the epoch's checkpoint
