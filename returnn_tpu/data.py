"""RETURNN datasets as per-replica batches, one batch per replica per step.

Batches come from RETURNN's own batch generation (``Dataset.generate_batches`` with the
config's ``batch_size``, ``max_seqs``, ``max_seq_length``, ``chunking``, ``batching``, ...) and
RETURNN's own padding (``batch_to_raw_dict``); this module only decides which replica gets
which batch, and reads ahead on a background thread.

``dataset_distribution`` decides what an epoch is:

* ``"random_seed_offset"`` (default, like RETURNN's Horovod mode): every replica has its own
  instance of the dataset with ``random_seed_offset = replica * 16127`` (plus the config's
  ``dataset_random_seed_offset``), so each sees the whole dataset in its own order (generated
  datasets generate different sequences). An epoch is one pass of every replica over its
  dataset; it ends when the first replica runs out, so about ``num_replicas`` times the data
  of a single-device epoch is trained on.
* ``"shard"``: one dataset, one order; consecutive batches go to replicas in turn. An epoch is
  one pass over the dataset in total; the last ``< num_replicas`` batches are dropped.

With several workers, all of them do the same number of steps in an epoch: the smallest
number any of them has (agreed once at the start of the epoch), so none waits in a collective
for a worker that has run out of data.

With ``jit_compile``, :class:`BucketBatching` replaces RETURNN's batch generation for training:
sequences grouped by length into buckets, batches padded to static shapes (one per bucket).

No ``tf.data.Dataset.from_generator`` (FACTS.md, "from_generator"): batches are NumPy arrays handed to
the step function directly. Nothing here imports TensorFlow: the data producer process runs this
module without it (FACTS.md, "A producer without TensorFlow").
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy

from returnn_tpu.errors import ConfigError

Batch = Dict[str, numpy.ndarray]
SEED_OFFSET_PER_REPLICA = 16127  # RETURNN's factor per Horovod rank


def size_key(data_key: str, axis: int) -> str:
    """Key of the sequence lengths of ``data_key``'s dynamic ``axis`` (without batch) in a batch dict."""
    return f"size:{data_key}:{axis}"


def template_shapes(extern_data, data_keys: Sequence[str]) -> Dict[str, dict]:
    """What batching needs of the network's ``extern_data`` for ``data_keys``: each key's shape
    (None where dynamic), dtype and batch axis, as plain values another process can be sent
    (the network's templates hold TensorFlow objects)."""
    return {
        key: {"shape": tuple(None if axis in data.get_dynamic_axes() else dim for axis, dim in
                             enumerate(data.batch_shape) if axis != data.batch_dim_axis),
              "dtype": data.dtype, "batch_dim_axis": data.batch_dim_axis}
        for key in data_keys
        for data in [extern_data.data[key]]
    }


def templates_from_shapes(shapes: Dict[str, dict]):
    """RETURNN ``TensorDict`` templates (without TensorFlow) from :func:`template_shapes`."""
    from returnn.tensor import Tensor, TensorDict

    return TensorDict({key: Tensor(key, **kwargs) for key, kwargs in shapes.items()})
COUNTERS = ("dropped", "padded_frames", "total_frames")  # what BucketBatching counts while batching


class BatchingOptions:
    """RETURNN's batching config options, read once (same defaults as RETURNN's TF engine)."""

    def __init__(self, config):
        from returnn.util.basic import NumbersDict

        self.batch_size = config.typed_value("batch_size", 1)
        self.max_seqs = config.int("max_seqs", -1)
        max_seq_length = config.typed_value("max_seq_length", None) or config.float("max_seq_length", 0)
        if isinstance(max_seq_length, dict):
            max_seq_length = NumbersDict(max_seq_length)
        self.max_seq_length = max_seq_length or None
        self.min_seq_length = config.typed_value("min_seq_length", 0) or 0
        self.max_pad_size = config.typed_value("max_pad_size", None)
        self.shuffle_batches = config.bool("shuffle_batches", False)

    def generate(self, dataset, *, recurrent: bool, used_data_keys, train: bool) -> list:
        """RETURNN's batches for ``dataset``'s current epoch (a list of ``Batch``, no data loaded)."""
        batch_set = dataset.generate_batches(
            recurrent_net=recurrent,
            batch_size=self.batch_size,
            max_seqs=self.max_seqs,
            max_seq_length=(self.max_seq_length or sys.maxsize) if train else sys.maxsize,
            min_seq_length=self.min_seq_length if train else 0,
            max_pad_size=self.max_pad_size if train else None,
            shuffle_batches=self.shuffle_batches and train,
            used_data_keys=used_data_keys,
        )
        batches = []
        while batch_set.has_more():
            batches.extend(batch_set.peek_next_n(1))
            batch_set.advance(1)
        return batches

    def pad(self, raw: Batch) -> Batch:
        """RETURNN's batches keep their own shapes."""
        return raw

    def take_counters(self) -> Dict[str, int]:
        """What padding counted since the last call, reset (none here; see BucketBatching)."""
        return {}

    def add_counters(self, counters: Dict[str, int]):
        """Adds what another copy of these options counted (the dataset producer's)."""
        for name, value in counters.items():
            setattr(self, name, getattr(self, name) + value)


class BucketBatching(BatchingOptions):
    """Static shapes for XLA: sequences grouped by length into buckets, batches padded to them.

    A sequence (or chunk, with ``chunking``) goes to the smallest bucket boundary >= its length
    in frames of ``key``; longer ones are dropped (and counted), or for evaluation
    (``keep_longer``) go to a bucket of the next multiple of the largest boundary. A bucket of
    boundary ``L`` makes batches of as many sequences as fit in ``batch_size`` frames (and
    ``max_seqs``), rounded down to a multiple of 8, or below 8 to a power of two: few distinct
    sizes, those TPUs tile well, and on CPU the compiled step gains most with more sequences
    (FACTS.md, "XLA shapes"). Every batch is padded to its bucket's length and sequence count;
    padded sequences have length 0 and padded frames lie past each sequence's length, so RETURNN
    masks both (the trainer makes RETURNN's attention mask finite for the empty ones). The step
    thus sees one shape per bucket.
    Batches are emitted in the order of their first sequence (datasets load in increasing order).
    """

    def __init__(self, config, boundaries, key: str, keep_longer: bool = False):
        super().__init__(config)
        self.keep_longer = keep_longer  # evaluation: every sequence counts, longer ones get larger buckets
        if not isinstance(self.batch_size, int):
            raise ConfigError(f"batch_size must be an int with bucketing, got {self.batch_size!r}")
        self.boundaries = sorted(int(b) for b in boundaries)
        self.key = key
        self.dropped = 0  # sequences longer than the largest bucket, since the last reset
        self.padded_frames = 0
        self.total_frames = 0

    def seqs_per_batch(self, boundary: int) -> int:
        limit = self.max_seqs if self.max_seqs > 0 else 10**9
        return _batch_size_rule(max(1, min(limit, self.batch_size // boundary)), up=False)

    def bucket_of(self, length: int) -> Optional[int]:
        """The bucket of a sequence of ``length`` frames; longer than the largest: None (dropped),
        or with ``keep_longer`` the next multiple of the largest."""
        if length > self.boundaries[-1] and self.keep_longer:
            return -(-length // self.boundaries[-1]) * self.boundaries[-1]
        return next((b for b in self.boundaries if length <= b), None)

    def generate(self, dataset, *, recurrent: bool, used_data_keys, train: bool) -> list:
        from returnn.engine.batch import Batch as ReturnnBatch

        pending: Dict[int, "ReturnnBatch"] = {}
        batches = []
        for seq_idx, t_start, t_end in dataset.iterate_seqs(recurrent_net=True, used_data_keys=used_data_keys):
            length = t_end - t_start
            bucket = self.bucket_of(length[self.key])
            if bucket is None:
                self.dropped += 1
                continue
            batch = pending.setdefault(bucket, ReturnnBatch())
            batch.add_sequence_as_slice(seq_idx=seq_idx, seq_start_frame=t_start, length=length)
            if batch.num_slices == self.seqs_per_batch(bucket):
                batches.append(pending.pop(bucket))
        batches.extend(pending.values())  # incomplete: padded with empty sequences
        batches.sort(key=lambda b: b.start_seq)
        return batches

    def pad(self, raw: Batch) -> Batch:
        lengths = raw[size_key(self.key, 0)]
        bucket = self.bucket_of(int(lengths.max()))
        num_seqs = self.seqs_per_batch(bucket)
        if len(lengths) > num_seqs:  # re-cut by deal_evenly (shard): the next size of the same rule
            num_seqs = _batch_size_rule(len(lengths), up=True)
        self.total_frames += bucket * num_seqs
        self.padded_frames += bucket * num_seqs - int(lengths.sum())
        out = {}
        for key, value in raw.items():
            pad_width = [(0, num_seqs - value.shape[0])] + [(0, 0)] * (value.ndim - 1)
            if not key.startswith("size:") and value.ndim >= 2 and size_key(key, 0) in raw:
                pad_width[1] = (0, bucket - value.shape[1])  # the time axis
            out[key] = numpy.pad(value, pad_width)
        return out

    def take_counters(self) -> Dict[str, int]:
        counters = {name: getattr(self, name) for name in COUNTERS}
        for name in COUNTERS:
            setattr(self, name, 0)
        return counters


def _batch_size_rule(count: int, *, up: bool) -> int:
    """``count`` rounded down (or ``up``) to a multiple of 8, or below 8 to a power of two."""
    if count >= 8:
        return count + -count % 8 if up else count - count % 8
    return 1 << ((count - 1).bit_length() if up else count.bit_length() - 1)


def init_seq_order(dataset, epoch: int):
    """RETURNN's ``init_seq_order``; an assertion RETURNN's dataset code makes there (its check of
    the dataset's options, e.g. ``num_seqs > 0``) is bad input: one line naming the dataset and
    the failed check."""
    try:
        dataset.init_seq_order(epoch=epoch)
    except AssertionError as exc:
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        detail = f": {exc}" if str(exc) else ""
        raise ConfigError(f"{dataset.name}: RETURNN's {type(dataset).__name__} refuses its options at epoch {epoch}: "
                          f"{where.line or 'an assertion'} ({os.path.basename(where.filename)}:{where.lineno})"
                          f"{detail}") from None


def default_bucket_boundaries(dataset, key: str, num_buckets: int = 4, max_seqs: int = 2000) -> List[int]:
    """Bucket boundaries from the length statistics of (up to ``max_seqs`` of) ``dataset``:
    the quantiles 1/n, 2/n, ..., 1 of the lengths of ``key``, rounded up to powers of two (at
    least 8), so that there are few shapes (those that coincide are one)."""
    init_seq_order(dataset, 1)
    lengths = []
    for seq_idx, t_start, t_end in dataset.iterate_seqs(recurrent_net=True, used_data_keys=[key]):
        lengths.append((t_end - t_start)[key])
        if len(lengths) >= max_seqs:
            break
    dataset.finish_epoch()
    quantiles = numpy.quantile(lengths, [(i + 1) / num_buckets for i in range(num_buckets)])
    return sorted({max(8, 1 << (int(numpy.ceil(q)) - 1).bit_length()) for q in quantiles})


def init_datasets(config, key: str, num_replicas: int = 1, first_replica: int = 0, distribution: str = "shard") -> list:
    """The RETURNN dataset(s) that config key ``key`` (``"train"``, ``"dev"``) describes.

    Options are completed as RETURNN's ``rnn.py`` does (``chunking``, ``batching``, ``window``
    from the config; no chunking and sorted order for ``dev``). For ``random_seed_offset`` on
    ``train`` there is one instance per local replica, each with its own offset; otherwise one.
    Returns [] if the config has no such key.
    """
    from returnn.datasets import Dataset

    opts = config.typed_value(key, None)
    if opts is None:
        return []
    defaults = {"name": key}
    if key != "train":
        defaults.update(Dataset.get_default_kwargs_eval(config=config))
    base_offset = config.int("dataset_random_seed_offset", 0)
    if distribution == "random_seed_offset" and key == "train":
        offsets = [(first_replica + i) * SEED_OFFSET_PER_REPLICA + base_offset for i in range(num_replicas)]
    else:
        offsets = [base_offset]
    if not isinstance(opts, dict):
        if len(offsets) > 1:
            raise ConfigError(f"{key} must be a dict for dataset_distribution 'random_seed_offset', got {opts!r}")
        return [_init_dataset(key, opts, defaults)]
    datasets = []
    for offset in offsets:
        kwargs = {**defaults, "random_seed_offset": offset, **opts}
        Dataset.kwargs_update_from_config(config, kwargs)
        datasets.append(_init_dataset(key, kwargs))
    return datasets


def _init_dataset(key: str, opts, defaults: Optional[dict] = None):
    """RETURNN's ``init_dataset``; a file it cannot open or read (a missing or truncated HDF file)
    is bad input, one line naming the dataset."""
    from returnn.datasets import init_dataset

    try:
        return init_dataset(opts, default_kwargs=defaults)
    except OSError as exc:
        what = opts.get("class") if isinstance(opts, dict) else opts
        raise ConfigError(f"{key}: RETURNN's {what} cannot read its files: {exc}") from None


def init_eval_datasets(config) -> list:
    """The datasets RETURNN evaluates after each training epoch, in its order: ``dev``, ``eval``
    (both with RETURNN's defaults for evaluation) and each of ``eval_datasets`` (name -> options)."""
    datasets = init_datasets(config, "dev") + init_datasets(config, "eval")
    for name, opts in (config.typed_value("eval_datasets", None) or {}).items():
        datasets.append(_init_dataset(name, opts, {"name": name}))
    return datasets


def deal_evenly(batches: list, num_slots: int, *, recurrent: bool) -> list:
    """RETURNN's batches, the last few re-cut so that their number is a multiple of ``num_slots``.

    Dealing batches to replicas in turn would otherwise leave the last ``len % num_slots`` of
    them, and their sequences, out of the epoch. The sequences of the last ``num_slots +
    remainder`` batches are cut, in order, into ``2 * num_slots`` batches (or ``num_slots`` when
    there are fewer than ``2 * num_slots`` sequences; a batch then holds up to about twice its
    usual frames). Only fewer sequences than replicas in the whole epoch leave some out.
    """
    from returnn.engine.batch import Batch

    remainder = len(batches) % num_slots
    if not remainder:
        return batches
    tail = batches[-(num_slots + remainder):]
    # In sequence order: datasets load sequences in increasing order (buckets interleave them).
    parts = sorted((part for batch in tail for part in batch.seqs), key=lambda part: part.seq_idx)
    count = 2 * num_slots if len(parts) >= 2 * num_slots else num_slots
    if len(parts) < count:
        return batches[: len(batches) - remainder]
    recut = []
    for i in range(count):
        batch = Batch()
        for part in parts[i * len(parts) // count : (i + 1) * len(parts) // count]:
            length = part.seq_end_frame - part.seq_start_frame
            if recurrent:
                batch.add_sequence_as_slice(seq_idx=part.seq_idx, seq_start_frame=part.seq_start_frame, length=length)
            else:
                batch.add_frames(seq_idx=part.seq_idx, seq_start_frame=part.seq_start_frame, length=length)
        recut.append(batch)
    return batches[: len(batches) - len(tail)] + recut


class EpochBatches:
    """The steps of one epoch: each step has one padded batch per local replica.

    Either one dataset per local replica (each replica walks its own; the epoch has as many
    steps as the shortest), or one dataset whose batches are dealt in turn to ``num_slots``
    global replicas, of which this process feeds ``slots`` (a range). The batch lists are made
    up front (RETURNN's batch generator, no data loaded), so :attr:`num_steps` is known before
    the first step and workers can agree on it; :meth:`limit_steps` lowers it. Datasets that know
    a sequence's length only once they have made it (generated ones, ``CachedDataset2``) make the
    whole epoch here: :attr:`making_seconds` says how long that took. A dealt dataset
    uses every sequence once (:func:`deal_evenly`).

    With ``pad_last`` (evaluation), the last, incomplete group of a dealt dataset is kept and
    filled with weight-0 copies of the last batch, so every batch is seen exactly once.
    Iterating yields ``(batches, weights)``; data is read on a background thread, ``prefetch``
    steps ahead.
    """

    def __init__(
        self,
        datasets: Sequence,
        *,
        epoch: int,
        extern_data,
        data_keys: Sequence[str],
        batching: BatchingOptions,
        recurrent: bool,
        train: bool,
        slots: Optional[range] = None,
        num_slots: Optional[int] = None,
        pad_last: bool = False,
        prefetch: int = 4,
    ):
        self.datasets = list(datasets)
        self.extern_data = extern_data
        self.data_keys = list(data_keys)
        self.slots = slots if slots is not None else range(len(self.datasets))
        self.num_slots = num_slots or len(self.slots)
        self.prefetch = prefetch
        self.first_step = 0
        self.batch_offset = 0  # see start_at
        self.batching = batching
        self.batch_lists = []
        start = time.perf_counter()
        for dataset in self.datasets:
            init_seq_order(dataset, epoch)
            self.batch_lists.append(
                batching.generate(dataset, recurrent=recurrent, used_data_keys=set(self.data_keys), train=train)
            )
        self.making_seconds = time.perf_counter() - start
        if len(self.datasets) > 1:
            self.num_steps = min(len(batches) for batches in self.batch_lists)
        elif not pad_last and self.num_slots > 1:
            self.batch_lists[0] = deal_evenly(self.batch_lists[0], self.num_slots, recurrent=recurrent)
            self.num_steps = len(self.batch_lists[0]) // self.num_slots
        elif pad_last:
            self.num_steps = -(-len(self.batch_lists[0]) // self.num_slots)
        else:
            self.num_steps = len(self.batch_lists[0]) // self.num_slots

    def limit_steps(self, num_steps: int):
        """Ends the epoch after ``num_steps`` steps (e.g. the minimum all workers can do)."""
        self.num_steps = min(self.num_steps, num_steps)

    def start_at(self, step: int, batch_offset: int = 0):
        """Skips the first ``step`` steps (an epoch continued after an interruption); their
        batches are not loaded. Batch lists depend only on the epoch, so the rest is what the
        interrupted run would have trained.

        ``batch_offset`` (a dealt dataset only): step ``s`` takes the batches from index
        ``batch_offset + s * num_slots``, to continue an epoch that another number of replicas
        began at any batch. The dealt list holds whole steps, so from an offset the last
        step would be incomplete: the epoch has one step fewer (``num_slots - batch_offset``
        batches of its end are left out).
        """
        self.first_step = step
        if batch_offset:
            if len(self.datasets) > 1:
                raise ValueError("a batch offset needs one dataset dealt to the replicas")
            self.batch_offset = batch_offset
            self.num_steps = min(self.num_steps, (len(self.batch_lists[0]) - batch_offset) // self.num_slots)

    def _raw_batch(self, dataset, batch) -> Batch:
        from returnn.engine.batch import batch_to_raw_dict

        raw = batch_to_raw_dict(batch, dataset=dataset, extern_data=self.extern_data, data_keys=self.data_keys)
        out = {}
        for key in self.data_keys:
            out[key] = raw[key]
            if f"{key}_seq_lens" in raw:
                out[size_key(key, 0)] = raw[f"{key}_seq_lens"].astype("int32")
        return self.batching.pad(out)

    def _step(self, step: int):
        if len(self.datasets) > 1:
            return [self._raw_batch(d, b[step]) for d, b in zip(self.datasets, self.batch_lists)], [1.0] * len(
                self.datasets
            )
        dataset, batches = self.datasets[0], self.batch_lists[0]
        out, weights = [], []
        for slot in self.slots:
            index = self.batch_offset + step * self.num_slots + slot
            if index < len(batches):
                out.append(self._raw_batch(dataset, batches[index]))
                weights.append(1.0)
            else:  # only with pad_last: a placeholder that counts zero (the last batch: datasets
                # such as generated ones can only load sequences in increasing order)
                out.append(self._raw_batch(dataset, batches[-1]))
                weights.append(0.0)
        return out, weights

    def __iter__(self) -> Iterator[Tuple[List[Batch], List[float]]]:
        try:
            yield from read_ahead((self._step(step) for step in range(self.first_step, self.num_steps)),
                                  self.prefetch, name="returnn_tpu batches")
        finally:
            for dataset in self.datasets:
                dataset.finish_epoch()


def read_ahead(items: Iterable, depth: int, *, name: str, transform: Optional[Callable] = None) -> Iterator:
    """The items of ``items`` (each passed through ``transform``), made on a background thread
    up to ``depth`` items ahead of the caller, so that reading (or copying to a device) overlaps
    what the caller does with the previous item. An error on the thread is raised to the caller
    at that item. When the caller stops early, the thread stops and ``items`` is closed (a
    generator's ``finally`` runs) before this returns."""
    results: "queue.Queue" = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def run():
        iterator = iter(items)
        try:
            while not stop.is_set():
                try:
                    item = next(iterator)
                except StopIteration:
                    results.put(end)
                    return
                results.put(transform(item) if transform else item)
        except BaseException as exc:  # handed to the caller, which re-raises it
            results.put(exc)
        finally:
            if hasattr(iterator, "close"):
                iterator.close()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = results.get()
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock the thread if it waits on a full queue
            try:
                results.get(timeout=0.1)
            except queue.Empty:
                pass
