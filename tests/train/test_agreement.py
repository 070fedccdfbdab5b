"""train.process.agreement: the processes of a multi-process run compare what they will run (the
resolved config less process_id, input files by contents) and all stop on a mismatch. Here on a
key-value store in memory, one thread per process; tests/e2e/test_multiprocess.py runs it on
jax.distributed."""

import shutil
import threading

import numpy as np
import pytest

from train.config.schema import ConfigError
from train.process import agreement

from tests.helpers.trainer import tiny_config

pytestmark = pytest.mark.usefixtures("compile_cache")  # this run's (tests/conftest.py)


class Store:
    """The two methods of jax.distributed's client that agreement calls."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.lock = threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            self.values[key] = value

    def key_value_dir_get(self, directory):
        with self.lock:
            return [(k, v) for k, v in self.values.items() if k.startswith(directory)]


def _agree_all(descriptions: list[dict], timeout: float = 5.0) -> list[BaseException | None]:
    """agreement.agree in one thread per process; what each raised (None: it went on)."""
    store, results = Store(), [None] * len(descriptions)

    def process(me):
        try:
            agreement.agree(store, "t", me, len(descriptions), descriptions[me], timeout)
        except BaseException as e:  # noqa: BLE001
            results[me] = e

    threads = [threading.Thread(target=process, args=(i,)) for i in range(len(descriptions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


@pytest.fixture(autouse=True)
def quick_exit(monkeypatch):
    monkeypatch.setattr(agreement, "LAST_TO_LEAVE_S", 0.0)


def _description(tmp_path, pid: int, *overrides: str) -> dict:
    return agreement.description(tiny_config(
        tmp_path / "run", "runtime.distributed.coordinator=127.0.0.1:1234",
        "runtime.distributed.num_processes=3", f"runtime.distributed.process_id={pid}",
        *overrides))


def test_the_same_config_agrees_whatever_each_process_id(tmp_path):
    assert _agree_all([_description(tmp_path, p) for p in range(3)]) == [None] * 3


def test_another_learning_rate_in_one_process_stops_every_process_naming_the_key(tmp_path):
    found = _agree_all([_description(tmp_path, 0), _description(tmp_path, 1),
                        _description(tmp_path, 2, "optimizer.lr=0.5")])
    assert all(isinstance(e, ConfigError) for e in found), found
    for e in found:
        text = str(e)
        assert "\n" not in text and "optimizer.lr" in text and "0.5" in text, text
        assert "process 2" in text, text


def test_input_files_compare_by_contents_not_by_path(tmp_path):
    """A copy of the token file on another path agrees; another file under the name does not;
    a file one process cannot read is left to its own check (it reports DataError itself)."""
    tokens = (np.arange(3000) % 200).astype(np.uint16)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    tokens.tofile(tmp_path / "a" / "t.bin")
    shutil.copy(tmp_path / "a" / "t.bin", tmp_path / "b" / "t.bin")
    (tokens + 1).tofile(tmp_path / "other.bin")

    def on(path):
        return ["data.source=tokens", f"data.path={path}"]

    copies = [_description(tmp_path, 0, *on(tmp_path / "a" / "t.bin")),
              _description(tmp_path, 1, *on(tmp_path / "b" / "t.bin"))]
    assert _agree_all(copies) == [None, None]
    other = _description(tmp_path, 1, *on(tmp_path / "other.bin"))
    found = _agree_all([copies[0], other])
    assert all(isinstance(e, ConfigError) and "data.path" in str(e) for e in found), found
    missing = _description(tmp_path, 1, *on(tmp_path / "missing.bin"))
    assert _agree_all([copies[0], missing]) == [None, None]


def test_a_process_that_publishes_nothing_is_one_line_after_the_timeout(tmp_path):
    store = Store()
    with pytest.raises(agreement.NoAnswer) as e:
        agreement.agree(store, "t", 0, 2, _description(tmp_path, 0), timeout=0.3)
    assert "process 1 of 2" in str(e.value) and "join_timeout_s" in str(e.value)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Hugging Face directories of the tiny preset: a (seed 0), b (a's copy elsewhere) and c
    (other weights of the same shape: seed 1)."""
    import models

    root = tmp_path_factory.mktemp("hf")
    config = models.ModelConfig.preset("tiny")
    for name, seed in (("a", 0), ("c", 1)):
        models.save_pretrained(models.init_model(config, seed=seed), str(root / name))
    shutil.copytree(root / "a", root / "b")
    return root


def test_hf_fingerprint_is_the_directory_contents_not_its_path(hf_dirs, tmp_path):
    """Equal for a copy (other files in the directory aside); another byte in a sampled block of
    the weights, a file of another size or other weights of the same shape differ."""
    from train.config.fingerprint import hf_fingerprint

    a = hf_fingerprint(str(hf_dirs / "a"))
    assert a["files"] == 2 and a["bytes"] > 1 << 20  # config.json, model.safetensors
    shutil.copytree(hf_dirs / "a", tmp_path / "copy")
    (tmp_path / "copy" / "README.md").write_text("notes")  # not read by a run
    assert hf_fingerprint(str(tmp_path / "copy")) == a
    assert hf_fingerprint(str(hf_dirs / "c")) != a
    weights = tmp_path / "copy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last block is always sampled
    weights.write_bytes(bytes(data))
    assert hf_fingerprint(str(tmp_path / "copy")) != a
    weights.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1, 0]))  # one byte longer
    assert hf_fingerprint(str(tmp_path / "copy")) != a
    # config only (model.load_weights=false): the weights are not compared
    assert hf_fingerprint(str(hf_dirs / "c"), weights=False) == \
        hf_fingerprint(str(hf_dirs / "a"), weights=False)


def _hf_description(tmp_path, pid: int, hf, *overrides: str) -> dict:
    return _description(tmp_path, pid, "model.preset=null", "model.shape={}",
                        f"model.hf_path={hf}", *overrides)


def test_model_hf_path_compares_by_contents_not_by_path(hf_dirs, tmp_path):
    """A stale copy of the model on one host (the same path and shape, other weights) stops
    every process with one line naming model.hf_path; a copy on another path agrees, and so do
    other weights when only the config is read (model.load_weights=false)."""
    a, b, c = (hf_dirs / name for name in "abc")
    assert _agree_all([_hf_description(tmp_path, 0, a), _hf_description(tmp_path, 1, b)]) \
        == [None, None]
    shared = tmp_path / "hf"  # one path, as each host sees it
    shutil.copytree(a, shared)
    first = _hf_description(tmp_path, 0, shared)
    shutil.rmtree(shared)
    shutil.copytree(c, shared)
    found = _agree_all([first, _hf_description(tmp_path, 1, shared)])
    for e in found:
        assert isinstance(e, ConfigError), found
        text = str(e)
        assert "\n" not in text and "model.hf_path: a Hugging Face directory of 2 files" in text
        assert "in process 0" in text and "in process 1" in text, text
    config_only = [_hf_description(tmp_path, p, d, "model.load_weights=false")
                   for p, d in ((0, a), (1, c))]
    assert _agree_all(config_only) == [None, None]
