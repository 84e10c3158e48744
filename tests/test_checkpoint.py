"""jax_sparse_attn.deepseek.checkpoint: safetensors files read and written bit for bit (FP8
included), memory-mapped, checked against files written by hand here and against the
``safetensors`` package; sharded checkpoints; one layer's attention tensors under both namings."""

from __future__ import annotations

import json
import mmap
import re
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from jax_sparse_attn.deepseek import checkpoint
from jax_sparse_attn.deepseek.checkpoint import (
    DTYPES,
    INDEX_FILENAME,
    SafetensorsError,
    read_attention_weights,
    read_safetensors,
    write_checkpoint,
    write_safetensors,
)

# Files and arrays only: no JAX program runs.
pytestmark = pytest.mark.jax_free

E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
BF16 = ml_dtypes.bfloat16


def random_bits(rng, dtype, shape):
    """Arrays of ``dtype`` with uniformly random bytes: every bit pattern (NaNs, infinities,
    subnormals, extremes) can occur. Booleans are 0 or 1."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def assert_same_bits(actual, expected):
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert np.ascontiguousarray(actual).tobytes() == np.ascontiguousarray(expected).tobytes()


def hand_written(path, header: dict, data: bytes, pad: bytes = b" ") -> None:
    """A safetensors file built here from struct and json, independently of the module."""
    raw = json.dumps(header).encode("utf-8")
    raw += pad * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def parse_by_hand(path):
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return n, blob[8:8 + n], blob[8 + n:]


# --- Round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(DTYPES))
def test_every_dtype_round_trips_bit_for_bit(tmp_path, rng, fmt):
    dtype = DTYPES[fmt]
    tensors = {
        "every_byte": np.arange(256 * dtype.itemsize, dtype=np.uint8).view(dtype)
        if dtype != np.bool_ else np.array([True, False]),
        "matrix": random_bits(rng, dtype, (3, 5)),
        "scalar": random_bits(rng, dtype, ()),
        "empty": random_bits(rng, dtype, (0, 4)),
    }
    write_safetensors(tmp_path / "t.safetensors", tensors)
    back = read_safetensors(tmp_path / "t.safetensors")
    assert list(back) == sorted(tensors)
    for name, value in tensors.items():
        assert_same_bits(back[name], value)
    assert json.loads(parse_by_hand(tmp_path / "t.safetensors")[1])["matrix"]["dtype"] == fmt


def test_fp8_special_values_survive(tmp_path):
    # DeepSeek's FP8 weights (E4M3: max 448, NaN 0x7f/0xff, no infinity) and block scales
    # (E8M0: powers of two 2**-127 .. 2**127, NaN 0xff, no zero or sign).
    e4m3 = np.array([448, -448, 2.0**-9, -(2.0**-9), 0.0, -0.0, np.nan], np.float32).astype(E4M3)
    e4m3 = np.concatenate([e4m3, np.array([0x7F, 0xFF], np.uint8).view(E4M3)])
    e8m0 = np.array([0, 127, 254, 255], np.uint8).view(E8M0)
    write_safetensors(tmp_path / "f.safetensors", {"w": e4m3, "s": e8m0})
    back = read_safetensors(tmp_path / "f.safetensors")
    assert_same_bits(back["w"], e4m3)
    assert_same_bits(back["s"], e8m0)
    w = back["w"].astype(np.float32)
    assert w[:6].tolist() == [448, -448, 2.0**-9, -(2.0**-9), 0.0, 0.0]
    assert np.signbit(w[5]) and np.isnan(w[6:]).all()
    s = back["s"].astype(np.float64)
    assert s[:3].tolist() == [2.0**-127, 1.0, 2.0**127] and np.isnan(s[3])


def test_writer_accepts_array_likes_and_any_layout(tmp_path):
    class ArrayLike:  # what JAX arrays offer numpy
        def __array__(self, dtype=None, copy=None):
            return np.arange(6, dtype=BF16).reshape(2, 3)

    big_endian = np.arange(12, dtype=">i4").reshape(3, 4)
    strided = np.arange(20, dtype=np.float32).reshape(4, 5).T  # not C-contiguous
    write_safetensors(tmp_path / "t.safetensors",
                      {"like": ArrayLike(), "list": [[1.5, 2.5]], "be": big_endian, "t": strided})
    back = read_safetensors(tmp_path / "t.safetensors")
    assert_same_bits(back["like"], np.arange(6, dtype=BF16).reshape(2, 3))
    assert_same_bits(back["list"], np.array([[1.5, 2.5]]))
    assert back["be"].dtype == np.dtype("<i4")
    np.testing.assert_array_equal(back["be"], big_endian)
    assert_same_bits(back["t"], np.ascontiguousarray(strided))


def test_names_select_tensors_in_the_order_asked(tmp_path):
    tensors = {n: np.full(2, i, np.int8) for i, n in enumerate("abc")}
    write_safetensors(tmp_path / "t.safetensors", tensors)
    back = read_safetensors(tmp_path / "t.safetensors", names=iter(["c", "a"]))
    assert list(back) == ["c", "a"]
    assert back["c"].tolist() == [2, 2]


# --- Memory mapping ----------------------------------------------------------------------------


def test_tensors_are_read_only_views_of_a_memory_map(tmp_path, rng):
    w = random_bits(rng, E4M3, (64, 32))
    write_safetensors(tmp_path / "t.safetensors", {"w": w, "s": random_bits(rng, E8M0, (4, 2))})
    back = read_safetensors(tmp_path / "t.safetensors")
    maps = []
    for arr in back.values():
        assert type(arr) is np.ndarray and not arr.flags.writeable
        base = arr
        while not isinstance(base, mmap.mmap):
            assert base is not None, "the array does not lead back to a memory map"
            base = base.base
        maps.append(base)
    assert maps[0] is maps[1]  # one map per file
    with pytest.raises(ValueError, match="read-only"):
        back["w"][0, 0] = 0

    # Nothing was copied: bytes changed on disk after reading show through the arrays.
    n, _, _ = parse_by_hand(tmp_path / "t.safetensors")
    begin = json.loads(parse_by_hand(tmp_path / "t.safetensors")[1])["w"]["data_offsets"][0]
    with open(tmp_path / "t.safetensors", "r+b") as f:
        f.seek(8 + n + begin)
        f.write(np.array([448], np.float32).astype(E4M3).view(np.uint8).tobytes())
    assert float(back["w"][0, 0]) == 448.0


# --- The format, against an independent writer and reader --------------------------------------


def test_reads_a_hand_written_file(tmp_path):
    a = np.arange(6, dtype="<f4").reshape(2, 3)
    b = np.array([1.0, -2.0, np.inf], BF16)
    c = np.array([[0, 1], [2, 255]], np.uint8).view(E8M0)
    # Out of name order in the data, with metadata: readers go by the offsets alone.
    header = {
        "b": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
        "__metadata__": {"format": "pt"},
        "c": {"dtype": "F8_E8M0", "shape": [2, 2], "data_offsets": [6, 10]},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [10, 34]},
    }
    data = b.tobytes() + c.tobytes() + a.tobytes()
    for pad in (b" ", b""):  # padded to 8 as the format asks, and not padded at all
        hand_written(tmp_path / "h.safetensors", header, data, pad=pad)
        back = read_safetensors(tmp_path / "h.safetensors")
        assert list(back) == ["b", "c", "a"]
        assert_same_bits(back["a"], a)  # offset 10: an unaligned view, read correctly
        assert_same_bits(back["b"], b)
        assert_same_bits(back["c"], c)


def test_written_bytes_follow_the_format(tmp_path):
    tensors = {"z": np.array([1, -2], ">i4"), "a": np.array([[0.5]], np.float64),
               "m": np.array([1.0, 2.0], BF16)}
    write_safetensors(tmp_path / "t.safetensors", tensors, metadata={"format": "pt", "note": "ü"})
    n, raw, data = parse_by_hand(tmp_path / "t.safetensors")
    assert n % 8 == 0 and len(raw) == n
    text = raw.decode("utf-8")
    assert text.rstrip(" ").endswith("}") and len(text) - len(text.rstrip(" ")) < 8  # space padding
    header = json.loads(text)
    assert list(header) == ["__metadata__", "a", "m", "z"]
    assert header["__metadata__"] == {"format": "pt", "note": "ü"}
    assert header["a"] == {"dtype": "F64", "shape": [1, 1], "data_offsets": [0, 8]}
    assert header["m"] == {"dtype": "BF16", "shape": [2], "data_offsets": [8, 12]}
    assert header["z"] == {"dtype": "I32", "shape": [2], "data_offsets": [12, 20]}
    assert data == (struct.pack("<d", 0.5) + np.array([1.0, 2.0], BF16).tobytes()
                    + struct.pack("<ii", 1, -2))


# --- Malformed files ---------------------------------------------------------------------------


F32_ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def write_raw(path, blob: bytes):
    path.write_bytes(blob)


MALFORMED = {
    "too short": (lambda p: write_raw(p, b"\x01\x02"), "too short"),
    "length past the end": (lambda p: write_raw(p, struct.pack("<Q", 1000) + b"{}"),
                            "runs past the end"),
    "not JSON": (lambda p: write_raw(p, struct.pack("<Q", 4) + b"{no}"), "not UTF-8 JSON"),
    "not UTF-8": (lambda p: write_raw(p, struct.pack("<Q", 2) + b"\xff\xfe"), "not UTF-8 JSON"),
    "a list": (lambda p: hand_written(p, [], b""), "not an object"),
    "no offsets": (lambda p: hand_written(p, {"x": {"dtype": "F32", "shape": [2]}}, bytes(8)),
                   "'x' must be an object with dtype, shape and data_offsets"),
    "negative dim": (lambda p: hand_written(p, {"x": {**F32_ENTRY, "shape": [-2]}}, bytes(8)),
                     "'x' has shape"),
    "bool dim": (lambda p: hand_written(p, {"x": {**F32_ENTRY, "shape": [True]}}, bytes(8)),
                 "'x' has shape"),
    "three offsets": (lambda p: hand_written(p, {"x": {**F32_ENTRY, "data_offsets": [0, 4, 8]}},
                                             bytes(8)), "not \\[begin, end\\]"),
    "offsets past the data": (lambda p: hand_written(p, {"x": F32_ENTRY}, bytes(4)),
                              "outside the 4 bytes of data"),
    "offsets reversed": (lambda p: hand_written(p, {"x": {**F32_ENTRY, "data_offsets": [8, 0]}},
                                                bytes(8)), "outside"),
    "size mismatch": (lambda p: hand_written(p, {"x": {**F32_ENTRY, "shape": [3]}}, bytes(8)),
                      "takes 12 bytes"),
    "overlap": (lambda p: hand_written(p, {"x": {**F32_ENTRY, "data_offsets": [0, 8]},
                                           "y": {**F32_ENTRY, "data_offsets": [4, 12]}}, bytes(12)),
                "'x' and 'y' overlap"),
    "metadata not strings": (lambda p: hand_written(p, {"__metadata__": {"n": 1}}, b""),
                             "__metadata__"),
    "duplicate name": (lambda p: write_raw(p, struct.pack("<Q", 16) + b'{"x":{},"x":{}} '),
                       "names 'x' twice"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_files_are_refused_clearly(tmp_path, case):
    make, message = MALFORMED[case]
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(SafetensorsError, match=message) as err:
        read_safetensors(path)
    assert str(path) in str(err.value)


def test_unknown_dtype_is_refused_only_when_read(tmp_path):
    # e.g. a shard whose FP4 expert weights sit beside the attention tensors
    header = {"experts": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}, "x": F32_ENTRY}
    header["x"] = {**F32_ENTRY, "data_offsets": [2, 10]}
    hand_written(tmp_path / "t.safetensors", header, bytes(2) + np.array([1, 2], "<f4").tobytes())
    assert read_safetensors(tmp_path / "t.safetensors", ["x"])["x"].tolist() == [1.0, 2.0]
    with pytest.raises(SafetensorsError, match="tensor 'experts' has dtype 'F4'"):
        read_safetensors(tmp_path / "t.safetensors")


def test_missing_names_and_bad_arguments(tmp_path):
    write_safetensors(tmp_path / "t.safetensors", {"x": np.zeros(2)})
    with pytest.raises(KeyError, match=re.escape(f"'nope' is not in {tmp_path / 't.safetensors'}")):
        read_safetensors(tmp_path / "t.safetensors", ["x", "nope"])
    with pytest.raises(TypeError, match="not the string"):
        read_safetensors(tmp_path / "t.safetensors", "x")
    with pytest.raises(TypeError, match="tensor 'bad' has dtype <U1"):
        write_safetensors(tmp_path / "u.safetensors", {"ok": np.zeros(1), "bad": np.array(["a"])})
    with pytest.raises(TypeError, match="complex128"):
        write_safetensors(tmp_path / "u.safetensors", {"c": np.zeros(1, np.complex128)})
    with pytest.raises(TypeError, match="__metadata__"):
        write_safetensors(tmp_path / "u.safetensors", {"__metadata__": np.zeros(1)})
    with pytest.raises(TypeError, match="metadata must map strings to strings"):
        write_safetensors(tmp_path / "u.safetensors", {"x": np.zeros(1)}, metadata={"n": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"]  # nothing half-written


# --- Sharded checkpoints -----------------------------------------------------------------------


def test_write_checkpoint_shards_in_order_with_an_index(tmp_path, rng):
    tensors = {  # 40 + 40 + 200 + 16 + 24 bytes, at most 100 per shard
        "b.weight": random_bits(rng, E4M3, (5, 8)),
        "a.weight": random_bits(rng, E4M3, (5, 8)),
        "big": random_bits(rng, np.float32, (50,)),
        "c.scale": random_bits(rng, E8M0, (16,)),
        "d": random_bits(rng, BF16, (12,)),
    }
    index = write_checkpoint(tmp_path / "ckpt", tensors, max_shard_bytes=100)
    files = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == files + [INDEX_FILENAME]
    assert json.loads((tmp_path / "ckpt" / INDEX_FILENAME).read_text()) == index
    assert index["metadata"] == {"total_size": 320}
    assert index["weight_map"] == {"a.weight": files[0], "b.weight": files[0], "big": files[1],
                                   "c.scale": files[2], "d": files[2]}
    assert list(index["weight_map"]) == sorted(tensors)
    for name, filename in index["weight_map"].items():
        assert_same_bits(read_safetensors(tmp_path / "ckpt" / filename, [name])[name], tensors[name])
    header = json.loads(parse_by_hand(tmp_path / "ckpt" / files[0])[1])
    assert header["__metadata__"] == {"format": "pt"}

    single = write_checkpoint(tmp_path / "one", {"x": np.zeros(3)})
    assert single["weight_map"] == {"x": "model-00001-of-00001.safetensors"}
    with pytest.raises(ValueError, match="max_shard_bytes"):
        write_checkpoint(tmp_path / "zero", {"x": np.zeros(3)}, max_shard_bytes=0)


# --- One layer's attention tensors -------------------------------------------------------------


def v4_names(layer):
    """DeepSeek's inference / released V4 naming."""
    p = f"layers.{layer}."
    return {
        p + "attn.wq_a.weight": (E4M3, (16, 8)),
        p + "attn.wq_a.scale": (E8M0, (1, 1)),
        p + "attn.compressor.ape": (np.float32, (4, 8)),
        p + "attn.indexer.compressor.norm.weight": (BF16, (8,)),
        p + "attn.attn_sink": (np.float32, (4,)),
        p + "attn_norm.weight": (BF16, (8,)),  # "attn" without the dot: not attention's
        p + "ffn.gate.weight": (BF16, (4, 8)),
    }, p + "attn."


def hf_names(layer):
    """Hugging Face's naming."""
    p = f"model.layers.{layer}."
    return {
        p + "self_attn.q_a_proj.weight": (E4M3, (16, 8)),
        p + "self_attn.q_a_proj.weight_scale_inv": (np.float32, (1, 1)),
        p + "self_attn.kv_a_layernorm.weight": (BF16, (8,)),
        p + "input_layernorm.weight": (BF16, (8,)),
        p + "mlp.gate.weight": (BF16, (4, 8)),
    }, p + "self_attn."


@pytest.fixture(params=[v4_names, hf_names])
def layered_checkpoint(request, tmp_path, rng):
    """A checkpoint of layers 1, 2 and 12 (plus an embedding) in small shards, so that layer 1's
    attention spans several files and some files hold none of it."""
    tensors, prefixes = {"embed.weight": random_bits(rng, BF16, (32, 8))}, {}
    for layer in (1, 2, 12):
        names, prefixes[layer] = request.param(layer)
        tensors.update({n: random_bits(rng, d, s) for n, (d, s) in names.items()})
    index = write_checkpoint(tmp_path / "ckpt", tensors, max_shard_bytes=200)
    return tmp_path / "ckpt", tensors, prefixes, index


def expected_layer(tensors, prefix):
    return {n[len(prefix):]: v for n, v in tensors.items() if n.startswith(prefix)}


def spy_on_opened_files(monkeypatch):
    opened = []
    real = checkpoint.read_safetensors

    def spy(path, names=None):
        opened.append(path.name)
        return real(path, names)

    monkeypatch.setattr(checkpoint, "read_safetensors", spy)
    return opened


@pytest.mark.parametrize("with_index", [True, False])
def test_reads_only_the_layers_attention(layered_checkpoint, monkeypatch, with_index):
    directory, tensors, prefixes, index = layered_checkpoint
    if not with_index:
        (directory / INDEX_FILENAME).unlink()
    opened = spy_on_opened_files(monkeypatch)
    for layer in (1, 12):
        opened.clear()
        got = read_attention_weights(directory, layer)
        want = expected_layer(tensors, prefixes[layer])
        assert sorted(got) == sorted(want) and len(want) >= 3
        for name in want:
            assert_same_bits(got[name], want[name])
            assert not got[name].flags.writeable
        holding = {index["weight_map"][prefixes[layer] + n] for n in want}
        assert len(holding) < len(set(index["weight_map"].values()))  # the test means something
        assert sorted(opened) == sorted(holding)
    if prefixes[1].startswith("layers."):
        assert set(got) == {"wq_a.weight", "wq_a.scale", "compressor.ape",
                            "indexer.compressor.norm.weight", "attn_sink"}
    else:
        assert set(got) == {"q_a_proj.weight", "q_a_proj.weight_scale_inv", "kv_a_layernorm.weight"}


def test_files_without_the_layer_are_never_opened(layered_checkpoint):
    directory, tensors, prefixes, index = layered_checkpoint
    holding = {f for n, f in index["weight_map"].items() if n.startswith(prefixes[1])}
    for filename in set(index["weight_map"].values()) - holding:
        (directory / filename).unlink()
    assert sorted(read_attention_weights(directory, 1)) == sorted(expected_layer(tensors, prefixes[1]))


def test_attention_errors_name_the_layer_and_directory(layered_checkpoint, tmp_path):
    directory, _, prefixes, index = layered_checkpoint
    with pytest.raises(KeyError, match=rf"layer 3 .*{re.escape(str(directory))}"):
        read_attention_weights(directory, 3)
    with pytest.raises(TypeError, match="layer_id"):
        read_attention_weights(directory, "1")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_attention_weights(tmp_path / "nowhere", 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither"):
        read_attention_weights(tmp_path / "empty", 1)
    first = next(n for n in index["weight_map"] if n.startswith(prefixes[1]))
    (directory / index["weight_map"][first]).unlink()
    with pytest.raises(FileNotFoundError, match="which the checkpoint's index names"):
        read_attention_weights(directory, 1)


def test_one_tensor_under_both_namings_is_refused(tmp_path):
    write_checkpoint(tmp_path, {"layers.0.attn.wkv.weight": np.zeros(2, BF16),
                                "model.layers.0.self_attn.wkv.weight": np.ones(2, BF16)})
    with pytest.raises(SafetensorsError, match="'wkv.weight' is stored under two names"):
        read_attention_weights(tmp_path, 0)


# --- The module itself, and the safetensors package ---------------------------------------------


def test_the_module_imports_no_jax():
    # Loaded from its file, apart from the package (whose __init__ imports JAX).
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ckpt', {checkpoint.__file__!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# The dtypes that safetensors.numpy reads and writes (it has no bfloat16 or float8).
NUMPY_FORMATS = ["BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "F32", "F64",
                 "C64"]


def test_agrees_with_the_safetensors_package(tmp_path, rng):
    st = pytest.importorskip("safetensors.numpy")
    safe_open = pytest.importorskip("safetensors").safe_open
    tensors = {f"t_{fmt}": random_bits(rng, DTYPES[fmt], (3, 4)) for fmt in NUMPY_FORMATS}
    tensors["scalar"] = np.array(1.5, np.float32)
    tensors["empty"] = np.zeros((0, 3), np.int32)

    write_safetensors(tmp_path / "ours.safetensors", tensors, metadata={"format": "pt"})
    theirs = st.load_file(tmp_path / "ours.safetensors")
    assert sorted(theirs) == sorted(tensors)
    for name, value in tensors.items():
        assert_same_bits(theirs[name], value)
    with safe_open(tmp_path / "ours.safetensors", "numpy") as f:
        assert f.metadata() == {"format": "pt"}

    st.save_file(tensors, tmp_path / "theirs.safetensors", metadata={"k": "v"})
    ours = read_safetensors(tmp_path / "theirs.safetensors")
    assert sorted(ours) == sorted(tensors)
    for name, value in tensors.items():
        assert_same_bits(ours[name], value)

    # The package's own header checks (offsets cover the data exactly, in order) pass on our
    # FP8 and bfloat16 files, which its numpy path cannot turn into arrays.
    fp8 = {"w": random_bits(rng, E4M3, (4, 8)), "g": random_bits(rng, ml_dtypes.float8_e5m2, (3,)),
           "n": random_bits(rng, BF16, (5,))}
    write_safetensors(tmp_path / "fp8.safetensors", fp8)
    with safe_open(tmp_path / "fp8.safetensors", "numpy") as f:
        assert {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()} == {
            "w": ("F8_E4M3", [4, 8]), "g": ("F8_E5M2", [3]), "n": ("BF16", [5])}
