// python/src/tensor.h: how the binding takes a tensor from Python.
//
// Every tensor argument arrives as a plain Python object and goes through take(), which
// imports it over DLPack (nanobind's ndarray caster with conversion off, so nothing is ever
// copied), then checks dtype, shape, strides and device, each with a message naming the
// argument and what was expected: TypeError for a wrong dtype or a non-tensor, ValueError for
// the rest. The C++ core below only ever sees raw pointers into the caller's memory.
//
// Dtypes without a NumPy equivalent have a raw stand-in of the same width, so NumPy callers can
// hold the bits: fp8 e4m3 may arrive as uint8, bf16 as uint16.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace moekit::py {

namespace nb = nanobind;

enum class DType { kFloat32, kFloat64, kBf16, kFp8, kInt32, kInt64 };
enum class Device { kCpu, kCuda };

const char* dtype_name(DType d);

// A named dimension of an expected shape: value < 0 means "any" (the label still prints).
struct Dim {
  int64_t value;
  const char* label;
};

struct Tensor {
  nb::ndarray<nb::ro> array;  // keeps the DLPack import alive for the call
  std::string name;
  void* data = nullptr;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements
  DType dtype = DType::kFloat32;
  Device device = Device::kCpu;
  int device_id = 0;

  int ndim() const { return int(shape.size()); }
  int64_t dim(int i) const { return shape[i < 0 ? shape.size() + i : i]; }
  int64_t numel() const;
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

enum class Access { kRead, kWrite };

// Imports `obj` as the argument `name`; its dtype must be one of `dtypes`. kWrite also
// requires a writable array (a read-only NumPy array is refused, never copied).
Tensor take(nb::handle obj, const char* name, std::initializer_list<DType> dtypes, Access access = Access::kRead);

// Shape must match `dims` (any where value < 0). Messages print the labels, e.g.
// "a_scales must have shape [E_loc=4, M_max=?, K/128=2], got [4, 8, 3]".
void expect_shape(const Tensor& t, const std::vector<Dim>& dims);
// Row-major and dense.
void expect_contiguous(const Tensor& t);
// Exactly these strides (in elements), for the MN-major scale tensors; `hint` says how to make one.
void expect_strides(const Tensor& t, const std::vector<int64_t>& strides, const char* hint);
// All on one device (the first one's), which must be the CPU or, when built with CUDA, a GPU.
Device expect_same_device(std::initializer_list<const Tensor*> tensors);

// Row-major strides of `shape`.
std::vector<int64_t> dense_strides(const std::vector<int64_t>& shape);
// The strides of an MN-major scale tensor of logical shape [..., M, K/128]: the memory is
// layout.h's [..., K/128, M] (DeepGEMM's and DeepEP's convention for activation scales).
std::vector<int64_t> mn_major_strides(const std::vector<int64_t>& shape);
void expect_mn_major(const Tensor& t);

// Raised when a CUDA tensor reaches a function that has no CUDA path in this build.
[[noreturn]] void no_cuda_path(const char* function);

#if defined(MOEKIT_WITH_CUDA)
// Runs on the tensors' device, restoring the caller's current device afterwards.
struct DeviceGuard {
  int previous = 0;
  explicit DeviceGuard(int device);
  ~DeviceGuard();
};
#endif

}  // namespace moekit::py
