"""Read and write *.safetensors checkpoints as Hugging Face lays them out.

Reading parses the header ourselves and memory-maps the file, so a tensor slice touches only the
bytes it needs (each host reads its shards, nothing is copied whole), and bfloat16 works (the
`safetensors` numpy backend cannot return bfloat16). Writing uses `safetensors.numpy`.

    model.safetensors                                   one file, or
    model-00001-of-00003.safetensors ... + model.safetensors.index.json  {"weight_map": {name: file}}
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from .config import ModelError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}


class SafetensorsFile:
    """One *.safetensors file: names, shapes, and lazily memory-mapped tensors."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) != 8:
                    raise ValueError("file shorter than its 8-byte header length")
                (n,) = struct.unpack("<Q", raw)
                size = os.path.getsize(path)
                if n > size - 8:
                    raise ValueError(f"header length {n} exceeds the file size {size}")
                header = json.loads(f.read(n))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise ModelError(f"{path} is not a readable safetensors file: {e}") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._header = header
        self._data_start = 8 + n
        self._mmap = None

    def keys(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def check(self, name: str) -> None:
        """The tensor's dtype is readable and its bytes lie inside the file (header only)."""
        info = self._header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        expected = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(dtype).itemsize
        if end - start != expected:
            raise ModelError(f"{self.path}: tensor {name} spans {end - start} bytes; its shape "
                             f"{tuple(info['shape'])} needs {expected}")
        size = os.path.getsize(self.path)
        if self._data_start + end > size:
            raise ModelError(f"{self.path} is truncated: tensor {name} ends at byte "
                             f"{self._data_start + end} of a {size}-byte file")

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of the tensor: slicing it reads only those bytes."""
        info = self._header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, end = info["data_offsets"]
        buf = self._mmap[self._data_start + start:self._data_start + end]
        shape = tuple(info["shape"])
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if buf.size != expected:
            raise ModelError(
                f"{self.path}: tensor {name} holds {buf.size} bytes; its shape {shape} needs "
                f"{expected}"
            )
        return buf.view(dtype).reshape(shape)


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
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelError(f"{index_path} is not a valid index: {e!r}") from None
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

    def _open(self, file_name: str) -> SafetensorsFile:
        if file_name not in self._files:
            self._files[file_name] = SafetensorsFile(os.path.join(self.directory, file_name))
        return self._files[file_name]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def _file_of(self, name: str) -> SafetensorsFile:
        if name not in self._where:
            raise ModelError(f"checkpoint {self.directory} lacks tensor {name}")
        file = self._open(self._where[name])
        if name not in file.keys():
            raise ModelError(f"{file.path} lacks tensor {name}, which {INDEX_FILE} places there")
        return file

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape from its file's header (no data is read)."""
        return self._file_of(name).shape(name)

    def check(self, name: str) -> None:
        """The tensor's dtype is readable and its bytes lie inside its file (header only)."""
        self._file_of(name).check(name)

    def get(self, name: str) -> np.ndarray:
        return self._file_of(name).get(name)


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path,
              metadata={"format": "pt"})
