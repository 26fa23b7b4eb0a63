"""The llama.cpp baseline's GGUF: the packaged weights, de-quantised, at the served precision."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from bench.gguf_precision import write_at_precision


def _quantised_gguf(path):
    """A small llama-style GGUF: one Q8_0 matrix, one F32 norm, tokenizer metadata."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_file_type(7)
    w.add_token_list(["<a>", "<b>", "c"])
    w.add_chat_template("{{ messages }}")
    rng = np.random.default_rng(0)
    mat = rng.standard_normal((8, 64)).astype(np.float32)
    w.add_tensor("blk.0.ffn_down.weight", gguf.quants.quantize(mat, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.linspace(0.5, 1.5, 64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tensor(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    return t, np.asarray(reader.data[t.data_offset : t.data_offset + t.n_bytes])


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_weights_are_the_dequantised_ones_at_the_precision(tmp_path, precision):
    src, dst = tmp_path / "q.gguf", tmp_path / f"{precision}.gguf"
    _quantised_gguf(src)
    info = write_at_precision(src, dst, precision)
    assert info["tensors"] == 2 and dst.is_file()
    before, after = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    q, _ = _tensor(before, "blk.0.ffn_down.weight")
    want = torch.from_numpy(gguf.quants.dequantize(q.data, q.tensor_type).astype(np.float32))
    t, raw = _tensor(after, "blk.0.ffn_down.weight")
    if precision == "bfloat16":
        assert t.tensor_type == gguf.GGMLQuantizationType.BF16
        got = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).reshape(want.shape)
        assert torch.equal(got, want.to(torch.bfloat16))  # round to nearest even, as torch casts
    else:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(torch.from_numpy(raw.view(np.float32).copy()).reshape(want.shape), want)
    norm, _ = _tensor(after, "blk.0.attn_norm.weight")
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32  # norms stay float32
    # every metadata key is carried over, the file type names the new precision
    assert after.fields["tokenizer.ggml.tokens"].contents() == ["<a>", "<b>", "c"]
    assert after.fields["tokenizer.chat_template"].contents() == "{{ messages }}"
    assert after.fields["llama.block_count"].contents() == 1
    assert after.fields["general.file_type"].contents() == (32 if precision == "bfloat16" else 0)


def test_an_unknown_precision_is_refused(tmp_path):
    with pytest.raises(ValueError, match="precision must be one of"):
        write_at_precision(tmp_path / "q.gguf", tmp_path / "x.gguf", "int4")
