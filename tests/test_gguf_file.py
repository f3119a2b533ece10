"""engine.model.gguf_file reads what the `gguf` package's GGUFReader reads: every metadata value
(with its Python type) and every tensor (type, shape, the same bytes, typed the same way), on
the default model and on a written file with every metadata type, a custom alignment and
unquantised and quantised tensors; a file that is not a GGUF, or is cut short, is a ValueError
naming the model path."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.model.gguf_file import GGUFFile
from engine.model.gguf_reader import gguf_metadata, open_gguf
from engine.model.loader import default_model_path


def assert_same_as_gguf_reader(path: str) -> None:
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    got, want = gguf_metadata(ours), gguf_metadata(ref)
    assert got.keys() == want.keys()
    for key in want:
        if key == "t.nested":  # GGUFReader flattens an array of arrays
            continue
        assert got[key] == want[key] and type(got[key]) is type(want[key]), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes,
                                                             b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name


def test_default_model_reads_as_gguf_reader_reads_it():
    assert_same_as_gguf_reader(default_model_path())


@pytest.fixture
def written(tmp_path) -> str:
    path = str(tmp_path / "every_type.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    for add, value in ((w.add_uint8, 200), (w.add_int8, -7), (w.add_uint16, 60000),
                       (w.add_int16, -300), (w.add_uint32, 4_000_000_000), (w.add_int32, -5),
                       (w.add_uint64, 2**63 + 5), (w.add_int64, -2**40), (w.add_float32, 0.1),
                       (w.add_float64, 1e-300), (w.add_bool, True)):
        add(f"t.{add.__name__}", value)
    w.add_string("t.text", "héllo\nworld")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strings", ["a", "", "ü" * 3])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_metadata_type_alignment_and_tensor_type(written):
    assert_same_as_gguf_reader(written)
    f = GGUFFile(written)
    assert f.fields["t.nested"].contents() == [[1, 2], [3]]
    assert f.fields["t.text"].contents() == "héllo\nworld"
    assert all(t.data_offset % 64 == 0 for t in f.tensors)


def test_not_a_gguf_and_a_cut_file_are_value_errors_naming_the_path(written, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match=r"model: expected a readable GGUF file at .*bad\.gguf"):
        open_gguf(str(bad))
    data = open(written, "rb").read()
    inside_last_tensor = GGUFFile(written).tensors[-1].data_offset + 1
    for cut in (10, 200, inside_last_tensor):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"cut{cut}"):
            open_gguf(str(short))
