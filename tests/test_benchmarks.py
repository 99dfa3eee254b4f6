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
    "slow_link.py": ["--smoke"],
    "speech_corpus.py": ["--smoke"],
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
