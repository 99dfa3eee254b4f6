"""What ``jit_compile`` changes around the compiled step: a config value RETURNN's masking needs
with buckets, and the per-epoch figures of compilation and padding.

The compiled step itself is :class:`returnn_tpu.returnn_side.steps.ReplicaSteps`' (``jit_compile``), the
buckets :class:`returnn_tpu.datapath.batching.BucketBatching`, the check that a network compiles
:func:`returnn_tpu.returnn_side.returnn_bridge.check_xla_compatible`.
"""

from __future__ import annotations

from typing import Optional

FINITE_INF_VALUE = 1e30  # RETURNN's ``inf_value`` with XLA buckets: in float32 and bfloat16 range


def prepare_config(config):
    """Buckets fill a batch with empty sequences. RETURNN masks attention energies with
    ``-inf_value``, which over no frames makes the softmax (and the gradient) NaN; a finite mask
    gives those rows finite weights, and real sequences the same ones (exp underflows to 0 alike;
    FACTS.md, "Empty sequences and -inf"). Unless the config sets ``inf_value``."""
    if not config.has("inf_value"):
        config.set("inf_value", FINITE_INF_VALUE)


def epoch_figures(data, steps) -> Optional[dict]:
    """The epoch's XLA figures for ``metrics.jsonl`` (shapes compiled so far, the epoch's
    compilations and their seconds, padding, dropped sequences), read from the epoch's data
    (:class:`returnn_tpu.datapath.epochs.EpochData`) and ``steps``; None without buckets."""
    counted = data.xla_counters()
    if counted is None:
        return None
    compilations, seconds = steps.take_compilations()
    return {
        "xla_compiled_shapes": len(steps.replica.compiled_shapes),
        "xla_compilations": compilations,
        "xla_compile_seconds": round(seconds, 3),
        "padding_fraction": round(counted["padded_frames"] / max(counted["total_frames"], 1), 4),
        "dropped_seqs": counted["dropped"],
    }


def log_line(epoch: int, figures: dict, boundaries) -> str:
    """The log's line of :func:`epoch_figures`."""
    return (f"epoch {epoch}: XLA: {figures['xla_compiled_shapes']} step shapes compiled (buckets "
            f"{list(boundaries)}), {figures['xla_compilations']} compilations in this epoch "
            f"({figures['xla_compile_seconds']:.1f} s), {100 * figures['padding_fraction']:.1f}% of frames are "
            f"padding, {figures['dropped_seqs']} sequences longer than the largest bucket dropped")
