"""Reading and writing safetensors checkpoints, FP8 included, with numpy and ml_dtypes only.

DeepSeek's released V4 checkpoints store FP8 weights as ``F8_E4M3`` and their block scales as
``F8_E8M0``. The ``safetensors`` package's numpy reader refuses both (numpy has no float8 types), so
this module reads the format itself: an 8-byte little-endian header length ``N``, ``N`` bytes of
UTF-8 JSON mapping each tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets counted from the byte after the header; an optional ``"__metadata__"`` of strings), then
the tensors' bytes, little-endian and C-ordered.

- ``read_safetensors(path, names=None)``: one file's tensors as read-only views of a memory map.
- ``write_safetensors(path, tensors, metadata=None)``: one file in the same format.
- ``write_checkpoint(directory, tensors, max_shard_bytes)``: sharded files plus
  ``model.safetensors.index.json``, the Hugging Face layout of DeepSeek's releases.
- ``read_attention_weights(checkpoint_dir, layer_id)``: one layer's attention tensors from such a
  directory, opening only the files that hold them.

Imports no JAX: the tensors come back as numpy arrays (ml_dtypes for the float8 and bfloat16 ones).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Union

import ml_dtypes
import numpy as np

PathLike = Union[str, "os.PathLike[str]"]

# The format's dtype names and the numpy dtypes they read as. Multi-byte numpy types are named
# little-endian explicitly: the format is little-endian whatever the host. ml_dtypes' types have
# no byte-order variants (their arrays are in the host's order, little-endian on x86 and Arm).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}

METADATA_KEY = "__metadata__"
# The header is padded with spaces to this many bytes, so that the data (and each tensor whose
# offset is a multiple of its item size) starts aligned.
HEADER_ALIGNMENT = 8

INDEX_FILENAME = "model.safetensors.index.json"
SHARD_FILENAME = "model-{index:05d}-of-{count:05d}.safetensors"
# Hugging Face's default shard size (transformers' ``max_shard_size="5GB"``).
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
# Every shard says it holds PyTorch-style tensors: transformers refuses a safetensors file whose
# metadata names another format, and these files are framework-neutral bytes anyway.
SHARD_METADATA = {"format": "pt"}

# A layer's attention tensors under each naming: DeepSeek's inference code and released V4
# checkpoints, then Hugging Face's. Each ends in "." so that layer 1 does not match layer 12.
ATTENTION_PREFIXES = ("layers.{layer}.attn.", "model.layers.{layer}.self_attn.")


class SafetensorsError(ValueError):
    """A safetensors file (or checkpoint index) that breaks the format, or holds a tensor of a
    dtype this module cannot represent; the message names the file and the tensor."""


class _Entry(NamedTuple):
    dtype: str  # the format's name, e.g. "F8_E4M3" (possibly one not in DTYPES)
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section, end exclusive
    end: int


class _Header(NamedTuple):
    entries: dict[str, _Entry]  # in the header's order
    metadata: dict[str, str]
    data_start: int  # the file offset of the data section: 8 + the header's length
    data_size: int


def _reject_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise SafetensorsError(f"the header names {key!r} twice")
        out[key] = value
    return out


def _is_count(x) -> bool:
    return type(x) is int and x >= 0  # JSON's true/false parse as bool, which is not a count


def _read_header(path: Path) -> _Header:
    """Parses and checks ``path``'s header without reading its data. Every entry's offsets are
    checked (in range, not overlapping), and so are the sizes of those whose dtype is known; an
    unknown dtype is only refused when its tensor is read (so that one FP4 expert tensor does not
    keep a shard's attention tensors from loading)."""
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsError(
                f"{path}: {file_size} bytes is too short for a safetensors file, which starts with "
                "an 8-byte header length"
            )
        header_size = int.from_bytes(prefix, "little")
        if header_size > file_size - 8:
            raise SafetensorsError(
                f"{path}: the header length {header_size} runs past the end of the file "
                f"({file_size} bytes, {file_size - 8} after the length)"
            )
        raw = f.read(header_size)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except SafetensorsError as err:
        raise SafetensorsError(f"{path}: {err}") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise SafetensorsError(f"{path}: the header is not UTF-8 JSON: {err}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is a JSON {type(header).__name__}, not an object")

    metadata = header.pop(METADATA_KEY, None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(
            f"{path}: {METADATA_KEY!r} must be an object of strings; got {metadata!r}"
        )

    data_start = 8 + header_size
    data_size = file_size - data_start
    entries = {}
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise SafetensorsError(
                f"{where} must be an object with dtype, shape and data_offsets; got {info!r}"
            )
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str):
            raise SafetensorsError(f"{where} has dtype {dtype!r}, not a string")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise SafetensorsError(f"{where} has shape {shape!r}, not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            raise SafetensorsError(f"{where} has data_offsets {offsets!r}, not [begin, end]")
        begin, end = offsets
        if not begin <= end <= data_size:
            raise SafetensorsError(
                f"{where} has data_offsets [{begin}, {end}], outside the {data_size} bytes of data "
                "after the header"
            )
        if dtype in DTYPES:
            expected = math.prod(shape) * DTYPES[dtype].itemsize
            if end - begin != expected:
                raise SafetensorsError(
                    f"{where} has data_offsets [{begin}, {end}] ({end - begin} bytes), but its shape "
                    f"{shape} of {dtype} takes {expected} bytes"
                )
        entries[name] = _Entry(dtype, tuple(shape), begin, end)

    # Two tensors sharing bytes would alias each other's values.
    spans = sorted((e.begin, e.end, n) for n, e in entries.items() if e.end > e.begin)
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise SafetensorsError(f"{path}: the bytes of tensors {prev!r} and {name!r} overlap")
    return _Header(entries, metadata, data_start, data_size)


def read_safetensors(path: PathLike, names: Optional[Iterable[str]] = None) -> dict[str, np.ndarray]:
    """Reads a ``.safetensors`` file's tensors as read-only views of a memory map of the file.

    Nothing is copied: the bytes are read from disk when the arrays are used, so selecting a few
    tensors of a large shard costs only the header and those tensors' pages.

    Args:
      path: the file.
      names: the tensors to read (an iterable of names, not one string); ``None`` reads them all.

    Returns:
      ``{name: array}`` in the order of ``names`` (or of the file's header), each array of its
      header's shape and dtype: ``F8_E4M3`` -> ``ml_dtypes.float8_e4m3fn``, ``F8_E5M2`` ->
      ``float8_e5m2``, ``F8_E8M0`` -> ``float8_e8m0fnu``, ``BF16`` -> ``bfloat16``, and ``F16``,
      ``F32``, ``F64``, ``C64``, ``I8``/``U8`` to ``I64``/``U64``, ``BOOL`` -> numpy's own.
      The arrays are not writeable, and an array whose offset in the file is not a multiple of
      its item size is an unaligned view (numpy reads it correctly, more slowly).

    Raises:
      KeyError: a name in ``names`` that the file does not hold (the message names the file).
      SafetensorsError: a malformed header (offsets out of range or overlapping, a size that does
        not match the shape and dtype, not JSON), or a selected tensor of a dtype not listed above.
    """
    path = Path(path)
    header = _read_header(path)
    if isinstance(names, str):
        raise TypeError(f"names must be an iterable of tensor names, not the string {names!r}")
    selected = list(header.entries) if names is None else list(dict.fromkeys(names))
    for name in selected:
        if name not in header.entries:
            raise KeyError(f"tensor {name!r} is not in {path}")
        dtype = header.entries[name].dtype
        if dtype not in DTYPES:
            raise SafetensorsError(
                f"{path}: tensor {name!r} has dtype {dtype!r}, which this reader does not support "
                f"(it reads {', '.join(DTYPES)})"
            )

    if header.data_size == 0:
        data = np.zeros(0, np.uint8)  # mmap refuses an empty mapping
        data.flags.writeable = False
    else:
        # One map of the whole data section; a plain ndarray view of it, so that the tensors are
        # ordinary arrays (np.memmap's subclass leaks into the results of arithmetic on them).
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=header.data_start,
                         shape=(header.data_size,)).view(np.ndarray)
    out = {}
    for name in selected:
        entry = header.entries[name]
        out[name] = data[entry.begin:entry.end].view(DTYPES[entry.dtype]).reshape(entry.shape)
    return out


def _format_dtype(name: str, dtype: np.dtype) -> str:
    for fmt, known in DTYPES.items():
        # Byte order aside (a big-endian array is written little-endian).
        if known == (dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype):
            return fmt
    raise TypeError(
        f"tensor {name!r} has dtype {dtype}, which safetensors cannot hold "
        f"(supported: {', '.join(str(d) for d in DTYPES.values())})"
    )


def write_safetensors(path: PathLike, tensors: Mapping[str, Any],
                      metadata: Optional[Mapping[str, str]] = None) -> None:
    """Writes ``tensors`` to ``path`` as one ``.safetensors`` file.

    The header is JSON padded with spaces to a multiple of 8 bytes, with ``metadata`` (if given)
    under ``"__metadata__"``; the tensors follow in name order, each C-contiguous and
    little-endian, with no gaps. The file is written beside ``path`` and renamed into place, so a
    failed write leaves no partial file.

    Args:
      path: the file to write (replaced if it exists).
      tensors: ``{name: array}``; anything ``np.asarray`` accepts (numpy, ml_dtypes, JAX arrays),
        of a dtype listed in :func:`read_safetensors`.
      metadata: ``{key: value}`` strings stored in the header (e.g. ``{"format": "pt"}``).

    Raises:
      TypeError: a name that is not a string or is ``"__metadata__"``, a tensor of a dtype the
        format cannot hold, or metadata that is not strings.
    """
    path = Path(path)
    header: dict[str, Any] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError(f"metadata must map strings to strings; got {dict(metadata)!r}")
        header[METADATA_KEY] = dict(metadata)
    arrays = {}
    offset = 0
    for name in sorted(tensors):
        if not isinstance(name, str) or name == METADATA_KEY:
            raise TypeError(f"tensor names must be strings other than {METADATA_KEY!r}; got {name!r}")
        arr = np.asarray(tensors[name])
        fmt = _format_dtype(name, arr.dtype)
        arrays[name] = (arr, DTYPES[fmt])
        header[name] = {"dtype": fmt, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes

    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % HEADER_ALIGNMENT)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for arr, dtype in arrays.values():
                # Converts only what is not already little-endian and C-ordered; written as bytes
                # (the buffer protocol has no format for ml_dtypes' types).
                f.write(np.asarray(arr, dtype=dtype, order="C").reshape(-1).view(np.uint8).data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_checkpoint(directory: PathLike, tensors: Mapping[str, Any],
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
    """Writes ``tensors`` as a sharded checkpoint in Hugging Face's layout.

    The tensors fill ``model-00001-of-0000N.safetensors``, ... in the order of ``tensors``, each
    shard taking tensors until the next would bring it over ``max_shard_bytes`` (a larger tensor
    gets a shard of its own), so tensors given together stay together. Each shard's metadata is
    ``{"format": "pt"}`` (transformers refuses other values). ``model.safetensors.index.json``
    maps every name to its shard: ``{"metadata": {"total_size": bytes}, "weight_map": {name:
    filename}}``. Even a single shard gets an index.

    Args:
      directory: created if missing; files of these names in it are replaced.
      tensors: ``{name: array}``, as for :func:`write_safetensors`.
      max_shard_bytes: the most tensor bytes per shard (headers not counted); default 5 GB.

    Returns:
      The index, as written.
    """
    if type(max_shard_bytes) is not int or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive integer; got {max_shard_bytes!r}")
    directory = Path(directory)
    arrays = {name: np.asarray(value) for name, value in tensors.items()}
    shards: list[dict[str, np.ndarray]] = [{}]
    shard_bytes = 0
    for name, arr in arrays.items():
        if shards[-1] and shard_bytes + arr.nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = arr
        shard_bytes += arr.nbytes

    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = SHARD_FILENAME.format(index=i + 1, count=len(shards))
        write_safetensors(directory / filename, shard, metadata=SHARD_METADATA)
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": sum(a.nbytes for a in arrays.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILENAME).write_text(json.dumps(index, indent=2) + "\n")
    return index


def _names_by_file(directory: Path) -> dict[str, list[str]]:
    """``{filename: [tensor names]}`` from the index, or else from every ``*.safetensors``
    file's header (headers only: no tensor data is read)."""
    index_path = directory / INDEX_FILENAME
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise SafetensorsError(f"{index_path} is not an index with a weight_map: {err!r}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise SafetensorsError(f"{index_path}: weight_map must map tensor names to file names")
        by_file: dict[str, list[str]] = {}
        for name, filename in weight_map.items():
            by_file.setdefault(filename, []).append(name)
        return by_file
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has neither {INDEX_FILENAME} nor any *.safetensors file")
    return {f.name: list(_read_header(f).entries) for f in files}


def read_attention_weights(checkpoint_dir: PathLike, layer_id: int) -> dict[str, np.ndarray]:
    """Reads layer ``layer_id``'s attention tensors from a checkpoint directory, memory-mapped.

    The files come from ``model.safetensors.index.json`` (or, without one, from the headers of
    every ``*.safetensors`` file in the directory); only the files that hold this layer's
    tensors are opened. A tensor belongs to the layer if its name starts with
    ``layers.{layer_id}.attn.`` (DeepSeek's inference code and released V4 checkpoints) or
    ``model.layers.{layer_id}.self_attn.`` (Hugging Face's naming).

    Returns:
      ``{name: array}`` with that prefix removed and nothing else renamed, e.g. ``wq_a.weight``
      (``float8_e4m3fn`` for FP8 weights), ``wq_a.scale`` or ``wq_a.weight_scale_inv`` as stored
      (``float8_e8m0fnu`` or ``float32``), ``compressor.ape``,
      ``indexer.compressor.norm.weight``, ``attn_sink``. The arrays are read-only views, as from
      :func:`read_safetensors`.

    Raises:
      KeyError: no tensor of this layer in the checkpoint (the message names the layer and the
        directory).
      FileNotFoundError: no checkpoint in the directory, or a file that the index names is missing.
      SafetensorsError: the same name under both namings, or a malformed file or index.
    """
    if isinstance(layer_id, bool) or not isinstance(layer_id, (int, np.integer)) or layer_id < 0:
        raise TypeError(f"layer_id must be a non-negative integer; got {layer_id!r}")
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    prefixes = tuple(p.format(layer=int(layer_id)) for p in ATTENTION_PREFIXES)

    out: dict[str, np.ndarray] = {}
    for filename, names in _names_by_file(directory).items():
        # Names are never renamed beyond the prefix, so each maps back to exactly one prefix.
        wanted = {n: n[len(p):] for n in names for p in prefixes if n.startswith(p)}
        if not wanted:
            continue
        path = directory / filename
        if not path.exists():
            raise FileNotFoundError(f"{path}, which the checkpoint's index names, does not exist")
        for name, array in read_safetensors(path, wanted).items():
            short = wanted[name]
            if short in out:
                raise SafetensorsError(
                    f"{directory}: layer {layer_id}'s attention tensor {short!r} is stored under "
                    f"two names ({', '.join(prefixes)})"
                )
            out[short] = array
    if not out:
        raise KeyError(
            f"no attention tensor of layer {layer_id} (names starting {' or '.join(prefixes)}) in "
            f"{directory}"
        )
    return out
