"""test_formats.py -- fusion's GGUF and safetensors readers against the reference Python packages.

Files are written with the PyPI `gguf` package (GGUFWriter, gguf.quants.quantize) and with
`safetensors` / `huggingface_hub` (torch tensors, a sharded checkpoint with its index); then
`fusion-inspect` must report the same metadata and tensor table as the `gguf` package's own
GGUFReader / the safetensors header, and dequantize every tensor to exactly (bit for bit) what
gguf.quants.dequantize / safetensors' own loader give. The real default model (SmolLM2 Q4_1) is
checked the same way.
"""

import json
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

# gguf 0.10 imports sentencepiece at import time though it only needs it for vocab handling.
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import GGUFReader, GGUFValueType, GGUFWriter  # noqa: E402

SOURCE = Path(os.environ.get("FUSION_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BUILD = Path(os.environ.get("FUSION_BUILD_DIR", SOURCE / "build"))
INSPECT = BUILD / "fusion-inspect"


# ---- helpers -----------------------------------------------------------------------------


def inspect(path, *args, check=True):
    """Runs fusion-inspect; returns the parsed JSON (check) or the CompletedProcess."""
    assert INSPECT.exists(), f"{INSPECT} not built"
    p = subprocess.run([str(INSPECT), str(path), *map(str, args)], capture_output=True, text=True)
    if not check:
        return p
    assert p.returncode == 0, f"fusion-inspect {path} {args} failed: {p.stderr}"
    return json.loads(p.stdout)


def values(path, name, rows=None):
    """The tensor's values as fusion dequantizes them (float32, memory order)."""
    args = ["--tensor", name] + (["--rows", f"{rows[0]}:{rows[1]}"] if rows else [])
    out = inspect(path, *args)
    conv = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
    # 9 significant digits identify a float32 uniquely (and far from rounding midpoints)
    v = np.array([conv.get(x, x) if isinstance(x, str) else x for x in out["values"]],
                 dtype=np.float64)
    return out, v.astype(np.float32)


def assert_bits_equal(got, want, what):
    want = np.ascontiguousarray(want, dtype=np.float32).reshape(-1)
    got = np.ascontiguousarray(got, dtype=np.float32).reshape(-1)
    assert got.shape == want.shape, f"{what}: {got.shape} values, want {want.shape}"
    bad = np.nonzero(got.view(np.uint32) != want.view(np.uint32))[0]
    assert bad.size == 0, (f"{what}: {bad.size} values differ, first at {bad[0]}: "
                           f"{got[bad[0]]!r} != {want[bad[0]]!r}")


def reader_value(field):
    """A metadata value decoded by the gguf package's own reader (nested arrays flattened)."""
    t = field.types
    if t[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if t[0] == GGUFValueType.ARRAY:
        if t[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    return field.parts[field.data[0]][0].item()


def flatten(v):
    return [y for x in v for y in flatten(x)] if isinstance(v, list) else [v]


def json_value(entry):
    """fusion-inspect's value, with its large-uint64 strings turned back into ints."""
    v = entry["value"]
    if entry["type"] == "uint64" and isinstance(v, str):
        return int(v)
    return v


def check_against_reader(path, out):
    """Metadata and tensor table printed by fusion-inspect == GGUFReader's view of `path`."""
    r = GGUFReader(str(path))
    meta = out["metadata"]
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert list(meta) == list(fields), "metadata keys differ (or their order)"
    for key, field in fields.items():
        entry = meta[key]
        assert entry["type"] == GGUFValueType(field.types[0]).name.lower(), key
        got, want = json_value(entry), reader_value(field)
        if entry["type"] == "array":
            assert entry["elem_type"] == GGUFValueType(field.types[1]).name.lower(), key
            got = flatten(got)
        assert got == want, f"metadata {key}: {str(got)[:200]} != {str(want)[:200]}"
    assert len(out["tensors"]) == len(r.tensors)
    for t, rt in zip(out["tensors"], r.tensors):
        assert t["name"] == rt.name
        assert t["ggml_type"] == int(rt.tensor_type)
        assert t["type"] == rt.tensor_type.name.lower()
        assert t["shape"] == [int(x) for x in rt.shape], t["name"]
        assert out["data_offset"] + t["offset"] == rt.data_offset, t["name"]
        assert t["nbytes"] == int(rt.n_bytes), t["name"]
    return r


# ---- GGUF written by the gguf package --------------------------------------------------------

RNG = np.random.default_rng(1234)

SCALARS = [  # (key, writer method, value)
    ("t.u8", "add_uint8", 255),
    ("t.i8", "add_int8", -128),
    ("t.u16", "add_uint16", 65535),
    ("t.i16", "add_int16", -32768),
    ("t.u32", "add_uint32", 2**32 - 1),
    ("t.i32", "add_int32", -(2**31)),
    ("t.f32", "add_float32", float(np.float32(1.1))),
    ("t.u64", "add_uint64", 2**64 - 1),
    ("t.i64", "add_int64", -(2**63)),
    ("t.f64", "add_float64", 3.141592653589793),
    ("t.true", "add_bool", True),
    ("t.false", "add_bool", False),
    ("t.str", "add_string", "h\u00e9llo \u2713 \U0001F600"),
    ("t.empty_str", "add_string", ""),
]
STRINGS = ["", "a", "\u00e9\u00e8", "tok with spaces", "\n\t"] + [f"s{i}" * (i % 7) for i in range(500)]
ARRAYS = [  # (key, value, element type name, nested)
    ("t.strs", STRINGS, "string"),
    ("t.i32s", [1, -2, 3, 2**31 - 1], "int32"),
    ("t.f32s", [0.5, -1.25, float(np.float32(0.1))], "float32"),
    ("t.bools", [True, False, True], "bool"),
    ("t.bytes", bytes(range(256)), "uint8"),
    ("t.nested", [[1, 2], [3], [4, 5, 6]], "array"),
    ("t.nested_strs", [["a"], ["b", "c"]], "array"),
]


def tensors_for_gguf():
    """name -> (original float32 data in numpy order, GGML type)."""
    return {
        "f32": (RNG.standard_normal((3, 5)).astype(np.float32), QT.F32),
        "f32_3d": (RNG.standard_normal((2, 3, 4)).astype(np.float32), QT.F32),
        "f16": (RNG.standard_normal((4, 8)).astype(np.float32), QT.F16),
        "bf16": (RNG.standard_normal((2, 64)).astype(np.float32), QT.BF16),
        "q8_0": (RNG.standard_normal((4, 64)).astype(np.float32), QT.Q8_0),
        "q4_0": (RNG.standard_normal((3, 96)).astype(np.float32), QT.Q4_0),
        "q4_1": (RNG.standard_normal((5, 32)).astype(np.float32) + 0.7, QT.Q4_1),
        "blk.0.attn_q.weight": (RNG.standard_normal((64, 64)).astype(np.float32), QT.Q4_1),
    }


def write_gguf(path, alignment=None):
    w = GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    for key, method, value in SCALARS:
        if value == "":  # add_string() silently drops empty strings
            w.add_key_value(key, value, GGUFValueType.STRING)
        else:
            getattr(w, method)(key, value)
    for key, value, _ in ARRAYS:
        w.add_array(key, value)
    ts = tensors_for_gguf()
    for name, (data, qt) in ts.items():
        if qt == QT.F32:
            w.add_tensor(name, data)
        elif qt == QT.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qt), raw_dtype=qt)
    # types fusion does not compute with: the file still opens, the tensor is refused
    w.add_tensor("q5k", np.zeros((2, 176), dtype=np.uint8), raw_dtype=QT.Q5_K)
    w.add_tensor("ints", np.arange(6, dtype=np.int8).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ts


@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_written_by_gguf_package(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    ts = write_gguf(path, alignment)
    out = inspect(path)
    assert out["format"] == "gguf"
    assert out["version"] == 3
    assert out["alignment"] == (alignment or 32)
    assert out["data_offset"] % out["alignment"] == 0

    # metadata: the values written, and what GGUFReader reads back
    meta = out["metadata"]
    assert meta["general.architecture"] == {"type": "string", "value": "llama"}
    for key, method, value in SCALARS:
        assert json_value(meta[key]) == value, key
        assert meta[key]["type"] == method[len("add_"):], key
    for key, value, et in ARRAYS:
        assert meta[key]["elem_type"] == et, key
        want = list(value) if isinstance(value, bytes) else value
        assert meta[key]["value"] == want, key
    r = check_against_reader(path, out)

    # tensors: exact dequantization against gguf.quants.dequantize, and close to the input
    tol = {QT.F32: 0, QT.F16: 2e-3, QT.BF16: 1e-2, QT.Q8_0: 2e-2, QT.Q4_0: 0.3, QT.Q4_1: 0.3}
    by_name = {t.name: t for t in r.tensors}
    for name, (data, qt) in ts.items():
        res, got = values(path, name)
        assert res["shape"] == list(reversed(data.shape)), name
        want = gguf.quants.dequantize(by_name[name].data, by_name[name].tensor_type)
        assert_bits_equal(got, want, name)
        err = np.abs(got - data.reshape(-1)) / (np.abs(data.reshape(-1)).max())
        assert err.max() <= tol[qt] + 1e-7, f"{name}: relative error {err.max()}"
    # a row range of a 2-D view
    res, got = values(path, "q4_0", rows=(1, 3))
    want = gguf.quants.dequantize(by_name["q4_0"].data, QT.Q4_0)[1:3]
    assert_bits_equal(got, want, "q4_0 rows 1:3")

    for name, tname in (("q5k", "q5_k"), ("ints", "i8")):
        p = inspect(path, "--tensor", name, check=False)
        assert p.returncode == 1
        assert f"'{name}'" in p.stderr and tname in p.stderr and str(path) in p.stderr, p.stderr


def test_gguf_v2_and_corrupt_copies(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path)
    raw = bytearray(path.read_bytes())
    # v2 has the same layout as v3
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(raw[:4] + struct.pack("<I", 2) + raw[8:])
    assert inspect(v2)["version"] == 2
    # truncated copies: a clean error naming the file, never a crash
    out = inspect(path)
    # (the writer pads the file after the last tensor: cutting padding is harmless)
    data_end = out["data_offset"] + max(t["offset"] + t["nbytes"] for t in out["tensors"])
    cuts = sorted({0, 3, 7, 23, 24, 100, out["data_offset"] - 1, out["data_offset"],
                   data_end - 1} | set(range(25, out["data_offset"], 997)))
    for n in cuts:
        bad = tmp_path / f"cut{n}.gguf"
        bad.write_bytes(raw[:n])
        p = inspect(bad, check=False)
        assert p.returncode == 1 and str(bad) in p.stderr, (n, p.stderr)
        assert "Sanitizer" not in p.stderr and "Segmentation" not in p.stderr
    # a tensor count of 2^60
    bad = tmp_path / "count.gguf"
    bad.write_bytes(raw[:8] + struct.pack("<Q", 2**60) + raw[16:])
    p = inspect(bad, check=False)
    assert p.returncode == 1 and "tensor count" in p.stderr, p.stderr


# ---- the real default model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model():
    script = SOURCE / "scripts" / "fetch-default-model.sh"
    p = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"default model unavailable: {p.stderr.strip()[-300:]}")
    return Path(p.stdout.strip().splitlines()[-1])


def test_default_model(default_model):
    out = inspect(default_model)
    r = check_against_reader(default_model, out)
    assert out["metadata"]["general.architecture"]["value"] == "llama"
    assert len(out["metadata"]["tokenizer.ggml.tokens"]["value"]) == 49152
    types = {t["type"] for t in out["tensors"]}
    assert "q4_1" in types, types
    by_name = {t.name: t for t in r.tensors}
    for name in ("output_norm.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight",
                 "blk.29.attn_k.weight", "blk.3.ffn_norm.weight"):
        rt = by_name[name]
        _, got = values(default_model, name)
        assert_bits_equal(got, gguf.quants.dequantize(rt.data, rt.tensor_type), name)
    rt = by_name["token_embd.weight"]  # q8_0, 49152 rows: check a few row ranges
    full = gguf.quants.dequantize(rt.data, rt.tensor_type)
    for a, b in ((0, 16), (1000, 1003), (49150, 49152)):
        _, got = values(default_model, "token_embd.weight", rows=(a, b))
        assert_bits_equal(got, full[a:b], f"token_embd rows {a}:{b}")


# ---- safetensors ---------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def st_header(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def test_safetensors_single(tmp_path):
    g = torch.Generator().manual_seed(7)
    sd = {
        "model.embed_tokens.weight": torch.randn(10, 6, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(6, 6, generator=g).half(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 6, generator=g).bfloat16(),
        "model.norm.weight": torch.randn(6, generator=g),
        "conv": torch.randn(2, 3, 4, 5, generator=g),
        "scalar": torch.tensor(3.5),
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([1, -2, 3], dtype=torch.int8),
        "bytes": torch.tensor([1, 2], dtype=torch.uint8),
        "double": torch.randn(3, generator=g, dtype=torch.float64),
    }
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path), metadata={"format": "pt"})
    hlen, header = st_header(path)
    out = inspect(path)
    assert out["format"] == "safetensors" and out["n_shards"] == 1
    assert [t["name"] for t in out["tensors"]] == sorted(sd)
    for t in out["tensors"]:
        h = header[t["name"]]
        assert t["dtype"] == h["dtype"] and t["shape"] == h["shape"], t
        assert t["offset"] == 8 + hlen + h["data_offsets"][0]
        assert t["nbytes"] == h["data_offsets"][1] - h["data_offsets"][0]
    with safe_open(str(path), framework="pt") as f:
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                     "model.layers.0.mlp.up_proj.weight", "model.norm.weight", "conv", "scalar"):
            ref = f.get_tensor(name)
            res, got = values(path, name)
            assert res["shape"] == list(ref.shape), name
            assert_bits_equal(got, ref.float().numpy(), name)
    for name, dtype in (("ids", "I64"), ("mask", "I8"), ("bytes", "U8"), ("double", "F64")):
        p = inspect(path, "--tensor", name, check=False)
        assert p.returncode == 1
        assert f"'{name}'" in p.stderr and f"dtype {dtype}" in p.stderr, p.stderr
    # a lying header: one byte short of the data the shape needs
    raw = bytearray(path.read_bytes())
    bad = tmp_path / "short.safetensors"
    bad.write_bytes(raw[:-1])
    p = inspect(bad, check=False)
    assert p.returncode == 1 and str(bad) in p.stderr and "outside the data section" in p.stderr


def test_safetensors_sharded(tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    g = torch.Generator().manual_seed(11)
    sd = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(16, 32, generator=g).bfloat16()
          for i in range(4)}
    sd["model.norm.weight"] = torch.randn(16, generator=g)
    sd["lm_head.weight"] = torch.randn(8, 16, generator=g).half()
    d = tmp_path / "ckpt"
    d.mkdir()
    hub.save_torch_state_dict(sd, str(d), max_shard_size=2500)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1, "expected a sharded checkpoint"
    for target in (d, d / "model.safetensors.index.json"):
        out = inspect(target)
        assert out["n_shards"] == len(shards)
        assert [t["name"] for t in out["tensors"]] == sorted(sd)
        for t in out["tensors"]:
            assert t["file"] == index["weight_map"][t["name"]], t
    for name, ref in sd.items():
        with safe_open(str(d / index["weight_map"][name]), framework="pt") as f:
            want = f.get_tensor(name)
        assert torch.equal(want, ref)
        res, got = values(d, name)
        assert res["shape"] == list(ref.shape)
        assert_bits_equal(got, ref.float().numpy(), name)
    # the index names a shard that is missing
    victim = sorted(shards)[-1]
    (d / victim).rename(d / "moved.bin")
    p = inspect(d, check=False)
    assert p.returncode == 1 and victim in p.stderr and "missing" in p.stderr, p.stderr
