"""RETURNN datasets as per-replica batches, one batch per replica per step.

Batches come from RETURNN's own batch generation (``Dataset.generate_batches`` with the
config's ``batch_size``, ``max_seqs``, ``max_seq_length``, ``chunking``, ``batching``, ...;
:mod:`returnn_tpu.datapath.batching`) of the datasets :mod:`returnn_tpu.datapath.datasets` makes, and RETURNN's own
padding (``batch_to_raw_dict``); this module only decides which replica gets which batch, and
reads ahead on a background thread.

``dataset_distribution`` decides what an epoch is:

* ``"random_seed_offset"`` (default, like RETURNN's Horovod mode): every replica has its own
  instance of the dataset with ``random_seed_offset = replica * 16127`` (plus the config's
  ``dataset_random_seed_offset``), so each sees the whole dataset in its own order (generated
  datasets generate different sequences). An epoch is one pass of every replica over its
  dataset; it ends when the first replica runs out, so about ``num_replicas`` times the data
  of a single-device epoch is trained on.
* ``"shard"``: one dataset, one order; consecutive batches go to replicas in turn. An epoch is
  one pass over the dataset in total; its last batches are re-cut so that every replica has one
  in the last step (:func:`deal_evenly`), so no sequence is left out.

Batches are made as they are taken (RETURNN's lazy batch generator), a bounded number of steps
ahead: no pass over the epoch before its first step, and what is held does not grow with the
corpus (docs/data.md, "Streamed epochs"); an epoch continued after an interruption begins
where its streams stood, recorded as each step is made (:mod:`returnn_tpu.datapath.positions`), without
making the sequences before. With several workers, all of them do the same number
of steps in an epoch, the smallest number any of them has, agreed as they go
(:class:`returnn_tpu.datapath.epochs.TrainEpoch`), so none waits in a collective for a worker that has
run out of data.

With ``jit_compile``, :class:`returnn_tpu.datapath.batching.BucketBatching` replaces RETURNN's batch
generation for training: sequences grouped by length into buckets, batches padded to static
shapes (one per bucket).

No ``tf.data.Dataset.from_generator`` (FACTS.md, "from_generator"): batches are NumPy arrays handed to
the step function directly. Nothing here imports TensorFlow: the data producer process runs this
module without it (FACTS.md, "A producer without TensorFlow").
"""

from __future__ import annotations

import collections
import itertools
import queue
import sys
import threading
import time
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

from returnn_tpu.datapath.batching import Batch, BatchingOptions, size_key
from returnn_tpu.datapath.datasets import init_seq_order
from returnn_tpu.errors import ConfigError, DatasetError
from returnn_tpu.datapath.positions import (ContinuedDataset, StepPoints, StreamPoint, position_after,
                                            why_not_continuable)


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


def dealt_stream(batches: Iterable, num_slots: int, *, recurrent: bool, before: int = 0) -> Iterator:
    """``batches`` (a stream), the last few re-cut as :func:`deal_evenly` re-cuts a whole epoch's
    list, so that their number is a multiple of ``num_slots``: the same batches, without knowing
    the epoch's length in advance. The tail to re-cut is at most ``2 * num_slots - 1`` batches
    long, so that many are held back. ``before``: the epoch's batches before the stream's first
    (a stream continued from a :data:`returnn_tpu.datapath.positions.Position`)."""
    held: "collections.deque" = collections.deque()
    handed_out = before
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


_AFTER = "returnn_tpu_after"  # the StreamPoint after a batch, as an attribute of RETURNN's Batch


class EpochBatches:
    """The steps of one epoch, made as they are taken: each step has one padded batch per local
    replica.

    Either one dataset per local replica (each replica walks its own; the epoch ends when the
    first runs out), or one dataset whose batches are dealt in turn to ``num_slots`` global
    replicas, of which this process feeds ``slots`` (a range). Batches come from RETURNN's lazy
    batch generator, a bounded number ahead of the step being read (:func:`dealt_stream`,
    :data:`returnn_tpu.datapath.batching.BUCKET_WINDOW_SEQS`), so the first step does not wait for a pass
    over the epoch and memory does not grow with it; the number of steps is known only at the end
    (workers agree where an epoch ends as they go: :class:`returnn_tpu.datapath.epochs.TrainEpoch`). A dealt
    dataset uses every sequence once (:func:`deal_evenly` at the end); batches of other slots, and of steps
    passed over (:meth:`start_at`), are never read.

    With ``pad_last`` (evaluation), the last, incomplete group of a dealt dataset is kept and
    filled with weight-0 copies of the last batch, so every batch is seen exactly once.
    Iterating yields ``(batches, weights)``; data is read on a background thread, ``prefetch``
    steps ahead. :attr:`start_seconds` is what RETURNN's ``init_seq_order`` took. For training,
    :attr:`positions` (:class:`StepPoints`) holds where each step leaves its batches' streams:
    what :meth:`start_at` continues from.
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
        self.epoch = epoch
        self.first_step = 0
        self.batch_offset = 0  # see start_at
        self.continue_from: List[Optional[StreamPoint]] = [None] * len(self.datasets)
        self.positions = StepPoints()
        start = time.perf_counter()
        for dataset in self.datasets:
            init_seq_order(dataset, epoch)
        self.start_seconds = time.perf_counter() - start
        self._why_not = [why_not_continuable(d, batching, recurrent) if train else "" for d in self.datasets]

    def start_at(self, step: int, batch_offset: int = 0, points: Optional[Sequence[Optional[StreamPoint]]] = None):
        """Skips the first ``step`` steps (an epoch continued after an interruption). Batches
        depend only on the epoch, so the rest is what the interrupted run would have trained.

        ``points`` (one per dataset; None where unknown) is where each dataset's stream stood
        then (:attr:`positions` of the interrupted run): the stream continues there, without
        making a sequence before it. A stream without one makes the batches it passes over (for
        their lengths) but does not read them.

        ``batch_offset`` (a dealt dataset only): step ``s`` takes the batches from index
        ``batch_offset + s * num_slots``, to continue an epoch that another number of replicas
        began at any batch; the last, incomplete step is left out.
        """
        if batch_offset and len(self.datasets) > 1:
            raise ValueError("a batch offset needs one dataset dealt to the replicas")
        self.first_step, self.batch_offset = step, batch_offset
        self.continue_from = list(points) if points is not None else [None] * len(self.datasets)

    def _stream(self, index: int, batches_passed_over: int) -> Tuple[object, Iterator]:
        """Dataset ``index``'s source (the dataset, or its :class:`ContinuedDataset`) and its
        batches after the first ``batches_passed_over`` of the epoch, each marked with the
        :data:`StreamPoint` after it when it can be continued from."""
        dataset, point = self.datasets[index], self.continue_from[index]
        source, before = dataset, 0
        if point is not None and 0 < point[0] <= batches_passed_over and not self._why_not[index]:
            source, before = ContinuedDataset(dataset, point[1], self.recurrent), point[0]
        batches = self.batching.stream(source, recurrent=self.recurrent, used_data_keys=set(self.data_keys),
                                       train=self.train)
        if self.train and not self._why_not[index]:
            batches = self._marked(batches, source, before)
        if len(self.datasets) == 1 and not self.pad_last and self.num_slots > 1:
            batches = dealt_stream(batches, self.num_slots, recurrent=self.recurrent, before=before)
        return source, self._passed_over(source, batches, batches_passed_over - before)

    def _marked(self, batches: Iterator, source, count: int) -> Iterator:
        first_seq = getattr(source, "first_seq", 0)
        for batch in batches:
            count += 1
            setattr(batch, _AFTER, (count, position_after(batch, first_seq, source.ctx_left, self.recurrent)))
            yield batch

    def _point_after(self, index: int, batch):
        """The StreamPoint after ``batch`` of dataset ``index``, or why there is none."""
        return getattr(batch, _AFTER, None) or self._why_not[index] or "the epoch's last batches are re-cut"

    def _raw_batch(self, dataset, batch) -> Batch:
        from returnn.engine.batch import batch_to_raw_dict

        if "seq_tag" not in self.data_keys:
            dataset = _Untagged(dataset)
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
        sources, streams = zip(*(self._stream(i, self.first_step) for i in range(len(self.datasets))))
        for step, batches in enumerate(zip(*streams), start=self.first_step):
            if self.train:
                self.positions.record(step, [self._point_after(i, batch) for i, batch in enumerate(batches)])
            yield [self._raw_batch(d, b) for d, b in zip(sources, batches)], [1.0] * len(self.datasets)

    def _dealt(self) -> Iterator[Tuple[List[Batch], List[float]]]:
        """One dataset, its batches dealt to ``num_slots`` replicas in turn; ours are ``slots``."""
        n = self.num_slots
        dataset, batches = self._stream(0, self.batch_offset + self.first_step * n)
        for step in itertools.count(self.first_step):
            group = list(itertools.islice(batches, n))
            if not group or (len(group) < n and not self.pad_last):
                return
            if self.train:
                self.positions.record(step, [self._point_after(0, group[-1])] * len(self.slots))
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
        """The steps, read on the caller's thread; the datasets' epoch is finished at the end.
        What the dataset raises meanwhile is a :class:`returnn_tpu.errors.DatasetError` (one line)."""
        try:
            yield from self._own_copies() if len(self.datasets) > 1 else self._dealt()
        except (ConfigError, DatasetError):
            raise
        except Exception as exc:  # noqa: BLE001 (RETURNN's dataset code, or a config function it calls)
            raise DatasetError(self.datasets[0], self.epoch, exc) from exc
        finally:
            for dataset in self.datasets:
                dataset.finish_epoch()

    def __iter__(self) -> Iterator[Tuple[List[Batch], List[float]]]:
        """The steps, read on a background thread ``prefetch`` steps ahead."""
        return read_ahead(self.steps(), self.prefetch, name="returnn_tpu batches")


class _Untagged:
    """``dataset`` as RETURNN's ``batch_to_raw_dict`` reads it for a network without a ``seq_tag``
    input: every sequence's tag is ``""``. ``batch_to_raw_dict`` asks the dataset for each
    sequence's tag whatever the data keys, and training drops them; ``HDFDataset`` reads each from
    its file, a quarter of what a batch of 80-dimensional features costs (FACTS.md, "Sequence tags
    of a batch")."""

    def __init__(self, dataset):
        self._dataset = dataset

    def __getattr__(self, name: str):
        return getattr(self._dataset, name)

    @staticmethod
    def get_tag(seq_idx: int) -> str:
        return ""


class ReadAhead:
    """The items of ``items`` (each passed through ``transform``), made on a background thread up
    to ``depth`` items ahead of the caller, so that reading (or copying to a device) overlaps what
    the caller does with the previous item. An error on the thread is raised to the caller at that
    item. When the caller stops early, the thread stops and ``items`` is closed (a generator's
    ``finally`` runs) before iteration returns.

    Another thread may ask how far it has got (:meth:`wait_made`): the items made so far (taken
    or waiting) and whether ``items`` has ended; that is how workers agree where an epoch ends
    (:class:`returnn_tpu.datapath.epochs.TrainEpoch`). Iterate once.
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
