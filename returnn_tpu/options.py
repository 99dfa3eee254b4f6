"""The two config keys that choose how training is distributed, checked once at start-up.

``distribute_strategy`` names the algorithm, ``distribute_options`` (a dict) tunes it.
Every check raises :class:`ConfigError` with a one-line message naming the option and
what would be valid, so that bad input stops the run before anything is written.
This module imports neither TensorFlow nor RETURNN.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Tuple

from returnn_tpu.errors import ConfigError

DEFAULT_STRATEGY = "local_sgd"  # what a config without distribute_strategy trains with
STRATEGY_NAMES = ("single", "mirrored", "local_sgd", "multi_worker_mirrored", "tpu", "local_sgd_tpu")
TPU_STRATEGY_NAMES = ("tpu", "local_sgd_tpu")
# The strategies that span the workers of a cluster when one is found (the command line resolves
# one for them; strategies.make_strategy builds them across its workers).
MULTI_WORKER_STRATEGY_NAMES = ("local_sgd", "multi_worker_mirrored")
CLUSTER_RESOLVERS = ("auto", "sge", "mpi", "tf_config", "local")  # TPUs are found by the TPU strategies
DATASET_DISTRIBUTIONS = ("random_seed_offset", "shard")
DATA_PRODUCERS = ("process", "chief", "thread")
DEFAULT_PARAM_SYNC_STEP = 100
LOCAL_SGD_STRATEGY_NAMES = ("local_sgd", "local_sgd_tpu")
OUTER_OPTIMIZER_CLASSES = ("nesterov", "slowmo")
OPTIMIZER_STATE_POLICIES = ("keep", "average", "reset")
SYNC_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")
QUANTIZED_SYNC_DTYPES = ("int8", "int4")
DEFAULT_SYNC_MIX = 0.5  # Streaming DiLoCo's mixing factor (Douillard et al., 2025)
# Options of local SGD's sync; any of them with another strategy is an error, not ignored.
LOCAL_SGD_OPTIONS = ("param_sync_step", "param_sync_time_diff", "outer_optimizer", "optimizer_state_at_sync",
                     "sync_dtype", "local_param_sync_step", "sync_fragments", "sync_delay", "sync_mix",
                     "sync_error_feedback", "sync_warmup_steps", "param_sync_step_ramp")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"distribute_options[{name!r}] must be an int >= 1, got {value!r}")
    return value


LOADERS_PER_CORE = 4  # data_loaders' bound: more processes than that per core only take memory


def _data_loaders(value: Any) -> int:
    """``data_loaders``: an int >= 1, and at most :data:`LOADERS_PER_CORE` per core this process may
    use (each loader holds a copy of the dataset)."""
    loaders = _positive_int("data_loaders", value)
    cores = len(os.sched_getaffinity(0))
    if loaders > LOADERS_PER_CORE * cores:
        raise ConfigError(f"distribute_options['data_loaders'] is {loaders}, more than {LOADERS_PER_CORE} per core "
                          f"of this machine ({cores} cores): at most {LOADERS_PER_CORE * cores}")
    return loaders


def _positive_number(name: str, value: Any, what: str = "a number of seconds") -> float:
    """``value`` of ``distribute_options[name]`` (``name`` may be a path: ``"a']['b"``), a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ConfigError(f"distribute_options['{name}'] must be {what} > 0, got {value!r}")
    return float(value)


def _seconds(name: str, value: Any) -> float:
    """A duration as SGE and SLURM write one (``"H:MM:SS"``, ``"MM:SS"``; minutes and seconds
    below 60) or a number of seconds."""
    if isinstance(value, str):
        parts = value.split(":")
        if 1 <= len(parts) <= 3 and all(part.isdigit() for part in parts) and \
                all(int(part) < 60 for part in parts[1:]):
            seconds = 0
            for part in parts:
                seconds = seconds * 60 + int(part)
            if seconds > 0:
                return float(seconds)
        raise ConfigError(f"distribute_options[{name!r}] must be seconds > 0 or 'H:MM:SS' (minutes and seconds "
                          f"below 60), got {value!r}")
    return _positive_number(name, value)


def _one_of(name: str, value: Any, valid: tuple) -> str:
    if value not in valid:
        raise ConfigError(f"distribute_options[{name!r}] must be one of {', '.join(map(repr, valid))}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class DistributeOptions:
    """Validated ``distribute_strategy`` plus ``distribute_options``.

    :ivar strategy: one of :data:`STRATEGY_NAMES`.
    :ivar num_replicas: replicas on this machine; on a machine without GPUs the CPU is split into
        that many logical devices. None: one per GPU, or one CPU device.
    :ivar param_sync_step: local SGD averages the replicas' parameters every this many steps.
    :ivar param_sync_time_diff: alternative to ``param_sync_step``: average when this many seconds
        have passed since the last average.
    :ivar cluster_resolver: how the workers of a multi-machine run find each other.
    :ivar dataset_distribution: how the replicas split the data (docs/data.md).
    :ivar jit_compile: compile the per-replica forward and backward pass with XLA (default: on
        for TPU strategies, off elsewhere); sequences are then bucketed to static shapes.
    :ivar bucket_boundaries: with ``jit_compile``, the bucket lengths (frames of the default
        input); default: the quartiles of the training data's lengths.
    :ivar startup_timeout: seconds to wait for all workers of a multi-worker run to come up.
    :ivar collective_timeout: seconds any one all-reduce between workers may wait (None: no
        limit per all-reduce; a dead or hung peer still aborts it, see
        :class:`returnn_tpu.strategies.multi_worker.TimedCollectiveExtended`).
    :ivar sync_bucket_bytes: parameters are averaged in all-reduces of about this many bytes.
    :ivar outer_optimizer: None (plain averaging) or ``{"class": "nesterov" | "slowmo",
        "learning_rate": .., "momentum": ..}``: an outer step on the replicas' mean change.
    :ivar optimizer_state_at_sync: ``"keep"``, ``"average"`` or ``"reset"`` the replicas'
        optimizer slots at a sync.
    :ivar sync_dtype: the type the change since the last sync travels in; ``"int8"`` and
        ``"int4"`` are quantized per block of 64 values with a float32 scale.
    :ivar sync_error_feedback: with ``"int8"``/``"int4"``: each replica adds what rounding left
        out of its change to its next change.
    :ivar sync_delay: overlapped syncs: a sync's all-reduce runs while this many further updates
        compute, then its result is applied (0: at once).
    :ivar sync_mix: overlapped syncs: each copy becomes ``sync_mix * copy + (1 - sync_mix) *
        synced model`` when a sync is applied (0: the synced model).
    :ivar sync_warmup_steps: post-local SGD: the first this many updates of the training are
        synchronous (the replicas' mean gradient, as ``mirrored``); local SGD starts after them.
    :ivar param_sync_step_ramp: growing sync intervals: over this many updates (after any warm-up)
        the interval between syncs grows linearly from 1 update to ``param_sync_step``
        (:class:`returnn_tpu.strategies.sync.SyncSchedule`).
    :ivar local_param_sync_step: hierarchical averaging: the replicas of each worker average every
        this many steps, all workers every ``param_sync_step``.
    :ivar sync_fragments: streaming syncs: the parameters in this many fragments of about equal
        bytes, one synced every ``param_sync_step / sync_fragments`` steps.
    :ivar skip_nonfinite_steps: an update whose loss or gradient is NaN or Inf in a replica is
        skipped and counted; without it, such an update stops the run.
    :ivar data_producer: where the training data is read, batched and padded: ``"process"``, a
        producer process per worker (:mod:`returnn_tpu.datapath.producer`), ``"chief"``, one on worker 0
        that serves all workers over TCP (the dataset is read once per epoch across the
        cluster), or ``"thread"``, a thread of the training process.
    :ivar data_prefetch: how many steps' batches are read ahead of training.
    :ivar data_loaders: processes that load the training sequences for a producer (RETURNN's
        ``MultiProcDataset`` around each of its datasets), for datasets that cost CPU per
        sequence (``OggZipDataset``'s feature extraction). None: :func:`default_data_loaders`.
    :ivar time_limit: the job's run-time limit in seconds from the start of the process (SGE's
        ``-l h_rt``, SLURM's ``--time``; also as ``"H:MM:SS"``). ``stop_before_time_limit``
        seconds before it, training stops at a step boundary with an interrupted checkpoint and
        exit status 75, which means "run the same command again" (docs/faults.md).
    :ivar stop_before_time_limit: see ``time_limit``: time enough to save and exit.
    """

    strategy: str = DEFAULT_STRATEGY
    num_replicas: Optional[int] = None
    param_sync_step: int = DEFAULT_PARAM_SYNC_STEP
    param_sync_time_diff: Optional[float] = None
    cluster_resolver: str = "auto"
    dataset_distribution: str = "random_seed_offset"
    jit_compile: bool = False
    startup_timeout: float = 300.0
    collective_timeout: Optional[float] = None
    sync_bucket_bytes: int = 32 * 1024 * 1024
    bucket_boundaries: Optional[Tuple[int, ...]] = None
    outer_optimizer: Optional[Mapping[str, Any]] = None
    optimizer_state_at_sync: str = "keep"
    sync_dtype: str = "float32"
    local_param_sync_step: Optional[int] = None
    sync_fragments: int = 1
    sync_delay: int = 0
    sync_mix: float = DEFAULT_SYNC_MIX
    sync_error_feedback: bool = True
    sync_warmup_steps: int = 0
    param_sync_step_ramp: int = 0
    skip_nonfinite_steps: bool = False
    data_producer: str = "process"
    data_prefetch: int = 4
    data_loaders: Optional[int] = None
    time_limit: Optional[float] = None
    stop_before_time_limit: float = 300.0

    def in_force(self) -> dict:
        """Every option with the value it has in this run (for ``metrics.jsonl``)."""
        values = dataclasses.asdict(self)
        del values["strategy"]
        return values

    @classmethod
    def from_config_values(cls, strategy: Any, options: Optional[Mapping[str, Any]]) -> "DistributeOptions":
        """Checks the raw config values; raises :class:`ConfigError` on the first bad one."""
        if strategy not in STRATEGY_NAMES:
            raise ConfigError(
                f"distribute_strategy must be one of {', '.join(map(repr, STRATEGY_NAMES))}, got {strategy!r}"
            )
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(f"distribute_options must be a dict, got {options!r}")
        options = dict(options or {})
        valid_keys = [f.name for f in dataclasses.fields(cls) if f.name != "strategy"]
        unknown = sorted(set(options) - set(valid_keys))
        if unknown:
            raise ConfigError(
                f"distribute_options has unknown key {unknown[0]!r}; valid keys: {', '.join(valid_keys)}"
            )
        kwargs: dict = {"strategy": strategy}
        if options.get("num_replicas") is not None:
            kwargs["num_replicas"] = _positive_int("num_replicas", options["num_replicas"])
        if "param_sync_step" in options:
            kwargs["param_sync_step"] = _positive_int("param_sync_step", options["param_sync_step"])
        if options.get("param_sync_time_diff") is not None:
            kwargs["param_sync_time_diff"] = _positive_number("param_sync_time_diff", options["param_sync_time_diff"])
        if "cluster_resolver" in options:
            kwargs["cluster_resolver"] = _one_of("cluster_resolver", options["cluster_resolver"], CLUSTER_RESOLVERS)
        if "dataset_distribution" in options:
            kwargs["dataset_distribution"] = _one_of(
                "dataset_distribution", options["dataset_distribution"], DATASET_DISTRIBUTIONS
            )
        for key in ("startup_timeout", "collective_timeout"):
            if options.get(key) is not None:
                kwargs[key] = _positive_number(key, options[key])
        if "sync_bucket_bytes" in options:
            kwargs["sync_bucket_bytes"] = _positive_int("sync_bucket_bytes", options["sync_bucket_bytes"])
        if options.get("bucket_boundaries") is not None:
            boundaries = options["bucket_boundaries"]
            if not isinstance(boundaries, (list, tuple)) or not boundaries or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in boundaries
            ):
                raise ConfigError(
                    f"distribute_options['bucket_boundaries'] must be a list of ints >= 1, got {boundaries!r}"
                )
            kwargs["bucket_boundaries"] = tuple(sorted(boundaries))
        if "data_producer" in options:
            kwargs["data_producer"] = _one_of("data_producer", options["data_producer"], DATA_PRODUCERS)
        if "data_prefetch" in options:
            kwargs["data_prefetch"] = _positive_int("data_prefetch", options["data_prefetch"])
        if options.get("data_loaders") is not None:
            kwargs["data_loaders"] = _data_loaders(options["data_loaders"])
        if options.get("time_limit") is not None:
            kwargs["time_limit"] = _seconds("time_limit", options["time_limit"])
        if "stop_before_time_limit" in options:
            kwargs["stop_before_time_limit"] = _positive_number("stop_before_time_limit",
                                                                options["stop_before_time_limit"])
        if "stop_before_time_limit" in options and options.get("time_limit") is None:
            raise ConfigError("distribute_options['stop_before_time_limit'] needs 'time_limit' (the job's run-time "
                              "limit, e.g. '4:00:00'); without it nothing stops before a limit")
        margin = kwargs.get("stop_before_time_limit", cls.stop_before_time_limit)
        if kwargs.get("time_limit") is not None and margin >= kwargs["time_limit"]:
            raise ConfigError(f"distribute_options['stop_before_time_limit'] ({margin:g} s) must be less than "
                              f"'time_limit' ({kwargs['time_limit']:g} s)")
        if "skip_nonfinite_steps" in options:
            if not isinstance(options["skip_nonfinite_steps"], bool):
                raise ConfigError("distribute_options['skip_nonfinite_steps'] must be True or False, got "
                                  f"{options['skip_nonfinite_steps']!r}")
            kwargs["skip_nonfinite_steps"] = options["skip_nonfinite_steps"]
        if "jit_compile" in options:
            if not isinstance(options["jit_compile"], bool):
                raise ConfigError(f"distribute_options['jit_compile'] must be True or False, got {options['jit_compile']!r}")
            kwargs["jit_compile"] = options["jit_compile"]
        else:
            kwargs["jit_compile"] = strategy in TPU_STRATEGY_NAMES  # TPUs run XLA programs only
        kwargs.update(_sync_options(strategy, options))
        if strategy == "single" and kwargs.get("num_replicas", 1) != 1:
            raise ConfigError("distribute_options['num_replicas'] must be 1 with distribute_strategy 'single'")
        return cls(**kwargs)


def _outer_optimizer(value: Any) -> Optional[dict]:
    if value is None:
        return None
    name = "outer_optimizer"
    if not isinstance(value, Mapping) or value.get("class") not in OUTER_OPTIMIZER_CLASSES:
        raise ConfigError(
            f"distribute_options[{name!r}] must be None or a dict with 'class' one of "
            f"{', '.join(map(repr, OUTER_OPTIMIZER_CLASSES))}, got {value!r}"
        )
    unknown = sorted(set(value) - {"class", "learning_rate", "momentum"})
    if unknown:
        raise ConfigError(f"distribute_options[{name!r}] has unknown key {unknown[0]!r}; valid: 'class', "
                          "'learning_rate', 'momentum'")
    if "learning_rate" in value:
        _positive_number(f"{name}']['learning_rate", value["learning_rate"], what="a number")
    momentum = value.get("momentum", 0.0)
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ConfigError(f"distribute_options[{name!r}]['momentum'] must be a number in [0, 1), got {momentum!r}")
    return dict(value)


def _sync_options(strategy: str, options: Mapping[str, Any]) -> dict:
    """The local-SGD sync options, checked alone and against each other."""
    given = [key for key in LOCAL_SGD_OPTIONS if options.get(key) is not None]
    if given and strategy not in LOCAL_SGD_STRATEGY_NAMES:
        raise ConfigError(
            f"distribute_options[{given[0]!r}] is an option of local SGD; it needs distribute_strategy "
            f"{' or '.join(map(repr, LOCAL_SGD_STRATEGY_NAMES))}, got {strategy!r}"
        )
    if "param_sync_step" in given and "param_sync_time_diff" in given:
        raise ConfigError("distribute_options: give either 'param_sync_step' or 'param_sync_time_diff', not both")
    kwargs: dict = {}
    if "outer_optimizer" in options:
        kwargs["outer_optimizer"] = _outer_optimizer(options["outer_optimizer"])
    if "optimizer_state_at_sync" in options:
        kwargs["optimizer_state_at_sync"] = _one_of(
            "optimizer_state_at_sync", options["optimizer_state_at_sync"], OPTIMIZER_STATE_POLICIES
        )
    if "sync_dtype" in options:
        kwargs["sync_dtype"] = _one_of("sync_dtype", options["sync_dtype"], SYNC_DTYPES)
    step = options.get("param_sync_step", DEFAULT_PARAM_SYNC_STEP)
    if options.get("sync_warmup_steps") is not None:
        kwargs["sync_warmup_steps"] = _positive_int("sync_warmup_steps", options["sync_warmup_steps"])
    for key in ("local_param_sync_step", "sync_fragments", "param_sync_step_ramp"):
        if options.get(key) is None:
            continue
        kwargs[key] = _positive_int(key, options[key])
        if "param_sync_time_diff" in given:
            raise ConfigError(f"distribute_options[{key!r}] counts steps; use 'param_sync_step', not "
                              "'param_sync_time_diff'")
    if kwargs.get("local_param_sync_step") is not None:
        if kwargs["local_param_sync_step"] >= step:
            raise ConfigError(f"distribute_options['local_param_sync_step'] must be smaller than param_sync_step "
                              f"({step}), got {kwargs['local_param_sync_step']}")
        if strategy == "local_sgd_tpu":
            raise ConfigError("distribute_options['local_param_sync_step'] cannot be used with 'local_sgd_tpu' "
                              "(one TPU host is one worker); use 'local_sgd'")
    kwargs.update(_overlap_and_quantization(options, kwargs, step, time_based="param_sync_time_diff" in given))
    if kwargs.get("param_sync_step_ramp") and kwargs.get("sync_delay"):
        raise ConfigError("distribute_options['param_sync_step_ramp'] starts with a sync after every update, where "
                          "no sync can overlap later updates; it cannot be used with sync_delay >= 1")
    fragments = kwargs.get("sync_fragments", 1)
    if fragments > step:
        raise ConfigError(f"distribute_options['sync_fragments'] must be at most param_sync_step ({step}), "
                          f"got {fragments}")
    if fragments > 1 and kwargs.get("optimizer_state_at_sync") == "reset":
        raise ConfigError("distribute_options['optimizer_state_at_sync'] 'reset' restarts Adam's bias correction "
                          "for all parameters; it cannot be used with sync_fragments > 1")
    return kwargs


def _overlap_and_quantization(options: Mapping[str, Any], checked: dict, step: int, time_based: bool) -> dict:
    """``sync_delay``, ``sync_mix`` and ``sync_error_feedback``, checked against the other sync options."""
    kwargs: dict = {}
    delay = options.get("sync_delay")
    if delay is not None:
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise ConfigError(f"distribute_options['sync_delay'] must be an int >= 0 (updates), got {delay!r}")
        gap = step // checked.get("sync_fragments", 1)
        if not time_based and delay >= gap:
            raise ConfigError(f"distribute_options['sync_delay'] must be less than param_sync_step / sync_fragments "
                              f"({gap} updates between two syncs: one sync is in flight at a time), got {delay}")
        if delay and checked.get("optimizer_state_at_sync", "keep") != "keep":
            raise ConfigError("distribute_options['optimizer_state_at_sync'] must be 'keep' with sync_delay > 0 "
                              f"(each replica keeps its own optimizer state), got {checked['optimizer_state_at_sync']!r}")
        kwargs["sync_delay"] = delay
    mix = options.get("sync_mix")
    if mix is not None:
        if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0 <= mix < 1:
            raise ConfigError(f"distribute_options['sync_mix'] must be a number in [0, 1), got {mix!r}")
        if not delay:
            raise ConfigError("distribute_options['sync_mix'] mixes overlapped syncs into the copies; it needs "
                              "'sync_delay' >= 1")
        kwargs["sync_mix"] = float(mix)
    feedback = options.get("sync_error_feedback")
    if feedback is not None:
        if not isinstance(feedback, bool):
            raise ConfigError(f"distribute_options['sync_error_feedback'] must be True or False, got {feedback!r}")
        if checked.get("sync_dtype") not in QUANTIZED_SYNC_DTYPES:
            raise ConfigError("distribute_options['sync_error_feedback'] applies to sync_dtype "
                              f"{' or '.join(map(repr, QUANTIZED_SYNC_DTYPES))}, got {checked.get('sync_dtype', 'float32')!r}")
        kwargs["sync_error_feedback"] = feedback
    return kwargs


def check_tf2_local_sgd_options(options: Mapping[str, Any], strategy_name: str = "LocalSGDStrategy",
                                multi_worker: bool = False, tpu: bool = False) -> DistributeOptions:
    """The options of a TF2 program's local-SGD strategy (``strategy_name``): the local-SGD keys of
    ``distribute_options`` (and, across workers, ``sync_bucket_bytes``), checked as in a config.
    The keys whose rule the TF2 path does not have are refused in one line that says why
    (:data:`NOT_FOR_TF2_PROGRAMS`)."""
    valid = LOCAL_SGD_OPTIONS + (("sync_bucket_bytes",) if multi_worker else ())
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"{strategy_name} has no option {unknown[0]!r}; its options: {', '.join(valid)}")
    checked = DistributeOptions.from_config_values("local_sgd", options)
    refused = [(repr(key), key) for key in ("param_sync_time_diff", "sync_warmup_steps", "param_sync_step_ramp")
               if options.get(key) is not None]
    if tpu and options.get("local_param_sync_step") is not None:
        refused.append(("'local_param_sync_step'", "local_param_sync_step_tpu"))
    if checked.optimizer_state_at_sync != "keep":
        refused.append((f"optimizer_state_at_sync {checked.optimizer_state_at_sync!r}", "optimizer_state_at_sync"))
    if checked.outer_optimizer is not None and checked.outer_optimizer["class"] != "nesterov":
        refused.append((f"outer_optimizer class {checked.outer_optimizer['class']!r}", "slowmo"))
    if refused:
        what, key = refused[0]
        raise ConfigError(f"{strategy_name}: {what} is not supported for TF2 programs: {NOT_FOR_TF2_PROGRAMS[key]}; "
                          "returnn-tpu's trainer has it (TF2 programs have param_sync_step, a 'nesterov' "
                          "outer_optimizer, sync_dtype, sync_error_feedback, sync_fragments, sync_delay, sync_mix and, "
                          "off TPUs, local_param_sync_step)")
    return checked


# Why a TF2 program's local SGD lacks what the trainer's has. Its schedule is counted inside the
# program's trace (Keras' train function, a tf.function loop), where the strategy sees gradients
# and variables but not the program's optimizer.
NOT_FOR_TF2_PROGRAMS = {
    "param_sync_time_diff": "a sync by time needs a clock that all workers agree on between steps, and the traced "
                            "schedule counts updates only",
    "local_param_sync_step_tpu": "a worker-local round averages within each host's cores through merge_call, which "
                                 "the TPU program does not have",
    "sync_warmup_steps": "the synchronous warm-up is counted by the trainer's host schedule, not by the traced one",
    "param_sync_step_ramp": "growing intervals are counted by the trainer's host schedule, not by the traced one",
    "optimizer_state_at_sync": "the strategy does not see the program's optimizer, whose slots it would change",
    "slowmo": "SlowMo's outer step scales by the inner learning rate, which the strategy cannot read from the "
              "program's optimizer",
}
