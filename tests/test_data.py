"""What an epoch is: which sequences each replica trains on, for both dataset distributions."""

import collections

import numpy
import pytest

from conftest import make_trainer

NUM_SEQS = 25  # not a multiple of the batches per step: the last batches must be re-dealt
NETWORK = {"output": {"class": "softmax", "loss": "ce", "from": "data"}}


def _static_dataset(seq_ordering="random"):
    """Sequence i: all its frames are i (so a batch shows which sequences it holds)."""
    rng = numpy.random.RandomState(0)
    seqs = []
    for i in range(NUM_SEQS):
        length = int(rng.randint(2, 9))
        seqs.append({"data": numpy.full((length, 9), float(i), "float32"),
                     "classes": numpy.zeros((length,), "int32")})
    return {"class": "StaticDataset", "data": seqs, "output_dim": {"data": [9, 2], "classes": [2, 1]},
            "seq_ordering": seq_ordering}


def _seqs(batch):
    """The sequence indices in a padded batch (frames of one sequence, or, for a feed-forward
    network, RETURNN's concatenated sequences), in order."""
    order = []
    for b, size in enumerate(batch["size:data:0"]):
        for value in batch["data"][b, :size, 0]:
            if not order or order[-1] != int(value):
                order.append(int(value))
    return order


def _trainer(tmp_path, distribution):
    return make_trainer(tmp_path, NETWORK, train=_static_dataset(), batch_size=30, max_seqs=3,
                        distribute_options={"dataset_distribution": distribution})


def test_shard_uses_every_sequence_once_across_local_replicas(tmp_path):
    trainer = _trainer(tmp_path, "shard")
    seen = collections.Counter()
    for step_batches, _ in trainer.data.train_batches(1):
        for batch in step_batches:
            seen.update(_seqs(batch))
    assert seen == collections.Counter(range(NUM_SEQS))


def test_shard_uses_every_sequence_once_across_workers(tmp_path):
    """Each of two workers (one replica each) deals the same batches and takes its own."""
    from returnn_tpu.data import EpochBatches, init_datasets

    trainer = _trainer(tmp_path, "shard")
    seen, steps = collections.Counter(), []
    for worker in (0, 1):
        batches = EpochBatches(
            init_datasets(trainer.config, "train", 1, worker, "shard"), epoch=1, extern_data=trainer.data.extern_data,
            data_keys=trainer.data.data_keys, batching=trainer.data.batching, recurrent=trainer.data.recurrent,
            train=True, slots=range(worker, worker + 1), num_slots=2,
        )
        steps.append(0)
        for (batch,), _ in batches:
            seen.update(_seqs(batch))
            steps[-1] += 1
    assert seen == collections.Counter(range(NUM_SEQS)) and steps[0] == steps[1]


@pytest.mark.parametrize("epoch", [1, 2])
def test_random_seed_offset_gives_each_replica_every_sequence_in_its_own_order(tmp_path, epoch):
    trainer = _trainer(tmp_path, "random_seed_offset")
    orders = [[], []]
    for step_batches, _ in trainer.data.train_batches(epoch):
        for replica, batch in enumerate(step_batches):
            orders[replica] += _seqs(batch)
    for order in orders:
        assert sorted(order) == list(range(NUM_SEQS)), order
    assert orders[0] != orders[1]


def test_an_epoch_continued_on_other_replicas_deals_the_rest_of_its_batches(tmp_path):
    """4 steps of 2 replicas (8 batches) trained, then the epoch continues on 3 replicas: step 3
    starts at the 9th batch (2 steps and 2 batches in), no sequence is trained twice, and only the
    batch left over at the end (3 - 2 of a step) is left out."""
    two = _trainer(tmp_path / "two", "shard")
    done = collections.Counter()
    for step, (step_batches, _) in enumerate(two.data.train_batches(1)):
        if step < 4:
            done.update(seq for batch in step_batches for seq in _seqs(batch))
    three = make_trainer(tmp_path / "three", NETWORK, num_replicas=3, train=_static_dataset(), batch_size=30,
                         max_seqs=3, distribute_options={"dataset_distribution": "shard"})
    full_steps = len(list(three.data.train_batches(1)))
    batches = three.data.train_batches(1)
    step, note = three.data.continue_epoch(batches, 4, 2)
    assert step == 2 and note == "continues after 8 of its batches (4 steps of 2 replicas) at step 3 of 3 replicas"
    rest = collections.Counter()
    for step_batches, _ in batches:
        rest.update(seq for batch in step_batches for seq in _seqs(batch))
    assert batches.steps_done == full_steps - 1  # the last step would be incomplete
    assert max((done + rest).values()) == 1
    missing = set(range(NUM_SEQS)) - set(done) - set(rest)
    assert len(missing) <= 3, missing  # one batch of at most max_seqs sequences
