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

No ``tf.data.Dataset.from_generator`` (DESIGN.md fact 18): batches are NumPy arrays handed to
the step function directly.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy

from returnn_tpu.errors import ConfigError
from returnn_tpu.returnn_bridge import size_key

Batch = Dict[str, numpy.ndarray]
SEED_OFFSET_PER_REPLICA = 16127  # RETURNN's factor per Horovod rank


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

    def generate(self, dataset, *, recurrent: bool, used_data_keys, train: bool):
        """RETURNN's batch set generator for ``dataset``'s current epoch."""
        import sys

        return dataset.generate_batches(
            recurrent_net=recurrent,
            batch_size=self.batch_size,
            max_seqs=self.max_seqs,
            max_seq_length=(self.max_seq_length or sys.maxsize) if train else sys.maxsize,
            min_seq_length=self.min_seq_length if train else 0,
            max_pad_size=self.max_pad_size if train else None,
            shuffle_batches=self.shuffle_batches and train,
            used_data_keys=used_data_keys,
        )


def init_datasets(config, key: str, num_replicas: int = 1, first_replica: int = 0, distribution: str = "shard") -> list:
    """The RETURNN dataset(s) that config key ``key`` (``"train"``, ``"dev"``) describes.

    Options are completed as RETURNN's ``rnn.py`` does (``chunking``, ``batching``, ``window``
    from the config; no chunking and sorted order for ``dev``). For ``random_seed_offset`` on
    ``train`` there is one instance per local replica, each with its own offset; otherwise one.
    Returns [] if the config has no such key.
    """
    from returnn.datasets import Dataset, init_dataset

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
        return [init_dataset(opts, default_kwargs=defaults)]
    datasets = []
    for offset in offsets:
        kwargs = {**defaults, "random_seed_offset": offset, **opts}
        Dataset.kwargs_update_from_config(config, kwargs)
        datasets.append(init_dataset(kwargs))
    return datasets


class EpochBatches:
    """The steps of one epoch: each step is a list with one padded batch per local replica.

    ``datasets`` has one dataset per replica (each replica walks its own) or a single one whose
    batches are dealt to the replicas in turn (``replica_slot`` of ``num_slots`` global
    replicas, for the multi-worker case; on one machine ``replica_slot`` is 0).
    Iterate it once; reading happens on a background thread, ``prefetch`` steps ahead.
    """

    def __init__(
        self,
        datasets: Sequence,
        *,
        epoch: int,
        num_replicas: int,
        extern_data,
        data_keys: Sequence[str],
        make_batches: Callable,
        replica_slot: int = 0,
        num_slots: Optional[int] = None,
        prefetch: int = 4,
    ):
        self.datasets = list(datasets)
        self.num_replicas = num_replicas
        self.extern_data = extern_data
        self.data_keys = list(data_keys)
        self.replica_slot = replica_slot
        self.num_slots = num_slots or num_replicas
        for dataset in self.datasets:
            dataset.init_seq_order(epoch=epoch)
        self.batch_sets = [make_batches(dataset) for dataset in self.datasets]
        self._queue: "queue.Queue" = queue.Queue(maxsize=prefetch)
        self._thread = threading.Thread(target=self._produce, name="returnn_tpu batches", daemon=True)
        self._stop = threading.Event()

    def _raw_batch(self, dataset, batch) -> Batch:
        from returnn.engine.batch import batch_to_raw_dict

        raw = batch_to_raw_dict(batch, dataset=dataset, extern_data=self.extern_data, data_keys=self.data_keys)
        out = {}
        for key in self.data_keys:
            out[key] = raw[key]
            if f"{key}_seq_lens" in raw:
                out[size_key(key, 0)] = raw[f"{key}_seq_lens"].astype("int32")
        return out

    def _take(self, index: int, *, read: bool) -> Optional[Batch]:
        """Advances dataset ``index`` by one batch; returns it padded if ``read``, else an empty dict."""
        batch_set = self.batch_sets[index]
        if not batch_set.has_more():
            return None
        (batch,) = batch_set.peek_next_n(1)
        batch_set.advance(1)
        return self._raw_batch(self.datasets[index], batch) if read else {}

    def _next_step(self) -> Optional[List[Batch]]:
        """The next step's batches for the local replicas, or None at the end of the epoch."""
        if len(self.datasets) > 1:  # one dataset per replica
            step = [self._take(i, read=True) for i in range(self.num_replicas)]
        else:  # one dataset dealt in turn over all global replicas; ours are a contiguous range
            mine = range(self.replica_slot, self.replica_slot + self.num_replicas)
            step = [self._take(0, read=slot in mine) for slot in range(self.num_slots)]
            step = step if None in step else [step[slot] for slot in mine]
        return None if any(batch is None for batch in step) else step

    def _produce(self):
        try:
            while not self._stop.is_set():
                step = self._next_step()
                self._queue.put(step)
                if step is None:
                    return
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._queue.put(exc)

    def __iter__(self) -> Iterator[List[Batch]]:
        self._thread.start()
        try:
            while True:
                item = self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    return
                yield item
        finally:
            self._stop.set()
            while self._thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    self._queue.get(timeout=0.1)
                except queue.Empty:
                    pass
            for dataset in self.datasets:
                dataset.finish_epoch()

    def complete_frac(self) -> float:
        """How much of the epoch has been read, from RETURNN's batch set generator (0..1)."""
        return min(b.completed_frac() for b in self.batch_sets)
