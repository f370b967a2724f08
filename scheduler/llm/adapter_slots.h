// The model's LoRA adapter slots as an LRU cache (multi-LoRA serving, S-LoRA's adapter
// paging): which adapter each slot holds, how many running sequences pin it, and which slot
// to reuse when an adapter that is not resident is needed.
//
// A sequence of an adapter pins the adapter's slot from its admission until it ends; a slot
// with pins is never reused. Adapters are told apart by identity (the pointer), not by name,
// so an adapter removed and added again under its name never matches the old slot.
//
// Thread-safety: none; the batcher's loop thread owns it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "models/lora/lora_config.h"

namespace kiln {

class AdapterSlots {
 public:
  explicit AdapterSlots(int32_t num_slots);

  struct Grant {
    int32_t slot = -1;
    bool load = false;  // the slot holds another adapter (or none): the caller uploads it
  };
  // Pins a slot for `adapter`: the slot that holds it, else an empty one, else the least
  // recently used one without pins. nullopt when every slot is pinned by other adapters (the
  // sequence waits). REQUIRES: adapter != nullptr.
  std::optional<Grant> Acquire(const std::shared_ptr<const models::LoraAdapter>& adapter);
  // Drops one pin of `slot` (its sequence ended); the adapter stays resident.
  void Release(int32_t slot);
  // Drops one pin of `slot` and forgets its adapter (its upload failed).
  void Clear(int32_t slot);

  int32_t num_slots() const { return static_cast<int32_t>(slots_.size()); }
  int32_t num_loaded() const;  // slots holding an adapter
  int32_t pins(int32_t slot) const { return slots_[slot].pins; }

 private:
  struct Slot {
    std::shared_ptr<const models::LoraAdapter> adapter;  // null: empty
    int32_t pins = 0;
    uint64_t last_used = 0;
  };
  std::vector<Slot> slots_;
  uint64_t clock_ = 0;
};

}  // namespace kiln
