"""Both notebooks run top to bottom on CPU (their cells assert what they show)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO


@pytest.mark.slow
@pytest.mark.parametrize("name", ["colab_tpu.ipynb", "gce_cluster.ipynb"])
def test_notebook_executes(name):
    notebook = nbformat.read(os.path.join(REPO, "notebooks", name), as_version=4)
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": os.path.join(REPO, "notebooks")}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for o in outputs)
