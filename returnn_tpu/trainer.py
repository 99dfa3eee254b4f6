"""The training loop: epochs, steps, learning-rate control, checkpoints, dev scores.

Each decision has its own owner, which the loop asks: the network an epoch trains and its steps
:mod:`returnn_tpu.returnn_side.current_network`, an epoch's batches :mod:`returnn_tpu.datapath.epochs`, when and how the
copies are combined the strategy's syncs (:func:`returnn_tpu.strategies.make_syncs`), the
checkpoints :mod:`returnn_tpu.checkpoints`, whether a run stops :mod:`returnn_tpu.faults` and what
a stop saves and says :mod:`returnn_tpu.stops`, what is reported :mod:`returnn_tpu.reporting`.
The copies are combined before every checkpoint and dev evaluation; worker 0 alone writes files.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional, Tuple

import returnn_tpu
from returnn_tpu import checkpoints, xla
from returnn_tpu.cluster import Cluster
from returnn_tpu.returnn_side.current_network import CurrentNetwork
from returnn_tpu.datapath.epochs import EpochData
from returnn_tpu.errors import ConfigError
from returnn_tpu.faults import NONFINITE_CHECK_STEPS, PEER_LOSS_ERRORS, NonFiniteMonitor
from returnn_tpu.returnn_side.networks import EpochNetworks, learning_rate_control
from returnn_tpu.optimizers import optimizer_from_config
from returnn_tpu.options import DistributeOptions
from returnn_tpu.reporting import EpochReport, EpochStats, ScoreAccumulator, StepProgress, evaluate
from returnn_tpu.returnn_side.returnn_bridge import NetworkBuilder
from returnn_tpu.strategies import make_strategy, make_syncs
from returnn_tpu.startup import check_config
from returnn_tpu.stops import RunStops
from returnn_tpu.workers import WorkerCollectives


class Trainer:
    """Trains the network of a RETURNN config with the configured distribution strategy.

    ``config_source``: the config file and its ``++`` overrides, from which the data producer
    process loads the same config (without: data on a thread). ``checked``: the command line
    has checked the config (:func:`returnn_tpu.startup.check_config`) and made its ``optimizer``."""

    def __init__(self, config, options: DistributeOptions, cluster: Optional[Cluster] = None,
                 config_source: Optional[Tuple[str, List[str]]] = None, checked: bool = False, optimizer=None):
        from returnn.log import log

        if not checked:  # a trainer made from a Config object: as the command line checks it
            check_config(config)
        self.config = config
        self.learning_rate_control = learning_rate_control(config)  # bad input found before anything starts
        self.options = options
        self.log = log
        self.cluster = cluster or Cluster("local", None)
        self.strategy = make_strategy(options, self.cluster)
        self.workers = WorkerCollectives(self.strategy, self.cluster.worker_index)
        self.syncs = make_syncs(options, self.strategy, num_workers=self.cluster.num_workers,
                                any_worker=self.workers.any)
        self.networks = EpochNetworks(config)
        self.builder = NetworkBuilder(config, net_dict=self.networks.net_dict(1))
        self.optimizer = optimizer or optimizer_from_config(config)  # its variables come with the network
        # Two counts: batches (RETURNN's global train step, what `dynamic_learning_rate` and the
        # learning_rate_file's global_train_step see) and updates (the optimizer's step, what
        # param_sync_step and the checkpoint's global_step count); they differ with
        # accum_grad_multiple_step, which makes one update of every batches_per_update batches.
        self.batches_per_update = max(1, config.int("accum_grad_multiple_step", 1))
        self.batches_trained = 0
        devices = self.strategy.extended.worker_devices
        self.data = EpochData(config, options, self.cluster, self.workers, local_replicas=len(devices),
                              num_replicas=self.strategy.num_replicas_in_sync, first_replica=self.workers.first_replica,
                              config_source=config_source, accelerators=any("CPU" not in d.upper() for d in devices))
        if options.jit_compile:
            xla.prepare_config(config)
        self.network = CurrentNetwork(
            config, options, self.strategy, networks=self.networks, builder=self.builder, optimizer=self.optimizer,
            syncs=self.syncs, workers=self.workers, data=self.data, learning_rate_control=self.learning_rate_control,
            batches_per_update=self.batches_per_update, worker_index=self.cluster.worker_index, log=log,
        )
        self.exp_loss = config.bool("calculate_exp_loss", False)
        self.num_epochs = config.int("num_epochs", 5)
        self.checkpoints = checkpoints.RunCheckpoints(
            config, self.networks, self.builder, self.optimizer, self.syncs, num_epochs=self.num_epochs,
            num_replicas=self.strategy.num_replicas_in_sync, worker_index=self.cluster.worker_index, log=log)
        self.report = EpochReport(
            config, log, self.learning_rate_control, model_filename=self.checkpoints.model_filename,
            chief=self.cluster.is_chief, static_fields={
                "strategy": options.strategy, "num_workers": self.cluster.num_workers,
                "num_replicas": self.steps.num_replicas, "distribute_options": options.in_force()})
        self.learning_rate = 0.0  # of the epoch being trained (SlowMo's outer step scales by it)
        self.nonfinite = NonFiniteMonitor(self.workers, skip=options.skip_nonfinite_steps,
                                          num_workers=self.cluster.num_workers, log=log,
                                          stop_on_nonfinite_score=config.bool("stop_on_nonfinite_train_score", True))
        self.stops = RunStops(options, self.checkpoints, self.syncs, self.workers, self.network,
                              num_workers=self.cluster.num_workers, epoch_name=self.epoch_name, log=log)
        self._stepped = False  # whether this process has made a train step
        self._resume_prefix: Optional[str] = None  # the checkpoint to restore once the variables exist

    @property
    def updates_done(self) -> int:
        """Updates applied since the run began (the optimizer's step, counted on the host)."""
        return self.batches_trained // self.batches_per_update

    @property
    def steps(self):
        """The compiled steps of the current network (:class:`returnn_tpu.returnn_side.steps.ReplicaSteps`)."""
        return self.network.steps

    # ---- building and resuming ---------------------------------------------------------------

    def _build(self, step_batches: List, stats: Optional[EpochStats] = None):
        """Creates all variables and traces the train step (its seconds counted in ``stats``);
        restores the checkpoint when resuming; then one model on every replica."""
        start = time.perf_counter()
        with self.stops.lock:
            self.network.build(step_batches)
            if self._resume_prefix:
                self.checkpoints.restore(self._resume_prefix)
                self._resume_prefix = None
                self.batches_trained = int(self.optimizer.step.numpy()) * self.batches_per_update
                self.network.created_in_epoch = 0
            self.syncs.at_network_start()
            point = self.checkpoints.last_sync  # marked at the epoch's start; a restore changed the update count
            if point:
                self.checkpoints.synced(point.epoch, point.steps_done, self.updates_done, point.data)
        if stats:
            stats.trace_seconds += time.perf_counter() - start

    def evaluate(self, epoch: int) -> Dict[str, Dict[str, Dict[str, float]]]:
        """The dev scores of the (combined) model: see :func:`returnn_tpu.reporting.evaluate`."""
        return evaluate(self.steps, self.data, epoch, self.workers.sum, self.exp_loss)

    def sync(self, stats: Optional[EpochStats] = None):
        """Makes the replicas' copies one model now (local SGD; synchronous strategies' copies are
        always equal); counted in ``stats``."""
        with self.stops.lock:
            self.syncs.sync_now(self.learning_rate, stats)

    # ---- the loop ----------------------------------------------------------------------------

    def train(self):
        """Trains from where the checkpoints leave off (:meth:`RunCheckpoints.resume_point`: after
        the newest epoch's, or inside an interrupted epoch) to ``num_epochs``."""
        print(f"returnn-tpu: cluster: {self.cluster.description}", file=self.log.v2)
        start = self.checkpoints.resume_point(self.workers.all_workers)
        if start.epoch > self.num_epochs:
            print(f"nothing to do: training is at epoch {start.epoch}, num_epochs is {self.num_epochs}",
                  file=self.log.v1)
            return
        where = f"epoch {start.epoch}" + (f", step {start.first_step + 1} (interrupted there)"
                                          if start.interrupted else "")
        for line in [f"strategy {self.options.strategy}, {self.cluster.num_workers} workers, {self.steps.num_replicas} "
                     f"replicas, start training at {where}", *self.start_notes()]:
            print(f"returnn-tpu: {line}", file=self.log.v2)
        self.network.created_in_epoch = start.epoch - 1
        self._resume_prefix = start.prefix
        first_step, replicas_before, streams = start.first_step, start.replicas_before, start.data
        try:
            for epoch in range(start.epoch, self.num_epochs + 1):
                self.train_epoch(epoch, first_step, replicas_before, streams)
                first_step, streams = 0, None
        except PEER_LOSS_ERRORS as exc:
            if self.cluster.num_workers == 1 or not self.network.built:
                raise
            raise self.stops.after_peer_loss(exc) from exc
        finally:
            self.close()
        if self.cluster.is_chief:
            logs, done = ", ".join(self.config.list("log", [])) or "stdout only", self.syncs.sync_stats
            print(f"returnn-tpu: finished training at epoch {self.num_epochs}: model "
                  f"{self.checkpoints.epoch_filename(self.num_epochs)}, log {logs}, metrics {self.report.metrics_path}; "
                  f"this process: {done['updates']} updates, {done['syncs']} syncs, {done['bytes'] / 1e6:.3f} MB sent",
                  file=self.log.v1)

    def start_notes(self) -> List[str]:
        """What a user should know before the first step: the options in force, and what the syncs
        and the epoch's data say (a local SGD of one replica, settings known to overshoot, what an
        epoch is with several replicas)."""
        return ([f"distribute_options in force: {self.options.in_force()}"] + self.report.changes_since_the_last_run()
                + self.syncs.start_notes(self.options.strategy, self.steps.num_replicas) + self.data.start_notes())

    def initialize_model(self):
        """RETURNN's ``task = "initialize_model"``: the initial parameters of epoch 1's network,
        written to ``model`` (no epoch suffix), as RETURNN writes them."""
        try:
            self.network.use_epoch(1)
            step_batches, _ = next(iter(self.data.train_batches(1)))
            self._build(step_batches)
            self.checkpoints.save_model()
        finally:
            self.close()

    def close(self):
        """Ends the dataset producer process, if there is one, and the signal watch."""
        self.stops.close()
        self.data.close()

    def train_step(self, step_batches: List, learning_rate: float, stats: Optional["EpochStats"] = None,
                   at: Optional[Tuple[int, int]] = None):
        """One training step on one batch per local replica, then a local-SGD sync if one is due
        (in the step itself on the in-step path); returns the step's per-replica metrics. ``at``:
        the epoch and the index of this step in it; a sync of all workers marks the point after it
        as the one a lost worker sends the run back to (:meth:`RunCheckpoints.synced`)."""
        stats = stats or EpochStats()
        if not self.network.built:
            self._build(step_batches, stats)
            if self.batches_trained == 0:
                self.checkpoints.save_initial()
        stats.steps += 1
        self.batches_trained += 1
        if self.batches_trained % self.batches_per_update:  # RETURNN applies on every N-th global step
            return self.steps.accumulate(step_batches)
        self.learning_rate = learning_rate
        due = self.syncs.due()
        in_step = due and self.syncs.updates_in_replica  # the step itself syncs
        with self.stops.lock if in_step else contextlib.nullcontext():
            metrics = self.steps.train(step_batches, learning_rate, due)
        with self.stops.lock:
            if self.syncs.after_update(due, learning_rate, stats) and at:
                self.checkpoints.synced(at[0], at[1] + 1, self.updates_done, self.data.stream_points(at[1] + 1))
        return metrics

    def train_epoch(self, epoch: int, first_step: int = 0, replicas_before: Optional[int] = None,
                    streams: Optional[dict] = None):
        """One epoch from step ``first_step`` (after an interruption there, of ``replicas_before``
        replicas if not as many as now, its data ``streams`` where they stood then): train steps
        with periodic syncs, final sync, checkpoint, dev scores, logs."""
        self.network.use_epoch(epoch)
        learning_rate = self.networks.learning_rate(epoch, self.learning_rate_control)
        print(f"start epoch {epoch} with learning rate {learning_rate} ...", file=self.log.v4)
        scores = ScoreAccumulator(self.strategy, self.exp_loss)
        stats = EpochStats()
        prefix = ("pre" if self.networks.is_pretrain_epoch(epoch) else "") + f"train epoch {epoch}"  # RETURNN's
        progress = StepProgress(self.log, prefix, self.exp_loss) if self.log.verbose[5] else None
        start = time.perf_counter()
        batches = self.data.train_batches(epoch, while_waiting=lambda: self.stops.while_waiting(epoch))
        first_step, note = self.data.continue_epoch(batches, first_step, replicas_before, streams)
        if note:
            print(f"returnn-tpu: epoch {epoch} {note}", file=self.log.v2)
        self.checkpoints.synced(epoch, first_step, self.updates_done, streams)  # the copies are one model here
        stats.data_start_seconds = batches.start_seconds
        waited_since = start  # starting the epoch's data is waiting for data too
        for step, (step_batches, _) in batches.steps(self.steps.on_device):
            self.stops.at_step_boundary(epoch, step, stats.mean_step_seconds, stepped=self._stepped,
                                        one_model=lambda: self._one_model(epoch, stats),
                                        streams=self.data.stream_points)
            step_start = time.perf_counter()
            stats.data_wait_seconds += step_start - waited_since
            metrics = self.train_step(step_batches, learning_rate, stats, at=(epoch, step))
            if not self._stepped:  # the process's first step: what starting took, as the user waited
                stats.startup_seconds, self._stepped = time.perf_counter() - returnn_tpu.STARTED, True
            scores.add(metrics)
            stats.step_seconds += time.perf_counter() - step_start
            if (step + 1) % NONFINITE_CHECK_STEPS == 0:
                self.check_nonfinite(epoch, stats)
            if progress:
                progress.step(step, self.data.steps_expected, self.steps.local_sums(metrics),
                              time.perf_counter() - step_start)
            waited_since = time.perf_counter()
        stats.add_agreements(batches.agreements, batches.agree_seconds, batches.agree_bytes)
        self.data.steps_expected = batches.steps_done
        if batches.steps_done == 0:
            raise ConfigError(f"train: epoch {epoch} has no batch for every replica (too few sequences, or all "
                              "longer than max_seq_length); check the dataset and batching options")
        if not self.network.built:  # continued at the epoch's end (the model of its last sync): no step ran
            self._build(self.data.placeholder_step())
        self.check_nonfinite(epoch, stats)  # before the sync: no replica's copy is non-finite
        with self.stops.lock:
            self.syncs.at_epoch_end(learning_rate, stats)
            self.checkpoints.synced(epoch, batches.steps_done, self.updates_done,
                                    self.data.stream_points(batches.steps_done))
        stats.seconds = time.perf_counter() - start
        scores.combine(self.workers.sum)
        self.nonfinite.check_score(scores.score(), self.epoch_name(epoch))
        print(f"epoch {epoch}: parameter checksum {self.steps.parameter_checksum():.9g}", file=self.log.v2)
        dev_results = self.evaluate(epoch)
        figures = xla.epoch_figures(self.data, self.steps)
        if figures:
            print(xla.log_line(epoch, figures, self.data.bucket_boundaries), file=self.log.v2)
        self.report.record(epoch, self.epoch_name(epoch), scores, dev_results, stats, learning_rate,
                           global_step=int(self.optimizer.step.numpy()),
                           first_global_step=self.batches_trained - stats.steps, extra=figures)
        # The checkpoint last: a run resumes after the newest checkpoint, so an epoch whose dev
        # evaluation or record failed (a dataset that raises, a full disk) is trained again, and
        # learning_rate_file and metrics.jsonl never miss an epoch that has a checkpoint.
        self.stops.within_grace(stats.mean_step_seconds,
                                lambda: self.checkpoints.save_epoch(epoch, self.learning_rate_control))

    def _one_model(self, epoch: int, stats: EpochStats):
        """Before an interrupted epoch's checkpoint: no replica's copy is non-finite, and all are one model."""
        self.check_nonfinite(epoch, stats)
        self.sync(stats)

    def check_nonfinite(self, epoch: int, stats: EpochStats):
        """Stops (or, with ``skip_nonfinite_steps``, counts) updates whose loss or gradient was NaN
        or Inf in any replica (:class:`returnn_tpu.faults.NonFiniteMonitor`)."""
        if self.network.built:
            stats.skipped_nonfinite += self.nonfinite.check(self.steps, self.epoch_name(epoch))

    def epoch_name(self, epoch: int) -> str:
        """``"epoch 3"``, or ``"pretrain epoch 1"``, as RETURNN names epochs in its log."""
        return ("pretrain " if self.networks.is_pretrain_epoch(epoch) else "") + f"epoch {epoch}"
