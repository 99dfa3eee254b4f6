"""How one sync runs, written once for both drivers of local SGD: the RETURNN trainer's host
driver (:class:`returnn_tpu.strategies.sync.lifecycle.LocalSGDSyncs`, which runs a sync between
steps or inside the TPU step) and a TF2 program's traced driver
(:class:`returnn_tpu.strategies.local_sgd.ScheduledLocalSGDMixin`, which runs it in the program
after an update). The schedule (:mod:`.schedule`) says which fragments are due; the engine says
what their sync does; the averaging (:mod:`.averaging` and its variants) how copies combine.

Every method named ``..._in_replica`` runs in replica context on every replica; each driver
wraps it in its own ``strategy.run``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from returnn_tpu.strategies.sync.averaging import ParameterAveraging, mean_over_all_replicas, mean_within_groups
from returnn_tpu.strategies.sync.fragments import split_into_fragments

Variables = Callable[[], Dict[str, tf.Variable]]  # the trainable variables by name (or key)


class SyncEngine:
    """The syncs of one strategy's copies: the fragment table of its trainable variables, the
    combination of a fragment's copies (immediate, worker-local, or overlapped in three parts:
    snapshot, all-reduce, apply), the one model at a start, and the bytes a sync sends.

    ``variables()`` gives the trainable variables (the table follows when variables are added);
    ``optimizer`` (the trainer's: ``slots_by_variable()``, ``slot_step``) is what
    ``optimizer_state_at_sync`` acts on; None: a TF2 program's optimizer, which the strategy does
    not see."""

    def __init__(self, strategy: tf.distribute.Strategy, averaging: ParameterAveraging, num_fragments: int):
        self.strategy = strategy
        self.averaging = averaging
        self.num_fragments = num_fragments
        self._variables: Variables = dict
        self._optimizer = None
        self._table = (None, [])  # (the variables' names when split, their fragments)

    @property
    def local_replicas(self) -> int:
        """This worker's replicas (read when first needed: a strategy's extended may be made first)."""
        return len(self.strategy.extended.worker_devices)

    def attach(self, variables: Variables, optimizer=None):
        """The variables to sync from now on (a new network's), and the optimizer updating them."""
        self._variables, self._optimizer = variables, optimizer
        self._table = (None, [])

    @property
    def fragments(self) -> List[List[str]]:
        """The names of each fragment (``sync_fragments`` lists of about equal bytes; a model of
        fewer variables than fragments leaves some empty), split alike on every worker."""
        variables = self._variables()
        names = tuple(variables)
        if self._table[0] != names:
            sizes = {name: var.shape.num_elements() * var.dtype.size for name, var in variables.items()}
            self._table = (names, split_into_fragments(sizes, self.num_fragments))
        return self._table[1]

    def fragment_variables(self, fragments: Sequence[int]) -> Dict[str, tf.Variable]:
        """The variables of the fragments numbered ``fragments``."""
        variables = self._variables()
        table = self.fragments
        return {name: variables[name] for index in fragments for name in table[index]}

    def sync_bytes(self, fragments: Sequence[int], local: bool = False) -> int:
        """Bytes this worker hands to the collective of one sync of ``fragments`` (0 for a
        worker-local round or a single replica: nothing leaves the worker)."""
        if self.strategy.num_replicas_in_sync == 1 or local:
            return 0
        return self.local_replicas * self.averaging.bytes_per_replica(self.fragment_variables(fragments),
                                                                      self._slots())

    def synced_model(self) -> Optional[Dict[str, tf.Variable]]:
        """The model of the last sync (name -> float32 variable), which every worker holds where
        the averaging keeps it (an anchor: DiLoCo, quantized syncs, several workers); else None."""
        return self.averaging.anchors if self.averaging.keeps_anchor else None

    def _slots(self) -> Optional[dict]:
        return self._optimizer.slots_by_variable() if self._optimizer is not None else None

    # ---- in replica context ----------------------------------------------------------------------

    def start_in_replica(self):
        """All copies, on all workers, one model and the averaging's anchor (no outer step): at a
        network's start, whatever each worker loaded, and when local SGD starts after a warm-up."""
        self.averaging.start_in_replica(self.strategy, self._variables())

    def sync_in_replica(self, fragments: Sequence[int], learning_rate, local: bool = False):
        """The sync of the fragments numbered ``fragments`` over all replicas; ``local``: a
        worker-local round (``local_param_sync_step``) of every variable, each worker's replicas
        among themselves, with no outer step (the anchor and outer state are the global syncs')."""
        self.averaging.sync_in_replica(
            self.strategy,
            self._variables() if local else self.fragment_variables(fragments),
            mean_within_groups(self.local_replicas) if local else mean_over_all_replicas,
            learning_rate=learning_rate,
            slots=self._slots(),
            slot_step=self._optimizer.slot_step if self._optimizer is not None else None,
            outer_step=not local,
        )

    def snapshot_in_replica(self, fragments: Sequence[int]):
        """Overlapped sync, after the update it starts at: each replica's change of ``fragments``."""
        self.averaging.snapshot_in_replica(self.strategy, self.fragment_variables(fragments))

    def reduce_in_replica(self, fragments: Sequence[int]):
        """Overlapped sync: the snapshot's mean over all replicas. Touches no parameter, so it may
        run while steps train."""
        self.averaging.reduce_in_replica(self.strategy, list(self.fragment_variables(fragments)))

    def apply_in_replica(self, fragments: Sequence[int], learning_rate):
        """Overlapped sync, after the update its delay ends at: the outer step from the reduced
        mean, mixed into each replica's copy."""
        self.averaging.apply_in_replica(self.strategy, self.fragment_variables(fragments), learning_rate=learning_rate)
