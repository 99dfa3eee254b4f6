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

``--check`` compares the model with ``lm_wall_clock.py``'s measured runs: the compute per update
and the collectives' fixed costs are fitted on the unthrottled runs, their round trips on the
1 Gbit/s runs, and the model then predicts every run's training seconds to the target from its
own curve (updates to the target) and its link, printed beside the measured seconds; the
100 Mbit/s runs, which the fit never saw, are the test.

``--map`` draws where each setting wins (``docs/images/time_to_quality_map.png``): over link
bandwidth and compute per update, the setting of the least time to the target (by default the
worst final perplexity of the rows compared: a quality every one of them reaches in the pass) on
the curves of the wall-clock runs (unthrottled, 2 workers, and plain RETURNN), or of ``--curves``
(``lm_quality.py``'s ``runs.json``: 4 replicas, so 4 workers), for the Brown LM's own size and for a model of 25M parameters (the curves' shape assumed to carry over), with three
clusters marked.

    python benchmarks/time_to_quality.py --wall-clock lm_wall_clock/wall_clock.json --check
    python benchmarks/time_to_quality.py --wall-clock lm_wall_clock/wall_clock.json --map docs/images/time_to_quality_map.png

``--smoke``: the model on a tiny made-up input (the test of this code).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # returnn_tpu's constants

from lm_wall_clock import LINKS  # noqa: E402  (the links the measured runs used)

QUANTIZED_BYTES = {"int8": 8.5 / 32, "int4": 4.5 / 32}  # per float32 byte: the blocks of 64 with a float32 scale
HALF_BYTES = {"bfloat16": 0.5, "float16": 0.5}


@dataclasses.dataclass(frozen=True)
class Link:
    """One direction of the link between two workers: bits per second and latency in seconds."""

    bits_per_second: float
    latency: float

    @property
    def round_trip(self) -> float:
        return 2 * self.latency

    def all_reduce(self, size: float, workers: int) -> float:
        """Seconds a ring all-reduce of ``size`` bytes over ``workers`` spends moving bytes."""
        return 2 * (workers - 1) / workers * size * 8 / self.bits_per_second if workers > 1 else 0.0

    def all_gather(self, size: float, workers: int) -> float:
        """Seconds an all-gather of each worker's ``size`` bytes spends moving bytes."""
        return (workers - 1) * size * 8 / self.bits_per_second if workers > 1 else 0.0


UNTHROTTLED = Link(float("inf"), 0.0)


@functools.lru_cache(maxsize=None)
def exchanges_per_update() -> float:
    """The trainer's small exchanges between workers per update: the agreement on where the epoch
    ends (every ``AHEAD_STEPS`` steps), whether a worker is to stop (every ``STOP_CHECK_STEPS``)
    and the non-finite counts (every ``NONFINITE_CHECK_STEPS``); each is one tiny all-gather."""
    from returnn_tpu.datapath.epochs import AHEAD_STEPS
    from returnn_tpu.faults import NONFINITE_CHECK_STEPS, STOP_CHECK_STEPS

    return 1 / AHEAD_STEPS + 1 / STOP_CHECK_STEPS + 1 / NONFINITE_CHECK_STEPS


@dataclasses.dataclass
class Collectives:
    """What TensorFlow's collectives cost besides moving bytes: fixed seconds (their software,
    here), and round trips of the link (gRPC fetches each piece from its sender: FACTS.md,
    "Collectives pull"), per gradient all-reduce of a synchronous update, per local-SGD sync (by
    ``sync_dtype``) and per small exchange. The round trips are those at 2 workers; with K
    workers a ring has K - 1 times as many steps."""

    gradient_seconds: float = 0.0
    gradient_round_trips: float = 2.0
    sync_seconds: Dict[str, float] = dataclasses.field(default_factory=dict)
    sync_round_trips: float = 2.0
    exchange_seconds: float = 0.0
    exchange_round_trips: float = 1.0

    def exchange(self, link: Link, workers: int) -> float:
        """Seconds of one small exchange."""
        return self.exchange_seconds + self.exchange_round_trips * (workers - 1) * link.round_trip


@dataclasses.dataclass(frozen=True)
class Setting:
    """How a row trains, as far as time goes: ``alone`` on one device (plain RETURNN: nothing
    exchanged); ``sync_every`` 0 is synchronous (every update all-reduces the gradients); else
    local SGD syncing every that many updates, in ``sync_dtype``, ``delay`` updates overlapped,
    after ``warmup`` synchronous updates."""

    sync_every: int = 0
    sync_dtype: str = "float32"
    delay: int = 0
    warmup: int = 0
    alone: bool = False

    @classmethod
    def of(cls, options: Optional[dict]) -> "Setting":
        """The setting of a row's ``distribute_options``: None is plain RETURNN on one device;
        without ``param_sync_step``, synchronous."""
        if options is None:
            return cls(alone=True)
        if "param_sync_step" not in options:
            return cls()
        return cls(options["param_sync_step"], options.get("sync_dtype", "float32"), options.get("sync_delay", 0),
                   options.get("sync_warmup_steps", 0))

    def sync_bytes_seconds(self, model_bytes: float, workers: int, link: Link) -> float:
        """Seconds one local-SGD sync spends moving bytes (int8 / int4: all-gathers of the payloads)."""
        if self.sync_dtype in QUANTIZED_BYTES:
            return link.all_gather(model_bytes * QUANTIZED_BYTES[self.sync_dtype], workers)
        return link.all_reduce(model_bytes * HALF_BYTES.get(self.sync_dtype, 1.0), workers)


@dataclasses.dataclass(frozen=True)
class Machine:
    """What an update costs on some hardware: ``compute`` seconds, the model's float32 bytes, the
    workers on the link, and what their collectives cost besides bytes."""

    compute: float
    model_bytes: float
    workers: int
    link: Link
    collectives: Collectives = dataclasses.field(default_factory=Collectives)

    def seconds(self, setting: Setting, updates: float) -> float:
        """Wall seconds of the first ``updates`` updates."""
        if setting.alone or self.workers < 2:
            return updates * self.compute
        costs, link, workers = self.collectives, self.link, self.workers
        round_trips = (workers - 1) * link.round_trip
        synchronous = updates if not setting.sync_every else min(updates, setting.warmup)
        local = updates - synchronous
        gradient = (link.all_reduce(self.model_bytes, workers) + costs.gradient_seconds
                    + costs.gradient_round_trips * round_trips)
        seconds = updates * (self.compute + exchanges_per_update() * costs.exchange(link, workers))
        seconds += synchronous * gradient
        if local:
            sync = (setting.sync_bytes_seconds(self.model_bytes, workers, link)
                    + costs.sync_seconds.get(setting.sync_dtype, 0.0) + costs.sync_round_trips * round_trips)
            seconds += local / setting.sync_every * max(0.0, sync - setting.delay * self.compute)
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

CALIBRATION_LINK = "1gbit"  # the measured link whose runs give the round trips (LINKS: 1 ms per direction)


def _train_seconds(run: dict, updates: Optional[float] = None) -> float:
    """A measured run's training seconds of its first ``updates`` updates (all: None), without
    its first step's trace (building the step, once per run: start-up, not a cost per update)."""
    curve = run["curve"]
    seconds = curve[-1]["train_seconds"] if updates is None else _interpolate(curve, updates, "train_seconds")
    return seconds - run.get("trace_seconds", 0.0)


def calibrate(results: List[dict]) -> Tuple[float, float, Collectives]:
    """From ``lm_wall_clock.py``'s runs: the compute seconds per update, the model's bytes, and
    the collectives' costs: their fixed seconds from the unthrottled runs, their round trips from
    the runs on :data:`CALIBRATION_LINK`."""
    distributed = [r for r in results if r["row"] != "plain"]
    unthrottled = {r["row"]: r for r in distributed if r["link_name"] == "unthrottled"}
    slow = {r["row"]: r for r in distributed if r["link_name"] == CALIBRATION_LINK}
    round_trip = Link(*LINKS[CALIBRATION_LINK]).round_trip
    per_exchange = lambda r: r["agree_seconds"] / r["agreements"]  # noqa: E731
    exchange_seconds = statistics.median(per_exchange(r) for r in unthrottled.values() if r["agreements"])
    updates = lambda r: r["curve"][-1]["updates"]  # noqa: E731
    local = [r for r in unthrottled.values() if Setting.of(r["options"]).sync_every and not Setting.of(r["options"]).warmup]
    compute = statistics.median((_train_seconds(r) - r["sync_seconds"]) / updates(r) for r in local) \
        - exchanges_per_update() * exchange_seconds
    model_bytes = unthrottled["multi_worker_mirrored"]["bytes_per_update"]  # one worker's gradients (one replica each)
    costs = Collectives(exchange_seconds=exchange_seconds)
    costs.exchange_round_trips = statistics.median(
        (per_exchange(r) - exchange_seconds) / round_trip for r in slow.values() if r["agreements"])
    for dtype in {Setting.of(r["options"]).sync_dtype for r in local}:
        costs.sync_seconds[dtype] = statistics.median(r["sync_seconds"] / r["syncs"] for r in local
                                                      if Setting.of(r["options"]).sync_dtype == dtype)
    link = Link(*LINKS[CALIBRATION_LINK])
    costs.sync_round_trips = statistics.median(
        (r["sync_seconds"] / r["syncs"] - Setting.of(r["options"]).sync_bytes_seconds(model_bytes, 2, link)
         - costs.sync_seconds["float32"]) / round_trip
        for r in slow.values() if r["syncs"] and Setting.of(r["options"]).sync_dtype == "float32"
        and not Setting.of(r["options"]).warmup)
    synchronous = unthrottled["multi_worker_mirrored"]
    costs.gradient_seconds = _train_seconds(synchronous) / updates(synchronous) - compute \
        - exchanges_per_update() * exchange_seconds
    slow_synchronous = slow["multi_worker_mirrored"]
    costs.gradient_round_trips = (
        _train_seconds(slow_synchronous) / updates(slow_synchronous) - compute - costs.gradient_seconds
        - exchanges_per_update() * costs.exchange(link, 2) - link.all_reduce(model_bytes, 2)) / round_trip
    return compute, model_bytes, costs


def check(results: List[dict]) -> str:
    """The model calibrated on the unthrottled and :data:`CALIBRATION_LINK` runs, against each
    run's measured training seconds to the target (plain RETURNN's first sub-epoch); the other
    links' runs are the test."""
    plain = next(r for r in results if r["row"] == "plain")
    target = plain["curve"][0]["dev_ppl"]
    compute, model_bytes, costs = calibrate(results)
    lines = [f"calibrated: compute {compute * 1e3:.1f} ms per update; model {model_bytes / 1e6:.3f} MB; fixed seconds "
             f"(unthrottled runs): gradient all-reduce {costs.gradient_seconds * 1e3:.1f} ms, sync "
             + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(costs.sync_seconds.items()))
             + f", small exchange {costs.exchange_seconds * 1e3:.1f} ms; round trips ({CALIBRATION_LINK} runs): "
             f"gradient all-reduce {costs.gradient_round_trips:.1f}, sync {costs.sync_round_trips:.1f}, small "
             f"exchange {costs.exchange_round_trips:.1f}; {exchanges_per_update():.3f} small exchanges per update; "
             f"target dev perplexity {target:.3f}",
             "| link | row | updates to target | measured s | predicted s | predicted / measured |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in sorted((r for r in results if r["row"] != "plain"), key=lambda r: (r["link_name"], r["row"])):
        updates = updates_to(r["curve"], target)
        if updates is None:
            lines.append(f"| {r['link_name']} | {r['row']} | not reached | | | |")
            continue
        measured = _train_seconds(r, updates)
        spec = LINKS[r["link_name"]]
        machine = Machine(compute, model_bytes, 2, Link(*spec) if spec else UNTHROTTLED, costs)
        predicted = machine.seconds(Setting.of(r["options"]), updates)
        fitted = " (fitted)" if r["link_name"] in ("unthrottled", CALIBRATION_LINK) else ""
        lines.append(f"| {r['link_name']}{fitted} | {r['row']} | {updates:.0f} | {measured:.1f} | {predicted:.1f} | "
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


def winners(runs: Dict[str, dict], target: float, model_bytes: float, workers: int, costs: Collectives,
            bandwidths: Sequence[float], computes: Sequence[float], latency: float = 1e-4) -> List[List[Optional[str]]]:
    """For each compute (rows) and bandwidth (columns): the row of least time to ``target``."""
    grid = []
    for compute in computes:
        line = []
        for bandwidth in bandwidths:
            times = time_to_target(runs, target, Machine(compute, model_bytes, workers, Link(bandwidth, latency), costs))
            reached = {name: t for name, t in times.items() if t is not None}
            line.append(min(reached, key=reached.get) if reached else None)
        grid.append(line)
    return grid


def draw_map(runs: Dict[str, dict], target: float, model_bytes: float, workers: int, costs: Collectives, path: str):
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
    colours = plt.cm.tab10(numpy.arange(len(names)) % 10)
    for ax, (size, title) in zip(axes[0], sizes):
        grid = winners(runs, target, size, workers, costs, bandwidths, computes)
        index = numpy.array([[names.index(w) if w else -1 for w in line] for line in grid], dtype=float)
        index[index < 0] = numpy.nan
        ax.pcolormesh(bandwidths, computes, index, cmap=matplotlib.colors.ListedColormap(colours),
                      vmin=-0.5, vmax=len(names) - 0.5, shading="nearest")
        for name, _, bandwidth, _ in CLUSTERS:
            ax.axvline(bandwidth, color="black", linestyle="--", linewidth=1)
            ax.text(bandwidth * 1.1, computes[-1] * 0.7, name, rotation=90, va="top", fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link bandwidth, bits per second (latency 0.1 ms)")
        ax.set_ylabel("compute per update, seconds")
        ax.set_title(f"{title}, {workers} workers: fastest to dev ppl {target:.2f}", fontsize=9)
        present = sorted({w for line in grid for w in line if w})
        ax.legend(handles=[matplotlib.patches.Patch(color=colours[names.index(n)], label=n) for n in present],
                  fontsize=7, loc="lower left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def summary(runs: Dict[str, dict], target: float, model_bytes: float, costs: Collectives) -> str:
    """Per cluster of :data:`CLUSTERS` (its workers and link; the curves' updates), at 10 ms and
    100 ms of compute per update: the time of each row."""
    lines = [f"time to dev perplexity {target:.3f}, model {model_bytes / 1e6:.2f} MB "
             "(seconds; '-': the row's curve does not reach it)",
             "| cluster | compute / update | " + " | ".join(sorted(runs)) + " |",
             "| --- | --- | " + " | ".join("---" for _ in runs) + " |"]
    for name, workers, bandwidth, latency in CLUSTERS:
        for compute in (0.01, 0.1):
            machine = Machine(compute, model_bytes, workers, Link(bandwidth, latency), costs)
            times = time_to_target(runs, target, machine)
            lines.append(f"| {name} | {compute * 1e3:.0f} ms | " + " | ".join(
                "-" if times[n] is None else f"{times[n]:.0f}" for n in sorted(runs)) + " |")
    return "\n".join(lines) + "\n"


def _smoke() -> str:
    """The model on made-up curves: local SGD needs more updates, sends less; one device needs the most."""
    curve = lambda scale: [{"updates": u, "dev_ppl": 10 / math.log(u * scale + 2)} for u in (100, 200, 400)]  # noqa: E731
    runs = {"sync": {"options": {}, "curve": curve(1.0)},
            "local_16": {"options": {"param_sync_step": 16}, "curve": curve(0.8)},
            "alone": {"options": None, "curve": curve(0.5)}}
    target = runs["sync"]["curve"][1]["dev_ppl"]
    costs = Collectives(gradient_seconds=0.001, sync_seconds={"float32": 0.002}, exchange_seconds=0.001)
    slow = time_to_target(runs, target, Machine(0.01, 4e8, 4, Link(1e8, 0.02), costs))
    fast = time_to_target(runs, target, Machine(0.01, 4e6, 4, Link(1e11, 1e-5), costs))
    assert slow["local_16"] < slow["sync"] and fast["sync"] < fast["local_16"] < fast["alone"]
    return summary(runs, target, 4e8, costs)


def load_curves(path: str, rows: Optional[Sequence[str]]) -> Tuple[Dict[str, dict], int]:
    """Row -> run (its ``options`` and ``curve``) of ``path``, and the workers its curves were
    measured on: ``lm_wall_clock.py``'s ``wall_clock.json`` (the unthrottled runs and plain
    RETURNN, 2 workers) or ``lm_quality.py``'s ``runs.json`` (seed 1, 4 replicas)."""
    with open(path) as f:
        results = json.load(f)
    if all("link_name" in r for r in results):
        runs, workers = {r["row"]: r for r in results if r["link_name"] in ("unthrottled", "-")}, 2
    else:
        runs, workers = {r["row"]: r for r in results if r["seed"] == 1}, 4
    if rows:
        missing = sorted(set(rows) - set(runs))
        if missing:
            raise SystemExit(f"time_to_quality.py: {path} has no run of {', '.join(missing)}")
        runs = {name: runs[name] for name in rows}
    return runs, workers


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wall-clock", help="lm_wall_clock.py's wall_clock.json: the measured runs that calibrate "
                                             "the model (and, without --curves, its curves)")
    parser.add_argument("--curves", help="lm_quality.py's runs.json instead: dev perplexity against updates per row")
    parser.add_argument("--rows", nargs="*", help="the rows the map compares (default: all of the curves)")
    parser.add_argument("--target", type=float,
                        help="dev perplexity (default: the worst final one of the rows, which every row reaches)")
    parser.add_argument("--check", action="store_true", help="the model against the measured runs")
    parser.add_argument("--map", help="where to draw the map (PNG)")
    parser.add_argument("--smoke", action="store_true", help="the model on a tiny made-up input")
    args = parser.parse_args()
    if args.smoke:
        print(_smoke())
        return
    if not args.wall_clock:
        parser.error("give --wall-clock (with --check and/or --map), or --smoke")
    with open(args.wall_clock) as f:
        measured = json.load(f)
    if args.check:
        print(check(measured))
    _, model_bytes, costs = calibrate(measured)
    runs, workers = load_curves(args.curves or args.wall_clock, args.rows)
    target = args.target or max(run["curve"][-1]["dev_ppl"] for run in runs.values())
    print(summary(runs, target, model_bytes, costs))
    print(summary(runs, target, PARAMETERS_OF_A_LARGER_MODEL * 4, costs))
    if args.map:
        draw_map(runs, target, model_bytes, workers, costs, args.map)


if __name__ == "__main__":
    main()
