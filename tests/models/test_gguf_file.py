"""ferry's GGUF header reader (models/gguf_file.py) against gguf's GGUFReader: the same metadata and the
same tensors (names, types, shapes, bytes) on the bundled SmolLM2 and on files written with odd
metadata; damaged files are clear errors."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ferry.models.gguf_file import GGUFFile  # noqa: E402
from ferry.models.loader import _open_gguf  # noqa: E402
from ferry.models.paths import default_model_path  # noqa: E402


def assert_same(path: str) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        assert ours.fields[key].contents() == theirs.fields[key].contents(), key
        assert len(ours.fields[key].data) == len(theirs.fields[key].data), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)  # fmt: skip
        assert np.array_equal(a.shape, b.shape) and a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8))


def test_the_bundled_model_reads_as_gguf_reads_it():
    assert_same(default_model_path())


def test_every_value_type_and_an_alignment(tmp_path):
    path = str(tmp_path / "odd.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("general.alignment", 64)
    w.add_string("s", "héllo")
    w.add_uint8("u8", 7)
    w.add_int16("i16", -3)
    w.add_bool("flag", True)
    w.add_float32("f", 0.1)
    w.add_float64("d", 1e-300)
    w.add_int64("i64", -(2**40))
    w.add_array("ints", [1, 2, 3])
    w.add_array("floats", [0.5, -1.25])
    w.add_array("strings", ["a", "", "ünïcode", "z" * 300])
    w.add_array("empty", [])
    w.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("f16", np.ones((2, 5), dtype=np.float16))
    q8 = gguf.quants.quantize(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same(path)
    assert GGUFFile(path).data_offset % 64 == 0


def test_damaged_files_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="not a readable GGUF file.*magic"):
        _open_gguf(str(bad))
    whole = open(default_model_path(), "rb").read(1 << 20)  # the header and the first tensors' bytes, cut
    short = tmp_path / "short.gguf"
    short.write_bytes(whole[:5000])  # inside the vocabulary
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        _open_gguf(str(short))
