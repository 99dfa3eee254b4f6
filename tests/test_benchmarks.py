"""Every script in benchmarks/ runs, at its ``--smoke`` size (or, for those that take a config,
on the smallest config of tests/configs/): a benchmark that breaks fails here, not when its
figure is next wanted. Nothing is measured."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CONFIG = os.path.join(REPO, "tests", "configs", "old_style_12ax.config")

RUNS = {
    "accum_parity.py": ["--smoke"],
    "chaos.py": ["--smoke"],
    "corpus.py": ["--smoke"],
    "data_pipeline.py": ["--smoke"],
    "data_scale.py": ["--smoke"],
    "keras_local_sgd.py": ["--smoke"],
    "epoch_time.py": [TINY_CONFIG, "--smoke"],
    "local_sgd_quality.py": ["--smoke"],
    "lm_quality.py": ["--smoke"],
    "lm_wall_clock.py": ["--smoke"],
    "memory.py": [TINY_CONFIG],
    "memory_growth.py": ["--smoke"],
    "multi_worker.py": ["--smoke"],
    "overhead.py": ["--smoke"],
    "regroup.py": ["--smoke"],
    "relay.py": ["--smoke"],
    "resume.py": ["--smoke"],
    "slow_link.py": ["--smoke"],
    "speech_corpus.py": ["--smoke"],
    "speech_quality.py": ["--smoke"],
    "startup.py": [TINY_CONFIG, "--smoke"],
    "time_to_quality.py": ["--smoke"],
    "xla.py": ["--smoke"],
}


def test_every_benchmark_is_run_here():
    scripts = {name for name in os.listdir(os.path.join(REPO, "benchmarks")) if name.endswith(".py")}
    assert scripts == set(RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(RUNS))
def test_the_benchmark_runs(script, tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", script), *RUNS[script]],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(table) >= 2, result.stdout  # a heading and at least one row


def test_the_time_model_adds_up_compute_transfers_exchanges_warmup_and_overlap():
    """benchmarks/time_to_quality.py's model, by hand: 2 workers on 100 Mbit/s with 20 ms latency
    (a 40 ms round trip), a 1 MB model, 10 ms of compute per update."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from time_to_quality import Collectives, Link, Machine, Setting, exchanges_per_update, updates_to

    from returnn_tpu.datapath.epochs import AHEAD_STEPS
    from returnn_tpu.faults import NONFINITE_CHECK_STEPS, STOP_CHECK_STEPS

    link = Link(1e8, 0.02)
    assert link.all_reduce(1e6, 2) == pytest.approx(1e6 * 8 / 1e8)  # each sends half twice: the whole model
    costs = Collectives(gradient_seconds=0.001, gradient_round_trips=3, sync_seconds={"float32": 0.002, "int4": 0.004},
                        sync_round_trips=2, exchange_seconds=0.0005, exchange_round_trips=1)
    machine = Machine(0.01, 1e6, 2, link, costs)
    exchanges = (1 / AHEAD_STEPS + 1 / STOP_CHECK_STEPS + 1 / NONFINITE_CHECK_STEPS) * (0.0005 + 0.04)
    assert exchanges_per_update() * costs.exchange(link, 2) == pytest.approx(exchanges)
    gradient = 0.08 + 0.001 + 3 * 0.04
    assert machine.seconds(Setting.of(None), 10) == pytest.approx(10 * 0.01)  # plain RETURNN: one device
    assert machine.seconds(Setting.of({}), 10) == pytest.approx(10 * (0.01 + exchanges + gradient))
    sync = 0.08 + 0.002 + 2 * 0.04
    local = Setting.of({"param_sync_step": 5, "sync_warmup_steps": 4})
    assert machine.seconds(local, 14) == pytest.approx(14 * (0.01 + exchanges) + 4 * gradient + 2 * sync)
    overlapped = Setting.of({"param_sync_step": 5, "sync_delay": 3, "sync_dtype": "int4"})
    gather = 1e6 * 4.5 / 32 * 8 / 1e8 + 0.004 + 2 * 0.04
    assert machine.seconds(overlapped, 10) == pytest.approx(10 * (0.01 + exchanges) + 2 * (gather - 3 * 0.01))
    four = Machine(0.01, 1e6, 4, link, costs)  # a ring of 4: 3 steps where 2 workers have 1
    assert four.seconds(Setting.of({}), 1) == pytest.approx(
        0.01 + exchanges_per_update() * (0.0005 + 3 * 0.04) + 1.5 * 0.08 + 0.001 + 3 * 3 * 0.04)
    curve = [{"updates": 100, "dev_ppl": 9.0}, {"updates": 200, "dev_ppl": 7.0}]
    assert updates_to(curve, 8.0) == pytest.approx(150) and updates_to(curve, 6.0) is None
