"""Building a RETURNN ``TFNetwork`` inside a replica's trace of a ``tf.function``.

RETURNN's TF backend is written for TF1 graphs and sessions. This module makes its network
construction run inside ``strategy.run(step_fn, ...)`` (see FACTS.md):

* :func:`in_process_config` starts RETURNN for a config made in this process, as the command
  line starts it for a file (with :func:`returnn_tpu.patches.setup_returnn`, where every patch
  of TensorFlow and RETURNN is).
* :class:`returnn_tpu.returnn_side.variable_cache.VariableCache` creates each ``tf.compat.v1.get_variable``
  once (as a distributed variable when a strategy scope is active) and hands the same object to
  every later trace, and :meth:`VariableCache.carry_over` fills re-created parameters after a
  network change.
* :class:`NetworkBuilder` builds one network per replica per trace from fresh extern data
  (:mod:`returnn_tpu.returnn_side.network_inputs`), with a fresh variable store and fresh variable
  collections, and a per-replica random seed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import tensorflow as tf

from returnn_tpu.datapath.batching import size_key
from returnn_tpu.errors import ConfigError, refused_by_returnn
from returnn_tpu.returnn_side.network_inputs import extern_data_template, fresh_dims
from returnn_tpu.patches import drawing_from, fresh_tf1_state, random_ops_keyed_by, setup_returnn
from returnn_tpu.returnn_side.variable_cache import VariableCache


class StepRandomSource:
    """What RETURNN's random generator gives its ``StatelessRandomSeed``, without a state variable.

    RETURNN draws a (key, counter) pair from a ``tf.random.Generator`` whose state advances at every
    draw. A variable of that kind, created inside a replica's trace, would be shared by the replicas
    or need a strategy of its own; instead the key is the replica's network seed and the counter is
    (update step, draw within this build), so every replica, update and draw gets its own numbers,
    reproducibly. The micro-batches of one ``accum_grad_multiple_step`` update share them.
    """

    algorithm = 1  # Philox, TensorFlow's default generator algorithm (its counter is two uint64)

    def __init__(self, seed, step: Optional[tf.Variable]):
        self.seed, self.step, self.draws = seed, step, 0  # seed: an int, or (shared build) an int64 tensor

    def _prepare_key_counter(self, shape):
        del shape  # each draw has a counter of its own, whatever its size
        self.draws += 1
        step = tf.zeros([], tf.int64) if self.step is None else tf.cast(self.step, tf.int64)
        counter = tf.bitcast(tf.stack([step, tf.constant(self.draws, tf.int64)]), tf.uint64)
        return tf.reshape(tf.bitcast(tf.cast(self.seed, tf.int64), tf.uint64), [1]), counter


@dataclasses.dataclass
class SharedBuild:
    """The inputs of a network build that all local replicas share (a function traced once and
    called by each replica with its own values; FACTS.md, "One trace for all replicas").

    :ivar variables: the replica's parameters (and other variables) by name, as variables over
        the function's resource-handle inputs.
    :ivar replica_seed: the replica's network seed (int64 scalar), which keys its random numbers.
    """

    variables: Dict[str, tf.Variable]
    replica_seed: tf.Tensor


def in_process_config(values: Mapping[str, Any]):
    """A RETURNN ``Config`` of ``values`` for a trainer made in this process (tests, ``--check``,
    benchmarks), with RETURNN started as the command line starts it for a config file: its TF code
    set up (:func:`returnn_tpu.patches.setup_returnn`), the config global, its backend selected
    (:func:`returnn_tpu.startup.select_backend`), RETURNN's log to no file and silent."""
    from returnn.config import Config, set_global_config
    from returnn.log import log

    from returnn_tpu.startup import select_backend

    setup_returnn()  # before RETURNN's config module turns eager execution off
    config = Config(dict(values))
    set_global_config(config)
    select_backend(config)
    log.initialize(logs=[], verbosity=[0])
    return config


@contextlib.contextmanager
def without_summaries() -> Iterator[None]:
    """TF1 summary ops (RETURNN adds some for the loss) become no-ops: XLA has no kernel for them."""
    summary = tf.compat.v1.summary
    names = ("scalar", "histogram", "image", "audio", "text")
    saved = {name: getattr(summary, name) for name in names}
    for name in names:
        setattr(summary, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(summary, name, function)


def check_xla_compatible(net_dict: Mapping[str, dict], prefix: str = ""):
    """Stops (ConfigError) on layers XLA cannot compile, naming the layer and the alternative.

    ``rec`` units that are RETURNN native ops (``nativelstm2``, ``lstm``, ...) have no XLA kernel;
    a ``rec`` subnetwork (a dict unit) loops over dynamically sized TensorArrays, which XLA refuses.
    """
    from returnn.tf.layers.rec import RecLayer
    from returnn.tf.native_op import RecSeqCellOp

    for name, opts in net_dict.items():
        if not isinstance(opts, dict):
            continue
        if opts.get("class") == "rec":
            unit = opts.get("unit", "lstm")
            if isinstance(unit, dict):
                raise ConfigError(
                    f"layer {prefix + name!r}: a rec subnetwork (dict unit) cannot be compiled by XLA "
                    "(dynamically sized TensorArrays); use distribute_options['jit_compile'] = False"
                )
            cell_class = RecLayer.get_rnn_cell_class(unit) if isinstance(unit, str) else None
            if cell_class is not None and issubclass(cell_class, RecSeqCellOp):
                raise ConfigError(
                    f"layer {prefix + name!r}: rec unit {unit!r} is a native op without an XLA kernel; "
                    "with jit_compile use unit 'standardlstm'"
                )
        if isinstance(opts.get("subnetwork"), dict):
            check_xla_compatible(opts["subnetwork"], prefix=f"{prefix}{name}/")


@dataclasses.dataclass
class NetworkInfo:
    """What a throwaway construction of the network tells (see :meth:`NetworkBuilder.inspect`)."""

    extern_data: Any  # RETURNN ExternData; the templates (dtypes, dynamic axes) for padding batches
    recurrent: bool
    used_data_keys: List[str]
    layer_classes: Dict[str, str]
    output_layer_params: List[str]  # variable names of the output layers (pretrain may re-initialize them)
    param_shapes: Dict[str, List[int]]  # every parameter's shape by variable name


class NetworkBuilder:
    """Builds a network dict inside replica traces, all networks sharing one
    :class:`returnn_tpu.returnn_side.variable_cache.VariableCache`.

    :meth:`use_network` sets the network (the config's ``network``, or one per epoch, see
    :class:`returnn_tpu.returnn_side.networks.EpochNetworks`); :meth:`build` constructs it in a trace.
    """

    def __init__(self, config, net_dict: Optional[Dict[str, Any]] = None):
        setup_returnn()
        self.config = config
        self.net_dict = net_dict if net_dict is not None else config.typed_value("network")
        if not isinstance(self.net_dict, dict):
            raise ConfigError("network must be a dict of layers (or define get_network(epoch))")
        self.net_seed = config.int("random_seed", 42)
        self.train_param_args: Dict[str, Any] = {}
        self.variables = VariableCache()

    def use_network(self, net_dict: Dict[str, Any], *, seeds: Tuple[int, int], train_param_args=None,
                    allow_new_shapes: bool = False, reset=()):
        """Later builds construct ``net_dict``; ``seeds`` (network seed, TF graph seed) seed its
        initializers as RETURNN seeds the network of that epoch; ``reset`` names parameters to
        initialize afresh."""
        self.net_dict = net_dict
        self.net_seed, graph_seed = seeds
        self.train_param_args = dict(train_param_args or {})
        self.variables.start_network(allow_new_shapes=allow_new_shapes, graph_seed=graph_seed, drop=reset)

    def inspect(self) -> "NetworkInfo":
        """Builds the network once in a throwaway TF1 graph, to learn what batching needs.

        RETURNN batches differently for recurrent and non-recurrent networks and reads only the
        data keys the network uses; both are known only after construction.
        """
        from returnn.tf.network import LayerNotFound, TFNetwork

        with tf.Graph().as_default():
            try:
                extern_data = extern_data_template(self.config, placeholders=True)
            except Exception as exc:  # noqa: BLE001 (RETURNN's checks of the data's options raise any type)
                raise refused_by_returnn("extern_data", "the network's inputs", exc) from None
            net = TFNetwork(config=self.config, extern_data=extern_data, train_flag=True, eval_flag=True)
            try:
                net.construct_from_dict(self.net_dict)
            except LayerNotFound as exc:  # a "from" (or another reference) naming no layer: the user's typo
                raise ConfigError(f"network: {str(exc).split(' in <')[0]}; a 'from' or another option names a layer "
                                  "that the network does not have") from None
            except Exception as exc:  # noqa: BLE001 (a layer's options checked by RETURNN: any type)
                raise refused_by_returnn("network", "the network", exc) from None
            return NetworkInfo(
                extern_data=extern_data,
                recurrent=bool(net.recurrent),
                used_data_keys=sorted(net.get_used_data_keys()),
                layer_classes={name: layer.layer_class for name, layer in net.layers.items()},
                output_layer_params=sorted(
                    v.name.split(":")[0] for layer in net.get_output_layers() for v in layer.params.values()
                ),
                param_shapes={v.name.split(":")[0]: v.shape.as_list() for v in sorted(net.get_params_list(), key=lambda v: v.name)},
            )

    def replica_seed(self, replica_id: int) -> int:
        """The network seed of replica ``replica_id`` (FACTS.md, "Seeds per replica")."""
        return self.net_seed + 1000 * replica_id

    def build(self, inputs: Mapping[str, tf.Tensor], *, train: bool, replica_id: int, global_step=None,
              shared: Optional[SharedBuild] = None):
        """Builds a ``TFNetwork`` on ``inputs`` (data keys and ``size:<key>:<axis>`` lengths).

        Call inside a replica's trace. ``replica_id`` offsets the random seed, so replicas drop
        different units (FACTS.md, "Seeds per replica"). ``global_step`` (the optimizer's step
        counter) is what the network's ``global_train_step`` reads (SpecAugment-style schedules
        do). With ``shared``, the build is one function that every local replica calls: the
        parameters are ``shared.variables`` (none is created) and ``shared.replica_seed`` keys
        the random numbers. Returns the network and its trainable parameters as ``(name,
        variable)`` pairs sorted by name (the same order on every replica).
        """
        from returnn.tf.network import TFNetwork
        from returnn.tf.util.data import BatchInfo

        dims = fresh_dims(self.config)
        net_dict = copy.deepcopy(self.net_dict, dict(dims)) if dims else self.net_dict
        extern_data = extern_data_template(self.config, dims=dims)
        for key, data in list(extern_data.data.items()):
            if key not in inputs:
                del extern_data.data[key]
                continue
            # A fresh tensor per replica: RETURNN attaches attributes to tensor objects
            # (FACTS.md, "Extern data per trace").
            data.placeholder = tf.identity(inputs[key])
            # A dim shared by several data keys gets its sizes from the first of them.
            data.size_placeholder = {
                axis: tf.identity(inputs[size_key(key, axis)])
                for axis, dim in enumerate(data.shape)
                if dim is None and not _has_sizes(data.get_dim_tag(data.get_batch_axis(axis)))
            }
            # Dims made without placeholders stay "undefined" after their sizes are set, and a layer's
            # own undefined dim (an eval layer's out_type in a rec loop) would then not be replaced
            # by them (FACTS.md, "Extern data per trace"). RETURNN's own placeholders are defined.
            for dim in data.dims:
                if dim.is_dynamic() and dim._extra is not None:
                    dim._extra.undefined = False
        first_input = next(d for d in extern_data.data.values() if d.placeholder is not None and d.have_batch_axis())
        batch = tf.shape(first_input.placeholder)[first_input.batch_dim_axis]
        if dims:  # the copies know no batch yet
            extern_data.set_batch_info(BatchInfo.make_global_batch_info(batch))
        else:  # the batch info of extern_data_template is a stand-in, which its dims refer to
            extern_data.get_batch_info().dim = batch
            extern_data.init_batch_info()
        seed = shared.replica_seed if shared else self.replica_seed(replica_id)
        self.variables.start_build()
        creator = functools.partial(self.variables.lend, shared.variables) if shared else self.variables.creator
        random_ops = random_ops_keyed_by(seed, global_step) if shared else contextlib.nullcontext()
        with fresh_tf1_state(), tf.variable_creator_scope(creator), _layer_templates_unlogged(), \
                drawing_from(StepRandomSource(seed, global_step)), random_ops:
            net = TFNetwork(
                config=self.config,
                extern_data=extern_data,
                rnd_seed=self.replica_seed(replica_id),
                # RETURNN evaluates with its train-flag placeholder fed False, not a Python False:
                # a Python False removes the losses of rec subnetworks (FACTS.md, "Eval networks").
                train_flag=True if train else tf.constant(False),
                eval_flag=True,
            )
            if global_step is not None:
                net._global_train_step_var = global_step  # else RETURNN makes its own, outside the trace
            net.construct_from_dict(net_dict)
            net.declare_train_params(**self.train_param_args)
            net.maybe_construct_objective()
            # RETURNN reads the TRAINABLE_VARIABLES collection here, so ask while it is ours.
            params = sorted((v.name.split(":")[0], v) for v in net.get_trainable_params())
        return net, params


@contextlib.contextmanager
def _layer_templates_unlogged():
    """RETURNN's log at verbosity 3 and above off: the layer templates (``layer /'fw0': [B,T,F]``)
    that it prints at every construction, here once per replica and trace. :meth:`NetworkBuilder.inspect`
    builds each network once with the log on, so the log has them once, as plain RETURNN's has."""
    from returnn.log import StreamDummy, log

    saved = log.v3, log.v4, log.v5
    log.v3 = log.v4 = log.v5 = StreamDummy()
    try:
        yield
    finally:
        log.v3, log.v4, log.v5 = saved


def _has_sizes(dim) -> bool:
    return dim.dyn_size_ext is not None and dim.dyn_size_ext.placeholder is not None


def loss_metrics(net, *, train: bool) -> Dict[str, tf.Tensor]:
    """Per-batch sums behind RETURNN's epoch scores, from RETURNN's own ``get_fetches_dict``.

    For every loss ``name`` that RETURNN fetches in this mode (losses inside ``rec`` subnetworks
    included; eval-only losses only when not training): ``cost:name`` and ``error:name`` (sums,
    where the loss has them) and ``frames:name`` (the inverse of RETURNN's loss norm factor).
    The epoch score is ``sum(cost) / sum(frames)``, as RETURNN's runner computes it.
    """
    fetches = net.get_fetches_dict(should_train=train, should_eval=True, with_summary=False, with_size=False)
    metrics = {}
    for key, value in fetches.items():
        if key.startswith(("cost:", "error:")):
            metrics[key] = tf.cast(value, tf.float32)
        elif key.startswith("loss_norm_factor:"):
            metrics["frames:" + key.split(":", 1)[1]] = 1.0 / tf.cast(value, tf.float32)
    return metrics


def static_replica_id() -> int:
    """The replica's index as a Python int, at trace time (0 outside a strategy)."""
    replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
    value = tf.get_static_value(replica_id)
    return int(value) if value is not None else 0
