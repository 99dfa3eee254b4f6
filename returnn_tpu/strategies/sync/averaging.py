"""How local SGD combines the replicas' copies: plain averaging, the base of the variants.

Everything here runs in replica context (inside ``strategy.run``), for the host-driven path and
for the in-step path alike. The collective is a parameter, a function from this replica's list
of tensors to their means: :func:`mean_over_all_replicas` (every replica of every worker) or
:func:`mean_within_groups` (the replicas of one worker: hierarchical averaging). All means are
computed before any copy is assigned (FACTS.md, "Averages"; "Syncs in replica context").

>>> from returnn_tpu.options import DistributeOptions
>>> from returnn_tpu.strategies import make_strategy
>>> strategy = make_strategy(DistributeOptions(strategy="local_sgd", num_replicas=2))
>>> with strategy.scope():
...     w = tf.Variable(0.0)
>>> @tf.function(autograph=False)
... def sync():
...     strategy.run(lambda: ParameterAveraging().sync_in_replica(
...         strategy, {"w": w}, mean_over_all_replicas, learning_rate=0.1))
>>> _ = strategy.extended.update(w, lambda copy, value: copy.assign(value),
...     args=(strategy.experimental_distribute_values_from_function(lambda ctx: float(ctx.replica_id_in_sync_group)),))
>>> [float(c) for c in strategy.experimental_local_results(w)]
[0.0, 1.0]
>>> sync()
>>> [float(c) for c in strategy.experimental_local_results(w)]
[0.5, 0.5]
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from returnn_tpu.options import QUANTIZED_SYNC_DTYPES
from returnn_tpu.strategies.devices import per_replica
from returnn_tpu.strategies.sync.quantized import QuantizedWire

Collective = Callable[[List[tf.Tensor]], List[tf.Tensor]]


def mean_over_all_replicas(values: List[tf.Tensor]) -> List[tf.Tensor]:
    """The mean of each value over all replicas of all workers (one batched all-reduce)."""
    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.MEAN, values)


def mean_within_groups(group_size: int) -> Collective:
    """The collective that averages each value over consecutive groups of ``group_size`` local
    replicas (the replicas of one worker), without any traffic between workers.

    Needs ``merge_call`` (not available inside the compiled TPU step).
    """

    def local_means(strategy, *values):
        means = []
        for value in values:
            copies = strategy.experimental_local_results(value)
            copies_per_replica = []
            for start in range(0, len(copies), group_size):
                group = copies[start : start + group_size]
                copies_per_replica += [tf.add_n(group) / len(group)] * len(group)
            means.append(per_replica(copies_per_replica))
        return means

    def collective(values: List[tf.Tensor]) -> List[tf.Tensor]:
        return tf.distribute.get_replica_context().merge_call(local_means, args=tuple(values))

    return collective


def assign_own_copies(strategy: tf.distribute.Strategy, variables: Sequence[tf.Variable], values: Sequence):
    """In replica context: sets this replica's copy of each variable to its value."""
    for var, value in zip(variables, values):
        strategy.extended.update(var, lambda copy, new: copy.assign(tf.cast(new, copy.dtype)), args=(value,))


class ParameterAveraging:
    """Plain local SGD: after a sync every copy holds the mean of all copies.

    :param sync_dtype: the type the values travel in. Other than float32, each replica sends its
        change since the last sync (the anchor, kept in float32) in that type, and the anchor plus
        the mean change becomes the new model: the rounding error is that of the change, not of
        the parameters. ``"int8"`` and ``"int4"``: quantized per block (:mod:`.quantized`).
    :param error_feedback: with ``"int8"``/``"int4"``, each replica adds what rounding left out of
        its change to its next change.
    :param optimizer_state_at_sync: what happens to each replica's optimizer slots (Adam's
        moments) at a sync: ``"keep"`` (each replica continues with its own), ``"average"``
        (replaced by their mean, which doubles Adam's traffic), ``"reset"`` (zero, and the bias
        correction restarts, as for a new optimizer).
    :param keep_synced_model: keep the model of the last sync (the anchor) also where the sync
        does not need it: with several workers, a survivor of a lost peer saves it
        (docs/faults.md, "A lost worker").
    :param overlapped_mix: None: a sync is applied at once. A number alpha: syncs are overlapped
        (Streaming DiLoCo, Douillard et al., 2025): :meth:`snapshot_in_replica` takes each
        replica's change, :meth:`reduce_in_replica` averages it while later steps compute, and
        :meth:`apply_in_replica` makes the new model then and sets each copy to
        ``alpha * copy + (1 - alpha) * new model``.
    """

    uses_anchor = False  # whether every sync needs the model of the last sync (variants: True)

    def __init__(self, sync_dtype: str = "float32", optimizer_state_at_sync: str = "keep",
                 keep_synced_model: bool = False, error_feedback: bool = True, overlapped_mix: Optional[float] = None):
        self.quantized = QuantizedWire(sync_dtype) if sync_dtype in QUANTIZED_SYNC_DTYPES else None
        self.sync_dtype = tf.float32 if self.quantized else tf.as_dtype(sync_dtype)
        self.error_feedback = error_feedback and self.quantized is not None
        self.optimizer_state_at_sync = optimizer_state_at_sync
        self.keep_synced_model = keep_synced_model
        self.overlapped_mix = overlapped_mix
        self.anchors: Dict[str, tf.Variable] = {}  # parameter name -> the model of the last sync
        self.residuals: Dict[str, tf.Variable] = {}  # per replica: what quantization left out of its change
        self.pending: Dict[str, tf.Variable] = {}  # overlapped: a sync's change, then its mean, until applied

    @property
    def syncs_changes(self) -> bool:
        """Whether a sync sends each replica's change since the anchor (outer optimizers, types
        other than float32, overlapped syncs), rather than the parameters themselves."""
        return self.uses_anchor or self.sync_dtype != tf.float32 or self.quantized is not None or self.overlapped

    @property
    def overlapped(self) -> bool:
        return self.overlapped_mix is not None

    @property
    def keeps_anchor(self) -> bool:
        return self.syncs_changes or self.keep_synced_model

    def start_warning(self, param_sync_step: Optional[int]) -> Optional[str]:
        """What a user should know of these settings before training with them, syncing every
        ``param_sync_step`` updates (None: by time); None if nothing."""
        return None

    # ---- state ----------------------------------------------------------------------------------

    def create_state(self, strategy: tf.distribute.Strategy, variables: Dict[str, tf.Variable]):
        """Creates the per-parameter state (cross-replica context, before the step is traced)."""
        kinds = [(self.anchors, "local_sgd_anchor", self.keeps_anchor),
                 (self.residuals, "local_sgd_residual", self.error_feedback),
                 (self.pending, "local_sgd_pending", self.overlapped)]
        with strategy.scope():
            for state, suffix, needed in kinds:
                for name, var in variables.items():
                    if needed and name not in state:
                        state[name] = tf.Variable(tf.zeros(var.shape, tf.float32), trainable=False, name=f"{name}/{suffix}")

    def state_variables(self) -> Dict[str, tf.Variable]:
        """The state a checkpoint holds, by checkpoint name: the anchors (a checkpoint follows a full
        sync, so nothing is pending; the quantization residuals, each replica's own, start at zero
        on resume)."""
        return {var.name.split(":")[0]: var for var in self.anchors.values()}

    def forget_state(self):
        """A new network: its state is created anew (anchors from its parameters)."""
        self.anchors, self.residuals, self.pending = {}, {}, {}

    # ---- syncs (replica context) -------------------------------------------------------------

    def start_in_replica(self, strategy, variables: Dict[str, tf.Variable], collective: Collective = mean_over_all_replicas):
        """Makes all copies one model (their mean) and the anchor that model; no outer step.

        Run once before training (and after a restore): workers may have loaded different files.
        """
        names = sorted(variables)
        values = [variables[name] for name in names]
        means = collective([tf.identity(var) for var in values])
        assign_own_copies(strategy, values, means)
        if self.keeps_anchor:
            assign_own_copies(strategy, [self.anchors[name] for name in names], means)

    def sync_in_replica(
        self,
        strategy: tf.distribute.Strategy,
        variables: Dict[str, tf.Variable],
        collective: Collective,
        *,
        learning_rate: tf.Tensor,
        slots: Optional[Dict[str, Sequence[tf.Variable]]] = None,
        slot_step: Optional[tf.Variable] = None,
        outer_step: bool = True,
    ):
        """Combines the copies of ``variables`` (name -> variable) with ``collective``.

        :param learning_rate: the inner learning rate now (SlowMo scales by it).
        :param slots: the optimizer slots of each variable (for ``optimizer_state_at_sync``).
        :param slot_step: the optimizer's bias-correction step (``"reset"`` restarts it).
        :param outer_step: False for the worker-local syncs of hierarchical averaging, which
            average and leave the anchor and outer state to the global syncs.
        """
        names = sorted(variables)
        params = [variables[name] for name in names]
        if self.syncs_changes and outer_step:
            mean_changes = self._mean_changes(strategy, names, self._changes(names, params), collective)
            new_values = self.apply_mean_change(
                strategy, names, [tf.identity(self.anchors[name]) for name in names], mean_changes, learning_rate
            )
            assign_own_copies(strategy, params, new_values)
        else:
            means = collective([tf.identity(var) for var in params])
            assign_own_copies(strategy, params, means)
            if self.keeps_anchor and outer_step:
                assign_own_copies(strategy, [self.anchors[name] for name in names], means)
        if slots and self.optimizer_state_at_sync == "average":
            slot_vars = [slot for name in names for slot in slots.get(name, ())]
            assign_own_copies(strategy, slot_vars, collective([tf.identity(slot) for slot in slot_vars]))
        elif slots and self.optimizer_state_at_sync == "reset":
            slot_vars = [slot for name in names for slot in slots.get(name, ())]
            assign_own_copies(strategy, slot_vars, [tf.zeros_like(slot) for slot in slot_vars])
            if slot_step is not None:
                assign_own_copies(strategy, [slot_step], [tf.zeros_like(slot_step)])

    def snapshot_in_replica(self, strategy: tf.distribute.Strategy, variables: Dict[str, tf.Variable]):
        """Overlapped syncs, after the update a sync starts at: this replica's change since the
        anchor, kept until :meth:`reduce_in_replica` sends it."""
        names = sorted(variables)
        assign_own_copies(strategy, [self.pending[name] for name in names],
                          self._changes(names, [variables[name] for name in names]))

    def reduce_in_replica(self, strategy: tf.distribute.Strategy, names: List[str],
                          collective: Collective = mean_over_all_replicas):
        """Overlapped syncs: the snapshot's mean over all replicas (as it travels), in its place.
        Touches no parameter, so it may run while steps train."""
        pending = [self.pending[name] for name in sorted(names)]
        assign_own_copies(strategy, pending, self._mean_changes(strategy, sorted(names),
                                                                [tf.identity(p) for p in pending], collective))

    def apply_in_replica(self, strategy: tf.distribute.Strategy, variables: Dict[str, tf.Variable], *,
                         learning_rate: tf.Tensor):
        """Overlapped syncs, after the update the sync's delay ends at: the new model from the anchor
        and the reduced mean change (the outer step, as an immediate sync makes it), mixed into
        this replica's copy as it is now."""
        names = sorted(variables)
        new_values = self.apply_mean_change(strategy, names, [tf.identity(self.anchors[name]) for name in names],
                                            [tf.identity(self.pending[name]) for name in names], learning_rate)
        params = [variables[name] for name in names]
        mix = self.overlapped_mix
        assign_own_copies(strategy, params, [mix * tf.cast(var, tf.float32) + (1 - mix) * new
                                             for var, new in zip(params, new_values)])

    def _changes(self, names: List[str], params: List[tf.Variable]) -> List[tf.Tensor]:
        return [tf.cast(var, tf.float32) - self.anchors[name] for name, var in zip(names, params)]

    def _mean_changes(self, strategy, names: List[str], changes: List[tf.Tensor], collective: Collective):
        """The mean over all replicas of each replica's ``changes`` as they travel in ``sync_dtype``
        (float32). Quantized: all-gathered and decoded (``collective`` is all replicas then), each
        replica's rounding error kept for its next sync with error feedback."""
        if self.quantized is None:
            return [tf.cast(m, tf.float32) for m in collective([tf.cast(c, self.sync_dtype) for c in changes])]
        if self.error_feedback:
            changes = [change + self.residuals[name] for name, change in zip(names, changes)]
        means, own = self.quantized.mean(strategy, changes)
        if self.error_feedback:
            assign_own_copies(strategy, [self.residuals[name] for name in names],
                              [change - sent for change, sent in zip(changes, own)])
        return means

    def apply_mean_change(self, strategy, names: List[str], anchors: List[tf.Tensor], mean_changes: List[tf.Tensor],
                          learning_rate: tf.Tensor) -> List[tf.Tensor]:
        """The new model from the anchor (``anchors``: its values before this sync) and the
        replicas' mean change since it, which also becomes the anchor. Plain averaging: their sum
        (the mean of the copies)."""
        new_values = [anchor + change for anchor, change in zip(anchors, mean_changes)]
        assign_own_copies(strategy, [self.anchors[name] for name in names], new_values)
        return new_values

    # ---- accounting ----------------------------------------------------------------------------

    def bytes_per_replica(self, variables: Dict[str, tf.Variable], slots: Optional[Dict[str, Sequence[tf.Variable]]] = None) -> int:
        """Bytes one replica contributes to the collective of a sync of ``variables``."""
        values = sum(var.shape.num_elements() for var in variables.values())
        total = self.quantized.payload_bytes(values) if self.quantized else values * self.sync_dtype.size
        if slots and self.optimizer_state_at_sync == "average":
            total += sum(slot.shape.num_elements() * slot.dtype.size for name in variables for slot in slots.get(name, ()))
        return total
