"""examples/notebook.ipynb, executed by a real Jupyter kernel (nbclient + ipykernel): the interactive session
runs top to bottom, an actor's prints reach the notebook, a shape error shows torch's message with a short
traceback ending at the cell's line, the session goes on, and the plot renders."""

import os
import re

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is a dev extra: pip install -e '.[dev]'")
nbclient = pytest.importorskip("nbclient", reason="nbclient is a dev extra: pip install -e '.[dev]'")
pytest.importorskip("ipykernel", reason="ipykernel is a dev extra: pip install -e '.[dev]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_the_notebook_runs_in_a_real_kernel(tmp_path):
    nb = nbformat.read(os.path.join(ROOT, "examples", "notebook.ipynb"), as_version=4)
    # (as a user's kernel: with the warm-up, which tests/conftest.py turns off for the tests' own procs)
    env = {k: v for k, v in os.environ.items() if k != "MONARCH_TENSOR_NO_WARMUP"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": ROOT}})
    with _env(env):
        client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")

    assert "tensor([[  5.,  14.,  23.,  32.]," in text  # dt @ dt.T, fetched
    assert "[0] hello notebook from rank 0" in text and "[1] hello notebook from rank 1" in text
    results = [o for c in code for o in c.outputs if o.output_type == "execute_result"]
    assert any("ValueMesh" in o["data"]["text/plain"] and "0" in o["data"]["text/plain"] for o in results)

    (err,) = [o for c in code for o in c.outputs if o.output_type == "error"]
    tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err.traceback))
    print(tb)
    assert err.ename == "RuntimeError" and err.evalue == "mat1 and mat2 shapes cannot be multiplied (4x4 and 3x5)"
    frames = [line for line in tb.splitlines() if line.startswith(("Cell In[", "File "))]
    assert len(frames) == 1 and frames[0].startswith("Cell In["), tb  # the cell's line only: no engine frames
    assert "a @ torch.randn(3, 5)" in tb
    assert any("torch.Size([4, 5])" in o["data"]["text/plain"] for o in results)  # and the session went on

    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)  # the plot


class _env:
    """The kernel inherits this process's environment, ``env`` in place of it: the repository on its path, as for
    a user's notebook started in the checkout."""

    def __init__(self, env):
        self.env, self.old = env, None

    def __enter__(self):
        self.old = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.env)

    def __exit__(self, *exc):
        os.environ.clear()
        os.environ.update(self.old)
