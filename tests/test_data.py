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
    from returnn_tpu.datapath.data import EpochBatches
    from returnn_tpu.datapath.datasets import init_datasets

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
    assert step == 2 and note.startswith("continues after 8 of its batches (4 steps of 2 replicas) at step 3 of "
                                         "3 replicas; makes the batches of the 2 steps it passes over"), note
    rest = collections.Counter()
    for step_batches, _ in batches:
        rest.update(seq for batch in step_batches for seq in _seqs(batch))
    assert batches.steps_done == full_steps - 1  # the last step would be incomplete
    assert max((done + rest).values()) == 1
    missing = set(range(NUM_SEQS)) - set(done) - set(rest)
    assert len(missing) <= 3, missing  # one batch of at most max_seqs sequences


def test_streamed_dealing_re_cuts_the_tail_as_dealing_the_whole_list_does():
    """:func:`dealt_stream` holds back at most ``2 * n - 1`` batches and gives the batches that
    :func:`deal_evenly` gives for the whole epoch's list, for every length and replica count."""
    from returnn.engine.batch import Batch

    from returnn_tpu.datapath.data import deal_evenly, dealt_stream

    def seqs(batches):
        return [[part.seq_idx for part in batch.seqs] for batch in batches]

    for num_slots in range(1, 6):
        for total in range(30):
            batches = []
            for seq in range(total):
                batch = Batch()
                batch.add_sequence_as_slice(seq_idx=seq, seq_start_frame=0, length=2)
                batches.append(batch)
            whole = seqs(deal_evenly(batches, num_slots, recurrent=True))
            taken = [0]

            def counted():
                for batch in batches:
                    taken[0] += 1
                    yield batch

            streamed = []
            for batch in dealt_stream(counted(), num_slots, recurrent=True):
                streamed.append(batch)
                assert taken[0] - len(streamed) <= 2 * num_slots - 1, (num_slots, total)
            assert seqs(streamed) == whole, (num_slots, total)
            assert len(whole) % num_slots == 0


def _streaming_setup(train, batch_size=200, max_seqs=4):
    from returnn.config import Config
    from returnn.datasets import init_dataset

    from returnn_tpu.datapath.batching import BatchingOptions, templates_from_shapes

    config = Config({"batch_size": batch_size, "max_seqs": max_seqs})
    extern_data = templates_from_shapes({"data": {"shape": (None, 9), "dtype": "float32", "batch_dim_axis": 0},
                                         "classes": {"shape": (None,), "dtype": "int32", "batch_dim_axis": 0}})
    datasets = [init_dataset(dict(train, random_seed_offset=16127 * i)) for i in range(2)]
    return datasets, extern_data, BatchingOptions(config)


@pytest.mark.parametrize("kind", ["DummyDataset", "PostprocessingDataset"])
@pytest.mark.parametrize("distribution", ["random_seed_offset", "shard"])
def test_a_million_sequences_stream_without_a_pass_over_the_epoch(kind, distribution):
    """10^6 generated sequences (``DummyDataset``, and a ``CachedDataset2`` over it): the first
    steps, and a continuation at step 5,000, make only the sequences of the batches near them and
    hold a few; the old batch lists made (and held) the whole epoch first."""
    from returnn_tpu.datapath.data import EpochBatches

    train = {"class": "DummyDataset", "input_dim": 9, "output_dim": 2, "num_seqs": 10**6, "seq_len": 5}
    if kind == "PostprocessingDataset":
        train = {"class": "PostprocessingDataset", "dataset": train, "map_seq": lambda data, **_: data}
    datasets, extern_data, batching = _streaming_setup(train)
    if distribution == "shard":
        datasets = datasets[:1]
    for first_step in (0, 5000):
        batches = EpochBatches(datasets, epoch=1, extern_data=extern_data, data_keys=["data", "classes"],
                               batching=batching, recurrent=True, train=True, prefetch=2,
                               slots=range(2) if distribution == "shard" else None,
                               num_slots=2 if distribution == "shard" else None)
        batches.start_at(first_step)
        steps = batches.steps()
        for _ in range(3):
            step_batches, weights = next(steps)
            assert len(step_batches) == 2 and weights == [1.0, 1.0]
        for dataset in datasets:
            inner = getattr(dataset, "dataset", dataset)  # PostprocessingDataset's wrapped DummyDataset
            made = max(part.seq_idx for part in inner.added_data)
            assert made < (first_step + 10) * 2 * 4 + 50, made  # 4 sequences per batch
            assert len(inner.added_data) < 50 and len(getattr(dataset, "added_data", [])) < 50
        steps.close()


def test_buckets_stream_in_order_and_hold_a_bounded_window(monkeypatch):
    """Bucketed batches (XLA) come in the order of their first sequence, each sequence once
    (unless longer than the largest bucket), and a bucket that began more than the window back is
    handed out unfilled, so the sequences held stay bounded."""
    import returnn_tpu.datapath.batching
    from returnn.config import Config
    from returnn.datasets import init_dataset

    from returnn_tpu.datapath.batching import BucketBatching

    monkeypatch.setattr(returnn_tpu.datapath.batching, "BUCKET_WINDOW_SEQS", 6)
    dataset = init_dataset(_static_dataset())
    dataset.init_seq_order(1)
    batching = BucketBatching(Config({"batch_size": 64, "max_seqs": 8}), [4, 8], "data")
    starts, seen = [], []
    for batch in batching.stream(dataset, recurrent=True, used_data_keys={"data", "classes"}, train=True):
        starts.append(batch.start_seq)
        seqs = [part.seq_idx for part in batch.seqs]
        assert max(seqs) - min(seqs) < 6, seqs
        seen += seqs
    assert starts == sorted(starts) and sorted(seen) == list(range(NUM_SEQS))


def write_hdf_parts(folder, num_files: int = 4, seqs_per_file: int = 10) -> list:
    """``num_files`` HDF files of 12AX's shapes; every frame of sequence s of file f is ``100 f + s``."""
    from returnn.datasets.hdf import SimpleHDFWriter

    paths = []
    for part in range(num_files):
        path = str(folder / f"part{part}.hdf")
        writer = SimpleHDFWriter(path, dim=9, ndim=2, extra_type={"classes": (2, 1, "int32")},
                                 extra_labels={"classes": ["0", "1"]})
        for seq in range(seqs_per_file):
            length = 3 + seq % 4
            writer.insert_batch(numpy.full((1, length, 9), 100 * part + seq, "float32"), seq_len=[length],
                                seq_tag=[f"part{part}-{seq}"], extra={"classes": numpy.zeros((1, length), "int32")})
        writer.close()
        paths.append(path)
    return paths


def distributed_files(paths, **options) -> dict:
    """RETURNN's ``DistributeFilesDataset`` over ``paths`` (an ``HDFDataset`` per sub-epoch), its
    files dealt to the ranks (here: the replicas)."""
    return {"class": "DistributeFilesDataset", "files": paths, "partition_epoch": 1, "distrib_shard_files": True,
            "sharding_fix": True, "get_sub_epoch_dataset": _sub_epoch_dataset, **options}


def _sub_epoch_dataset(files):
    return {"class": "HDFDataset", "files": files, "seq_ordering": "random"}


@pytest.mark.parametrize("distribution", ["random_seed_offset", "shard"])
def test_distribute_files_dataset_deals_its_files_to_the_replicas(tmp_path, distribution):
    """``DistributeFilesDataset`` with ``distrib_shard_files``: each replica walks its own shard of
    the files (as each rank does under RETURNN's PyTorch engine), the shards are disjoint and
    together hold every file, whatever ``dataset_distribution`` says. (Sub-epochs loaded in this
    process here; in their own processes, as by default, in the multi-worker test.)"""
    paths = write_hdf_parts(tmp_path)
    trainer = make_trainer(tmp_path, NETWORK, train=distributed_files(paths, use_worker_proc=False), batch_size=30,
                           max_seqs=3,
                           distribute_options={"dataset_distribution": distribution})
    files = [set(), set()]
    for step_batches, _ in trainer.data.train_batches(1):
        for replica, batch in enumerate(step_batches):
            files[replica].update(seq // 100 for seq in _seqs(batch))
    assert files[0] and files[1] and not files[0] & files[1], files
    assert files[0] | files[1] == set(range(len(paths)))


@pytest.mark.parametrize("distribution", ["own_copies", "dealt"])
@pytest.mark.parametrize("chunking,recurrent", [("50:50", True), ("10:5", True), ("0", True), ("0", False)],
                         ids=["chunks", "overlapping_chunks", "sequences", "frames"])
def test_an_epoch_continued_from_its_recorded_point_makes_the_same_batches_without_the_sequences_before(
        distribution, chunking, recurrent):
    """An epoch of RETURNN's ``Task12AXDataset`` continued at 60% of its steps from the point its
    streams recorded there: the same batches as the rest of the uninterrupted epoch, bit for bit,
    while the datasets make less than half of what passing over the steps makes (the frames they
    count as loaded)."""
    from returnn.config import Config, set_global_config
    from returnn.datasets import init_dataset

    from returnn_tpu.datapath.batching import BatchingOptions
    from returnn_tpu.datapath.data import EpochBatches
    from returnn_tpu.returnn_side.network_inputs import extern_data_template

    config = Config()
    config.update(dict(extern_data={"data": {"dim": 9}, "classes": {"dim": 2, "sparse": True}}, batch_size=400,
                       max_seqs=8, chunking=chunking))
    set_global_config(config)
    extern_data, batching = extern_data_template(config), BatchingOptions(config)
    copies = 2 if distribution == "own_copies" else 1
    slots = dict(slots=range(3), num_slots=3) if distribution == "dealt" else {}

    def epoch(points=None, step=0):
        datasets = [init_dataset({"class": "Task12AXDataset", "num_seqs": 600, "seq_ordering": "random",
                                  "chunking": chunking, "random_seed_offset": 16127 * i}) for i in range(copies)]
        batches = EpochBatches(datasets, epoch=1, extern_data=extern_data, data_keys=["data", "classes"],
                               batching=batching, recurrent=recurrent, train=True, prefetch=1, **slots)
        batches.start_at(step, points=points)
        return batches, [step_batches for step_batches, _ in batches.steps()]

    whole, full = epoch()
    step = int(len(full) * 0.6)
    points = whole.positions.after(step)
    assert all(isinstance(point, tuple) for point in points), points
    replayed, replayed_steps = epoch(step=step)
    continued, continued_steps = epoch([points[0]] if distribution == "dealt" else points, step)
    assert len(continued_steps) == len(replayed_steps) == len(full) - step
    for ours, theirs in zip(continued_steps, full[step:]):
        for our_batch, their_batch in zip(ours, theirs):
            assert our_batch.keys() == their_batch.keys()
            for key in our_batch:
                numpy.testing.assert_array_equal(our_batch[key], their_batch[key])
    for ours, theirs in zip(continued.datasets, replayed.datasets):
        made = [dataset._num_timesteps.max_value() for dataset in (ours, theirs)]  # noqa: SLF001 (its count)
        assert made[0] < 0.5 * made[1], made
