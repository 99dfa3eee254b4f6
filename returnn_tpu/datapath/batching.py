"""How sequences become batches: RETURNN's batching options, or XLA's buckets, and what a batch holds.

:class:`BatchingOptions` reads RETURNN's batching config options (``batch_size``, ``max_seqs``,
``max_seq_length``, ...) and makes an epoch's batches with RETURNN's own lazy batch generation
(``Dataset.generate_batches``). With ``jit_compile``, :class:`BucketBatching` replaces it for
training: sequences grouped by length into buckets, batches padded to static shapes (one per
bucket), with boundaries from the data's lengths (:func:`default_bucket_boundaries`) unless
``distribute_options`` gives them. A batch is a dict of NumPy arrays by data key, with each
dynamic axis's sequence lengths under :func:`size_key`; :func:`template_shapes` is what batching
needs of the network's ``extern_data``, in a form the producer process can be sent.

Which replica gets which batch is :mod:`returnn_tpu.datapath.data`'s decision; this module decides only
how sequences are grouped and padded. Nothing here imports TensorFlow: the data producer process
runs it without it (FACTS.md, "A producer without TensorFlow").
"""

from __future__ import annotations

import sys
from typing import Dict, Iterator, List, Optional, Sequence

import numpy

from returnn_tpu.datapath.datasets import init_seq_order
from returnn_tpu.errors import ConfigError

Batch = Dict[str, numpy.ndarray]
COUNTERS = ("dropped", "padded_frames", "total_frames")  # what BucketBatching counts while batching
BUCKET_WINDOW_SEQS = 4096  # a bucket's batch is handed out unfilled when it began this many sequences back


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
