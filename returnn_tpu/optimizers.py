"""RETURNN's optimizers (``optimizer = {"class": ...}``) with RETURNN's defaults, for ``tf.distribute``.

Each optimizer chooses the reduction of the gradients: for synchronous strategies their mean over
the replicas (``strategy.extended.batch_reduce_to``); for local SGD none, each replica's gradient
goes to its own copy. It updates every replica's copy with TensorFlow's fused training kernels (``ResourceApply*``), which also
have XLA kernels. The update rules and defaults are those of the TF1 optimizers RETURNN creates:
``optimizer_epsilon`` defaults to 1e-16, ``momentum`` is read from the config, and the slot
variables are named as TF1 names them (``<var>/Adam``, ``<var>/Adam_1``, ``<var>/Momentum``).
Call :meth:`Optimizer.apply` in cross-replica context inside the training ``tf.function``, or
:meth:`Optimizer.apply_in_replica` inside ``strategy.run`` (TPU-style steps).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

from returnn_tpu.errors import ConfigError

DEFAULT_EPSILON = 1e-16


class Optimizer:
    """Plain SGD: ``var -= lr * grad``. Subclasses add slots and override :meth:`_apply_dense`."""

    slot_names: Tuple[str, ...] = ()
    # Checkpoints written before the slot step existed: it equals the global step there.
    FALLBACKS = {"optimize/slot_step": "global_step"}

    def __init__(self):
        self.slots: Dict[str, Dict[str, tf.Variable]] = {}  # variable name -> slot name -> slot variable
        self.step: Optional[tf.Variable] = None  # applied updates (RETURNN's global_step)
        # Updates since the slots were created: Adam's bias correction (TF1's beta powers) restarts
        # with new slots, as with the new optimizer RETURNN creates for a new network.
        self.slot_step: Optional[tf.Variable] = None

    def variables(self) -> Dict[str, tf.Variable]:
        """The optimizer's state by checkpoint name."""
        state = {f"{name}/{slot}": v for name, slots in self.slots.items() for slot, v in slots.items()}
        if self.step is not None:
            state["global_step"] = self.step  # RETURNN's name; its loader requires it
            state["optimize/slot_step"] = self.slot_step
        return state

    def slots_by_variable(self) -> Dict[str, List[tf.Variable]]:
        """Each variable's slot variables (variable name -> slots)."""
        return {name: list(slots.values()) for name, slots in self.slots.items()}

    def reset_slots(self):
        """Forgets the slot variables (new ones, zero, are created for the next network), as RETURNN
        creates a new optimizer when the network changes between epochs. The step count stays;
        the count that Adam's bias correction uses restarts."""
        self.slots = {}
        if self.slot_step is not None:
            self.slot_step.assign(0)

    def create_step(self, strategy: tf.distribute.Strategy):
        """Creates the step counter (once); networks read it as RETURNN's ``global_train_step``."""
        if self.step is None:
            with strategy.scope():
                self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
                self.slot_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="optimize/slot_step")

    def create_state(self, strategy: tf.distribute.Strategy, variables: Sequence[tf.Variable]):
        """Creates the step counter and the slots of ``variables`` (cross-replica context, once,
        before the first step is traced)."""
        self.create_step(strategy)
        with strategy.scope():
            for var in variables:
                name = var_name(var)
                if name in self.slots:
                    continue
                self.slots[name] = {
                    slot: tf.Variable(tf.zeros(var.shape, var.dtype), trainable=False, name=f"{name}/{slot}")
                    for slot in self.slot_names
                }

    def apply(
        self,
        strategy: tf.distribute.Strategy,
        grads_and_vars: Sequence[Tuple[Any, tf.Variable]],
        learning_rate: tf.Tensor,
        *,
        reduce: bool,
        apply_if,
    ):
        """Updates all copies with the gradients: their mean over the replicas, or (``reduce``
        False: local SGD) each replica's own. A copy whose ``apply_if`` (a bool tensor, or one per
        replica) is False is left as it is, slots included; the step counts still advance."""
        if reduce:
            reduced = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.MEAN, list(grads_and_vars))
        else:
            reduced = [grad for grad, _ in grads_and_vars]
        self.step.assign_add(1)
        step = self.slot_step.assign_add(1)
        updates = []
        for grad, (_, var) in zip(reduced, grads_and_vars):
            slots = self.slots[var_name(var)]
            updates.append(
                strategy.extended.update(
                    var, self._apply_dense_if, args=(grad, slots, learning_rate, step, apply_if), group=True
                )
            )
        return tf.group(updates)

    def apply_in_replica(
        self,
        strategy: tf.distribute.Strategy,
        grads_and_vars: Sequence[Tuple[tf.Tensor, tf.Variable]],
        learning_rate: tf.Tensor,
        *,
        apply_if,
    ):
        """In replica context (TPU-style steps): applies the gradients as given (already averaged
        for synchronous training) to this replica's copies, if ``apply_if`` (a bool tensor)."""
        strategy.extended.update(self.step, lambda v: v.assign_add(1))
        step = strategy.extended.update(self.slot_step, lambda v: v.assign_add(1))
        for grad, var in grads_and_vars:
            strategy.extended.update(
                var, self._apply_dense_if, args=(grad, self.slots[var_name(var)], learning_rate, step, apply_if)
            )

    def apply_to_copy(self, copy: tf.Variable, grad: tf.Tensor, slots: Mapping[str, tf.Variable], learning_rate):
        """This optimizer's rule applied once to one copy of a variable with slots the caller keeps
        (``slot_names`` -> variable; update context): for rules reused elsewhere, as local SGD's
        outer optimizers reuse momentum. Rules that need a bias-correction step do not apply."""
        return self._apply_dense(copy, grad, slots, learning_rate, None)

    def _apply_dense_if(self, var, grad, slots, lr, step, apply_if):
        def apply():
            with tf.control_dependencies([self._apply_dense(var, grad, slots, lr, step)]):
                return tf.constant(True)

        return tf.cond(apply_if, apply, lambda: tf.constant(False))

    def _apply_dense(self, var: tf.Variable, grad: tf.Tensor, slots: Mapping[str, tf.Variable], lr, step):
        return tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=tf.cast(lr, var.dtype), delta=grad)


class MomentumOptimizer(Optimizer):
    """TF1 momentum: ``accum = momentum * accum + grad; var -= lr * accum``."""

    slot_names = ("Momentum",)

    def __init__(self, momentum: float, use_nesterov: bool = False):
        super().__init__()
        self.momentum = momentum
        self.use_nesterov = use_nesterov

    def _apply_dense(self, var, grad, slots, lr, step):
        return tf.raw_ops.ResourceApplyMomentum(
            var=var.handle,
            accum=slots["Momentum"].handle,
            lr=tf.cast(lr, var.dtype),
            grad=grad,
            momentum=tf.cast(self.momentum, var.dtype),
            use_nesterov=self.use_nesterov,
        )


class AdamOptimizer(Optimizer):
    """TF1 Adam (bias-corrected learning rate, epsilon outside the root); Nadam with ``use_nesterov``."""

    slot_names = ("Adam", "Adam_1")

    def __init__(self, beta1=0.9, beta2=0.999, epsilon=DEFAULT_EPSILON, use_nesterov=False):
        super().__init__()
        self.beta1, self.beta2, self.epsilon, self.use_nesterov = beta1, beta2, epsilon, use_nesterov

    def _apply_dense(self, var, grad, slots, lr, step):
        dtype = var.dtype
        t = tf.cast(step, dtype)
        return tf.raw_ops.ResourceApplyAdam(
            var=var.handle,
            m=slots["Adam"].handle,
            v=slots["Adam_1"].handle,
            beta1_power=tf.pow(tf.cast(self.beta1, dtype), t),
            beta2_power=tf.pow(tf.cast(self.beta2, dtype), t),
            lr=tf.cast(lr, dtype),
            beta1=tf.cast(self.beta1, dtype),
            beta2=tf.cast(self.beta2, dtype),
            epsilon=tf.cast(self.epsilon, dtype),
            grad=grad,
            use_nesterov=self.use_nesterov,
        )


def var_name(var: tf.Variable) -> str:
    """The checkpoint name of a variable, as TF1 and RETURNN use it (op name, no ``:0``)."""
    return var.name.split(":")[0]


def optimizer_from_config(config) -> Optimizer:
    """Creates the optimizer a RETURNN config asks for.

    :param config: a RETURNN ``Config`` (only ``typed_value``, ``float`` and ``bool`` are used).
    Supported: ``optimizer = {"class": "sgd" | "momentum" | "adam" | "nadam", ...}`` and the old
    flags ``adam = True``, ``nadam = True``, ``momentum = 0.9``; anything else is a ConfigError.
    """
    epsilon = config_number(config, "optimizer_epsilon", DEFAULT_EPSILON)
    momentum = config_number(config, "momentum", 0.0)
    opts = config.typed_value("optimizer", None)
    if opts is None:
        if config.bool("adam", False):
            opts = {"class": "adam"}
        elif config.bool("nadam", False):
            opts = {"class": "nadam"}
        elif momentum:
            opts = {"class": "momentum"}
        else:
            opts = {"class": "sgd"}
    if isinstance(opts, str):
        opts = {"class": opts}
    if not isinstance(opts, dict) or "class" not in opts:
        raise ConfigError(f"optimizer must be a dict with a 'class' name, got {opts!r}")
    opts = dict(opts)
    name = _optimizer_class_name(opts.pop("class"))
    known = {
        "sgd": (Optimizer, {}),
        "gradientdescent": (Optimizer, {}),
        "momentum": (MomentumOptimizer, {"momentum": momentum}),
        "adam": (AdamOptimizer, {"epsilon": epsilon}),
        "nadam": (AdamOptimizer, {"epsilon": epsilon, "use_nesterov": True}),
    }
    if name not in known:
        raise ConfigError(f"optimizer class {name!r} is not supported; use one of: {', '.join(known)}")
    cls, defaults = known[name]
    kwargs = {**defaults, **opts}
    for key, value in opts.items():  # TensorFlow would find a string only when the step runs
        if key != "use_nesterov" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"optimizer[{key!r}] must be a number, got {value!r}")
    if cls is MomentumOptimizer and not kwargs.get("momentum"):
        raise ConfigError("optimizer 'momentum' needs a momentum value (optimizer['momentum'] or config 'momentum')")
    try:
        return cls(**kwargs)
    except TypeError:
        valid = [p for p in cls.__init__.__code__.co_varnames[1 : cls.__init__.__code__.co_argcount]]
        raise ConfigError(
            f"optimizer {name!r} got unsupported options {sorted(opts)}; valid: {', '.join(valid) or 'none'}"
        ) from None


def config_number(config, key: str, default: float) -> float:
    """RETURNN's ``config.float(key, default)``; a value that is no number is a one-line error."""
    try:
        return config.float(key, default)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a number, got {config.typed_value(key)!r}") from None


def _optimizer_class_name(value) -> str:
    """The name of the optimizer ``optimizer["class"]`` means, for the forms RETURNN's
    ``get_optimizer_class`` accepts: a name, a function that returns one, or a class; a class is
    one of TensorFlow's that this module implements, else refused in one line."""
    if callable(value) and not isinstance(value, type):
        value = value()
    if isinstance(value, type):
        implemented = {tf.compat.v1.train.GradientDescentOptimizer: "sgd",
                       tf.compat.v1.train.MomentumOptimizer: "momentum", tf.compat.v1.train.AdamOptimizer: "adam"}
        if value not in implemented:
            raise ConfigError(f"optimizer class {value.__name__}: returnn-tpu runs its own optimizers in each replica; "
                              "use one of: sgd, momentum, adam, nadam")
        return implemented[value]
    if not isinstance(value, str):
        raise ConfigError(f"optimizer['class'] must be an optimizer's name, got {value!r}")
    return value.lower()


class StepLearningRate:
    """RETURNN's ``dynamic_learning_rate``: each update's learning rate from the epoch's and the step.

    The config gives either a function ``dynamic_learning_rate(*, network, global_train_step,
    learning_rate, **kwargs)`` that returns the rate as a tensor (per-step warm-up and OneCycle
    schedules of newer setups), or ``{"interval": N, "decay": d}``: the rate times
    ``d ** (global_train_step mod N)``. RETURNN's ``global_train_step`` counts batches; at the
    update after ``accum_grad_multiple_step`` = A batches it is ``(update + 1) * A - 1``, which is
    what the function gets here. ``network`` is None: here each replica builds its own.
    """

    def __init__(self, setting=None, accum: int = 1):
        import inspect

        self.function = self.interval = None
        self.decay, self.accum = 1.0, accum
        if callable(setting):
            parameters = inspect.signature(setting).parameters.values()
            if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters) or \
                    any(p.name == "epoch" for p in parameters):
                raise ConfigError("dynamic_learning_rate must be a function (*, network, global_train_step, "
                                  "learning_rate, **kwargs), without an epoch argument, as RETURNN's TF updater asks")
            self.function = setting
        elif isinstance(setting, dict):
            if sorted(setting) != ["decay", "interval"] or isinstance(setting["interval"], bool) or \
                    not isinstance(setting["interval"], int) or setting["interval"] < 1 or \
                    not isinstance(setting["decay"], (int, float)):
                raise ConfigError("dynamic_learning_rate must be a function or {'interval': int >= 1, 'decay': "
                                  f"number}}, got {setting!r}")
            self.interval, self.decay = setting["interval"], float(setting["decay"])
        elif setting:
            raise ConfigError(f"dynamic_learning_rate must be a function or a dict, got {setting!r}")

    @classmethod
    def from_config(cls, config) -> "StepLearningRate":
        return cls(config.typed_value("dynamic_learning_rate", None),
                   accum=max(1, config.int("accum_grad_multiple_step", 1)))

    def __call__(self, learning_rate: tf.Tensor, update_step) -> tf.Tensor:
        """The rate of the update after ``update_step`` updates (the optimizer's step, read before it)."""
        if self.function is None and self.interval is None:
            return learning_rate
        global_train_step = (tf.cast(update_step, tf.int64) + 1) * self.accum - 1
        if self.function is not None:
            rate = self.function(network=None, global_train_step=global_train_step, learning_rate=learning_rate)
            return tf.cast(rate, tf.float32)
        return learning_rate * tf.pow(self.decay, tf.cast(global_train_step % self.interval, tf.float32))


@dataclasses.dataclass(frozen=True)
class GradientOptions:
    """RETURNN's updater options that change a replica's gradients, applied in RETURNN's order.

    Read from the config by :meth:`from_config`; :meth:`final` turns one update's gradients into
    the ones the optimizer applies. ``maximize_grad_norm`` (a second derivative) is added where the
    gradients are computed (see :mod:`returnn_tpu.returnn_side.steps`).
    """

    noise: float = 0.0  # gradient_noise: stddev of truncated-normal noise
    clip: float = 0.0  # gradient_clip: element-wise
    clip_norm: float = 0.0  # gradient_clip_norm: per variable
    clip_avg_norm: float = 0.0  # gradient_clip_avg_norm: per variable, by average norm
    clip_global_norm: float = 0.0  # gradient_clip_global_norm
    nan_inf_filter: bool = False  # gradient_nan_inf_filter: NaN/Inf entries become 0
    norm_to_clip_to_zero: float = 0.0  # grad_norm_to_clip_to_zero: all zero above this global norm
    maximize_grad_norm: float = 0.0

    @classmethod
    def from_config(cls, config) -> "GradientOptions":
        def number(key: str) -> float:
            return config_number(config, key, 0.0)

        return cls(
            noise=number("gradient_noise"),
            clip=number("gradient_clip"),
            clip_norm=number("gradient_clip_norm"),
            clip_avg_norm=number("gradient_clip_avg_norm"),
            clip_global_norm=number("gradient_clip_global_norm"),
            nan_inf_filter=config.bool("gradient_nan_inf_filter", False),
            norm_to_clip_to_zero=number("grad_norm_to_clip_to_zero"),
            maximize_grad_norm=number("maximize_grad_norm"),
        )

    def final(self, grads: List[tf.Tensor], batch_grads: List[tf.Tensor]) -> List[tf.Tensor]:
        """``grads`` (summed over ``accum_grad_multiple_step`` micro-batches) as the optimizer gets them.

        As in RETURNN's updater, the global norm that ``gradient_clip_global_norm`` and
        ``grad_norm_to_clip_to_zero`` compare with is that of ``batch_grads``, the gradients of
        this batch as computed, and noise (RETURNN's own function, drawn per replica) comes first.
        """
        if self.noise:
            from returnn.tf.util.basic import add_scaled_noise_to_gradients

            grads = [grad for grad, _ in add_scaled_noise_to_gradients([(g, None) for g in grads], self.noise)]
        if self.clip:
            grads = [tf.clip_by_value(g, -self.clip, self.clip) for g in grads]
        if self.clip_norm:
            grads = [tf.clip_by_norm(g, self.clip_norm) for g in grads]
        if self.clip_avg_norm:
            grads = [tf.compat.v1.clip_by_average_norm(g, self.clip_avg_norm) for g in grads]
        batch_norm = tf.linalg.global_norm(batch_grads) if self.clip_global_norm or self.norm_to_clip_to_zero else None
        if self.clip_global_norm:
            grads, _ = tf.clip_by_global_norm(grads, self.clip_global_norm, use_norm=batch_norm)
        if self.nan_inf_filter:
            grads = [tf.where(tf.math.is_finite(g), g, tf.zeros_like(g)) for g in grads]
        if self.norm_to_clip_to_zero:
            grads = [tf.where(batch_norm > self.norm_to_clip_to_zero, tf.zeros_like(g), g) for g in grads]
        return list(grads)
