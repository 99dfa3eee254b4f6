"""Every place where returnn_tpu reaches into TensorFlow's or RETURNN's internals, so that a
TensorFlow or RETURNN upgrade that changes one breaks here, and its test (named with each) fails.

* :func:`setup_returnn` imports RETURNN's TF code and turns TF2 behaviour back on, then patches,
  once per process: distributed variables accept RETURNN's ``set_shape``; RETURNN's root graph is
  the trace (FACTS.md, "RETURNN's root graph"; tests/test_parity.py, the loop configs); RETURNN's
  gradient definitions reach a ``GradientTape`` (FACTS.md, "Gradients under a tape";
  tests/test_bridge.py); TensorFlow's stateful random ops can be routed to stateless ones
  (:func:`random_ops_keyed_by`; FACTS.md, "One trace for all replicas"; tests/test_shared_trace.py);
  TensorFlow's ``static_rnn`` unrolls without ``tf.cond`` (FACTS.md, "Unrolled recurrences";
  tests/test_bridge.py, tests/configs/unrolled_maxgradnorm.config).
* Helpers on TensorFlow's private API for a network build: :func:`fresh_tf1_state` (a fresh TF1
  variable store and collections; FACTS.md, "Shared TF1 state"), :func:`variables_over_handles`
  (variables over a function's resource inputs), :func:`function_graph` (a graph traced once).
* :class:`BackgroundCalls`: a function called from this thread that runs on an asynchronous
  eager executor (FACTS.md, "Overlapped syncs"; tests/test_multi_worker.py, the overlapped run).

Nothing else in the package outside ``strategies/`` imports ``tensorflow.python``
(tests/test_imports.py).
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from typing import Iterator, List

import tensorflow as tf
from tensorflow.python.framework import func_graph as _func_graph

_RETURNN_READY = False


def setup_returnn():
    """Imports RETURNN's TF backend and restores the TF2 settings it turns off. Idempotent.

    Process-wide, independent of any config:

    * Native ops are built without CUDA when TensorFlow has no GPU support (FACTS.md, "Native ops").
    * ``returnn.tf.compat`` disables eager execution, v2 shapes and control flow v2; RETURNN keeps
      tensors and variables in sets and dict keys, so tensor equality goes off (FACTS.md, "TF2 mode").
    * ``NativeLstm2`` calls ``set_shape`` on its weights; distributed variables refuse that, so
      they get a ``set_shape`` that checks the shape is compatible (FACTS.md, "set_shape").
    """
    global _RETURNN_READY
    if _RETURNN_READY:
        return
    if not tf.test.is_built_with_cuda():
        os.environ.setdefault("DISABLE_CUDA", "1")
    import returnn.tf.compat  # noqa: F401  (side effects undone below)
    from tensorflow.python.distribute import values as tf_values

    tf.compat.v1.enable_eager_execution()
    tf.compat.v1.enable_v2_tensorshape()
    tf.compat.v1.enable_control_flow_v2()
    tf.compat.v1.disable_tensor_equality()

    def set_shape_if_compatible(self, shape):
        if not self.shape.is_compatible_with(shape):
            raise ValueError(f"variable {self.name} has shape {self.shape}, not compatible with {shape}")

    tf_values.DistributedVariable.set_shape = set_shape_if_compatible
    _make_returnn_gradients_tape_aware()
    _make_the_trace_returnns_root_graph()
    _route_stateful_random_ops()
    _unroll_recurrences_without_conditionals()
    _RETURNN_READY = True


def _make_the_trace_returnns_root_graph():
    """RETURNN's "outside of every loop" is the trace, not the graph the trace was started from.

    RETURNN builds what must not depend on a loop iteration (dropout masks of a fully static noise
    shape, weight noise, the LSTM cells' initial states, its random generator) in its *root graph*,
    which with control flow v2 it finds by leaving every function graph. In a TF1 graph that is the
    network's graph; in a ``tf.function`` it is the graph outside the trace, whose tensors the trace
    cannot use ("out of scope"). The root is now the innermost graph that is not a loop or branch
    body: the trace itself, as the TF1 graph was (FACTS.md, "RETURNN's root graph").

    RETURNN's random generator (weight noise, stateless dropout) is a variable it creates in that
    root graph; here each replica's network build gets a :class:`StepRandomSource` instead. A layer
    whose parameter is such a noisy tensor finds its variable again by the variable's handle, which
    in a trace is the handle's capture.
    """
    from returnn.tf.util import basic as tf_util
    from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

    get_root_graph = tf_util.get_root_graph

    def root_graph_of_the_trace(graph=None):
        graph = graph if graph is not None else tf.compat.v1.get_default_graph()
        while isinstance(graph, ControlFlowFuncGraph):
            graph = graph.outer_graph
        return graph if graph.building_function else get_root_graph(graph)

    tf_util.get_root_graph = root_graph_of_the_trace
    get_global_random_generator = tf_util.get_global_random_generator

    def replica_random_generator(*, create: bool = True):
        generator = getattr(_BUILDING, "random_generator", None)
        return generator if generator is not None else get_global_random_generator(create=create)

    tf_util.get_global_random_generator = replica_random_generator
    var_handle_or_ref = tf_util.var_handle_or_ref

    def var_handle_in_the_trace(var):
        # A layer whose parameter is a tensor (weight noise, weight dropout) finds its variable by
        # walking back to the variable's handle; in a trace that is the handle's capture.
        graph = tf_util.get_root_graph()
        if graph.building_function:
            return graph.capture(var.handle)
        return var_handle_or_ref(var)

    tf_util.var_handle_or_ref = var_handle_in_the_trace


def _unroll_recurrences_without_conditionals():
    """TensorFlow's ``static_rnn`` (RETURNN's ``"unroll": True``) selects, not branches, per step.

    With sequence lengths, each unrolled step is two nested ``tf.cond`` (skip the cell past the
    longest sequence, copy states through past the shortest). In a trace every one is control flow
    v2: function graphs per branch, more for each gradient, and more again for a second-order term
    (``maximize_grad_norm``), which made most of a large graph's trace (FACTS.md, "Unrolled
    recurrences"). TensorFlow's own ``skip_conditionals`` path computes the cell at every step and
    selects per sequence with ``tf.where``: the same outputs, states and gradients, without a branch.
    """
    from tensorflow.python.ops import rnn

    rnn_step = rnn._rnn_step

    def rnn_step_selecting(*args, **kwargs):
        kwargs["skip_conditionals"] = True
        return rnn_step(*args, **kwargs)

    rnn._rnn_step = rnn_step_selecting


_BUILDING = threading.local()  # the random source of the network being built (on this replica's thread)


class SharedBuildUnsupported(Exception):
    """The network cannot be built once for all replicas (a random op without a stateless form,
    a parameter the first build did not create); each replica builds its own instead."""


def variables_over_handles(handles: List[tf.Tensor], like: List[tf.Variable]) -> List[tf.Variable]:
    """Variables that read and write through ``handles`` (a function's resource inputs), each with
    the name, shape, dtype and trainability of its counterpart in ``like``."""
    from tensorflow.python.ops import resource_variable_ops

    return [
        resource_variable_ops.BaseResourceVariable(
            # The name without its ":0", which the variable adds (RETURNN keys a layer's params by it).
            trainable=var.trainable, shape=var.shape, dtype=var.dtype, handle=handle,
            handle_name=var.name.rsplit(":", 1)[0], unique_id=f"shared_{var.name}", in_graph_mode=False,
        )
        for handle, var in zip(handles, like)
    ]


@contextlib.contextmanager
def random_ops_keyed_by(replica_seed: tf.Tensor, step) -> Iterator[None]:
    """TensorFlow's stateful random ops, while a shared build runs on this thread, become stateless
    ones keyed by (replica seed, op index, update step, and the iteration of every enclosing
    while loop), so that the replicas calling one traced function draw different numbers, each op
    new ones per update and loop iteration (FACTS.md, "One trace for all replicas")."""
    from tensorflow.python.ops import gen_stateless_random_ops
    from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph, WhileBodyFuncGraph

    step = tf.zeros([], tf.int64) if step is None else tf.cast(tf.convert_to_tensor(step), tf.int64)
    ops_made = [0]

    def next_key():
        ops_made[0] += 1
        key = tf.stack([tf.cast(replica_seed, tf.int64), tf.constant(ops_made[0], tf.int64)])
        key = tf.random.experimental.stateless_fold_in(key, step)
        graph = tf.compat.v1.get_default_graph()
        while isinstance(graph, ControlFlowFuncGraph):
            if isinstance(graph, WhileBodyFuncGraph):  # its first input counts the iterations
                key = tf.random.experimental.stateless_fold_in(key, tf.cast(graph.inputs[0], tf.int64))
            graph = graph.outer_graph
        return key

    # The stateful ops' arguments; their seed attributes are replaced by the key.
    def uniform(shape, dtype, seed=0, seed2=0, name=None):
        return gen_stateless_random_ops.stateless_random_uniform(shape, next_key(), dtype=dtype, name=name)

    def normal(shape, dtype, seed=0, seed2=0, name=None):
        return gen_stateless_random_ops.stateless_random_normal(shape, next_key(), dtype=dtype, name=name)

    def truncated(shape, dtype, seed=0, seed2=0, name=None):
        return gen_stateless_random_ops.stateless_truncated_normal(shape, next_key(), dtype=dtype, name=name)

    def uniform_int(shape, minval, maxval, seed=0, seed2=0, name=None):
        return gen_stateless_random_ops.stateless_random_uniform_int(shape, next_key(), minval, maxval, name=name)

    def multinomial(logits, num_samples, seed=0, seed2=0, output_dtype=tf.int64, name=None):
        return gen_stateless_random_ops.stateless_multinomial(logits, num_samples, next_key(), output_dtype, name=name)

    def refuse(op_name):
        def unsupported(*args, **kwargs):
            raise SharedBuildUnsupported(f"the network uses TensorFlow's {op_name}, which has no stateless form")
        return unsupported

    stateless = (uniform, normal, truncated, uniform_int, multinomial)
    _SHARED_RANDOM.ops = {**dict(zip(_STATEFUL_WITH_STATELESS, stateless)),
                          **{name: refuse(name) for name in _STATEFUL_WITHOUT_STATELESS}}
    try:
        yield
    finally:
        _SHARED_RANDOM.ops = None


# TensorFlow's stateful random ops (gen_random_ops), with a stateless form and without.
_STATEFUL_WITH_STATELESS = ("random_uniform", "random_standard_normal", "truncated_normal", "random_uniform_int",
                            "multinomial")
_STATEFUL_WITHOUT_STATELESS = ("random_shuffle", "random_gamma", "random_poisson", "random_poisson_v2",
                               "parameterized_truncated_normal")
_SHARED_RANDOM = threading.local()  # the stateless replacements while a shared build runs on this thread


def _route_stateful_random_ops():
    """TensorFlow's stateful random ops go to :func:`random_ops_keyed_by`'s replacements while a
    shared build runs on the calling thread, else to TensorFlow's own (process-wide, once)."""
    from tensorflow.python.ops import gen_random_ops

    for name in _STATEFUL_WITH_STATELESS + _STATEFUL_WITHOUT_STATELESS:
        original = getattr(gen_random_ops, name)

        def routed(*args, _name=name, _original=original, **kwargs):
            ops = getattr(_SHARED_RANDOM, "ops", None)
            return _original(*args, **kwargs) if ops is None else ops[_name](*args, **kwargs)

        setattr(gen_random_ops, name, routed)


def _make_returnn_gradients_tape_aware():
    """RETURNN's three ways of defining gradients, made visible to a ``tf.GradientTape``.

    RETURNN builds graphs for ``tf.gradients``; under a tape in a ``tf.function`` (FACTS.md,
    "Gradients under a tape") each of these silently gave no gradient or the default one:

    * ``gradient_override_map`` (``safe_log``'s identity gradient, scaled gradients, ...): the tape
      looked up the op's type, not its override. Ops are now recorded under their override.
    * ``copy_op`` (``safe_log`` on a softmax becomes a log-softmax this way) created ops the tape
      never saw. They are now recorded.
    * ``CustomGradient.register`` (native CTC, synthetic gradients, ...) wraps a TF1 ``Defun``,
      whose gradient function the tape never calls. It is now a ``tf.custom_gradient`` with the
      same forward and gradient functions.
    """
    import types

    from returnn.tf.util import basic as tf_util
    from tensorflow.python.eager import execute

    record_gradient = execute.record_gradient

    def record_gradient_under_override(op_name, inputs, attrs, outputs):
        if outputs and not tf.executing_eagerly():
            try:
                op_name = outputs[0].op.get_attr("_gradient_op_type").decode()
            except (ValueError, AttributeError):
                pass
        return record_gradient(op_name, inputs, attrs, outputs)

    execute.record_gradient = record_gradient_under_override

    copy_op = tf_util.copy_op

    def copy_op_on_tape(op, **kwargs):
        new_op = copy_op(op, **kwargs)
        if new_op.type not in tf_util._copy_op_simple_math_unary_funcs and execute.must_record_gradient():
            attrs = []
            for name in new_op.node_def.attr:
                attrs += [name, new_op.get_attr(name)]
            execute.record_gradient(new_op.type, list(new_op.inputs), tuple(attrs), list(new_op.outputs))
        return new_op

    tf_util.copy_op = copy_op_on_tape

    def register(self, input_types, op, grad_op, name=None):
        del self, name  # no graph-level registration: tf.custom_gradient needs none

        def op_with_new_grad(*inputs):
            inputs = [tf.convert_to_tensor(x, dtype=dtype) for x, dtype in zip(inputs, input_types)]

            @tf.custom_gradient
            def forward(*xs):
                y = op(*xs)

                def backward(*grads):
                    in_grads = grad_op(types.SimpleNamespace(inputs=list(xs), outputs=[y]), *grads)
                    return list(in_grads) if isinstance(in_grads, (list, tuple)) else [in_grads]

                return y, backward

            return forward(*inputs)

        return op_with_new_grad

    tf_util.CustomGradient.register = register


@contextlib.contextmanager
def fresh_tf1_state() -> Iterator[None]:
    """A fresh v1 variable store, empty variable collections and a root variable scope without a
    custom getter, for one network build.

    FuncGraphs share the store and the collections with the outer graph by reference (FACTS.md,
    "Shared TF1 state"); without this, a second network (the next replica, or the eval net)
    would see the first one's variables. A strategy's scope puts its own custom getter on the
    variable scope, which RETURNN's ``reuse_params`` getters cannot be composed with (FACTS.md,
    "Custom getters"); variables still go through the strategy's variable creator.
    """
    from tensorflow.python.ops import variable_scope

    graph = tf.compat.v1.get_default_graph()
    keys = [tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES]
    saved = {key: list(graph.get_collection(key)) for key in keys}
    for key in keys:
        graph.get_collection_ref(key)[:] = []
    root_scope = copy.copy(variable_scope.get_variable_scope())
    root_scope.set_custom_getter(None)
    try:
        with variable_scope.with_variable_store(variable_scope._VariableStore()), variable_scope.variable_scope(
            root_scope, auxiliary_name_scope=False
        ):
            yield
    finally:
        for key in keys:
            graph.get_collection_ref(key)[:] = saved[key]


@contextlib.contextmanager
def drawing_from(random_source) -> Iterator[None]:
    """RETURNN's random generator is ``random_source``
    (a :class:`returnn_tpu.returnn_side.returnn_bridge.StepRandomSource`)
    while a network is built on this thread."""
    _BUILDING.random_generator = random_source
    try:
        yield
    finally:
        _BUILDING.random_generator = None


def function_graph(name: str, python_function, signature) -> None:
    """Traces ``python_function`` once into a graph that is never run (a ``tf.function`` whose first
    trace creates variables traces twice; FACTS.md, "One trace for all replicas")."""
    _func_graph.func_graph_from_py_func(name, python_function, None, None, signature=signature)
