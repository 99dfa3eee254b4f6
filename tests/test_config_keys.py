"""The table of RETURNN's config options (``returnn_tpu/config_keys.py``) against the installed RETURNN.

RETURNN keeps no list of its options, so its TF training sources are the list: they are parsed
(as text, nothing of them runs) for every option they read, and each must be in exactly one class
of the table. An option that a RETURNN upgrade adds fails here until it is classified.
"""

import ast
import os

import pytest

from returnn_tpu import config_keys

# The files of RETURNN whose options the table classifies: its main (rnn.py), the engine base,
# the TF engine and updater, and the TF network (extern data, the fetches of a step).
SOURCES = ("__main__.py", "engine/base.py", "tf/engine.py", "tf/updater.py", "tf/network.py")
CLASSES = {"SUPPORTED": config_keys.SUPPORTED, "REFUSED": config_keys.REFUSED,
           "WITHOUT_EFFECT": config_keys.WITHOUT_EFFECT}

# Config methods that read an option: config.int("num_epochs", 5), config.typed_value("dev"), ...
READ_METHODS = {"value", "int", "float", "bool", "bool_or_other", "typed_value", "opt_typed_value", "list", "dict",
                "float_list", "int_list", "int_pair", "has", "is_true", "is_typed", "is_of_type", "get_of_type"}
TYPED_DICT_METHODS = {"get", "setdefault", "pop"}  # config.typed_dict.get("wrap_tf_session", None), ...

# Reads whose option name is an expression, by file and source text, with the options they read
# (found by hand). A read not listed here fails the test until it is added.
DYNAMIC_READS = {
    # load_data(config, ..., files_config_key) is called with "dev", "eval" and "train".
    ("__main__.py", "config.bool_or_other(files_config_key, None)"): ("train", "dev", "eval"),
    ("__main__.py", "config.is_typed(files_config_key)"): ("train", "dev", "eval"),
    ("__main__.py", "config.typed_value(files_config_key)"): ("train", "dev", "eval"),
    ("__main__.py", "config.value(files_config_key, '')"): ("train", "dev", "eval"),
    # setup_dummy_datasets: for key in ["dev", "eval", "forward_data", "search_data"].
    ("__main__.py", "config.bool_or_other(key)"): ("dev", "eval", "forward_data", "search_data"),
    # task "config:NAME" / "optional-config:NAME" calls the config's own function NAME (no option);
    # such a task is handed to plain RETURNN.
    ("__main__.py", "config.typed_dict[task[len('config:'):]]"): (),
    ("__main__.py", "config.typed_dict.get(task[len('optional-config:'):], None)"): (),
    # Engine._maybe_update_config: a network dict's "#config" entries, options classified under
    # their own names (returnn-tpu applies them in EpochNetworks.apply_config_updates).
    ("tf/engine.py", "key in self.config.typed_dict"): (),
    ("tf/engine.py", "self.config.typed_dict[key]"): (),
}


def _name(node) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _is_config(node) -> bool:
    """``config``, ``self.config``, ``self.engine.config``, ``self._config`` or ``get_global_config()``."""
    return _name(node) == "get_global_config" if isinstance(node, ast.Call) else _name(node).endswith("config")


def _is_typed_dict(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "typed_dict" and _is_config(node.value)


def option_reads(source: str):
    """``(names, dynamic)``: the option names ``source`` reads with a literal name, and the source
    text of each read whose name is an expression."""
    names, dynamic = set(), set()
    for node in ast.walk(ast.parse(source)):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            method, owner = node.func.attr, node.func.value
            if method in READ_METHODS and _is_config(owner) or method in TYPED_DICT_METHODS and _is_typed_dict(owner):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_typed_dict(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and _is_typed_dict(node.comparators[0]):
            key = node.left
        if key is None:
            continue
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            names.add(key.value)
        else:
            dynamic.add(ast.unparse(node))
    return names, dynamic


def returnn_options():
    """``(options, unknown dynamic reads)`` of the installed RETURNN's :data:`SOURCES`."""
    import returnn

    options, unknown = set(), set()
    for path in SOURCES:
        with open(os.path.join(os.path.dirname(returnn.__file__), path), encoding="utf8") as f:
            names, dynamic = option_reads(f.read())
        options |= names
        for text in dynamic:
            if (path, text) in DYNAMIC_READS:
                options.update(DYNAMIC_READS[path, text])
            else:
                unknown.add(f"{path}: {text}")
    return options, unknown


def test_option_reads_finds_every_form():
    """Each way RETURNN's code reads an option; a name made at run time is reported as such; a
    layer's ``updater_opts`` are no config."""
    names, dynamic = option_reads(
        "config.int('a', 1)\nself.engine.config.bool('b')\nget_global_config().value('c', None)\n"
        "self._config.has('d')\nconfig.typed_dict.get('e')\nconfig.typed_dict['f']\n"
        "if 'g' in self.config.typed_dict: pass\nconfig.typed_value('%s_h' % prefix)\nupdater_opts.get('i', 0)\n"
    )
    assert names == set("abcdefg") and dynamic == {"config.typed_value('%s_h' % prefix)"}


def test_every_option_returnn_reads_is_classified():
    """Every option the installed RETURNN's sources read is in the table, and every option in the
    table is read there (no misspelt entry that would never refuse anything)."""
    import returnn

    options, unknown = returnn_options()
    assert len(options) > 100  # the parse found RETURNN's reads
    assert not unknown, (
        f"RETURNN {returnn.__version__} reads options through a variable here: {sorted(unknown)}; find which "
        "options each reads and add it to DYNAMIC_READS in tests/test_config_keys.py")
    classified = set().union(*CLASSES.values())
    missing = sorted(options - classified)
    assert not missing, (
        f"RETURNN {returnn.__version__} reads options that returnn_tpu/config_keys.py does not classify: {missing}. "
        "Look at what each does in RETURNN's source and add it to SUPPORTED (implemented with RETURNN's meaning), "
        "REFUSED (changes training, not implemented: check_supported stops on it) or WITHOUT_EFFECT, with a reason")
    stale = sorted(classified - options)
    assert not stale, f"returnn_tpu/config_keys.py classifies options RETURNN does not read: {stale} (misspelt?)"


def test_no_option_in_two_classes():
    """Each option has one class, and one line of reason."""
    names = list(CLASSES)
    twice = {f"{a}/{b}": sorted(CLASSES[a].keys() & CLASSES[b].keys())
             for i, a in enumerate(names) for b in names[i + 1:] if CLASSES[a].keys() & CLASSES[b].keys()}
    assert not twice
    assert all(isinstance(reason, str) and reason and "\n" not in reason
               for table in CLASSES.values() for reason in table.values())


@pytest.mark.parametrize("values", [
    {"search_train_network_layers": ["output"]},
    {"seq_drop": 0.1},
    {"load": "/other/model.010"},
    {"preload_from_files": {"base": {"filename": "/other/model.010", "init_for_train": True}}},
    {"adagrad": True},
    {"eval_use_train_flag": True},
])
def test_refused_option_stops(values):
    """A refused option turned on stops with one line naming it."""
    from returnn.config import Config

    from returnn_tpu.errors import ConfigError
    from returnn_tpu.startup import check_supported

    (key,) = values
    with pytest.raises(ConfigError) as error:
        check_supported(Config(values))
    message = str(error.value)
    assert f"config option {key!r} (" in message and "not supported by returnn-tpu" in message
    assert "\n" not in message


@pytest.mark.parametrize("values", [
    {"search_train_network_layers": []},
    {"seq_drop": 0.0},
    {"load": ""},
    {"preload_from_files": {"base": {"filename": "/other/model.010"}}},  # for recognition only
    {"adagrad": True, "optimizer": {"class": "adam"}},  # RETURNN reads the old flags only without optimizer
    {"eval_use_train_flag": False},
])
def test_refused_option_at_its_default_passes(values):
    """A refused option at a value with which RETURNN trains as returnn-tpu does is no error."""
    from returnn.config import Config

    from returnn_tpu.startup import check_supported

    check_supported(Config(values))


DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
README = os.path.join(os.path.dirname(DOCS), "README.md")


def _first_column_names(path: str, after: str):
    """The backquoted names in the first column of the first table after the line ``after``."""
    text = open(path).read()
    lines = text[text.index(after):].split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:  # past the header and its rule
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip().split("`")[1].strip('"'))
    return rows


def test_the_options_table_in_the_docs_is_the_options_class():
    """docs/config.md's `distribute_options` table has a row for each field of DistributeOptions
    (``strategy`` is the other config key)."""
    import dataclasses

    from returnn_tpu.options import DistributeOptions

    documented = _first_column_names(os.path.join(DOCS, "config.md"), "`distribute_options` (unknown keys")
    fields = [field.name for field in dataclasses.fields(DistributeOptions) if field.name != "strategy"]
    assert sorted(documented) == sorted(fields)


def test_the_strategies_table_in_the_readme_is_the_strategy_list():
    from returnn_tpu.options import DEFAULT_STRATEGY, STRATEGY_NAMES

    names = _first_column_names(README, "## Strategies")
    assert sorted(names) == sorted(STRATEGY_NAMES)
    assert f'`"{DEFAULT_STRATEGY}"` (default)' in open(README).read()


@pytest.mark.parametrize("given,seconds", [("4:00:00", 14400.0), ("90:00", 5400.0), ("45", 45.0), (3600, 3600.0)])
def test_time_limit_reads_as_sge_and_slurm_write_it(given, seconds):
    from returnn_tpu.options import DistributeOptions

    options = {"time_limit": given, "stop_before_time_limit": 1}
    assert DistributeOptions.from_config_values("local_sgd", options).time_limit == seconds
