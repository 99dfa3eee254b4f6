"""Cloud TPU strategies: ``"tpu"`` (TensorFlow's synchronous ``TPUStrategy``) and ``"local_sgd_tpu"``.

TPUs run one XLA program per step and replicate only through ``strategy.run`` with the inputs
as arguments, so ``local_sgd_tpu`` runs the whole local-SGD step inside that program: each core
applies its own gradients to its own copy, and the sync (:mod:`returnn_tpu.strategies.sync`, the same code
as for ``local_sgd``) runs under ``tf.cond`` on the fragments the host says are due.

Not run on a real TPU yet (none was available): what a CPU can show is tested (the error when
no TPU is found; the in-step sync logic, with ``TrainerLocalSGDStrategy(in_step_sync=True)``).
"""

from __future__ import annotations

import contextlib
import glob
from typing import Optional

import tensorflow as tf
from tensorflow.python.distribute import tpu_strategy

from returnn_tpu.errors import ConfigError
from returnn_tpu.strategies.local_sgd import LocalSGDExtendedMixin


def find_tpu(strategy_name: str, tpu: Optional[str] = None):
    """A connected, initialised ``TPUClusterResolver``, or a ConfigError saying what was tried.

    Tried in order: ``tpu`` if given; the environment (``TPU_NAME``; Colab's ``COLAB_TPU_ADDR``);
    ``tpu="local"`` on a TPU VM (one with ``/dev/accel*`` or ``/dev/vfio`` devices).
    """
    tried = []
    resolver = None
    candidates = [tpu] if tpu else [None, "local"]
    for candidate in candidates:
        if candidate == "local" and not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
            tried.append("tpu='local' (no /dev/accel* or /dev/vfio devices: not a TPU VM)")
            continue
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=candidate)
            break
        except (ValueError, RuntimeError) as exc:
            env = "TPU_NAME/COLAB_TPU_ADDR environment" if candidate is None else f"tpu={candidate!r}"
            tried.append(f"{env} ({exc})")
    if resolver is None:
        raise ConfigError(f"distribute_strategy {strategy_name!r}: no TPU found; tried {'; '.join(tried)}")
    if resolver.master():  # a remote TPU (Colab, a named TPU): connect to its host
        tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return resolver


class LocalSGDTPUExtended(LocalSGDExtendedMixin, tpu_strategy.TPUExtended):
    """Local SGD on TPU cores; the sync always runs inside the compiled step."""

    in_step_sync = True


@contextlib.contextmanager
def _tpu_strategies_make(extended_class):
    """While in it, ``TPUStrategyV2.__init__`` makes its extended of ``extended_class``: it names
    the class by the module's global ``TPUExtended`` (FACTS.md, "TPUStrategy's extended")."""
    made = tpu_strategy.TPUExtended
    tpu_strategy.TPUExtended = extended_class
    try:
        yield
    finally:
        tpu_strategy.TPUExtended = made


class TrainerLocalSGDTPUStrategy(tpu_strategy.TPUStrategyV2):
    """Local SGD on the cores of a TPU for the RETURNN trainer (``local_sgd_tpu``): each core
    trains its own copy with the package's optimizers, and :mod:`returnn_tpu.strategies.sync` combines the
    copies inside the compiled step. Not for TF2 programs: there, Keras' gradient all-reduce would
    make it synchronous SGD (docs/strategies.md).

    TensorFlow's own ``__init__`` runs, with the local-SGD extended in place of its own, so every
    setting it makes (packed variables in eager mode, its usage gauges) holds here too.
    """

    def __init__(self, resolver):
        with _tpu_strategies_make(LocalSGDTPUExtended):
            super().__init__(resolver)


def make_tpu_strategy(name: str) -> tf.distribute.Strategy:
    """``"tpu"`` or ``"local_sgd_tpu"`` on the TPU that :func:`find_tpu` finds."""
    resolver = find_tpu(name)
    if name == "tpu":
        return tf.distribute.TPUStrategy(resolver)
    return TrainerLocalSGDTPUStrategy(resolver)
