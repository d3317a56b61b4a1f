// The emulated NPU's ATen kernels: tensor creation in device memory, views that alias it (a view
// through the CPU fallback would be a copy, and writes through it would be lost), copies between
// host and device, random ops drawing from the device's generator, autocast's casts, and a
// boxed CPU fallback for every other op (inputs copied to the host, the CPU kernel run, results
// copied back).
#include "npu.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

namespace nbnpu {
namespace {

constexpr c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);

// Inside the CPU fallback: its copies to and from the host are the emulation's, not the user's
// (a real device runs the op where its data is), so they are no synchronisations.
thread_local int t_in_fallback = 0;

struct InFallback {
  InFallback() { ++t_in_fallback; }
  ~InFallback() { --t_in_fallback; }
};

at::Tensor on_host(const at::Tensor& t) {      // the same memory, seen as a CPU tensor
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> device, std::optional<bool> pin,
                               std::optional<c10::MemoryFormat> memory_format) {
  const auto d = c10::device_or_default(device);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "npu: only strided tensors");
  const c10::DeviceGuard guard(d);
  return at::detail::empty_generic(size, c10::GetAllocator(c10::DeviceType::PrivateUse1), kKeys,
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin) {
  const auto d = c10::device_or_default(device);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "npu: only strided tensors");
  const c10::DeviceGuard guard(d);
  return at::detail::empty_strided_generic(
      size, stride, c10::GetAllocator(c10::DeviceType::PrivateUse1), kKeys,
      c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  return at::native::view(self, size);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size,
                         c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  const c10::DeviceGuard guard(self.device());    // new memory on self's card, not the current
  return at::native::resize_(self, size, memory_format);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  // the host waits for the device: a blocking copy from it (a real device would synchronise)
  if (dst.is_cpu() && self.is_privateuseone() && !non_blocking && !t_in_fallback)
    count_synchronization();
  // host memory on both sides: a device-to-device, host-to-device or device-to-host copy is a
  // host copy between the two views (converting dtypes and broadcasting as copy_ does)
  at::Tensor to = dst.is_cpu() ? dst : on_host(dst);
  const at::Tensor from = self.is_cpu() ? self : on_host(self);
  at::native::copy_(to, from, non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  const c10::DeviceGuard guard(dst.device());     // (a fallback's output: arange on npu:1, e.g.)
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  if (!t_in_fallback) count_synchronization();   // .item(): the host reads the device's value
  return at::native::_local_scalar_dense_cpu(on_host(self));
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_storage(at::Tensor& self, at::Storage source) {
  return at::native::set_(self, source);
}

at::Tensor& set_storage_offset(at::Tensor& self, at::Storage source, int64_t offset,
                               c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset, size, stride);
}

// `module.to("npu")` swaps each parameter's data in place (the optimizer keeps its parameters),
// as for CUDA: dense host and device tensors are compatible
bool compatible_shallow_copy(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.is_cpu() || t.is_privateuseone());
  };
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set()) ||
         (dense(self) && dense(from));
}

void record_stream(at::Tensor&, c10::Stream) {}     // one stream per device: nothing to record

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  InFallback inside;
  at::native::cpu_fallback(op, stack);
}

// A random op: the CPU kernel runs through the fallback, drawing from the device's generator,
// never the CPU's. An op with a generator argument gets a private CPU generator holding the
// device generator's state (written back after); one without (native_dropout) runs with the
// CPU's default generator holding that state for the duration, all such ops one at a time.
std::mutex g_swap;

// a generator's whole state (the engine and the cached normal samples) into another
void copy_state(at::CPUGeneratorImpl* from, at::CPUGeneratorImpl* into) {
  into->set_engine(from->engine());
  into->set_next_float_normal_sample(from->next_float_normal_sample());
  into->set_next_double_normal_sample(from->next_double_normal_sample());
}

void random_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto n = op.schema().arguments().size();
  const auto base = stack->size() - n;
  at::Generator device_gen;
  c10::DeviceIndex idx = -1;
  std::optional<size_t> slot;
  for (size_t i = 0; i < n; ++i) {
    auto& v = (*stack)[base + i];
    if (op.schema().arguments()[i].type()->str().find("Generator") != std::string::npos) {
      slot = base + i;
      if (v.isGenerator() && v.toGenerator().device().is_privateuseone())
        device_gen = v.toGenerator();
    } else if (idx < 0 && v.isTensor() && v.toTensor().defined() &&
               v.toTensor().device().is_privateuseone()) {
      idx = v.toTensor().device().index();
    }
  }
  if (!device_gen.defined()) device_gen = default_generator(idx);
  auto* mine = at::check_generator<Generator>(device_gen);
  std::lock_guard<std::mutex> hold(device_gen.mutex());
  InFallback inside;
  if (slot) {
    at::Generator own = at::make_generator<at::CPUGeneratorImpl>();
    auto* cpu = at::check_generator<at::CPUGeneratorImpl>(own);
    copy_state(mine, cpu);
    (*stack)[*slot] = c10::IValue(own);
    at::native::cpu_fallback(op, stack);
    copy_state(cpu, mine);
    return;
  }
  std::lock_guard<std::mutex> one_at_a_time(g_swap);
  at::Generator host_gen = at::detail::getDefaultCPUGenerator();
  auto* cpu = at::check_generator<at::CPUGeneratorImpl>(host_gen);
  at::Generator saved = host_gen.clone();
  {
    std::lock_guard<std::mutex> g(host_gen.mutex());
    copy_state(mine, cpu);
  }
  auto put_back = [&] {
    std::lock_guard<std::mutex> g(host_gen.mutex());
    copy_state(cpu, mine);
    copy_state(at::check_generator<at::CPUGeneratorImpl>(saved), cpu);
  };
  try {
    at::native::cpu_fallback(op, stack);
  } catch (...) {
    put_back();
    throw;
  }
  put_back();
}

}  // namespace
}  // namespace nbnpu

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace nbnpu;
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
  m.impl("resize_", resize_);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_.source_Storage", set_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
  m.impl("record_stream", record_stream);
  m.impl("_has_compatible_shallow_copy_type", compatible_shallow_copy);
  for (const char* name :
       {"uniform_", "normal_", "normal.Tensor_float", "normal.float_Tensor",
        "normal.Tensor_Tensor", "bernoulli_.Tensor", "bernoulli_.float", "bernoulli.p",
        "bernoulli", "random_", "random_.from", "random_.to", "exponential_", "geometric_",
        "log_normal_", "cauchy_", "multinomial", "native_dropout", "randperm.generator_out",
        "poisson", "_standard_gamma", "rrelu_with_noise"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&nbnpu::random_fallback>());
  }
  // Ops with a CPU kernel and a different CompositeExplicitAutograd one, which a backend without
  // its own kernel gets in place of the fallback: their numerics differ from the CPU's in the
  // last bits (layer norm's math version, e.g.), so they too run the CPU's kernel.
  for (const char* name : {"native_layer_norm", "native_group_norm", "addr", "addr.out",
                           "linalg__powsum"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&nbnpu::fallback>());
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&nbnpu::fallback>());
}

// autocast on the device: matrix products in the autocast dtype, everything else as it comes
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  using at::autocast::CastPolicy;
  KERNEL_PRIVATEUSEONE(mm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(addmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(bmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(baddbmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(matmul, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(linear, lower_precision_fp)
}
