"""SlowMo's outer step (Wang et al., 2020): heavy-ball momentum on the averaged change, scaled by
the inner learning rate, so that the slow momentum keeps its scale when the schedule lowers it."""

from __future__ import annotations

import tensorflow as tf

from returnn_tpu.strategies.sync.diloco import DiLoCoAveraging


class SlowMoAveraging(DiLoCoAveraging):
    """``m = momentum * m + g / lr``; ``new = anchor - learning_rate * lr * m`` (``lr``: the
    inner learning rate, ``g``: the outer gradient). The paper's defaults: slow learning rate 1,
    momentum 0.5 to 0.8; with momentum 0 it is plain averaging."""

    def __init__(self, learning_rate: float = 1.0, momentum: float = 0.5, **kwargs):
        super().__init__(learning_rate=learning_rate, momentum=momentum, **kwargs)

    def apply_mean_change(self, strategy, names, anchors, mean_changes, learning_rate):
        inner_lr = tf.cast(learning_rate, tf.float32)
        return self.outer_step(strategy, names, [-change / inner_lr for change in mean_changes],
                               self.outer_learning_rate * inner_lr, nesterov=False)
