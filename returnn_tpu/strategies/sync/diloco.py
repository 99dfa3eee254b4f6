"""DiLoCo's outer optimizer (Douillard et al., 2023): Nesterov momentum on the averaged change.

The replicas' mean change since the last sync is the negative of an outer gradient
``g = anchor - mean(copies)``; the outer step is Nesterov momentum with (in the paper) learning
rate 0.7 and momentum 0.9, applied to the anchor by the package's momentum optimizer
(:class:`returnn_tpu.optimizers.MomentumOptimizer`, TF1's rule). With learning rate 1 and
momentum 0 it is plain averaging.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import tensorflow as tf

from returnn_tpu.optimizers import MomentumOptimizer
from returnn_tpu.strategies.sync.averaging import ParameterAveraging


class DiLoCoAveraging(ParameterAveraging):
    """``m = momentum * m + g``; ``new = anchor - learning_rate * (g + momentum * m)``.

    The outer momentum is per parameter, the same on every replica, and in the checkpoint.
    """

    uses_anchor = True
    # Measured on RETURNN's demo-tf-vanilla-lstm.12ax.config at its Adam learning rate with 16
    # inner steps (``python benchmarks/local_sgd_quality.py --task returnn_demo --seeds 1 2 3``):
    # outer steps of 7x and 10x the mean change (0.7 / 0.9, 1.0 / 0.9) left the task's plateau in
    # 1 of 3 seeds, those of 0.7x to 2x in all; the papers' settings assume hundreds of inner
    # steps between syncs.
    OVERSHOOT_SCALE = 3.0
    FEW_INNER_STEPS = 100

    def __init__(self, learning_rate: float = 0.7, momentum: float = 0.9, **kwargs):
        super().__init__(**kwargs)
        self.outer_learning_rate = learning_rate
        self.outer_momentum = momentum
        self.momenta: Dict[str, tf.Variable] = {}

    @property
    def step_scale(self) -> float:
        """How far an outer step goes once the momentum has built up, in units of the replicas'
        mean change: ``learning_rate / (1 - momentum)`` (1 is plain averaging); SlowMo's too."""
        return self.outer_learning_rate / (1 - self.outer_momentum)

    def start_warning(self, param_sync_step: Optional[int]) -> Optional[str]:
        if not param_sync_step or param_sync_step >= self.FEW_INNER_STEPS or self.step_scale <= self.OVERSHOOT_SCALE:
            return None
        return (f"outer_optimizer learning_rate {self.outer_learning_rate} with momentum {self.outer_momentum} "
                f"steps {self.step_scale:.1f}x the replicas' mean change once its momentum has built up; with "
                f"param_sync_step {param_sync_step} (fewer than {self.FEW_INNER_STEPS} updates between syncs) such "
                f"outer steps overshoot at RETURNN's usual learning rates: learning_rate / (1 - momentum) of at most "
                f"{self.OVERSHOOT_SCALE:g} (e.g. 0.7 and 0.5) trains (docs/local_sgd.md, 'Outer optimizer')")

    def create_state(self, strategy, variables):
        super().create_state(strategy, variables)
        with strategy.scope():
            for name, var in variables.items():
                if name not in self.momenta:
                    self.momenta[name] = tf.Variable(
                        tf.zeros(var.shape, tf.float32), trainable=False, name=f"{name}/local_sgd_momentum"
                    )

    def state_variables(self):
        state = super().state_variables()
        state.update({var.name.split(":")[0]: var for var in self.momenta.values()})
        return state

    def forget_state(self):
        super().forget_state()
        self.momenta = {}

    def outer_step(self, strategy, names: List[str], outer_grads: List[tf.Tensor], step_size, *,
                   nesterov: bool) -> List[tf.Tensor]:
        """Momentum (``m = momentum * m + g``) applied to each anchor in place with ``step_size``,
        Nesterov's or heavy ball; the new anchors (replica context: this replica's copies)."""
        rule = MomentumOptimizer(self.outer_momentum, use_nesterov=nesterov)
        for name, grad in zip(names, outer_grads):
            strategy.extended.update(self.anchors[name], rule.apply_to_copy,
                                     args=(grad, {"Momentum": self.momenta[name]}, step_size))
        return [tf.identity(self.anchors[name]) for name in names]

    def apply_mean_change(self, strategy, names, anchors, mean_changes, learning_rate):
        return self.outer_step(strategy, names, [-change for change in mean_changes], self.outer_learning_rate,
                               nesterov=True)
