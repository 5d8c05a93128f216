"""The strict .safetensors reader: reads what the reference library writes; refuses damage with
BadInput (never another exception) naming the file and the problem; fuzzed."""
import json
import struct

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch

from precast.compiler.errors import BadInput
from precast.compiler.sources.safetensors_file import SafetensorsFile, parse_header


def _file(tmp_path, header: dict, data: bytes, name="m.safetensors"):
    blob = json.dumps(header).encode()
    p = tmp_path / name
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return p


def test_reads_what_the_reference_library_writes(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a.weight": rng.standard_normal((3, 5)).astype(np.float32),
               "b": rng.standard_normal((7,)).astype(np.float16),
               "c": np.arange(6, dtype=np.int64).reshape(2, 3), "scalar": np.array(3.5, np.float32),
               "empty": np.zeros((0, 4), np.float32)}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.metadata == {"format": "pt"}
    assert sorted(f.keys()) == sorted(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(f.read(k), v)
        assert f.read(k).dtype == v.dtype


def test_bf16_is_widened_exactly(tmp_path):
    t = torch.randn(4, 3).to(torch.bfloat16)
    save_torch({"w": t}, tmp_path / "bf.safetensors")
    np.testing.assert_array_equal(SafetensorsFile(tmp_path / "bf.safetensors").read("w"), t.float().numpy())


@pytest.mark.parametrize("header, data, message", [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "outside"),
    ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 12, "needs 12"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlap"),
    ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "outside"),
    ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "exactly dtype, shape, data_offsets"),
    ({"__metadata__": {"a": 1}}, b"", "__metadata__"),
    ({"__metadata__": 0}, b"", "__metadata__"),
    ([1, 2], b"", "not a JSON object"),
    ({"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
    ({"w": {"dtype": "F32", "shape": [10**30], "data_offsets": [0, 8]}}, b"\0" * 8, "needs more than"),
    # 64 x (2**58 + 1) x 4 bytes wraps to 256 in int64 arithmetic: exact integers refuse it
    ({"w": {"dtype": "F32", "shape": [64, 2**58 + 1], "data_offsets": [0, 256]}}, b"\0" * 256, "needs more than"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "4 bytes after the last tensor"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, b"\0" * 12, "bytes [4, 8) of the data area"),
])
def test_damaged_headers_name_the_problem(tmp_path, header, data, message):
    p = _file(tmp_path, header, data)
    with pytest.raises(BadInput) as e:
        SafetensorsFile(p)
    assert message in str(e.value) and str(p) in str(e.value)


def _raw(tmp_path, blob: bytes, data: bytes):
    p = tmp_path / "raw.safetensors"
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return p


@pytest.mark.parametrize("blob, message", [
    # the second 'w' would shadow the first one's bytes: refused, not silently last-wins
    (b'{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},'
     b' "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', "key 'w' appears twice"),
    (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
    (b'{"w": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 2]}}', "NaN"),
    (b'{"w": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 2]}}', "not valid UTF-8 JSON"),
])
def test_hostile_json_is_one_clear_error(tmp_path, blob, message):
    p = _raw(tmp_path, blob, b"\0\0")
    with pytest.raises(BadInput) as e:
        SafetensorsFile(p)
    assert message in str(e.value) and str(p) in str(e.value)


def test_a_folder_is_not_a_file(tmp_path):
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(BadInput, match="not a file"):
        SafetensorsFile(tmp_path / "d.safetensors")


def test_header_length_past_end_and_truncation(tmp_path):
    p = tmp_path / "t.safetensors"
    p.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(BadInput, match="past the end"):
        SafetensorsFile(p)
    p.write_bytes(b"\x01\x02")
    with pytest.raises(BadInput, match="shorter than the 8-byte"):
        SafetensorsFile(p)
    p.write_bytes(struct.pack("<Q", 2) + b"\xff\xfe")
    with pytest.raises(BadInput, match="UTF-8 JSON"):
        SafetensorsFile(p)


def test_missing_file_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="cannot open"):
        SafetensorsFile(tmp_path / "nope.safetensors")


def _valid_bytes(tmp_path) -> bytes:
    rng = np.random.default_rng(1)
    save_file({f"t{i}": rng.standard_normal((i + 1, 3)).astype(np.float32) for i in range(6)},
              tmp_path / "v.safetensors")
    return (tmp_path / "v.safetensors").read_bytes()


def _covers_exactly(spans, data_start: int, size: int) -> bool:
    """The tensors tile [data_start, size) with no gap, overlap or trailing byte."""
    cursor = data_start
    for s, e in sorted(spans):
        if s != cursor:
            return False
        cursor = e
    return cursor == size


def _check_invariants(f: SafetensorsFile, size: int, data_start: int):
    assert _covers_exactly([(i.start, i.end) for i in f.tensors.values()], data_start, size)
    for k, info in f.tensors.items():
        assert info.end <= size
        assert f.read(k).shape == info.shape


def test_fuzz_byte_mutations_and_truncations(tmp_path):
    """2000 damaged variants of a valid file: each parses consistently or raises BadInput."""
    base = _valid_bytes(tmp_path)
    n = struct.unpack("<Q", base[:8])[0]
    rng = np.random.default_rng(2)
    p = tmp_path / "fuzz.safetensors"
    outcomes = {"ok": 0, "bad": 0}
    for i in range(2000):
        b = bytearray(base)
        kind = i % 4
        if kind == 0:  # flip bytes inside the header
            for _ in range(rng.integers(1, 4)):
                b[8 + rng.integers(0, n)] = rng.integers(0, 256)
        elif kind == 1:  # truncate anywhere
            b = b[:rng.integers(0, len(b))]
        elif kind == 2:  # corrupt the length field
            b[:8] = struct.pack("<Q", int(rng.integers(0, 2 * len(base))))
        else:  # replace a digit in the header (offsets, shapes)
            digits = [j for j in range(8, 8 + n) if chr(b[j]).isdigit()]
            b[digits[rng.integers(0, len(digits))]] = ord(str(rng.integers(0, 10)))
        p.write_bytes(bytes(b))
        try:
            f = SafetensorsFile(p)
        except BadInput:
            outcomes["bad"] += 1
            continue
        _check_invariants(f, len(b), 8 + struct.unpack("<Q", bytes(b[:8]))[0])
        f.close()
        outcomes["ok"] += 1
    assert outcomes["bad"] > 500 and outcomes["ok"] > 0, outcomes


def test_fuzz_random_headers(tmp_path):
    """Random tensor tables: accepted ones satisfy every invariant; the rest are BadInput."""
    rng = np.random.default_rng(3)
    dtypes = ["F32", "F16", "BF16", "I64", "U8", "F8_E4M3", "X9"]
    accepted = 0
    for _ in range(1000):
        header, cursor = {}, 0
        for t in range(rng.integers(1, 5)):
            dt = dtypes[rng.integers(0, len(dtypes))]
            shape = [int(x) for x in rng.integers(0, 4, rng.integers(0, 3))]
            width = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "F8_E4M3": 1}.get(dt, 4)
            n = width * int(np.prod(shape)) if shape else width
            begin = cursor + int(rng.integers(-3, 3)) if rng.random() < 0.3 else cursor
            header[f"k{t}"] = {"dtype": dt, "shape": shape, "data_offsets": [begin, begin + n + int(rng.random() < 0.1)]}
            cursor = max(cursor, begin + n)
        blob = json.dumps(header).encode()
        head = struct.pack("<Q", len(blob)) + blob
        file_size = len(head) + max(0, cursor + (int(rng.integers(-2, 2)) if rng.random() < 0.3 else 0))
        try:
            tensors, _ = parse_header("fuzz", head, file_size)
        except BadInput:
            continue
        accepted += 1
        assert _covers_exactly([(i.start, i.end) for i in tensors.values()], len(head), file_size)
    assert accepted > 100, accepted
