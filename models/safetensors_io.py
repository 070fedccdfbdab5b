"""Read and write *.safetensors checkpoints as Hugging Face lays them out, with `safetensors`.

Reading goes through `safe_open(path, "numpy")`: the file is memory-mapped and `get_slice` reads
only the bytes of the requested block, so each device reads just its shard (nothing is copied
whole), and bfloat16 comes back as ml_dtypes.bfloat16 (safetensors >= 0.8).

    model.safetensors                                   one file, or
    model-00001-of-00003.safetensors ... + model.safetensors.index.json  {"weight_map": {name: file}}
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
from safetensors import SafetensorError, safe_open

from .config import ModelError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsFile:
    """One *.safetensors file: names, shapes, and lazily read tensors or slices of them."""

    def __init__(self, path: str):
        self.path = path
        try:  # safetensors checks the header and that the tensors cover the file exactly
            self._file = safe_open(path, "numpy")
        except (OSError, SafetensorError) as e:
            detail = " ".join(str(e).split())
            if "not fully covered" in detail:
                raise ModelError(f"{path} is truncated or damaged ({detail}); download or copy it "
                                 "again") from None
            raise ModelError(f"{path} is not a readable safetensors file: {detail}") from None
        self.metadata = self._file.metadata() or {}
        self._keys = set(self._file.keys())

    def keys(self) -> list[str]:
        return list(self._file.keys())

    def __contains__(self, name: str) -> bool:
        return name in self._keys

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(name).get_shape())

    def check(self, name: str) -> None:
        """The tensor's dtype can be read into numpy (reads no data: an empty slice)."""
        part = self._file.get_slice(name)
        if not part.get_shape():
            return
        try:
            part[0:0]
        except Exception:  # noqa: BLE001 (an AttributeError for numpy's lack of float8, ...)
            raise ModelError(f"{self.path}: tensor {name} has dtype {part.get_dtype()}, which "
                             "numpy cannot read") from None

    def slice(self, name: str):
        """The tensor as a lazy slice: indexing it (`t[a:b, c:d]`, `t[:]`) reads only that block."""
        return self._file.get_slice(name)

    def get(self, name: str) -> np.ndarray:
        """The whole tensor, read."""
        return self._file.get_tensor(name)


LANGUAGE_MODEL_PREFIX = "model.language_model."


class Checkpoint:
    """The safetensors files of one Hugging Face model directory, addressed by tensor name."""

    def __init__(self, directory: str):
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise ModelError(f"checkpoint directory {directory} does not exist")
        self.directory = directory
        index_path = os.path.join(directory, INDEX_FILE)
        single_path = os.path.join(directory, SINGLE_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
                raise ModelError(f"{index_path} is not a valid index: {e!r}"[:300]) from None
        elif os.path.isfile(single_path):
            weight_map = None
        else:
            raise ModelError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")
        self._files: dict[str, SafetensorsFile] = {}
        if weight_map is None:
            file = self._open(SINGLE_FILE)
            self._where = {name: SINGLE_FILE for name in file.keys()}
        else:
            for file_name in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(directory, file_name)):
                    raise ModelError(
                        f"{INDEX_FILE} in {directory} names {file_name}, which is missing")
            self._where = dict(weight_map)
        self._stored = self._language_model_names()

    def _language_model_names(self) -> dict[str, str]:
        """{the text model's name: the name stored} for a multimodal checkpoint (Qwen3.5's),
        whose text model is under model.language_model.; its vision tower is not read."""
        if any(name.startswith("model.layers.") for name in self._where):
            return {}
        return {"model." + name[len(LANGUAGE_MODEL_PREFIX):]: name for name in self._where
                if name.startswith(LANGUAGE_MODEL_PREFIX)}

    def _open(self, file_name: str) -> SafetensorsFile:
        if file_name not in self._files:
            self._files[file_name] = SafetensorsFile(os.path.join(self.directory, file_name))
        return self._files[file_name]

    def __contains__(self, name: str) -> bool:
        return self._stored.get(name, name) in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def _file_of(self, name: str) -> tuple[SafetensorsFile, str]:
        """(the file holding the tensor, its name there)."""
        name = self._stored.get(name, name)
        if name not in self._where:
            raise ModelError(f"checkpoint {self.directory} lacks tensor {name}")
        file = self._open(self._where[name])
        if name not in file:
            raise ModelError(f"{file.path} lacks tensor {name}, which {INDEX_FILE} places there")
        return file, name

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape from its file's header (no data is read)."""
        file, stored = self._file_of(name)
        return file.shape(stored)

    def check(self, name: str) -> None:
        """The tensor's dtype is readable (no data is read)."""
        file, stored = self._file_of(name)
        file.check(stored)

    def slice(self, name: str):
        """A lazy slice of the tensor: indexing it reads only that block."""
        file, stored = self._file_of(name)
        return file.slice(stored)

    def get(self, name: str) -> np.ndarray:
        file, stored = self._file_of(name)
        return file.get(stored)


# how safetensors reports an I/O error: "Error while serializing: I/O error: No space left on
# device (os error 28)"
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Write `tensors` to `path`. An I/O error (a full disk, a quota) is raised as the OSError
    it is (safetensors raises its own SafetensorError), naming `path`."""
    from safetensors.numpy import save_file

    try:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path,
                  metadata={"format": "pt"})
    except SafetensorError as e:
        found = _OS_ERROR.search(str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), path) from e
