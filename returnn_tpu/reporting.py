"""What a run reports: RETURNN's epoch scores, its log lines, ``learning_rate_file``,
``metrics.jsonl`` and TensorBoard summaries.

:class:`ScoreAccumulator` sums RETURNN's per-batch costs, errors and frame counts and gives the
epoch scores as RETURNN's runner computes them; :class:`EpochReport` writes one epoch's results
everywhere they go (the chief alone writes files); :class:`StepProgress` is RETURNN's per-step
line at ``log_verbosity >= 5``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Callable, Dict, List, Optional

import numpy
import tensorflow as tf

from returnn_tpu.errors import write_failure_status

METRICS_FILE = "metrics.jsonl"


class RecordWriteError(RuntimeError):
    """An epoch's record (``learning_rate_file``, ``metrics.jsonl``) could not be written; names the file
    and why. The epoch's checkpoint is written after its record, so a continued run trains it again."""

    def __init__(self, path: str, epoch: int, exc: OSError):
        try:
            free = f"{shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free / 1e6:.1f} MB free there"
        except OSError:
            free = "its folder not readable"
        super().__init__(f"could not write {path} ({free}): {exc.strerror or exc}; epoch "
                         f"{epoch} is trained again when the run is continued")
        self.status = write_failure_status(exc)  # the exit status


@dataclasses.dataclass
class EpochStats:
    """Counts of one epoch for the log and ``metrics.jsonl``."""

    steps: int = 0
    seconds: float = 0.0
    syncs: int = 0  # local SGD: syncs between all replicas (a fragment's sync counts as one)
    local_syncs: int = 0  # hierarchical averaging: syncs within each worker
    sync_seconds: float = 0.0
    sync_bytes: int = 0  # what this worker handed to collectives between replicas (syncs or gradients)
    skipped_nonfinite: int = 0  # updates not applied: NaN/Inf loss or gradient (skip_nonfinite_steps)
    step_seconds: float = 0.0  # in the train steps (syncs included): RETURNN's "computing time"
    data_wait_seconds: float = 0.0  # waiting for the next batch
    data_start_seconds: float = 0.0  # RETURNN's init_seq_order of the epoch (in the producer, if there is one)
    agreements: int = 0  # several workers: exchanges of where the epoch ends (epochs.TrainEpoch)
    agree_seconds: float = 0.0
    agree_bytes: int = 0  # what this worker handed to those exchanges
    trace_seconds: float = 0.0  # building the network and tracing the train step (at the start, at a network change)
    startup_seconds: Optional[float] = None  # the process's first epoch: from its start to the first step's end

    @property
    def mean_step_seconds(self) -> float:
        return self.step_seconds / self.steps if self.steps else 0.0

    @property
    def computing_time_share(self) -> float:
        return self.step_seconds / self.seconds if self.seconds > 0 else 0.0

    def add_agreements(self, count: int, seconds: float, sent_bytes: int):
        self.agreements += count
        self.agree_seconds += seconds
        self.agree_bytes += sent_bytes


class ScoreAccumulator:
    """Sums RETURNN's per-batch costs, errors and frame counts; gives RETURNN's epoch scores.

    Steps leave this worker's replicas' values on the device (no read-back to the host, no
    communication per step); every :data:`FOLD_STEPS` steps they are summed there, in float64, with
    two ops per key and replica (two eager ops per key and replica and step cost about 0.6 ms of
    a step's Python here: docs/measured.md, "Corpora at scale"); :meth:`combine` reads the sums
    once and adds up all workers' sums, at the end of the epoch.
    """

    FOLD_STEPS = 64

    def __init__(self, strategy: tf.distribute.Strategy, exp_loss: bool = False):
        self.strategy = strategy
        self.exp_loss = exp_loss  # RETURNN's calculate_exp_loss: also exp(score) (perplexity)
        self.device_sums: Dict[str, list] = {}  # key -> running sum per local replica (device tensors)
        self.pending: Dict[str, list] = {}  # key -> per step not yet summed, its values per local replica
        self.sums: Dict[str, float] = {}  # after combine: over all replicas of all workers

    def add(self, metrics: Dict[str, tf.Tensor]):
        """Adds per-replica step metrics (see :func:`loss_metrics`), each on its replica's device."""
        for key, value in metrics.items():
            self.pending.setdefault(key, []).append(self.strategy.experimental_local_results(value))
        if max(map(len, self.pending.values()), default=0) >= self.FOLD_STEPS:
            self._fold()

    def _fold(self):
        """The pending steps' values added to the running sums, on each replica's device."""
        for key, steps in self.pending.items():
            folded = []
            for values in zip(*steps):  # one replica's values over the pending steps
                with tf.device(values[0].device):
                    folded.append(tf.reduce_sum(tf.cast(tf.stack(values), tf.float64)))
            running = self.device_sums.get(key)
            self.device_sums[key] = folded if running is None else [a + b for a, b in zip(running, folded)]
        self.pending = {}

    def combine(self, sum_over_workers: Callable[[List[float]], List[float]]):
        """Reads the sums back (once) and adds them up over the workers."""
        self._fold()
        keys = sorted(self.device_sums)
        local = [float(sum(value.numpy() for value in self.device_sums[key])) for key in keys]
        self.sums = dict(zip(keys, sum_over_workers(local)))

    def _normalized(self, prefix: str) -> Dict[str, float]:
        out = {}
        for key, value in self.sums.items():
            if key.startswith(prefix):
                frames = self.sums.get("frames:" + key[len(prefix) :], 0.0)
                out[key] = value / frames if frames else float("nan")
        return out

    def score(self) -> Dict[str, float]:
        """``{"cost:<loss>": score}`` (and ``"cost:<loss>:exp"``), as RETURNN's runner reports it."""
        scores = self._normalized("cost:")
        if self.exp_loss:
            scores.update({f"{key}:exp": float(numpy.exp(value)) for key, value in list(scores.items())})
        return scores

    def error(self) -> Dict[str, float]:
        """``{"error:<loss>": error}`` (frame error rate)."""
        return self._normalized("error:")


class StepProgress:
    """RETURNN's per-step progress line at ``log_verbosity >= 5``, in RETURNN's format:
    ``train epoch 1, step 0, cost:output 0.69, error:output 0.5, 0.123 sec/step, elapsed ...``
    (this worker's replicas; every step reads its metrics back, as RETURNN's session run does)."""

    def __init__(self, log, prefix: str, exp_loss: bool = False):
        self.log = log
        self.prefix = prefix
        self.exp_loss = exp_loss
        self.start = time.time()

    def step(self, step: int, num_steps: Optional[int], sums: Dict[str, float], seconds: float):
        """Step ``step``'s line; ``num_steps``: the epoch's expected steps (the last epoch's; None
        in the first, where only the elapsed time is shown)."""
        from returnn.util.basic import hms

        info = {}
        for key, value in sums.items():
            if key.startswith(("cost:", "error:")):
                frames = sums.get("frames:" + key.split(":", 1)[1], 0.0)
                info[key] = value / frames if value and frames else value
                if self.exp_loss and key.startswith("cost:"):
                    info[key + ":exp"] = float(numpy.exp(info[key]))
        elapsed = time.time() - self.start
        parts = [self.prefix, f"step {step}"] + [f"{k} {v}" for k, v in sorted(info.items())] + [
            f"{seconds:.3f} sec/step",
            f"elapsed {hms(elapsed)}",
        ]
        if num_steps:
            complete = min((step + 1) / num_steps, 1.0)
            parts += [f"exp. remaining {hms(elapsed / complete - elapsed)}", f"complete {complete * 100:.02f}%"]
        print(", ".join(parts), file=self.log.v5)


def process_threads() -> Optional[int]:
    """Threads of this process, TensorFlow's included (Linux: /proc; elsewhere None)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return None


def strict_json(value):
    """``value`` with NaN and Inf numbers replaced by None, which JSON can hold."""
    if isinstance(value, dict):
        return {key: strict_json(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    if isinstance(value, float) and not numpy.isfinite(value):
        return None
    return value


def format_score(score: Dict[str, float]) -> str:
    """RETURNN's formatting: the bare number for one loss, else ``name value`` pairs."""
    if not score:
        return "None"
    if len(score) == 1:
        return str(next(iter(score.values())))
    return " ".join(f"{key.split(':', 1)[-1]} {score[key]}" for key in sorted(score))


def single_or_dict(values: Dict[str, float]):
    """One loss: its value; several: ``{loss_name: value}`` (as RETURNN names them in the LR file)."""
    if len(values) == 1:
        return next(iter(values.values()))
    return {key.split(":", 1)[-1]: value for key, value in values.items()} or None


class EpochReport:
    """Writes the results of each epoch: RETURNN's log lines, the learning-rate file (RETURNN's
    ``LearningRateControl``), ``metrics.jsonl`` beside the checkpoints, and TensorBoard scalars.

    TensorBoard: as RETURNN, under ``tf_log_dir`` (default: the model's folder), in ``train-<time>``
    for the run and ``<dataset>-<epoch>-<time>`` per evaluation, with RETURNN's tag names
    (``loss_<name>``, ``error_<name>``) plus ``learning_rate`` and ``sync_seconds``; one point per
    epoch at the global step (RETURNN writes one per step).

    :param chief: whether this worker writes files (the others only log).
    :param static_fields: fields every ``metrics.jsonl`` record starts with (strategy, sizes).
    """

    def __init__(self, config, log, learning_rate_control, *, model_filename: str, chief: bool, static_fields: dict):
        from returnn.util.basic import get_utc_start_time_filename_part

        self.log = log
        self.learning_rate_control = learning_rate_control
        self.chief = chief
        self.static_fields = static_fields
        model_dir = os.path.dirname(os.path.abspath(model_filename))
        self.metrics_path = os.path.join(model_dir, METRICS_FILE)
        self.tf_log_dir = config.value("tf_log_dir", None) or model_dir
        self.start_time = get_utc_start_time_filename_part()
        self._train_writer = None

    def record(self, epoch: int, epoch_name: str, scores: "ScoreAccumulator", dev_results: Dict[str, dict],
               stats: "EpochStats", learning_rate: float, global_step: int, first_global_step: int,
               extra: Optional[dict] = None):
        """Logs and writes one epoch; ``dev_results`` maps a dataset name to its score and error dicts.
        ``global_step`` counts updates at the end of the epoch, ``first_global_step`` RETURNN's global
        train step (batches) at its start."""
        from returnn.util.basic import hms

        train_score, train_error = scores.score(), scores.error()
        errors = {"train_score": train_score, "train_error": train_error}
        for name, result in dev_results.items():
            errors[f"{name}_score"] = result["score"]
            errors[f"{name}_error"] = result["error"]
        self.learning_rate_control.set_epoch_error(epoch, {k: v for k, v in errors.items() if v})
        # RETURNN's ":meta:" entries of the epoch (its engine's names; the global step at the start).
        self.learning_rate_control.epoch_data[epoch].meta.update(
            {"global_train_step": first_global_step, "effective_learning_rate": learning_rate,
             "epoch_num_train_steps": stats.steps, "epoch_train_time_secs": round(stats.seconds)})
        train_prefix = ("pre" if epoch_name.startswith("pretrain") else "") + f"train epoch {epoch}"
        print(f"{train_prefix}, finished after {stats.steps} steps, {hms(stats.seconds)} elapsed "
              f"({100 * stats.computing_time_share:.1f}% computing time)", file=self.log.v3)  # RETURNN's line
        # Not in the process's first epoch (startup_seconds set): the producer's start is waited for.
        if stats.startup_seconds is None and stats.data_wait_seconds > 0.05 * stats.seconds:
            print(f"{train_prefix}: {stats.data_wait_seconds:.1f} s waiting for data, {stats.step_seconds:.1f} s in "
                  "its steps: the dataset is slower than the training", file=self.log.v3)
        print(f"{epoch_name} score: {format_score(train_score)} error: {format_score(train_error)} "
              f"elapsed: {hms(stats.seconds)}", file=self.log.v1)
        if dev_results:
            print(" ".join(f"{name}: score {format_score(r['score'])} error {format_score(r['error'])}"
                           for name, r in dev_results.items()), file=self.log.v1)
        local_syncs = f" (+{stats.local_syncs} within workers)" if stats.local_syncs else ""
        print(f"epoch {epoch}: {stats.steps} steps, {stats.seconds:.2f} s, {stats.syncs} syncs{local_syncs}, "
              f"{stats.sync_seconds:.3f} s in sync, {stats.sync_bytes / 1e6:.3f} MB sent", file=self.log.v2)
        if not self.chief:
            return  # the chief alone writes the learning-rate file, metrics and summaries
        try:
            self.learning_rate_control.save()
        except OSError as exc:  # e.g. a full disk; RETURNN leaves its temporary file behind
            raise RecordWriteError(self.learning_rate_control.filename, epoch, exc) from None
        record = dict(self.static_fields, epoch=epoch, steps=stats.steps, learning_rate=learning_rate,
                      train_score=single_or_dict(train_score), train_error=single_or_dict(train_error),
                      seconds=round(stats.seconds, 3), syncs=stats.syncs, local_syncs=stats.local_syncs,
                      sync_seconds=round(stats.sync_seconds, 4), sync_bytes=stats.sync_bytes,
                      skipped_nonfinite_updates=stats.skipped_nonfinite, threads=process_threads(),
                      computing_time_share=round(stats.computing_time_share, 4),
                      data_wait_seconds=round(stats.data_wait_seconds, 3),
                      data_start_seconds=round(stats.data_start_seconds, 3),
                      agreements=stats.agreements, agree_seconds=round(stats.agree_seconds, 4),
                      agree_bytes=stats.agree_bytes,
                      trace_seconds=round(stats.trace_seconds, 3))
        if stats.startup_seconds is not None:
            record["startup_seconds"] = round(stats.startup_seconds, 3)
        record.update(extra or {})
        for name, result in dev_results.items():
            record[f"{name}_score"] = single_or_dict(result["score"])
            record[f"{name}_error"] = single_or_dict(result["error"])
        try:
            self._write_metrics(epoch, json.dumps(strict_json(record), allow_nan=False))
        except OSError as exc:
            raise RecordWriteError(self.metrics_path, epoch, exc) from None
        self._summaries(epoch, scores, dev_results, stats, learning_rate, global_step)

    def changes_since_the_last_run(self) -> List[str]:
        """What a resumed run changes against the newest epoch in ``metrics.jsonl`` that a user
        should hear of: the number of workers or replicas (the epoch's data is dealt anew, the
        steps per epoch change) and the distribute options (e.g. ``sync_dtype``: another rounding
        of the syncs, residuals of the old one dropped)."""
        try:
            with open(self.metrics_path) as f:
                last = json.loads([line for line in f.read().splitlines() if line.strip()][-1])
        except (OSError, IndexError, ValueError):
            return []  # no earlier run (or its record unreadable: nothing to compare)
        notes = []
        for key in ("strategy", "num_workers", "num_replicas"):
            if key in last and last[key] != self.static_fields.get(key):
                notes.append(f"resuming with {key} {self.static_fields.get(key)!r}; epoch {last['epoch']} was trained "
                             f"with {last[key]!r}")
        before = last.get("distribute_options") or {}
        now = json.loads(json.dumps(self.static_fields.get("distribute_options") or {}))  # as recorded: lists
        for key in sorted(set(before) | set(now)):
            if key not in ("num_replicas", "time_limit", "stop_before_time_limit") and before.get(key) != now.get(key):
                notes.append(f"resuming with distribute_options[{key!r}] = {now.get(key)!r}; epoch {last['epoch']} "
                             f"was trained with {before.get(key)!r}")
        return notes

    def _write_metrics(self, epoch: int, line: str):
        """Appends ``line``; records of this epoch or later (of an epoch trained again because its
        checkpoint was not written) are replaced, atomically, so each epoch has one record."""
        kept = []
        if os.path.exists(self.metrics_path):
            with open(self.metrics_path) as f:
                kept = [old for old in f.read().splitlines() if old.strip() and json.loads(old)["epoch"] < epoch]
        tmp = f"{self.metrics_path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                f.write("".join(old + "\n" for old in kept) + line + "\n")
            os.replace(tmp, self.metrics_path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def _summaries(self, epoch, scores, dev_results, stats, learning_rate, global_step):
        if self._train_writer is None:
            self._train_writer = tf.summary.create_file_writer(os.path.join(self.tf_log_dir, f"train-{self.start_time}"))
        with self._train_writer.as_default():
            _write_scalars(scores.score(), scores.error(), global_step)
            _scalar("learning_rate", learning_rate, global_step)
            _scalar("sync_seconds", stats.sync_seconds, global_step)
        self._train_writer.flush()
        for name, result in dev_results.items():
            writer = tf.summary.create_file_writer(os.path.join(self.tf_log_dir, f"{name}-{epoch}-{self.start_time}"))
            with writer.as_default():
                _write_scalars(result["score"], result["error"], global_step)
            writer.close()


def _write_scalars(score: Dict[str, float], error: Dict[str, float], step: int):
    """RETURNN's summary names: ``loss_<name>`` and ``error_<name>`` (normalized per frame)."""
    for key, value in score.items():
        _scalar("loss_" + key.split(":", 1)[1].replace("/", "_"), value, step)
    for key, value in error.items():
        _scalar("error_" + key.split(":", 1)[1].replace("/", "_"), value, step)


_SCALAR_METADATA = tf.compat.v1.SummaryMetadata(
    plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars")
).SerializeToString()


def _scalar(tag: str, value: float, step: int):
    """A TensorBoard scalar through TensorFlow's own summary op (``tensorflow-cpu`` has no
    TensorBoard package, whose ``tf.summary.scalar`` this would otherwise need)."""
    tf.summary.write(tag, tf.constant(value, tf.float32), step=step, metadata=_SCALAR_METADATA)


def evaluate(steps, data, epoch: int, sum_over_workers: Callable[[List[float]], List[float]],
             exp_loss: bool) -> Dict[str, Dict[str, Dict[str, float]]]:
    """RETURNN's scores of the current (combined) model on each eval dataset of ``data``
    (:class:`returnn_tpu.datapath.epochs.EpochData`): ``{"dev": {"score": .., "error": ..}}``.

    Every batch is evaluated exactly once, spread over all replicas of all workers by ``steps``
    (:class:`returnn_tpu.returnn_side.steps.ReplicaSteps`); the sums are combined with ``sum_over_workers``.
    """
    results = {}
    for dataset in data.dev_datasets:
        scores = ScoreAccumulator(steps.strategy, exp_loss)
        for step_batches, weights in steps.on_device(data.eval_batches(dataset, epoch)):
            scores.add(steps.evaluate(step_batches, weights))
        scores.combine(sum_over_workers)
        results[dataset.name] = {"score": scores.score(), "error": scores.error()}
    return results
