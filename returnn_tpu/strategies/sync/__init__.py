"""Local SGD's sync: the RETURNN trainer's side of a strategy, what its loop's sync points do
(:mod:`.lifecycle`; overlapped syncs: :class:`OverlappedSyncs`), when the replicas' copies are
combined (:mod:`.schedule`) and how (:mod:`.averaging` and its variants :mod:`.diloco`,
:mod:`.slowmo`; the int8/int4 wire format: :mod:`.quantized`).

Every combination runs in replica context (inside ``strategy.run``), the same code for the
host-driven path (``local_sgd``: the trainer calls a sync function between steps) and the in-step
path (``local_sgd_tpu``: the host passes which fragments are due into the compiled step). Knows
nothing of RETURNN.
"""

from __future__ import annotations

import tensorflow as tf

from returnn_tpu.options import DistributeOptions
from returnn_tpu.strategies.extended import is_local_sgd, updates_in_replica
from returnn_tpu.strategies.sync.averaging import ParameterAveraging, mean_over_all_replicas, mean_within_groups
from returnn_tpu.strategies.sync.diloco import DiLoCoAveraging
from returnn_tpu.strategies.sync.fragments import split_into_fragments
from returnn_tpu.strategies.sync.lifecycle import CopiesAlwaysEqual, LocalSGDSyncs, OverlappedSyncs
from returnn_tpu.strategies.sync.schedule import SyncDue, SyncSchedule, TracedSchedule
from returnn_tpu.strategies.sync.slowmo import SlowMoAveraging

__all__ = [
    "make_averaging",
    "make_syncs",
    "CopiesAlwaysEqual",
    "LocalSGDSyncs",
    "OverlappedSyncs",
    "ParameterAveraging",
    "DiLoCoAveraging",
    "SlowMoAveraging",
    "SyncDue",
    "SyncSchedule",
    "TracedSchedule",
    "mean_over_all_replicas",
    "mean_within_groups",
    "split_into_fragments",
]

OUTER_OPTIMIZERS = {"nesterov": DiLoCoAveraging, "slowmo": SlowMoAveraging}


def make_averaging(options: DistributeOptions, keep_synced_model: bool = False) -> ParameterAveraging:
    """The combination ``distribute_options`` asks for: plain averaging, or an outer optimizer;
    ``keep_synced_model``: see :class:`ParameterAveraging`."""
    common = {"sync_dtype": options.sync_dtype, "optimizer_state_at_sync": options.optimizer_state_at_sync,
              "keep_synced_model": keep_synced_model, "error_feedback": options.sync_error_feedback,
              "overlapped_mix": options.sync_mix if options.sync_delay else None}
    if options.outer_optimizer is None:
        return ParameterAveraging(**common)
    outer = dict(options.outer_optimizer)
    cls = OUTER_OPTIMIZERS[outer.pop("class")]
    return cls(**common, **outer)


def make_syncs(options: DistributeOptions, strategy: tf.distribute.Strategy, *, num_workers: int,
               any_worker) -> CopiesAlwaysEqual:
    """The trainer's side of ``strategy`` (:mod:`.lifecycle`): for synchronous strategies the mean
    gradient of every update; for local SGD the schedule and averaging ``distribute_options`` ask
    for. ``any_worker(flag)`` is True on every worker if it is on any (the time-based schedule's
    agreement, every 10 updates with several workers). With several workers every worker keeps
    the model of the last sync, which a survivor of a lost peer saves."""
    in_replica = updates_in_replica(strategy)
    if not is_local_sgd(strategy):
        return CopiesAlwaysEqual(strategy, updates_in_replica=in_replica)
    local_replicas = len(strategy.extended.worker_devices)
    local_step = options.local_param_sync_step if local_replicas > 1 else None
    schedule = SyncSchedule(
        options.param_sync_step,
        options.param_sync_time_diff,
        fragments=options.sync_fragments,
        local_step=local_step,
        delay=options.sync_delay,
        any_worker=any_worker,
        time_check_steps=1 if num_workers == 1 else 10,
        warmup=options.sync_warmup_steps,
        ramp=options.param_sync_step_ramp,
    )
    syncs = OverlappedSyncs if options.sync_delay else LocalSGDSyncs
    return syncs(strategy, make_averaging(options, keep_synced_model=num_workers > 1), schedule,
                 updates_in_replica=in_replica,
                 sync_steps=None if options.param_sync_time_diff else options.param_sync_step,
                 ignored_local_step=bool(options.local_param_sync_step) and local_step is None)
