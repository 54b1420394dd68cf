// cudasim — a strict simulated CUDA runtime (see cudasim.hpp and README.md beside this file).
//
// Compiled against the toolkit's cuda_runtime_api.h, so every exported function has the runtime's exact signature.
// One mutex guards the whole machine; each device has an engine thread (copies, memsets, event records, waits) and
// one host-function thread shared by all its streams (CUDA may serialize host functions across streams).
#include "cudasim.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/mman.h>

namespace {

using clock_type = std::chrono::steady_clock;

// ------------------------------------------------------------------------------------------------------------------
// The machine's state
// ------------------------------------------------------------------------------------------------------------------

struct op_state {
  bool done = false;
  clock_type::time_point completed_at{};
  unsigned long long stream_id = 0;  // set when enqueued: its stream (cudaStreamGetId's id, never reused)
  std::uint64_t seq = 0;             // and its place in the machine's order of enqueued work
};
using state_ptr = std::shared_ptr<op_state>;

enum class op_kind { engine, host };

struct event_obj;

/// What an operation does: what a capture records, and each launch of its graph enqueues again.
struct captured_op {
  op_kind kind = op_kind::engine;
  std::function<bool()> precheck;  // under the lock, just before running: false = illegal access
  std::function<void()> work;      // runs without the lock
  std::string what;
  std::uintptr_t allocates = 0;              // an allocation node: the graph allocation at this address
  std::uintptr_t frees = 0;                  // a free node of the graph allocation at this address
  std::shared_ptr<event_obj> external_wait;  // an event wait node (cudaEventWaitExternal): each launch waits for
                                             // the event's record as it stands then
};

/// An operation enqueued on a stream.
struct op : captured_op {
  op() = default;
  explicit op(const captured_op& recorded) : captured_op(recorded) {}
  state_ptr state = std::make_shared<op_state>();
  std::vector<state_ptr> deps;  // must complete before this op starts (event waits, legacy barriers)
};

struct capture_state;

enum class stream_kind { created, legacy, per_thread };

struct stream_obj {
  unsigned long long id = 0;
  int device = 0;
  unsigned flags = 0;
  int priority = 0;
  stream_kind kind = stream_kind::created;
  std::uintptr_t handle = 0;
  std::deque<std::shared_ptr<op>> queue;
  state_ptr tail;
  bool running = false;
  bool destroyed = false;
  std::shared_ptr<capture_state> capture;
  bool blocking() const { return kind != stream_kind::legacy && (flags & cudaStreamNonBlocking) == 0; }
};
using stream_ptr = std::shared_ptr<stream_obj>;

struct capture_state {
  unsigned long long id = 0;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;
  bool invalidated = false;
  bool active = true;
  bool ended_from_wrong_thread = false;  // its end was asked from another thread: its own end then fails (401)
  stream_ptr origin;
  std::vector<captured_op> ops;
  // Each stream in the capture: its work (captured operations) and steps (work and waits, for order), and where it
  // was last joined: a stream waited for an event recorded on it after its last work. cudaStreamEndCapture requires
  // every stream forked into the capture with work of its own to be joined back, directly or through others, into
  // the origin (else cudaErrorStreamCaptureUnjoined). Not measured on a GPU: whether a fork without work, or a wait
  // after the join, also counts as unjoined; both are accepted here.
  struct member {
    std::size_t work = 0;
    std::size_t steps = 0;
    const stream_obj* joined_into = nullptr;
    std::size_t joined_after_work = 0;   // this stream's work when the joining event was recorded
    std::size_t joined_after_steps = 0;  // and its steps
    std::size_t joined_at = 0;           // the joining stream's steps once it had waited
  };
  std::map<const stream_obj*, member> members;
  /// True when `st` (a member) reaches the origin through joins made after its last work; a stream that relays a
  /// join must have been joined itself after it waited.
  bool joined(const stream_obj* st, int depth = 0) const {
    if (st == origin.get()) return true;
    const auto m = members.find(st);
    if (m == members.end() || m->second.joined_into == nullptr || m->second.joined_after_work != m->second.work) {
      return false;
    }
    const stream_obj* into = m->second.joined_into;
    if (into == origin.get()) return true;
    const auto next = members.find(into);
    return depth < 64 && next != members.end() && next->second.joined_after_steps >= m->second.joined_at &&
           joined(into, depth + 1);
  }
  /// Whether a stream with work of its own is not joined back.
  bool unjoined() const {
    return std::any_of(members.begin(), members.end(),
                       [&](const auto& m) { return m.second.work != 0 && !joined(m.first); });
  }
};

struct event_obj {
  int device = 0;
  unsigned flags = 0;
  state_ptr last;                           // null: never recorded
  std::shared_ptr<capture_state> capture;   // recorded inside this capture (until recorded again outside)
  const stream_obj* captured_on = nullptr;  // inside a capture: the stream, and its work and steps then
  std::size_t captured_after_work = 0;
  std::size_t captured_after_steps = 0;
};

struct graph_obj {
  std::vector<captured_op> ops;
  state_ptr last_launch;  // an executable's launches run in order, whatever their streams
  // A graph with memory nodes: its executable, while it lives (CUDA allows one at a time, since each allocation node
  // keeps one address).
  std::weak_ptr<graph_obj> executable;
  bool has_memory_nodes() const {
    return std::any_of(ops.begin(), ops.end(), [](const captured_op& o) { return o.allocates != 0 || o.frees != 0; });
  }
};

enum class region_kind { device, pinned, registered };

struct region {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  region_kind kind = region_kind::device;
  int device = 0;
  unsigned flags = 0;
  bool pooled = false;               // from cudaMallocAsync
  bool graph_allocation = false;     // cudaMallocAsync during a capture: what a free node of a capture may free
  bool graph_live = false;           // ... from a launch's allocation node to its free (node, or outside the graph)
  bool graph_launched = false;       // ... in the host's order: launched, its free not enqueued yet
  bool graph_free_captured = false;  // ... its free node was captured
  bool free_enqueued = false;        // cudaFreeAsync enqueued outside a capture, not run yet
  bool virtual_range = false;        // cuMemAddressReserve: device memory only where pages are mapped with access
};

/// A physical allocation of cuMemCreate.
struct vmm_allocation {
  int device = 0;
  std::size_t size = 0;
  bool released = false;  // cuMemRelease: the memory goes with its last mapping
  int mappings = 0;
};

/// A page of a reserved range mapped with cuMemMap.
struct vmm_page {
  unsigned long long handle = 0;
  std::uint64_t access = 0;  // bit d: cuMemSetAccess granted read/write to visible ordinal d
  CUdeviceptr mapping = 0;   // the cuMemMap that mapped it: its address and size (unmapped only whole)
  std::size_t mapping_size = 0;
};

struct device_state {
  cudasim::device_config config;
  int physical = 0;
  bool context = false;
  int creations = 0;
  std::size_t used = 0;
  // The default pool (cudaMallocAsync): its reserved memory is in `used`: the live allocations, the frees enqueued
  // and not yet run (pending, per stream), and the freed memory it keeps. A stream's allocation takes its own pending
  // frees first (stream order makes them safe to reuse), then kept memory (fungible: the pool's own fragmentation is
  // not modelled), then more from the device. At a stream, event or device synchronization the pool gives back what
  // it keeps above its release threshold (CUDA's default threshold, 0, keeps nothing); cudaMemPoolTrimTo gives back
  // down to the size asked.
  std::size_t pool_reserved = 0;
  std::size_t pool_used = 0;                              // live cudaMallocAsync bytes, as the host sees them
  std::map<const stream_obj*, std::size_t> pool_pending;  // bytes freed on each stream whose frees have not run
  std::size_t pool_pending_total = 0;
  // Frees that have run but whose completion the host has not observed (by a synchronization, or a query that
  // answered complete, of their stream or of an event recorded after them there, or a device synchronization): kept,
  // and reused, but not given back (cudaMemPoolTrimTo's header: such frees "can count as outstanding").
  struct unobserved_free {
    unsigned long long stream_id = 0;
    std::uint64_t seq = 0;  // the free's place in the machine's order (op_state::seq)
    std::size_t bytes = 0;
    int stream_device = 0;     // its stream's device (a free may be made on another device's stream)
    bool on_blocking = false;  // its stream synchronizes with the legacy stream
  };
  std::vector<unobserved_free> pool_unobserved;
  std::size_t pool_unobserved_total = 0;
  std::size_t pool_reserved_high = 0;
  std::size_t pool_used_high = 0;
  std::uint64_t pool_release_threshold = 0;
  std::uint64_t pool_peers = 0;  // bit d: cudaMemPoolSetAccess granted visible ordinal d the default pool's memory
  std::map<std::size_t, std::vector<void*>> pool_freed_blocks;  // by rounded size, with reuse_pool_addresses
  stream_ptr legacy;
  std::vector<stream_ptr> streams;  // every stream with work or a live handle, legacy and per-thread ones included
  bool workers = false;
};

/// Handles as the runtime hands them out: a destroyed handle's value is given to the next object created (LIFO).
template <class T>
struct handle_table {
  explicit handle_table(std::uintptr_t b) : base(b) {}
  std::uintptr_t base;
  std::vector<std::shared_ptr<T>> slots;
  std::vector<std::size_t> free_slots;
  std::set<std::uintptr_t> issued;

  std::uintptr_t add(std::shared_ptr<T> object) {
    std::size_t index;
    if (!free_slots.empty()) {
      index = free_slots.back();
      free_slots.pop_back();
      slots[index] = std::move(object);
    } else {
      index = slots.size();
      slots.push_back(std::move(object));
    }
    const std::uintptr_t h = base + index * 64;
    issued.insert(h);
    return h;
  }
  std::shared_ptr<T> find(std::uintptr_t h) const {
    if (h < base || (h - base) % 64 != 0) return nullptr;
    const std::size_t index = (h - base) / 64;
    return index < slots.size() ? slots[index] : nullptr;
  }
  bool was_issued(std::uintptr_t h) const { return issued.count(h) != 0; }
  void remove(std::uintptr_t h) {
    const std::size_t index = (h - base) / 64;
    slots[index].reset();
    free_slots.push_back(index);
  }
};

struct simulator {
  std::mutex mutex;
  bool reuse_pool_addresses = false;  // see cudasim::reuse_pool_addresses
  std::condition_variable changed;
  bool initialized = false;
  bool configured = false;
  // What every device call answers when no device is visible: cudaErrorNoDevice, or cudaErrorInvalidDevice when
  // CUDA_VISIBLE_DEVICES named a device twice (cudaGetDeviceCount on an H100; the other calls assumed to agree).
  cudaError_t no_devices_result = cudaErrorNoDevice;
  cudasim::machine_config machine;
  std::vector<device_state> devices;  // visible ordinals
  handle_table<stream_obj> streams{0x5100000000};
  handle_table<event_obj> events{0x5200000000};
  handle_table<graph_obj> graphs{0x5300000000};
  handle_table<graph_obj> execs{0x5400000000};
  std::map<std::uintptr_t, region> regions;  // by base address
  std::map<unsigned long long, vmm_allocation> vmm_allocations;
  unsigned long long next_vmm_handle = 0x5600000000;
  std::map<std::uintptr_t, vmm_page> vmm_pages;  // by address, one granule each
  std::vector<cudasim::violation> violations;
  std::vector<int> allowed_contexts;
  std::set<std::pair<int, int>> peer_enabled;  // (device, peer) by visible ordinal: cudaDeviceEnablePeerAccess
  std::map<std::string, std::vector<std::pair<int, cudaError_t>>> faults;
  std::map<std::string, std::vector<std::pair<int, std::function<void()>>>> actions;  // before_call
  std::map<std::string, std::size_t> call_counts;
  cudaError_t sticky = cudaSuccess;
  cudaError_t unloaded = cudaSuccess;  // cudasim::unload: every call returns it
  unsigned long long next_stream_id = 1;
  unsigned long long next_capture_id = 1;
  std::uint64_t next_op_seq = 1;  // op_state::seq
  std::map<std::pair<std::thread::id, int>, stream_ptr> per_thread;
  std::vector<std::shared_ptr<capture_state>> captures;  // active ones
  std::size_t checked_ops_running = 0;  // ops past their alive_check, running outside the lock (copies, memsets)
};

// Never destroyed: worker threads, host functions and static destructors of the program may call in at exit.
simulator& sim() {
  static simulator* s = new simulator();
  return *s;
}

thread_local int t_current = -1;  // -1: the thread never chose a device (cudaGetDevice says 0)
thread_local bool t_in_host_function = false;
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local cudaStreamCaptureMode t_capture_mode = cudaStreamCaptureModeGlobal;
thread_local int t_call_depth = 0;  // simulated calls in progress on this thread (cudasim::inside_call)

bool is_sticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
      return true;
    default:
      return false;
  }
}

std::string hex(std::uintptr_t v) {
  char text[32];
  std::snprintf(text, sizeof text, "%#llx", static_cast<unsigned long long>(v));
  return text;
}

void record_violation(simulator& s, const std::string& call, cudaError_t error, const std::string& message) {
  s.violations.push_back({call, error, message});
  std::fprintf(stderr, "cudasim violation: %s: %s (returns %d)\n", call.c_str(), message.c_str(),
               static_cast<int>(error));
}

std::string format_uuid(const unsigned char (&b)[16]) {
  char text[64];
  std::snprintf(text, sizeof text, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return text;
}

void initialize_locked(simulator& s) {
  if (s.initialized) return;
  s.initialized = true;
  if (!s.configured) {
    int count = 2;
    if (const char* n = std::getenv("CUDASIM_DEVICES")) count = std::max(0, std::min(8, std::atoi(n)));
    s.machine = cudasim::default_machine(count);
  }
  bool emptied_by_repeat = false;
  const auto visible =
      cudasim::visible_physical_devices(std::getenv("CUDA_VISIBLE_DEVICES"), s.machine, &emptied_by_repeat);
  if (emptied_by_repeat) s.no_devices_result = cudaErrorInvalidDevice;
  for (int physical : visible) {
    device_state d;
    d.config = s.machine.devices[static_cast<std::size_t>(physical)];
    d.physical = physical;
    s.devices.push_back(std::move(d));
  }
}

// ------------------------------------------------------------------------------------------------------------------
// Every API call goes through a `call`: it takes the lock, counts the call, and applies the rules that hold for every
// call (none from a host function, a sticky error stays, injected failures).
// ------------------------------------------------------------------------------------------------------------------

/// The injected failure of this call of `function` (cudaSuccess when none comes due): every queued fault counts the
/// call; the first that comes due fires, one due at the same call waits for the next.
cudaError_t due_fault(simulator& s, const std::string& function) {
  cudaError_t due = cudaSuccess;
  auto it = s.faults.find(function);
  if (it == s.faults.end()) return due;
  bool fired = false;
  for (auto f = it->second.begin(); f != it->second.end();) {
    if (--f->first > 0) {
      ++f;
    } else if (fired) {
      f->first = 1;
      ++f;
    } else {
      fired = true;
      due = f->second;
      f = it->second.erase(f);
      if (is_sticky(due)) s.sticky = due;
    }
  }
  return due;
}

/// A driver function's injected failure: out of memory for cudaErrorMemoryAllocation, the teardown results as the
/// driver spells them (cudaErrorCudartUnloading is CUDA_ERROR_DEINITIALIZED's value, cudaErrorContextIsDestroyed
/// CUDA_ERROR_CONTEXT_IS_DESTROYED's), else an unknown error. After cudasim::unload, every driver call fails too, as
/// the driver does once it is deinitialised at process exit.
CUresult due_driver_fault(simulator& s, const char* function) {
  ++s.call_counts[function];
  const cudaError_t e = s.unloaded != cudaSuccess ? s.unloaded : due_fault(s, function);
  switch (e) {
    case cudaSuccess:
      return CUDA_SUCCESS;
    case cudaErrorMemoryAllocation:
      return CUDA_ERROR_OUT_OF_MEMORY;
    case cudaErrorCudartUnloading:
      return CUDA_ERROR_DEINITIALIZED;
    case cudaErrorContextIsDestroyed:
      return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    default:
      return CUDA_ERROR_UNKNOWN;
  }
}

/// Runs the before_call action due at this call of `function`, if any, outside the lock (it may call CUDA).
void run_due_action(simulator& s, const char* function) {
  std::function<void()> action;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto it = s.actions.find(function);
    if (it == s.actions.end()) return;
    for (auto a = it->second.begin(); a != it->second.end();) {
      if (--a->first > 0) {
        ++a;
      } else if (action) {
        a->first = 1;  // due at the same call as another: the next one
        ++a;
      } else {
        action = std::move(a->second);
        a = it->second.erase(a);
      }
    }
  }
  if (action) action();
}

/// Locks the simulator for a call of `function`, after its due before_call action.
std::unique_lock<std::mutex> lock_for_call(simulator& s, const char* function) {
  run_due_action(s, function);
  return std::unique_lock<std::mutex>(s.mutex);
}

/// Counts a simulated call in progress on this thread, before anything of the call allocates.
struct call_depth {
  call_depth() noexcept { ++t_call_depth; }
  ~call_depth() { --t_call_depth; }
  call_depth(const call_depth&) = delete;
  call_depth& operator=(const call_depth&) = delete;
};

struct call {
  explicit call(const char* name) : s(sim()), lock(lock_for_call(s, name)), function(name) {
    initialize_locked(s);
    ++s.call_counts[function];
    if (t_in_host_function) {
      record_violation(s, function, cudaErrorNotPermitted, "CUDA call from inside a host function");
      early = cudaErrorNotPermitted;
      return;
    }
    if (s.unloaded != cudaSuccess) {
      early = s.unloaded;
      return;
    }
    if (s.sticky != cudaSuccess) {
      early = s.sticky;
      return;
    }
    early = due_fault(s, function);
  }
  /// The result of the call: failures become the thread's last error (cudaErrorNotReady is a status, not an error).
  cudaError_t result(cudaError_t e) {
    if (e != cudaSuccess && e != cudaErrorNotReady) t_last_error = e;
    return e;
  }
  cudaError_t violation(cudaError_t e, const std::string& message) {
    record_violation(s, function, e, message);
    return result(e);
  }

  call_depth depth;  // first: counted before the members below allocate
  simulator& s;
  std::unique_lock<std::mutex> lock;
  std::string function;
  cudaError_t early = cudaSuccess;
};

#define CUDASIM_ENTER(name) \
  call c(name);             \
  if (c.early != cudaSuccess) return c.result(c.early)

bool valid_device(simulator& s, int d) { return d >= 0 && static_cast<std::size_t>(d) < s.devices.size(); }

/// Gives back the default pool's kept memory above `keep` bytes reserved (never what is live, pending, or freed
/// without the host having observed the free complete).
void pool_release(device_state& dev, std::uint64_t keep) {
  const std::size_t floor = static_cast<std::size_t>(
      std::max<std::uint64_t>(keep, dev.pool_used + dev.pool_pending_total + dev.pool_unobserved_total));
  if (dev.pool_reserved <= floor) return;
  dev.used -= dev.pool_reserved - floor;
  dev.pool_reserved = floor;
}

/// Drops the unobserved frees of `dev` that `observed` says the host has now seen complete.
template <class Predicate>
void forget_unobserved(device_state& dev, Predicate observed) {
  auto& list = dev.pool_unobserved;
  for (auto it = list.begin(); it != list.end();) {
    if (observed(*it)) {
      dev.pool_unobserved_total -= it->bytes;
      it = list.erase(it);
    } else {
      ++it;
    }
  }
}

/// The host has observed `state` complete (a synchronization, or a query that answered complete): the frees that ran
/// before it on its stream are no longer outstanding. Only the stream's own order counts, not orders made through
/// event waits or the legacy stream (CUDA may count those frees as outstanding still).
void observe(simulator& s, const state_ptr& state) {
  if (!state || !state->done || state->seq == 0) return;
  for (auto& dev : s.devices) {
    forget_unobserved(dev, [&](const device_state::unobserved_free& f) {
      return f.stream_id == state->stream_id && f.seq <= state->seq;
    });
  }
}

/// The host has observed all work enqueued before `before` on `device`'s streams (a device synchronization), or on
/// its blocking streams only (`blocking_only`: the legacy stream's synchronization, or a query that answered
/// complete), destroyed streams included: the frees made there are no longer outstanding, whichever device's memory.
void observe_device(simulator& s, int device, std::uint64_t before, bool blocking_only) {
  for (auto& dev : s.devices) {
    forget_unobserved(dev, [&](const device_state::unobserved_free& f) {
      return f.stream_device == device && f.seq < before && (f.on_blocking || !blocking_only);
    });
  }
}

/// A stream, event or device synchronization on `device`: its pool keeps at most its release threshold (more only
/// while it is live).
void pool_release_at_synchronize(simulator& s, int device) {
  if (!valid_device(s, device)) return;
  device_state& dev = s.devices[static_cast<std::size_t>(device)];
  pool_release(dev, dev.pool_release_threshold);
}

/// The handle of `device`'s default memory pool (cudaDeviceGetDefaultMemPool).
cudaMemPool_t default_pool_of(int device) {
  return reinterpret_cast<cudaMemPool_t>(std::uintptr_t{0x5500000000} + 64u * static_cast<unsigned>(device));
}

/// The device whose default pool `pool` is (default_pool_of); -1 if none is.
int pool_device(simulator& s, cudaMemPool_t pool) {
  const auto offset = reinterpret_cast<std::uintptr_t>(pool) - std::uintptr_t{0x5500000000};
  const auto device = static_cast<int>(offset / 64u);
  return offset % 64u == 0 && valid_device(s, device) ? device : -1;
}

/// Whether visible ordinal `d` can access the memory of `peer` in the configured topology (never itself).
bool peer_capable(simulator& s, int d, int peer) {
  if (d == peer) return false;
  const auto& matrix = s.machine.peer_access;
  if (matrix.empty()) return true;
  const auto i = static_cast<std::size_t>(s.devices[static_cast<std::size_t>(d)].physical);
  const auto j = static_cast<std::size_t>(s.devices[static_cast<std::size_t>(peer)].physical);
  return matrix[i][j];
}

/// Creates the primary context of `d` if it does not exist (as cudaSetDevice, allocations, stream and event creation,
/// cudaMemGetInfo ... do on a real driver).
void ensure_context(call& c, int d) {
  device_state& dev = c.s.devices[static_cast<std::size_t>(d)];
  if (dev.context) return;
  dev.context = true;
  ++dev.creations;
  dev.used += c.s.machine.context_bytes;
  const auto& allowed = c.s.allowed_contexts;
  if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), d) == allowed.end()) {
    record_violation(c.s, c.function, cudaSuccess,
                     "created the primary context of cuda:" + std::to_string(d) +
                         ", a device the program never named (the test allows contexts only on its own devices)");
  }
}

/// The device a context-needing call works on: the thread's current device, device 0 if it never chose one (the
/// runtime then initialises device 0 and makes it current).
int context_device(call& c) {
  if (t_current < 0) t_current = 0;
  ensure_context(c, t_current);
  return t_current;
}

int current_ordinal() { return t_current < 0 ? 0 : t_current; }

/// Calls that enqueue work on an explicit stream, query it or synchronize it still run in the runtime's current
/// context: on a thread that never chose a device (no context current) the runtime first initialises device 0 and
/// makes it current, whichever device the stream belongs to.
void require_current_context(call& c) {
  if (t_current < 0) context_device(c);
}

// ------------------------------------------------------------------------------------------------------------------
// Streams and work
// ------------------------------------------------------------------------------------------------------------------

void worker_loop(int device, op_kind kind);

void start_workers(simulator& s, int d) {
  device_state& dev = s.devices[static_cast<std::size_t>(d)];
  if (dev.workers) return;
  dev.workers = true;
  std::thread(worker_loop, d, op_kind::engine).detach();
  std::thread(worker_loop, d, op_kind::host).detach();
}

stream_ptr make_stream(simulator& s, int d, stream_kind kind, unsigned flags, int priority) {
  auto st = std::make_shared<stream_obj>();
  st->id = s.next_stream_id++;
  st->device = d;
  st->kind = kind;
  st->flags = flags;
  st->priority = priority;
  s.devices[static_cast<std::size_t>(d)].streams.push_back(st);
  return st;
}

stream_ptr legacy_stream(simulator& s, int d) {
  device_state& dev = s.devices[static_cast<std::size_t>(d)];
  if (!dev.legacy) {
    dev.legacy = make_stream(s, d, stream_kind::legacy, 0, 0);
    dev.legacy->handle = reinterpret_cast<std::uintptr_t>(cudaStreamLegacy);
  }
  return dev.legacy;
}

/// A thread's per-thread default streams end with the thread (a later thread with the same id gets new ones).
struct per_thread_streams_owner {
  ~per_thread_streams_owner() {
    simulator& s = sim();
    std::lock_guard<std::mutex> lock(s.mutex);
    for (auto it = s.per_thread.begin(); it != s.per_thread.end();) {
      if (it->first.first == std::this_thread::get_id()) {
        it->second->destroyed = true;
        it = s.per_thread.erase(it);
      } else {
        ++it;
      }
    }
  }
};

stream_ptr per_thread_stream(simulator& s, int d) {
  thread_local per_thread_streams_owner owner;
  (void)owner;
  auto& st = s.per_thread[{std::this_thread::get_id(), d}];
  if (!st) {
    st = make_stream(s, d, stream_kind::per_thread, 0, 0);
    st->handle = reinterpret_cast<std::uintptr_t>(cudaStreamPerThread);
  }
  return st;
}

/// The stream a handle names: 0 is the legacy stream (the per-thread stream in _ptsz entry points), cudaStreamLegacy
/// and cudaStreamPerThread belong to the current device. A destroyed or unknown handle is a violation.
cudaError_t resolve_stream(call& c, cudaStream_t handle, bool ptsz, stream_ptr& out, bool needs_context = true) {
  const auto h = reinterpret_cast<std::uintptr_t>(handle);
  if (h == 0 || h == 1 || h == 2) {
    const int d = needs_context ? context_device(c) : current_ordinal();
    if (!valid_device(c.s, d)) return c.result(c.s.no_devices_result);
    const bool per_thread = h == 2 || (h == 0 && ptsz);
    out = per_thread ? per_thread_stream(c.s, d) : legacy_stream(c.s, d);
    return cudaSuccess;
  }
  out = c.s.streams.find(h);
  if (out) return cudaSuccess;
  if (c.s.streams.was_issued(h))
    return c.violation(cudaErrorInvalidResourceHandle, "use of a destroyed stream " + hex(h));
  return c.violation(cudaErrorInvalidResourceHandle, "use of an invalid stream handle " + hex(h));
}

/// A blocking stream of the device is being captured: the legacy stream would join it implicitly (illegal).
std::shared_ptr<capture_state> capture_on_device(simulator& s, int d) {
  for (const auto& st : s.devices[static_cast<std::size_t>(d)].streams) {
    if (st->capture && st->blocking()) return st->capture;
  }
  return nullptr;
}

/// Appends work to a stream: while the stream is captured the work is recorded into the capture instead of run.
cudaError_t enqueue(call& c, const stream_ptr& st, std::shared_ptr<op> o) {
  simulator& s = c.s;
  if (st->capture) {
    if (st->capture->invalidated) return c.result(cudaErrorStreamCaptureInvalidated);
    st->capture->ops.push_back(*o);  // what it does, without its state in this stream
    auto& m = st->capture->members[st.get()];
    ++m.work;
    ++m.steps;
    return cudaSuccess;
  }
  device_state& dev = s.devices[static_cast<std::size_t>(st->device)];
  if (st->kind == stream_kind::legacy) {
    if (auto cap = capture_on_device(s, st->device)) {
      cap->invalidated = true;
      return c.violation(cudaErrorStreamCaptureImplicit,
                         "work on the legacy default stream while a blocking stream of its device is captured");
    }
    for (const auto& other : dev.streams) {
      if (other != st && other->blocking() && other->tail && !other->tail->done) o->deps.push_back(other->tail);
    }
  } else if (st->blocking() && dev.legacy && dev.legacy->tail && !dev.legacy->tail->done) {
    o->deps.push_back(dev.legacy->tail);
  }
  o->state->stream_id = st->id;
  o->state->seq = s.next_op_seq++;
  st->tail = o->state;
  st->queue.push_back(std::move(o));
  start_workers(s, st->device);
  s.changed.notify_all();
  return cudaSuccess;
}

bool deps_done(const op& o) {
  for (const auto& d : o.deps) {
    if (!d->done) return false;
  }
  return true;
}

void worker_loop(int device, op_kind kind) {
  simulator& s = sim();
  std::unique_lock<std::mutex> lock(s.mutex);
  for (;;) {
    stream_ptr st;
    std::shared_ptr<op> o;
    s.changed.wait(lock, [&] {
      for (const auto& candidate : s.devices[static_cast<std::size_t>(device)].streams) {
        if (candidate->running || candidate->queue.empty()) continue;
        const auto& head = candidate->queue.front();
        if (head->kind != kind || !deps_done(*head)) continue;
        st = candidate;
        o = head;
        return true;
      }
      return false;
    });
    st->queue.pop_front();
    st->running = true;
    const bool legal = !o->precheck || o->precheck();
    const bool checked = legal && o->precheck && o->work;
    if (checked) ++s.checked_ops_running;
    lock.unlock();
    if (legal && o->work) {
      t_in_host_function = kind == op_kind::host;
      o->work();
      t_in_host_function = false;
    }
    lock.lock();
    if (checked) --s.checked_ops_running;
    o->state->done = true;
    o->state->completed_at = clock_type::now();
    st->running = false;
    auto& list = s.devices[static_cast<std::size_t>(device)].streams;
    list.erase(std::remove_if(list.begin(), list.end(),
                              [](const stream_ptr& x) { return x->destroyed && x->queue.empty() && !x->running; }),
               list.end());
    s.changed.notify_all();
  }
}

/// Waits (releasing the lock) until every state in `states` is done.
void wait_for(call& c, const std::vector<state_ptr>& states) {
  c.s.changed.wait(c.lock, [&] {
    for (const auto& st : states) {
      if (st && !st->done) return false;
    }
    return true;
  });
}

/// Waits (releasing the lock) until no copy or memset that passed its alive_check is running: memory freed without
/// waiting for the device's work (cudaFree of cudaMallocAsync memory) is never freed under the simulator's memcpy.
void wait_for_running_copies(call& c) {
  c.s.changed.wait(c.lock, [&] { return c.s.checked_ops_running == 0; });
}

std::vector<state_ptr> device_tails(simulator& s, int d) {
  std::vector<state_ptr> tails;
  for (const auto& st : s.devices[static_cast<std::size_t>(d)].streams) {
    if (st->tail) tails.push_back(st->tail);
  }
  return tails;
}

/// What synchronizing (or querying) `st` waits for: its work, and for the legacy stream the work of every blocking
/// stream of its device too (an action on the legacy stream first waits on all blocking streams: CUDA's "Stream
/// synchronization behavior"; its query and synchronize alike join a blocking capture, measured on an H200).
std::vector<state_ptr> synchronized_states(simulator& s, const stream_obj& st) {
  std::vector<state_ptr> states{st.tail};
  if (st.kind == stream_kind::legacy) {
    for (const auto& other : s.devices[static_cast<std::size_t>(st.device)].streams) {
      if (other->blocking() && other->tail) states.push_back(other->tail);
    }
  }
  return states;
}

/// Potentially unsafe calls are prohibited while this thread's own capture (begun in global or thread-local mode) is
/// underway, or another thread's begun in global mode while this thread's mode is global; a thread in thread-local
/// mode ignores other threads' captures, one in relaxed mode every capture (cuda_runtime_api.h,
/// cudaThreadExchangeStreamCaptureMode). Which calls are unsafe was measured on an
/// H200 (tests/graph/gpu_capture_rules_test.cpp, bench/results/gpu-20261129-2214-H200-capture-rules.md): allocating
/// and freeing (cudaMalloc/Free, cudaMallocHost/FreeHost, cudaHostRegister/Unregister, and cudaMallocAsync/FreeAsync
/// on a stream that is not captured), cudaMemPoolTrimTo, cudaGraphInstantiate and cudaGraphExecDestroy, and every wait
/// or query (cudaDeviceSynchronize, cudaStreamSynchronize/Query, cudaEventSynchronize/Query). cudaDeviceSynchronize
/// stays prohibited in relaxed mode too (`even_relaxed`), and during any capture of the device's streams whatever
/// the modes (cudaDeviceSynchronize itself: measured on an H100 for captures in global, thread-local and relaxed
/// mode, from the capturing thread and others in every mode); other devices' captures follow the modes' rules (not
/// measured: the H100 had one GPU).
std::shared_ptr<capture_state> prohibiting_capture(simulator& s, bool even_relaxed = false) {
  if (t_capture_mode == cudaStreamCaptureModeRelaxed && !even_relaxed) return nullptr;
  for (const auto& cap : s.captures) {
    if (cap->mode != cudaStreamCaptureModeRelaxed && cap->thread == std::this_thread::get_id()) return cap;
    const bool thread_global = t_capture_mode == cudaStreamCaptureModeGlobal || even_relaxed;
    if (cap->mode == cudaStreamCaptureModeGlobal && thread_global) return cap;
  }
  return nullptr;
}

cudaError_t unsafe_during_capture(call& c, bool even_relaxed = false) {
  if (auto cap = prohibiting_capture(c.s, even_relaxed)) {
    cap->invalidated = true;
    return c.violation(cudaErrorStreamCaptureUnsupported,
                       c.function + " is not permitted while a stream capture is underway (capture " +
                           std::to_string(cap->id) + " is invalidated)");
  }
  return cudaSuccess;
}

// ------------------------------------------------------------------------------------------------------------------
// Memory
// ------------------------------------------------------------------------------------------------------------------

const region* find_region(const simulator& s, const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  auto it = s.regions.upper_bound(a);
  if (it == s.regions.begin()) return nullptr;
  --it;
  if (a >= it->first && a < it->first + std::max<std::size_t>(it->second.size, 1)) return &it->second;
  return nullptr;
}

constexpr std::size_t vmm_granularity = std::size_t{2} << 20;

/// Whether [p, p + n) of a reserved range lies on mapped pages with access granted.
bool pages_accessible(const simulator& s, std::uintptr_t p, std::size_t n) {
  for (std::uintptr_t page = p / vmm_granularity * vmm_granularity; page < p + std::max<std::size_t>(n, 1);
       page += vmm_granularity) {
    const auto it = s.vmm_pages.find(page);
    if (it == s.vmm_pages.end() || it->second.access == 0) return false;
  }
  return true;
}

enum class location { device, host };

location locate(const simulator& s, const void* p) {
  const region* r = find_region(s, p);
  return r != nullptr && r->kind == region_kind::device ? location::device : location::host;
}

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

void* allocate_host_memory(std::size_t bytes) {
  return std::aligned_alloc(4096, round_up(std::max<std::size_t>(bytes, 1), 4096));
}

/// Checks a copy's pointers against its kind and the allocations they fall in.
cudaError_t check_copy(call& c, void* dst, const void* src, std::size_t n, cudaMemcpyKind kind) {
  const location d = locate(c.s, dst);
  const location sl = locate(c.s, src);
  bool ok = true;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      ok = d == location::device && sl == location::host;
      break;
    case cudaMemcpyDeviceToHost:
      ok = d == location::host && sl == location::device;
      break;
    case cudaMemcpyDeviceToDevice:
      ok = d == location::device && sl == location::device;
      break;
    case cudaMemcpyHostToHost:
      ok = d == location::host && sl == location::host;
      break;
    case cudaMemcpyDefault:
      break;
    default:
      return c.violation(cudaErrorInvalidMemcpyDirection, "unknown cudaMemcpyKind");
  }
  if (!ok) {
    return c.violation(cudaErrorInvalidValue, "the copy's kind (" + std::to_string(static_cast<int>(kind)) +
                                                  ") contradicts its pointers (destination " +
                                                  (d == location::device ? "device" : "host") + ", source " +
                                                  (sl == location::device ? "device" : "host") + ")");
  }
  for (const void* p : {static_cast<const void*>(dst), src}) {
    const region* r = find_region(c.s, p);
    if (r != nullptr && r->virtual_range && !pages_accessible(c.s, reinterpret_cast<std::uintptr_t>(p), n)) {
      return c.violation(cudaErrorIllegalAddress, "a copy of " + std::to_string(n) + " bytes at " +
                                                      hex(reinterpret_cast<std::uintptr_t>(p)) +
                                                      " touches pages of a reserved range that are not mapped with "
                                                      "access (cuMemMap, cuMemSetAccess)");
    }
    if (r != nullptr && r->kind != region_kind::registered &&
        reinterpret_cast<std::uintptr_t>(p) + n > r->base + r->size) {
      return c.violation(cudaErrorInvalidValue,
                         "a copy of " + std::to_string(n) + " bytes at " + hex(reinterpret_cast<std::uintptr_t>(p)) +
                             " overruns its allocation of " + std::to_string(r->size) + " bytes");
    }
  }
  return cudaSuccess;
}

/// At execution: device memory a copy touches must still be allocated (else: an illegal address, which is sticky).
std::function<bool()> alive_check(void* dst, const void* src, std::size_t n, std::string what) {
  const bool dst_device = locate(sim(), dst) == location::device;
  const bool src_device = src != nullptr && locate(sim(), src) == location::device;
  return [dst, src, n, dst_device, src_device, what] {
    simulator& s = sim();
    auto dead = [&](const void* p) {
      const region* r = find_region(s, p);
      return r == nullptr || r->kind != region_kind::device || (r->graph_allocation && !r->graph_live) ||
             reinterpret_cast<std::uintptr_t>(p) + n > r->base + r->size ||
             (r->virtual_range && !pages_accessible(s, reinterpret_cast<std::uintptr_t>(p), n));
    };
    if ((dst_device && dead(dst)) || (src_device && dead(src))) {
      record_violation(s, what, cudaErrorIllegalAddress, "the work ran after device memory it uses was freed");
      s.sticky = cudaErrorIllegalAddress;
      return false;
    }
    return true;
  };
}

cudaError_t memcpy_async(call& c, void* dst, const void* src, std::size_t n, cudaMemcpyKind kind, cudaStream_t h,
                         bool ptsz, bool synchronous) {
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, h, ptsz, st); e != cudaSuccess) return e;
  require_current_context(c);
  ensure_context(c, st->device);
  if (n == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return c.violation(cudaErrorInvalidValue, "null pointer in a copy");
  if (cudaError_t e = check_copy(c, dst, src, n, kind); e != cudaSuccess) return e;
  const region* src_region = find_region(c.s, src);
  const region* dst_region = find_region(c.s, dst);
  const bool pageable_source = src_region == nullptr && locate(c.s, dst) == location::device;
  const bool pageable_destination = dst_region == nullptr && locate(c.s, src) == location::device;
  auto o = std::make_shared<op>();
  o->what = c.function;
  o->precheck = alive_check(dst, src, n, c.function);
  if (pageable_source && !st->capture) {
    // The runtime stages pageable memory before returning: the caller may reuse the source at once.
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + n);
    o->work = [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); };
  } else {
    o->work = [dst, src, n] { std::memmove(dst, src, n); };
  }
  const state_ptr done = o->state;
  if (cudaError_t e = enqueue(c, st, std::move(o)); e != cudaSuccess) return e;
  if ((synchronous || pageable_destination) && !st->capture) {
    // A copy into pageable memory returns when it has completed (as the runtime's does).
    wait_for(c, {done});
  }
  return cudaSuccess;
}

cudaError_t memset_async(call& c, void* p, int value, std::size_t n, cudaStream_t h, bool ptsz, bool synchronous) {
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, h, ptsz, st); e != cudaSuccess) return e;
  require_current_context(c);
  ensure_context(c, st->device);
  if (n == 0) return cudaSuccess;
  const region* r = find_region(c.s, p);
  if (r == nullptr || r->kind != region_kind::device) {
    return c.violation(cudaErrorInvalidValue, "cudaMemset on memory that is not device memory");
  }
  if (reinterpret_cast<std::uintptr_t>(p) + n > r->base + r->size) {
    return c.violation(cudaErrorInvalidValue, "a memset overruns its allocation");
  }
  auto o = std::make_shared<op>();
  o->what = c.function;
  o->precheck = alive_check(p, nullptr, n, c.function);
  o->work = [p, value, n] { std::memset(p, value, n); };
  const state_ptr done = o->state;
  if (cudaError_t e = enqueue(c, st, std::move(o)); e != cudaSuccess) return e;
  if (synchronous && !st->capture) wait_for(c, {done});
  return cudaSuccess;
}

/// cudaMemcpyPeerAsync: device memory of `dst_device` from device memory of `src_device`, in the order of the stream
/// (of any device). It needs no peer access (the runtime stages the copy through the host where there is none).
cudaError_t memcpy_peer_async(call& c, void* dst, int dst_device, const void* src, int src_device, std::size_t n,
                              cudaStream_t h) {
  if (!valid_device(c.s, dst_device) || !valid_device(c.s, src_device)) return c.result(cudaErrorInvalidDevice);
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, h, false, st); e != cudaSuccess) return e;  // no _ptsz entry point exists
  require_current_context(c);
  ensure_context(c, st->device);
  if (n == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return c.violation(cudaErrorInvalidValue, "null pointer in a peer copy");
  struct side {
    const char* role;
    const void* pointer;
    int device;
  };
  for (const side& x : {side{"destination", dst, dst_device}, side{"source", src, src_device}}) {
    const region* r = find_region(c.s, x.pointer);
    if (r == nullptr || r->kind != region_kind::device) {
      return c.violation(cudaErrorInvalidValue, std::string("the ") + x.role + " of a peer copy (" +
                                                    hex(reinterpret_cast<std::uintptr_t>(x.pointer)) +
                                                    ") is not device memory");
    }
    if (r->device != x.device) {
      return c.violation(cudaErrorInvalidValue, std::string("the ") + x.role +
                                                    " of a peer copy is memory of cuda:" + std::to_string(r->device) +
                                                    ", not of cuda:" + std::to_string(x.device) + " as the call says");
    }
  }
  if (cudaError_t e = check_copy(c, dst, src, n, cudaMemcpyDeviceToDevice); e != cudaSuccess) return e;
  ensure_context(c, dst_device);  // the copy runs between both devices' memory
  ensure_context(c, src_device);
  auto o = std::make_shared<op>();
  o->what = c.function;
  o->precheck = alive_check(dst, src, n, c.function);
  o->work = [dst, src, n] { std::memmove(dst, src, n); };
  return enqueue(c, st, std::move(o));
}

// ------------------------------------------------------------------------------------------------------------------
// Driver entry points (cudaGetDriverEntryPoint)
// ------------------------------------------------------------------------------------------------------------------

CUcontext context_handle(int d) {
  return reinterpret_cast<CUcontext>(std::uintptr_t{0xC0000000} + 0x1000u * static_cast<unsigned>(d));
}

CUresult CUDAAPI sim_cuCtxGetCurrent(CUcontext* ctx) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  ++sim().call_counts["cuCtxGetCurrent"];
  *ctx = t_current >= 0 ? context_handle(t_current) : nullptr;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI sim_cuCtxGetDevice(CUdevice* device) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  ++sim().call_counts["cuCtxGetDevice"];
  if (t_current < 0) return CUDA_ERROR_INVALID_CONTEXT;
  *device = t_current;
  return CUDA_SUCCESS;
}

/// cuCtxGetDevice as CUDA 13.0 has it: the device of a given context (a context handle names its device here).
CUresult CUDAAPI sim_cuCtxGetDevice_v2(CUdevice* device, CUcontext ctx) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  initialize_locked(s);
  if (CUresult fault = due_driver_fault(s, "cuCtxGetDevice_v2"); fault != CUDA_SUCCESS) return fault;
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (ctx == nullptr) {
    if (t_current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    *device = t_current;
    return CUDA_SUCCESS;
  }
  const auto offset = reinterpret_cast<std::uintptr_t>(ctx) - reinterpret_cast<std::uintptr_t>(context_handle(0));
  const auto d = static_cast<int>(offset / 0x1000u);
  if (offset % 0x1000u != 0 || !valid_device(s, d) || !s.devices[static_cast<std::size_t>(d)].context) {
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  *device = d;
  return CUDA_SUCCESS;
}

/// cuStreamGetCtx: the context of a created stream (a default stream: the current one). Unlike cudaStreamGetDevice,
/// permitted while the stream is captured (measured on an H200). Of the legacy stream while a blocking stream of
/// the device is captured it fails and invalidates that capture (measured); the error code is assumed
/// (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, the runtime's 906): the measuring test mapped every driver failure to one.
CUresult CUDAAPI sim_cuStreamGetCtx(CUstream stream, CUcontext* ctx) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  initialize_locked(s);
  if (CUresult fault = due_driver_fault(s, "cuStreamGetCtx"); fault != CUDA_SUCCESS) return fault;
  if (t_in_host_function) {
    record_violation(s, "cuStreamGetCtx", cudaErrorNotPermitted, "CUDA call from inside a host function");
    return CUDA_ERROR_NOT_PERMITTED;
  }
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const auto h = reinterpret_cast<std::uintptr_t>(stream);
  if (h == 0 || h == 1 || h == 2) {
    if (t_current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (h != 2) {  // the legacy stream: as the runtime's questions, it would join a blocking capture (an H200)
      if (auto cap = capture_on_device(s, t_current)) {
        cap->invalidated = true;
        record_violation(s, "cuStreamGetCtx", cudaErrorStreamCaptureImplicit,
                         "asking the legacy stream's context during a blocking capture");
        return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
      }
    }
    *ctx = context_handle(t_current);
    return CUDA_SUCCESS;
  }
  const stream_ptr st = s.streams.find(h);
  if (!st) {
    record_violation(
        s, "cuStreamGetCtx", cudaErrorInvalidResourceHandle,
        (s.streams.was_issued(h) ? "use of a destroyed stream " : "use of an invalid stream handle ") + hex(h));
    return CUDA_ERROR_INVALID_HANDLE;
  }
  *ctx = context_handle(st->device);
  return CUDA_SUCCESS;
}

/// cuStreamGetCtx as CUDA 12.5 has it: with the green context, none here.
CUresult CUDAAPI sim_cuStreamGetCtx_v2(CUstream stream, CUcontext* ctx, CUgreenCtx* green) {
  if (green != nullptr) *green = nullptr;
  return sim_cuStreamGetCtx(stream, ctx);
}

CUresult CUDAAPI sim_cuDeviceGet(CUdevice* device, int ordinal) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  initialize_locked(s);
  if (!valid_device(s, ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI sim_cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  initialize_locked(s);
  ++s.call_counts["cuDevicePrimaryCtxGetState"];
  if (!valid_device(s, dev)) return CUDA_ERROR_INVALID_DEVICE;
  *flags = 0;
  *active = s.devices[static_cast<std::size_t>(dev)].context ? 1 : 0;
  return CUDA_SUCCESS;
}

// Virtual memory management: a reservation is host address space without access (PROT_NONE); cuMemMap +
// cuMemSetAccess make a granule readable and writable; cuMemUnmap discards its contents and takes the access back.
// Physical allocations count against the device's memory like cudaMalloc's.

CUresult vmm_check_prop(simulator& s, const CUmemAllocationProp* prop) {
  if (prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_device(s, prop->location.id)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!s.devices[static_cast<std::size_t>(prop->location.id)].config.virtual_memory) return CUDA_ERROR_NOT_SUPPORTED;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI sim_cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice dev) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  initialize_locked(s);
  ++s.call_counts["cuDeviceGetAttribute"];
  if (value == nullptr || !valid_device(s, dev)) return CUDA_ERROR_INVALID_VALUE;
  if (attribute != CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) {
    record_violation(s, "cuDeviceGetAttribute", cudaErrorNotSupported,
                     "device attribute " + std::to_string(static_cast<int>(attribute)) + " is not simulated");
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  *value = s.devices[static_cast<std::size_t>(dev)].config.virtual_memory ? 1 : 0;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI sim_cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                                   CUmemAllocationGranularity_flags) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  initialize_locked(s);
  if (CUresult fault = due_driver_fault(s, "cuMemGetAllocationGranularity"); fault != CUDA_SUCCESS) return fault;
  if (granularity == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult r = vmm_check_prop(s, prop); r != CUDA_SUCCESS) return r;
  *granularity = vmm_granularity;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI sim_cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                         unsigned long long flags) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  if (CUresult fault = due_driver_fault(s, "cuMemAddressReserve"); fault != CUDA_SUCCESS) return fault;
  if (t_current < 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (ptr == nullptr || size == 0 || size % vmm_granularity != 0 || addr != 0 || flags != 0 ||
      (alignment != 0 && alignment % vmm_granularity != 0)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const std::size_t align = std::max(alignment, vmm_granularity);
  void* raw = mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const auto base = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t start = round_up(base, align);
  if (start > base) munmap(raw, start - base);
  if (start + size < base + size + align) munmap(reinterpret_cast<void*>(start + size), base + align - start);
  region r;
  r.base = start;
  r.size = size;
  r.kind = region_kind::device;
  r.device = t_current;
  r.virtual_range = true;
  s.regions[start] = r;
  *ptr = static_cast<CUdeviceptr>(start);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI sim_cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  if (CUresult fault = due_driver_fault(s, "cuMemAddressFree"); fault != CUDA_SUCCESS) return fault;  // counts it
  const auto it = s.regions.find(static_cast<std::uintptr_t>(ptr));
  if (it == s.regions.end() || !it->second.virtual_range || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;
  const auto mapped = s.vmm_pages.lower_bound(static_cast<std::uintptr_t>(ptr));
  if (mapped != s.vmm_pages.end() && mapped->first < ptr + size) {
    record_violation(s, "cuMemAddressFree", cudaErrorInvalidValue, "a reserved range is freed with pages mapped");
    return CUDA_ERROR_INVALID_VALUE;
  }
  munmap(reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr)), size);
  s.regions.erase(it);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI sim_cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                                 unsigned long long flags) {
  const call_depth depth;
  run_due_action(sim(), "cuMemCreate");
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  if (CUresult fault = due_driver_fault(s, "cuMemCreate"); fault != CUDA_SUCCESS) return fault;
  if (t_current < 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (handle == nullptr || size == 0 || size % vmm_granularity != 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult r = vmm_check_prop(s, prop); r != CUDA_SUCCESS) return r;
  device_state& dev = s.devices[static_cast<std::size_t>(prop->location.id)];
  if (size > dev.config.total_memory - std::min(dev.used, dev.config.total_memory)) return CUDA_ERROR_OUT_OF_MEMORY;
  dev.used += size;
  const unsigned long long h = s.next_vmm_handle++;
  s.vmm_allocations[h] = vmm_allocation{prop->location.id, size, false, 0};
  *handle = h;
  return CUDA_SUCCESS;
}

/// Frees a physical allocation once it is released and mapped nowhere.
void vmm_collect(simulator& s, unsigned long long h) {
  const auto it = s.vmm_allocations.find(h);
  if (it == s.vmm_allocations.end() || !it->second.released || it->second.mappings != 0) return;
  s.devices[static_cast<std::size_t>(it->second.device)].used -= it->second.size;
  s.vmm_allocations.erase(it);
}

CUresult CUDAAPI sim_cuMemRelease(CUmemGenericAllocationHandle handle) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  if (CUresult fault = due_driver_fault(s, "cuMemRelease"); fault != CUDA_SUCCESS) return fault;  // counts it
  const auto it = s.vmm_allocations.find(handle);
  if (it == s.vmm_allocations.end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
  it->second.released = true;
  vmm_collect(s, handle);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI sim_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                              unsigned long long flags) {
  const call_depth depth;
  run_due_action(sim(), "cuMemMap");
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  if (CUresult fault = due_driver_fault(s, "cuMemMap"); fault != CUDA_SUCCESS) return fault;
  const auto a = s.vmm_allocations.find(handle);
  const region* r = find_region(s, reinterpret_cast<const void*>(static_cast<std::uintptr_t>(ptr)));
  if (a == s.vmm_allocations.end() || a->second.released || offset != 0 || flags != 0 || size != a->second.size ||
      ptr % vmm_granularity != 0 || r == nullptr || !r->virtual_range || ptr + size > r->base + r->size) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (CUdeviceptr page = ptr; page < ptr + size; page += vmm_granularity) {
    if (s.vmm_pages.count(static_cast<std::uintptr_t>(page)) != 0) {
      record_violation(s, "cuMemMap", cudaErrorInvalidValue, "cuMemMap over a mapped page");
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  for (CUdeviceptr page = ptr; page < ptr + size; page += vmm_granularity) {
    s.vmm_pages[static_cast<std::uintptr_t>(page)] = vmm_page{handle, 0, ptr, size};
  }
  ++a->second.mappings;
  return CUDA_SUCCESS;
}

/// Grants (read/write) or takes back (none) the access of each descriptor's device to mapped pages. A device other
/// than the memory's own must be able to reach it (cudaDeviceCanAccessPeer); peer access need not be enabled, as
/// virtual memory's access is its own.
CUresult CUDAAPI sim_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  const call_depth depth;
  run_due_action(sim(), "cuMemSetAccess");
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  if (CUresult fault = due_driver_fault(s, "cuMemSetAccess"); fault != CUDA_SUCCESS) return fault;
  if (desc == nullptr || count == 0 || ptr % vmm_granularity != 0 || size == 0 || size % vmm_granularity != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (std::size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_device(s, desc[i].location.id) ||
        (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE)) {
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  for (CUdeviceptr page = ptr; page < ptr + size; page += vmm_granularity) {
    const auto it = s.vmm_pages.find(static_cast<std::uintptr_t>(page));
    if (it == s.vmm_pages.end()) return CUDA_ERROR_INVALID_VALUE;
    const int owner = s.vmm_allocations[it->second.handle].device;
    for (std::size_t i = 0; i < count; ++i) {
      if (desc[i].location.id != owner && desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE &&
          !peer_capable(s, desc[i].location.id, owner)) {
        record_violation(s, "cuMemSetAccess", cudaErrorInvalidDevice,
                         "access for cuda:" + std::to_string(desc[i].location.id) +
                             " to memory of cuda:" + std::to_string(owner) + ", which it cannot reach");
        return CUDA_ERROR_INVALID_DEVICE;
      }
    }
  }
  for (CUdeviceptr page = ptr; page < ptr + size; page += vmm_granularity) {
    std::uint64_t& access = s.vmm_pages[static_cast<std::uintptr_t>(page)].access;
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint64_t bit = std::uint64_t{1} << desc[i].location.id;
      access = desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? (access | bit) : (access & ~bit);
    }
    // The host stands in for every device: the pages are readable while any device may access them.
    mprotect(reinterpret_cast<void*>(static_cast<std::uintptr_t>(page)), vmm_granularity,
             access != 0 ? PROT_READ | PROT_WRITE : PROT_NONE);
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI sim_cuMemUnmap(CUdeviceptr ptr, size_t size) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  if (CUresult fault = due_driver_fault(s, "cuMemUnmap"); fault != CUDA_SUCCESS) return fault;
  if (ptr % vmm_granularity != 0 || size == 0 || size % vmm_granularity != 0) return CUDA_ERROR_INVALID_VALUE;
  for (CUdeviceptr page = ptr; page < ptr + size; page += vmm_granularity) {
    const auto it = s.vmm_pages.find(static_cast<std::uintptr_t>(page));
    if (it == s.vmm_pages.end()) {
      record_violation(s, "cuMemUnmap", cudaErrorInvalidValue, "cuMemUnmap of a page that is not mapped");
      return CUDA_ERROR_INVALID_VALUE;
    }
    // cuda.h: "cuMemUnmap cannot unmap a sub-range of an address range mapped by cuMemCreate / cuMemMap".
    if (it->second.mapping < ptr || it->second.mapping + it->second.mapping_size > ptr + size) {
      record_violation(s, "cuMemUnmap", cudaErrorInvalidValue,
                       "cuMemUnmap of part of a mapping (" + std::to_string(size) + " of its " +
                           std::to_string(it->second.mapping_size) + " bytes)");
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  void* at = reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr));
  madvise(at, size, MADV_DONTNEED);  // the contents go with the mapping
  mprotect(at, size, PROT_NONE);
  for (CUdeviceptr page = ptr; page < ptr + size; page += vmm_granularity) {
    const auto it = s.vmm_pages.find(static_cast<std::uintptr_t>(page));
    const unsigned long long h = it->second.handle;
    const bool mapping_start = it->second.mapping == page;
    s.vmm_pages.erase(it);
    // Each mapping ends once (an allocation may be mapped at several addresses; it goes with its last mapping).
    if (auto a = s.vmm_allocations.find(h); mapping_start && a != s.vmm_allocations.end()) {
      --a->second.mappings;
      vmm_collect(s, h);
    }
  }
  return CUDA_SUCCESS;
}

/// The entry point of `symbol` in the form CUDA `version` has it (13000 for cudaGetDriverEntryPoint, as this
/// runtime's).
void* driver_function(const char* symbol, unsigned version) {
  const std::string name(symbol);
  if (name == "cuCtxGetCurrent") return reinterpret_cast<void*>(&sim_cuCtxGetCurrent);
  if (name == "cuCtxGetDevice") {
    return version >= 13000 ? reinterpret_cast<void*>(&sim_cuCtxGetDevice_v2)
                            : reinterpret_cast<void*>(&sim_cuCtxGetDevice);
  }
  if (name == "cuStreamGetCtx") {
    return version >= 12050 ? reinterpret_cast<void*>(&sim_cuStreamGetCtx_v2)
                            : reinterpret_cast<void*>(&sim_cuStreamGetCtx);
  }
  if (name == "cuDeviceGet") return reinterpret_cast<void*>(&sim_cuDeviceGet);
  if (name == "cuDevicePrimaryCtxGetState") return reinterpret_cast<void*>(&sim_cuDevicePrimaryCtxGetState);
  if (name == "cuDeviceGetAttribute") return reinterpret_cast<void*>(&sim_cuDeviceGetAttribute);
  if (name == "cuMemGetAllocationGranularity") return reinterpret_cast<void*>(&sim_cuMemGetAllocationGranularity);
  if (name == "cuMemAddressReserve") return reinterpret_cast<void*>(&sim_cuMemAddressReserve);
  if (name == "cuMemAddressFree") return reinterpret_cast<void*>(&sim_cuMemAddressFree);
  if (name == "cuMemCreate") return reinterpret_cast<void*>(&sim_cuMemCreate);
  if (name == "cuMemRelease") return reinterpret_cast<void*>(&sim_cuMemRelease);
  if (name == "cuMemMap") return reinterpret_cast<void*>(&sim_cuMemMap);
  if (name == "cuMemUnmap") return reinterpret_cast<void*>(&sim_cuMemUnmap);
  if (name == "cuMemSetAccess") return reinterpret_cast<void*>(&sim_cuMemSetAccess);
  return nullptr;
}

cudaError_t get_entry_point(const char* symbol, void** function, unsigned version,
                            cudaDriverEntryPointQueryResult* status) {
  CUDASIM_ENTER("cudaGetDriverEntryPoint");
  if (symbol == nullptr || function == nullptr) return c.result(cudaErrorInvalidValue);
  *function = driver_function(symbol, version);
  if (status != nullptr) *status = *function ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

// ------------------------------------------------------------------------------------------------------------------
// Implementations shared by the legacy and per-thread (_ptsz) entry points
// ------------------------------------------------------------------------------------------------------------------

cudaError_t stream_synchronize(cudaStream_t h, bool ptsz, const char* name) {
  CUDASIM_ENTER(name);
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, h, ptsz, st); e != cudaSuccess) return e;
  require_current_context(c);  // as PyTorch's CUDAStream::synchronize guards its device: the runtime needs one
  if (st->capture) {
    st->capture->invalidated = true;
    return c.violation(cudaErrorStreamCaptureUnsupported, "synchronizing a stream that is being captured");
  }
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  if (st->kind == stream_kind::legacy) {
    if (auto cap = capture_on_device(c.s, st->device)) {
      cap->invalidated = true;
      return c.violation(cudaErrorStreamCaptureImplicit, "synchronizing the legacy stream during a capture");
    }
  }
  const std::uint64_t enqueued_before = c.s.next_op_seq;
  const std::vector<state_ptr> wait = synchronized_states(c.s, *st);
  wait_for(c, wait);
  for (const auto& w : wait) observe(c.s, w);
  // Blocking streams destroyed and drained before the call are not in `wait`: their work is done, and the legacy
  // stream's synchronization observes it as that of the others.
  if (st->kind == stream_kind::legacy) observe_device(c.s, st->device, enqueued_before, true);
  pool_release_at_synchronize(c.s, st->device);
  return c.s.sticky != cudaSuccess ? c.result(c.s.sticky) : cudaSuccess;
}

cudaError_t stream_query(cudaStream_t h, bool ptsz, const char* name) {
  CUDASIM_ENTER(name);
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, h, ptsz, st); e != cudaSuccess) return e;
  require_current_context(c);  // as PyTorch's CUDAStream::query guards its device
  if (st->capture) {
    st->capture->invalidated = true;
    return c.violation(cudaErrorStreamCaptureUnsupported, "querying a stream that is being captured");
  }
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  if (st->kind == stream_kind::legacy) {  // as its synchronize, relaxed too (measured on an H200)
    if (auto cap = capture_on_device(c.s, st->device)) {
      cap->invalidated = true;
      return c.violation(cudaErrorStreamCaptureImplicit, "querying the legacy stream during a blocking capture");
    }
  }
  // Complete when a synchronize would return at once (the header: success is "equivalent to having called
  // cudaStreamSynchronize()"), the legacy stream's blocking streams included.
  const std::uint64_t enqueued_before = c.s.next_op_seq;
  const std::vector<state_ptr> states = synchronized_states(c.s, *st);
  if (!std::all_of(states.begin(), states.end(), [](const state_ptr& x) { return !x || x->done; })) {
    return cudaErrorNotReady;
  }
  for (const auto& x : states) observe(c.s, x);
  if (st->kind == stream_kind::legacy) observe_device(c.s, st->device, enqueued_before, true);  // as its synchronize
  return cudaSuccess;
}

cudaError_t launch_host_func(cudaStream_t h, cudaHostFn_t fn, void* data, bool ptsz, const char* name) {
  CUDASIM_ENTER(name);
  if (fn == nullptr) return c.result(cudaErrorInvalidValue);
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, h, ptsz, st); e != cudaSuccess) return e;
  require_current_context(c);
  auto o = std::make_shared<op>();
  o->kind = op_kind::host;
  o->what = name;
  o->work = [fn, data] { fn(data); };
  return enqueue(c, st, std::move(o));
}

cudaError_t event_record(cudaEvent_t e, cudaStream_t h, bool ptsz, const char* name) {
  CUDASIM_ENTER(name);
  auto ev = c.s.events.find(reinterpret_cast<std::uintptr_t>(e));
  if (!ev) return c.violation(cudaErrorInvalidResourceHandle, "record of a destroyed or invalid event");
  stream_ptr st;
  if (cudaError_t r = resolve_stream(c, h, ptsz, st); r != cudaSuccess) return r;
  require_current_context(c);
  if (st->device != ev->device) {
    return c.violation(cudaErrorInvalidResourceHandle,
                       "an event of cuda:" + std::to_string(ev->device) +
                           " recorded on a stream of cuda:" + std::to_string(st->device));
  }
  if (st->capture) {
    if (st->capture->invalidated) return c.result(cudaErrorStreamCaptureInvalidated);
    ev->capture = st->capture;
    const auto& m = st->capture->members[st.get()];
    ev->captured_on = st.get();
    ev->captured_after_work = m.work;
    ev->captured_after_steps = m.steps;
    ev->last.reset();
    return cudaSuccess;
  }
  auto o = std::make_shared<op>();
  o->what = name;
  const state_ptr marker = o->state;
  if (cudaError_t r = enqueue(c, st, std::move(o)); r != cudaSuccess) return r;
  ev->capture.reset();
  ev->last = marker;
  return cudaSuccess;
}

cudaError_t stream_wait_event(cudaStream_t h, cudaEvent_t e, unsigned flags, bool ptsz, const char* name) {
  CUDASIM_ENTER(name);
  if ((flags & ~unsigned{cudaEventWaitExternal}) != 0) return c.result(cudaErrorInvalidValue);  // undefined bits
  auto ev = c.s.events.find(reinterpret_cast<std::uintptr_t>(e));
  if (!ev) return c.violation(cudaErrorInvalidResourceHandle, "wait for a destroyed or invalid event");
  stream_ptr st;
  if (cudaError_t r = resolve_stream(c, h, ptsz, st); r != cudaSuccess) return r;
  require_current_context(c);
  if (ev->capture) {
    if (!ev->capture->active)
      return c.violation(cudaErrorStreamCaptureIsolation, "wait for an event of an ended capture");
    if (st->capture && st->capture != ev->capture) {
      st->capture->invalidated = true;
      return c.violation(cudaErrorStreamCaptureMerge, "a stream of one capture waits for an event of another");
    }
    if (st->kind == stream_kind::legacy) {
      // CUDA never captures the legacy stream (cudaStreamBeginCapture: "Capture may not be initiated if stream is
      // cudaStreamLegacy"; cudaStreamIsCapturing: "The legacy stream is not supported for stream capture"), so it
      // cannot join one as a fork. During a blocking capture the wait is legacy-stream work, refused as any (906).
      // Otherwise, measured on an H100 (tests/graph/gpu_capture_rules_test.cpp; non-blocking captures in global and
      // relaxed mode): refused with cudaErrorStreamCaptureImplicit as well, and the capture invalidated.
      if (auto cap = capture_on_device(c.s, st->device)) {
        cap->invalidated = true;
        return c.violation(cudaErrorStreamCaptureImplicit,
                           "a wait on the legacy default stream while a blocking stream of its device is captured");
      }
      ev->capture->invalidated = true;
      return c.violation(cudaErrorStreamCaptureImplicit,
                         "the legacy default stream waits for an event recorded in a capture (the legacy stream "
                         "cannot join a capture; capture " +
                             std::to_string(ev->capture->id) + " is invalidated)");
    }
    if (!st->capture) st->capture = ev->capture;  // the stream joins the capture (fork)
    auto& cap = *ev->capture;
    auto& waiter = cap.members[st.get()];
    ++waiter.steps;
    if (ev->captured_on != st.get()) {
      auto& source = cap.members[ev->captured_on];
      if (source.work == ev->captured_after_work) {  // the event follows the source's last work: joined here
        source.joined_into = st.get();
        source.joined_after_work = ev->captured_after_work;
        source.joined_after_steps = ev->captured_after_steps;
        source.joined_at = waiter.steps;
      }
    }
    return cudaSuccess;
  }
  if (st->capture && (flags & cudaEventWaitExternal) != 0) {
    // An event wait node: "Event is captured in the graph as an external event node" (driver_types.h); each launch
    // of the graph waits for the event's most recent record at that launch.
    auto o = std::make_shared<op>();
    o->what = std::string(name) + " (external event)";
    o->external_wait = ev;
    return enqueue(c, st, std::move(o));
  }
  if (st->capture) {
    st->capture->invalidated = true;
    return c.violation(cudaErrorStreamCaptureIsolation,
                       "a captured stream waits for an event recorded outside the capture");
  }
  if (st->kind == stream_kind::legacy) {  // refused even for a completed event, as work on the stream is (enqueue)
    if (auto cap = capture_on_device(c.s, st->device)) {
      cap->invalidated = true;
      return c.violation(cudaErrorStreamCaptureImplicit,
                         "a wait on the legacy default stream while a blocking stream of its device is captured");
    }
  }
  if (!ev->last || ev->last->done) return cudaSuccess;
  auto o = std::make_shared<op>();
  o->what = name;
  o->deps.push_back(ev->last);
  return enqueue(c, st, std::move(o));
}

cudaError_t stream_begin_capture(cudaStream_t h, cudaStreamCaptureMode mode, bool ptsz, const char* name) {
  CUDASIM_ENTER(name);
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, h, ptsz, st); e != cudaSuccess) return e;
  if (st->kind == stream_kind::legacy) {
    return c.violation(cudaErrorStreamCaptureUnsupported, "the legacy default stream cannot be captured");
  }
  if (st->capture) return c.violation(cudaErrorIllegalState, "the stream is already being captured");
  auto cap = std::make_shared<capture_state>();
  cap->id = c.s.next_capture_id++;
  cap->mode = mode;
  cap->thread = std::this_thread::get_id();
  cap->origin = st;
  st->capture = cap;
  c.s.captures.push_back(cap);
  return cudaSuccess;
}

cudaError_t stream_end_capture(cudaStream_t h, cudaGraph_t* graph, bool ptsz, const char* name) {
  CUDASIM_ENTER(name);
  if (graph == nullptr) return c.result(cudaErrorInvalidValue);
  *graph = nullptr;
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, h, ptsz, st); e != cudaSuccess) return e;
  auto cap = st->capture;
  if (!cap) return c.violation(cudaErrorIllegalState, "cudaStreamEndCapture on a stream that is not capturing");
  if (cap->origin != st) return c.violation(cudaErrorStreamCaptureUnmatched, "the capture began on another stream");
  // cudaStreamBeginCapture's header: "If mode is not cudaStreamCaptureModeRelaxed, cudaStreamEndCapture must be
  // called on this stream from the same thread." Measured on an H100 (global and thread-local captures): 908, the
  // capture still reported active and not invalidated, and its own thread's cudaStreamEndCapture then fails with
  // cudaErrorIllegalState and gives no graph. Whether the stream captures until then is not measured (it does here).
  if (cap->mode != cudaStreamCaptureModeRelaxed && cap->thread != std::this_thread::get_id()) {
    cap->ended_from_wrong_thread = true;
    return c.violation(cudaErrorStreamCaptureWrongThread,
                       "cudaStreamEndCapture from another thread than the one that began the capture (not relaxed)");
  }
  const bool unjoined = !cap->invalidated && cap->unjoined();
  for (auto& dev : c.s.devices) {
    for (auto& other : dev.streams) {
      if (other->capture == cap) other->capture.reset();
    }
  }
  cap->active = false;
  auto& list = c.s.captures;
  list.erase(std::remove(list.begin(), list.end(), cap), list.end());
  if (cap->invalidated) return c.result(cudaErrorStreamCaptureInvalidated);
  // The misuse was recorded when the other thread asked; this is its consequence, not a second violation.
  if (cap->ended_from_wrong_thread) return c.result(cudaErrorIllegalState);
  if (unjoined) {
    return c.violation(cudaErrorStreamCaptureUnjoined,
                       "a stream forked into the capture (it waited for an event recorded in it) was not joined back "
                       "into the origin stream after its last work");
  }
  auto g = std::make_shared<graph_obj>();
  g->ops = cap->ops;
  *graph = reinterpret_cast<cudaGraph_t>(c.s.graphs.add(g));
  return cudaSuccess;
}

cudaError_t stream_is_capturing(cudaStream_t h, cudaStreamCaptureStatus* status, unsigned long long* id, bool ptsz,
                                const char* name) {
  CUDASIM_ENTER(name);
  if (status == nullptr) return c.result(cudaErrorInvalidValue);
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, h, ptsz, st, false); e != cudaSuccess) return e;
  // The header documents this answer, which leaves the capture intact: the one way to ask, before using the legacy
  // stream, whether that would join a capture (so not a violation).
  if (st->kind == stream_kind::legacy && capture_on_device(c.s, st->device)) {
    return c.result(cudaErrorStreamCaptureImplicit);
  }
  *status = !st->capture
                ? cudaStreamCaptureStatusNone
                : (st->capture->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive);
  if (id != nullptr && st->capture) *id = st->capture->id;
  return cudaSuccess;
}

cudaError_t graph_launch(cudaGraphExec_t exec, cudaStream_t h, bool ptsz, const char* name) {
  CUDASIM_ENTER(name);
  auto g = c.s.execs.find(reinterpret_cast<std::uintptr_t>(exec));
  if (!g) return c.violation(cudaErrorInvalidResourceHandle, "launch of a destroyed or invalid graph executable");
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, h, ptsz, st); e != cudaSuccess) return e;
  // A graph cannot be launched into a stream that is being captured: CUDA returns cudaErrorStreamCaptureUnsupported
  // (900), in every capture mode, and, as for any operation a capture refuses, invalidates the capture (the CUDA
  // programming guide, "Stream Capture": "When an invalid operation is attempted during stream capture, any
  // associated capture graphs are invalidated"; reported with 900 from cudaGraphLaunch in a caller's capture by
  // onnxruntime PR #32081, measured on an H200 with CUDA 12.6; Warp's capture_launch documents the failure, and code
  // that must nest a graph adds a child graph node instead: cudaStreamGetCaptureInfo, cudaGraphAddChildGraphNode,
  // cudaStreamUpdateCaptureDependencies). No CUDA release up to 13.0 documents capturing a launch as a child graph
  // node. Nothing is enqueued. A launch into another stream during a capture is permitted (measured on an H100,
  // bench/results/gpu-20261205-1937-H100.md).
  if (st->capture) {
    // A capture invalidated already answers as to any other work (the guide: further use "will return an error").
    if (st->capture->invalidated) return c.result(cudaErrorStreamCaptureInvalidated);
    st->capture->invalidated = true;
    return c.violation(cudaErrorStreamCaptureUnsupported,
                       "cudaGraphLaunch into a stream that is being captured (capture " +
                           std::to_string(st->capture->id) +
                           " is invalidated): add the graph as a child graph node, or launch it outside the capture");
  }
  // A graph allocation must be freed before its graph is launched again (CUDA refuses the launch).
  for (const auto& captured : g->ops) {
    if (captured.allocates == 0) continue;
    const auto found = c.s.regions.find(captured.allocates);
    if (found != c.s.regions.end() && found->second.graph_launched) {
      return c.violation(cudaErrorInvalidValue,
                         "a graph launched again while the allocation of its earlier launch is not freed (by a free "
                         "node, cudaFreeAsync or cudaFree)");
    }
  }
  bool first = true;
  for (const auto& captured : g->ops) {
    auto o = std::make_shared<op>(captured);
    o->what += " (graph)";
    if (first && g->last_launch && !g->last_launch->done) o->deps.push_back(g->last_launch);
    if (captured.external_wait && captured.external_wait->last && !captured.external_wait->last->done) {
      o->deps.push_back(captured.external_wait->last);
    }
    first = false;
    const state_ptr state = o->state;
    if (cudaError_t e = enqueue(c, st, std::move(o)); e != cudaSuccess) return e;
    g->last_launch = state;
    const std::uintptr_t base = captured.allocates != 0 ? captured.allocates : captured.frees;
    if (base == 0) continue;
    const auto found = c.s.regions.find(base);
    if (found != c.s.regions.end()) found->second.graph_launched = captured.allocates != 0;
  }
  return cudaSuccess;
}

/// Whether a question about a stream may be asked while the stream is being captured. Measured on an H200 (driver
/// 580, 2026-12-04): cudaStreamGetId, cudaStreamGetDevice and cudaStreamGetFlags of a captured stream fail with
/// cudaErrorStreamCaptureUnsupported and invalidate the capture, in every capture mode (relaxed too), blocking or
/// not; cudaStreamGetPriority and cudaStreamIsCapturing do not (tests/graph/gpu_capture_rules_test.cpp). Asked of the
/// legacy stream while a blocking stream of its device is captured, all four fail with
/// cudaErrorStreamCaptureImplicit and invalidate that capture (the legacy stream would join it), in every mode.
enum class during_capture { permitted, prohibited };

/// cudaStreamGetId/GetDevice/GetPriority/GetFlags: one field of the stream a handle names (no context is needed).
template <class T, class Field>
cudaError_t stream_field(cudaStream_t h, T* out, bool ptsz, const char* name, Field field,
                         during_capture rule = during_capture::prohibited) {
  CUDASIM_ENTER(name);
  if (out == nullptr) return c.result(cudaErrorInvalidValue);
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, h, ptsz, st, false); e != cudaSuccess) return e;
  if (rule == during_capture::prohibited && st->capture) {
    st->capture->invalidated = true;
    return c.violation(cudaErrorStreamCaptureUnsupported,
                       std::string("asking ") + name + " of a stream that is being captured");
  }
  if (st->kind == stream_kind::legacy) {
    if (auto cap = capture_on_device(c.s, st->device)) {  // any field, the priority too (measured on an H200)
      cap->invalidated = true;
      return c.violation(cudaErrorStreamCaptureImplicit,
                         std::string("asking ") + name + " of the legacy stream during a blocking capture");
    }
  }
  *out = static_cast<T>(field(*st));
  return cudaSuccess;
}

unsigned long long id_of(const stream_obj& st) { return st.id; }
int device_of(const stream_obj& st) { return st.device; }
int priority_of(const stream_obj& st) { return st.priority; }
unsigned flags_of(const stream_obj& st) { return st.flags; }

const char* error_name(cudaError_t e) {
  switch (e) {
#define CUDASIM_NAME(x) \
  case x:               \
    return #x;
    CUDASIM_NAME(cudaSuccess)
    CUDASIM_NAME(cudaErrorInvalidValue)
    CUDASIM_NAME(cudaErrorMemoryAllocation)
    CUDASIM_NAME(cudaErrorInitializationError)
    CUDASIM_NAME(cudaErrorCudartUnloading)
    CUDASIM_NAME(cudaErrorInvalidMemcpyDirection)
    CUDASIM_NAME(cudaErrorStubLibrary)
    CUDASIM_NAME(cudaErrorInsufficientDriver)
    CUDASIM_NAME(cudaErrorDevicesUnavailable)
    CUDASIM_NAME(cudaErrorNoDevice)
    CUDASIM_NAME(cudaErrorInvalidDevice)
    CUDASIM_NAME(cudaErrorInvalidResourceHandle)
    CUDASIM_NAME(cudaErrorIllegalState)
    CUDASIM_NAME(cudaErrorNotReady)
    CUDASIM_NAME(cudaErrorIllegalAddress)
    CUDASIM_NAME(cudaErrorLaunchFailure)
    CUDASIM_NAME(cudaErrorContextIsDestroyed)
    CUDASIM_NAME(cudaErrorHostMemoryAlreadyRegistered)
    CUDASIM_NAME(cudaErrorHostMemoryNotRegistered)
    CUDASIM_NAME(cudaErrorNotPermitted)
    CUDASIM_NAME(cudaErrorNotSupported)
    CUDASIM_NAME(cudaErrorStreamCaptureUnsupported)
    CUDASIM_NAME(cudaErrorStreamCaptureInvalidated)
    CUDASIM_NAME(cudaErrorGraphExecUpdateFailure)
    CUDASIM_NAME(cudaErrorStreamCaptureUnmatched)
    CUDASIM_NAME(cudaErrorStreamCaptureUnjoined)
    CUDASIM_NAME(cudaErrorStreamCaptureMerge)
    CUDASIM_NAME(cudaErrorStreamCaptureIsolation)
    CUDASIM_NAME(cudaErrorStreamCaptureImplicit)
    CUDASIM_NAME(cudaErrorCapturedEvent)
    CUDASIM_NAME(cudaErrorStreamCaptureWrongThread)
    CUDASIM_NAME(cudaErrorSymbolNotFound)
    CUDASIM_NAME(cudaErrorPeerAccessUnsupported)
    CUDASIM_NAME(cudaErrorPeerAccessAlreadyEnabled)
    CUDASIM_NAME(cudaErrorPeerAccessNotEnabled)
    CUDASIM_NAME(cudaErrorUnknown)
#undef CUDASIM_NAME
    default:
      return "cudaErrorUnknown";
  }
}

const char* error_string(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInsufficientDriver:
      return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorNotPermitted:
      return "operation not permitted";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorCapturedEvent:
      return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorPeerAccessUnsupported:
      return "peer access is not supported between these two devices";
    case cudaErrorPeerAccessAlreadyEnabled:
      return "peer access is already enabled";
    case cudaErrorPeerAccessNotEnabled:
      return "peer access has not been enabled";
    default:
      return error_name(e);
  }
}

}  // namespace

// ==================================================================================================================
// Control interface
// ==================================================================================================================

namespace cudasim {

device_config default_device(int index) {
  device_config d;
  for (int i = 0; i < 16; ++i) d.uuid[i] = static_cast<unsigned char>(0x10 * (i % 16) + index);
  d.uuid[0] = 0xc0;
  d.uuid[1] = 0xda;
  d.uuid[2] = static_cast<unsigned char>(0x51 + index);
  d.pci_bus = 0x18 + 0x10 * index;
  return d;
}

machine_config default_machine(int count) {
  machine_config m;
  for (int i = 0; i < count; ++i) m.devices.push_back(default_device(i));
  return m;
}

void configure(const machine_config& machine) {
  simulator& s = sim();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.initialized) throw std::logic_error("cudasim::configure: the runtime is already initialised");
  if (!machine.peer_access.empty()) {
    bool square = machine.peer_access.size() == machine.devices.size();
    for (const auto& row : machine.peer_access) square = square && row.size() == machine.devices.size();
    if (!square) {
      throw std::invalid_argument("cudasim::configure: peer_access must be empty or " +
                                  std::to_string(machine.devices.size()) + " x " +
                                  std::to_string(machine.devices.size()));
    }
  }
  s.machine = machine;
  s.configured = true;
}

std::vector<int> visible_physical_devices(const char* value, const machine_config& machine, bool* emptied_by_repeat) {
  if (emptied_by_repeat != nullptr) *emptied_by_repeat = false;
  const int installed = static_cast<int>(machine.devices.size());
  std::vector<int> out;
  if (value == nullptr) {
    for (int i = 0; i < installed; ++i) out.push_back(i);
    return out;
  }
  std::string text(value);
  bool uuid_list = false;
  std::size_t start = 0;
  for (int entry = 0; start <= text.size(); ++entry) {
    std::size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(start, end - start);
    start = end + 1;
    const auto first = item.find_first_not_of(" \t\n\r\f\v");
    if (first == std::string::npos) break;
    item = item.substr(first, item.find_last_not_of(" \t\n\r\f\v") - first + 1);
    int index = -1;
    if (item.rfind("GPU-", 0) == 0) {
      if (entry == 0) uuid_list = true;
      if (!uuid_list) break;  // an index list ends at a UUID (measured on an H100: `0,GPU-<uuid>` is one device)
      int matches = 0;
      for (int i = 0; i < installed; ++i) {
        if (format_uuid(machine.devices[static_cast<std::size_t>(i)].uuid).rfind(item, 0) == 0) {
          ++matches;
          index = i;
        }
      }
      if (matches != 1) break;
    } else if (item.rfind("MIG-", 0) == 0 || uuid_list) {
      break;  // no MIG instances are simulated; a UUID list ends at its first other entry
    } else {
      // Read like strtoul (measured on an H100: `+0` and `-0` are device 0); a negated non-zero value wraps to a
      // huge index, beyond the installed devices.
      const bool negative = item[0] == '-';
      if (item[0] == '+' || negative) item.erase(0, 1);
      if (item.empty() || item[0] < '0' || item[0] > '9') break;
      unsigned long long v = 0;
      for (char ch : item) {
        if (ch < '0' || ch > '9') break;
        v = v * 10 + static_cast<unsigned long long>(ch - '0');
        if (v > 1000000) break;
      }
      if ((negative && v != 0) || v >= static_cast<unsigned long long>(installed)) break;
      index = static_cast<int>(v);
    }
    if (std::find(out.begin(), out.end(), index) != out.end()) {
      if (emptied_by_repeat != nullptr) *emptied_by_repeat = true;
      return {};
    }
    out.push_back(index);
    if (end == text.size()) break;
  }
  return out;
}

std::vector<violation> violations() {
  std::lock_guard<std::mutex> lock(sim().mutex);
  return sim().violations;
}

std::vector<violation> take_violations() {
  std::lock_guard<std::mutex> lock(sim().mutex);
  return std::exchange(sim().violations, {});
}

int context_creations(int device) {
  std::lock_guard<std::mutex> lock(sim().mutex);
  initialize_locked(sim());
  return valid_device(sim(), device) ? sim().devices[static_cast<std::size_t>(device)].creations : 0;
}

bool context_active(int device) {
  std::lock_guard<std::mutex> lock(sim().mutex);
  initialize_locked(sim());
  return valid_device(sim(), device) && sim().devices[static_cast<std::size_t>(device)].context;
}

bool accessible_from(int device, const void* address) {
  std::lock_guard<std::mutex> lock(sim().mutex);
  simulator& s = sim();
  if (!valid_device(s, device)) return false;
  const region* r = find_region(s, address);
  if (r == nullptr) return false;
  if (r->kind != region_kind::device) return true;  // pinned host memory: every device reaches it
  if (r->virtual_range) {
    const auto page = s.vmm_pages.find(reinterpret_cast<std::uintptr_t>(address) / vmm_granularity * vmm_granularity);
    return page != s.vmm_pages.end() && (page->second.access >> device & 1u) != 0;
  }
  if (r->device == device) return true;
  if (r->pooled || r->graph_allocation) {
    return (s.devices[static_cast<std::size_t>(r->device)].pool_peers >> device & 1u) != 0;
  }
  return s.peer_enabled.count({device, r->device}) != 0;
}

bool peer_access_enabled(int device, int peer) {
  std::lock_guard<std::mutex> lock(sim().mutex);
  return sim().peer_enabled.count({device, peer}) != 0;
}

void allow_contexts_only_on(const std::vector<int>& devices) {
  std::lock_guard<std::mutex> lock(sim().mutex);
  sim().allowed_contexts = devices;
}

void before_call(const std::string& function, int nth, std::function<void()> action) {
  std::lock_guard<std::mutex> lock(sim().mutex);
  sim().actions[function].emplace_back(nth, std::move(action));
}

void fail_call(const std::string& function, int nth, cudaError_t error) {
  std::lock_guard<std::mutex> lock(sim().mutex);
  sim().faults[function].emplace_back(nth, error);
}

void clear_faults() {
  std::lock_guard<std::mutex> lock(sim().mutex);
  sim().faults.clear();
  sim().actions.clear();
  sim().sticky = cudaSuccess;
  sim().unloaded = cudaSuccess;
}

void unload(cudaError_t result) {
  std::lock_guard<std::mutex> lock(sim().mutex);
  sim().unloaded = result;
}

bool inside_call() noexcept { return t_call_depth != 0; }

std::size_t calls(const std::string& function) {
  std::lock_guard<std::mutex> lock(sim().mutex);
  const auto it = sim().call_counts.find(function);
  return it == sim().call_counts.end() ? 0 : it->second;
}

std::size_t device_memory_used(int device) {
  std::lock_guard<std::mutex> lock(sim().mutex);
  initialize_locked(sim());
  return valid_device(sim(), device) ? sim().devices[static_cast<std::size_t>(device)].used : 0;
}

int live_streams(int device) {
  std::lock_guard<std::mutex> lock(sim().mutex);
  initialize_locked(sim());
  int n = 0;
  for (const auto& st : sim().streams.slots) n += st && st->device == device ? 1 : 0;
  return n;
}

void reuse_pool_addresses(bool on) {
  std::lock_guard<std::mutex> lock(sim().mutex);
  sim().reuse_pool_addresses = on;
}

void drain_all() {
  simulator& s = sim();
  std::unique_lock<std::mutex> lock(s.mutex);
  s.changed.wait(lock, [&] {
    for (const auto& dev : s.devices) {
      for (const auto& st : dev.streams) {
        if (st->tail && !st->tail->done) return false;
      }
    }
    return true;
  });
}

}  // namespace cudasim

// ==================================================================================================================
// The CUDA Runtime API
// ==================================================================================================================

extern "C" {

// The per-thread default stream entry points (declared by cuda_runtime_api.h only in that mode).
CUDASIM_API cudaError_t CUDARTAPI cudaMemcpyAsync_ptsz(void*, const void*, size_t, enum cudaMemcpyKind, cudaStream_t);
CUDASIM_API cudaError_t CUDARTAPI cudaMemsetAsync_ptsz(void*, int, size_t, cudaStream_t);
CUDASIM_API cudaError_t CUDARTAPI cudaMemcpy_ptds(void*, const void*, size_t, enum cudaMemcpyKind);
CUDASIM_API cudaError_t CUDARTAPI cudaStreamQuery_ptsz(cudaStream_t);
CUDASIM_API cudaError_t CUDARTAPI cudaStreamSynchronize_ptsz(cudaStream_t);
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetDevice_ptsz(cudaStream_t, int*);
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetId_ptsz(cudaStream_t, unsigned long long*);
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetPriority_ptsz(cudaStream_t, int*);
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetFlags_ptsz(cudaStream_t, unsigned int*);
CUDASIM_API cudaError_t CUDARTAPI cudaEventRecord_ptsz(cudaEvent_t, cudaStream_t);
CUDASIM_API cudaError_t CUDARTAPI cudaStreamWaitEvent_ptsz(cudaStream_t, cudaEvent_t, unsigned int);
CUDASIM_API cudaError_t CUDARTAPI cudaLaunchHostFunc_ptsz(cudaStream_t, cudaHostFn_t, void*);
CUDASIM_API cudaError_t CUDARTAPI cudaStreamBeginCapture_ptsz(cudaStream_t, enum cudaStreamCaptureMode);
CUDASIM_API cudaError_t CUDARTAPI cudaStreamEndCapture_ptsz(cudaStream_t, cudaGraph_t*);
CUDASIM_API cudaError_t CUDARTAPI cudaStreamIsCapturing_ptsz(cudaStream_t, enum cudaStreamCaptureStatus*);
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetCaptureInfo_ptsz(cudaStream_t, enum cudaStreamCaptureStatus*,
                                                                unsigned long long*, cudaGraph_t*,
                                                                const cudaGraphNode_t**, const cudaGraphEdgeData**,
                                                                size_t*);
CUDASIM_API cudaError_t CUDARTAPI cudaGraphLaunch_ptsz(cudaGraphExec_t, cudaStream_t);
CUDASIM_API cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion_ptsz(const char*, void**, unsigned int,
                                                                        unsigned long long,
                                                                        enum cudaDriverEntryPointQueryResult*);

// --- errors ---

CUDASIM_API const char* CUDARTAPI cudaGetErrorName(cudaError_t error) { return error_name(error); }
CUDASIM_API const char* CUDARTAPI cudaGetErrorString(cudaError_t error) { return error_string(error); }

CUDASIM_API cudaError_t CUDARTAPI cudaGetLastError(void) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  ++sim().call_counts["cudaGetLastError"];
  if (sim().unloaded != cudaSuccess) return sim().unloaded;
  if (sim().sticky != cudaSuccess) return sim().sticky;
  return std::exchange(t_last_error, cudaSuccess);
}

CUDASIM_API cudaError_t CUDARTAPI cudaPeekAtLastError(void) {
  const call_depth depth;
  std::lock_guard<std::mutex> lock(sim().mutex);
  ++sim().call_counts["cudaPeekAtLastError"];
  if (sim().unloaded != cudaSuccess) return sim().unloaded;
  return sim().sticky != cudaSuccess ? sim().sticky : t_last_error;
}

// --- versions and entry points ---

CUDASIM_API cudaError_t CUDARTAPI cudaDriverGetVersion(int* version) {
  const call_depth depth;
  if (version == nullptr) return cudaErrorInvalidValue;
  *version = CUDART_VERSION;
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaRuntimeGetVersion(int* version) {
  const call_depth depth;
  if (version == nullptr) return cudaErrorInvalidValue;
  *version = CUDART_VERSION;
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaGetDriverEntryPoint(const char* symbol, void** function, unsigned long long,
                                                          enum cudaDriverEntryPointQueryResult* status) {
  const call_depth depth;
  return get_entry_point(symbol, function, 13000, status);
}

CUDASIM_API cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion(const char* symbol, void** function,
                                                                   unsigned int version, unsigned long long,
                                                                   enum cudaDriverEntryPointQueryResult* status) {
  const call_depth depth;
  return get_entry_point(symbol, function, version, status);
}

CUDASIM_API cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion_ptsz(const char* symbol, void** function,
                                                                        unsigned int version, unsigned long long,
                                                                        enum cudaDriverEntryPointQueryResult* status) {
  const call_depth depth;
  return get_entry_point(symbol, function, version, status);
}

// --- devices ---

CUDASIM_API cudaError_t CUDARTAPI cudaGetDeviceCount(int* count) {
  const call_depth depth;
  CUDASIM_ENTER("cudaGetDeviceCount");
  if (count == nullptr) return c.result(cudaErrorInvalidValue);
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  *count = static_cast<int>(c.s.devices.size());
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaGetDevice(int* device) {
  const call_depth depth;
  CUDASIM_ENTER("cudaGetDevice");
  if (device == nullptr) return c.result(cudaErrorInvalidValue);
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  *device = current_ordinal();
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaSetDevice(int device) {
  const call_depth depth;
  CUDASIM_ENTER("cudaSetDevice");
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  if (!valid_device(c.s, device)) return c.result(cudaErrorInvalidDevice);
  // CUDA 12+: "will also immediately initialize the runtime state on the primary context".
  ensure_context(c, device);
  t_current = device;
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
  const call_depth depth;
  CUDASIM_ENTER("cudaGetDeviceProperties");
  if (prop == nullptr) return c.result(cudaErrorInvalidValue);
  if (!valid_device(c.s, device)) return c.result(cudaErrorInvalidDevice);
  const cudasim::device_config& d = c.s.devices[static_cast<std::size_t>(device)].config;
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "%s", d.name.c_str());
  std::memcpy(prop->uuid.bytes, d.uuid, 16);
  prop->totalGlobalMem = d.total_memory;
  prop->major = d.major;
  prop->minor = d.minor;
  prop->multiProcessorCount = d.multiprocessors;
  prop->asyncEngineCount = d.copy_engines;
  prop->pciDomainID = d.pci_domain;
  prop->pciBusID = d.pci_bus;
  prop->pciDeviceID = d.pci_device;
  prop->memoryBusWidth = d.memory_bus_width_bits;
  prop->l2CacheSize = 50 << 20;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->sharedMemPerBlock = 48 << 10;
  prop->sharedMemPerMultiprocessor = 228 << 10;
  prop->ECCEnabled = 1;
  prop->unifiedAddressing = 1;
  prop->managedMemory = 1;
  prop->concurrentManagedAccess = 1;
  prop->canMapHostMemory = 1;
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  const call_depth depth;
  CUDASIM_ENTER("cudaDeviceGetAttribute");
  if (value == nullptr) return c.result(cudaErrorInvalidValue);
  if (!valid_device(c.s, device)) return c.result(cudaErrorInvalidDevice);
  const cudasim::device_config& d = c.s.devices[static_cast<std::size_t>(device)].config;
  switch (attr) {
    case cudaDevAttrClockRate:
      *value = d.clock_rate_khz;
      break;
    case cudaDevAttrMemoryClockRate:
      *value = d.memory_clock_rate_khz;
      break;
    case cudaDevAttrComputeMode:
      *value = d.compute_mode;
      break;
    case cudaDevAttrMemoryPoolsSupported:
      *value = 1;
      break;
    case cudaDevAttrMultiProcessorCount:
      *value = d.multiprocessors;
      break;
    case cudaDevAttrComputeCapabilityMajor:
      *value = d.major;
      break;
    case cudaDevAttrComputeCapabilityMinor:
      *value = d.minor;
      break;
    case cudaDevAttrAsyncEngineCount:
      *value = d.copy_engines;
      break;
    case cudaDevAttrUnifiedAddressing:
      *value = 1;
      break;
    case cudaDevAttrCanMapHostMemory:
      *value = 1;
      break;
    case cudaDevAttrPciBusId:
      *value = d.pci_bus;
      break;
    case cudaDevAttrPciDeviceId:
      *value = d.pci_device;
      break;
    case cudaDevAttrPciDomainId:
      *value = d.pci_domain;
      break;
    case cudaDevAttrIntegrated:
      *value = 0;
      break;
    case cudaDevAttrWarpSize:
      *value = 32;
      break;
    case cudaDevAttrCanUseHostPointerForRegisteredMem:
      *value = 1;
      break;
    case cudaDevAttrPageableMemoryAccess:
      *value = 0;
      break;
    case cudaDevAttrConcurrentManagedAccess:
      *value = 1;
      break;
    default:
      return c.violation(cudaErrorNotSupported,
                         "device attribute " + std::to_string(static_cast<int>(attr)) + " is not simulated");
  }
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  const call_depth depth;
  CUDASIM_ENTER("cudaDeviceGetStreamPriorityRange");
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  // The *current* device's range, and its context is initialised.
  const int d = context_device(c);
  const cudasim::device_config& config = c.s.devices[static_cast<std::size_t>(d)].config;
  if (least != nullptr) *least = config.priority_least;
  if (greatest != nullptr) *greatest = config.priority_greatest;
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemGetInfo");
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  const int d = context_device(c);
  const device_state& dev = c.s.devices[static_cast<std::size_t>(d)];
  if (free_bytes != nullptr) *free_bytes = dev.config.total_memory - std::min(dev.used, dev.config.total_memory);
  if (total_bytes != nullptr) *total_bytes = dev.config.total_memory;
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaDeviceSynchronize(void) {
  const call_depth depth;
  CUDASIM_ENTER("cudaDeviceSynchronize");
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  const int d = context_device(c);
  // Every capture that holds a stream of the device (its origin or a stream forked into it), whatever the modes,
  // refuses it and is invalidated (the programming guide; measured on an H100), one invalidated already too until it
  // ends; besides, another device's capture as the modes say, no mode lifting it (not measured).
  std::set<const capture_state*> refusing;
  std::string ids;
  const auto refuse = [&](const std::shared_ptr<capture_state>& cap) {
    cap->invalidated = true;
    if (refusing.insert(cap.get()).second) ids += (ids.empty() ? "" : ", ") + std::to_string(cap->id);
  };
  for (const auto& cap : c.s.captures) {
    bool of_device = cap->origin->device == d;
    for (const auto& member : cap->members) of_device = of_device || member.first->device == d;
    if (of_device) refuse(cap);
  }
  if (auto cap = prohibiting_capture(c.s, true)) refuse(cap);
  if (!refusing.empty()) {
    return c.violation(
        cudaErrorStreamCaptureUnsupported,
        "cudaDeviceSynchronize is not permitted while a stream capture is underway (capture " + ids + " invalidated)");
  }
  const std::uint64_t enqueued_before = c.s.next_op_seq;  // the work this synchronization waits for
  wait_for(c, device_tails(c.s, d));
  observe_device(c.s, d, enqueued_before, false);
  pool_release_at_synchronize(c.s, d);
  return c.s.sticky != cudaSuccess ? c.result(c.s.sticky) : cudaSuccess;
}

// --- peer access (one context per device here, so access is a property of the device pair) ---

CUDASIM_API cudaError_t CUDARTAPI cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  const call_depth depth;
  CUDASIM_ENTER("cudaDeviceCanAccessPeer");
  if (can == nullptr) return c.result(cudaErrorInvalidValue);
  if (!valid_device(c.s, device) || !valid_device(c.s, peer)) return c.result(cudaErrorInvalidDevice);
  *can = peer_capable(c.s, device, peer) ? 1 : 0;  // a device property: no context is needed
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
  const call_depth depth;
  CUDASIM_ENTER("cudaDeviceEnablePeerAccess");
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  if (flags != 0) return c.result(cudaErrorInvalidValue);
  const int d = context_device(c);  // from the current device's context, initialised if missing
  if (!valid_device(c.s, peer)) return c.result(cudaErrorInvalidDevice);
  // The current device itself: 217 as for a pair the topology forbids (H100, driver 580.159: bench/results).
  if (peer == d || !peer_capable(c.s, d, peer)) return c.result(cudaErrorPeerAccessUnsupported);
  ensure_context(c, peer);  // the driver enables access to the peer's primary context, so it must exist
  if (!c.s.peer_enabled.insert({d, peer}).second) return c.result(cudaErrorPeerAccessAlreadyEnabled);
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaDeviceDisablePeerAccess(int peer) {
  const call_depth depth;
  CUDASIM_ENTER("cudaDeviceDisablePeerAccess");
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  const int d = context_device(c);
  if (!valid_device(c.s, peer) || peer == d) return c.result(cudaErrorInvalidDevice);
  if (c.s.peer_enabled.erase({d, peer}) == 0) return c.result(cudaErrorPeerAccessNotEnabled);
  return cudaSuccess;
}

// --- device memory ---

CUDASIM_API cudaError_t CUDARTAPI cudaMalloc(void** p, size_t size) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMalloc");
  if (p == nullptr) return c.result(cudaErrorInvalidValue);
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  const int d = context_device(c);
  device_state& dev = c.s.devices[static_cast<std::size_t>(d)];
  if (size == 0) {
    *p = nullptr;
    return cudaSuccess;
  }
  const std::size_t rounded = round_up(size, 512);
  if (rounded < size || rounded > dev.config.total_memory - std::min(dev.used, dev.config.total_memory)) {
    return c.result(cudaErrorMemoryAllocation);
  }
  void* memory = allocate_host_memory(rounded);
  if (memory == nullptr) return c.result(cudaErrorMemoryAllocation);
  region r;
  r.base = reinterpret_cast<std::uintptr_t>(memory);
  r.size = size;
  r.kind = region_kind::device;
  r.device = d;
  c.s.regions[r.base] = r;
  dev.used += rounded;
  *p = memory;
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaFree(void* p) {
  const call_depth depth;
  CUDASIM_ENTER("cudaFree");
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  if (p == nullptr) {
    context_device(c);  // cudaFree(0) is the classic way to initialise a context
    return cudaSuccess;
  }
  const auto it = c.s.regions.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == c.s.regions.end() || it->second.kind != region_kind::device) {
    return c.violation(cudaErrorInvalidValue, "cudaFree of " + hex(reinterpret_cast<std::uintptr_t>(p)) +
                                                  ", which cudaMalloc did not return (or was freed already)");
  }
  const int d = it->second.device;
  if (it->second.pooled || it->second.graph_allocation) {
    // cudaFree's header: "This API will not perform any implicit synchronization when the pointer was allocated with
    // cudaMallocAsync or cudaMallocFromPoolAsync. Callers must ensure that all accesses to these pointer have
    // completed before invoking cudaFree." Work queued that touches it later is an illegal address (alive_check).
    // Only a copy already running (past its check, outside the lock) is waited for, so that the simulator never
    // frees host memory under its own memcpy.
    wait_for_running_copies(c);
  } else {
    // cudaFree waits for the device's work: memory still in use by queued work is not freed under it.
    wait_for(c, device_tails(c.s, d));
  }
  const auto again = c.s.regions.find(reinterpret_cast<std::uintptr_t>(p));
  if (again == c.s.regions.end()) return c.violation(cudaErrorInvalidValue, "double cudaFree");
  if (again->second.free_enqueued) {
    return c.violation(cudaErrorInvalidValue, "cudaFree of memory whose cudaFreeAsync is enqueued already");
  }
  if (again->second.graph_allocation) {  // its graph's address: the next launch allocates it again
    if (!again->second.graph_live) {
      return c.violation(cudaErrorInvalidValue, "cudaFree of a graph allocation that is not live");
    }
    again->second.graph_live = false;
    again->second.graph_launched = false;
    return cudaSuccess;
  }
  device_state& dev = c.s.devices[static_cast<std::size_t>(d)];
  if (again->second.pooled) {
    dev.pool_used -= round_up(again->second.size, 512);  // back to the pool, which keeps it
  } else {
    dev.used -= round_up(again->second.size, 512);
  }
  c.s.regions.erase(again);
  std::free(p);
  return cudaSuccess;
}

// --- stream-ordered allocation (cudaMallocAsync): the default pool of each device (device_state says what it keeps)
// ---

CUDASIM_API cudaError_t CUDARTAPI cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  const call_depth depth;
  CUDASIM_ENTER("cudaDeviceGetDefaultMemPool");
  if (pool == nullptr) return c.result(cudaErrorInvalidValue);
  if (!valid_device(c.s, device)) return c.result(cudaErrorInvalidDevice);
  *pool = default_pool_of(device);
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaMemPoolSetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void* value) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemPoolSetAttribute");
  if (pool == nullptr || value == nullptr) return c.result(cudaErrorInvalidValue);
  const int device = pool_device(c.s, pool);
  if (device < 0) return c.violation(cudaErrorInvalidValue, "not a memory pool of this machine");
  device_state& dev = c.s.devices[static_cast<std::size_t>(device)];
  const cuuint64_t v = *static_cast<cuuint64_t*>(value);
  switch (attr) {
    case cudaMemPoolAttrReservedMemHigh:
    case cudaMemPoolAttrUsedMemHigh:
      if (v != 0) return c.violation(cudaErrorInvalidValue, "a pool's high-water mark can only be reset (to 0)");
      if (attr == cudaMemPoolAttrReservedMemHigh) {
        dev.pool_reserved_high = dev.pool_reserved;
      } else {
        dev.pool_used_high = dev.pool_used + dev.pool_pending_total;
      }
      return cudaSuccess;
    case cudaMemPoolAttrReleaseThreshold:
      dev.pool_release_threshold = v;
      return cudaSuccess;
    default:
      return c.violation(cudaErrorNotSupported, "cudasim models only the pool's release threshold and memory");
  }
}

/// Reserved memory is what the pool holds, used what is live; the high-water marks can be reset to 0.
CUDASIM_API cudaError_t CUDARTAPI cudaMemPoolGetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void* value) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemPoolGetAttribute");
  if (pool == nullptr || value == nullptr) return c.result(cudaErrorInvalidValue);
  const int device = pool_device(c.s, pool);
  if (device < 0) return c.violation(cudaErrorInvalidValue, "not a memory pool of this machine");
  const device_state& dev = c.s.devices[static_cast<std::size_t>(device)];
  auto& out = *static_cast<cuuint64_t*>(value);
  switch (attr) {
    case cudaMemPoolAttrReservedMemCurrent:
      out = dev.pool_reserved;
      return cudaSuccess;
    case cudaMemPoolAttrUsedMemCurrent:
      out = dev.pool_used + dev.pool_pending_total;  // a free releases its memory when it runs
      return cudaSuccess;
    case cudaMemPoolAttrReservedMemHigh:
      out = dev.pool_reserved_high;
      return cudaSuccess;
    case cudaMemPoolAttrUsedMemHigh:
      out = dev.pool_used_high;
      return cudaSuccess;
    case cudaMemPoolAttrReleaseThreshold:
      out = dev.pool_release_threshold;
      return cudaSuccess;
    default:
      return c.violation(cudaErrorNotSupported, "cudasim models only the pool's release threshold and memory");
  }
}

/// The default pool's memory is reachable from its own device always, and from a peer once granted here (peer access
/// enabled with cudaDeviceEnablePeerAccess does not cover it).
CUDASIM_API cudaError_t CUDARTAPI cudaMemPoolSetAccess(cudaMemPool_t pool, const struct cudaMemAccessDesc* descs,
                                                       size_t count) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemPoolSetAccess");
  if (pool == nullptr || (descs == nullptr && count != 0)) return c.result(cudaErrorInvalidValue);
  const int device = pool_device(c.s, pool);
  if (device < 0) return c.violation(cudaErrorInvalidValue, "not a memory pool of this machine");
  for (std::size_t i = 0; i < count; ++i) {
    const cudaMemAccessDesc& d = descs[i];
    if (d.location.type != cudaMemLocationTypeDevice || !valid_device(c.s, d.location.id) ||
        (d.flags != cudaMemAccessFlagsProtReadWrite && d.flags != cudaMemAccessFlagsProtNone)) {
      return c.result(cudaErrorInvalidValue);
    }
    if (d.location.id == device && d.flags != cudaMemAccessFlagsProtReadWrite) {
      return c.violation(cudaErrorInvalidDevice, "a pool's own device always has access to it");
    }
    if (d.location.id != device && d.flags == cudaMemAccessFlagsProtReadWrite &&
        !peer_capable(c.s, d.location.id, device)) {
      return c.violation(cudaErrorInvalidDevice, "pool access for a device that cannot reach the pool's device");
    }
  }
  device_state& dev = c.s.devices[static_cast<std::size_t>(device)];
  for (std::size_t i = 0; i < count; ++i) {
    if (descs[i].location.id == device) continue;
    const std::uint64_t bit = std::uint64_t{1} << descs[i].location.id;
    dev.pool_peers =
        descs[i].flags == cudaMemAccessFlagsProtReadWrite ? (dev.pool_peers | bit) : (dev.pool_peers & ~bit);
  }
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaMemPoolGetAccess(enum cudaMemAccessFlags* flags, cudaMemPool_t pool,
                                                       struct cudaMemLocation* location) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemPoolGetAccess");
  if (flags == nullptr || pool == nullptr || location == nullptr || location->type != cudaMemLocationTypeDevice ||
      !valid_device(c.s, location->id)) {
    return c.result(cudaErrorInvalidValue);
  }
  const int device = pool_device(c.s, pool);
  if (device < 0) return c.violation(cudaErrorInvalidValue, "not a memory pool of this machine");
  const bool granted =
      location->id == device || (c.s.devices[static_cast<std::size_t>(device)].pool_peers >> location->id & 1u) != 0;
  *flags = granted ? cudaMemAccessFlagsProtReadWrite : cudaMemAccessFlagsProtNone;
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaMemPoolTrimTo(cudaMemPool_t pool, size_t keep) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemPoolTrimTo");
  if (pool == nullptr) return c.result(cudaErrorInvalidValue);
  const int device = pool_device(c.s, pool);
  if (device < 0) return c.violation(cudaErrorInvalidValue, "not a memory pool of this machine");
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  pool_release(c.s.devices[static_cast<std::size_t>(device)], keep);  // frees the host has observed complete
  return cudaSuccess;
}

/// cudaMallocAsync during a capture: an allocation node. Its address is fixed when captured (CUDA reserves it for the
/// graph) and its memory is live from each launch's allocation node until its free (a free node, or cudaFreeAsync or
/// cudaFree after the launch); a launch before the previous one's allocation is freed is refused, as CUDA refuses it.
/// The memory comes from the device's graph memory pool, which is not the default pool: the default pool's figures do
/// not count it, and the simulator does not model that pool's size or give its memory (or address) back. Peers
/// reach it as they reach the default pool's memory.
static cudaError_t graph_allocation(call& c, const stream_ptr& st, void** p, std::size_t size) {
  if (st->capture->invalidated) return c.result(cudaErrorStreamCaptureInvalidated);
  const device_state& dev = c.s.devices[static_cast<std::size_t>(st->device)];
  const std::size_t rounded = round_up(size, 512);
  if (rounded < size || rounded > dev.config.total_memory) return c.result(cudaErrorMemoryAllocation);
  void* memory = allocate_host_memory(rounded);
  if (memory == nullptr) return c.result(cudaErrorMemoryAllocation);
  const auto base = reinterpret_cast<std::uintptr_t>(memory);
  auto o = std::make_shared<op>();
  o->what = c.function + " (allocation node)";
  o->allocates = base;
  o->precheck = [base] {
    simulator& s = sim();
    const auto found = s.regions.find(base);
    if (found == s.regions.end()) return false;
    found->second.graph_live = true;
    return true;
  };
  if (cudaError_t e = enqueue(c, st, std::move(o)); e != cudaSuccess) {
    std::free(memory);
    return e;
  }
  region r;
  r.base = base;
  r.size = size;
  r.kind = region_kind::device;
  r.device = st->device;
  r.graph_allocation = true;
  c.s.regions[r.base] = r;
  *p = memory;
  return cudaSuccess;
}

/// cudaMallocAsync, or cudaMallocFromPoolAsync when `pool` is given (the default pool of the stream's device only).
static cudaError_t malloc_async(call& c, void** p, std::size_t size, cudaMemPool_t pool, cudaStream_t stream) {
  if (p == nullptr) return c.result(cudaErrorInvalidValue);
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, stream, false, st); e != cudaSuccess) return e;
  // Captured, it becomes an allocation node; on any other stream it is an allocation like cudaMalloc's, and on the
  // legacy stream it is work there, which a capture of a blocking stream of the device refuses (as for any work).
  if (st->capture == nullptr) {
    if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  }
  if (st->kind == stream_kind::legacy) {
    if (auto cap = capture_on_device(c.s, st->device)) {
      cap->invalidated = true;
      return c.violation(
          cudaErrorStreamCaptureImplicit,
          "cudaMallocAsync on the legacy default stream while a blocking stream of its device is captured");
    }
  }
  if (pool != nullptr && pool != default_pool_of(st->device)) {
    return c.violation(cudaErrorInvalidValue, "cudasim models only the default pool of the stream's device");
  }
  device_state& dev = c.s.devices[static_cast<std::size_t>(st->device)];
  ensure_context(c, st->device);
  if (size == 0) {
    *p = nullptr;
    return cudaSuccess;
  }
  if (st->capture != nullptr) return graph_allocation(c, st, p, size);
  const std::size_t rounded = round_up(size, 512);
  // This stream's pending frees serve first, then what the pool keeps; the rest it reserves from the device.
  const auto mine = dev.pool_pending.find(st.get());
  const std::size_t from_pending = mine == dev.pool_pending.end() ? 0 : std::min(mine->second, rounded);
  const std::size_t kept = dev.pool_reserved - dev.pool_used - dev.pool_pending_total;
  const std::size_t rest = rounded - from_pending;
  const std::size_t growth = rest > kept ? rest - kept : 0;
  if (rounded < size || growth > dev.config.total_memory - std::min(dev.used, dev.config.total_memory)) {
    return c.result(cudaErrorMemoryAllocation);
  }
  void* memory = nullptr;
  if (auto freed = dev.pool_freed_blocks.find(rounded);
      freed != dev.pool_freed_blocks.end() && !freed->second.empty()) {
    memory = freed->second.back();
    freed->second.pop_back();
  } else {
    memory = allocate_host_memory(rounded);
  }
  if (memory == nullptr) return c.result(cudaErrorMemoryAllocation);
  region r;
  r.base = reinterpret_cast<std::uintptr_t>(memory);
  r.size = size;
  r.kind = region_kind::device;
  r.device = st->device;
  r.pooled = true;
  c.s.regions[r.base] = r;
  if (from_pending != 0) {
    mine->second -= from_pending;  // the free, when it runs, releases only what is still pending
    dev.pool_pending_total -= from_pending;
    if (mine->second == 0) dev.pool_pending.erase(mine);
  }
  // Kept memory serves observed frees first: the unobserved ones it takes are live again (oldest first, the strict
  // choice: the newest, least likely observed, stay outstanding).
  const std::size_t from_kept = std::min(rest, kept);
  const std::size_t observed_kept = kept - dev.pool_unobserved_total;
  std::size_t reused_unobserved = from_kept > observed_kept ? from_kept - observed_kept : 0;
  while (reused_unobserved != 0) {
    auto& oldest = dev.pool_unobserved.front();
    const std::size_t taken = std::min(oldest.bytes, reused_unobserved);
    oldest.bytes -= taken;
    dev.pool_unobserved_total -= taken;
    reused_unobserved -= taken;
    if (oldest.bytes == 0) dev.pool_unobserved.erase(dev.pool_unobserved.begin());
  }
  dev.used += growth;
  dev.pool_reserved += growth;
  dev.pool_used += rounded;
  dev.pool_reserved_high = std::max(dev.pool_reserved_high, dev.pool_reserved);
  dev.pool_used_high = std::max(dev.pool_used_high, dev.pool_used + dev.pool_pending_total);
  *p = memory;
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaMallocAsync(void** p, size_t size, cudaStream_t stream) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMallocAsync");
  return malloc_async(c, p, size, nullptr, stream);
}

CUDASIM_API cudaError_t CUDARTAPI cudaMallocFromPoolAsync(void** p, size_t size, cudaMemPool_t pool,
                                                          cudaStream_t stream) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMallocFromPoolAsync");
  if (pool == nullptr) return c.result(cudaErrorInvalidValue);
  return malloc_async(c, p, size, pool, stream);
}

CUDASIM_API cudaError_t CUDARTAPI cudaFreeAsync(void* p, cudaStream_t stream) {
  const call_depth depth;
  CUDASIM_ENTER("cudaFreeAsync");
  stream_ptr st;
  if (cudaError_t e = resolve_stream(c, stream, false, st); e != cudaSuccess) return e;
  if (st->capture == nullptr) {
    if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  }
  if (p == nullptr) return cudaSuccess;
  const auto it = c.s.regions.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == c.s.regions.end() || it->second.kind != region_kind::device) {
    return c.violation(cudaErrorInvalidValue, "cudaFreeAsync of a pointer that is not a live device allocation");
  }
  if (st->capture && !it->second.graph_allocation) {
    // Captured, the free becomes a free node, which only a graph allocation may have (cudaGraphAddMemFreeNode).
    return c.violation(cudaErrorInvalidValue,
                       "cudaFreeAsync during a capture of memory not allocated in a capture (a free node frees only "
                       "a graph allocation)");
  }
  if (it->second.free_enqueued) {
    return c.violation(cudaErrorInvalidValue, "cudaFreeAsync of memory whose cudaFreeAsync is enqueued already");
  }
  // Outside a capture, the memory is off the pool's live bytes at once and pending on this stream, whose later
  // allocations may take it; the pool keeps it once the stream reaches the free. A captured free (a free node) runs
  // at the graph's launch, and leaves the live bytes then.
  const std::size_t rounded = round_up(it->second.size, 512);
  const bool pending = it->second.pooled && st->capture == nullptr;
  if (it->second.graph_allocation) {
    // A free node (captured), or the free of a launch's allocation outside the graph: the memory stays the graph's.
    if (st->capture != nullptr && it->second.graph_free_captured) {
      return c.violation(cudaErrorInvalidValue, "a second free node of the same graph allocation");
    }
    auto o = std::make_shared<op>();
    o->what = c.function;
    if (st->capture != nullptr) o->frees = it->first;
    o->precheck = [p] {
      simulator& s = sim();
      const auto found = s.regions.find(reinterpret_cast<std::uintptr_t>(p));
      if (found == s.regions.end()) return false;
      found->second.free_enqueued = false;
      if (!found->second.graph_live) {
        record_violation(s, "cudaFreeAsync", cudaErrorInvalidValue,
                         "the free of a graph allocation that is not live (its graph was not launched, or it was "
                         "freed already)");
        return false;
      }
      found->second.graph_live = false;
      return true;
    };
    if (cudaError_t e = enqueue(c, st, std::move(o)); e != cudaSuccess) return e;
    if (st->capture != nullptr) {
      it->second.graph_free_captured = true;
    } else {
      it->second.free_enqueued = true;
      it->second.graph_launched = false;
    }
    return cudaSuccess;
  }
  // Freed when the stream reaches this point (the precheck runs under the machine's lock).
  auto o = std::make_shared<op>();
  o->what = c.function;
  auto kept = std::make_shared<bool>(false);  // by the pool, for reuse_pool_addresses
  o->precheck = [p, pending, rounded, kept, on = st.get(), device = it->second.device,
                 state = std::weak_ptr<op_state>(o->state)] {
    simulator& s = sim();
    device_state& dev = s.devices[static_cast<std::size_t>(device)];
    if (pending) {  // first: the stream's pending bytes go even if the region went another way meanwhile
      const auto mine = dev.pool_pending.find(on);
      const std::size_t still = mine == dev.pool_pending.end() ? 0 : std::min(mine->second, rounded);
      if (still != 0) {
        mine->second -= still;  // kept by the pool from now on, given back once the host observed this free
        dev.pool_pending_total -= still;
        if (mine->second == 0) dev.pool_pending.erase(mine);
        if (const auto self = state.lock()) {
          dev.pool_unobserved.push_back({self->stream_id, self->seq, still, on->device, on->blocking()});
          dev.pool_unobserved_total += still;
        }
      }
    }
    const auto found = s.regions.find(reinterpret_cast<std::uintptr_t>(p));
    if (found == s.regions.end()) return false;
    if (!pending) {  // not counted when enqueued: cudaMalloc memory, or a captured free
      if (found->second.pooled) {
        dev.pool_used -= rounded;  // kept by the pool
      } else {
        dev.used -= rounded;
      }
    }
    if (s.reuse_pool_addresses && found->second.pooled) {
      dev.pool_freed_blocks[rounded].push_back(p);
      *kept = true;
    }
    s.regions.erase(found);
    return true;
  };
  o->work = [p, kept] {
    if (!*kept) std::free(p);
  };
  if (cudaError_t e = enqueue(c, st, std::move(o)); e != cudaSuccess) return e;
  if (pending) {  // after the enqueue, which may be refused (its precheck cannot run before this call returns)
    device_state& dev = c.s.devices[static_cast<std::size_t>(it->second.device)];
    dev.pool_used -= rounded;
    dev.pool_pending[st.get()] += rounded;
    dev.pool_pending_total += rounded;
    it->second.free_enqueued = true;
  }
  return cudaSuccess;
}

// --- host memory ---

static cudaError_t host_alloc(call& c, void** p, std::size_t size, unsigned flags) {
  if (p == nullptr) return c.result(cudaErrorInvalidValue);
  // Bits cudaHostAlloc does not define (cudaHostAllocPortable, Mapped, WriteCombined are all it has).
  if ((flags & ~unsigned{cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined}) != 0) {
    return c.result(cudaErrorInvalidValue);
  }
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  const int d = context_device(c);  // pinned memory belongs to the current device's context
  if (size == 0) {
    *p = nullptr;
    return cudaSuccess;
  }
  void* memory = allocate_host_memory(size);
  if (memory == nullptr) return c.result(cudaErrorMemoryAllocation);
  region r;
  r.base = reinterpret_cast<std::uintptr_t>(memory);
  r.size = size;
  r.kind = region_kind::pinned;
  r.device = d;
  r.flags = flags;
  c.s.regions[r.base] = r;
  *p = memory;
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaHostAlloc(void** p, size_t size, unsigned int flags) {
  const call_depth depth;
  CUDASIM_ENTER("cudaHostAlloc");
  return host_alloc(c, p, size, flags);
}

CUDASIM_API cudaError_t CUDARTAPI cudaMallocHost(void** p, size_t size) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMallocHost");
  return host_alloc(c, p, size, 0);
}

CUDASIM_API cudaError_t CUDARTAPI cudaFreeHost(void* p) {
  const call_depth depth;
  CUDASIM_ENTER("cudaFreeHost");
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  require_current_context(c);  // runs in the current context: a thread without one initialises device 0's
  if (p == nullptr) return cudaSuccess;
  const auto it = c.s.regions.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == c.s.regions.end() || it->second.kind != region_kind::pinned) {
    return c.violation(cudaErrorInvalidValue, "cudaFreeHost of " + hex(reinterpret_cast<std::uintptr_t>(p)) +
                                                  ", which cudaHostAlloc did not return (or was freed already)");
  }
  std::vector<state_ptr> tails;
  for (int d = 0; d < static_cast<int>(c.s.devices.size()); ++d) {
    auto more = device_tails(c.s, d);
    tails.insert(tails.end(), more.begin(), more.end());
  }
  wait_for(c, tails);
  c.s.regions.erase(reinterpret_cast<std::uintptr_t>(p));
  std::free(p);
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaHostRegister(void* p, size_t size, unsigned int flags) {
  const call_depth depth;
  CUDASIM_ENTER("cudaHostRegister");
  if (p == nullptr || size == 0) return c.result(cudaErrorInvalidValue);
  constexpr unsigned defined_flags =
      cudaHostRegisterPortable | cudaHostRegisterMapped | cudaHostRegisterIoMemory | cudaHostRegisterReadOnly;
  if ((flags & ~defined_flags) != 0) return c.result(cudaErrorInvalidValue);  // bits cudaHostRegister does not define
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  const int d = context_device(c);
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  for (const auto& entry : c.s.regions) {
    const region& r = entry.second;
    if (a < r.base + r.size && r.base < a + size) {
      return c.result(r.kind == region_kind::device ? cudaErrorInvalidValue : cudaErrorHostMemoryAlreadyRegistered);
    }
  }
  region r;
  r.base = a;
  r.size = size;
  r.kind = region_kind::registered;
  r.device = d;
  r.flags = flags;
  c.s.regions[a] = r;
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaHostUnregister(void* p) {
  const call_depth depth;
  CUDASIM_ENTER("cudaHostUnregister");
  require_current_context(c);  // as cudaFreeHost
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  const auto it = c.s.regions.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == c.s.regions.end() || it->second.kind != region_kind::registered) {
    return c.result(cudaErrorHostMemoryNotRegistered);
  }
  c.s.regions.erase(it);
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaHostGetDevicePointer(void** device_pointer, void* host, unsigned int flags) {
  const call_depth depth;
  CUDASIM_ENTER("cudaHostGetDevicePointer");
  if (device_pointer == nullptr || flags != 0) return c.result(cudaErrorInvalidValue);
  const region* r = find_region(c.s, host);
  if (r == nullptr || r->kind == region_kind::device) return c.result(cudaErrorInvalidValue);
  // Under unified addressing every page-locked allocation is mapped, at its host address.
  *device_pointer = host;
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaPointerGetAttributes(struct cudaPointerAttributes* attributes, const void* p) {
  const call_depth depth;
  CUDASIM_ENTER("cudaPointerGetAttributes");
  if (attributes == nullptr) return c.result(cudaErrorInvalidValue);
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  context_device(c);  // answered by the current device's context
  *attributes = cudaPointerAttributes{};
  const region* r = find_region(c.s, p);
  if (r == nullptr) {
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = cudaInvalidDeviceId;
    return cudaSuccess;
  }
  attributes->device = r->device;
  attributes->devicePointer = const_cast<void*>(p);
  if (r->kind == region_kind::device) {
    attributes->type = cudaMemoryTypeDevice;
  } else {
    attributes->type = cudaMemoryTypeHost;
    attributes->hostPointer = const_cast<void*>(p);
  }
  return cudaSuccess;
}

// --- copies ---

CUDASIM_API cudaError_t CUDARTAPI cudaMemcpyAsync(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind,
                                                  cudaStream_t stream) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemcpyAsync");
  return memcpy_async(c, dst, src, n, kind, stream, false, false);
}

CUDASIM_API cudaError_t CUDARTAPI cudaMemcpyAsync_ptsz(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind,
                                                       cudaStream_t stream) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemcpyAsync_ptsz");
  return memcpy_async(c, dst, src, n, kind, stream, true, false);
}

CUDASIM_API cudaError_t CUDARTAPI cudaMemcpy(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemcpy");
  return memcpy_async(c, dst, src, n, kind, nullptr, false, true);
}

CUDASIM_API cudaError_t CUDARTAPI cudaMemcpy_ptds(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemcpy_ptds");
  return memcpy_async(c, dst, src, n, kind, nullptr, true, true);
}

CUDASIM_API cudaError_t CUDARTAPI cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device,
                                                      size_t n, cudaStream_t stream) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemcpyPeerAsync");
  return memcpy_peer_async(c, dst, dst_device, src, src_device, n, stream);
}

CUDASIM_API cudaError_t CUDARTAPI cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t stream) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemsetAsync");
  return memset_async(c, p, value, n, stream, false, false);
}

CUDASIM_API cudaError_t CUDARTAPI cudaMemsetAsync_ptsz(void* p, int value, size_t n, cudaStream_t stream) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemsetAsync_ptsz");
  return memset_async(c, p, value, n, stream, true, false);
}

CUDASIM_API cudaError_t CUDARTAPI cudaMemset(void* p, int value, size_t n) {
  const call_depth depth;
  CUDASIM_ENTER("cudaMemset");
  return memset_async(c, p, value, n, nullptr, false, true);
}

// --- streams ---

static cudaError_t stream_create(call& c, cudaStream_t* out, unsigned flags, int priority) {
  if (out == nullptr) return c.result(cudaErrorInvalidValue);
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  const int d = context_device(c);
  const cudasim::device_config& config = c.s.devices[static_cast<std::size_t>(d)].config;
  priority = std::min(std::max(priority, config.priority_greatest), config.priority_least);
  stream_ptr st = make_stream(c.s, d, stream_kind::created, flags, priority);
  st->handle = c.s.streams.add(st);
  *out = reinterpret_cast<cudaStream_t>(st->handle);
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaStreamCreate(cudaStream_t* out) {
  const call_depth depth;
  CUDASIM_ENTER("cudaStreamCreate");
  return stream_create(c, out, cudaStreamDefault, 0);
}

CUDASIM_API cudaError_t CUDARTAPI cudaStreamCreateWithFlags(cudaStream_t* out, unsigned int flags) {
  const call_depth depth;
  CUDASIM_ENTER("cudaStreamCreateWithFlags");
  return stream_create(c, out, flags, 0);
}

CUDASIM_API cudaError_t CUDARTAPI cudaStreamCreateWithPriority(cudaStream_t* out, unsigned int flags, int priority) {
  const call_depth depth;
  CUDASIM_ENTER("cudaStreamCreateWithPriority");
  return stream_create(c, out, flags, priority);
}

CUDASIM_API cudaError_t CUDARTAPI cudaStreamDestroy(cudaStream_t stream) {
  const call_depth depth;
  CUDASIM_ENTER("cudaStreamDestroy");
  const auto h = reinterpret_cast<std::uintptr_t>(stream);
  if (h <= 2) return c.violation(cudaErrorInvalidResourceHandle, "cudaStreamDestroy of a default stream");
  stream_ptr st = c.s.streams.find(h);
  if (!st) {
    return c.violation(cudaErrorInvalidResourceHandle, c.s.streams.was_issued(h)
                                                           ? "double cudaStreamDestroy of " + hex(h)
                                                           : "cudaStreamDestroy of an invalid handle");
  }
  // Returns at once; queued work still completes. The handle is free for the next cudaStreamCreate.
  st->destroyed = true;
  c.s.streams.remove(h);
  auto& list = c.s.devices[static_cast<std::size_t>(st->device)].streams;
  if (st->queue.empty() && !st->running) list.erase(std::remove(list.begin(), list.end(), st), list.end());
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaStreamSynchronize(cudaStream_t stream) {
  const call_depth depth;
  return stream_synchronize(stream, false, "cudaStreamSynchronize");
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamSynchronize_ptsz(cudaStream_t stream) {
  const call_depth depth;
  return stream_synchronize(stream, true, "cudaStreamSynchronize_ptsz");
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamQuery(cudaStream_t stream) {
  const call_depth depth;
  return stream_query(stream, false, "cudaStreamQuery");
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamQuery_ptsz(cudaStream_t stream) {
  const call_depth depth;
  return stream_query(stream, true, "cudaStreamQuery_ptsz");
}
CUDASIM_API cudaError_t CUDARTAPI cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* data) {
  const call_depth depth;
  return launch_host_func(stream, fn, data, false, "cudaLaunchHostFunc");
}
CUDASIM_API cudaError_t CUDARTAPI cudaLaunchHostFunc_ptsz(cudaStream_t stream, cudaHostFn_t fn, void* data) {
  const call_depth depth;
  return launch_host_func(stream, fn, data, true, "cudaLaunchHostFunc_ptsz");
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetId(cudaStream_t stream, unsigned long long* id) {
  const call_depth depth;
  return stream_field(stream, id, false, "cudaStreamGetId", id_of);
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetId_ptsz(cudaStream_t stream, unsigned long long* id) {
  const call_depth depth;
  return stream_field(stream, id, true, "cudaStreamGetId_ptsz", id_of);
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetDevice(cudaStream_t stream, int* device) {
  const call_depth depth;
  return stream_field(stream, device, false, "cudaStreamGetDevice", device_of);
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetDevice_ptsz(cudaStream_t stream, int* device) {
  const call_depth depth;
  return stream_field(stream, device, true, "cudaStreamGetDevice_ptsz", device_of);
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetPriority(cudaStream_t stream, int* priority) {
  const call_depth depth;
  return stream_field(stream, priority, false, "cudaStreamGetPriority", priority_of, during_capture::permitted);
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetPriority_ptsz(cudaStream_t stream, int* priority) {
  const call_depth depth;
  return stream_field(stream, priority, true, "cudaStreamGetPriority_ptsz", priority_of, during_capture::permitted);
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetFlags(cudaStream_t stream, unsigned int* flags) {
  const call_depth depth;
  return stream_field(stream, flags, false, "cudaStreamGetFlags", flags_of);
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetFlags_ptsz(cudaStream_t stream, unsigned int* flags) {
  const call_depth depth;
  return stream_field(stream, flags, true, "cudaStreamGetFlags_ptsz", flags_of);
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  const call_depth depth;
  return stream_wait_event(stream, event, flags, false, "cudaStreamWaitEvent");
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamWaitEvent_ptsz(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  const call_depth depth;
  return stream_wait_event(stream, event, flags, true, "cudaStreamWaitEvent_ptsz");
}

// --- capture and graphs ---

CUDASIM_API cudaError_t CUDARTAPI cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  const call_depth depth;
  return stream_begin_capture(stream, mode, false, "cudaStreamBeginCapture");
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamBeginCapture_ptsz(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  const call_depth depth;
  return stream_begin_capture(stream, mode, true, "cudaStreamBeginCapture_ptsz");
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  const call_depth depth;
  return stream_end_capture(stream, graph, false, "cudaStreamEndCapture");
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamEndCapture_ptsz(cudaStream_t stream, cudaGraph_t* graph) {
  const call_depth depth;
  return stream_end_capture(stream, graph, true, "cudaStreamEndCapture_ptsz");
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* status) {
  const call_depth depth;
  return stream_is_capturing(stream, status, nullptr, false, "cudaStreamIsCapturing");
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamIsCapturing_ptsz(cudaStream_t stream,
                                                             enum cudaStreamCaptureStatus* status) {
  const call_depth depth;
  return stream_is_capturing(stream, status, nullptr, true, "cudaStreamIsCapturing_ptsz");
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetCaptureInfo(cudaStream_t stream, enum cudaStreamCaptureStatus* status,
                                                           unsigned long long* id, cudaGraph_t* graph,
                                                           const cudaGraphNode_t** dependencies,
                                                           const cudaGraphEdgeData** edges, size_t* count) {
  const call_depth depth;
  if (graph != nullptr) *graph = nullptr;
  if (dependencies != nullptr) *dependencies = nullptr;
  if (edges != nullptr) *edges = nullptr;
  if (count != nullptr) *count = 0;
  return stream_is_capturing(stream, status, id, false, "cudaStreamGetCaptureInfo");
}
CUDASIM_API cudaError_t CUDARTAPI cudaStreamGetCaptureInfo_ptsz(cudaStream_t stream,
                                                                enum cudaStreamCaptureStatus* status,
                                                                unsigned long long* id, cudaGraph_t* graph,
                                                                const cudaGraphNode_t** dependencies,
                                                                const cudaGraphEdgeData** edges, size_t* count) {
  const call_depth depth;
  if (graph != nullptr) *graph = nullptr;
  if (dependencies != nullptr) *dependencies = nullptr;
  if (edges != nullptr) *edges = nullptr;
  if (count != nullptr) *count = 0;
  return stream_is_capturing(stream, status, id, true, "cudaStreamGetCaptureInfo_ptsz");
}
CUDASIM_API cudaError_t CUDARTAPI cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode* mode) {
  const call_depth depth;
  CUDASIM_ENTER("cudaThreadExchangeStreamCaptureMode");
  if (mode == nullptr) return c.result(cudaErrorInvalidValue);
  std::swap(*mode, t_capture_mode);
  return cudaSuccess;
}
CUDASIM_API cudaError_t CUDARTAPI cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  const call_depth depth;
  CUDASIM_ENTER("cudaGraphInstantiate");
  auto g = c.s.graphs.find(reinterpret_cast<std::uintptr_t>(graph));
  if (exec == nullptr || !g) return c.violation(cudaErrorInvalidValue, "instantiate of an invalid graph");
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  const bool memory_nodes = g->has_memory_nodes();
  if (memory_nodes && !g->executable.expired()) {
    return c.violation(cudaErrorInvalidValue,
                       "a second executable of a graph with memory allocation or free nodes (CUDA allows one at a "
                       "time: destroy the first with cudaGraphExecDestroy)");
  }
  auto executable = std::make_shared<graph_obj>(*g);
  executable->executable.reset();
  if (memory_nodes) g->executable = executable;
  *exec = reinterpret_cast<cudaGraphExec_t>(c.s.execs.add(std::move(executable)));
  return cudaSuccess;
}
CUDASIM_API cudaError_t CUDARTAPI cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  const call_depth depth;
  return graph_launch(exec, stream, false, "cudaGraphLaunch");
}
CUDASIM_API cudaError_t CUDARTAPI cudaGraphLaunch_ptsz(cudaGraphExec_t exec, cudaStream_t stream) {
  const call_depth depth;
  return graph_launch(exec, stream, true, "cudaGraphLaunch_ptsz");
}
CUDASIM_API cudaError_t CUDARTAPI cudaGraphDestroy(cudaGraph_t graph) {
  const call_depth depth;
  CUDASIM_ENTER("cudaGraphDestroy");
  const auto h = reinterpret_cast<std::uintptr_t>(graph);
  if (!c.s.graphs.find(h)) return c.violation(cudaErrorInvalidValue, "destroy of an invalid graph");
  c.s.graphs.remove(h);
  return cudaSuccess;
}
/// The executable takes the graph's work when it has as many operations of the same kinds (its "topology"); the
/// runtime's finer rules (node types and parameters that may change) are not modelled.
CUDASIM_API cudaError_t CUDARTAPI cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph,
                                                      cudaGraphExecUpdateResultInfo* info) {
  const call_depth depth;
  CUDASIM_ENTER("cudaGraphExecUpdate");
  auto e = c.s.execs.find(reinterpret_cast<std::uintptr_t>(exec));
  auto g = c.s.graphs.find(reinterpret_cast<std::uintptr_t>(graph));
  if (!e || !g || info == nullptr)
    return c.violation(cudaErrorInvalidValue, "update with an invalid graph or executable");
  *info = cudaGraphExecUpdateResultInfo{};
  bool same = e->ops.size() == g->ops.size();
  for (std::size_t i = 0; same && i < e->ops.size(); ++i) same = e->ops[i].kind == g->ops[i].kind;
  if (!same) {
    info->result = cudaGraphExecUpdateErrorTopologyChanged;
    return c.result(cudaErrorGraphExecUpdateFailure);
  }
  // Memory nodes cannot change: an executable's allocations keep their addresses.
  for (std::size_t i = 0; i < e->ops.size(); ++i) {
    if (e->ops[i].allocates != g->ops[i].allocates || e->ops[i].frees != g->ops[i].frees) {
      info->result = cudaGraphExecUpdateErrorNotSupported;
      return c.result(cudaErrorGraphExecUpdateFailure);
    }
  }
  e->ops = g->ops;
  info->result = cudaGraphExecUpdateSuccess;
  return cudaSuccess;
}
CUDASIM_API cudaError_t CUDARTAPI cudaGraphExecDestroy(cudaGraphExec_t exec) {
  const call_depth depth;
  CUDASIM_ENTER("cudaGraphExecDestroy");
  const auto h = reinterpret_cast<std::uintptr_t>(exec);
  if (!c.s.execs.find(h)) return c.violation(cudaErrorInvalidValue, "destroy of an invalid graph executable");
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  c.s.execs.remove(h);
  return cudaSuccess;
}

// --- events ---

static cudaError_t event_create(call& c, cudaEvent_t* out, unsigned flags) {
  if (out == nullptr) return c.result(cudaErrorInvalidValue);
  if (c.s.devices.empty()) return c.result(c.s.no_devices_result);
  if ((flags & cudaEventInterprocess) != 0 && (flags & cudaEventDisableTiming) == 0) {
    return c.result(cudaErrorInvalidValue);
  }
  auto ev = std::make_shared<event_obj>();
  ev->device = context_device(c);
  ev->flags = flags;
  *out = reinterpret_cast<cudaEvent_t>(c.s.events.add(ev));
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaEventCreate(cudaEvent_t* out) {
  const call_depth depth;
  CUDASIM_ENTER("cudaEventCreate");
  return event_create(c, out, cudaEventDefault);
}

CUDASIM_API cudaError_t CUDARTAPI cudaEventCreateWithFlags(cudaEvent_t* out, unsigned int flags) {
  const call_depth depth;
  CUDASIM_ENTER("cudaEventCreateWithFlags");
  return event_create(c, out, flags);
}

CUDASIM_API cudaError_t CUDARTAPI cudaEventDestroy(cudaEvent_t event) {
  const call_depth depth;
  CUDASIM_ENTER("cudaEventDestroy");
  const auto h = reinterpret_cast<std::uintptr_t>(event);
  if (!c.s.events.find(h)) {
    return c.violation(cudaErrorInvalidResourceHandle, c.s.events.was_issued(h)
                                                           ? "double cudaEventDestroy of " + hex(h)
                                                           : "cudaEventDestroy of an invalid handle");
  }
  c.s.events.remove(h);
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  const call_depth depth;
  return event_record(event, stream, false, "cudaEventRecord");
}
CUDASIM_API cudaError_t CUDARTAPI cudaEventRecord_ptsz(cudaEvent_t event, cudaStream_t stream) {
  const call_depth depth;
  return event_record(event, stream, true, "cudaEventRecord_ptsz");
}

CUDASIM_API cudaError_t CUDARTAPI cudaEventQuery(cudaEvent_t event) {
  const call_depth depth;
  CUDASIM_ENTER("cudaEventQuery");
  auto ev = c.s.events.find(reinterpret_cast<std::uintptr_t>(event));
  if (!ev) return c.violation(cudaErrorInvalidResourceHandle, "query of a destroyed or invalid event");
  if (ev->capture) return c.violation(cudaErrorCapturedEvent, "cudaEventQuery of an event recorded in a capture");
  // An event recorded outside any capture may be asked about only where the thread's mode permits unsafe calls.
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  if (ev->last && !ev->last->done) return cudaErrorNotReady;
  observe(c.s, ev->last);
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaEventSynchronize(cudaEvent_t event) {
  const call_depth depth;
  CUDASIM_ENTER("cudaEventSynchronize");
  auto ev = c.s.events.find(reinterpret_cast<std::uintptr_t>(event));
  if (!ev) return c.violation(cudaErrorInvalidResourceHandle, "synchronize of a destroyed or invalid event");
  if (ev->capture) return c.violation(cudaErrorCapturedEvent, "cudaEventSynchronize of an event recorded in a capture");
  if (cudaError_t e = unsafe_during_capture(c); e != cudaSuccess) return e;
  const int device = ev->device;
  wait_for(c, {ev->last});
  observe(c.s, ev->last);
  pool_release_at_synchronize(c.s, device);
  return c.s.sticky != cudaSuccess ? c.result(c.s.sticky) : cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  const call_depth depth;
  CUDASIM_ENTER("cudaEventElapsedTime");
  auto a = c.s.events.find(reinterpret_cast<std::uintptr_t>(start));
  auto b = c.s.events.find(reinterpret_cast<std::uintptr_t>(end));
  if (ms == nullptr || !a || !b) return c.violation(cudaErrorInvalidResourceHandle, "elapsed time of invalid events");
  if ((a->flags & cudaEventDisableTiming) != 0 || (b->flags & cudaEventDisableTiming) != 0 || !a->last || !b->last) {
    return c.result(cudaErrorInvalidResourceHandle);
  }
  if (!a->last->done || !b->last->done) return c.result(cudaErrorNotReady);
  *ms = std::chrono::duration<float, std::milli>(b->last->completed_at - a->last->completed_at).count();
  return cudaSuccess;
}

CUDASIM_API cudaError_t CUDARTAPI cudaIpcGetEventHandle(cudaIpcEventHandle_t* handle, cudaEvent_t event) {
  const call_depth depth;
  CUDASIM_ENTER("cudaIpcGetEventHandle");
  auto ev = c.s.events.find(reinterpret_cast<std::uintptr_t>(event));
  if (handle == nullptr || !ev) return c.violation(cudaErrorInvalidResourceHandle, "IPC handle of an invalid event");
  if ((ev->flags & cudaEventInterprocess) == 0) return c.result(cudaErrorInvalidResourceHandle);
  *handle = cudaIpcEventHandle_t{};
  const auto h = reinterpret_cast<std::uintptr_t>(event);
  std::memcpy(handle->reserved, &h, sizeof h);
  return cudaSuccess;
}

}  // extern "C"
