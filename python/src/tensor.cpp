#include "tensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#if defined(MOEKIT_WITH_CUDA)
#include "moekit/cuda_check.h"
#endif

namespace moekit::py {

namespace {

namespace dl = nb::dlpack;

bool is(const dl::dtype& t, dl::dtype_code code, int bits) { return t.code == uint8_t(code) && t.bits == bits && t.lanes == 1; }

// What a DLPack dtype may stand for, given what the argument wants.
bool matches(const dl::dtype& t, DType want) {
  switch (want) {
    case DType::kFloat32: return is(t, dl::dtype_code::Float, 32);
    case DType::kFloat64: return is(t, dl::dtype_code::Float, 64);
    case DType::kBf16: return is(t, dl::dtype_code::Bfloat, 16) || is(t, dl::dtype_code::UInt, 16);
    case DType::kFp8: return is(t, dl::dtype_code::Float8_E4M3FN, 8) || is(t, dl::dtype_code::UInt, 8);
    case DType::kInt32: return is(t, dl::dtype_code::Int, 32);
    case DType::kInt64: return is(t, dl::dtype_code::Int, 64);
  }
  return false;
}

std::string describe(const dl::dtype& t) {
  const char* kind = "?";
  switch (dl::dtype_code(t.code)) {
    case dl::dtype_code::Int: kind = "int"; break;
    case dl::dtype_code::UInt: kind = "uint"; break;
    case dl::dtype_code::Float: kind = "float"; break;
    case dl::dtype_code::Bfloat: kind = "bfloat"; break;
    case dl::dtype_code::Bool: kind = "bool"; break;
    case dl::dtype_code::Complex: kind = "complex"; break;
    case dl::dtype_code::Float8_E4M3FN: return "float8_e4m3fn";
    case dl::dtype_code::Float8_E5M2: return "float8_e5m2";
    default: return fmt::format("DLPack dtype code {} with {} bits", int(t.code), int(t.bits));
  }
  return fmt::format("{}{}", kind, int(t.bits));
}

std::string format_dims(const std::vector<Dim>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += dims[i].value < 0 ? fmt::format("{}=any", dims[i].label) : fmt::format("{}={}", dims[i].label, dims[i].value);
  }
  return s + "]";
}

}  // namespace

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kBf16: return "bfloat16 (or uint16 holding bf16 bits)";
    case DType::kFp8: return "float8_e4m3fn (or uint8 holding e4m3 bytes)";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "?";
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::vector<int64_t> dense_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

std::vector<int64_t> mn_major_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> swapped = shape;
  size_t n = shape.size();
  std::swap(swapped[n - 1], swapped[n - 2]);
  std::vector<int64_t> strides = dense_strides(swapped);
  std::swap(strides[n - 1], strides[n - 2]);
  return strides;
}

void expect_mn_major(const Tensor& t) {
  expect_strides(t, mn_major_strides(t.shape),
                 "activation scales are MN-major (layout.h): allocate [..., K/128, M] and pass "
                 ".transpose(-1, -2) (PyTorch) or .swapaxes(-1, -2) (NumPy)");
}

Tensor take(nb::handle obj, const char* name, std::initializer_list<DType> dtypes, Access access) {
  Tensor t;
  t.name = name;
  // Conversion off: a caster that would have to copy (or a list, or a scalar) fails instead.
  if (!nb::try_cast(obj, t.array, /*convert=*/false)) {
    std::string type = nb::type_name(obj.type()).c_str();
    throw nb::type_error(fmt::format("{} must be a tensor that supports DLPack (NumPy, PyTorch, CuPy ...), got {}", name, type).c_str());
  }
  if (access == Access::kWrite) {
    nb::ndarray<> writable;
    if (!nb::try_cast(obj, writable, false))
      throw nb::value_error(fmt::format("{} is written by moekit and must be writable, got a read-only array", name).c_str());
  }
  const nb::ndarray<nb::ro>& a = t.array;
  bool ok = false;
  for (DType d : dtypes) {
    if (matches(a.dtype(), d)) {
      t.dtype = d;
      ok = true;
      break;
    }
  }
  if (!ok) {
    std::string want;
    for (DType d : dtypes) want += (want.empty() ? "" : " or ") + std::string(dtype_name(d));
    throw nb::type_error(fmt::format("{} must have dtype {}, got {}", name, want, describe(a.dtype())).c_str());
  }
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  for (size_t i = 0; i < a.ndim(); ++i) {
    t.shape.push_back(int64_t(a.shape(i)));
    t.strides.push_back(a.stride(i));
  }
  switch (a.device_type()) {
    case nb::device::cpu::value: t.device = Device::kCpu; break;
    case nb::device::cuda::value: t.device = Device::kCuda; break;
    default:
      throw nb::value_error(fmt::format("{} must live on the CPU or a CUDA GPU, got DLPack device type {}", name, a.device_type()).c_str());
  }
  t.device_id = a.device_id();
  return t;
}

void expect_shape(const Tensor& t, const std::vector<Dim>& dims) {
  bool ok = t.shape.size() == dims.size();
  for (size_t i = 0; ok && i < dims.size(); ++i) ok = dims[i].value < 0 || dims[i].value == t.shape[i];
  if (!ok)
    throw nb::value_error(fmt::format("{} must have shape {}, got [{}]", t.name, format_dims(dims), fmt::join(t.shape, ", ")).c_str());
}

void expect_contiguous(const Tensor& t) {
  std::vector<int64_t> dense = dense_strides(t.shape);
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (t.shape[i] > 1 && t.strides[i] != dense[i])
      throw nb::value_error(fmt::format("{} must be contiguous (row-major strides [{}]), got strides [{}]; pass .contiguous() "
                                        "or np.ascontiguousarray (moekit never copies)",
                                        t.name, fmt::join(dense, ", "), fmt::join(t.strides, ", "))
                                .c_str());
  }
}

void expect_strides(const Tensor& t, const std::vector<int64_t>& strides, const char* hint) {
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (t.shape[i] > 1 && t.strides[i] != strides[i])
      throw nb::value_error(fmt::format("{} must have strides [{}], got [{}]: {}", t.name, fmt::join(strides, ", "),
                                        fmt::join(t.strides, ", "), hint)
                                .c_str());
  }
}

Device expect_same_device(std::initializer_list<const Tensor*> tensors) {
  const Tensor* first = *tensors.begin();
  for (const Tensor* t : tensors) {
    if (t->device != first->device || t->device_id != first->device_id) {
      auto where = [](const Tensor* x) { return x->device == Device::kCpu ? std::string("cpu") : fmt::format("cuda:{}", x->device_id); };
      throw nb::value_error(fmt::format("{} is on {} but {} is on {}: every tensor of one call must be on the same device",
                                        t->name, where(t), first->name, where(first))
                                .c_str());
    }
  }
#if !defined(MOEKIT_WITH_CUDA)
  if (first->device == Device::kCuda)
    throw nb::value_error(fmt::format("{} is on a CUDA GPU, but this moekit was built without CUDA (MOEKIT_WITH_CUDA=OFF): "
                                      "pass CPU tensors",
                                      first->name)
                              .c_str());
#endif
  return first->device;
}

void no_cuda_path(const char* function) {
  throw nb::value_error(fmt::format("{} has no CUDA path yet: pass CPU tensors", function).c_str());
}

#if defined(MOEKIT_WITH_CUDA)
DeviceGuard::DeviceGuard(int device) {
  MOEKIT_CUDA_CHECK(cudaGetDevice(&previous));
  if (previous != device) MOEKIT_CUDA_CHECK(cudaSetDevice(device));
}
DeviceGuard::~DeviceGuard() { cudaSetDevice(previous); }
#endif

}  // namespace moekit::py
