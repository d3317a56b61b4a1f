// The emulated NPU's runtime: its memory (host memory, one allocator per process), its device
// guard (current device, one no-op stream per device), its generators, the hooks torch asks a
// PrivateUse1 backend for, pinned host memory, and the functions the Python device module calls.
// Everything an accelerator plug-in registers, with the host standing in for the card.
#include "npu.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace nbnpu {

namespace {

// The current device, per thread as on CUDA (the autograd engine's device threads set theirs
// without changing the caller's).
thread_local int g_current = 0;
std::atomic<int64_t> g_syncs{0};

// Device memory: host memory, each block remembering the card it was allocated on.
struct DeviceMemory final : c10::Allocator {
  std::mutex lock;
  std::unordered_map<void*, c10::DeviceIndex> owner;

  static void release(void* ptr);

  c10::DataPtr allocate(size_t n) override {
    void* p = n ? std::aligned_alloc(64, (n + 63) / 64 * 64) : nullptr;
    TORCH_CHECK(!n || p, "npu: out of memory allocating ", n, " bytes");
    const auto idx = static_cast<c10::DeviceIndex>(g_current);
    if (p) {
      std::lock_guard<std::mutex> g(lock);
      owner[p] = idx;
    }
    return {p, p, &release, c10::Device(c10::DeviceType::PrivateUse1, idx)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

// Never destroyed: tensors freed during the interpreter's exit still release through them
// (a destroyed mutex there ends the process with std::terminate).
DeviceMemory& g_device_memory = *new DeviceMemory;

void DeviceMemory::release(void* ptr) {
  if (!ptr) return;
  {
    std::lock_guard<std::mutex> g(g_device_memory.lock);
    g_device_memory.owner.erase(ptr);
  }
  std::free(ptr);
}

// Pinned ("page-locked") host memory: plain host memory that the hooks recognise as pinned.
struct PinnedMemory final : c10::Allocator {
  std::mutex lock;
  std::unordered_map<void*, size_t> blocks;

  static void release(void* ptr);

  c10::DataPtr allocate(size_t n) override {
    void* p = n ? std::aligned_alloc(64, (n + 63) / 64 * 64) : nullptr;
    TORCH_CHECK(!n || p, "npu: out of pinned memory allocating ", n, " bytes");
    if (p) {
      std::lock_guard<std::mutex> g(lock);
      blocks[p] = n;
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool pinned(const void* p) {
    std::lock_guard<std::mutex> g(lock);
    auto* c = static_cast<const char*>(p);
    for (const auto& [base, n] : blocks) {
      auto* b = static_cast<const char*>(base);
      if (c >= b && c < b + (n ? n : 1)) return true;
    }
    return false;
  }
};

PinnedMemory& g_pinned_memory = *new PinnedMemory;   // never destroyed, as above

void PinnedMemory::release(void* ptr) {
  if (!ptr) return;
  {
    std::lock_guard<std::mutex> g(g_pinned_memory.lock);
    g_pinned_memory.blocks.erase(ptr);
  }
  std::free(ptr);
}

c10::DeviceIndex checked(c10::DeviceIndex idx) {
  if (idx < 0) return static_cast<c10::DeviceIndex>(g_current);
  TORCH_CHECK(idx < kDevices, "npu: device index ", int(idx), " out of range (", kDevices,
              " devices)");
  return idx;
}

// The device guard: a current device, and on each device one stream (the default) on which
// everything has always completed: recording, waiting for and querying events are no-ops.
struct Guard final : c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType T = c10::DeviceType::PrivateUse1;
  c10::DeviceType type() const override { return T; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(T, static_cast<c10::DeviceIndex>(g_current));
  }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == T, "npu: not an npu device: ", d);
    g_current = checked(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < kDevices) g_current = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(T, checked(d.index())));
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return getStream(d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getStream(d); }
  c10::Stream getNewStream(c10::Device d, int) const override { return getStream(d); }
  c10::Stream exchangeStream(c10::Stream s) const override {   // the one stream: it was
    return getStream(s.device());                                 // current already
  }
  c10::DeviceIndex deviceCount() const noexcept override { return kDevices; }
  void record(void** event, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    if (event && !*event) *event = reinterpret_cast<void*>(1);    // recorded: complete
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override { g_syncs++; }
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override { g_syncs++; }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex idx) const override {
    return default_generator(idx);
  }
  at::Generator getNewGenerator(c10::DeviceIndex idx) const override {
    return at::make_generator<Generator>(checked(idx));
  }
  at::Device getDeviceFromPtr(void* data) const override {
    std::lock_guard<std::mutex> g(g_device_memory.lock);
    auto it = g_device_memory.owner.find(data);
    TORCH_CHECK(it != g_device_memory.owner.end(), "npu: not the start of npu memory");
    return c10::Device(c10::DeviceType::PrivateUse1, it->second);
  }
  bool isPinnedPtr(const void* data) const override { return g_pinned_memory.pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_memory; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kDevices; }
  void setCurrentDevice(c10::DeviceIndex idx) const override { g_current = checked(idx); }
  c10::DeviceIndex getCurrentDevice() const override {
    return static_cast<c10::DeviceIndex>(g_current);
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex idx) const override {
    auto old = getCurrentDevice();
    setCurrentDevice(idx);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex idx) const override {
    return exchangeDevice(idx);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t n) const override {
    const c10::DeviceGuard guard(storage.device());    // the storage's card, not the current
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), n);
  }
};

Hooks g_hooks;

const bool g_registered = [] {
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &g_device_memory);
  at::RegisterPrivateUse1HooksInterface(&g_hooks);
  return true;
}();

}  // namespace

void count_synchronization() { g_syncs++; }

c10::DeviceType Generator::device_type() { return c10::DeviceType::PrivateUse1; }

const at::Generator& default_generator(c10::DeviceIndex idx) {
  static auto& gens = *new std::vector<at::Generator>([] {   // never destroyed, as above
    std::vector<at::Generator> out;
    for (c10::DeviceIndex i = 0; i < kDevices; ++i) {
      out.push_back(at::make_generator<Generator>(i));
      out.back().seed();
    }
    return out;
  }());
  return gens[checked(idx)];
}

}  // namespace nbnpu

namespace {

at::Generator gen(int64_t idx) {
  return nbnpu::default_generator(static_cast<c10::DeviceIndex>(idx));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("DEVICES") = nbnpu::kDevices;
  m.def("current_device", [] { return nbnpu::g_current; });
  m.def("set_device", [](int idx) {
    nbnpu::g_current = nbnpu::checked(static_cast<c10::DeviceIndex>(idx));
  });
  m.def("synchronize", [] { nbnpu::g_syncs++; });
  m.def("synchronizations", [] { return nbnpu::g_syncs.load(); });
  m.def("manual_seed", [](int64_t idx, uint64_t seed) {
    auto g = gen(idx);
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(seed);
  });
  m.def("seed", [](int64_t idx) {
    auto g = gen(idx);
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.seed();
  });
  m.def("initial_seed", [](int64_t idx) { return gen(idx).current_seed(); });
  m.def("get_rng_state", [](int64_t idx) {
    auto g = gen(idx);
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.get_state();
  });
  m.def("set_rng_state", [](int64_t idx, const at::Tensor& state) {
    auto g = gen(idx);
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  });
  m.def("default_generator", [](int64_t idx) { return gen(idx); });
  m.def("is_pinned_ptr", [](uintptr_t p) {
    return nbnpu::g_pinned_memory.pinned(reinterpret_cast<void*>(p));
  });
}
