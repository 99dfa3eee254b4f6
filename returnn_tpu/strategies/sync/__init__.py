"""Local SGD's sync, the parts a local-SGD extended (:mod:`returnn_tpu.strategies.extended`)
owns: when the replicas' copies are combined (:mod:`.schedule`: the host's clock and the traced
clock derived from it), how one sync runs (:mod:`.engine`, for both drivers), how copies combine
(:mod:`.averaging` and its variants :mod:`.diloco`, :mod:`.slowmo`; the int8/int4 wire format:
:mod:`.quantized`), and the RETURNN trainer's host driver, what its loop's sync points do
(:mod:`.lifecycle`; overlapped syncs: :class:`OverlappedSyncs`).

Every combination runs in replica context (inside ``strategy.run``), the same code for the
host-driven path (``local_sgd``: the trainer calls a sync function between steps), the in-step
path (``local_sgd_tpu``: the host passes which fragments are due into the compiled step) and a
TF2 program's traced path. Knows nothing of RETURNN.
"""

from __future__ import annotations

import tensorflow as tf

from returnn_tpu.options import DistributeOptions
from returnn_tpu.strategies.sync.averaging import ParameterAveraging, mean_over_all_replicas, mean_within_groups
from returnn_tpu.strategies.sync.diloco import DiLoCoAveraging
from returnn_tpu.strategies.sync.engine import SyncEngine
from returnn_tpu.strategies.sync.fragments import split_into_fragments
from returnn_tpu.strategies.sync.lifecycle import CopiesAlwaysEqual, LocalSGDSyncs, OverlappedSyncs
from returnn_tpu.strategies.sync.schedule import SyncDue, SyncSchedule, TracedSchedule
from returnn_tpu.strategies.sync.slowmo import SlowMoAveraging

__all__ = [
    "make_averaging",
    "CopiesAlwaysEqual",
    "LocalSGDSyncs",
    "OverlappedSyncs",
    "ParameterAveraging",
    "DiLoCoAveraging",
    "SlowMoAveraging",
    "SyncEngine",
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
