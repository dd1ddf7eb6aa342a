"""The notebooks (notebooks/*.ipynb) run top to bottom in a fresh Jupyter kernel, as a user opens
them: every cell without an error (each notebook asserts its own checks against TransformerLens
or a torch oracle), and their output is the user's results, not engine logs: no vLLM INFO line,
no traceback, none of vLLM's non-actionable warnings (backend/vllm/logs.py).

Each notebook starts its own engine in its kernel process (a compiled SmolLM2); conftest runs this
module first, while the suite's own engines are not built yet."""
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 900  # seconds: a compiled engine's first start on 2 cores, with room
ENGINE_LOG = re.compile(r"^(INFO|DEBUG) \d\d-\d\d |Traceback \(most recent call last\)", re.MULTILINE)


def outputs(notebook) -> str:
    texts = []
    for cell in notebook.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") if out.get("output_type") == "stream"
                         else "\n".join(str(v) for k, v in out.get("data", {}).items() if k == "text/plain"))
    return "\n".join(texts)


def test_every_notebook_the_readme_lists_is_here():
    listed = re.findall(r"^\| `(\d\d_\w+)` \|", (NOTEBOOKS[0].parent / "README.md").read_text(), re.MULTILINE)
    assert len(listed) >= 5 and sorted(listed) == [p.stem for p in NOTEBOOKS], (listed, [p.name for p in NOTEBOOKS])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom_quietly(path, tmp_path):
    from xmix_lens.backend.vllm.logs import NOT_ACTIONABLE
    from xmix_lens.verbosity import NATIVE_NOT_ACTIONABLE

    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        f"{path.name} is stored with outputs: strip them (the repo stays small)"
    # the kernel's environment as a user's: none of this process's engine settings, and no
    # PYTEST_CURRENT_TEST (with it, ipykernel leaves sys.stdout without a file descriptor)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_", "XMIX_LENS_VERBOSITY", "TRITON_", "PYTEST_"))}
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    # raises CellExecutionError, with the cell and its traceback, on any failing cell
    client.execute(env={**env, "PYTHONPATH": str(path.parents[1])})
    text = outputs(notebook)
    assert not ENGINE_LOG.search(text), ENGINE_LOG.search(text).group(0) + " in\n" + text[-3000:]
    # and none of the engine's start-up noise: native warnings, vLLM's weight-loading bar, tqdm's
    # notebook bar without widgets
    noise = (*NOT_ACTIONABLE, *NATIVE_NOT_ACTIONABLE, "Loading safetensors checkpoint shards", "IProgress not found")
    leaked = [m for m in noise if m in text]
    assert not leaked, leaked
