// Loading an instruction-set variant, and what the CPU and the OS let run.
//
// cpu_features() reads CPUID and XGETBV: an instruction set is usable only if the CPU has it
// and the OS saves its registers on a context switch (XCR0), which CPUID alone does not say.
// fastdraft/kernels/build.py picks the best variant from these, builds its library, and
// load_isa() maps it; the driver then calls its kernels through the table (kernel_table.h),
// passing with each call the tuning cpu_tuning() chose for this CPU.
#include <torch/extension.h>

#include <cpuid.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <string>

#include "kernels.h"

namespace {

// XCR0, the register state the OS enables; 0 when the OS does not use XSAVE (no AVX state).
uint64_t xcr0() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_OSXSAVE)) return 0;
  uint32_t lo, hi;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

std::map<std::string, bool> cpu_features() {
  std::map<std::string, bool> f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const uint64_t xcr = xcr0();
  const bool is_avx_state = (xcr & 0x6) == 0x6;        // XMM and YMM registers saved
  const bool is_avx512_state = (xcr & 0xe6) == 0xe6;   // and the opmask and ZMM registers
  const bool is_amx_state = (xcr & 0x60000) == 0x60000;  // tile config and tile data
  const bool has_leaf1 = __get_cpuid(1, &eax, &ebx, &ecx, &edx);
  f["os_avx"] = is_avx_state;
  f["os_avx512"] = is_avx512_state;
  f["fma"] = has_leaf1 && (ecx & bit_FMA) && is_avx_state;
  f["f16c"] = has_leaf1 && (ecx & bit_F16C) && is_avx_state;
  f["avx"] = has_leaf1 && (ecx & bit_AVX) && is_avx_state;
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  unsigned b7 = 0, c7 = 0, d7 = 0, a71 = 0;
  if (max_leaf >= 7) {
    unsigned a7;
    __cpuid_count(7, 0, a7, b7, c7, d7);
    unsigned b71, c71, d71;
    if (a7 >= 1) __cpuid_count(7, 1, a71, b71, c71, d71);
  }
  f["avx2"] = (b7 & bit_AVX2) && is_avx_state;
  f["avx512f"] = (b7 & bit_AVX512F) && is_avx512_state;
  f["avx512dq"] = (b7 & bit_AVX512DQ) && is_avx512_state;
  f["avx512bw"] = (b7 & bit_AVX512BW) && is_avx512_state;
  f["avx512vl"] = (b7 & bit_AVX512VL) && is_avx512_state;
  f["avx512_vnni"] = (c7 & bit_AVX512VNNI) && is_avx512_state;
  f["avx_vnni"] = (a71 & (1u << 4)) && is_avx_state;
  f["avx512_bf16"] = (a71 & (1u << 5)) && is_avx512_state;
  f["amx_bf16"] = (d7 & (1u << 22)) && is_amx_state;
  f["amx_tile"] = (d7 & (1u << 24)) && is_amx_state;
  return f;
}

// The speed choices the instruction sets leave open (kernel_table.h::Tuning), decided here so
// that the variants hold no vendor probe; timed on AMD Zen 4 and on Sapphire Rapids-class Xeons.
fastdraft::Tuning cpu_tuning() {
  __builtin_cpu_init();
  const bool is_amd = __builtin_cpu_is("amd");
  fastdraft::Tuning t{};
  // On AMD an L1 prefetch serializes compute and memory, and a cold few-row GEMV ran faster
  // with no software prefetch at all (more rows take longer per line, and their L2 prefetch
  // pays off there too); on Intel few-row calls would otherwise wait on L2.
  t.woq_few_rows_prefetch = !is_amd;
  // On Zen 4, from 5 rows the independent rows alone cover vpdpbusd's latency, and a second
  // chain only costs an add per row and block.
  t.woq_one_chain_many_rows = is_amd;
  // On AMD, L1 prefetches stall on the few L1 miss buffers.
  t.attention_prefetch_l2 = is_amd;
  return t;
}

// Tuning's fields by name, as Python sees and overrides them.
struct TuningField {
  const char* name;
  int32_t fastdraft::Tuning::*field;
};
constexpr TuningField kTuningFields[] = {
    {"woq_few_rows_prefetch", &fastdraft::Tuning::woq_few_rows_prefetch},
    {"woq_one_chain_many_rows", &fastdraft::Tuning::woq_one_chain_many_rows},
    {"attention_prefetch_l2", &fastdraft::Tuning::attention_prefetch_l2},
};

std::map<std::string, bool> tuning_dict(const fastdraft::Tuning& t) {
  std::map<std::string, bool> d;
  for (const auto& f : kTuningFields) d[f.name] = t.*f.field != 0;
  return d;
}

// Maps a variant library and checks that its table is the one this driver was built against.
// overrides replace the CPU's tuning choices by name, so tests can run every choice on one CPU.
fastdraft::IsaPtr load_isa(const std::string& path, const std::map<std::string, bool>& overrides) {
  // RTLD_LOCAL: nothing of the variant's joins the process's symbols, so no code built with its
  // flags can stand in for a function of the driver's. Never unloaded: tables stay valid.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(handle, "cannot load kernel variant ", path, ": ", dlerror());
  using TableFn = const fastdraft::KernelTable* (*)();
  auto table_fn = reinterpret_cast<TableFn>(dlsym(handle, "fastdraft_kernel_table"));
  TORCH_CHECK(table_fn, "kernel variant ", path, " exports no fastdraft_kernel_table");
  const fastdraft::KernelTable* table = table_fn();
  TORCH_CHECK(table && table->version == fastdraft::kKernelTableVersion && table->size == sizeof(fastdraft::KernelTable),
              "kernel variant ", path, " was built against another kernel table");
  auto isa = std::make_shared<fastdraft::Isa>();
  isa->table = table;
  isa->tuning = cpu_tuning();
  for (const auto& [name, value] : overrides) {
    const TuningField* f = std::find_if(std::begin(kTuningFields), std::end(kTuningFields),
                                        [&](const TuningField& t) { return name == t.name; });
    TORCH_CHECK(f != std::end(kTuningFields), "unknown tuning choice ", name);
    isa->tuning.*f->field = value;
  }
  isa->path = path;
  return isa;
}

}  // namespace

void bind_isa(pybind11::module& m) {
  namespace py = pybind11;
  // module_local: two builds of the driver in one process (benchmarks/ab_kernels.py) each keep their own.
  py::class_<fastdraft::Isa, std::shared_ptr<fastdraft::Isa>>(m, "Isa", py::module_local())
      .def_property_readonly("name", [](const fastdraft::Isa& isa) { return std::string(isa.table->name); })
      .def_property_readonly("tile_rows", [](const fastdraft::Isa& isa) { return isa.table->tile_rows; })
      .def_property_readonly("has_bf16_dot", [](const fastdraft::Isa& isa) { return isa.table->has_bf16_dot() != 0; })
      .def_property_readonly("tuning", [](const fastdraft::Isa& isa) { return tuning_dict(isa.tuning); })
      .def_readonly("path", &fastdraft::Isa::path);
  m.def("load_isa", [](const std::string& path, const std::map<std::string, bool>& tuning) {
    return load_isa(path, tuning);
  }, "map a kernel variant library; tuning: choices to make instead of this CPU's, by name", py::arg("path"),
        py::arg("tuning") = std::map<std::string, bool>());
  m.def("cpu_features", &cpu_features, "instruction sets the CPU has and the OS enables (CPUID, XGETBV)");
}
