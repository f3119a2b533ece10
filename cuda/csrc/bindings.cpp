// bindings.cpp: the Python module over pk_ops.h (pybind11; no torch, no CUDA headers).
//
// Built as `_pk_cuda` (nvcc objects, GPU) or `_pk_cuda_host` (g++ -DPK_HOST_EMULATION); the
// module name comes from PK_MODULE_NAME. Parameters arrive as the packed bytes of the structs in
// pk_ops.h (params.py packs them); `fields(name)` returns the field names and kinds of a struct so
// the Python side can check its packing against this build.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pk_ops.h"

#ifndef PK_MODULE_NAME
#error "PK_MODULE_NAME must name the module (_pk_cuda or _pk_cuda_host)"
#endif

namespace py = pybind11;

namespace {

using FieldList = std::vector<std::pair<std::string, std::string>>;

#define PK_LIST_P(name) fields.emplace_back(#name, "p");
#define PK_LIST_I(name) fields.emplace_back(#name, "i");
#define PK_LIST_F(name) fields.emplace_back(#name, "f");

FieldList fields_of(const std::string& name) {
  FieldList fields;
  if (name == "attn") {
    PK_ATTN_FIELDS(PK_LIST_P, PK_LIST_I, PK_LIST_F)
  } else if (name == "write_kv") {
    PK_WRITE_KV_FIELDS(PK_LIST_P, PK_LIST_I, PK_LIST_F)
  } else if (name == "copy") {
    PK_COPY_FIELDS(PK_LIST_P, PK_LIST_I, PK_LIST_F)
  } else {
    throw std::invalid_argument("fields: expected 'attn', 'write_kv' or 'copy', got '" + name +
                                "'");
  }
  return fields;
}

// Unpacks `packed` into a Params struct, checking the size first.
template <typename Params>
Params unpack(const py::bytes& packed, const char* what) {
  std::string raw = packed;
  if (raw.size() != sizeof(Params)) {
    throw std::invalid_argument(std::string(what) + ": expected " +
                                std::to_string(sizeof(Params)) + " packed bytes, got " +
                                std::to_string(raw.size()));
  }
  Params p;
  std::memcpy(&p, raw.data(), sizeof(Params));
  return p;
}

// Runs `op` without the GIL and raises RuntimeError with its message on failure.
template <typename Params>
void run(const char* (*op)(const Params&, void*), const py::bytes& packed, uintptr_t stream,
         const char* what) {
  Params p = unpack<Params>(packed, what);
  const char* err;
  {
    py::gil_scoped_release release;
    err = op(p, reinterpret_cast<void*>(stream));
  }
  if (err != nullptr) throw std::runtime_error(std::string(what) + ": " + err);
}

}  // namespace

PYBIND11_MODULE(PK_MODULE_NAME, m) {
  m.doc() = "paged-kernels CUDA backend launchers (see cuda/csrc/pk_ops.h)";
  m.def("fields", &fields_of, py::arg("name"),
        "Field names and kinds ('p' pointer, 'i' int64, 'f' double) of a params struct.");
  m.def("struct_size", [](const std::string& name) -> size_t {
    if (name == "attn") return sizeof(PkAttnParams);
    if (name == "write_kv") return sizeof(PkWriteKvParams);
    if (name == "copy") return sizeof(PkCopyParams);
    throw std::invalid_argument("struct_size: expected 'attn', 'write_kv' or 'copy', got '" +
                                name + "'");
  });
  m.def("paged_attention", [](const py::bytes& p, uintptr_t stream) {
    run<PkAttnParams>(&pk_paged_attention, p, stream, "paged_attention");
  }, py::arg("params"), py::arg("stream"));
  m.def("write_kv", [](const py::bytes& p, uintptr_t stream) {
    run<PkWriteKvParams>(&pk_write_kv, p, stream, "write_kv");
  }, py::arg("params"), py::arg("stream"));
  m.def("copy_blocks", [](const py::bytes& p, uintptr_t stream) {
    run<PkCopyParams>(&pk_copy_blocks, p, stream, "copy_blocks");
  }, py::arg("params"), py::arg("stream"));
}
