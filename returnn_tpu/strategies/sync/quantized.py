"""Quantized syncs: each replica's change since the anchor in 8 or 4 bits per value.

A sync's changes (all parameters of the due fragments, flattened into one vector) are cut into
blocks of :data:`BLOCK` values; each block travels as signed integers ``round(x / scale)`` with
``scale = max|x| / qmax`` (qmax 127 for int8, 7 for int4) in float32, so a value is off by at most
half its block's scale. Integers cannot be summed in an all-reduce (they overflow, and
TensorFlow's collectives take no 8-bit types), so each replica's payload is packed into 32-bit
words (4 int8 or 8 int4 values per word, the scales as their bits) and all-gathered; every
replica decodes all payloads to float32 and averages them (FACTS.md, "Quantized syncs").

Error feedback (Seide et al., 2014; Karimireddy et al., 2019): what rounding left out of a
replica's change is added to its next change, so over many syncs nothing is lost but the last
residual.

>>> import numpy
>>> wire = QuantizedWire("int4")
>>> words, decoded = wire.encode(tf.constant(numpy.linspace(-1, 1, 70, dtype="float32")))
>>> words.shape.as_list(), wire.payload_bytes(70)  # 2 blocks: 2 x 8 words of values, 2 scales
([18], 72)
>>> float(tf.reduce_max(tf.abs(decoded - numpy.linspace(-1, 1, 70)))) <= 0.5 / 7
True
"""

from __future__ import annotations

from typing import List, Tuple

import tensorflow as tf

BLOCK = 64  # values per scale: 0.5 bits of scale per value


class QuantizedWire:
    """Block-wise symmetric quantization to ``dtype`` (``"int8"`` or ``"int4"``), packed into int32 words."""

    def __init__(self, dtype: str):
        self.bits = int(dtype[len("int"):])  # one of options.QUANTIZED_SYNC_DTYPES
        self.qmax = 2 ** (self.bits - 1) - 1
        self.values_per_word = 32 // self.bits

    def payload_bytes(self, num_values: int) -> int:
        """Bytes one replica sends for ``num_values`` values: the words of the values and the scales."""
        blocks = -(-num_values // BLOCK)
        return 4 * blocks * (BLOCK // self.values_per_word + 1)

    def encode(self, values: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        """``values`` (float32, 1-D) -> (the int32 words that travel, what they decode to)."""
        size = tf.size(values)
        blocks = (size + BLOCK - 1) // BLOCK
        padded = tf.reshape(tf.pad(values, [[0, blocks * BLOCK - size]]), [-1, BLOCK])
        scales = tf.reduce_max(tf.abs(padded), axis=1) / self.qmax
        levels = tf.clip_by_value(tf.round(tf.math.divide_no_nan(padded, scales[:, None])), -self.qmax, self.qmax)
        decoded = tf.reshape(levels * scales[:, None], [-1])[:size]
        words = tf.concat([self._pack(tf.cast(levels, tf.int32)), tf.bitcast(scales, tf.int32)[:, None]], axis=1)
        return tf.reshape(words, [-1]), decoded

    def decode(self, words: tf.Tensor, size) -> tf.Tensor:
        """The float32 values of one or more replicas' payloads (``words`` of shape [replicas, n])."""
        replicas = tf.shape(words)[0]
        rows = tf.reshape(words, [replicas, -1, BLOCK // self.values_per_word + 1])
        levels = self._unpack(rows[:, :, :-1])
        scales = tf.bitcast(rows[:, :, -1], tf.float32)
        return tf.reshape(tf.cast(levels, tf.float32) * scales[:, :, None], [replicas, -1])[:, :size]

    def _pack(self, levels: tf.Tensor) -> tf.Tensor:
        """[blocks, BLOCK] ints in [-qmax, qmax] -> [blocks, BLOCK / values_per_word] int32 words,
        each value as its two's complement in ``bits`` bits."""
        mask = 2 ** self.bits - 1
        fields = tf.reshape(tf.bitwise.bitwise_and(levels, mask), [tf.shape(levels)[0], -1, self.values_per_word])
        shifts = tf.range(self.values_per_word, dtype=tf.int32) * self.bits
        return tf.reduce_sum(tf.bitwise.left_shift(fields, shifts), axis=-1)  # disjoint bits: sum is bitwise or

    def _unpack(self, words: tf.Tensor) -> tf.Tensor:
        """The inverse of :meth:`_pack` (any leading dims): signed ints, BLOCK per row."""
        shifts = tf.range(self.values_per_word, dtype=tf.int32) * self.bits
        # Shift each field to the top of the word, then arithmetically back down: sign-extended.
        top = tf.bitwise.left_shift(words[..., None], 32 - self.bits - shifts)
        fields = tf.bitwise.right_shift(top, 32 - self.bits)
        return tf.reshape(fields, tf.concat([tf.shape(words)[:-1], [-1]], axis=0))

    def mean(self, strategy: tf.distribute.Strategy, changes: List[tf.Tensor]) -> Tuple[List[tf.Tensor], List[tf.Tensor]]:
        """In replica context: the mean over all replicas of each of ``changes`` as they decode,
        and what this replica's own decode to (the rest is its quantization error)."""
        flat = tf.concat([tf.reshape(change, [-1]) for change in changes], axis=0)
        words, own = self.encode(flat)
        gathered = strategy.extended.gather_in_replica(words[None])
        mean = tf.reduce_mean(self.decode(gathered, tf.size(flat)), axis=0)
        return _split_like(mean, changes), _split_like(own, changes)


def _split_like(flat: tf.Tensor, like: List[tf.Tensor]) -> List[tf.Tensor]:
    sizes = [tf.size(value) for value in like]
    return [tf.reshape(part, tf.shape(value)) for part, value in zip(tf.split(flat, sizes), like)]
