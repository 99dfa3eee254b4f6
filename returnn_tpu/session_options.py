"""RETURNN's TF1 session options (``tf_session_opts``, ``device``) mapped to TF2 settings.

Real configs carry them for session-based RETURNN. Where TF2 has an equivalent (thread pools,
GPU memory growth, device placement logging), it is applied; everything else is reported once
as ignored. They are never an error. Must run before TensorFlow initialises its runtime.
"""

from __future__ import annotations

from typing import Any, Dict, List

import tensorflow as tf


def apply_session_options(config) -> List[str]:
    """Applies what can be applied; returns one message per option that was ignored."""
    opts: Dict[str, Any] = dict(config.typed_value("tf_session_opts", None) or {})
    ignored = []
    if "intra_op_parallelism_threads" in opts:
        tf.config.threading.set_intra_op_parallelism_threads(int(opts.pop("intra_op_parallelism_threads")))
    if "inter_op_parallelism_threads" in opts:
        tf.config.threading.set_inter_op_parallelism_threads(int(opts.pop("inter_op_parallelism_threads")))
    if "log_device_placement" in opts:
        tf.debugging.set_log_device_placement(bool(opts.pop("log_device_placement")))
    gpu_options = dict(opts.pop("gpu_options", None) or {})
    if gpu_options.pop("allow_growth", False):
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)
    for key in sorted(gpu_options):
        ignored.append(f"tf_session_opts['gpu_options'][{key!r}] (no TF2 equivalent; TF2 allocates on demand)")
    for key in sorted(opts):
        ignored.append(f"tf_session_opts[{key!r}] (no TF2 equivalent)")
    if config.has("device"):
        ignored.append("device (replicas are placed by distribute_strategy / distribute_options['num_replicas'])")
    return ignored
