"""Named tensors from checkpoint files, read as numpy arrays without running code from the file.

`read_tensors` takes safetensors files (through the `safetensors` package) and PyTorch's zip checkpoints
(`torch.save`: `pytorch_model.bin`, `.pt`), whose pickle is read by an unpickler that only knows how to
rebuild tensors from their storages and the dicts that hold them, so a file that asks for anything else
(a class, a function, the legacy non-zip format) is refused with one line instead of being run. torch is
not needed for either.
"""
from __future__ import annotations

import json
import pathlib
import pickle
import zipfile

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

# torch's storage classes (as `torch.save` pickles them) -> the numpy dtype of their elements
STORAGES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
            "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
            "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


# safetensors' 8-bit float dtypes, which its numpy reader cannot return (numpy has no such type)
FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def read_float8(path: pathlib.Path, name: str) -> np.ndarray:
  """One 8-bit float tensor of a safetensors file, read from the file's own header: 8 bytes of header length,
  the JSON header (dtype, shape, byte offsets after it), the data."""
  with open(path, "rb") as f:
    size = int.from_bytes(f.read(8), "little")
    info = json.loads(f.read(size))[name]
    begin, end = info["data_offsets"]
    f.seek(8 + size + begin)
    return np.frombuffer(f.read(end - begin), FLOAT8[info["dtype"]]).reshape(info["shape"])


def read_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
  """Every tensor of one checkpoint file, by name (`.safetensors`, or a PyTorch zip checkpoint)."""
  path = pathlib.Path(path)
  if path.suffix == ".safetensors":
    try:
      with safe_open(path, framework="numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
      raise ValueError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())})") from None
  if not zipfile.is_zipfile(path):
    raise ValueError(f"{path}: not a safetensors file or a PyTorch zip checkpoint (an old torch format, which "
                     f"cannot be read without running its code: convert it to safetensors)")
  return _read_torch_zip(path)


class _Storage:
  """A storage's elements, as `persistent_load` finds them in the archive."""

  def __init__(self, data: np.ndarray):
    self.data = data


def _rebuild_tensor(storage: _Storage, offset: int, size: tuple, stride: tuple, *_ignored) -> np.ndarray:
  """torch._utils._rebuild_tensor_v2: a strided view of a storage, copied out."""
  data = storage.data
  if not size:
    return data[offset].copy()
  strides = tuple(s * data.itemsize for s in stride)
  return np.lib.stride_tricks.as_strided(data[offset:], shape=tuple(size), strides=strides).copy()


def _rebuild_parameter(tensor: np.ndarray, *_ignored) -> np.ndarray:
  return tensor


class _TensorsOnly(pickle.Unpickler):
  """Rebuilds tensors and the (ordered) dicts holding them; any other global is refused."""

  ALLOWED = {("collections", "OrderedDict"): dict, ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
             ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}

  def __init__(self, file, archive: zipfile.ZipFile, prefix: str, where: pathlib.Path):
    super().__init__(file)
    self.archive, self.prefix, self.where = archive, prefix, where

  def find_class(self, module: str, name: str):
    if (module, name) in self.ALLOWED:
      return self.ALLOWED[(module, name)]
    if module == "torch" and name in STORAGES:
      return STORAGES[name]
    raise ValueError(f"{self.where}: holds {module}.{name}, not only tensors; refusing to unpickle it "
                     f"(convert it to safetensors)")

  def persistent_load(self, pid):
    kind, dtype, key, _location, _numel = pid
    if kind != "storage" or dtype not in STORAGES.values():
      raise ValueError(f"{self.where}: an unexpected storage record {pid!r}")
    raw = self.archive.read(f"{self.prefix}data/{key}")
    return _Storage(np.frombuffer(raw, dtype=dtype))


def _read_torch_zip(path: pathlib.Path) -> dict[str, np.ndarray]:
  with zipfile.ZipFile(path) as archive:
    pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
    if len(pickles) != 1:
      raise ValueError(f"{path}: not a PyTorch checkpoint (no single data.pkl)")
    prefix = pickles[0][:-len("data.pkl")]
    with archive.open(pickles[0]) as f:
      try:
        state = _TensorsOnly(f, archive, prefix, path).load()
      except (pickle.UnpicklingError, TypeError, KeyError, EOFError) as e:
        raise ValueError(f"{path}: unreadable checkpoint ({' '.join(str(e).split())})") from None
  if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
    state = state["state_dict"]
  if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
    raise ValueError(f"{path}: not a dict of tensors")
  return state
