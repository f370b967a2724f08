#include "scheduler/llm/adapter_slots.h"

#include "engine/base/status.h"

namespace kiln {

AdapterSlots::AdapterSlots(int32_t num_slots) : slots_(static_cast<size_t>(num_slots)) {}

std::optional<AdapterSlots::Grant> AdapterSlots::Acquire(
    const std::shared_ptr<const models::LoraAdapter>& adapter) {
  KILN_CHECK(adapter != nullptr, "AdapterSlots::Acquire: null adapter");
  int32_t victim = -1;
  for (int32_t i = 0; i < num_slots(); ++i) {
    Slot& s = slots_[i];
    if (s.adapter == adapter) {
      ++s.pins;
      s.last_used = ++clock_;
      return Grant{i, false};
    }
    if (s.pins > 0) continue;
    // Empty slots first, then the least recently used.
    if (victim < 0 || (s.adapter == nullptr && slots_[victim].adapter != nullptr) ||
        ((s.adapter == nullptr) == (slots_[victim].adapter == nullptr) &&
         s.last_used < slots_[victim].last_used)) {
      victim = i;
    }
  }
  if (victim < 0) return std::nullopt;
  Slot& s = slots_[victim];
  s.adapter = adapter;
  s.pins = 1;
  s.last_used = ++clock_;
  return Grant{victim, true};
}

void AdapterSlots::Release(int32_t slot) {
  KILN_CHECK(slot >= 0 && slot < num_slots() && slots_[slot].pins > 0,
             "AdapterSlots::Release: slot without pins");
  --slots_[slot].pins;
}

void AdapterSlots::Clear(int32_t slot) {
  Release(slot);
  slots_[slot].adapter = nullptr;
}

int32_t AdapterSlots::num_loaded() const {
  int32_t n = 0;
  for (const Slot& s : slots_) n += s.adapter != nullptr;
  return n;
}

}  // namespace kiln
