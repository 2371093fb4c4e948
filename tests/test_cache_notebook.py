"""notebooks/explore_cache.ipynb runs top to bottom on a small cache built here."""
import os

import nbformat
import numpy as np
from nbclient import NotebookClient

from test_cache import make_rows, new_store

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "notebooks", "explore_cache.ipynb")


def test_explore_cache_notebook_runs(tmp_path, monkeypatch):
  new_store(tmp_path / "cache", num_seqs=10, layout_name="compact").write(
      0, make_rows(np.random.default_rng(0), 10))
  monkeypatch.setenv("KDJAX_CACHE", str(tmp_path / "cache"))
  with open(NOTEBOOK) as f:
    notebook = nbformat.read(f, as_version=4)
  NotebookClient(notebook, timeout=120, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  outputs = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                    for out in cell.outputs)
  assert "top-k mass" in outputs and "tensorstore and zarr-python disagree" not in outputs
