"""From this machine to a cluster, on paper: which way of training reaches a target quality first.

How good the model is after u updates does not depend on the hardware (the curves of
``lm_quality.py``, dev perplexity against updates); the time an update takes does. The model:

* an update computes for ``compute`` seconds (forward, backward, optimizer);
* a synchronous update (``mirrored``, ``multi_worker_mirrored``, and the updates of a
  ``sync_warmup_steps`` warm-up) then all-reduces the gradients: ``all_reduce(model bytes)``;
* local SGD all-reduces the parameters' change every ``N`` updates (int8 / int4: all-gathers
  the quantized payloads); with ``sync_delay`` tau that transfer runs while the next tau updates
  compute, and only what is left of it is waited for;
* ``all_reduce(B)`` over K workers on a link of bandwidth b and latency l is a ring's
  ``2 (K - 1) / K * B / b + 2 (K - 1) * l``, plus a fixed cost per collective ``overhead`` (the
  collective's software on this machine: measured, ``--check``); an all-gather of payloads P
  is ``(K - 1) * P / b + (K - 1) * l``.

The wall time to a target is then the time of the updates the curve needs to reach it.

``--check WALL_CLOCK_JSON`` compares the model with ``lm_wall_clock.py``'s measured runs: the
compute per update and the per-collective overheads are taken from the unthrottled runs, and the
model then predicts each throttled run's training seconds to the target from its own curve
(updates to the target) and the link; printed beside the measured seconds.

``--map`` draws where each setting wins (``docs/images/time_to_quality_map.png``): over link
bandwidth and compute per update, the setting of the least time to the target (by default the
worst final perplexity of the rows compared: a quality every one of them reaches in the pass) on
the curves of ``--curves`` (``lm_quality.py``'s ``runs.json``: 4 replicas, so 4 workers), for the Brown LM's
own size and for a model of 25M parameters (the curves' shape assumed to carry over), with three
clusters marked.

    python benchmarks/time_to_quality.py --curves lm_quality/runs.json --map docs/images/time_to_quality_map.png
    python benchmarks/time_to_quality.py --check lm_wall_clock/wall_clock.json

``--smoke``: the model on a tiny made-up input (the test of this code).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lm_wall_clock import LINKS  # noqa: E402  (the links the measured runs used)

QUANTIZED_BYTES = {"int8": 8.5 / 32, "int4": 4.5 / 32}  # per float32 byte: the blocks of 64 with a float32 scale
HALF_BYTES = {"bfloat16": 0.5, "float16": 0.5}


@dataclasses.dataclass(frozen=True)
class Link:
    """One direction of the link between two workers: bits per second and latency in seconds."""

    bits_per_second: float
    latency: float

    def all_reduce(self, size: float, workers: int) -> float:
        """Seconds of a ring all-reduce of ``size`` bytes over ``workers``."""
        if workers < 2:
            return 0.0
        return 2 * (workers - 1) / workers * size * 8 / self.bits_per_second + 2 * (workers - 1) * self.latency

    def all_gather(self, size: float, workers: int) -> float:
        """Seconds of an all-gather of each worker's ``size`` bytes."""
        if workers < 2:
            return 0.0
        return (workers - 1) * size * 8 / self.bits_per_second + (workers - 1) * self.latency


UNTHROTTLED = Link(float("inf"), 0.0)


@dataclasses.dataclass(frozen=True)
class Setting:
    """How a row trains, as far as time goes: ``sync_every`` 0 is synchronous (every update all-reduces
    the gradients); else local SGD syncing every that many updates, in ``sync_dtype``, ``delay``
    updates overlapped, after ``warmup`` synchronous updates."""

    sync_every: int = 0
    sync_dtype: str = "float32"
    delay: int = 0
    warmup: int = 0

    @classmethod
    def of(cls, options: Optional[dict]) -> "Setting":
        """The setting of a row's ``distribute_options`` (None or without ``param_sync_step``: synchronous)."""
        options = options or {}
        if "param_sync_step" not in options:
            return cls()
        return cls(options["param_sync_step"], options.get("sync_dtype", "float32"), options.get("sync_delay", 0),
                   options.get("sync_warmup_steps", 0))

    def sync_seconds(self, model_bytes: float, workers: int, link: Link, overhead: float) -> float:
        """Seconds one local-SGD sync transfers."""
        if self.sync_dtype in QUANTIZED_BYTES:
            return link.all_gather(model_bytes * QUANTIZED_BYTES[self.sync_dtype], workers) + overhead
        return link.all_reduce(model_bytes * HALF_BYTES.get(self.sync_dtype, 1.0), workers) + overhead


@dataclasses.dataclass(frozen=True)
class Machine:
    """What an update costs on some hardware: ``compute`` seconds, the model's float32 bytes, the
    workers on the link, and the fixed seconds of a gradient all-reduce and of a sync."""

    compute: float
    model_bytes: float
    workers: int
    link: Link
    gradient_overhead: float = 0.0
    sync_overhead: float = 0.0

    def seconds(self, setting: Setting, updates: float) -> float:
        """Wall seconds of the first ``updates`` updates."""
        synchronous = updates if not setting.sync_every else min(updates, setting.warmup)
        local = updates - synchronous
        gradient = self.link.all_reduce(self.model_bytes, self.workers) + self.gradient_overhead if self.workers > 1 else 0
        seconds = synchronous * (self.compute + gradient) + local * self.compute
        if local and self.workers > 1:
            waited = max(0.0, setting.sync_seconds(self.model_bytes, self.workers, self.link, self.sync_overhead)
                         - setting.delay * self.compute)
            seconds += local / setting.sync_every * waited
        return seconds


def updates_to(curve: Sequence[dict], target: float) -> Optional[float]:
    """Updates at which ``curve`` (points with ``updates`` and ``dev_ppl``) first reaches ``target``,
    linear between its points (None: not within the curve)."""
    before = None
    for point in curve:
        if point["dev_ppl"] <= target:
            if before is None:
                return float(point["updates"])
            share = (before["dev_ppl"] - target) / (before["dev_ppl"] - point["dev_ppl"])
            return before["updates"] + share * (point["updates"] - before["updates"])
        before = point
    return None


def time_to_target(runs: Dict[str, dict], target: float, machine: Machine) -> Dict[str, Optional[float]]:
    """Row -> predicted wall seconds to ``target`` on ``machine`` (None: the curve does not reach it)."""
    times = {}
    for name, run in runs.items():
        updates = updates_to(run["curve"], target)
        times[name] = None if updates is None else machine.seconds(Setting.of(run["options"]), updates)
    return times


# ---- the check against lm_wall_clock.py's measured runs -------------------------------------------

def check(results: List[dict]) -> str:
    """The model calibrated on the unthrottled runs, against each throttled run's measured
    training seconds to the target (plain RETURNN's first sub-epoch)."""
    plain = next(r for r in results if r["row"] == "plain")
    target = plain["curve"][0]["dev_ppl"]
    distributed = [r for r in results if r["row"] != "plain"]
    unthrottled = {r["row"]: r for r in distributed if r["link_name"] == "unthrottled"}
    compute = statistics.median(r["compute_seconds_per_update"] for r in unthrottled.values()
                                if Setting.of(r["options"]).sync_every)
    synchronous = unthrottled["multi_worker_mirrored"]
    last = synchronous["curve"][-1]
    gradient_overhead = last["train_seconds"] / last["updates"] - compute
    local = [r for r in unthrottled.values() if Setting.of(r["options"]).sync_every and r["syncs"]]
    sync_overhead = statistics.median(r["sync_seconds"] / r["syncs"] for r in local)
    model_bytes = synchronous["bytes_per_update"]  # one worker's gradients (one replica each)
    lines = [f"calibrated on the unthrottled runs: compute {compute * 1e3:.1f} ms per update, a gradient all-reduce "
             f"{gradient_overhead * 1e3:.1f} ms, a sync {sync_overhead * 1e3:.1f} ms; model {model_bytes / 1e6:.3f} MB; "
             f"target dev perplexity {target:.3f}",
             "| link | row | updates to target | measured s | predicted s | predicted / measured |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in sorted(distributed, key=lambda r: (r["link_name"], r["row"])):
        updates = updates_to(r["curve"], target)
        if updates is None:
            lines.append(f"| {r['link_name']} | {r['row']} | not reached | | | |")
            continue
        measured = _interpolate(r["curve"], updates, "train_seconds")
        spec = LINKS[r["link_name"]]
        machine = Machine(compute, model_bytes, 2, Link(*spec) if spec else UNTHROTTLED, gradient_overhead, sync_overhead)
        predicted = machine.seconds(Setting.of(r["options"]), updates)
        lines.append(f"| {r['link_name']} | {r['row']} | {updates:.0f} | {measured:.0f} | {predicted:.0f} | "
                     f"{predicted / measured:.2f} |")
    return "\n".join(lines) + "\n"


def _interpolate(curve: Sequence[dict], updates: float, key: str) -> float:
    """``key`` at ``updates`` along the curve (linear; before its first point: proportional)."""
    before = {"updates": 0, key: 0.0}
    for point in curve:
        if point["updates"] >= updates:
            share = (updates - before["updates"]) / max(1e-9, point["updates"] - before["updates"])
            return before[key] + share * (point[key] - before[key])
        before = point
    return curve[-1][key]


# ---- the map ------------------------------------------------------------------------------------

# Three clusters: workers, the link's bits per second and latency, with where the figures come from.
CLUSTERS = [
    # PCI-SIG: 16 GT/s x 16 lanes with 128b/130b coding, 31.5 GB/s per direction; about 10 us per transfer.
    ("8 consumer GPUs, PCIe 4.0 x16", 8, 31.5e9 * 8, 10e-6),
    ("2 nodes, 10 GbE", 2, 10e9, 50e-6),  # IEEE 802.3ae's line rate; tens of microseconds within a rack
    ("4 cloud nodes, 1 Gbit/s", 4, 1e9, 0.5e-3),  # a cloud zone's round trips take about 1 ms
]
PARAMETERS_OF_A_LARGER_MODEL = 25e6


def winners(runs: Dict[str, dict], target: float, model_bytes: float, workers: int,
            bandwidths: Sequence[float], computes: Sequence[float], latency: float = 1e-4) -> List[List[Optional[str]]]:
    """For each compute (rows) and bandwidth (columns): the row of least time to ``target``."""
    grid = []
    for compute in computes:
        line = []
        for bandwidth in bandwidths:
            times = time_to_target(runs, target, Machine(compute, model_bytes, workers, Link(bandwidth, latency)))
            reached = {name: t for name, t in times.items() if t is not None}
            line.append(min(reached, key=reached.get) if reached else None)
        grid.append(line)
    return grid


def draw_map(runs: Dict[str, dict], target: float, model_bytes: float, path: str, workers: int = 4):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy

    bandwidths = numpy.logspace(6, 12, 61)  # 1 Mbit/s .. 1 Tbit/s
    computes = numpy.logspace(-3, 1, 41)  # 1 ms .. 10 s per update
    names = sorted(runs)
    sizes = [(model_bytes, f"the Brown LM ({model_bytes / 4e3:.0f}k parameters)"),
             (PARAMETERS_OF_A_LARGER_MODEL * 4, f"{PARAMETERS_OF_A_LARGER_MODEL / 1e6:.0f}M parameters")]
    figure, axes = plt.subplots(1, len(sizes), figsize=(13, 5), squeeze=False)
    for ax, (size, title) in zip(axes[0], sizes):
        grid = winners(runs, target, size, workers, bandwidths, computes)
        index = numpy.array([[names.index(w) if w else -1 for w in line] for line in grid], dtype=float)
        index[index < 0] = numpy.nan
        colours = plt.cm.tab10(numpy.arange(len(names)) % 10)
        ax.pcolormesh(bandwidths, computes, index, cmap=matplotlib.colors.ListedColormap(colours),
                      vmin=-0.5, vmax=len(names) - 0.5, shading="nearest")
        for name, _, bandwidth, _ in CLUSTERS:
            ax.axvline(bandwidth, color="black", linestyle="--", linewidth=1)
            ax.text(bandwidth * 1.1, computes[-1] * 0.7, name, rotation=90, va="top", fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link bandwidth, bits per second (latency 0.1 ms)")
        ax.set_ylabel("compute per update, seconds")
        ax.set_title(f"{title}, {workers} workers: fastest to ppl {target:.2f}", fontsize=9)
        present = sorted({w for line in grid for w in line if w})
        ax.legend(handles=[matplotlib.patches.Patch(color=colours[names.index(n)], label=n) for n in present],
                  fontsize=7, loc="lower left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def summary(runs: Dict[str, dict], target: float, model_bytes: float) -> str:
    """Per cluster of :data:`CLUSTERS` (its workers, the curves' updates), at 10 ms and 100 ms of
    compute per update: the time of each row."""
    lines = [f"time to dev perplexity {target:.3f}, model {model_bytes / 1e6:.2f} MB "
             "(seconds; '-': the row's curve does not reach it)",
             "| link | compute / update | " + " | ".join(sorted(runs)) + " |",
             "| --- | --- | " + " | ".join("---" for _ in runs) + " |"]
    for name, workers, bandwidth, latency in CLUSTERS:
        for compute in (0.01, 0.1):
            times = time_to_target(runs, target, Machine(compute, model_bytes, workers, Link(bandwidth, latency)))
            lines.append(f"| {name} | {compute * 1e3:.0f} ms | " + " | ".join(
                "-" if times[n] is None else f"{times[n]:.0f}" for n in sorted(runs)) + " |")
    return "\n".join(lines) + "\n"


def _smoke() -> str:
    """The model on a made-up pair of curves: local SGD needs more updates, sends less."""
    curve = lambda scale: [{"updates": u, "dev_ppl": 10 / math.log(u * scale + 2)} for u in (100, 200, 400)]  # noqa: E731
    runs = {"sync": {"options": None, "curve": curve(1.0)},
            "local_16": {"options": {"param_sync_step": 16}, "curve": curve(0.8)}}
    target = runs["sync"]["curve"][1]["dev_ppl"]
    slow, fast = Link(1e8, 0.02), Link(1e11, 1e-5)
    assert time_to_target(runs, target, Machine(0.01, 4e8, 4, slow))["local_16"] < \
        time_to_target(runs, target, Machine(0.01, 4e8, 4, slow))["sync"]
    assert time_to_target(runs, target, Machine(0.01, 4e6, 4, fast))["sync"] < \
        time_to_target(runs, target, Machine(0.01, 4e6, 4, fast))["local_16"]
    return summary(runs, target, 4e8)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--curves", help="lm_quality.py's runs.json (dev perplexity against updates per row)")
    parser.add_argument("--rows", nargs="*", default=["sync_4", "local_sgd_16", "diloco_64", "diloco_64_int4",
                                                      "local_sgd_16_warmup", "diloco_64_warmup"],
                        help="the rows of --curves the map compares (seed 1)")
    parser.add_argument("--target", type=float,
                        help="dev perplexity (default: the worst final one of the rows, which every row reaches)")
    parser.add_argument("--map", help="where to draw the map (PNG)")
    parser.add_argument("--check", help="lm_wall_clock.py's wall_clock.json: the model against the measured runs")
    parser.add_argument("--smoke", action="store_true", help="the model on a tiny made-up input")
    args = parser.parse_args()
    if args.smoke:
        print(_smoke())
        return
    if args.check:
        with open(args.check) as f:
            print(check(json.load(f)))
    if args.curves:
        with open(args.curves) as f:
            results = json.load(f)
        runs = {r["row"]: r for r in results if r["row"] in args.rows and r["seed"] == 1}
        missing = sorted(set(args.rows) - set(runs))
        if missing:
            raise SystemExit(f"time_to_quality.py: {args.curves} has no seed-1 run of {', '.join(missing)}")
        target = args.target or max(run["dev_ppl"] for run in runs.values())
        model_bytes = runs["sync_4"]["bytes_per_update"] / 4  # 4 replicas' gradients per update
        print(summary(runs, target, model_bytes))
        print(summary(runs, target, PARAMETERS_OF_A_LARGER_MODEL * 4))
        if args.map:
            draw_map(runs, target, model_bytes, args.map)
    if not (args.check or args.curves):
        parser.error("give --curves, --check or --smoke")


if __name__ == "__main__":
    main()
