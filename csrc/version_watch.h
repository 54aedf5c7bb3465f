// VersionWatch: whether any of a list of tensors changed since it last looked, in one call.
// A tensor changed when its version counter moved (an in-place write through it or any view
// of it) or its data address did (`param.data = ...` gives the same TensorImpl new storage).
// PackedSet (swiftkern/packed_weights.py) asks before every forward whether its packed copies
// are still current: 211 weights for SmolLM2, ~71 us as Python tuples, one loop here.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace swiftkern {

class VersionWatch {
 public:
  explicit VersionWatch(std::vector<at::Tensor> tensors) : tensors_(std::move(tensors)) { look(); }

  // Whether a tensor's version or data address moved since the last look()
  bool changed() const {
    for (size_t i = 0; i < tensors_.size(); ++i)
      if (seen_[i] != state(tensors_[i])) return true;
    return false;
  }

  // Remember every tensor's version and data address as they are now
  void look() {
    seen_.clear();
    for (const at::Tensor& t : tensors_) seen_.push_back(state(t));
  }

 private:
  static std::pair<int64_t, const void*> state(const at::Tensor& t) { return {t._version(), t.const_data_ptr()}; }

  std::vector<at::Tensor> tensors_;
  std::vector<std::pair<int64_t, const void*>> seen_;
};

}  // namespace swiftkern
