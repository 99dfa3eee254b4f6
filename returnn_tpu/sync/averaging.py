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

from returnn_tpu.strategies import per_replica

Collective = Callable[[List[tf.Tensor]], List[tf.Tensor]]
OPTIMIZER_STATE_POLICIES = ("keep", "average", "reset")


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
        the parameters.
    :param optimizer_state_at_sync: what happens to each replica's optimizer slots (Adam's
        moments) at a sync: ``"keep"`` (each replica continues with its own), ``"average"``
        (replaced by their mean, which doubles Adam's traffic), ``"reset"`` (zero, and the bias
        correction restarts, as for a new optimizer).
    :param keep_synced_model: keep the model of the last sync (the anchor) also where the sync
        does not need it: with several workers, a survivor of a lost peer saves it
        (docs/faults.md, "A lost worker").
    """

    uses_anchor = False  # whether every sync needs the model of the last sync (variants: True)

    def __init__(self, sync_dtype: str = "float32", optimizer_state_at_sync: str = "keep",
                 keep_synced_model: bool = False):
        self.sync_dtype = tf.as_dtype(sync_dtype)
        self.optimizer_state_at_sync = optimizer_state_at_sync
        self.keep_synced_model = keep_synced_model
        self.anchors: Dict[str, tf.Variable] = {}  # parameter name -> the model of the last sync

    @property
    def syncs_changes(self) -> bool:
        """Whether a sync sends each replica's change since the anchor (outer optimizers, and types
        other than float32), rather than the parameters themselves."""
        return self.uses_anchor or self.sync_dtype != tf.float32

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
        if not self.keeps_anchor:
            return
        with strategy.scope():
            for name, var in variables.items():
                if name not in self.anchors:
                    self.anchors[name] = tf.Variable(
                        tf.zeros(var.shape, tf.float32), trainable=False, name=f"{name}/local_sgd_anchor"
                    )

    def state_variables(self) -> Dict[str, tf.Variable]:
        """The state a checkpoint holds, by checkpoint name."""
        return {var.name.split(":")[0]: var for var in self.anchors.values()}

    def forget_state(self):
        """A new network: its state is created anew (anchors from its parameters)."""
        self.anchors = {}

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
            anchors = [self.anchors[name] for name in names]
            changes = [tf.cast(var, tf.float32) - anchor for var, anchor in zip(params, anchors)]
            mean_changes = [tf.cast(m, tf.float32) for m in collective([tf.cast(c, self.sync_dtype) for c in changes])]
            new_values = self.apply_mean_change(
                strategy, names, [tf.identity(a) for a in anchors], mean_changes, learning_rate
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
        total = sum(var.shape.num_elements() * self.sync_dtype.size for var in variables.values())
        if slots and self.optimizer_state_at_sync == "average":
            total += sum(slot.shape.num_elements() * slot.dtype.size for name in variables for slot in slots.get(name, ()))
        return total
