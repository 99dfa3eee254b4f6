"""The import rules of docs/architecture.md, read from the package's source (every import
statement, also those inside functions)."""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "returnn_tpu")

# Outside strategies/, the one module that uses TensorFlow's private API (tensorflow.python); each
# use is cited in docs/FACTS.md.
PRIVATE_TENSORFLOW_OUTSIDE_STRATEGIES = {"patches.py"}


def imported_modules(path: str):
    """Every module that ``path`` imports, as its dotted name (relative imports resolved)."""
    package = os.path.relpath(os.path.dirname(path), os.path.dirname(PACKAGE)).replace(os.sep, ".")
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def sources(folder: str = ""):
    """The package's source files under ``folder``, relative to the package."""
    for root, _, files in os.walk(os.path.join(PACKAGE, folder)):
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(root, name), PACKAGE)


def imports_of(relative: str):
    return set(imported_modules(os.path.join(PACKAGE, relative)))


def test_the_source_tree_is_where_the_rules_look():
    found = set(sources())
    assert {"trainer.py", os.path.join("datapath", "data.py"), os.path.join("datapath", "producer.py"),
            os.path.join("returnn_side", "returnn_bridge.py"), os.path.join("strategies", "__init__.py"),
            os.path.join("strategies", "sync", "schedule.py"), os.path.join("cluster", "mpi.py")} <= found


@pytest.mark.parametrize("folder", ["strategies", "cluster"])
def test_strategies_and_cluster_never_import_returnn(folder):
    offending = {relative: sorted(m for m in imports_of(relative) if m == "returnn" or m.startswith("returnn."))
                 for relative in sources(folder)}
    assert {k: v for k, v in offending.items() if v} == {}


def test_only_the_strategies_know_what_kind_of_strategy_runs():
    """The trainer is one client of the strategies' surface (``make_strategy``, ``make_syncs``):
    outside strategies/, nothing asks whether a strategy is local SGD or runs its syncs in the
    step, and nothing reaches into the sync's modules."""
    private = ("returnn_tpu.strategies.extended.is_local_sgd", "returnn_tpu.strategies.extended.updates_in_replica")
    offending = {}
    for relative in sources():
        if relative.startswith("strategies" + os.sep):
            continue
        found = sorted(m for m in imports_of(relative)
                       if m in private or m.startswith("returnn_tpu.strategies.sync."))
        if found:
            offending[relative] = found
    assert offending == {}
    assert "returnn_tpu.strategies.sync.CopiesAlwaysEqual" in imports_of(os.path.join("strategies", "__init__.py"))


def test_the_extended_owns_the_sync_parts():
    """The local-SGD extended owns the schedule, the engine and their state, for the trainer and
    for TF2 programs: it imports them, and nothing of the sync package imports the extended back."""
    owner = imports_of(os.path.join("strategies", "extended.py"))
    assert {"returnn_tpu.strategies.sync.SyncEngine", "returnn_tpu.strategies.sync.SyncSchedule",
            "returnn_tpu.strategies.sync.LocalSGDSyncs"} <= owner
    owners = ("returnn_tpu.strategies.extended", "returnn_tpu.strategies.local_sgd",
              "returnn_tpu.strategies.multi_worker", "returnn_tpu.strategies.tpu")
    back = {relative: sorted(m for m in imports_of(relative) if m == "returnn_tpu.strategies" or m.startswith(owners))
            for relative in sources(os.path.join("strategies", "sync"))}
    assert {k: v for k, v in back.items() if v} == {}


@pytest.mark.parametrize("relative", sorted(sources("datapath")))
def test_the_data_path_never_imports_tensorflow(relative):
    """The producer process runs without TensorFlow (its memory; docs/data.md), and the whole data
    path is what it runs."""
    assert sorted(m for m in imports_of(relative) if m.split(".")[0] == "tensorflow") == []


# What each folder may import of the package besides itself (docs/architecture.md, "The parts"):
# the strategies and the cluster know no data and no RETURNN, the data path no strategy and no
# network, the RETURNN side of the data path its batching key and read-ahead only, and of the
# strategies their public surface; none of them the run (trainer, cli, checkpoints, ...).
FOLDER_IMPORTS = {
    "cluster": {"errors"},
    "strategies": {"cluster", "errors", "options", "optimizers"},
    "datapath": {"errors", "startup", "launcher"},
    "returnn_side": {"datapath", "errors", "optimizers", "patches", "startup", "strategies"},
}


@pytest.mark.parametrize("folder", sorted(FOLDER_IMPORTS))
def test_the_import_direction_between_the_folders(folder):
    offending = {}
    for relative in sources(folder):
        parts = {m.split(".")[1] for m in imports_of(relative) if m.startswith("returnn_tpu.")}
        found = sorted(parts - FOLDER_IMPORTS[folder] - {folder})
        if found:
            offending[relative] = found
    assert offending == {}


def test_private_tensorflow_only_in_strategies_and_the_patches_module():
    users = {relative for relative in sources()
             if any(m.startswith("tensorflow.python") for m in imports_of(relative))}
    outside = {relative for relative in users if not relative.startswith("strategies" + os.sep)}
    assert outside <= PRIVATE_TENSORFLOW_OUTSIDE_STRATEGIES, sorted(outside - PRIVATE_TENSORFLOW_OUTSIDE_STRATEGIES)
    assert any(relative.startswith("strategies" + os.sep) for relative in users)  # the rule still sees them


def test_the_tf2_example_imports_no_returnn():
    """examples/keras_local_sgd.py is a TF2 program: it uses the strategies without RETURNN."""
    example = os.path.join(os.path.dirname(PACKAGE), "examples", "keras_local_sgd.py")
    modules = {node.module for node in ast.walk(ast.parse(open(example).read())) if isinstance(node, ast.ImportFrom)}
    modules |= {alias.name for node in ast.walk(ast.parse(open(example).read())) if isinstance(node, ast.Import)
                for alias in node.names}
    assert "returnn_tpu.strategies" in modules
    assert not [m for m in modules if m and (m == "returnn" or m.startswith("returnn."))]
