"""The params structs of cuda/csrc/pk_ops.h as Python sees them: their layout, packing, and the
codes their fields carry.

Every launcher (the pybind11 modules `_pk_cuda` / `_pk_cuda_host` and `jit.JitModule`) takes one
packed struct per operation. The layouts are read at import from the X-macro field lists of
pk_ops.h (`PK_ATTN_FIELDS`, `PK_WRITE_KV_FIELDS`, `PK_COPY_FIELDS`), so the C++ and Python
layouts come from one definition; `check_layout` compares them with a built module. Every field
is 8 bytes: a pointer (an int here, 0 for none), an int64 or a double.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import torch

CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"

#: Head sizes the kernels are compiled for (PK_HEAD_SIZES in pk_launch.cuh).
HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
#: The reduced set of builds with PK_REDUCED_HEAD_SIZES / PK_HOST_INSTANTIATIONS.
REDUCED_HEAD_SIZES = (64, 128)

#: Values of the `dtype` field (PkDtype in pk_ops.h).
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: C++ spelling of each dtype (template arguments of the JIT path).
CTYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
#: Values of the `kv_dtype` fields (PkKvDtype in pk_ops.h) for the 8-bit caches; 0 is a cache of
#: the query's dtype.
KV_DTYPE_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.int8: 3}
#: The template argument of the kernels over an 8-bit cache (pk_kv8.cuh).
KV8_CTYPE = "PkKv8"
#: Values of the `kernel` field (PkAttnKernel in pk_ops.h).
KERNEL_DECODE, KERNEL_VARLEN_MMA, KERNEL_VARLEN_SIMT, KERNEL_DECODE_MMA = 0, 1, 2, 3

_KIND_FORMAT = {"p": "Q", "i": "q", "f": "d"}
_STRUCT_MACROS = {"attn": "PK_ATTN_FIELDS", "write_kv": "PK_WRITE_KV_FIELDS",
                  "copy": "PK_COPY_FIELDS"}


def _read_fields(macro: str) -> tuple[tuple[str, str], ...]:
    """(name, kind) of every field of X-macro `macro` in pk_ops.h, in order; kind is "p", "i"
    or "f"."""
    text = (CSRC_DIR / "pk_ops.h").read_text()
    m = re.search(rf"#define {macro}\(P, I, F\)(.*?)(?:\n\n|\n#define|\nstruct)", text, re.DOTALL)
    if m is None:
        raise RuntimeError(f"cannot find {macro} in {CSRC_DIR / 'pk_ops.h'}")
    return tuple((name, kind.lower()) for kind, name in re.findall(r"\b([PIF])\((\w+)\)",
                                                                      m.group(1)))


#: Struct name ("attn", "write_kv", "copy") -> its (field name, kind) pairs in order.
FIELDS: dict[str, tuple[tuple[str, str], ...]] = {k: _read_fields(v)
                                                  for k, v in _STRUCT_MACROS.items()}

_STRUCTS = {name: struct.Struct("<" + "".join(_KIND_FORMAT[k] for _, k in fields))
            for name, fields in FIELDS.items()}
_NAMES = {name: tuple(n for n, _ in fields) for name, fields in FIELDS.items()}


def pack(struct_name: str, values: dict[str, Any]) -> bytes:
    """Packs `values` (every field of the struct, by name; pointers as ints, 0 for none) in
    field order. A missing field raises KeyError."""
    return _STRUCTS[struct_name].pack(*[values[n] for n in _NAMES[struct_name]])


def unpack(struct_name: str, packed: bytes) -> dict[str, Any]:
    """The inverse of `pack` (used by the JIT launcher)."""
    return dict(zip(_NAMES[struct_name], _STRUCTS[struct_name].unpack(packed)))


def check_layout(ext: Any) -> None:
    """Raises RuntimeError if a built module's structs differ from pk_ops.h as read here."""
    for name, fields in FIELDS.items():
        built = tuple((n, k) for n, k in ext.fields(name))
        if built != fields or ext.struct_size(name) != 8 * len(fields):
            raise RuntimeError(f"params struct {name!r}: the built module's layout differs from "
                               f"{CSRC_DIR / 'pk_ops.h'} (rebuild the extension)")
