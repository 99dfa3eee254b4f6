"""What an epoch is for this worker: which batches each of its replicas trains, the step count all
workers agree on, and the evaluation data.

The one owner of those decisions (docs/data.md): ``dataset_distribution`` says whether every
replica walks its own copy of the train dataset (``random_seed_offset``) or one order is dealt
to the replicas of all workers in turn (``shard``, and always for evaluation); ``data_producer``
says where the batches are made (a producer process per worker, one on worker 0 for all, or a
thread here). RETURNN's batching options, or XLA's buckets, say how sequences become batches.
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional, Tuple

import numpy

from returnn_tpu.data import BatchingOptions, BucketBatching, EpochBatches, default_bucket_boundaries, init_datasets
from returnn_tpu.data import init_eval_datasets, init_seq_order, size_key, template_shapes
from returnn_tpu.errors import ConfigError
from returnn_tpu.producer import DataProducer, RemoteProducer, ServeOptions


class EpochData:
    """This worker's data: per epoch, its replicas' training batches (from the producer or read
    here) and each eval dataset's batches, spread over all replicas.

    ``num_replicas`` counts the replicas of all workers, ``local_replicas`` this worker's, whose
    first has the global index ``first_replica``. ``workers`` are the collectives between workers
    (the agreed step count; the producer's address). ``config_source`` (the config file and its
    ``++`` overrides) lets a producer process load the same config; without it the data is read on
    a thread of this process. Call :meth:`use_network` before the first epoch, and again when the
    network (its ``extern_data``) or the batching options change.
    """

    def __init__(self, config, options, cluster, workers, *, num_replicas: int, local_replicas: int,
                 first_replica: int, config_source: Optional[Tuple[str, List[str]]] = None):
        self.config = config
        self.options = options
        self.cluster = cluster
        self.workers = workers
        self.num_replicas = num_replicas
        self.local_replicas = local_replicas
        self.first_replica = first_replica
        # One producer serves all workers: it makes the batches of all replicas.
        self.shared_producer = options.data_producer == "chief" and cluster.num_workers > 1
        self.producer = self._start_producer(config_source) if config_source else None  # works while the rest is set up
        # With a producer, it reads the training data; one instance here, for the checks only.
        self.train_datasets = init_datasets(config, "train") if self.producer else init_datasets(
            config, "train", local_replicas, first_replica, options.dataset_distribution
        )
        self.dev_datasets = init_eval_datasets(config)
        self.extern_data, self.data_keys, self.recurrent = None, [], False
        self.bucket_boundaries: Optional[List[int]] = None
        self.batching = self.eval_batching = None

    def _start_producer(self, config_source: Tuple[str, List[str]]):
        """The training data's producer (``data_producer``): this worker's own process; with
        ``"chief"`` and several workers, worker 0's, which serves all (worker 0 tells the others
        its port and key through the collective); None for ``"thread"``."""
        if self.options.data_producer == "thread":
            return None
        common = dict(dataset_key="train", distribution=self.options.dataset_distribution,
                      prefetch=self.options.data_prefetch)
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
        """What an epoch is with several replicas, for the log before the first step."""
        replicas = self.num_replicas
        if replicas > 1 and self.options.dataset_distribution == "random_seed_offset":
            return [f"an epoch is {replicas} passes over the training data: each of the {replicas} replicas walks "
                    "its own copy in its own order (as RETURNN's Horovod mode does), and epoch-keyed learning-rate "
                    "schedules see that; distribute_options['dataset_distribution'] = 'shard' makes an epoch one "
                    "pass, dealt to the replicas"]
        if replicas > 1:
            return [f"an epoch is one pass over the training data, its batches dealt to the {replicas} replicas"]
        return []

    def use_network(self, info):
        """Batches for the network ``info`` describes (:class:`returnn_tpu.returnn_bridge.NetworkInfo`):
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
        for dataset in self.train_datasets[:1] + self.dev_datasets:
            self._check_matches(dataset)
        if self.producer:
            self.train_datasets = None  # the data is held once per worker
        for dataset in self.dev_datasets:  # what RETURNN's dataset refuses is found now, not after epoch 1
            init_seq_order(dataset, 1)
            dataset.finish_epoch()  # a MetaDataset fails a second init of one epoch (FACTS.md, "MetaDataset epochs")

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

    def train_batches(self, epoch: int, while_waiting: Optional[Callable[[], None]] = None) -> EpochBatches:
        """This worker's training batches of ``epoch``; ``while_waiting`` is called while a producer
        makes them."""
        return self._batches(self.train_datasets, epoch, train=True, while_waiting=while_waiting)

    def continue_epoch(self, batches, steps_done: int, replicas_before: Optional[int] = None) -> Tuple[int, str]:
        """Has ``batches`` (an epoch's training batches) continue after ``steps_done`` steps that
        ``replicas_before`` replicas trained (None: as many as now); returns the step it continues
        at, and what that means when the number of replicas changed (for the log; else "").

        With each replica walking its own copy of the data (``random_seed_offset``), every
        replica continues its own walk at that step (replicas that are new begin theirs there).
        With the batches dealt to the replicas (``shard``), the rest of the epoch (from batch
        ``steps_done * replicas_before`` on) is dealt to the replicas there are now; when that is
        no whole number of steps, up to ``num_replicas - 1`` batches at the epoch's end are left
        out (docs/faults.md, "Resuming on other workers").
        """
        replicas = f"{self.num_replicas} replica{'s' if self.num_replicas > 1 else ''}"
        if not replicas_before or replicas_before == self.num_replicas or steps_done == 0:
            batches.start_at(steps_done)
            return steps_done, ""
        if self.options.dataset_distribution == "random_seed_offset":
            batches.start_at(steps_done)
            return steps_done, (f"continues at step {steps_done + 1} ({replicas_before} replicas trained its first "
                                f"{steps_done} steps): each of the {replicas} continues its own walk through the data")
        done = steps_done * replicas_before
        step, offset = divmod(done, self.num_replicas)
        batches.start_at(step, offset)
        return step, (f"continues after {done} of its batches ({steps_done} steps of {replicas_before} replicas) "
                      f"at step {step + 1} of {replicas}")

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
        """This worker's share of ``dataset``'s batches: every batch once over all replicas."""
        return self._batches([dataset], epoch, train=False)

    def _batches(self, datasets, epoch: int, *, train: bool, while_waiting=None) -> EpochBatches:
        # random_seed_offset: every replica walks its own copy (also with one replica per worker);
        # shard, and always for evaluation: one order, dealt to the replicas of all workers in turn.
        own_copies = train and self.options.dataset_distribution == "random_seed_offset"
        if self.shared_producer and train:  # it makes all replicas' batches and hands each worker its own
            ours = range(self.num_replicas)
        else:
            ours = range(self.first_replica, self.first_replica + self.local_replicas)
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
            batches = self.producer.epoch(**what, templates=template_shapes(self.extern_data, self.data_keys),
                                          while_waiting=while_waiting)
        else:
            batches = EpochBatches(datasets, extern_data=self.extern_data, prefetch=self.options.data_prefetch, **what)
        batches.limit_steps(min(self.workers.all_workers(batches.num_steps)))
        return batches

    def xla_counters(self) -> Optional[dict]:
        """With buckets (XLA): the padded and total frames and the dropped sequences since the last
        call; None without."""
        return self.batching.take_counters() if isinstance(self.batching, BucketBatching) else None

    def close(self):
        """Ends the producer process, if there is one."""
        if self.producer:
            self.producer.close()
