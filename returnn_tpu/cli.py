"""``returnn-tpu CONFIG [++key value ...]``: train a RETURNN config as RETURNN's ``rnn.py`` would.

``returnn-tpu --local-workers N [--max-restarts K] CONFIG ...`` runs N workers of one cluster on
127.0.0.1 (and restarts all of them from the newest checkpoint up to K times after a failure).
``returnn-tpu --check`` runs every strategy this machine's devices allow on a tiny network
(:mod:`returnn_tpu.selfcheck`).

Exit status: 0 on success, 2 for bad input (one line on stderr naming the option; nothing is
written), 1 for a failure during training, 75 when the run stopped early and running the same
command continues it (a lost worker, whose survivors saved the model of the last sync; the
``time_limit``), 128 + N when signal N (SIGTERM, SIGINT, SIGHUP) stopped it at a step boundary.
"""

from __future__ import annotations

import argparse
import ast
import os
import signal
import sys
import time
from typing import List, Optional

from returnn_tpu.errors import ConfigError, DatasetError
from returnn_tpu.model_lock import ModelLock

ENVIRONMENT = """\
environment variables:
  TF_CONFIG                  TensorFlow's cluster spec (JSON): this process is one worker of that cluster
  OMPI_COMM_WORLD_RANK, ...  set by mpirun: the workers find each other over MPI (cluster_resolver "mpi")
  JOB_ID, PE_HOSTFILE        set by SGE (qsub -pe ...): the job's hosts and ports (cluster_resolver "sge")
  TPU_NAME, COLAB_TPU_ADDR   the Cloud TPU to use (distribute_strategy "tpu" or "local_sgd_tpu")
  RETURNN_TPU_SHARE_NETWORK  =1: --local-workers runs its workers in this machine's network, not an isolated one
  DISABLE_CUDA               =1: RETURNN builds its native ops without CUDA (set when TensorFlow has no GPU)
  TF_XLA_FLAGS               TensorFlow's XLA flags (with jit_compile, a persistent cache beside the model is added)

exit status: 0 success; 2 bad input (one line naming the option, nothing written); 1 a failure during
training; 75 stopped early, run the same command again to continue (a worker was lost and the model of
the last sync saved; distribute_options['time_limit']); 128 + N stopped by signal N at a step boundary
(the combined model saved: run the same command)."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are this command's one-line error (exit status 2), not usage + error."""

    def error(self, message):
        raise ConfigError(f"{message}; see returnn-tpu --help")


def argument_parser() -> argparse.ArgumentParser:
    """The command line: flags of returnn-tpu itself, then RETURNN's ``CONFIG [++key value ...]``."""
    parser = _Parser(
        prog="returnn-tpu",
        usage="returnn-tpu [--local-workers N [--max-restarts K]] CONFIG [++key value ...]\n"
              "       returnn-tpu --check",
        description="Train a RETURNN TensorFlow config on several devices, machines or TPU cores through\n"
                    "tf.distribute, as RETURNN's rnn.py would (task 'train'); other tasks go to plain RETURNN.\n"
                    "The config chooses how: distribute_strategy (default 'local_sgd') and distribute_options.",
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="a RETURNN config file")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, metavar="++key value",
                        help="set config option key to value, as with RETURNN (e.g. ++num_epochs 3)")
    parser.add_argument("--local-workers", type=int, metavar="N",
                        help="run N workers of one cluster on 127.0.0.1 (in a network namespace of their own)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="with --local-workers: restart all workers from the newest checkpoint up to K times "
                             "after a failure (default 0)")
    parser.add_argument("--check", action="store_true",
                        help="run every strategy this machine's devices allow on a tiny network and print a table")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    return parser


def _version() -> str:
    """This package's version and those of what it runs on (without importing them)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    found = [f"{name} {of(name)}" for name in ("returnn", "tensorflow", "tensorflow-cpu", "tensorflow-tpu") if of(name)]
    return f"{of('returnn_tpu') or 'unknown'} ({', '.join(found)})"


def parse_args(argv: List[str]) -> argparse.Namespace:
    """The parsed command line; :class:`ConfigError` for a bad one."""
    args = argument_parser().parse_args(argv)
    if args.check:
        if args.config or args.local_workers is not None:
            raise ConfigError("--check takes no config and no other option; see returnn-tpu --help")
        return args
    if args.local_workers is not None and args.local_workers < 1:
        raise ConfigError(f"--local-workers needs a number >= 1, got {args.local_workers}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts needs a number >= 0, got {args.max_restarts}")
    if args.max_restarts and args.local_workers is None:
        raise ConfigError("--max-restarts needs --local-workers")
    if not args.config:
        raise ConfigError("give a RETURNN config file; see returnn-tpu --help")
    if os.path.isdir(args.config):
        raise ConfigError(f"config file {args.config!r} is a folder, not a config file")
    if not os.path.isfile(args.config):
        raise ConfigError(f"config file {args.config!r} does not exist")
    return args


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
    from returnn_tpu.options import DEFAULT_STRATEGY, DistributeOptions

    strategy = config.typed_value("distribute_strategy", None) or config.value("distribute_strategy", DEFAULT_STRATEGY)
    options = config.typed_value("distribute_options", None)
    if options is None and config.has("distribute_options"):
        # ``++distribute_options "{...}"`` for a config that does not set it: RETURNN keeps the text
        # (its ``++`` evaluates only values of keys the config file set; FACTS.md, "Command-line overrides").
        text = config.value("distribute_options", "")
        try:
            options = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ConfigError(f"++distribute_options must be a Python dict, e.g. \"{{'num_replicas': 2}}\", got {text!r}") from None
    return DistributeOptions.from_config_values(strategy, options)


def set_worker_log(config, worker_index: int):
    """Non-chief workers log to ``<log>.worker<N>`` and print only errors and epoch results."""
    logs = [f"{path}.worker{worker_index}" if path not in ("stdout", "|") else path for path in config.list("log", [])]
    config.set("log", logs)
    config.set("log_verbosity", min(config.int("log_verbosity", 3), 2))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except ConfigError as exc:
        print(f"returnn-tpu: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        from returnn_tpu.selfcheck import check

        return check()
    if args.local_workers is not None:
        from returnn_tpu.launcher import run_local_workers

        return run_local_workers(args.local_workers, [args.config, *args.overrides], max_restarts=args.max_restarts)
    return train(args.config, args.overrides)


def train(filename: str, overrides: List[str]) -> int:
    """Runs the config's task in this process (training, or plain RETURNN for other tasks);
    returns the exit status."""
    from returnn_tpu.startup import TASKS, check_config, keys_dropped_by_overrides, load_config

    cluster = lock = options = None
    new_paths: List[str] = []
    try:
        config = load_config(filename, overrides)
        for line in keys_dropped_by_overrides(filename, overrides):
            print(f"returnn-tpu: note: {line}", file=sys.stderr)
        task = config.value("task", "train")
        if task not in TASKS:
            run_plain_returnn(config, filename, overrides)
        # Everything that can be checked is checked before anything is written, and what needs
        # no TensorFlow before TensorFlow starts.
        options = distribute_options_from_config(config)
        check_config(config)
        from returnn_tpu.cluster import resolve_cluster
        from returnn_tpu.faults import Stopped
        from returnn_tpu.launcher import STOP_SIGNALS
        from returnn_tpu.optimizers import optimizer_from_config
        from returnn_tpu.patches import setup_returnn
        from returnn_tpu.returnn_side.returnn_bridge import check_xla_compatible
        from returnn_tpu.session_options import apply_session_options
        from returnn_tpu.options import MULTI_WORKER_STRATEGY_NAMES
        from returnn_tpu.startup import check_classes, select_backend, use_persistent_xla_cache
        from returnn_tpu.strategies import check_replicas_per_worker
        from returnn_tpu.trainer import Trainer

        if options.jit_compile:
            use_persistent_xla_cache(config)
        select_backend(config)
        setup_returnn()
        optimizer = optimizer_from_config(config)  # bad input found before TensorFlow starts
        check_classes(config)
        if options.jit_compile:
            check_xla_compatible(config.typed_value("network") or {})
        ignored = apply_session_options(config)
        cluster = resolve_cluster(options.cluster_resolver) if options.strategy in MULTI_WORKER_STRATEGY_NAMES else None
        check_replicas_per_worker(options, cluster)
        if cluster and not cluster.is_chief:
            set_worker_log(config, cluster.worker_index)
        new_paths = _new_paths(config)
        if not cluster or cluster.is_chief:  # one run per model folder; the chief speaks for its workers
            model = config.value("model", "")
            os.makedirs(os.path.dirname(os.path.abspath(model)), exist_ok=True)
            lock = ModelLock(model)
        for path in config.list("log", []):
            if path not in ("stdout", "|"):
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        import returnn.__main__ as rnn

        rnn.init_log()
        rnn.returnn_greeting(config_filename=filename, command_line_options=overrides)
        for message in ignored:
            print(f"returnn-tpu: ignoring {message}", file=rnn.log.v3)
        trainer = Trainer(config, options, cluster, config_source=(filename, overrides), checked=True,
                          optimizer=optimizer)
        for signum in STOP_SIGNALS:  # replaces TensorFlow's multi-worker handler
            signal.signal(signum, trainer.stops.request.handle)
        trainer.stops.watch_signals(STOP_SIGNALS)
        trainer.initialize_model() if task == "initialize_model" else trainer.train()
    except ConfigError as exc:
        if lock:
            lock.release()
        _remove_new_paths(new_paths)  # bad input found after the log started (e.g. the data's dims)
        print(f"returnn-tpu: error: {exc}", file=sys.stderr)
        _abort_mpi_job(2)  # a refusal on one rank (the chief's lock, data found late) ends all of them
        _report_refusal_to_cluster(cluster, options, str(exc))
        return 2
    except Exception as exc:  # noqa: BLE001 (the failures of training that are one line; others re-raised)
        status = 1
        try:
            status = _training_failure(exc, cluster)
            return status
        finally:
            if lock:
                lock.release()
            if not isinstance(exc, Stopped):
                _abort_mpi_job(status)
    finally:
        if lock:
            lock.release()
    return 0


def _new_paths(config) -> List[str]:
    """The log files of ``config`` that do not exist yet, and the folders of its logs, model and
    learning-rate file that do not exist either (files first, each folder after the ones inside
    it): what is removed again when bad input is found after the start."""
    new = []
    logs = [os.path.abspath(path) for path in config.list("log", []) if path not in ("stdout", "|")]
    others = [os.path.dirname(os.path.abspath(config.value(key, "") or "."))
              for key in ("model", "learning_rate_file") if config.value(key, None)]
    for path in logs + others:
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


def _abort_mpi_job(status: int):
    """Under ``mpirun`` (MPI initialized in this process, more than one rank), a rank that fails
    or refuses its input ends the whole job: ``MPI_Abort`` has ``mpirun`` kill every rank (a hung
    one too, or one waiting for this one in a collective), where a normal exit would wait in
    ``MPI_Finalize`` for a peer that never comes (FACTS.md, "MPI"); ``mpirun`` then exits with
    ``status``. Without MPI, nothing."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() < 2:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    mpi.COMM_WORLD.Abort(status)


REFUSAL_WAIT_SECONDS = 30.0  # how long a refusing worker looks for another that waits for it


def _report_refusal_to_cluster(cluster, options, message: str):
    """Under ``TF_CONFIG`` (no ``mpirun`` to abort; workers that wait in TensorFlow's start-up hold
    the GIL and do not act on the launcher's SIGTERM), a worker that refuses its input ends the
    others through TensorFlow's coordination service: it joins the cluster if it has not yet,
    reports the refusal, and each other worker's next collective fails with it, which they print
    as this refusal and exit 2 (:func:`_training_failure`; FACTS.md, "A refusal under TF_CONFIG").
    To join, the others must be waiting for it (answering on their ports). Workers started one by
    one may come later: it looks for one for :data:`REFUSAL_WAIT_SECONDS`; under returnn-tpu's
    launcher, which stops workers that have not reached the start-up, it does not wait."""
    from returnn_tpu.launcher import LAUNCHED_WORKER_ENV

    if cluster is None or cluster.kind != "tf_config" or cluster.num_workers < 2 or options is None:
        return
    wait_for_any = 0.0 if os.environ.get(LAUNCHED_WORKER_ENV) else REFUSAL_WAIT_SECONDS
    import dataclasses

    from returnn_tpu.faults import REFUSAL_PREFIX
    from returnn_tpu.strategies import make_strategy
    from returnn_tpu.strategies.multi_worker import joined_cluster, report_error_to_cluster
    from returnn_tpu.strategies.startup_barrier import own_task, task_addresses
    from returnn_tpu.strategies.startup_watchdog import unanswered

    if not joined_cluster():
        own = own_task(cluster.resolver)
        peers = {name: address for name, address in task_addresses(cluster.resolver).items() if name != own}
        start = time.time()
        while unanswered(peers):
            waited = time.time() - start
            if (len(unanswered(peers)) == len(peers) and waited >= wait_for_any) or \
                    waited > options.startup_timeout:
                return  # nobody waits for this worker: each ends by itself, or names it at its startup_timeout
            time.sleep(0.5)
        make_strategy(dataclasses.replace(options, startup_timeout=min(options.startup_timeout, 30.0)), cluster)
    if report_error_to_cluster(f"{REFUSAL_PREFIX}worker {cluster.worker_index}: {message}"):
        time.sleep(2.0)  # worker 0 hosts the service: it stays while the others are told


def _training_failure(exc: Exception, cluster) -> int:
    """One line and the exit status for the failures training reports so (see module doc);
    re-raises any other exception."""
    from returnn_tpu import checkpoints
    from returnn_tpu.datapath.producer_protocol import ProducerError
    from returnn_tpu.reporting import RecordWriteError
    from returnn_tpu.errors import RESUMABLE_STATUS
    from returnn_tpu.faults import PEER_LOSS_ERRORS, NonFiniteScore, PeerLost, Stopped, reported_refusal
    from returnn_tpu.strategies.startup_barrier import ClusterDidNotComeUp

    if isinstance(exc, Stopped):
        print(f"returnn-tpu: {exc}", file=sys.stderr)
        return exc.status
    if isinstance(exc, (checkpoints.CheckpointWriteError, RecordWriteError)):
        print(f"returnn-tpu: error: {exc}", file=sys.stderr)
        return exc.status
    if isinstance(exc, (NonFiniteScore, checkpoints.NonFiniteModel, ProducerError, DatasetError, ClusterDidNotComeUp)):
        print(f"returnn-tpu: error: {exc}", file=sys.stderr)
        return 1
    refusal = reported_refusal(exc.cause if isinstance(exc, PeerLost) else exc)
    if refusal:  # another worker refused its input and told the cluster (under TF_CONFIG)
        print(f"returnn-tpu: error: {refusal}", file=sys.stderr)
        return 2
    saved = ""
    if isinstance(exc, PeerLost):
        exc, saved = exc.cause, f"; {exc.where}"
    if not isinstance(exc, PEER_LOSS_ERRORS) or not (cluster and cluster.num_workers > 1):
        raise exc
    lost = ", ".join(cluster.workers_named_in(exc.message)) or "another worker"
    reason = exc.message.strip().splitlines()[0]
    print(f"returnn-tpu: error: worker {cluster.worker_index}: lost {lost} in a collective "
          f"(it died, hangs, or is unreachable): {reason}{saved}", file=sys.stderr)
    return RESUMABLE_STATUS


if __name__ == "__main__":
    sys.exit(main())
