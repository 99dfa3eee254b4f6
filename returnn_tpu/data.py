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

Batches are made as they are taken (RETURNN's lazy batch generator), a bounded number of steps
ahead: no pass over the epoch before its first step, and what is held does not grow with the
corpus (docs/data.md, "Streamed epochs"). With several workers, all of them do the same number
of steps in an epoch, the smallest number any of them has, agreed as they go
(:class:`returnn_tpu.epochs.TrainEpoch`), so none waits in a collective for a worker that has
run out of data.

With ``jit_compile``, :class:`BucketBatching` replaces RETURNN's batch generation for training:
sequences grouped by length into buckets, batches padded to static shapes (one per bucket).

No ``tf.data.Dataset.from_generator`` (FACTS.md, "from_generator"): batches are NumPy arrays handed to
the step function directly. Nothing here imports TensorFlow: the data producer process runs this
module without it (FACTS.md, "A producer without TensorFlow").
"""

from __future__ import annotations

import collections
import gc
import itertools
import os
import queue
import sys
import threading
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy

from returnn_tpu.errors import ConfigError, refused_by_returnn

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
BUCKET_WINDOW_SEQS = 4096  # a bucket's batch is handed out unfilled when it began this many sequences back


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

    def stream(self, dataset, *, recurrent: bool, used_data_keys, train: bool) -> Iterator:
        """RETURNN's batches for ``dataset``'s current epoch (``Batch`` objects, no data loaded),
        made as they are taken: RETURNN's batch generator is lazy, so a dataset that knows a
        sequence's length only once it has made it (``CachedDataset2``, generated datasets) makes
        it only shortly before its batch is read."""
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
        while batch_set.has_more():
            (batch,) = batch_set.peek_next_n(1)
            batch_set.advance(1)
            yield batch

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

    def stream(self, dataset, *, recurrent: bool, used_data_keys, train: bool) -> Iterator:
        """The bucketed batches of ``dataset``'s current epoch, in the order of their first
        sequence (a dataset loads sequences in increasing order), made as they are taken. A batch
        is handed out once it is full and no unfilled bucket began before it; a bucket whose first
        sequence lies :data:`BUCKET_WINDOW_SEQS` sequences back is handed out unfilled (padded), so
        at most that many sequences are held, whatever the corpus's size."""
        from returnn.engine.batch import Batch as ReturnnBatch

        pending: Dict[int, "ReturnnBatch"] = {}  # bucket -> its batch being filled
        ready: List["ReturnnBatch"] = []  # full, waiting for the unfilled ones that began before them

        def handed_out() -> List["ReturnnBatch"]:
            """The ready batches that begin no later than every pending one, in order."""
            first_pending = min((b.start_seq for b in pending.values()), default=sys.maxsize)
            ready.sort(key=lambda b: b.start_seq)
            out = [b for b in ready if b.start_seq <= first_pending]
            del ready[: len(out)]
            return out

        for seq_idx, t_start, t_end in dataset.iterate_seqs(recurrent_net=True, used_data_keys=used_data_keys):
            for bucket, batch in list(pending.items()):  # held too long: out, unfilled
                if batch.start_seq <= seq_idx - BUCKET_WINDOW_SEQS:
                    ready.append(pending.pop(bucket))
            length = t_end - t_start
            bucket = self.bucket_of(length[self.key])
            if bucket is None:
                self.dropped += 1
                continue
            batch = pending.setdefault(bucket, ReturnnBatch())
            batch.add_sequence_as_slice(seq_idx=seq_idx, seq_start_frame=t_start, length=length)
            if batch.num_slices == self.seqs_per_batch(bucket):
                ready.append(pending.pop(bucket))
            yield from handed_out()
        ready.extend(pending.values())  # incomplete: padded with empty sequences
        pending.clear()
        yield from handed_out()

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
    """RETURNN's ``init_seq_order``; an assertion or ``ValueError`` RETURNN's dataset code raises
    there (its check of the dataset's options, e.g. ``num_seqs > 0``, or a ``DistributeFilesDataset``
    sub-dataset without ``seq_ordering``) is bad input: one line naming the dataset and the failed
    check."""
    try:
        dataset.init_seq_order(epoch=epoch)
    except (AssertionError, ValueError) as exc:
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        detail = f": {exc}" if str(exc) else ""
        if "seq_ordering" in detail:  # RETURNN sets a dataset's seq_ordering from the config's batching
            detail += (" (the dataset's seq_ordering, or the config's batching where the dataset sets none; valid: "
                       "default, default_every_n:N, reverse, sorted, sorted_reverse, random[:SEED], random_sample, "
                       "sort_bin_shuffle[:N], sort_bin_shuffle_x2[:N], laplace[:N])")
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


def shards_files(config, key: str = "train") -> bool:
    """Whether ``key``'s dataset deals its files to the replicas: RETURNN's
    ``DistributeFilesDataset`` with ``distrib_shard_files`` (its shard of the files for each
    distributed rank; here, for each replica)."""
    opts = config.typed_value(key, None)
    return isinstance(opts, dict) and bool(opts.get("distrib_shard_files"))


def init_datasets(config, key: str, num_replicas: int = 1, first_replica: int = 0, distribution: str = "shard",
                  all_replicas: Optional[int] = None) -> list:
    """The RETURNN dataset(s) that config key ``key`` (``"train"``, ``"dev"``) describes.

    Options are completed as RETURNN's ``rnn.py`` does (``chunking``, ``batching``, ``window``
    from the config; no chunking and sorted order for ``dev``). For ``random_seed_offset`` on
    ``train`` there is one instance per local replica, each with its own offset; otherwise one.
    A ``train`` that shards its files (:func:`shards_files`) has one instance per local replica,
    each with its shard of ``all_replicas`` (default: ``first_replica + num_replicas``), as
    RETURNN's PyTorch engine gives each rank its shard (``_num_shards``, ``_shard_index``).
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
    replicas = range(first_replica, first_replica + num_replicas)
    sharded = shards_files(config, key)
    if sharded:  # one file order for all shards (else they would overlap)
        offsets = [base_offset] * num_replicas
    elif distribution == "random_seed_offset" and key == "train":
        offsets = [replica * SEED_OFFSET_PER_REPLICA + base_offset for replica in replicas]
    else:
        offsets = [base_offset]
    if not isinstance(opts, dict):
        if len(offsets) > 1:
            raise ConfigError(f"{key} must be a dict for dataset_distribution 'random_seed_offset', got {opts!r}")
        return [_init_dataset(key, opts, defaults)]
    datasets = []
    for replica, offset in zip(replicas, offsets):
        kwargs = {**defaults, "random_seed_offset": offset, **opts}
        if sharded:  # as RETURNN's "shard" over torch ranks, with a replica as the rank
            kwargs.update(distrib_shard_files=False, _num_shards=all_replicas or replicas.stop, _shard_index=replica)
        Dataset.kwargs_update_from_config(config, kwargs)
        datasets.append(_init_dataset(key, kwargs))
    return datasets


def _init_dataset(key: str, opts, defaults: Optional[dict] = None):
    """RETURNN's ``init_dataset``; whatever it raises is bad input, one line naming the dataset: a
    file it cannot open or read (a missing or truncated HDF file), an option it refuses (a
    ``chunking`` it cannot parse, a ``seq_ordering`` a dataset does not allow)."""
    from returnn.datasets import init_dataset

    try:
        return init_dataset(opts, default_kwargs=defaults)
    except Exception as exc:  # noqa: BLE001 (RETURNN's checks raise any type; all are the config's)
        what = opts.get("class") if isinstance(opts, dict) else opts
        what = getattr(what, "__name__", what)
        if isinstance(exc, OSError):
            error = ConfigError(f"{key}: RETURNN's {what} cannot read its files: {exc}")
        else:
            error = refused_by_returnn(key, f"its {what}", exc)
        # The half-made dataset's __del__ may fail in turn (PostprocessingDataset's does): a second
        # traceback about nothing the user can change. It runs as the exception is let go.
        hook, sys.unraisablehook = sys.unraisablehook, lambda _: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook
    raise error from None


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


def dealt_stream(batches: Iterable, num_slots: int, *, recurrent: bool) -> Iterator:
    """``batches`` (a stream), the last few re-cut as :func:`deal_evenly` re-cuts a whole epoch's
    list, so that their number is a multiple of ``num_slots``: the same batches, without knowing
    the epoch's length in advance. The tail to re-cut is at most ``2 * num_slots - 1`` batches
    long, so that many are held back."""
    held: "collections.deque" = collections.deque()
    handed_out = 0
    for batch in batches:
        held.append(batch)
        if len(held) >= 2 * num_slots:
            yield held.popleft()
            handed_out += 1
    remainder = (handed_out + len(held)) % num_slots
    tail = min(len(held), num_slots + remainder) if remainder else 0
    for _ in range(len(held) - tail):
        yield held.popleft()
    yield from deal_evenly(list(held), num_slots, recurrent=recurrent)


def release_seqs_before(dataset, seq_idx: int):
    """Tells ``dataset`` that no sequence before ``seq_idx`` will be read (RETURNN's meaning of a
    ``load_seqs`` that starts there; an empty one loads nothing): ``CachedDataset2`` and generated
    datasets then drop what they made for the lengths of batches passed over."""
    dataset.load_seqs(seq_idx, seq_idx)


class EpochBatches:
    """The steps of one epoch, made as they are taken: each step has one padded batch per local
    replica.

    Either one dataset per local replica (each replica walks its own; the epoch ends when the
    first runs out), or one dataset whose batches are dealt in turn to ``num_slots`` global
    replicas, of which this process feeds ``slots`` (a range). Batches come from RETURNN's lazy
    batch generator, a bounded number ahead of the step being read (:func:`dealt_stream`,
    :data:`BUCKET_WINDOW_SEQS`), so the first step does not wait for a pass over the epoch and
    memory does not grow with it; the number of steps is known only at the end (workers agree
    where an epoch ends as they go: :class:`returnn_tpu.epochs.TrainEpoch`). A dealt dataset uses
    every sequence once (:func:`deal_evenly` at the end); batches of other slots, and of steps
    passed over (:meth:`start_at`), are never read.

    With ``pad_last`` (evaluation), the last, incomplete group of a dealt dataset is kept and
    filled with weight-0 copies of the last batch, so every batch is seen exactly once.
    Iterating yields ``(batches, weights)``; data is read on a background thread, ``prefetch``
    steps ahead. :attr:`start_seconds` is what RETURNN's ``init_seq_order`` took.
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
        self.batching = batching
        self.recurrent = recurrent
        self.train = train
        self.pad_last = pad_last
        self.first_step = 0
        self.batch_offset = 0  # see start_at
        start = time.perf_counter()
        for dataset in self.datasets:
            init_seq_order(dataset, epoch)
        self.start_seconds = time.perf_counter() - start

    def start_at(self, step: int, batch_offset: int = 0):
        """Skips the first ``step`` steps (an epoch continued after an interruption); their
        batches are made (for the order) but not read. Batches depend only on the epoch, so the
        rest is what the interrupted run would have trained.

        ``batch_offset`` (a dealt dataset only): step ``s`` takes the batches from index
        ``batch_offset + s * num_slots``, to continue an epoch that another number of replicas
        began at any batch; the last, incomplete step is left out.
        """
        if batch_offset and len(self.datasets) > 1:
            raise ValueError("a batch offset needs one dataset dealt to the replicas")
        self.first_step, self.batch_offset = step, batch_offset

    def _stream(self, dataset) -> Iterator:
        return self.batching.stream(dataset, recurrent=self.recurrent, used_data_keys=set(self.data_keys),
                                    train=self.train)

    def _raw_batch(self, dataset, batch) -> Batch:
        from returnn.engine.batch import batch_to_raw_dict

        raw = batch_to_raw_dict(batch, dataset=dataset, extern_data=self.extern_data, data_keys=self.data_keys)
        out = {}
        for key in self.data_keys:
            out[key] = raw[key]
            if f"{key}_seq_lens" in raw:
                out[size_key(key, 0)] = raw[f"{key}_seq_lens"].astype("int32")
        return self.batching.pad(out)

    @staticmethod
    def _passed_over(dataset, batches: Iterator, count: int) -> Iterator:
        """``batches`` after its first ``count``, which are made but not read."""
        for _ in range(count):
            batch = next(batches, None)
            if batch is None:
                break
            release_seqs_before(dataset, batch.start_seq)
        return batches

    def _own_copies(self) -> Iterator[Tuple[List[Batch], List[float]]]:
        """One dataset per replica: a step while every replica has a batch."""
        streams = [self._passed_over(d, self._stream(d), self.first_step) for d in self.datasets]
        for step in zip(*streams):
            yield [self._raw_batch(d, b) for d, b in zip(self.datasets, step)], [1.0] * len(self.datasets)

    def _dealt(self) -> Iterator[Tuple[List[Batch], List[float]]]:
        """One dataset, its batches dealt to ``num_slots`` replicas in turn; ours are ``slots``."""
        dataset, n = self.datasets[0], self.num_slots
        batches = self._stream(dataset)
        if not self.pad_last and n > 1:
            batches = dealt_stream(batches, n, recurrent=self.recurrent)
        batches = self._passed_over(dataset, batches, self.batch_offset + self.first_step * n)
        while True:
            group = list(itertools.islice(batches, n))
            if not group or (len(group) < n and not self.pad_last):
                return
            out, weights = [], []
            for slot in self.slots:
                if slot < len(group):
                    out.append(self._raw_batch(dataset, group[slot]))
                    weights.append(1.0)
                else:  # only with pad_last: a placeholder that counts zero (the last batch: datasets
                    # such as generated ones can only load sequences in increasing order)
                    out.append(self._raw_batch(dataset, group[-1]))
                    weights.append(0.0)
            yield out, weights

    def steps(self) -> Iterator[Tuple[List[Batch], List[float]]]:
        """The steps, read on the caller's thread; the datasets' epoch is finished at the end."""
        try:
            yield from self._own_copies() if len(self.datasets) > 1 else self._dealt()
        finally:
            for dataset in self.datasets:
                dataset.finish_epoch()

    def __iter__(self) -> Iterator[Tuple[List[Batch], List[float]]]:
        """The steps, read on a background thread ``prefetch`` steps ahead."""
        return read_ahead(self.steps(), self.prefetch, name="returnn_tpu batches")


class ReadAhead:
    """The items of ``items`` (each passed through ``transform``), made on a background thread up
    to ``depth`` items ahead of the caller, so that reading (or copying to a device) overlaps what
    the caller does with the previous item. An error on the thread is raised to the caller at that
    item. When the caller stops early, the thread stops and ``items`` is closed (a generator's
    ``finally`` runs) before iteration returns.

    Another thread may ask how far it has got (:meth:`wait_made`): the items made so far (taken
    or waiting) and whether ``items`` has ended; that is how workers agree where an epoch ends
    (:class:`returnn_tpu.epochs.TrainEpoch`). Iterate once.
    """

    def __init__(self, items: Iterable, depth: int, *, name: str, transform: Optional[Callable] = None):
        self._results: "queue.Queue" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._progress = threading.Condition()
        self.made = 0
        self.ended = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(items, transform), name=name, daemon=True)
        self._thread.start()

    def _run(self, items: Iterable, transform: Optional[Callable]):
        iterator = iter(items)
        try:
            while not self._stop.is_set():
                try:
                    item = next(iterator)
                except StopIteration:
                    self._results.put(_END)
                    self._advance(ended=True)
                    return
                self._results.put(transform(item) if transform else item)
                self._advance()
        except BaseException as exc:  # handed to the caller, which re-raises it
            self._results.put(exc)
            self._advance(error=exc)
        finally:
            if hasattr(iterator, "close"):
                iterator.close()

    def _advance(self, ended: bool = False, error: Optional[BaseException] = None):
        with self._progress:
            self.made += not (ended or error)
            self.ended |= ended
            self._error = self._error or error
            self._progress.notify_all()

    def wait_made(self, count: int, report_seconds: float = 60.0) -> Tuple[int, bool]:
        """Waits until ``count`` items are made or ``items`` has ended (an error it raised is
        raised here too); reports a wait every ``report_seconds`` on stderr. Returns the items
        made so far and whether ``items`` has ended."""
        waited = 0.0
        with self._progress:
            while self.made < count and not (self.ended or self._error):
                if not self._progress.wait(timeout=report_seconds):
                    waited += report_seconds
                    print(f"returnn-tpu: waited {waited:.0f} s for item {count} of {self._thread.name}",
                          file=sys.stderr, flush=True)
            if self._error is not None and self.made < count:
                raise self._error
            return self.made, self.ended

    def __iter__(self) -> Iterator:
        try:
            while True:
                item = self._results.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._stop.set()
            while self._thread.is_alive():  # unblock the thread if it waits on a full queue
                try:
                    self._results.get(timeout=0.1)
                except queue.Empty:
                    pass


_END = object()  # ReadAhead's end of the items


def read_ahead(items: Iterable, depth: int, *, name: str, transform: Optional[Callable] = None) -> Iterator:
    """:class:`ReadAhead`'s items, its thread started when the first is asked for."""
    yield from ReadAhead(items, depth, name=name, transform=transform)
