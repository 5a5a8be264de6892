// hybridmem CPU allocator meter: a c10::Allocator that wraps the CPU allocator and counts bytes.
//
// Built and loaded by hybridmem/cpumeter.py (plain C ABI, ctypes; c10 headers only, no pybind11).
//
// Design
// - MeterAllocator::allocate(n) calls the allocator that was current at install time ("inner") and
//   returns a DataPtr whose data pointer is the inner one's and whose context is the *same* pointer
//   (ctx == data), with meter_delete as deleter. The inner DataPtr (which owns the memory and knows
//   how to free it), n and the allocation serial live in a table keyed by the data pointer. Keeping
//   ctx == data makes the DataPtr "simple" (is_simple_data_ptr holds, copy-on-write lazy clones work)
//   and lets raw_deleter() honestly return meter_delete, so raw_allocate/raw_deallocate work too.
// - meter_delete(ptr) removes the entry, subtracts n and destroys the inner DataPtr (freeing through
//   the inner allocator's deleter). It does not depend on the allocator being installed: frees of
//   memory allocated while installed are counted after uninstall too. Frees of memory allocated
//   before install (or by another allocator) never reach it and are not seen.
// - The allocator is process-global: allocations on every thread are counted.
// - Every global here is heap-allocated and never destroyed, and the library is never unloaded:
//   deleters of live tensors (including tensors torch frees during interpreter shutdown, after this
//   library's static destructors would have run) point into it.
// - The raw interface is used for real: ideep/oneDNN allocate their buffers with
//   GetCPUAllocator()->raw_allocate and free them with GetCPUAllocator()->raw_deallocate, i.e.
//   through whatever allocator is current *at the free*. A buffer raw-allocated before install and
//   freed while installed reaches meter_delete unknown: it is passed to the wrapped allocator's raw
//   deleter (counted in hm_orphan_frees). A buffer raw-allocated while installed and freed after
//   uninstall is freed by the other allocator without us knowing: its entry stays (current bytes
//   overstated, lookup still answers for its address) until the address is allocated through the
//   meter again, when the entry is dropped without a second free (counted in hm_stale_entries).
// - Zero-byte requests are passed through to the inner allocator unchanged (not counted, no
//   serial): allocators may return one shared sentinel pointer for them, which cannot be a key.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>

#define HM_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

struct Entry {
  c10::DataPtr inner;  // owns the memory; destroying it frees through the inner allocator
  int64_t bytes = 0;
  int64_t serial = 0;
};

struct State {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> serial{0};      // number of counted allocations so far (monotonic)
  std::atomic<int64_t> orphan_frees{0};   // meter_delete on a pointer it did not allocate
  std::atomic<int64_t> stale_entries{0};  // allocations freed behind our back (see allocate)
  std::mutex table_mutex;
  std::unordered_map<void*, Entry> table;  // live counted allocations, by data pointer
  std::mutex install_mutex;
  // The allocator wrapped by the latest install; read by allocate() on any thread, never reset to
  // null (a storage made while installed keeps using the meter for resizes after uninstall).
  std::atomic<c10::Allocator*> inner{nullptr};
  c10::Allocator* previous = nullptr;  // what GetCPUAllocator() returned before install
  int priority = -1;                   // priority our SetCPUAllocator used (-1: not installed)
};

// Leaked on purpose (see the header comment).
State& state() {
  static State* s = new State();
  return *s;
}

void meter_delete(void* ptr) noexcept {
  if (ptr == nullptr) {
    return;  // raw_deallocate(nullptr) (e.g. ideep frees null pointers): a no-op, like free()
  }
  State& s = state();
  c10::DataPtr inner;
  int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(s.table_mutex);
    auto it = s.table.find(ptr);
    if (it != s.table.end()) {
      inner = std::move(it->second.inner);
      bytes = it->second.bytes;
      s.table.erase(it);
    }
  }
  if (bytes == 0) {
    // Not ours: memory raw_allocate'd through the wrapped allocator before install and handed to
    // the *current* allocator's raw_deallocate after install (ideep/oneDNN free this way). Free it
    // as the wrapped allocator would have; leak it if that allocator has no raw interface.
    s.orphan_frees.fetch_add(1, std::memory_order_relaxed);
    c10::Allocator* a = s.inner.load(std::memory_order_acquire);
    c10::DeleterFnPtr d = a != nullptr ? a->raw_deleter() : nullptr;
    if (d != nullptr && d != &meter_delete) {
      d(ptr);
    }
    return;
  }
  s.current.fetch_sub(bytes, std::memory_order_relaxed);
  // `inner` is destroyed here, outside the lock: it frees through the inner allocator's deleter.
}

struct MeterAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    State& s = state();
    c10::Allocator* inner = s.inner.load(std::memory_order_acquire);
    c10::DataPtr dp = inner->allocate(n);
    void* data = dp.get();
    if (n == 0 || data == nullptr) {
      return dp;
    }
    const c10::Device device = dp.device();
    const int64_t bytes = static_cast<int64_t>(n);
    const int64_t serial = s.serial.fetch_add(1, std::memory_order_relaxed) + 1;
    int64_t stale = 0;
    {
      std::lock_guard<std::mutex> lock(s.table_mutex);
      auto [it, fresh] = s.table.try_emplace(data);
      if (!fresh) {
        // The address is live in the table, so the memory it described was freed behind our back:
        // raw_allocate'd here and raw_deallocate'd through another allocator after uninstall.
        // Forget it without freeing it again.
        stale = it->second.bytes;
        it->second.inner.release_context();
      }
      it->second = Entry{std::move(dp), bytes, serial};
    }
    if (stale != 0) {
      s.current.fetch_sub(stale, std::memory_order_relaxed);
      s.stale_entries.fetch_add(1, std::memory_order_relaxed);
    }
    const int64_t now = s.current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    int64_t peak = s.peak.load(std::memory_order_relaxed);
    while (now > peak &&
           !s.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    return c10::DataPtr(data, data, &meter_delete, device);
  }

  // Every non-empty DataPtr we return has ctx == data and this deleter, so the raw interface works.
  c10::DeleterFnPtr raw_deleter() const override {
    return &meter_delete;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

MeterAllocator& meter_allocator() {
  static MeterAllocator* a = new MeterAllocator();
  return *a;
}

}  // namespace

// 1: our allocator is now GetCPUAllocator() (also when it already was); 0: SetCPUAllocator did not
// take effect at any priority (nothing changed); -1: still installed under another allocator that
// replaced ours (nothing changed).
HM_EXPORT int hm_install() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.install_mutex);
  c10::Allocator* ours = &meter_allocator();
  c10::Allocator* cur = c10::GetCPUAllocator();
  if (cur == ours) {
    return 1;
  }
  if (s.priority >= 0) {
    // Installed, but another allocator replaced us since (and may wrap us): wrapping it would
    // make a cycle.
    return -1;
  }
  // SetAllocator only replaces the current allocator when `priority` >= the priority it was set
  // with (the default CPU allocator registers with 0), and does so silently. Use the lowest priority
  // that takes effect: it then equals the recorded priority, so restoring with it on uninstall puts
  // both the allocator and its priority back as they were.
  s.inner.store(cur, std::memory_order_release);
  for (int p = 0; p <= 255; ++p) {
    c10::SetCPUAllocator(ours, static_cast<uint8_t>(p));
    if (c10::GetCPUAllocator() == ours) {
      s.previous = cur;
      s.priority = p;
      return 1;
    }
  }
  return 0;
}

// 1: restored the previous allocator; 0: not installed; -1: another allocator replaced ours since
// install (left alone: restoring would drop it); -2: the restore did not take effect.
HM_EXPORT int hm_uninstall() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.install_mutex);
  if (s.priority < 0) {
    return 0;
  }
  if (c10::GetCPUAllocator() != &meter_allocator()) {
    return -1;
  }
  c10::SetCPUAllocator(s.previous, static_cast<uint8_t>(s.priority));
  if (c10::GetCPUAllocator() != s.previous) {
    return -2;
  }
  s.priority = -1;
  s.previous = nullptr;
  return 1;
}

// 1 when GetCPUAllocator() is the meter now.
HM_EXPORT int hm_installed() {
  return c10::GetCPUAllocator() == &meter_allocator() ? 1 : 0;
}

// Priority the current install used (-1 when not installed by hm_install).
HM_EXPORT int hm_priority() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.install_mutex);
  return s.priority;
}

HM_EXPORT int64_t hm_current() {
  return state().current.load(std::memory_order_relaxed);
}

HM_EXPORT int64_t hm_peak() {
  return state().peak.load(std::memory_order_relaxed);
}

// peak := current. Not atomic with concurrent allocations (a racing allocation may raise the peak
// just before the store and be lost); call it when no other thread allocates.
HM_EXPORT void hm_reset_peak() {
  State& s = state();
  s.peak.store(s.current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

HM_EXPORT int64_t hm_serial() {
  return state().serial.load(std::memory_order_relaxed);
}

// 1 and (bytes, serial) when `ptr` is the data pointer of a live counted allocation, else 0.
HM_EXPORT int hm_lookup(uintptr_t ptr, int64_t* bytes, int64_t* serial) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.table_mutex);
  auto it = s.table.find(reinterpret_cast<void*>(ptr));
  if (it == s.table.end()) {
    return 0;
  }
  if (bytes != nullptr) *bytes = it->second.bytes;
  if (serial != nullptr) *serial = it->second.serial;
  return 1;
}

// The serial of the live allocation at ``ptr``, or -1: one call, no out-parameters (the monitor's pack
// hook asks once per saved storage).
HM_EXPORT int64_t hm_serial_of(uintptr_t ptr) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.table_mutex);
  auto it = s.table.find(reinterpret_cast<void*>(ptr));
  return it == s.table.end() ? -1 : it->second.serial;
}

HM_EXPORT int64_t hm_live_count() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.table_mutex);
  return static_cast<int64_t>(s.table.size());
}

// Frees of memory the meter did not allocate that reached its deleter (forwarded, see meter_delete).
HM_EXPORT int64_t hm_orphan_frees() {
  return state().orphan_frees.load(std::memory_order_relaxed);
}

// Allocations found freed behind the meter's back (forgotten, see allocate).
HM_EXPORT int64_t hm_stale_entries() {
  return state().stale_entries.load(std::memory_order_relaxed);
}

// raw_allocate(n) / raw_deallocate(p) through whatever GetCPUAllocator() is now, as ideep/oneDNN
// do for their buffers (hundreds of times per ResNet-50 step on the CPU). For tests. 0 when the
// current allocator has no raw interface.
HM_EXPORT uintptr_t hm_raw_allocate(int64_t n) {
  c10::Allocator* a = c10::GetCPUAllocator();
  if (a->raw_deleter() == nullptr) {
    return 0;
  }
  return reinterpret_cast<uintptr_t>(a->raw_allocate(static_cast<size_t>(n)));
}

HM_EXPORT int hm_raw_deallocate(uintptr_t p) {
  c10::Allocator* a = c10::GetCPUAllocator();
  if (a->raw_deleter() == nullptr) {
    return 0;
  }
  a->raw_deallocate(reinterpret_cast<void*>(p));
  return 1;
}
