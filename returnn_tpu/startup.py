"""Loading a RETURNN config and checking it, before TensorFlow is imported or anything written.

:func:`load_config` reads the config as RETURNN's ``rnn.py`` does; :func:`check_config` finds
the bad input a user can make in it (a typo, a value out of range, a path that cannot be
written) and raises :class:`ConfigError` with one line naming the option and what is valid.
Neither imports TensorFlow, so such an error is not preceded by TensorFlow's start-up lines
(FACTS.md, "What imports TensorFlow").
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tempfile
from typing import List, Optional, Set

from returnn_tpu.config_keys import REFUSED
from returnn_tpu.errors import ConfigError

TASKS = ("train", "initialize_model")  # the tasks returnn-tpu runs itself; cli hands others to RETURNN

# Options that change what is trained and that this trainer does not implement: stop, don't ignore
# (the REFUSED class of the table of every option RETURNN's TF training reads).
UNSUPPORTED_TRAINING_OPTIONS = REFUSED
# RETURNN reads these only when the config has no ``optimizer``.
_OLD_OPTIMIZER_FLAGS = ("adadelta", "adagrad", "rmsprop")

# (option, whether it is an int, what is valid, the test): numbers RETURNN reads with int()/float().
NUMBERS = (
    ("num_epochs", True, "an int >= 1", lambda v: v >= 1),
    ("save_interval", True, "an int >= 1", lambda v: v >= 1),
    ("batch_size", True, "an int >= 1", lambda v: v >= 1),
    ("max_seqs", True, "an int >= 1 (or -1: no limit)", lambda v: v >= 1 or v == -1),
    ("max_seq_length", True, "an int >= 0 (0: no limit)", lambda v: v >= 0),
    ("learning_rate", False, "a number > 0", lambda v: v > 0),
    ("log_verbosity", True, "an int >= 0", lambda v: v >= 0),
)


def load_config(config_filename: str, overrides):
    """Loads the config and sets RETURNN's process-global state as its ``rnn.py`` does.

    RETURNN's own ``init_config`` loads the file with the ``++key value`` overrides applied
    before and after (so config code can read them and they win), makes it the global config
    and applies the config's ``behavior_version``. A backend other than the TF net-dict one is
    an error (:func:`select_backend` then selects it); RETURNN's low-level ``"tensorflow"``
    frontend backend would raise the minimum behavior version to 16 and change what old configs
    mean (FACTS.md, "Backend and behavior version"). Nothing is written. Returns the config.
    """
    import returnn.__main__ as rnn

    _check_overrides(overrides)
    _check_override_keys(config_filename, overrides[::2])
    try:
        rnn.init_config(config_filename=config_filename, command_line_options=overrides)
    except SyntaxError as exc:
        raise ConfigError(f"config file {config_filename!r} has a Python syntax error in line {exc.lineno}: {exc.msg}") from None
    except NameError as exc:  # RETURNN evaluates an override of a non-string config value as Python
        culprit = next((f"{key} {value}" for key, value in zip(overrides[::2], overrides[1::2])
                        if getattr(exc, "name", None) and exc.name in value), None)
        if culprit is None:
            raise ConfigError(f"config file {config_filename!r} raised {_where(exc, config_filename)}") from None
        raise ConfigError(f"{culprit}: not a Python value ({exc}); quote a string, as in ++key \"'text'\"") from None
    except Exception as exc:  # noqa: BLE001 (the config's own code: the user's error, shown as one line)
        if isinstance(exc, UnicodeDecodeError) or "null bytes" in str(exc):  # a binary file
            raise ConfigError(f"config file {config_filename!r} is not a text file of Python ({exc})") from None
        raise ConfigError(f"config file {config_filename!r} raised {_where(exc, config_filename)}") from None
    config = rnn.config
    backend = config.value("backend", None)
    if backend not in (None, "tensorflow-net-dict"):
        raise ConfigError(
            f"backend {backend!r} is not supported: returnn-tpu trains RETURNN's TensorFlow network-dict "
            "configs (backend 'tensorflow-net-dict' or use_tensorflow = True)"
        )
    return config


def _where(exc: BaseException, config_filename: str) -> str:
    """``"TypeError: ... (line 12)"``: the exception and the config's line it came from."""
    import traceback

    lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__)
             if os.path.abspath(frame.filename) == os.path.abspath(config_filename)]
    return f"{type(exc).__name__}: {exc}" + (f" (line {lines[-1]})" if lines else "")


XLA_CACHE_FLAG = "--tf_xla_persistent_cache_directory"


def use_persistent_xla_cache(config):
    """TensorFlow's own persistent XLA compilation cache, in ``xla_cache`` beside the checkpoints:
    a later epoch, a resumed run and the next run of the config load compiled programs instead
    of compiling them again. Set in ``TF_XLA_FLAGS`` before TensorFlow reads them (at its first
    XLA compilation); a cache directory the user set there is kept."""
    flags = os.environ.get("TF_XLA_FLAGS", "")
    if XLA_CACHE_FLAG not in flags:
        folder = os.path.join(os.path.dirname(os.path.abspath(config.value("model", ""))), "xla_cache")
        os.environ["TF_XLA_FLAGS"] = f"{flags} {XLA_CACHE_FLAG}={folder}".strip()


def select_backend(config):
    """RETURNN's backend choice for the config (the TF net-dict backend where it names none).
    Imports TensorFlow (RETURNN registers its TF frontend here)."""
    from returnn.util.basic import BackendEngine

    BackendEngine.select_engine(config=config, default_fallback_engine=BackendEngine.TensorFlowNetDict)


def _check_overrides(overrides):
    """The command line after the config is ``++key value`` pairs (RETURNN asserts it)."""
    if len(overrides) % 2 or not all(key.startswith("++") and len(key) > 2 for key in overrides[::2]):
        raise ConfigError(f"after the config file, give ++key value pairs, got {' '.join(overrides)!r}")


# How RETURNN's code (and ours) reads an option: config.int("num_epochs", ...), config.typed_value("dev"), ...
_OPTION_READ = re.compile(
    r"""config\.(?:value|int|float|bool|bool_or_other|typed_value|opt_typed_value|list|dict|float_list|int_list|"""
    r"""int_pair|has|is_true|is_typed|is_of_type|get_of_type|typed_dict\.get)\(\s*["']([A-Za-z_]\w*)["']"""
)


def known_option_names() -> Set[str]:
    """Every option name that RETURNN's or returnn-tpu's code reads with a literal name (found in
    their installed sources; RETURNN keeps no list of its options)."""
    import returnn

    names = {"distribute_strategy", "distribute_options"}
    for package in (os.path.dirname(returnn.__file__), os.path.dirname(__file__)):
        for folder, _, files in os.walk(package):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), encoding="utf8", errors="replace") as f:
                        names.update(_OPTION_READ.findall(f.read()))
    return names


def keys_dropped_by_overrides(config_filename: str, overrides) -> List[str]:
    """One line for each ``++key {...}`` that replaces a dict the config file assigns as a literal
    (RETURNN's semantics: the whole value, not an update), naming the file's keys it dropped, so
    that an override meant as an update does not silently lose them."""
    import ast

    try:
        with open(config_filename, encoding="utf8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return []  # load_config says what is wrong with the file
    assigned = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned[target.id] = {key.value for key in node.value.keys if isinstance(key, ast.Constant)}
    lines = []
    for key, text in zip(overrides[::2], overrides[1::2]):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            continue
        dropped = sorted(map(str, assigned.get(key[2:], set()) - set(value))) if isinstance(value, dict) else []
        if dropped:
            lines.append(f"{key} replaces the config's whole {key[2:]} (RETURNN's overrides do not merge); it dropped "
                         f"{', '.join(dropped)}: give them in the override too to keep them")
    return lines


def _check_override_keys(config_filename: str, keys):
    """A ``++key`` must be an option the config names (its own code may read it) or one RETURNN
    or returnn-tpu reads: anything else is a typo that would be ignored."""
    with open(config_filename, encoding="utf8", errors="replace") as f:
        text = f.read()
    for key in (key[2:] for key in keys):
        if re.search(rf"\b{re.escape(key)}\b", text):
            continue
        known = known_option_names()
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known | set(re.findall(r"^(\w+)\s*=", text, re.M))), n=1)
        hint = f"; did you mean ++{close[0]}?" if close else ""
        raise ConfigError(f"++{key}: no such option (the config does not name it and RETURNN does not read it){hint}")


def check_config(config):
    """Everything about the config that can be checked before TensorFlow starts (see module doc)."""
    check_supported(config)
    for key, integer, what, valid in NUMBERS:
        _check_number(config, key, integer, what, valid)
    if config.typed_value("train", None) is None:
        raise ConfigError("config option 'train' (the training dataset) is missing")
    if not config.value("model", None):
        raise ConfigError("config option 'model' (where checkpoints go) is missing")
    network = config.typed_value("network", None)
    if isinstance(network, dict) and not config.typed_value("get_network", None) and not _has_loss(network):
        raise ConfigError("network has no layer with a 'loss': there is nothing to train")
    model = config.value("model", "")
    if model.endswith(os.sep) or os.path.isdir(model):
        raise ConfigError(f"model must be a file name prefix for the checkpoints (e.g. 'out/model', which gives "
                          f"out/model.001.index), got the folder {model!r}")
    _check_writable("model", os.path.dirname(os.path.abspath(model)))
    scores_file = config.value("learning_rate_file", None)
    if scores_file:
        if os.path.isdir(scores_file):
            raise ConfigError(f"learning_rate_file must be a file (RETURNN writes the epochs' scores there), got the "
                              f"folder {scores_file!r}")
        _check_writable("learning_rate_file", os.path.dirname(os.path.abspath(scores_file)))
    for path in config.list("log", []):
        if path not in ("stdout", "|"):
            _check_writable("log", os.path.dirname(os.path.abspath(path)))


def check_supported(config):
    """Stops on config options that would change training and are not implemented."""
    if config.value("task", "train") not in TASKS:
        raise ConfigError(f"task must be one of {', '.join(map(repr, TASKS))} for the trainer, got {config.value('task', '')!r}")
    from returnn.tensor import Dim

    for key, opts in (config.typed_value("extern_data", None) or {}).items():
        for field in ("dim_tags", "dims"):
            dims = opts.get(field) if isinstance(opts, dict) else None
            if dims is not None and not all(isinstance(dim, Dim) for dim in dims):
                raise ConfigError(f"extern_data[{key!r}][{field!r}] must be a list of Dim objects "
                                  f"(returnn.tensor.Dim, batch_dim), got {dims!r}")
    for key, what in UNSUPPORTED_TRAINING_OPTIONS.items():
        if _turned_on(config, key):
            raise ConfigError(f"config option {key!r} ({what}) is not supported by returnn-tpu yet; remove it")
    accum = config.typed_value("accum_grad_multiple_step", None)
    if accum is not None and (isinstance(accum, bool) or not isinstance(accum, int) or accum < 0):
        raise ConfigError(f"accum_grad_multiple_step must be an int >= 0 (0 and 1: an update after every batch, "
                          f"as in RETURNN), got {accum!r}")


def _turned_on(config, key: str) -> bool:
    """Whether the config sets a refused option to a value with which RETURNN's training differs
    from returnn-tpu's (RETURNN's default, off: None, False, 0, empty, is what returnn-tpu does)."""
    value = config.typed_value(key, None)
    if key == "preload_from_files":  # in training, RETURNN loads only the entries with init_for_train
        return isinstance(value, dict) and any(isinstance(opts, dict) and opts.get("init_for_train")
                                               for opts in value.values())
    if key in _OLD_OPTIMIZER_FLAGS:
        return bool(value) and not config.typed_value("optimizer", None)
    return bool(value)


def check_classes(config):
    """Every dataset and layer class the config names is one RETURNN knows, and ``chunking``
    parses. Imports RETURNN's
    dataset and TF layer modules (TensorFlow): run after RETURNN is set up for TF2 (FACTS.md,
    "What imports TensorFlow")."""
    for key in ("train", "dev", "eval"):
        _check_dataset(key, config.typed_value(key, None))
    eval_datasets = config.typed_value("eval_datasets", None) or {}
    if not isinstance(eval_datasets, dict):
        raise ConfigError(f"eval_datasets must be a dict (name -> dataset options), got {eval_datasets!r}")
    for name, opts in eval_datasets.items():
        _check_dataset(f"eval_datasets[{name!r}]", opts)
    check_layer_classes(config.typed_value("network", None))
    _check_chunking(config.typed_value("chunking", None))


def _check_chunking(chunking):
    """``chunking`` is a value RETURNN's datasets can parse (with RETURNN's own parser)."""
    from returnn.datasets.basic import Dataset

    if chunking is None:
        return
    try:
        Dataset._parse_chunking(chunking)
    except Exception:  # noqa: BLE001 (its parser fails with any type)
        raise ConfigError(f"chunking must be 'size:step' (e.g. '100:50'), a size, a (size, step) pair, dicts of "
                          f"them per data key, or a function; got {chunking!r}") from None


def check_layer_classes(network: Optional[dict], where: str = "network"):
    """Every layer's ``class`` is one RETURNN knows."""
    from returnn.tf.layers.basic import get_layer_class

    for name, layer in (network or {}).items():
        if not isinstance(layer, dict):
            continue
        cls = layer.get("class")
        if isinstance(cls, str):
            try:
                get_layer_class(cls)
            except Exception:  # noqa: BLE001 (RETURNN raises a bare Exception or KeyError)
                raise ConfigError(f"{where}[{name!r}]: unknown layer class {cls!r}") from None
        for key in ("subnetwork", "unit"):
            if isinstance(layer.get(key), dict):
                check_layer_classes(layer[key], f"{where}[{name!r}][{key!r}]")


def _check_number(config, key: str, integer: bool, what: str, valid):
    raw = config.typed_value(key, None)
    if raw is None or (isinstance(raw, (dict, list, tuple)) and key != "learning_rate"):
        return  # e.g. batch_size or max_seq_length per data key: RETURNN checks those
    # A string is not a number here even if it reads as one: RETURNN's code uses the value as it is.
    value = float(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else None
    if value is None or not math.isfinite(value) or (integer and not isinstance(raw, int)) or not valid(value):
        raise ConfigError(f"{key} must be {what}, got {raw!r}")


def _check_dataset(key: str, opts):
    """The dataset's class is one RETURNN's ``init_dataset`` accepts: a name it knows, or a
    ``Dataset`` subclass (one defined in the config, too). Other forms (a file name, a
    ``"config:"`` reference, a function returning the options, a dataset object) RETURNN resolves."""
    if not isinstance(opts, dict):
        return
    from returnn.datasets.basic import Dataset, get_dataset_class

    cls = opts.get("class")
    if isinstance(cls, type):
        if not issubclass(cls, Dataset):
            raise ConfigError(f"{key}: dataset class {cls.__name__} is not a subclass of RETURNN's Dataset")
    elif not isinstance(cls, str) or get_dataset_class(cls) is None:
        raise ConfigError(f"{key}: unknown dataset class {cls!r}; see RETURNN's returnn/datasets for the classes, "
                          "or give a Dataset subclass")


def _has_loss(net: dict) -> bool:
    for layer in net.values():
        if not isinstance(layer, dict):
            continue
        if layer.get("loss") or any(isinstance(layer.get(k), dict) and _has_loss(layer[k]) for k in ("subnetwork", "unit")):
            return True
    return False


LONGEST_FILE_NAME = 100  # bytes: the longest name of a file written in the model's folder, with room to spare


def _check_writable(option: str, folder: str):
    """``folder`` can be created or written, found by trying (``os.access`` says yes to root, also
    under ``/proc``): a file is created and removed in its nearest existing ancestor, and every
    part still to be created is a name the file system allows."""
    existing, missing = folder, []
    while not os.path.lexists(existing):
        existing, name = os.path.dirname(existing), os.path.basename(existing)
        missing.append(name)
    if not os.path.exists(existing):
        raise ConfigError(f"{option}: cannot write to {folder!r} ({existing!r} is a symlink to nothing)")
    if not os.path.isdir(existing):
        raise ConfigError(f"{option}: cannot write to {folder!r} ({existing!r} is not a folder)")
    try:
        longest = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    too_long = [name for name in missing if len(name.encode()) > longest]
    if too_long:
        raise ConfigError(f"{option}: cannot write to {folder!r} (the name {too_long[0][:40]!r}... is longer than the "
                          f"{longest} bytes the file system allows)")
    try:
        longest_path = os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        longest_path = 4096
    # Room for the files written there, e.g. "model.123.interrupted.tmp-1234567.data-00000-of-00001".
    if len(folder.encode()) + LONGEST_FILE_NAME > longest_path:
        raise ConfigError(f"{option}: cannot write to {folder[:60]!r}... (its path of {len(folder.encode())} bytes "
                          f"leaves no room for file names in the {longest_path} bytes a path may have)")
    try:
        handle, probe = tempfile.mkstemp(prefix=".returnn_tpu_write_test_", dir=existing)
        os.close(handle)
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"{option}: cannot write to {folder!r} (creating a file in {existing!r} failed: "
                          f"{exc.strerror or exc})") from None
