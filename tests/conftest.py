"""Every test sees 8 emulated CPU devices; this must run before JAX initialises its backend."""
import os

from tests.helpers.flags import TEST_XLA_FLAGS  # noqa: E402 (imports nothing of JAX)

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" {TEST_XLA_FLAGS}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


# ------------------------------------------------------------------ one compilation cache per run
# The trainer tests compile the same tiny programs again and again (every single-device reference
# run, every subprocess of the same command). One JAX persistent compilation cache for the whole
# pytest run, shared by its xdist workers and the `python train.py` subprocesses they start, turns
# each repetition into a cache read: every distinct program is still compiled once per run. Every
# test module uses it (the compile_cache fixture, on by default; helpers.trainer.train_env for
# subprocesses) but those that count XLA compilations, which say `COMPILE_CACHE = False` and so
# still see every one. The folder is made by the controller, passed to the workers and removed
# at the end of the run.
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

CACHE_VAR = "BASP_TEST_COMPILE_CACHE"


def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker: the controller's folder
        if CACHE_VAR in workerinput:
            os.environ[CACHE_VAR] = workerinput[CACHE_VAR]
    else:
        config._basp_tmp = Path(tempfile.mkdtemp(prefix="basp-test-"))
        os.environ[CACHE_VAR] = str(config._basp_tmp / "compile-cache")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # pytest-xdist, in the controller, for each worker it starts
    if CACHE_VAR in os.environ:
        node.workerinput[CACHE_VAR] = os.environ[CACHE_VAR]


def pytest_unconfigure(config):
    folder = getattr(config, "_basp_tmp", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def compile_cache():
    """This run's persistent compilation cache, on for one module's in-process compiles (and
    restored after it): `pytestmark = pytest.mark.usefixtures("compile_cache")`."""
    from tests.helpers.trainer import compile_cache_at

    with compile_cache_at(os.environ[CACHE_VAR]) as path:
        yield path


@pytest.fixture(scope="module", autouse=True)
def _compile_cache_unless_counted(request):
    """compile_cache for every module but those that say `COMPILE_CACHE = False`."""
    if getattr(request.module, "COMPILE_CACHE", True):
        request.getfixturevalue("compile_cache")
    yield


# ------------------------------------------------------------------ slowest files first
# pytest-xdist (--dist loadfile) hands whole files to the two workers in collection order
# (pyproject.toml turns off its reordering by test count): starting with the files that take
# longest and ending with the quick ones keeps both workers busy to the end, instead of one
# worker starting a 5-minute file while the other has nothing left. Roughly slowest first, as
# measured with --durations (update when a file's cost changes much; any order is correct).
SLOWEST_FIRST = [  # seconds of one pass on 2 busy cores (--junitxml): jaxlib 0.10 / 0.12
    "e2e/test_gpu_compile.py",  # 1110 / 234
    "e2e/test_multiprocess.py",  # 278 / 185
    "models/test_qwen35.py",  # 187 / 195
    "models/test_scan_periods.py",  # 179 / 148
    "models/test_staged_sharding.py",  # 142 / 154
    "train/test_loop.py",  # 132 / 139
    "basp_jax/test_attention.py",  # 122 / 92
    "models/test_fp8.py",  # 95 / 111
    "models/test_qwen3_moe.py",  # 95 / 107
    "train/test_streamed.py",  # 63 / 80
    "models/test_qwen35_moe.py",  # 66 / 62
    "models/test_scan.py",  # 63 / 65
    "train/test_layouts.py",  # 54 / 72
    "basp_jax/test_flash.py",  # 61 / 62
    "train/test_generate.py",  # 38 / 57
    "e2e/test_reliability.py",  # 44 / 44
    "e2e/test_gpu_check.py",  # 78 / 4
    "train/test_nonfinite.py",  # 34 / 41
    "basp_jax/test_adaptive.py",  # 31 / 43
    "models/test_layout_families.py",  # 35 / 39
    "e2e/test_quickstart_notebook.py",  # 38 / 35
    "models/test_loss_chunked.py",  # 31 / 40
    "models/test_hybrid_cpu.py",  # 34 / 35
    "train/test_long_context.py",  # 40 / 28
    "train/test_adaptive_trainer.py",  # 28 / 40
    "train/test_bad_input.py",  # 35 / 31
    "models/test_parallel.py",  # 24 / 39
    "models/test_host_sharding.py",  # 30 / 29
    "train/test_resume_changes.py",  # 29 / 29
    "e2e/test_crash.py",  # 28 / 28
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    tests = Path(__file__).parent

    def place(item):
        return rank.get(item.path.relative_to(tests).as_posix(), len(rank))

    items.sort(key=place)  # stable: files stay whole
