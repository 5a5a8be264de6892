// hybridmem native allocator device: a c10::Allocator that wraps the CPU allocator, counts its bytes,
// caps them at a budget, and frees evictable storages (a registry) when an allocation would cross it.
// With HM_WITH_CUDA the same registry is reached from the CUDA caching allocator through a c10
// free-memory callback (FreeCudaMemoryCallbacksRegistry).
//
// Built by hybridmem/native/build.py, loaded by cpumeter.py (plain C ABI, ctypes; c10 headers only, no
// pybind11).
//
// The cap
// - hm_set_budget(b): an allocation that would take current (+ external) bytes over b first asks the
//   registry to free the difference, then, if it still does not fit, throws c10::OutOfMemoryError
//   (torch.OutOfMemoryError in Python) naming the bytes requested, held, and what the registry could
//   not free. Nothing is allocated past the budget: the bytes are reserved before the inner allocator
//   runs. No Python and no GIL on this path.
// - hm_add_external(d): bytes the device holds that were allocated before the wrapper was installed
//   (parameters, inputs): counted in current/peak and against the budget like the rest.
// - A thread may exempt its allocations from the cap (hm_cap_exempt): they are counted, never refused.
//
// The registry of evictable storages
// - hm_reg_add(key, StorageImpl*, limit, priority): takes a strong reference (the StorageImpl stays
//   alive, its Python object too). The storage is *droppable* while its use count is <= limit (the
//   caller's own references plus ours: nothing else can read it, so freeing it frees real memory).
// - reclaim(need): under the registry lock, droppable storages in priority order have their data
//   taken out (the StorageImpl keeps a null DataPtr and 0 bytes, as after resize_(0)); the DataPtrs are
//   destroyed after the lock is released, which frees the memory. Their keys queue for hm_reg_drain.
//   The StorageImpl is never released here: its last reference may be a Python object, whose release
//   needs the GIL.
// - hm_reg_claim(key) (called with the GIL held, through ctypes.PyDLL): removes the entry and drops
//   our reference; 1 = its data was still there, 0 = it had been dropped, -1 = unknown key. Python
//   claims an entry before it reads it, so a storage is never dropped while Python uses it.
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

#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/flat_hash_map.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#ifdef HM_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

#define HM_EXPORT extern "C" __attribute__((visibility("default")))

// The page rounding an expandable segment may add to a request at the allocator's fraction check
// (allocconf.EXPANDABLE_SLACK): a cache miss needs this much room under the cap beyond the request.
constexpr int64_t kExpandableSlack = int64_t{20} << 20;

namespace {

struct Entry {
  c10::DataPtr inner;  // owns the memory; destroying it frees through the inner allocator
  int64_t bytes = 0;
  int64_t serial = 0;
  bool inherited = false;  // allocated by the parent of a forked child: not counted in the child
};

struct State {
  std::atomic<int64_t> current{0};     // live counted allocations + external bytes
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> window_peak{0};  // a second peak, reset independently (per-op scratch in capture)
  std::atomic<int64_t> budget{-1};      // -1: no cap
  std::atomic<int64_t> external{0};     // bytes from before install, counted in current
  std::atomic<int64_t> refused{0};      // allocations refused (OutOfMemoryError thrown)
  // Soft cap (hm_set_soft): an allocation the registry cannot make room for goes through and is noted
  // instead of throwing. A steady-state step has no op hook around its ops to recover from a refusal in;
  // the runtime reads the note at its next save or read (the bytes over the budget show there) and evicts.
  std::atomic<int> soft{0};
  std::atomic<int64_t> let_through{0};   // refusals let through since the last hm_soft_take
  std::atomic<int64_t> let_bytes{0};     // the first one's request
  std::atomic<int64_t> let_held{0};      // and the bytes held when it was refused
  std::atomic<int64_t> reclaimed{0};    // bytes the registry freed at allocation time
  std::atomic<int64_t> serial{0};      // number of counted allocations so far (monotonic)
  std::atomic<int64_t> orphan_frees{0};   // meter_delete on a pointer it did not allocate
  std::atomic<int64_t> stale_entries{0};  // allocations freed behind our back (see allocate)
  std::mutex table_mutex;
  // Live counted allocations, by data pointer. Open addressing (c10's ska::flat_hash_map): every allocation
  // and free goes through this table, and a node-based map would call malloc and free once more for each.
  ska::flat_hash_map<void*, Entry> table;
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

void bump_peaks(State& s, int64_t now) {
  int64_t peak = s.peak.load(std::memory_order_relaxed);
  while (now > peak && !s.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  int64_t w = s.window_peak.load(std::memory_order_relaxed);
  while (now > w && !s.window_peak.compare_exchange_weak(w, now, std::memory_order_relaxed)) {
  }
}

thread_local int cap_exempt = 0;  // > 0: this thread's allocations are never refused

struct RegEntry {
  c10::StorageImpl* impl = nullptr;  // we hold one strong reference
  int64_t limit = 0;                 // droppable while use_count <= limit
  double priority = 0.0;             // lower goes first
  int64_t seq = 0;                   // registration order (older first on ties)
  bool dropped = false;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, RegEntry> entries;
  std::vector<int64_t> dropped;  // keys dropped since the last drain
  int64_t seq = 0;
};

// Leaked on purpose, like state(); replaced (not freed) in a forked child.
std::atomic<Registry*> the_registry{new Registry()};

Registry& registry() {
  return *the_registry.load(std::memory_order_acquire);
}

void meter_delete(void* ptr) noexcept;

// Frees droppable registered storages of `device_type` (and of device `index`, where >= 0), lowest
// priority first, until `need` bytes were taken out or none is left; returns the bytes taken out. Only
// storages whose memory the meter allocated count on the CPU (`metered_only`): freeing anything else
// would not lower the count.
int64_t reclaim(int64_t need, c10::DeviceType device_type, bool metered_only, int index = -1) {
  Registry& r = registry();
  std::vector<c10::DataPtr> victims;
  int64_t taken = 0;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    std::vector<std::pair<std::pair<double, int64_t>, int64_t>> order;
    order.reserve(r.entries.size());
    for (auto& [key, e] : r.entries) {
      if (e.dropped || e.impl->device_type() != device_type) {
        continue;
      }
      if (c10::raw::intrusive_ptr::use_count(e.impl) > static_cast<uint32_t>(e.limit)) {
        continue;  // something else references it: freeing it would corrupt that tensor
      }
      const c10::DataPtr& dp = e.impl->_mutable_data_ptr_no_checks();
      if (dp.get() == nullptr || e.impl->nbytes() == 0) {
        continue;
      }
      if (metered_only && dp.get_deleter() != &meter_delete) {
        continue;
      }
      if (index >= 0 && dp.device().index() != index) {
        continue;  // another device's memory: freeing it does not help this device's allocation
      }
      order.push_back({{e.priority, e.seq}, key});
    }
    std::sort(order.begin(), order.end());
    for (auto& item : order) {
      if (taken >= need) {
        break;
      }
      RegEntry& e = r.entries[item.second];
      const int64_t n = static_cast<int64_t>(e.impl->nbytes());
      const c10::Device dev = e.impl->_mutable_data_ptr_no_checks().device();
      victims.push_back(std::move(e.impl->_mutable_data_ptr_no_checks()));
      e.impl->set_data_ptr_noswap(c10::DataPtr(nullptr, dev));
      e.impl->set_nbytes(0);
      e.dropped = true;
      r.dropped.push_back(item.second);
      taken += n;
    }
  }
  state().reclaimed.fetch_add(taken, std::memory_order_relaxed);
  victims.clear();  // frees the memory, outside the registry lock (meter_delete takes the table lock)
  return taken;
}

std::string mib(int64_t b) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(b) / 1048576.0);
  return std::string(buf);
}

// Reserve `n` bytes against the budget (freeing registered storages if needed) or throw OOM.
void reserve(State& s, int64_t n) {
  for (int attempt = 0;; ++attempt) {
    const int64_t now = s.current.fetch_add(n, std::memory_order_relaxed) + n;
    const int64_t b = s.budget.load(std::memory_order_relaxed);
    if (b < 0 || now <= b || cap_exempt > 0) {
      bump_peaks(s, now);
      return;
    }
    s.current.fetch_sub(n, std::memory_order_relaxed);
    if (attempt < 2 && reclaim(now - b, c10::DeviceType::CPU, true) > 0) {
      continue;
    }
    const int64_t held = s.current.load(std::memory_order_relaxed);
    if (s.soft.load(std::memory_order_relaxed) != 0) {
      if (s.let_through.fetch_add(1, std::memory_order_relaxed) == 0) {
        s.let_bytes.store(n, std::memory_order_relaxed);
        s.let_held.store(held, std::memory_order_relaxed);
      }
      bump_peaks(s, s.current.fetch_add(n, std::memory_order_relaxed) + n);
      return;
    }
    s.refused.fetch_add(1, std::memory_order_relaxed);
    // "Tried to allocate X MiB" is the form torch's CUDA allocator uses: callers parse it.
    C10_THROW_ERROR(OutOfMemoryError,
                    "hybridmem: CPU allocator budget exceeded. Tried to allocate " + mib(n) + " (" +
                        std::to_string(n) + " bytes) with " + mib(held) + " (" + std::to_string(held) +
                        " bytes) held and nothing more the allocator could free; budget " + mib(b) +
                        " (" + std::to_string(b) + " bytes)");
  }
}

void meter_delete(void* ptr) noexcept {
  if (ptr == nullptr) {
    return;  // raw_deallocate(nullptr) (e.g. ideep frees null pointers): a no-op, like free()
  }
  State& s = state();
  c10::DataPtr inner;
  int64_t bytes = 0;
  bool inherited = false;
  {
    std::lock_guard<std::mutex> lock(s.table_mutex);
    auto it = s.table.find(ptr);
    if (it != s.table.end()) {
      inner = std::move(it->second.inner);
      bytes = it->second.bytes;
      inherited = it->second.inherited;
      s.table.erase(it);
    }
  }
  if (inherited) {
    return;  // the parent's memory, freed in a forked child: never counted here (`inner` frees it)
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
    if (n == 0) {
      return inner->allocate(n);
    }
    const int64_t bytes = static_cast<int64_t>(n);
    reserve(s, bytes);  // throws past the budget: nothing is allocated then
    c10::DataPtr dp;
    try {
      dp = inner->allocate(n);
    } catch (...) {
      s.current.fetch_sub(bytes, std::memory_order_relaxed);
      throw;
    }
    void* data = dp.get();
    if (data == nullptr) {
      s.current.fetch_sub(bytes, std::memory_order_relaxed);
      return dp;
    }
    const c10::Device device = dp.device();
    const int64_t serial = s.serial.fetch_add(1, std::memory_order_relaxed) + 1;
    int64_t stale = 0;
    {
      std::lock_guard<std::mutex> lock(s.table_mutex);
      auto [it, fresh] = s.table.emplace(data, Entry{});
      if (!fresh) {
        // The address is live in the table, so the memory it described was freed behind our back:
        // raw_allocate'd here and raw_deallocate'd through another allocator after uninstall.
        // Forget it without freeing it again.
        stale = it->second.inherited ? 0 : it->second.bytes;
        it->second.inner.release_context();
      }
      it->second = Entry{std::move(dp), bytes, serial};
    }
    if (stale != 0) {
      s.current.fetch_sub(stale, std::memory_order_relaxed);
      s.stale_entries.fetch_add(1, std::memory_order_relaxed);
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

// Budget of the CPU device in bytes; -1 removes the cap.
HM_EXPORT void hm_set_budget(int64_t b) {
  state().budget.store(b, std::memory_order_relaxed);
}

HM_EXPORT int64_t hm_budget() {
  return state().budget.load(std::memory_order_relaxed);
}

// Soft cap on (1) or off (0): see State::soft.
HM_EXPORT void hm_set_soft(int on) {
  state().soft.store(on, std::memory_order_relaxed);
}

// Refusals let through since the last call (0: none); the first one's request and the bytes then held go
// to out[0] and out[1]. Resets the count.
HM_EXPORT int64_t hm_soft_take(int64_t* out) {
  State& s = state();
  const int64_t n = s.let_through.exchange(0, std::memory_order_relaxed);
  if (n > 0 && out != nullptr) {
    out[0] = s.let_bytes.load(std::memory_order_relaxed);
    out[1] = s.let_held.load(std::memory_order_relaxed);
  }
  return n;
}

// Adds `delta` (may be negative) to the external bytes, which count in current and peak.
HM_EXPORT int64_t hm_add_external(int64_t delta) {
  State& s = state();
  // Never below zero: a forked child's device starts with none, whatever its copy of the Python side
  // believes it added before the fork.
  int64_t ext = s.external.load(std::memory_order_relaxed);
  while (ext + delta < 0 && !s.external.compare_exchange_weak(ext, 0, std::memory_order_relaxed)) {
  }
  if (ext + delta < 0) {
    delta = -ext;
  } else {
    s.external.fetch_add(delta, std::memory_order_relaxed);
  }
  const int64_t now = s.current.fetch_add(delta, std::memory_order_relaxed) + delta;
  bump_peaks(s, now);
  return now;
}

// Exempt this thread's allocations from the cap while depth > 0 (nested calls stack).
HM_EXPORT int hm_cap_exempt(int enter) {
  cap_exempt += enter ? 1 : -1;
  if (cap_exempt < 0) cap_exempt = 0;
  return cap_exempt;
}

HM_EXPORT void hm_window_reset() {
  State& s = state();
  s.window_peak.store(s.current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

HM_EXPORT int64_t hm_window_peak() {
  return state().window_peak.load(std::memory_order_relaxed);
}

HM_EXPORT int64_t hm_refused() {
  return state().refused.load(std::memory_order_relaxed);
}

HM_EXPORT int64_t hm_reclaimed_bytes() {
  return state().reclaimed.load(std::memory_order_relaxed);
}

// ---- registry (the hm_reg_* functions that take or drop references run with the GIL held) ----

// Registers a storage (`impl` = StorageImpl*, i.e. UntypedStorage._cdata) under `key`; takes a strong
// reference. 1: added; 0: the key was registered already (nothing changed).
HM_EXPORT int hm_reg_add(int64_t key, uintptr_t impl, int64_t limit, double priority) {
  Registry& r = registry();
  auto* p = reinterpret_cast<c10::StorageImpl*>(impl);
  std::lock_guard<std::mutex> lock(r.mutex);
  auto [it, fresh] = r.entries.try_emplace(key);
  if (!fresh) {
    return 0;
  }
  c10::raw::intrusive_ptr::incref(p);
  it->second = RegEntry{p, limit, priority, ++r.seq, false};
  return 1;
}

// Removes `key` and drops our reference: 1 = its data was there, 0 = it had been dropped, -1 = unknown.
HM_EXPORT int hm_reg_claim(int64_t key) {
  Registry& r = registry();
  c10::StorageImpl* p = nullptr;
  int res = -1;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.entries.find(key);
    if (it == r.entries.end()) {
      return -1;
    }
    p = it->second.impl;
    res = it->second.dropped ? 0 : 1;
    r.entries.erase(it);
  }
  c10::raw::intrusive_ptr::decref(p);  // may free the storage (and its Python object: GIL held)
  return res;
}

// Copies up to `cap` keys dropped since the last drain into `out`; returns how many (the rest stay).
HM_EXPORT int64_t hm_reg_drain(int64_t* out, int64_t cap) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const int64_t n = std::min<int64_t>(cap, static_cast<int64_t>(r.dropped.size()));
  std::copy(r.dropped.begin(), r.dropped.begin() + n, out);
  r.dropped.erase(r.dropped.begin(), r.dropped.begin() + n);
  return n;
}

HM_EXPORT int64_t hm_reg_pending() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return static_cast<int64_t>(r.dropped.size());
}

#ifdef HM_WITH_CUDA
namespace {
std::atomic<int64_t> cuda_budget{-1};
std::atomic<int64_t> cuda_headroom{0};
std::atomic<int> cuda_device{0};
std::atomic<int64_t> cuda_calls{0};
std::atomic<int64_t> cuda_freed{0};
}  // namespace
#endif

// What the CUDA free-memory callback frees on a cache miss: the bytes by which the device's reserved bytes,
// plus the page rounding an expandable segment may add to the request (`slack`), pass the budget less its
// headroom; 0 when a new segment still fits (the allocator grows under the cap, nothing is freed). Reserved,
// not allocated: the per-process fraction caps what the allocator reserves, and a miss near that cap falls
// back to releasing every cached block (a device synchronisation). Freed blocks return to the cache, where
// the request is looked for again. Exported for tests (no CUDA needed).
HM_EXPORT int64_t hm_cuda_need(int64_t reserved, int64_t slack, int64_t budget, int64_t headroom) {
  if (budget < 0) {
    return 0;
  }
  const int64_t need = reserved + slack - (budget - headroom);
  return need > 0 ? need : 0;
}

// The page rounding the CUDA callback allows for (kExpandableSlack).
HM_EXPORT int64_t hm_cuda_slack() {
  return kExpandableSlack;
}

// A forked child starts unmanaged: no cap, an empty registry (its references are the parent's
// objects, copied; they are leaked, never touched), and a device holding nothing of the parent's.
HM_EXPORT void hm_after_fork_child() {
  State& s = state();
  s.budget.store(-1, std::memory_order_relaxed);
#ifdef HM_WITH_CUDA
  // A child of a CUDA-initialised parent cannot use CUDA: the parent's budget must not make the callback
  // read the allocator's statistics there (it would reach into the parent's copied allocator state).
  cuda_budget.store(-1, std::memory_order_relaxed);
#endif
  // The parent's registry (and its lock, in whatever state another thread left it) is abandoned.
  the_registry.store(new Registry(), std::memory_order_release);
  // The child's device starts empty: what the parent held is marked inherited (freed uncounted). The
  // child has one thread now, so the table is walked without its lock, which another parent thread may
  // have held at the fork: a fresh mutex replaces it.
  new (&s.table_mutex) std::mutex();
  for (auto& [ptr, e] : s.table) {
    e.inherited = true;
  }
  s.current.store(0, std::memory_order_relaxed);
  s.external.store(0, std::memory_order_relaxed);
  s.peak.store(0, std::memory_order_relaxed);
  s.window_peak.store(0, std::memory_order_relaxed);
}

// peak := current. Not atomic with concurrent allocations (a racing allocation may raise the peak
// just before the store and be lost); call it when no other thread allocates.
HM_EXPORT void hm_reset_peak() {
  State& s = state();
  s.peak.store(s.current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

#ifdef HM_WITH_CUDA
// ---- CUDA: the caching allocator asks registered callbacks to free memory on a cache miss, before
// cudaMalloc. Ours frees registered CUDA storages of the budgeted device while its reserved bytes leave
// no room for a new segment under the CUDA budget minus a headroom (hm_cuda_need). It runs inside the
// caching allocator's malloc, which holds that device's (recursive) allocator mutex: freeing blocks of the
// same device re-enters it on the same thread. A miss on another device is left alone: its statistics
// are not the budget's, and taking the budgeted device's mutex from inside another device's malloc could
// invert the lock order with a thread allocating on the budgeted device.
namespace {
// While the current stream captures a CUDA graph the miss is the graph's private pool's: blocks freed now
// go back to other pools only once the capture ends, and a registered storage may be one the graph reads.
bool capturing() noexcept {
  try {
    return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  } catch (...) {
    return true;  // the status could not be read: do nothing rather than free under a capture
  }
}

// The current device, or -1 where it cannot be read (no exception may leave the allocator's callback).
int current_device() noexcept {
  try {
    return static_cast<int>(c10::cuda::current_device());
  } catch (...) {
    return -1;
  }
}
}  // namespace

namespace c10 {
class HybridmemFreeMemoryCallback : public FreeMemoryCallback {
 public:
  bool Execute() override {
    const int64_t b = cuda_budget.load(std::memory_order_relaxed);
    if (b < 0) {
      return false;
    }
    const int device = cuda_device.load();
    // The caching allocator mallocs on the current device (NativeCachingAllocator::malloc takes it from
    // c10::cuda::GetDevice): that is the device whose allocation missed.
    if (current_device() != device || capturing()) {
      return false;
    }
    cuda_calls.fetch_add(1, std::memory_order_relaxed);
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
    const int64_t reserved =
        stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
    const int64_t need =
        hm_cuda_need(reserved, kExpandableSlack, b, cuda_headroom.load(std::memory_order_relaxed));
    if (need <= 0) {
      return false;
    }
    const int64_t freed = reclaim(need, c10::DeviceType::CUDA, false, device);
    cuda_freed.fetch_add(freed, std::memory_order_relaxed);
    return freed > 0;
  }
};
REGISTER_FREE_MEMORY_CALLBACK(hybridmem_free_memory, HybridmemFreeMemoryCallback);
}  // namespace c10

HM_EXPORT int hm_cuda_hook() {
  return 1;
}

// 1 when c10's FreeCudaMemoryCallbacksRegistry holds our callback (it does once this library loads).
HM_EXPORT int hm_cuda_registered() {
  return c10::FreeCudaMemoryCallbacksRegistry()->Has("hybridmem_free_memory") ? 1 : 0;
}

HM_EXPORT void hm_cuda_set_budget(int device, int64_t budget, int64_t headroom) {
  cuda_device.store(device);
  cuda_headroom.store(headroom);
  cuda_budget.store(budget);
}

HM_EXPORT int64_t hm_cuda_calls() {
  return cuda_calls.load(std::memory_order_relaxed);
}

HM_EXPORT int64_t hm_cuda_freed() {
  return cuda_freed.load(std::memory_order_relaxed);
}

// The caching allocator's counters of `device`, read in C: torch.cuda.memory_allocated() builds and
// flattens the whole memory_stats() dict in Python (about 0.25 ms a read on an H100's host), and the
// runtime reads the allocated bytes before and after each op it meters. `which`: 0 allocated bytes now,
// 1 their peak, 2 reserved bytes now, 3 the allocator's refusals (num_ooms). -1 where the allocator
// cannot answer (no such device, CUDA not initialised): a C++ exception must not cross the C ABI.
HM_EXPORT int64_t hm_cuda_stat(int device, int which) {
  try {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    switch (which) {
      case 0:
        return stats.allocated_bytes[all].current;
      case 1:
        return stats.allocated_bytes[all].peak;
      case 2:
        return stats.reserved_bytes[all].current;
      case 3:
        return stats.num_ooms;
      default:
        return -1;
    }
  } catch (...) {
    return -1;
  }
}

#else
HM_EXPORT int hm_cuda_hook() {
  return 0;
}
#endif

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
