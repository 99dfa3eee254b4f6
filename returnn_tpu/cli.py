"""``returnn-tpu CONFIG [++key value ...]``: train a RETURNN config as RETURNN's ``rnn.py`` would.

``returnn-tpu --local-workers N [--max-restarts K] CONFIG ...`` runs N workers of one cluster on
127.0.0.1 (and restarts all of them from the newest checkpoint up to K times after a failure).
``returnn-tpu --check`` runs every strategy this machine's devices allow on a tiny network
(:mod:`returnn_tpu.selfcheck`).

Exit status: 0 on success, 2 for bad input (one line on stderr naming the option; nothing is
written), 1 for a failure during training, 128 + N when signal N (SIGTERM, SIGINT) stopped it at
a step boundary.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import List, Optional

from returnn_tpu.errors import ConfigError

USAGE = "usage: returnn-tpu [--local-workers N [--max-restarts K]] CONFIG [++key value ...] | returnn-tpu --check"


def split_args(argv: List[str]):
    """``CONFIG [++key value ...]`` -> ``(CONFIG, overrides)``; a usage error otherwise."""
    if not argv or argv[0].startswith(("-", "+")):
        raise ConfigError(USAGE)
    filename, overrides = argv[0], argv[1:]
    if not os.path.isfile(filename):
        raise ConfigError(f"config file {filename!r} does not exist")
    return filename, overrides


def run_plain_returnn(config, filename: str, overrides: List[str]):
    """Replaces this process by plain RETURNN on the same config (tasks other than training).

    Checkpoints are RETURNN's, so ``eval``, ``forward`` and ``search`` need nothing of ours. A
    config that names no backend gets ``use_tensorflow``, since returnn-tpu assumed that backend.
    """
    names_backend = config.value("backend", None) or config.bool("use_tensorflow", False)
    extra = [] if names_backend else ["++use_tensorflow", "1"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "returnn", filename, *overrides, *extra])


def distribute_options_from_config(config):
    """The validated ``distribute_strategy`` and ``distribute_options`` of a RETURNN config."""
    from returnn_tpu.options import DistributeOptions

    strategy = config.typed_value("distribute_strategy", None) or config.value("distribute_strategy", "local_sgd")
    return DistributeOptions.from_config_values(strategy, config.typed_value("distribute_options", None))


MULTI_WORKER_STRATEGIES = ("local_sgd", "multi_worker_mirrored")


def set_worker_log(config, worker_index: int):
    """Non-chief workers log to ``<log>.worker<N>`` and print only errors and epoch results."""
    logs = [f"{path}.worker{worker_index}" if path not in ("stdout", "|") else path for path in config.list("log", [])]
    config.set("log", logs)
    config.set("log_verbosity", min(config.int("log_verbosity", 3), 2))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv == ["--check"]:
        from returnn_tpu.selfcheck import check

        return check()
    if argv and argv[0] == "--local-workers":
        restarts = 0
        if len(argv) > 3 and argv[2] == "--max-restarts":
            if not argv[3].isdigit():
                print(f"returnn-tpu: error: --max-restarts needs a number >= 0; {USAGE}", file=sys.stderr)
                return 2
            restarts = int(argv[3])
            argv = argv[:2] + argv[4:]
        if len(argv) < 3 or not argv[1].isdigit() or int(argv[1]) < 1:
            print(f"returnn-tpu: error: --local-workers needs a number >= 1 and a config; {USAGE}", file=sys.stderr)
            return 2
        from returnn_tpu.launcher import run_local_workers

        return run_local_workers(int(argv[1]), argv[2:], max_restarts=restarts)
    from returnn_tpu.startup import TASKS, check_config, load_config

    cluster = None
    new_log_paths: List[str] = []
    try:
        filename, overrides = split_args(argv)
        config = load_config(filename, overrides)
        task = config.value("task", "train")
        if task not in TASKS:
            run_plain_returnn(config, filename, overrides)
        # Everything that can be checked is checked before anything is written, and what needs
        # no TensorFlow before TensorFlow starts.
        options = distribute_options_from_config(config)
        check_config(config)
        from returnn_tpu.cluster import resolve_cluster
        from returnn_tpu.optimizers import optimizer_from_config
        from returnn_tpu.returnn_bridge import check_xla_compatible, setup_returnn
        from returnn_tpu.session_options import apply_session_options
        from returnn_tpu.startup import check_classes, select_backend, use_persistent_xla_cache
        from returnn_tpu.trainer import Trainer

        if options.jit_compile:
            use_persistent_xla_cache(config)
        select_backend(config)
        setup_returnn()
        optimizer_from_config(config)
        check_classes(config)
        if options.jit_compile:
            check_xla_compatible(config.typed_value("network") or {})
        ignored = apply_session_options(config)
        cluster = resolve_cluster(options.cluster_resolver) if options.strategy in MULTI_WORKER_STRATEGIES else None
        if cluster and cluster.num_workers > 1 and options.num_replicas and not _has_gpus():
            raise ConfigError("distribute_options['num_replicas'] cannot be used with several CPU workers (each has "
                              "one replica); remove it, or run on GPUs")
        if cluster and not cluster.is_chief:
            set_worker_log(config, cluster.worker_index)
        new_log_paths = _new_log_paths(config)
        for path in new_log_paths:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        import returnn.__main__ as rnn

        rnn.init_log()
        rnn.returnn_greeting(config_filename=filename, command_line_options=overrides)
        for message in ignored:
            print(f"returnn-tpu: ignoring {message}", file=rnn.log.v3)
        trainer = Trainer(config, options, cluster, config_source=(filename, overrides))
        for signum in (signal.SIGTERM, signal.SIGINT):  # replaces TensorFlow's multi-worker handler
            signal.signal(signum, trainer.request_stop)
        trainer.initialize_model() if task == "initialize_model" else trainer.train()
    except ConfigError as exc:
        _remove_new_paths(new_log_paths)  # bad input found after the log started (e.g. the data's dims)
        print(f"returnn-tpu: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 (the failures of training that are one line; others re-raised)
        return _training_failure(exc, cluster)
    return 0


def _new_log_paths(config) -> List[str]:
    """The log files of ``config`` that do not exist yet, and the folders above them that do not
    exist either (files first, each folder after the ones inside it)."""
    new = []
    for path in config.list("log", []):
        if path in ("stdout", "|"):
            continue
        path = os.path.abspath(path)
        while not os.path.exists(path) and path not in new:
            new.append(path)
            path = os.path.dirname(path)
    return sorted(new, key=lambda p: -p.count(os.sep))


def _remove_new_paths(paths: List[str]):
    for path in paths:
        try:
            os.rmdir(path) if os.path.isdir(path) else os.remove(path)
        except OSError:
            pass  # already gone, or a folder someone else wrote into


def _has_gpus() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def _training_failure(exc: Exception, cluster) -> int:
    """One line and the exit status for the failures training reports so (see module doc);
    re-raises any other exception."""
    import tensorflow as tf

    from returnn_tpu import checkpoints
    from returnn_tpu.producer import ProducerError
    from returnn_tpu.trainer import NonFiniteScore, Stopped

    if isinstance(exc, Stopped):
        print(f"returnn-tpu: {exc}", file=sys.stderr)
        return 128 + exc.signum
    if isinstance(exc, (NonFiniteScore, checkpoints.NonFiniteModel, checkpoints.CheckpointWriteError, ProducerError)):
        print(f"returnn-tpu: error: {exc}", file=sys.stderr)
        return 1
    if not isinstance(exc, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError)) \
            or not (cluster and cluster.num_workers > 1):
        raise exc
    lost = ", ".join(cluster.workers_named_in(exc.message)) or "another worker"
    reason = exc.message.strip().splitlines()[0]
    print(f"returnn-tpu: error: worker {cluster.worker_index}: lost {lost} in a collective "
          f"(it died, hangs, or is unreachable): {reason}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
