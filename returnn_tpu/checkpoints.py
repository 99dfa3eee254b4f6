"""Checkpoints in RETURNN's format, written atomically.

A checkpoint is a TF name-based bundle (``model.NNN.index`` and ``model.NNN.data-00000-of-00001``)
whose keys are the variables' TF1 names, exactly as RETURNN's ``Saver`` writes them, so plain
RETURNN loads it (``TFNetwork.load_params_from_file``) for forwarding or search.

The bundle is first written under a temporary prefix and then renamed, data file first and index
last. RETURNN looks for the ``.index`` file, so a crash at any point leaves either the previous
state or a complete checkpoint, never a half one. A ``model.NNN.meta`` file follows: RETURNN's
``load`` and ``import_model_train_epoch1`` accept a checkpoint only where that file exists
(FACTS.md, "Plain RETURNN on TF 2.21"); it holds an empty graph, which RETURNN does not read.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import re
import shutil
import threading
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional

import numpy
import tensorflow as tf

from returnn_tpu.errors import ConfigError, write_failure_status


def save(prefix: str, variables: Mapping[str, tf.Variable]):
    """Writes ``variables`` (name -> variable) as the bundle ``prefix``; never a non-finite model
    (:class:`NonFiniteModel` instead).

    For distributed variables the value seen in cross-replica context is written; for local SGD,
    average the replicas first, so that the checkpoint holds the averaged model.
    """
    names = sorted(variables)
    tensors = [tf.convert_to_tensor(variables[name]) for name in names]
    for name, tensor in zip(names, tensors):
        if tensor.dtype.is_floating and not bool(tf.reduce_all(tf.math.is_finite(tensor))):
            raise NonFiniteModel(f"not writing checkpoint {prefix}: {name!r} holds NaN or Inf values")
    tmp_prefix = f"{prefix}{TMP_MARK}{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        tf.raw_ops.SaveV2(
            prefix=tmp_prefix,
            tensor_names=names,
            shape_and_slices=[""] * len(names),
            tensors=tensors,
        )
        with open(tmp_prefix + ".meta", "wb") as file:
            file.write(_META_GRAPH)
        data_suffix = ".data-00000-of-00001"
        os.replace(tmp_prefix + data_suffix, prefix + data_suffix)
        os.replace(tmp_prefix + ".index", prefix + ".index")
        os.replace(tmp_prefix + ".meta", prefix + ".meta")
    except (tf.errors.OpError, OSError) as exc:
        for path in glob.glob(glob.escape(tmp_prefix) + "*"):
            try:
                os.remove(path)
            except OSError:
                pass  # the next start removes it (remove_stale_temporaries)
        raise CheckpointWriteError.of(prefix, exc) from None


TMP_MARK = ".tmp-"  # <prefix>.tmp-<pid>.*: a bundle being written by process <pid>
_META_GRAPH = tf.compat.v1.MetaGraphDef(
    meta_info_def=tf.compat.v1.MetaGraphDef.MetaInfoDef(
        meta_graph_version="returnn-tpu: the variables are in the .index/.data bundle",
        tensorflow_version=tf.__version__,
    )
).SerializeToString()


class NonFiniteModel(RuntimeError):
    """The model to be saved holds NaN or Inf values: it is not written."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; one line naming the path, the free space there and why.
    ``status`` is the exit status it ends the run with (:func:`returnn_tpu.errors.write_failure_status`)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status

    @classmethod
    def of(cls, prefix: str, exc: BaseException) -> "CheckpointWriteError":
        """The error for ``exc`` (an ``OSError``, or TensorFlow's error of its save op) while
        ``prefix`` was written."""
        folder = os.path.dirname(os.path.abspath(prefix))
        try:
            free = f"{shutil.disk_usage(folder).free / 1e6:.1f} MB free there"
        except OSError:
            free = "its folder not readable"
        # TensorFlow's "{{function_node ...}} <temporary file>; No space left on device [Op:SaveV2]"
        reason = re.sub(r"^\{\{.*?\}\}\s*|\s*\[Op:\w+\]$", "", _first_line(exc)).rsplit("; ", 1)[-1]
        if isinstance(exc, OSError) and exc.strerror:
            reason = exc.strerror
        return cls(f"could not write checkpoint {prefix} ({free}): {reason}", write_failure_status(exc))


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (TensorFlow's errors run to many), or its type."""
    text = str(getattr(exc, "message", exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


INTERRUPTED_MARK = ".interrupted"  # <epoch prefix>.interrupted: the model of an epoch stopped early
_EPOCH_KEY = "returnn_tpu/interrupted_epoch"
_STEPS_KEY = "returnn_tpu/interrupted_steps_done"
_REPLICAS_KEY = "returnn_tpu/interrupted_num_replicas"  # the replicas that trained those steps


class ResumePoint(NamedTuple):
    """Where a run starts: the first epoch to train, its first step (after an interruption there),
    the checkpoint to load once the variables exist (None: a fresh start), and how many replicas
    trained the steps before the first (None: as many as now)."""

    epoch: int
    first_step: int
    prefix: Optional[str]
    interrupted: bool
    replicas_before: Optional[int] = None
    data: Optional[dict] = None  # where the data streams stood there (read_stream_points)


class SyncPoint(NamedTuple):
    """Where every worker's copies were last combined: in ``epoch`` after ``steps_done`` of its
    steps, ``updates`` updates since the run began; ``data``: where this worker's data streams
    stood there (:meth:`returnn_tpu.datapath.epochs.EpochData.stream_points`)."""

    epoch: int
    steps_done: int
    updates: int
    data: Optional[dict] = None


class Interrupted(NamedTuple):
    """A checkpoint written when an epoch stopped early (a signal, a time limit, a lost worker):
    resume continues that epoch after ``steps_done`` steps, which ``num_replicas`` replicas trained
    (None in checkpoints written before that was recorded)."""

    prefix: str
    epoch: int
    steps_done: int
    num_replicas: Optional[int] = None


def save_interrupted(model_filename: str, prefix: str, variables: Mapping[str, tf.Variable], *, epoch: int,
                     steps_done: int, num_replicas: Optional[int] = None):
    """Writes ``prefix`` (an epoch's prefix + :data:`INTERRUPTED_MARK`): the model of an epoch
    stopped after ``steps_done`` steps of ``num_replicas`` replicas, with those numbers, and
    removes any older interrupted checkpoint of ``model_filename``. RETURNN's own resume ignores
    the file (its name is no epoch's); ``TFNetwork.load_params_from_file`` reads it as any
    checkpoint."""
    marks = {_EPOCH_KEY: tf.constant(epoch, tf.int64), _STEPS_KEY: tf.constant(steps_done, tf.int64)}
    if num_replicas is not None:
        marks[_REPLICAS_KEY] = tf.constant(num_replicas, tf.int64)
    save(prefix, {**variables, **marks})
    remove_interrupted(model_filename, keep=prefix)


def _interrupted_prefixes(model_filename: str):
    pattern = glob.escape(model_filename) + ".*" + INTERRUPTED_MARK + ".index"
    return [path[: -len(".index")] for path in glob.glob(pattern)]


@contextlib.contextmanager
def _exclusive(path: str):
    """Holds an exclusive lock on the file ``path`` (made if missing) and removes it afterwards.
    A process that waited for the lock while the holder removed the file reopens it, so no two
    hold it at once and no lock file is left behind."""
    while True:
        lock = open(path, "a")
        fcntl.lockf(lock, fcntl.LOCK_EX)
        try:
            current = os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        lock.close()  # removed by the holder before: the next one is made afresh
    try:
        yield
    finally:
        try:
            os.remove(path)
        finally:
            lock.close()


def interrupted(model_filename: str, start_epoch: int) -> Optional[Interrupted]:
    """The interrupted checkpoint to resume from: of an epoch at or after ``start_epoch`` (the one
    after the newest complete epoch's checkpoint); None if there is none."""
    found = []
    for prefix in _interrupted_prefixes(model_filename):
        reader = tf.train.load_checkpoint(prefix)
        replicas = int(reader.get_tensor(_REPLICAS_KEY)) if reader.has_tensor(_REPLICAS_KEY) else None
        found.append(Interrupted(prefix, int(reader.get_tensor(_EPOCH_KEY)), int(reader.get_tensor(_STEPS_KEY)),
                                 replicas))
    found = [entry for entry in found if entry.epoch >= start_epoch]
    return max(found, key=lambda entry: entry.epoch) if found else None


def remove_interrupted(model_filename: str, keep: Optional[str] = None):
    """Deletes the interrupted checkpoints of ``model_filename`` (but ``keep``): a later complete
    epoch's checkpoint, or a newer interruption, replaces them."""
    for prefix in _interrupted_prefixes(model_filename):
        if prefix != keep:
            for path in glob.glob(glob.escape(prefix) + ".*"):
                os.remove(path)


STREAMS_MARK = ".streams-worker"  # <interrupted prefix>.streams-worker<N>.json: worker N's data streams


def write_stream_points(prefix: str, worker: int, *, epoch: int, steps_done: int, streams: dict):
    """Writes, beside the interrupted checkpoint ``prefix``, where worker ``worker``'s data streams
    stood after ``steps_done`` steps of ``epoch`` (by stream: a StreamPoint, or why none), so that
    resume continues them there (docs/faults.md, "Resuming without replay"). Each worker writes
    its own file, atomically; :func:`remove_interrupted` removes them with the checkpoint."""
    path = f"{prefix}{STREAMS_MARK}{worker}.json"
    tmp = f"{prefix}{TMP_MARK}{os.getpid()}{STREAMS_MARK}{worker}.json"
    try:
        with open(tmp, "w") as file:
            json.dump({"epoch": epoch, "steps_done": steps_done, "streams": streams}, file)
        os.replace(tmp, path)
    except OSError as exc:
        raise CheckpointWriteError.of(path, exc) from None


def read_stream_points(prefix: str, epoch: int, steps_done: int) -> dict:
    """Where the data streams of all workers stood at the interrupted checkpoint ``prefix`` (after
    ``steps_done`` steps of ``epoch``): the files :func:`write_stream_points` wrote for that point,
    merged (none: an empty dict; the epoch is then continued by making what it passes over)."""
    streams = {}
    for path in sorted(glob.glob(glob.escape(prefix + STREAMS_MARK) + "*.json")):
        try:
            with open(path) as file:
                found = json.load(file)
        except (OSError, ValueError):
            continue  # unreadable: those streams replay
        if (found.get("epoch"), found.get("steps_done")) == (epoch, steps_done):
            streams.update(found.get("streams") or {})
    return streams


def remove_stale_temporaries(model_filename: str, log_file=None):
    """Deletes the temporary bundles of saves that did not finish (their process is gone)."""
    for path in glob.glob(glob.escape(model_filename) + "*" + TMP_MARK + "*"):
        match = re.search(re.escape(TMP_MARK) + r"(\d+)\.", path)
        if not match:
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # its process still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's process
        os.remove(path)
        print(f"removed {path}, left by a save that did not finish", file=log_file)


def set_aside_unreadable(newest: Callable[[], Optional[str]], log_file=None):
    """Renames the index of the newest checkpoint while it does not load, so that resume uses the
    previous complete one. ``newest()`` is the prefix of the newest checkpoint (None: none left)."""
    while True:
        prefix = newest()
        if prefix is None or _set_aside_if_unreadable(prefix, "resuming from the checkpoint before it", log_file):
            return


def set_aside_unreadable_interrupted(model_filename: str, log_file=None):
    """Renames the index of every interrupted checkpoint of ``model_filename`` that does not load:
    its epoch then starts again from the newest epoch's checkpoint."""
    for prefix in _interrupted_prefixes(model_filename):
        _set_aside_if_unreadable(prefix, "its epoch starts again from the epoch's checkpoint before it", log_file)


def _set_aside_if_unreadable(prefix: str, fallback: str, log_file) -> bool:
    """Whether the bundle ``prefix`` loads, with its marks; if not, its index is renamed to
    ``.index.unreadable`` (kept for a person to look at), with a warning that says ``fallback``."""
    try:
        load(prefix)
        return True
    except Exception as exc:  # noqa: BLE001 (any reason a bundle does not load: truncation, garbage)
        reason = _first_line(exc)
    os.replace(prefix + ".index", prefix + ".index.unreadable")
    print(f"returnn-tpu: warning: checkpoint {prefix} does not load ({reason}); renamed its index to "
          f"{prefix}.index.unreadable, {fallback}", file=log_file)
    return False


def load(prefix: str) -> Dict[str, numpy.ndarray]:
    """All tensors of the bundle ``prefix`` by name."""
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def variable_names(prefix: str) -> List[str]:
    """The names of the tensors in the bundle ``prefix`` (without reading their values)."""
    return list(tf.train.load_checkpoint(prefix).get_variable_to_shape_map())


def restore(prefix: str, variables: Mapping[str, tf.Variable], *, partial: bool = False, log_file=None,
            fallbacks: Mapping[str, str] = None):
    """Assigns the saved values to ``variables`` (every replica's copy of a distributed variable).

    Raises :class:`ConfigError` naming the first variable the checkpoint lacks. ``fallbacks`` maps a name
    to the saved name whose value stands in for it when it is missing (older checkpoints). With
    ``partial`` (a network that changes per epoch resumed from another epoch's checkpoint),
    variables the checkpoint lacks or holds in another shape keep their initialization, logged.
    """
    values = load(prefix)
    for name, var in variables.items():
        value = values.get(name, values.get((fallbacks or {}).get(name)))
        if value is not None and tuple(value.shape) == tuple(var.shape):
            var.assign(value)
        elif not partial:
            raise ConfigError(
                f"checkpoint {prefix} has no variable {name!r} of shape {list(var.shape)}: the network differs from "
                "the one the checkpoint was trained with; undo the change, or start in a new model folder"
            )
        else:
            print(f"checkpoint {prefix}: {name!r} not loaded (not in it, or of another shape)", file=log_file)


def cleanup_old_models(config, learning_rate_control):
    """RETURNN's ``cleanup_old_models``: deletes old epochs' checkpoints by RETURNN's own policy
    (keep the last N, the best N by dev score, and the listed epochs), on our files.

    RETURNN implements the policy on its engine base class; an engine that only carries the
    config and the learning-rate control (the policy's inputs) runs it unchanged.
    """
    from returnn.engine.base import EngineBase
    from returnn.tf.engine import Engine

    class _Checkpoints(EngineBase):
        delete_model = staticmethod(Engine.delete_model)

        def __init__(self):  # noqa: D107  (EngineBase's start-up is done; only the policy's inputs)
            self.config = config
            self.learning_rate_control = learning_rate_control

    _Checkpoints().cleanup_old_models()


class RunCheckpoints:
    """The checkpoints of one training run: what each holds, its name, where the run resumes, when
    one is written and removed. The trainer asks; this decides.

    ``networks`` (:class:`returnn_tpu.returnn_side.networks.EpochNetworks`) names an epoch's file (pretrain
    epochs have their own names); ``builder`` holds the current network's variables, ``optimizer``
    its state, ``syncs`` (the strategy's, :func:`returnn_tpu.strategies.make_syncs`) the state of
    local SGD's syncs (:meth:`checkpoint_state`: anchors and outer momenta). Only the
    chief (worker 0) writes the model; each worker writes where its data streams stood beside an
    interrupted checkpoint.
    """

    def __init__(self, config, networks, builder, optimizer, syncs, *, num_epochs: int, num_replicas: int,
                 worker_index: int, log):
        self.config = config
        self.networks = networks
        self.builder = builder
        self.optimizer = optimizer
        self.syncs = syncs
        self.worker_index = worker_index
        self.chief = worker_index == 0
        self.log = log
        self.model_filename = config.value("model", None)  # startup.check_config: set
        self.num_epochs = num_epochs  # the last epoch is always saved
        self.num_replicas = num_replicas  # of all workers: they train an epoch's steps
        self.save_interval = config.int("save_interval", 1)
        self.last_sync: Optional[SyncPoint] = None  # see synced()
        # One interrupted checkpoint written at a time: the loop's, or one at a signal during a step
        # (the lock file below excludes other processes, not this one's threads).
        self._writing_interrupted = threading.Lock()

    # ---- names and the resume point -------------------------------------------------------------

    def epoch_filename(self, epoch: int) -> str:
        """The checkpoint prefix of ``epoch`` (0: the initial model)."""
        return self.networks.model_filename(self.model_filename, epoch)

    def start_epoch(self) -> int:
        """The epoch after the newest checkpoint at ``model`` (1 if there is none), as RETURNN does."""
        from returnn.engine.base import EngineBase

        return EngineBase.get_train_start_epoch(self.config)

    def newest(self) -> Optional[str]:
        """The newest epoch's checkpoint, or None."""
        epoch = self.start_epoch() - 1
        return self.epoch_filename(epoch) if epoch >= 1 else None

    def tidy(self):
        """Chief, before training: removes what crashed saves left behind and sets aside interrupted
        checkpoints and a newest epoch's checkpoint that do not load (resume then uses the one
        before it)."""
        if self.chief:
            remove_stale_temporaries(self.model_filename, log_file=self.log.v2)
            set_aside_unreadable_interrupted(self.model_filename, log_file=self.log.v1)
            set_aside_unreadable(self.newest, log_file=self.log.v1)

    def interrupted(self, start_epoch: int) -> Optional[Interrupted]:
        """The interrupted epoch to continue (at or after ``start_epoch``), or None."""
        return interrupted(self.model_filename, start_epoch)

    def resume_point(self, all_workers: Callable[[int], List[int]]) -> ResumePoint:
        """Where every worker starts: after the newest epoch's checkpoint, or in the interrupted
        epoch after it. The chief first tidies (:meth:`tidy`) while the others wait
        (``all_workers(value)``: every worker's value); all must find the same checkpoints."""
        self.tidy()
        all_workers(0)  # the chief is done with the files
        start_epoch = self.start_epoch()
        start_epochs = all_workers(start_epoch)
        if len(set(start_epochs)) > 1:
            raise RuntimeError(
                f"workers found different checkpoints to resume from (start epochs {start_epochs}); "
                "`model` must be on a file system all workers share"
            )
        if self.chief:
            os.makedirs(os.path.dirname(os.path.abspath(self.model_filename)), exist_ok=True)
        found = self.interrupted(start_epoch)
        if found:
            return ResumePoint(found.epoch, found.steps_done, found.prefix, True, found.num_replicas,
                               read_stream_points(found.prefix, found.epoch, found.steps_done))
        return ResumePoint(start_epoch, 0, self.newest(), False)

    # ---- contents -----------------------------------------------------------------------------

    def state(self) -> Dict[str, tf.Variable]:
        """Everything a checkpoint holds: the current network's variables (RETURNN names), the
        optimizer state and the local-SGD state (anchors, outer momenta)."""
        state = self.builder.variables.network_variables()
        state.update(self.optimizer.variables())
        state.update(self.syncs.checkpoint_state())
        return state

    def restore(self, prefix: str):
        """Loads ``prefix`` into the network, the optimizer and the local-SGD state. A network that
        changes per epoch may differ from the checkpoint's; a checkpoint of a run without an outer
        optimizer has no outer state (it starts at 0)."""
        print(f"load model {prefix}", file=self.log.v2)
        partial = self.networks.changes_per_epoch
        restore(prefix, self.builder.variables.network_variables(), partial=partial, log_file=self.log.v3)
        self._restore_optimizer(prefix)
        restore(prefix, self.syncs.checkpoint_state(), partial=True, log_file=self.log.v3)

    def _restore_optimizer(self, prefix: str):
        """The optimizer's state from the checkpoint. One without the slots (plain RETURNN on TF 2
        saves none of its Keras optimizer's state) starts them fresh, with a warning: the step
        count comes from its ``global_step``, Adam's moments and bias correction restart (FACTS.md,
        "Plain RETURNN on TF 2.21")."""
        state = self.optimizer.variables()
        saved = variable_names(prefix)
        slots = [name for name in state if name not in ("global_step", "optimize/slot_step")]
        if not slots or any(name in saved for name in slots):  # ours (of this network, or of another epoch's)
            restore(prefix, state, partial=self.networks.changes_per_epoch, log_file=self.log.v3,
                    fallbacks=self.optimizer.FALLBACKS)
            return
        print(f"returnn-tpu: warning: checkpoint {prefix} has no optimizer state (e.g. no {slots[0]!r}; plain "
              f"RETURNN saves none): the optimizer's {len(slots)} slots start fresh, at its global_step",
              file=self.log.v1)
        restore(prefix, {"global_step": self.optimizer.step}, log_file=self.log.v3)

    # ---- writing ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _naming_the_last_good(self):
        """A save's :class:`CheckpointWriteError` also says where the newest checkpoint that was
        written is (what the same command resumes from)."""
        try:
            yield
        except CheckpointWriteError as exc:
            found = interrupted(self.model_filename, self.start_epoch())
            last = found.prefix if found else self.newest()
            where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
            raise CheckpointWriteError(f"{exc}; {where}", exc.status) from None

    def save_initial(self):
        """RETURNN's ``save_epoch1_initial_model``: the parameters before the first update, as epoch 0."""
        if self.chief and self.config.bool("save_epoch1_initial_model", False):
            with self._naming_the_last_good():
                save(self.epoch_filename(0), self.state())

    def save_model(self):
        """RETURNN's ``task = "initialize_model"``: the model at ``model`` itself, without an epoch suffix."""
        if self.chief:
            with self._naming_the_last_good():
                save(self.model_filename, self.state())

    def save_epoch(self, epoch: int, learning_rate_control):
        """After ``epoch``'s record: its checkpoint (every ``save_interval`` epochs, and the last),
        which replaces an interrupted one; then RETURNN's ``cleanup_old_models``."""
        if not self.chief:
            return
        if epoch % self.save_interval == 0 or epoch == self.num_epochs:
            with self._naming_the_last_good():
                save(self.epoch_filename(epoch), self.state())
            remove_interrupted(self.model_filename)
        if self.config.bool_or_other("cleanup_old_models", None):
            cleanup_old_models(self.config, learning_rate_control)

    def save_interrupted(self, epoch: int, steps_done: int, streams: Optional[dict]) -> str:
        """The combined model of ``epoch`` stopped after ``steps_done`` steps (chief writes), and
        where this worker's data ``streams`` stood (every worker writes its own); its prefix."""
        prefix = self.epoch_filename(epoch) + INTERRUPTED_MARK
        with self._writing_interrupted:
            if streams:
                write_stream_points(prefix, self.worker_index, epoch=epoch, steps_done=steps_done, streams=streams)
            if self.chief:
                with self._naming_the_last_good():
                    save_interrupted(self.model_filename, prefix, self.state(), epoch=epoch, steps_done=steps_done,
                                     num_replicas=self.num_replicas)
        return prefix

    # ---- the model of the last sync, for a lost worker or a stop without time to agree ----------

    def synced(self, epoch: int, steps_done: int, updates: int, streams: Optional[dict] = None):
        """Every worker's copies were combined after ``steps_done`` steps of ``epoch`` (``updates``
        updates since the run began; this worker's data ``streams`` stood at ``streams``): the
        point a survivor of a lost worker goes back to."""
        self.last_sync = SyncPoint(epoch, steps_done, updates, streams)

    def save_last_sync(self, synced_model: Optional[Mapping[str, tf.Variable]]) -> Optional[str]:
        """Writes the model of the last sync as the interrupted checkpoint of its epoch, with the
        optimizer state it has, so that resume continues there: after a worker was lost (this is
        a survivor; docs/faults.md, "A lost worker"), at a stop with no time to agree, or at a stop
        signal during a step (:class:`returnn_tpu.faults.SignalWatch`). ``synced_model`` is that
        model (name -> variable; None: the parameters themselves, as with synchronous strategies). Survivors
        write one after the other (a lock file beside the model); one that finds the checkpoint
        written, or one as new, writes nothing. Returns the checkpoint's prefix, or None when
        nothing was trained since the newest epoch's checkpoint."""
        point = self.last_sync
        if point is None or point.steps_done == 0:
            return None
        prefix = self.epoch_filename(point.epoch) + INTERRUPTED_MARK
        state = self.state()
        for name, value in (synced_model or {}).items():
            if name in state:
                state[name] = tf.cast(value, state[name].dtype)
        state["global_step"] = tf.constant(point.updates, tf.int64)  # the updates that count
        with self._writing_interrupted, self._naming_the_last_good():
            if point.data:
                write_stream_points(prefix, self.worker_index, epoch=point.epoch, steps_done=point.steps_done,
                                    streams=point.data)
            try:
                with _exclusive(self.model_filename + ".interrupted.lock"):
                    written = interrupted(self.model_filename, point.epoch)
                    if not written or (written.epoch, written.steps_done) < (point.epoch, point.steps_done):
                        save_interrupted(self.model_filename, prefix, state, epoch=point.epoch,
                                         steps_done=point.steps_done, num_replicas=self.num_replicas)
            except OSError as exc:
                raise CheckpointWriteError.of(prefix, exc) from None
        return prefix
