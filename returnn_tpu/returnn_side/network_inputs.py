"""The network's inputs for one build: RETURNN's ``ExternData`` with a build's own ``Dim`` copies.

:func:`extern_data_template` makes RETURNN's ``ExternData`` for the config (placeholders only
for a throwaway graph; in a trace the builder sets the inputs); :func:`fresh_dims` gives each build
copies of the config's dynamic dims, since a ``Dim`` keeps the sizes it was given and would mix
the tensors of replicas and traces (FACTS.md, "Extern data per trace"). Used by
:class:`returnn_tpu.returnn_side.returnn_bridge.NetworkBuilder` for every build and for its throwaway
inspection of the network.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import tensorflow as tf

from returnn_tpu.errors import ConfigError


def fresh_dims(config) -> Dict[int, Any]:
    """Copies of the dynamic ``Dim`` objects the config's ``extern_data`` names, by ``id`` of the original.

    A ``Dim`` keeps the sizes it was given, so one shared by the builds of several replicas and
    traces would mix their tensors (FACTS.md, "Extern data per trace"). Each build uses copies,
    one per original, so data keys that share a dim (``dim_tags``, ``same_dim_tags_as``) still
    share it. The result is a ``copy.deepcopy`` memo: applied to the extern data options and the
    network dict, it replaces the originals consistently in both.
    """
    from returnn.tensor import Dim, batch_dim

    memo: Dict[int, Any] = {}
    for opts in (config.typed_value("extern_data", None) or {}).values():
        if not isinstance(opts, dict):
            continue
        named = list(opts.get("dim_tags") or opts.get("dims") or []) + list((opts.get("same_dim_tags_as") or {}).values())
        for dim in named:
            if isinstance(dim, Dim) and dim is not batch_dim and dim.dimension is None and id(dim) not in memo:
                memo[id(dim)] = copied = Dim(None, name=dim.name, kind=dim.kind)
                # Undefined like the dims a Tensor makes for itself without placeholders, which
                # same_dim_tags_as declares the same as this one: a defined dim and an undefined one
                # each defer to the other in RETURNN's declare_same_as, forever. build() defines
                # them all once their sizes are set.
                copied._extra.undefined = True
    return memo


def extern_data_template(config, *, placeholders: bool = False, dims: Optional[Dict[int, Any]] = None):
    """RETURNN's ``ExternData`` for the config (from ``extern_data`` or ``num_inputs``/``num_outputs``),
    with the dims of ``dims`` (see :func:`fresh_dims`) in place of the config's."""
    from returnn.tensor import Tensor
    from returnn.tf.network import ExternData, _extern_data_types_from_config

    extern_data = ExternData()
    if dims:
        # RETURNN's init_from_config with the copies; the caller sets the sizes and then the batch info.
        for key, init_args in _extern_data_types_from_config(config).items():
            extern_data.data[key] = Tensor(name=key, **copy.deepcopy(init_args, dict(dims)))
        extern_data.default_input = config.value("default_input", "data")
        extern_data.default_target = config.value("target", "classes")
    elif placeholders:
        extern_data.init_from_config(config, auto_create_placeholders=True)
    else:
        # init_from_config creates a batch-dim placeholder when no input is set yet; keep it out of
        # the trace (XLA cannot compile it). The caller sets the inputs and the real batch dim.
        with tf.Graph().as_default():
            extern_data.init_from_config(config, auto_create_placeholders=False)
    for key, data in extern_data.data.items():
        if len(data.get_dynamic_axes()) > 1:
            raise ConfigError(f"extern_data[{key!r}] has more than one dynamic axis, which is not supported yet")
    return extern_data
