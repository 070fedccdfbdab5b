"""examples/quickstart.ipynb runs top to bottom in a fresh kernel, and is stored without outputs."""

import json
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def _kernel_env() -> dict[str, str]:
    """This process's environment, less the device setup conftest.py made for pytest itself (the
    notebook arranges its own devices), with this checkout importable."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.pop("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    env.pop("JAX_PLATFORMS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    return env


def _kernel_manager(tmp_path) -> KernelManager:
    """ipykernel on this interpreter, whatever "python3" kernels the user's Jupyter knows."""
    spec = tmp_path / "kernels" / "basp-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "basp-test",
                                                  "language": "python"}))
    specs = KernelSpecManager(kernel_dirs=[str(spec.parent)])
    return KernelManager(kernel_name="basp-test", kernel_spec_manager=specs)


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # a cell that raises fails the test with its traceback; 300 s per cell is ~10x what they take
    km = _kernel_manager(tmp_path)
    client = NotebookClient(nb, km=km, timeout=300, startup_timeout=120,
                            allow_errors=False, resources={"metadata": {"path": str(ROOT)}})
    try:
        client.execute(env=_kernel_env(), cwd=str(ROOT))
    finally:
        # nbclient shuts down only the kernels of managers it made: this one would live (JAX,
        # 8 devices, the notebook's arrays) until the pytest worker exits
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "8 cpu devices" in outputs or "8 gpu devices" in outputs, outputs
    # section 6 needs a GPU; without one both of its cells say so
    if "GPU(s) for section 6" not in outputs and "8 gpu devices" not in outputs:
        assert outputs.count("skipped: no GPU here (JAX has only CPU devices)") == 2, outputs
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.outputs), "the loss plot is missing"


def test_quickstart_notebook_is_stored_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                "examples/quickstart.ipynb holds outputs; clear them before committing "
                "(jupyter nbconvert --clear-output --inplace, or Kernel > Restart & Clear Output)")


def test_quickstart_sections_are_numbered_in_order():
    """The numbered section headings run 1, 2, 3, ... with none left out, as the introduction's
    list counts them."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    headings = [line for cell in nb.cells if cell.cell_type == "markdown"
                for line in cell.source.splitlines() if line.startswith("#")]
    numbers = [int(m.group(1)) for h in headings if (m := re.match(r"#+ (\d+)\. ", h))]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 5, headings
