"""The network's variables, created once and handed to every trace of every replica.

RETURNN's layers ask ``tf.compat.v1.get_variable`` for their parameters at every network build,
and here a network is built once per replica per trace. :class:`VariableCache` is the variable
creator of those builds: it creates each variable once (a distributed variable under a strategy
scope), with the initial value RETURNN's graph would give it, puts it where RETURNN's layers look
for it, and keeps what a network change re-created, for
:meth:`VariableCache.carry_over`. A module of its own because it is the one state
that outlives the builds of :class:`returnn_tpu.returnn_side.returnn_bridge.NetworkBuilder`.
"""

from __future__ import annotations

from typing import Dict, Optional

import tensorflow as tf

from returnn_tpu.patches import SharedBuildUnsupported


class VariableCache(tf.Module):
    """The network's variables by RETURNN name, created once and reused by every trace.

    Used as a ``tf.variable_creator_scope`` creator. A variable that does not exist yet is
    created under ``tf.init_scope()``, so it outlives the trace and, under ``strategy.scope()``,
    becomes a distributed variable (FACTS.md, "Variables in a trace"). Every variable handed out
    is also added to the trace's GLOBAL_VARIABLES (and TRAINABLE_VARIABLES) collection, because
    RETURNN's ``rec`` layer finds its parameters there (FACTS.md, "Variable collections").

    When the network changes between epochs (``pretrain``, ``get_network``), variables of the
    same name and shape carry over; one asked for with another shape is created anew (RETURNN
    initializes it) and the old one is kept in :attr:`replaced` for
    :meth:`carry_over`.
    """

    def __init__(self):
        super().__init__(name="returnn_params")
        self.by_name: Dict[str, tf.Variable] = {}
        self.in_network: set = set()  # names the current network uses (what a checkpoint holds)
        self.replaced: Dict[str, tf.Variable] = {}  # old variables whose new network wants another shape
        self.allow_new_shapes = False
        self.graph_seed = 42  # TF graph-level seed of the initializers (RETURNN's per-network seed)

    def start_network(self, *, allow_new_shapes: bool, graph_seed: int, drop=()):
        """Starts a new network: ``drop`` names are initialized afresh, other names carry over."""
        self.graph_seed = graph_seed
        for name in drop:
            self.by_name.pop(name, None)
        self.in_network = set()
        self.replaced = {}
        self.allow_new_shapes = allow_new_shapes

    def creator(self, next_creator, **kwargs):
        name = kwargs["name"]
        var = self.by_name.get(name)
        if var is not None and self._asked_with_other_shape(var, kwargs):
            if not self.allow_new_shapes:
                raise ValueError(f"parameter {name} exists with shape {var.shape}, asked for {kwargs.get('shape')}")
            self.replaced[name] = var
            var = None
        if var is None:
            # A TF1 caching device (a function of the op, which dynamic_rnn sets) means nothing to an
            # eager variable, and tf.device refuses a function there.
            kwargs.pop("caching_device", None)
            with tf.init_scope():
                if callable(kwargs.get("initial_value")):
                    kwargs["initial_value"] = self.initial_value_as_in_graph(kwargs["initial_value"])
                var = next_creator(**kwargs)
            self.by_name[name] = var
        self.in_network.add(name)
        self._add_to_collections(var, kwargs.get("trainable", True))
        return var

    def start_build(self):
        """Makes the next network build each variable's first, as every build is in plain RETURNN.

        ``LayerBase.add_param`` takes the variables of a layer with ``"trainable": False`` out of the
        build's TRAINABLE_VARIABLES only where it sees a variable for the first time (its
        ``RETURNN_layer`` unset); these variables outlive a build, so a second build would train
        a frozen layer (FACTS.md, "Frozen layers")."""
        for var in self.by_name.values():
            if getattr(var, "RETURNN_layer", None) is not None:
                var.RETURNN_layer = None

    @staticmethod
    def _asked_with_other_shape(var: tf.Variable, kwargs) -> bool:
        return tuple(var.shape) != tuple(tf.TensorShape(kwargs.get("shape") or var.shape))

    @staticmethod
    def _add_to_collections(var: tf.Variable, trainable: bool):
        graph = tf.compat.v1.get_default_graph()
        collections = [tf.compat.v1.GraphKeys.GLOBAL_VARIABLES]
        if trainable:
            collections.append(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
        for key in collections:
            if not any(v is var for v in graph.get_collection(key)):
                graph.add_to_collection(key, var)

    def lend(self, variables: Dict[str, tf.Variable], next_creator, **kwargs):
        """A creator for a shared build: hands out ``variables[name]``, creates nothing."""
        del next_creator
        var = variables.get(kwargs["name"])
        if var is None or self._asked_with_other_shape(var, kwargs):
            raise SharedBuildUnsupported(f"parameter {kwargs['name']} was not made by the network's first build")
        self._add_to_collections(var, kwargs.get("trainable", True))
        return var

    def initial_value_as_in_graph(self, initial_value):
        """The value RETURNN's initializer gives in a TF1 graph seeded with :attr:`graph_seed`.

        RETURNN gives several initializers the same op seed; in a graph each such op starts the
        same random sequence, while eager ops with one seed continue a shared one (FACTS.md,
        "RETURNN's seeds"). A throwaway graph per variable reproduces plain RETURNN's values.
        Initializers that need tensors of the trace keep the eager path.
        """
        graph = tf.Graph()
        try:
            with graph.as_default():
                tf.compat.v1.set_random_seed(self.graph_seed)
                tensor = initial_value()
                with tf.compat.v1.Session(graph=graph) as session:
                    return session.run(tensor)
        except (ValueError, TypeError, tf.errors.OpError):
            return initial_value

    def network_variables(self) -> Dict[str, tf.Variable]:
        """The current network's variables by name."""
        return {name: self.by_name[name] for name in sorted(self.in_network)}

    def carry_over(self, copy_param_mode: Optional[str], first_copy, log_file=None):
        """After a network change: fills re-created parameters from their old values where RETURNN would.

        With ``copy_param_mode = "subset"`` the old values fill the overlapping part of the new shape
        (RETURNN's ``copy_with_new_split_axes``, honouring LSTM-style split axes); otherwise the new
        parameter keeps its fresh initialization, as in RETURNN. ``first_copy(var)`` is a variable's
        value in cross-replica context.
        """
        from returnn.tf.util import basic as tf_util

        for name, old in sorted(self.replaced.items()):
            new = self.by_name[name]
            old_values, new_values = first_copy(old), first_copy(new)
            if copy_param_mode != "subset" or old_values.ndim != new_values.ndim:
                print(f"Will not set param {name!r} because its shape {list(new.shape)} != {list(old.shape)}.",
                      file=log_file)
                continue
            split_info = tf_util.get_param_axes_split_info(new)
            if split_info:
                old_splits = tf_util.transform_param_axes_split_info_to_new_shape(
                    split_info, old_values.shape, debug_name=name)
            else:
                old_splits, split_info = [[d] for d in old_values.shape], [[d] for d in new_values.shape]
            print(f"Param {name!r}: transform old values of shape {list(old.shape)} into new shape {list(new.shape)}.",
                  file=log_file)
            new.assign(tf_util.copy_with_new_split_axes(old_splits, split_info, old_values, new_values))
        self.replaced = {}
