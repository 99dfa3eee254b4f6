"""Cloud TPU strategies: ``"tpu"`` (TensorFlow's synchronous ``TPUStrategy``) and ``"local_sgd_tpu"``
for the RETURNN trainer, and :class:`LocalSGDTPUStrategy` for a TF2 or Keras program.

TPUs run one XLA program per step and replicate only through ``strategy.run`` with the inputs
as arguments, so ``local_sgd_tpu`` runs the whole local-SGD step inside that program: each core
applies its own gradients to its own copy, and the sync (:mod:`returnn_tpu.strategies.sync`, the
same code as for ``local_sgd``) runs under ``tf.cond`` on the fragments the host says are due.
:class:`LocalSGDTPUStrategy` runs a program's own step unchanged and each sync due as a program
of its own (:class:`ScheduledLocalSGDTPUMixin`).

Not run on a real TPU yet (none was available): what a CPU can show is tested (the error when
no TPU is found; the trainer's in-step sync logic, with
``TrainerLocalSGDStrategy(in_step_sync=True)``; the TF2 strategy's schedule and syncs around
``tpu_run``, over local CPU devices in tests/test_tf2_strategy.py).
"""

from __future__ import annotations

import contextlib
import glob
import weakref
from typing import Optional

import tensorflow as tf
from tensorflow.python.distribute import tpu_strategy, tpu_util

from returnn_tpu.errors import ConfigError
from returnn_tpu.strategies.extended import LocalSGDExtendedMixin
from returnn_tpu.strategies.local_sgd import ScheduledLocalSGDMixin, when


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
    trains its own copy with the package's optimizers, and :mod:`returnn_tpu.strategies.sync`
    combines the copies inside the compiled step. TF2 programs use :class:`LocalSGDTPUStrategy`.

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


class ScheduledLocalSGDTPUMixin(ScheduledLocalSGDMixin):
    """:class:`ScheduledLocalSGDMixin` for an extended whose ``strategy.run`` compiles ``fn`` into one
    program of all cores (``tpu_run``): a program that cannot touch the host's counters, and in
    which the cores' trace is one. So a run's program also returns whether it made an update
    (known when it is traced: an all-reduce of gradients in it); the host counts it and runs
    each sync due as a program of its own, under ``tf.cond``, after the run. In a core's program,
    the all-reduce of a gradient gives that core's own (a tensor, not a per-replica value)
    (FACTS.md, "Local SGD for TF2 programs")."""

    def _start_schedule(self, options, keep_synced_model: bool = False):
        super()._start_schedule(options, keep_synced_model)
        self._run_makes_update = False  # set while a run's function is traced
        self._reporting = weakref.WeakKeyDictionary()  # fn -> fn that reports its update

    def _mark_update(self):
        self._run_makes_update = True

    def _own_gradient(self, value, scale):
        if tpu_util.enclosing_tpu_context() is not None:
            return value * scale
        return super()._own_gradient(value, scale)

    def tpu_run(self, fn, args, kwargs, options=None):
        if self._syncing:
            return super().tpu_run(fn, args, kwargs, options)
        result, made_update = super().tpu_run(self._reporting_update(fn), args, kwargs, options)
        made_update = self._container_strategy().experimental_local_results(made_update)[0] > 0
        self._updates.assign_add(tf.cast(made_update, tf.int64))
        when(made_update, self._count_update)
        return result

    def _reporting_update(self, fn):
        """``fn`` that also returns whether it made an update (1 or 0): one per ``fn`` while ``fn``
        lives, so that TensorFlow's cache of eager TPU programs (by the function) still finds it."""
        try:
            return self._reporting[fn]
        except (KeyError, TypeError):
            pass

        def reporting(*args, **kwargs):
            self._run_makes_update = False
            result = fn(*args, **kwargs)
            return result, tf.constant(int(self._run_makes_update))

        try:
            self._reporting[fn] = reporting
        except TypeError:  # not weakly referable: wrapped at each call
            pass
        return reporting

    def _run_in_replicas(self, fn):
        self.tpu_run(fn, (), {})


class ScheduledLocalSGDTPUExtended(ScheduledLocalSGDTPUMixin, LocalSGDTPUExtended):
    """:class:`ScheduledLocalSGDTPUMixin` on the cores of a TPU."""


class LocalSGDTPUStrategy(tpu_strategy.TPUStrategyV2):
    """Local SGD on the cores of a TPU for a TF2 or Keras program: a drop-in replacement of
    ``tf.distribute.TPUStrategy`` (``tpu_cluster_resolver`` as there), with the options of
    :class:`returnn_tpu.strategies.LocalSGDStrategy`. Each core applies its own gradient to its
    own copy; the syncs due run after a step as programs of their own
    (:class:`ScheduledLocalSGDTPUMixin`). Not yet run on a TPU (docs/strategies.md says what was
    tested on CPU devices)."""

    def __init__(self, tpu_cluster_resolver=None, **local_sgd_options):
        from returnn_tpu.options import check_tf2_local_sgd_options

        options = check_tf2_local_sgd_options(local_sgd_options, "LocalSGDTPUStrategy", tpu=True)
        with _tpu_strategies_make(ScheduledLocalSGDTPUExtended):
            super().__init__(tpu_cluster_resolver)
        self.extended._start_schedule(options)
