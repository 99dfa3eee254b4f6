"""RETURNN datasets made from the config, as RETURNN's ``rnn.py`` makes them, one per replica where needed.

:func:`init_datasets` completes a dataset's options as ``rnn.py`` does and gives each local
replica its own instance where ``dataset_distribution`` or the dataset's file sharding asks for
it (its ``random_seed_offset``, or its shard of the files); :func:`init_eval_datasets` makes the
datasets RETURNN evaluates. What RETURNN's dataset code refuses, here or when an epoch starts
(:func:`init_seq_order`), is bad input: a one-line :class:`returnn_tpu.errors.ConfigError`
naming the dataset. Nothing here imports TensorFlow: the data producer process makes its
datasets with this module (FACTS.md, "A producer without TensorFlow").
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Optional

from returnn_tpu.errors import ConfigError, refused_by_returnn

# A dataset's file that is not there (or cannot be opened): the config's error, not the machine's.
MISSING_FILE_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
SEED_OFFSET_PER_REPLICA = 16127  # RETURNN's factor per Horovod rank
LOADER_BUFFER_SEQS = 32  # sequences each loader process reads ahead (MultiProcDataset's buffer_size)
# Datasets that data_loaders leaves as they are: one that is a MultiProcDataset already, and
# DistributeFilesDataset, which loads each sub-epoch in a process of its own (one per instance).
LOADS_IN_PROCESSES = ("MultiProcDataset", "DistributeFilesDataset")


def init_seq_order(dataset, epoch: int):
    """RETURNN's ``init_seq_order``; an assertion or ``ValueError`` RETURNN's dataset code raises
    there (its check of the dataset's options, e.g. ``num_seqs > 0``, or a ``DistributeFilesDataset``
    sub-dataset without ``seq_ordering``), or a file that is not there, is bad input: one line
    naming the dataset and the failed check or the file."""
    try:
        dataset.init_seq_order(epoch=epoch)
    except MISSING_FILE_ERRORS as exc:  # DistributeFilesDataset looks at its files here (their sizes)
        raise ConfigError(f"{dataset.name}: RETURNN's {type(dataset).__name__} cannot read its files at epoch {epoch}: "
                          f"{exc}") from None
    except (AssertionError, ValueError) as exc:
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        detail = f": {exc}" if str(exc) else ""
        if "seq_ordering" in detail:  # RETURNN sets a dataset's seq_ordering from the config's batching
            detail += (" (the dataset's seq_ordering, or the config's batching where the dataset sets none; valid: "
                       "default, default_every_n:N, reverse, sorted, sorted_reverse, random[:SEED], random_sample, "
                       "sort_bin_shuffle[:N], sort_bin_shuffle_x2[:N], laplace[:N])")
        raise ConfigError(f"{dataset.name}: RETURNN's {type(dataset).__name__} refuses its options at epoch {epoch}: "
                          f"{where.line or 'an assertion'} ({os.path.basename(where.filename)}:{where.lineno})"
                          f"{detail}") from None


def shards_files(config, key: str = "train") -> bool:
    """Whether ``key``'s dataset deals its files to the replicas: RETURNN's
    ``DistributeFilesDataset`` with ``distrib_shard_files`` (its shard of the files for each
    distributed rank; here, for each replica)."""
    opts = config.typed_value(key, None)
    return isinstance(opts, dict) and bool(opts.get("distrib_shard_files"))


def init_datasets(config, key: str, num_replicas: int = 1, first_replica: int = 0, distribution: str = "shard",
                  all_replicas: Optional[int] = None, loaders: int = 1) -> list:
    """The RETURNN dataset(s) that config key ``key`` (``"train"``, ``"dev"``) describes.

    Options are completed as RETURNN's ``rnn.py`` does (``chunking``, ``batching``, ``window``
    from the config; no chunking and sorted order for ``dev``). For ``random_seed_offset`` on
    ``train`` there is one instance per local replica, each with its own offset; otherwise one.
    A ``train`` that shards its files (:func:`shards_files`) has one instance per local replica,
    each with its shard of ``all_replicas`` (default: ``first_replica + num_replicas``), as
    RETURNN's PyTorch engine gives each rank its shard (``_num_shards``, ``_shard_index``).
    With ``loaders`` > 1, each instance is wrapped in RETURNN's ``MultiProcDataset`` with
    ``loaders // instances`` processes (at least one), as a config that wraps its dataset itself
    would be (:func:`with_loaders`). Returns [] if the config has no such key.
    """
    from returnn.datasets import Dataset

    opts = config.typed_value(key, None)
    if opts is None:
        return []
    defaults = {"name": key}
    if key != "train":
        defaults.update(Dataset.get_default_kwargs_eval(config=config))
    base_offset = config.int("dataset_random_seed_offset", 0)
    replicas = range(first_replica, first_replica + num_replicas)
    sharded = shards_files(config, key)
    if sharded:  # one file order for all shards (else they would overlap)
        offsets = [base_offset] * num_replicas
    elif distribution == "random_seed_offset" and key == "train":
        offsets = [replica * SEED_OFFSET_PER_REPLICA + base_offset for replica in replicas]
    else:
        offsets = [base_offset]
    if not isinstance(opts, dict):
        if len(offsets) > 1:
            raise ConfigError(f"{key} must be a dict for dataset_distribution 'random_seed_offset', got {opts!r}")
        return [_init_dataset(key, opts, defaults)]
    datasets = []
    for replica, offset in zip(replicas, offsets):
        kwargs = {**defaults, "random_seed_offset": offset, **opts}
        if sharded:  # as RETURNN's "shard" over torch ranks, with a replica as the rank
            kwargs.update(distrib_shard_files=False, _num_shards=all_replicas or replicas.stop, _shard_index=replica)
        if loaders > 1:  # (else the dataset loads in the producer itself)
            kwargs = with_loaders(kwargs, max(1, loaders // len(offsets)))
        Dataset.kwargs_update_from_config(config, kwargs)
        datasets.append(_init_dataset(key, kwargs))
    return datasets


def loads_in_processes(opts) -> bool:
    """Whether the dataset of ``opts`` (a config's dataset options) loads its sequences in
    processes of its own already (:data:`LOADS_IN_PROCESSES`)."""
    kind = opts.get("class") if isinstance(opts, dict) else None
    return getattr(kind, "__name__", kind) in LOADS_IN_PROCESSES


def with_loaders(kwargs: dict, loaders: int) -> dict:
    """The options of a RETURNN ``MultiProcDataset`` that loads the dataset of ``kwargs`` in
    ``loaders`` processes of its own (``distribute_options['data_loaders']``): the same sequences in
    the same order, each made by one of them in turn (FACTS.md, "MultiProcDataset"). The config's
    batching options are added to it afterwards, as RETURNN adds them to a config's own
    ``MultiProcDataset``, which hands them on to the dataset it wraps. A dataset that already
    loads in processes of its own (:data:`LOADS_IN_PROCESSES`) is returned as it is."""
    if loads_in_processes(kwargs):
        return kwargs
    return {"class": "MultiProcDataset", "name": kwargs["name"], "dataset": kwargs, "num_workers": loaders,
            "buffer_size": LOADER_BUFFER_SEQS}


def _init_dataset(key: str, opts, defaults: Optional[dict] = None):
    """RETURNN's ``init_dataset``; whatever it raises is bad input, one line naming the dataset: a
    file it cannot open or read (a missing or truncated HDF file), an option it refuses (a
    ``chunking`` it cannot parse, a ``seq_ordering`` a dataset does not allow)."""
    from returnn.datasets import init_dataset

    try:
        return init_dataset(opts, default_kwargs=defaults)
    except Exception as exc:  # noqa: BLE001 (RETURNN's checks raise any type; all are the config's)
        what = opts.get("class") if isinstance(opts, dict) else opts
        what = getattr(what, "__name__", what)
        if isinstance(exc, OSError):
            error = ConfigError(f"{key}: RETURNN's {what} cannot read its files: {exc}")
        else:
            error = refused_by_returnn(key, f"its {what}", exc)
        # The half-made dataset's __del__ may fail in turn (PostprocessingDataset's does): a second
        # traceback about nothing the user can change. It runs as the exception is let go.
        hook, sys.unraisablehook = sys.unraisablehook, lambda _: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook
    raise error from None


def init_eval_datasets(config) -> list:
    """The datasets RETURNN evaluates after each training epoch, in its order: ``dev``, ``eval``
    (both with RETURNN's defaults for evaluation) and each of ``eval_datasets`` (name -> options)."""
    datasets = init_datasets(config, "dev") + init_datasets(config, "eval")
    for name, opts in (config.typed_value("eval_datasets", None) or {}).items():
        datasets.append(_init_dataset(name, opts, {"name": name}))
    return datasets
