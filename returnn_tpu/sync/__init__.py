"""Local SGD's sync: when the replicas' copies are combined (:mod:`.schedule`) and how
(:mod:`.averaging` and its variants :mod:`.diloco`, :mod:`.slowmo`).

Every combination runs in replica context (inside ``strategy.run``), the same code for the
host-driven path (``local_sgd``: the trainer calls a sync function between steps) and the in-step
path (``local_sgd_tpu``: the host passes which fragments are due into the compiled step). Knows
nothing of RETURNN.
"""

from __future__ import annotations

from returnn_tpu.options import DistributeOptions
from returnn_tpu.sync.averaging import ParameterAveraging, mean_over_all_replicas, mean_within_groups
from returnn_tpu.sync.diloco import DiLoCoAveraging
from returnn_tpu.sync.fragments import split_into_fragments
from returnn_tpu.sync.schedule import SyncDue, SyncSchedule
from returnn_tpu.sync.slowmo import SlowMoAveraging

__all__ = [
    "make_averaging",
    "ParameterAveraging",
    "DiLoCoAveraging",
    "SlowMoAveraging",
    "SyncDue",
    "SyncSchedule",
    "mean_over_all_replicas",
    "mean_within_groups",
    "split_into_fragments",
]

OUTER_OPTIMIZERS = {"nesterov": DiLoCoAveraging, "slowmo": SlowMoAveraging}


def make_averaging(options: DistributeOptions) -> ParameterAveraging:
    """The combination ``distribute_options`` asks for: plain averaging, or an outer optimizer."""
    common = {"sync_dtype": options.sync_dtype, "optimizer_state_at_sync": options.optimizer_state_at_sync}
    if options.outer_optimizer is None:
        return ParameterAveraging(**common)
    outer = dict(options.outer_optimizer)
    cls = OUTER_OPTIMIZERS[outer.pop("class")]
    return cls(**common, **outer)
