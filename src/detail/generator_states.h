// generator_states.h — the default random generators' states, to run a step again.
//
// A replayed step must draw the same numbers: dropout masks on the CPU come
// from the CPU generator, on a GPU from that device's CUDA generator (its
// seed and Philox offset).
#pragma once

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <mutex>
#include <vector>

namespace nanguard::detail {

/// The CPU generator's state and each CUDA device's.
struct generator_states {
  at::Tensor cpu;                ///< uint8, as Generator::get_state
  std::vector<at::Tensor> cuda;  ///< one per CUDA device; none where no GPU is found
};

inline at::Tensor state_of(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

inline void restore(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

/// The default generators' states now.
inline generator_states capture_generators() {
  generator_states s;
  s.cpu = state_of(at::detail::getDefaultCPUGenerator());
  if (at::hasCUDA())
    for (size_t i = 0; i < at::getNumGPUs(); ++i)
      s.cuda.push_back(state_of(at::globalContext().defaultGenerator(at::Device(at::kCUDA, c10::DeviceIndex(i)))));
  return s;
}

/// Sets the default generators back to `s` (the CUDA ones `s` holds).
inline void restore_generators(const generator_states& s) {
  restore(at::detail::getDefaultCPUGenerator(), s.cpu);
  for (size_t i = 0; i < s.cuda.size(); ++i)
    restore(at::globalContext().defaultGenerator(at::Device(at::kCUDA, c10::DeviceIndex(i))), s.cuda[i]);
}

}  // namespace nanguard::detail
