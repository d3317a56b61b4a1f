// Shared by runtime.cpp and kernels.cpp: the emulated NPU's device count and its generators.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

namespace nbnpu {

constexpr c10::DeviceIndex kDevices = 2;     // npu:0 and npu:1

// A device's generator: the CPU's Mersenne twister (its state, seed and offset behave the same),
// owned by one npu device. Random kernels on the device draw from it, never from the CPU's.
struct Generator : at::CPUGeneratorImpl {
  explicit Generator(c10::DeviceIndex idx) {
    device_ = c10::Device(c10::DeviceType::PrivateUse1, idx);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
  static c10::DeviceType device_type();
};

const at::Generator& default_generator(c10::DeviceIndex idx);

// Counts each time the host waits for the device: an explicit synchronisation, a value read
// (`.item()`), a blocking copy to the host (what a real device would wait for).
void count_synchronization();

}  // namespace nbnpu
