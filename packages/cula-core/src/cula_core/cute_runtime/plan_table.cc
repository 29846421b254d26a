// cula's compiled plan table: a repeated public-op call resolved, checked and launched without Python.
//
// A plan (cula_core.plans) is what core decided for one call signature. Where a backend can state its plan as a
// *program* (allocations plus kernel launches whose arguments are literals, input / allocation addresses and the
// stream), the op registers that program here under the call's key, and later calls with the same key run it from
// C++: the key built from the DLPack metadata TVM-FFI hands us (no per-tensor Python attribute reads), the outputs
// allocated through the caller's framework (torch's caching allocator, via TVMFFIEnvTensorAlloc), the kernels'
// TVM-FFI functions called directly, on the caller's current stream (TVMFFIEnvGetStream).
//
// Exported functions (Python: cula_core.cute_runtime.plan_table):
//   cula_plan_call(op, n_scalars, scalars..., tensors...)      -> the program's first result, or None: no
//                                                                 program for this key (the caller takes its
//                                                                 Python path), or a call this table never serves
//   cula_plan_next_result(like)                                 -> the next result of the program this thread's
//                                                                 last cula_plan_call ran (None past the last):
//                                                                 one tensor per return, because a container
//                                                                 costs Python several us to unpack; `like`, any
//                                                                 torch tensor, makes TVM-FFI hand it back as a
//                                                                 torch tensor
//   cula_plan_register(program, op, n_scalars, scalars..., tensors...) -> bool: stored under the call's key
//   cula_plan_clear(), cula_plan_count(), cula_plan_stats() -> [calls served, calls declined]
//   cula_plan_take_failure()                                    -> bool: whether this thread's last cula_plan_call
//                                                                 raised while running its program (a kernel or an
//                                                                 allocation failed: the call must not be retried
//                                                                 on the Python path, which would launch again);
//                                                                 clears it. False when the error came before the
//                                                                 call reached a program (a tensor TVM-FFI cannot
//                                                                 take fails in the argument conversion)
//
// The key: op id; the dispatch environment (CULA_BACKEND, CULA_STRICT, read with getenv, which Python's os.environ
// writes through to); every scalar with its type (None, bool, int, float, str); every tensor's dtype, device,
// shape (None for an absent one). A call is never served when CULA_CHECK_DEVICE_VALUES is set to anything but "0",
// when a tensor argument is not contiguous, or when an input the program reads with 16-byte vectors is not
// 16-byte aligned: those take the Python path, which handles them.
//
// A program (built by plan_table.Program, checked there):
//   n_inputs     the tensor arguments of the call; slots 0 .. n_inputs-1 are the inputs, then the allocations
//   allocs       per allocation [dtype code, bits, lanes, device input slot, ndim, shape...]
//   kernels      the TVM-FFI functions launched in order
//   args         per launch, its arguments as triples (kind, a, b):
//                  LITERAL_INT (a)           an integer
//                  LITERAL_FLOAT (a)         floats[a]
//                  ADDRESS (slot, offset)    data address of slot + offset bytes (slot must hold a tensor)
//                  STREAM                    the current stream of the first input's device
//   floats       the float literals
//   aligned      input slots that must be 16-byte aligned
//   results      allocation slots returned, in order (at least one)
//   keep         objects held as long as the program (what its literal addresses point into)
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace {

namespace ffi = tvm::ffi;

enum ArgKind : int64_t { LITERAL_INT = 0, LITERAL_FLOAT = 1, ADDRESS = 2, STREAM = 3 };

// plans kept at most; past it the table is emptied (a process that never repeats a signature)
constexpr size_t kMaxPlans = 4096;
// most arguments of one launch (the kernels take about 25)
constexpr size_t kMaxArgs = 64;

struct Alloc {
  DLDataType dtype;
  int device_slot;
  std::vector<int64_t> shape;
};

struct Launch {
  ffi::Function kernel;
  std::vector<int64_t> args;  // triples
};

struct Program {
  int n_inputs = 0;
  std::vector<Alloc> allocs;
  std::vector<Launch> launches;
  std::vector<double> floats;
  std::vector<int> aligned;
  std::vector<int> results;
  ffi::Array<ffi::Any> keep;
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const noexcept {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t w : key) {
      h ^= static_cast<uint64_t>(w);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

std::mutex table_mutex;
std::unordered_map<std::vector<int64_t>, std::shared_ptr<const Program>, KeyHash> table;
// the results after the first of this thread's last program, last first (cula_plan_next_result pops them)
thread_local std::vector<ffi::Any> pending_results;
// calls that reached the table and ran a program / came back without one (cula_plan_stats): what a benchmark reads
// to tell whether its calls were served
std::atomic<int64_t> calls_served{0}, calls_declined{0};
// set when this thread's cula_plan_call raised inside RunProgram (cula_plan_take_failure reads and clears it)
thread_local bool program_failed = false;

void AppendText(std::vector<int64_t>* key, const char* data, size_t size) {
  key->push_back(static_cast<int64_t>(size));
  for (size_t i = 0; i < size; i += 8) {
    int64_t word = 0;
    std::memcpy(&word, data + i, size - i < 8 ? size - i : 8);
    key->push_back(word);
  }
}

void AppendEnvironment(std::vector<int64_t>* key, const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) {
    key->push_back(-1);
  } else {
    AppendText(key, value, std::strlen(value));
  }
}

// torch's is_contiguous: row-major strides, ignoring the strides of size-1 dimensions; empty tensors are contiguous
bool IsContiguous(const DLTensor* t) {
  if (t->strides == nullptr) return true;
  int64_t expected = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    if (t->shape[i] == 0) return true;
    if (t->shape[i] != 1 && t->strides[i] != expected) return false;
    expected *= t->shape[i];
  }
  return true;
}

const DLTensor* TensorArg(const ffi::AnyView& arg) {
  int32_t index = arg.type_index();
  if (index == ffi::TypeIndex::kTVMFFITensor) {
    return TVMFFITensorGetDLTensorPtr(reinterpret_cast<const TVMFFIAny*>(&arg)->v_obj);
  }
  if (index == ffi::TypeIndex::kTVMFFIDLTensorPtr) {
    return static_cast<const DLTensor*>(reinterpret_cast<const TVMFFIAny*>(&arg)->v_ptr);
  }
  return nullptr;
}

// The key of a call (args: op, n_scalars, scalars..., tensors...) into `key`, the tensors into `tensors` (nullptr
// for None). False when this table never serves the call.
bool BuildKey(const ffi::AnyView* args, int32_t num_args, std::vector<int64_t>* key,
              std::vector<const DLTensor*>* tensors) {
  if (num_args < 2) return false;
  const char* check = std::getenv("CULA_CHECK_DEVICE_VALUES");
  if (check != nullptr && check[0] != '\0' && std::strcmp(check, "0") != 0) return false;
  std::optional<int64_t> op = args[0].as<int64_t>();
  std::optional<int64_t> n_scalars = args[1].as<int64_t>();
  if (!op || !n_scalars || *n_scalars < 0 || 2 + *n_scalars > num_args) return false;
  key->push_back(*op);
  AppendEnvironment(key, "CULA_BACKEND");
  AppendEnvironment(key, "CULA_STRICT");
  const int32_t first_tensor = 2 + static_cast<int32_t>(*n_scalars);
  for (int32_t i = 2; i < first_tensor; ++i) {
    const TVMFFIAny* raw = reinterpret_cast<const TVMFFIAny*>(&args[i]);
    switch (raw->type_index) {
      case ffi::TypeIndex::kTVMFFINone:
        key->push_back(0);
        break;
      case ffi::TypeIndex::kTVMFFIBool:
        key->push_back(1);
        key->push_back(raw->v_int64 != 0);
        break;
      case ffi::TypeIndex::kTVMFFIInt:
        key->push_back(2);
        key->push_back(raw->v_int64);
        break;
      case ffi::TypeIndex::kTVMFFIFloat: {
        int64_t bits;
        std::memcpy(&bits, &raw->v_float64, sizeof(bits));
        key->push_back(3);
        key->push_back(bits);
        break;
      }
      default: {
        std::optional<ffi::String> text = args[i].as<ffi::String>();
        if (!text) return false;
        key->push_back(4);
        AppendText(key, text->data(), text->size());
      }
    }
  }
  for (int32_t i = first_tensor; i < num_args; ++i) {
    if (args[i].type_index() == ffi::TypeIndex::kTVMFFINone) {
      tensors->push_back(nullptr);
      key->push_back(-1);
      continue;
    }
    const DLTensor* t = TensorArg(args[i]);
    if (t == nullptr || !IsContiguous(t)) return false;
    tensors->push_back(t);
    key->push_back((static_cast<int64_t>(t->dtype.code) << 32) | (static_cast<int64_t>(t->dtype.bits) << 16) |
                   t->dtype.lanes);
    key->push_back((static_cast<int64_t>(t->device.device_type) << 32) | t->device.device_id);
    key->push_back(t->ndim);
    key->insert(key->end(), t->shape, t->shape + t->ndim);
  }
  return true;
}

std::vector<int64_t> Integers(const ffi::Array<ffi::Any>& values) {
  std::vector<int64_t> out;
  out.reserve(values.size());
  for (const ffi::Any& v : values) out.push_back(v.cast<int64_t>());
  return out;
}

// The program of a registration, checked against the slots it may use.
std::shared_ptr<const Program> ParseProgram(const ffi::Array<ffi::Any>& spec, int n_inputs) {
  if (spec.size() != 7) TVM_FFI_THROW(ValueError) << "plan program: 7 parts expected, got " << spec.size();
  auto program = std::make_shared<Program>();
  program->n_inputs = n_inputs;
  for (const ffi::Any& a : spec[0].cast<ffi::Array<ffi::Any>>()) {
    std::vector<int64_t> v = Integers(a.cast<ffi::Array<ffi::Any>>());
    if (v.size() < 5 || v.size() != 5 + static_cast<size_t>(v[4]) || v[3] < 0 || v[3] >= n_inputs) {
      TVM_FFI_THROW(ValueError) << "plan program: bad allocation";
    }
    DLDataType dtype{static_cast<uint8_t>(v[0]), static_cast<uint8_t>(v[1]), static_cast<uint16_t>(v[2])};
    program->allocs.push_back(Alloc{dtype, static_cast<int>(v[3]), std::vector<int64_t>(v.begin() + 5, v.end())});
  }
  const int n_slots = n_inputs + static_cast<int>(program->allocs.size());
  for (const ffi::Any& f : spec[3].cast<ffi::Array<ffi::Any>>()) program->floats.push_back(f.cast<double>());
  ffi::Array<ffi::Any> kernels = spec[1].cast<ffi::Array<ffi::Any>>();
  ffi::Array<ffi::Any> launch_args = spec[2].cast<ffi::Array<ffi::Any>>();
  if (kernels.size() != launch_args.size()) TVM_FFI_THROW(ValueError) << "plan program: kernels and args differ";
  for (size_t i = 0; i < kernels.size(); ++i) {
    Launch launch{kernels[i].cast<ffi::Function>(), Integers(launch_args[i].cast<ffi::Array<ffi::Any>>())};
    if (launch.args.size() % 3 != 0 || launch.args.size() / 3 > kMaxArgs) {
      TVM_FFI_THROW(ValueError) << "plan program: launch " << i << " has a bad argument list";
    }
    for (size_t j = 0; j < launch.args.size(); j += 3) {
      int64_t kind = launch.args[j], a = launch.args[j + 1], b = launch.args[j + 2];
      bool ok = (kind == LITERAL_INT) || (kind == STREAM) ||
                (kind == LITERAL_FLOAT && a >= 0 && a < static_cast<int64_t>(program->floats.size())) ||
                (kind == ADDRESS && a >= 0 && a < n_slots);
      if (!ok) TVM_FFI_THROW(ValueError) << "plan program: launch " << i << " argument " << j / 3 << " is bad";
    }
    program->launches.push_back(std::move(launch));
  }
  for (int64_t s : Integers(spec[4].cast<ffi::Array<ffi::Any>>())) {
    if (s < 0 || s >= n_inputs) TVM_FFI_THROW(ValueError) << "plan program: aligned slot " << s << " is no input";
    program->aligned.push_back(static_cast<int>(s));
  }
  for (int64_t s : Integers(spec[5].cast<ffi::Array<ffi::Any>>())) {
    if (s < n_inputs || s >= n_slots) TVM_FFI_THROW(ValueError) << "plan program: result slot " << s << " is bad";
    program->results.push_back(static_cast<int>(s));
  }
  if (program->results.empty()) TVM_FFI_THROW(ValueError) << "plan program: no result";
  program->keep = spec[6].cast<ffi::Array<ffi::Any>>();
  return program;
}

void* Address(const DLTensor* t) { return static_cast<char*>(t->data) + t->byte_offset; }

// Runs `program` on the call's tensors; false (nothing launched) when an input breaks its alignment contract or an
// allocation's device slot holds None. An address asked of an absent tensor is an error (a program bug: the key
// tells present from absent tensors, so a program never sees a None where it was registered with a tensor).
bool RunProgram(const Program& program, const std::vector<const DLTensor*>& inputs, ffi::Any* result) {
  for (int s : program.aligned) {
    if (inputs[s] != nullptr && reinterpret_cast<uintptr_t>(Address(inputs[s])) % 16 != 0) return false;
  }
  std::vector<ffi::Tensor> allocated;
  allocated.reserve(program.allocs.size());
  for (const Alloc& a : program.allocs) {
    const DLTensor* like = inputs[a.device_slot];
    if (like == nullptr) return false;
    allocated.push_back(ffi::Tensor::FromEnvAlloc(TVMFFIEnvTensorAlloc, ffi::ShapeView(a.shape.data(), a.shape.size()),
                                                  a.dtype, like->device));
  }
  auto address = [&](int64_t slot) -> void* {
    if (slot < program.n_inputs) return inputs[slot] == nullptr ? nullptr : Address(inputs[slot]);
    return Address(allocated[slot - program.n_inputs].GetDLTensorPtr());
  };
  void* stream = nullptr;
  for (const DLTensor* t : inputs) {
    if (t != nullptr) {
      stream = TVMFFIEnvGetStream(t->device.device_type, t->device.device_id);
      break;
    }
  }
  ffi::AnyView packed[kMaxArgs];
  for (const Launch& launch : program.launches) {
    const size_t n = launch.args.size() / 3;
    for (size_t j = 0; j < n; ++j) {
      int64_t kind = launch.args[3 * j], a = launch.args[3 * j + 1], b = launch.args[3 * j + 2];
      switch (kind) {
        case LITERAL_INT:
          packed[j] = a;
          break;
        case LITERAL_FLOAT:
          packed[j] = program.floats[a];
          break;
        case STREAM:
          packed[j] = reinterpret_cast<int64_t>(stream);
          break;
        default: {  // ADDRESS
          void* p = address(a);
          if (p == nullptr) TVM_FFI_THROW(ValueError) << "plan program: an absent tensor's address was asked for";
          packed[j] = reinterpret_cast<int64_t>(static_cast<char*>(p) + b);
        }
      }
    }
    ffi::Any ignored;
    launch.kernel.CallPacked(packed, static_cast<int32_t>(n), &ignored);
  }
  pending_results.clear();
  for (size_t i = program.results.size(); i-- > 1;) {
    pending_results.push_back(allocated[program.results[i] - program.n_inputs]);
  }
  *result = allocated[program.results[0] - program.n_inputs];
  return true;
}

}  // namespace

extern "C" {

TVM_FFI_DLL_EXPORT int __tvm_ffi_cula_plan_call(void*, const TVMFFIAny* raw_args, int32_t num_args,
                                               TVMFFIAny* raw_result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  const ffi::AnyView* args = reinterpret_cast<const ffi::AnyView*>(raw_args);
  ffi::Any* result = reinterpret_cast<ffi::Any*>(raw_result);
  std::vector<int64_t> key;
  key.reserve(96);
  std::vector<const DLTensor*> tensors;
  tensors.reserve(16);
  *result = nullptr;
  pending_results.clear();
  std::shared_ptr<const Program> program;
  if (BuildKey(args, num_args, &key, &tensors)) {
    std::lock_guard<std::mutex> lock(table_mutex);
    auto it = table.find(key);
    if (it != table.end()) program = it->second;
  }
  bool ran = false;
  if (program != nullptr && static_cast<int>(tensors.size()) == program->n_inputs) {
    try {
      ran = RunProgram(*program, tensors, result);
    } catch (...) {
      program_failed = true;
      throw;
    }
  }
  if (!ran) {
    *result = nullptr;
    calls_declined.fetch_add(1, std::memory_order_relaxed);
    return 0;
  }
  calls_served.fetch_add(1, std::memory_order_relaxed);
  TVM_FFI_SAFE_CALL_END();
}

TVM_FFI_DLL_EXPORT int __tvm_ffi_cula_plan_register(void*, const TVMFFIAny* raw_args, int32_t num_args,
                                                   TVMFFIAny* raw_result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  const ffi::AnyView* args = reinterpret_cast<const ffi::AnyView*>(raw_args);
  ffi::Any* result = reinterpret_cast<ffi::Any*>(raw_result);
  *result = false;
  if (num_args < 1) TVM_FFI_THROW(TypeError) << "cula_plan_register(program, op, n_scalars, ...)";
  ffi::Array<ffi::Any> spec = args[0].cast<ffi::Array<ffi::Any>>();
  std::vector<int64_t> key;
  std::vector<const DLTensor*> tensors;
  if (!BuildKey(args + 1, num_args - 1, &key, &tensors)) return 0;
  std::shared_ptr<const Program> program = ParseProgram(spec, static_cast<int>(tensors.size()));
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    if (table.size() >= kMaxPlans) table.clear();
    table[std::move(key)] = std::move(program);
  }
  *result = true;
  TVM_FFI_SAFE_CALL_END();
}

TVM_FFI_DLL_EXPORT int __tvm_ffi_cula_plan_next_result(void*, const TVMFFIAny*, int32_t, TVMFFIAny* raw_result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  ffi::Any* result = reinterpret_cast<ffi::Any*>(raw_result);
  if (pending_results.empty()) {
    *result = nullptr;
  } else {
    *result = std::move(pending_results.back());
    pending_results.pop_back();
  }
  TVM_FFI_SAFE_CALL_END();
}

TVM_FFI_DLL_EXPORT int __tvm_ffi_cula_plan_clear(void*, const TVMFFIAny*, int32_t, TVMFFIAny* raw_result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  std::lock_guard<std::mutex> lock(table_mutex);
  table.clear();
  *reinterpret_cast<ffi::Any*>(raw_result) = nullptr;
  TVM_FFI_SAFE_CALL_END();
}

TVM_FFI_DLL_EXPORT int __tvm_ffi_cula_plan_stats(void*, const TVMFFIAny*, int32_t, TVMFFIAny* raw_result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  *reinterpret_cast<ffi::Any*>(raw_result) =
      ffi::Array<int64_t>{calls_served.load(std::memory_order_relaxed), calls_declined.load(std::memory_order_relaxed)};
  TVM_FFI_SAFE_CALL_END();
}

TVM_FFI_DLL_EXPORT int __tvm_ffi_cula_plan_take_failure(void*, const TVMFFIAny*, int32_t, TVMFFIAny* raw_result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  *reinterpret_cast<ffi::Any*>(raw_result) = program_failed;
  program_failed = false;
  TVM_FFI_SAFE_CALL_END();
}

TVM_FFI_DLL_EXPORT int __tvm_ffi_cula_plan_count(void*, const TVMFFIAny*, int32_t, TVMFFIAny* raw_result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  std::lock_guard<std::mutex> lock(table_mutex);
  *reinterpret_cast<ffi::Any*>(raw_result) = static_cast<int64_t>(table.size());
  TVM_FFI_SAFE_CALL_END();
}

}  // extern "C"
