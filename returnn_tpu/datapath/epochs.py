"""What an epoch is for this worker: which batches each of its replicas trains, where all workers
agree that it ends, and the evaluation data.

The one owner of those decisions (docs/data.md): ``dataset_distribution`` says whether every
replica walks its own copy of the train dataset (``random_seed_offset``) or one order is dealt
to the replicas of all workers in turn (``shard``, and always for evaluation); ``data_producer``
says where the batches are made (a producer process per worker, one on worker 0 for all, or a
thread here). RETURNN's batching options, or XLA's buckets, say how sequences become batches.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterator, List, Optional, Tuple

import numpy

from returnn_tpu.datapath.batching import (BatchingOptions, BucketBatching, default_bucket_boundaries, size_key,
                                           template_shapes)
from returnn_tpu.datapath.data import EpochBatches, ReadAhead
from returnn_tpu.datapath.datasets import (init_datasets, init_eval_datasets, init_seq_order, loads_in_processes,
                                           shards_files)
from returnn_tpu.errors import ConfigError
from returnn_tpu.datapath.producer import DataProducer, RemoteProducer
from returnn_tpu.datapath.producer_serving import ServeOptions

AHEAD_STEPS = 16  # with several workers: how many steps each makes ahead (what one agreement can cover)
CORES_KEPT = 2  # of the machine's cores, the training loop's and the producer's (data_loaders' default)


def default_data_loaders(replicas: int, accelerators: bool, cores: Optional[int] = None) -> int:
    """How many processes load the training sequences of a producer that feeds ``replicas`` when
    ``data_loaders`` is not set: one per replica, as many as the cores left once the training loop
    and the producer have one each (``cores``: those this process may use); 1 (the producer alone)
    when the replicas are CPU devices, whose steps use the cores themselves."""
    if not accelerators:
        return 1
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, min(replicas, cores - CORES_KEPT))


class TrainEpoch:
    """One epoch's training steps on this worker, ending where all workers agree.

    No worker knows in advance how many steps its data gives: batches are made as they are taken
    (:class:`returnn_tpu.datapath.data.EpochBatches`, or the producer's). Workers agree on a horizon as they
    go: when a worker reaches it, it waits until it has data for one more step or knows its data
    has ended, and all workers exchange how many steps they have made and whether that is all (one
    small all-gather, on the loop's thread, at the same step on every worker). The new horizon is
    the least any worker has; where a worker whose data ended has no more than that, the epoch
    ends there. Thus all workers train the same number of steps, the smallest any of them has, as
    before, without a pass over the epoch first; each worker makes up to ``ahead`` steps ahead, so
    one agreement covers about that many steps. With one worker nothing is exchanged.

    ``local`` (:class:`returnn_tpu.datapath.data.EpochBatches` or :class:`returnn_tpu.datapath.producer.ProducedEpoch`)
    gives this worker's steps. After iteration, :attr:`steps_done` is the epoch's step count, and
    :attr:`agreements`, :attr:`agree_seconds`, :attr:`agree_bytes` what agreeing cost.
    """

    def __init__(self, local, workers, ahead: int):
        self.local = local
        self.workers = workers
        self.ahead = ahead
        self.start_seconds = local.start_seconds  # RETURNN's init_seq_order of the epoch
        self.first_step = 0
        self.steps_done = 0
        self.agreements = 0
        self.agree_seconds = 0.0
        self.agree_bytes = 0

    def start_at(self, step: int, batch_offset: int = 0, points=None):
        """Continues the epoch at ``step`` (see :meth:`returnn_tpu.datapath.data.EpochBatches.start_at`)."""
        self.local.start_at(step, batch_offset, points)
        self.first_step = step

    def positions_after(self, steps_done: int) -> Optional[list]:
        """Where the stream of each of this worker's batches stands after ``steps_done`` steps
        (:class:`returnn_tpu.datapath.positions.StepPoints`)."""
        return self.local.positions.after(steps_done)

    def steps(self, on_device: Callable) -> Iterator[Tuple[int, tuple]]:
        """``(step, (batches, weights))`` of the epoch, the batches passed through ``on_device``
        (an iterator of steps to an iterator of steps); ends where all workers agree."""
        made = ReadAhead(self.local.steps(), self.ahead, name="returnn_tpu batches")
        items = iter(on_device(made))
        horizon, end_known, step = self.first_step, False, self.first_step
        try:
            while True:
                if step >= horizon:
                    if end_known:
                        return
                    horizon, end_known = self._agree(made, step)
                    if step >= horizon:
                        return
                yield step, next(items)
                step += 1
        finally:
            self.steps_done = step
            if hasattr(items, "close"):
                items.close()

    def __iter__(self) -> Iterator[tuple]:
        """``(batches, weights)`` of each step, as read (not copied to devices)."""
        return (item for _, item in self.steps(iter))

    def _agree(self, made: ReadAhead, step: int) -> Tuple[int, bool]:
        """At the horizon ``step``: the next horizon, and whether the epoch ends there."""
        count, ended = made.wait_made(step + 1 - self.first_step)
        ready = self.first_step + count
        if self.workers.num_workers == 1:
            return ready, ended
        start = time.perf_counter()
        rows = self.workers.rows([float(ready), float(ended)])
        self.agreements += 1
        self.agree_seconds += time.perf_counter() - start
        self.agree_bytes += self.workers.row_bytes(2)
        horizon = int(min(row[0] for row in rows))
        return horizon, any(row[1] and int(row[0]) == horizon for row in rows)


class EpochData:
    """This worker's data: per epoch, its replicas' training batches (from the producer or read
    here) and each eval dataset's batches, spread over all replicas.

    ``num_replicas`` counts the replicas of all workers, ``local_replicas`` this worker's, whose
    first has the global index ``first_replica``. ``workers`` are the collectives between workers
    (where an epoch ends; the producer's address). ``config_source`` (the config file and its
    ``++`` overrides) lets a producer process load the same config; without it the data is read on
    a thread of this process. Call :meth:`use_network` before the first epoch, and again when the
    network (its ``extern_data``) or the batching options change. ``accelerators``: the replicas
    run on GPUs or TPUs, not CPU devices (for :func:`default_data_loaders`).
    """

    def __init__(self, config, options, cluster, workers, *, num_replicas: int, local_replicas: int,
                 first_replica: int, config_source: Optional[Tuple[str, List[str]]] = None,
                 accelerators: bool = False):
        self.config = config
        self.options = options
        self.cluster = cluster
        self.workers = workers
        self.num_replicas = num_replicas
        self.local_replicas = local_replicas
        self.first_replica = first_replica
        # One producer serves all workers: it makes the batches of all replicas.
        self.shared_producer = options.data_producer == "chief" and cluster.num_workers > 1
        fed = num_replicas if self.shared_producer else local_replicas  # the replicas this worker's batches are for
        self.loaders = options.data_loaders or default_data_loaders(fed, accelerators)
        self.producer = self._start_producer(config_source) if config_source else None  # works while the rest is set up
        # With a producer, it reads the training data; one instance here, for the checks only (the
        # dataset's own order, the same on every worker; files dealt: the first replica's shard).
        if self.producer:
            self.train_datasets = init_datasets(config, "train", 1, first_replica, "shard", all_replicas=num_replicas)
        else:
            self.train_datasets = init_datasets(config, "train", local_replicas, first_replica,
                                                options.dataset_distribution, all_replicas=num_replicas,
                                                loaders=self.loaders)
        self.dev_datasets = init_eval_datasets(config)
        self.extern_data, self.data_keys, self.recurrent = None, [], False
        self.bucket_boundaries: Optional[List[int]] = None
        self.batching = self.eval_batching = None
        self.steps_expected: Optional[int] = None  # the last epoch's steps: for the progress line
        self._epoch = None  # the training epoch's batches, its first step and where the resume found its streams

    def _start_producer(self, config_source: Tuple[str, List[str]]):
        """The training data's producer (``data_producer``): this worker's own process; with
        ``"chief"`` and several workers, worker 0's, which serves all (worker 0 tells the others
        its port and key through the collective); None for ``"thread"``."""
        if self.options.data_producer == "thread":
            return None
        common = dict(dataset_key="train", distribution=self.options.dataset_distribution,
                      prefetch=self.options.data_prefetch, all_replicas=self.num_replicas, loaders=self.loaders)
        if not self.shared_producer:
            return DataProducer(*config_source, num_replicas=self.local_replicas,
                                first_replica=self.first_replica, **common)
        host, producer = self.cluster.chief_host, None
        if self.cluster.is_chief:
            serve = ServeOptions(host, os.urandom(16), self.cluster.num_workers, self.local_replicas)
            producer = DataProducer(*config_source, num_replicas=self.num_replicas, first_replica=0,
                                    serve=serve, **common)
            told = [producer.port(), *numpy.frombuffer(serve.authkey, numpy.uint32)]
        else:
            told = [0] * 5
        port, *key = self.workers.rows([float(x) for x in told])[0]
        if producer:
            return producer
        return RemoteProducer((host, int(port)), numpy.array(key, numpy.uint32).tobytes(), self.cluster.worker_index)

    def start_notes(self) -> List[str]:
        """What an epoch is with several replicas, and who loads the training data, for the log
        before the first step."""
        wrapped = self.loaders > 1 and not loads_in_processes(self.config.typed_value("train", None))
        return self._epoch_notes() + ([
            f"the training sequences are loaded by {self.loaders} processes (distribute_options['data_loaders']; "
            "RETURNN's MultiProcDataset around the train dataset, in its order)"] if wrapped else [])

    def _epoch_notes(self) -> List[str]:
        replicas = self.num_replicas
        if replicas > 1 and shards_files(self.config):
            return [f"the training files are dealt to the {replicas} replicas (distrib_shard_files): each walks its own "
                    "shard; an epoch ends when the first replica's shard ends"]
        if replicas > 1 and self.options.dataset_distribution == "random_seed_offset":
            return [f"an epoch is {replicas} passes over the training data: each of the {replicas} replicas walks "
                    "its own copy in its own order (as RETURNN's Horovod mode does), and epoch-keyed learning-rate "
                    "schedules see that; distribute_options['dataset_distribution'] = 'shard' makes an epoch one "
                    "pass, dealt to the replicas"]
        if replicas > 1:
            return [f"an epoch is one pass over the training data, its batches dealt to the {replicas} replicas"]
        return []

    def use_network(self, info):
        """Batches for the network ``info`` describes (:class:`returnn_tpu.returnn_side.returnn_bridge.NetworkInfo`):
        its ``extern_data`` and the data keys it uses. The first time, the datasets are checked
        against it (a mismatch is bad input, found before any step) and the training data is then
        held by the producer alone."""
        first = self.extern_data is None
        self.extern_data = info.extern_data
        # Every data key the network uses, as RETURNN feeds them (it asks the dataset for each, also
        # for one its get_data_keys() does not list).
        self.data_keys = list(info.used_data_keys)
        self.recurrent = info.recurrent
        if not first:  # the batching options stay; a network's #config changes them (read_batching_options)
            return
        if self.options.jit_compile:
            key = self.extern_data.default_input
            self.bucket_boundaries = self.options.bucket_boundaries or default_bucket_boundaries(
                self.train_datasets[0], key)
        self.read_batching_options()
        # What RETURNN's dataset refuses is found now, not after epoch 1; some datasets (a
        # DistributeFilesDataset) know their dtypes only in an epoch, as RETURNN checks them.
        for dataset in self.train_datasets[:1] + self.dev_datasets:
            init_seq_order(dataset, 1)
            self._check_matches(dataset)
            dataset.finish_epoch()  # a MetaDataset fails a second init of one epoch (FACTS.md, "MetaDataset epochs")
        if self.producer:
            self.train_datasets = None  # the data is held once per worker

    def _check_matches(self, dataset):
        """The dataset's dims, shapes and dtypes are the network's ``extern_data`` (RETURNN's
        check), before any step: a mismatch is bad input, not a failure in the middle of batching."""
        try:
            self.extern_data.check_matched_dataset(dataset, used_data_keys=self.data_keys)
        except AssertionError as exc:
            what = str(exc).split(". ")[0]  # "key 'data' dim mismatch"
            key = next((k for k in self.data_keys if f"key {k!r}" in what), self.extern_data.default_input)
            data = self.extern_data.data[key]
            raise ConfigError(
                f"{dataset.name}: {what}: the network's extern_data[{key!r}] (num_inputs/num_outputs) has dim "
                f"{data.dim}, shape {data.shape}, dtype {data.dtype}; the dataset has dim {dataset.get_data_dim(key)}, "
                f"shape {tuple(dataset.get_data_shape(key))}, dtype {dataset.get_data_dtype(key)}"
            ) from None

    def read_batching_options(self):
        """RETURNN's batching options from the config (again after a network's ``#config`` set them)."""
        self.eval_batching = self.batching = BatchingOptions(self.config)
        if self.bucket_boundaries is not None:  # XLA: static shapes, for evaluation too (no sequence left out)
            key = self.extern_data.default_input
            self.batching = BucketBatching(self.config, self.bucket_boundaries, key)
            self.eval_batching = BucketBatching(self.config, self.bucket_boundaries, key, keep_longer=True)

    def train_batches(self, epoch: int, while_waiting: Optional[Callable[[], None]] = None) -> TrainEpoch:
        """This worker's training steps of ``epoch``; ``while_waiting`` is called while a producer
        starts the epoch."""
        local = self._batches(self.train_datasets, epoch, train=True, while_waiting=while_waiting)
        ahead = max(self.options.data_prefetch, AHEAD_STEPS if self.workers.num_workers > 1 else 0)
        return TrainEpoch(local, self.workers, ahead)

    def continue_epoch(self, batches, steps_done: int, replicas_before: Optional[int] = None,
                       streams: Optional[dict] = None) -> Tuple[int, str]:
        """Has ``batches`` (an epoch's training batches) continue after ``steps_done`` steps that
        ``replicas_before`` replicas trained (None: as many as now), from where its data
        ``streams`` stood then (:meth:`stream_points` of all workers); returns the step it
        continues at, and what that means for the log ("" when nothing is worth saying).

        With each replica walking its own copy of the data (``random_seed_offset``), every
        replica continues its own walk at that step (replicas that are new begin theirs there).
        With the batches dealt to the replicas (``shard``), the rest of the epoch (from batch
        ``steps_done * replicas_before`` on) is dealt to the replicas there are now; when that is
        no whole number of steps, up to ``num_replicas - 1`` batches at the epoch's end are left
        out (docs/faults.md, "Resuming on other workers"). A stream with a recorded point
        continues there without making a sequence before it; one without makes the batches it
        passes over (docs/faults.md, "Resuming without replay").
        """
        self._epoch = (batches, 0, streams)  # what stream_points reads
        if steps_done == 0:
            return 0, ""
        replicas = f"{self.num_replicas} replica{'s' if self.num_replicas > 1 else ''}"
        if not replicas_before or replicas_before == self.num_replicas:
            step, offset, note = steps_done, 0, ""
        elif self._own_copies(train=True):
            step, offset = steps_done, 0
            note = (f"continues at step {steps_done + 1} ({replicas_before} replicas trained its first "
                    f"{steps_done} steps): each of the {replicas} continues its own walk through the data")
        else:
            done = steps_done * replicas_before
            step, offset = divmod(done, self.num_replicas)
            note = (f"continues after {done} of its batches ({steps_done} steps of {replicas_before} replicas) "
                    f"at step {step + 1} of {replicas}")
        keys = [str(r) for r in self._fed_replicas()] if self._own_copies(train=True) else ["dealt"]
        found = [(streams or {}).get(key) for key in keys]
        points = [None if point is None or isinstance(point, str) else point for point in found]
        batches.start_at(step, offset, points)
        self._epoch = (batches, step, streams)
        replayed = [f"{'replica ' + key if key != 'dealt' else 'the dealt batches'}: {why or 'not recorded'}"
                    for key, why, point in zip(keys, found, points) if point is None]
        if replayed:
            how = (f"makes the batches of the {step} steps it passes over, for their lengths ("
                   + "; ".join(sorted(set(replayed))) + ")")
        else:
            how = f"continues its data where it stood after step {steps_done} (no sequence before it is made)"
        return step, f"{note}; {how}" if note else how

    def stream_points(self, steps_done: int) -> Optional[dict]:
        """Where this worker's data streams stand after ``steps_done`` steps of the epoch
        :meth:`continue_epoch` started, by stream (``"dealt"``, or a replica's global index): a
        StreamPoint, or why there is none; what an interrupted checkpoint records (None at the
        epoch's start, or before an epoch)."""
        if self._epoch is None:
            return None
        batches, first_step, streams = self._epoch
        if steps_done == first_step:
            return streams  # where the resume found them
        points = batches.positions_after(steps_done)
        if points is None:
            return None
        if self._own_copies(train=True):
            return {str(self.first_replica + i): point for i, point in enumerate(points)}
        return {"dealt": points[0]}

    def _own_copies(self, train: bool) -> bool:
        """Whether each replica walks its own copy of the data (else one order dealt to all)."""
        return train and (self.options.dataset_distribution == "random_seed_offset" or shards_files(self.config))

    def _fed_replicas(self) -> range:
        """The global replicas whose training batches this worker (or its producer) makes."""
        if self.shared_producer:  # it makes all replicas' batches and hands each worker its own
            return range(self.num_replicas)
        return range(self.first_replica, self.first_replica + self.local_replicas)

    def placeholder_step(self) -> List[dict]:
        """One batch per local replica of one sequence of one frame, all zeros: what the step is
        traced on when an epoch continued at its very end has no batch to train (a run resumed
        from the model of the epoch's last sync)."""
        batch = {}
        for key, template in template_shapes(self.extern_data, self.data_keys).items():
            batch[key] = numpy.zeros([1] + [dim or 1 for dim in template["shape"]], template["dtype"])
            if None in template["shape"]:
                batch[size_key(key, 0)] = numpy.ones([1], "int32")
        return [batch] * self.local_replicas

    def eval_batches(self, dataset, epoch: int) -> EpochBatches:
        """This worker's share of ``dataset``'s batches: every batch once over all replicas (the
        same number of steps on every worker: each deals the same batches)."""
        return self._batches([dataset], epoch, train=False)

    def _batches(self, datasets, epoch: int, *, train: bool, while_waiting=None):
        # random_seed_offset: every replica walks its own copy (also with one replica per worker);
        # shard, and always for evaluation: one order, dealt to the replicas of all workers in turn.
        own_copies = self._own_copies(train)
        ours = self._fed_replicas() if train else range(self.first_replica, self.first_replica + self.local_replicas)
        what = dict(
            epoch=epoch,
            data_keys=self.data_keys,
            batching=self.batching if train else self.eval_batching,
            recurrent=self.recurrent,
            train=train,
            slots=None if own_copies else ours,
            num_slots=None if own_copies else self.num_replicas,
            pad_last=not train,
        )
        if train and self.producer:
            return self.producer.epoch(**what, templates=template_shapes(self.extern_data, self.data_keys),
                                       while_waiting=while_waiting)
        return EpochBatches(datasets, extern_data=self.extern_data, prefetch=self.options.data_prefetch, **what)

    def xla_counters(self) -> Optional[dict]:
        """With buckets (XLA): the padded and total frames and the dropped sequences since the last
        call; None without."""
        return self.batching.take_counters() if isinstance(self.batching, BucketBatching) else None

    def close(self):
        """Ends the producer process, if there is one."""
        if self.producer:
            self.producer.close()
