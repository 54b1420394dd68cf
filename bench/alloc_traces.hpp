// Allocation traces for gpukit's fragmentation benchmark, and the baselines replayed beside the caching allocator:
// - transformer_training(): the allocations of a transformer training step as PyTorch performs them under
//   mixed precision (fp32 parameters, gradients and Adam states; bf16 weight copies and activations saved in the
//   forward pass and freed in reverse during backward; matmul workspaces of varied sizes; foreach optimizer
//   temporaries; gradients freed by zero_grad(set_to_none=True)); several steps, optionally with a different
//   sequence length each step (variable-length batches);
// - random_allocations(): RMM's random benchmark: 73 % allocations / 27 % frees of a random live block, sizes
//   uniform in [1, max_size];
// - churn(): one stream, a few MiB live, random sizes, the oldest freed first (the footprint never grows, so every
//   upstream call after the first few is churn);
// - inference_server(): requests on several streams, each allocating a few buffers of varied sizes on its stream
//   and freeing them when the stream's next request comes (trace_op::stream says which stream);
// - replay(): through any allocator with allocate(bytes) / deallocate(p); reports peak reserved / peak requested;
// - bin_allocator_model: a geometric-bin cache like cub::CachingDeviceAllocator (power-of-two bins, or CUB's
//   defaults: growth 8, bins 512 B..2 MiB, at most 6 MB cached, larger blocks uncached), optionally
//   capacity-limited.
// Each trace marks where its warm-up ends (warmup_ops): the end of the first training step, the first 10 % of the
// random operations; upstream frees after it are the ones a steady workload should not make.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cmath>
#include <cstdint>
#include <deque>
#include <random>
#include <utility>
#include <string>
#include <vector>

namespace gpukit_bench {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

struct trace_op {
  bool allocate = true;
  std::uint8_t stream = 0;  // for multi-stream traces (inference_server); 0 elsewhere
  std::uint32_t id = 0;
  std::size_t bytes = 0;
};

struct trace {
  std::string name;
  std::vector<trace_op> ops;
  std::size_t ids = 0;
  std::size_t peak_requested = 0;  // most bytes live at once, as requested
  std::size_t allocations = 0;
  std::size_t warmup_ops = 0;  // ops[0, warmup_ops) are the warm-up (the first training step)
  int streams = 1;
};

class trace_builder {
 public:
  explicit trace_builder(std::string name) { t_.name = std::move(name); }
  std::uint32_t alloc(std::size_t bytes, std::uint8_t stream = 0) {
    const auto id = static_cast<std::uint32_t>(sizes_.size());
    sizes_.push_back(bytes);
    streams_.push_back(stream);
    if (stream >= t_.streams) t_.streams = stream + 1;
    t_.ops.push_back({true, stream, id, bytes});
    live_ += bytes;
    t_.peak_requested = std::max(t_.peak_requested, live_);
    ++t_.allocations;
    return id;
  }
  void free(std::uint32_t id) {
    t_.ops.push_back({false, streams_[id], id, sizes_[id]});
    live_ -= sizes_[id];
  }
  /// The warm-up ends here.
  void end_warmup() { t_.warmup_ops = t_.ops.size(); }
  trace finish() {
    t_.ids = sizes_.size();
    return std::move(t_);
  }

 private:
  trace t_;
  std::vector<std::size_t> sizes_;
  std::vector<std::uint8_t> streams_;
  std::size_t live_ = 0;
};

struct transformer_shape {
  int layers = 24;
  std::size_t hidden = 1024;
  std::size_t seq = 1024;
  std::size_t batch = 8;
  std::size_t vocab = 50257;
  int steps = 4;
  bool variable_seq = false;  // each step draws its sequence length from [seq/2, seq] in multiples of 64
  std::uint64_t seed = 1;
};

inline std::string describe(const transformer_shape& t) {
  return "transformer L" + std::to_string(t.layers) + " h" + std::to_string(t.hidden) + " s" +
         (t.variable_seq ? "<=" : "") + std::to_string(t.seq) + " b" + std::to_string(t.batch);
}

/// See the file comment. Sizes: bf16 = 2 bytes, fp32 = 4 bytes; T = batch × sequence tokens.
inline trace transformer_training(const transformer_shape& t) {
  trace_builder b(describe(t));
  std::mt19937_64 rng(t.seed);
  const std::size_t h = t.hidden;
  const std::size_t f = 4 * h;
  const std::size_t heads = std::max<std::size_t>(1, h / 64);
  constexpr std::uint32_t none = ~0u;

  struct param {
    std::size_t elems;
    std::uint32_t weight = none, grad = none, m = none, v = none;
  };
  std::vector<param> params;
  auto add_param = [&](std::size_t elems) {
    params.push_back({elems});
    params.back().weight = b.alloc(elems * 4);
    return params.size() - 1;
  };
  struct layer_params {
    std::size_t ln1w, ln1b, qkvw, qkvb, projw, projb, ln2w, ln2b, fc1w, fc1b, fc2w, fc2b;
  };
  const std::size_t wte = add_param(t.vocab * h);
  const std::size_t wpe = add_param(t.seq * h);
  std::vector<layer_params> layers;
  for (int l = 0; l < t.layers; ++l) {
    layer_params p{};
    p.ln1w = add_param(h);
    p.ln1b = add_param(h);
    p.qkvw = add_param(3 * h * h);
    p.qkvb = add_param(3 * h);
    p.projw = add_param(h * h);
    p.projb = add_param(h);
    p.ln2w = add_param(h);
    p.ln2b = add_param(h);
    p.fc1w = add_param(f * h);
    p.fc1b = add_param(f);
    p.fc2w = add_param(h * f);
    p.fc2b = add_param(h);
    layers.push_back(p);
  }
  const std::size_t lnfw = add_param(h);
  const std::size_t lnfb = add_param(h);
  (void)b.alloc(32 * MiB);  // cuBLAS workspace, kept for the whole run

  // A matmul's temporary workspace: varied sizes, freed at once.
  auto workspace = [&](std::size_t scale) {
    const std::size_t bytes = std::uniform_int_distribution<std::size_t>(scale / 8, scale)(rng) & ~std::size_t{255};
    if (bytes != 0) b.free(b.alloc(bytes));
  };
  // A weight gradient: computed in bf16, accumulated into the fp32 .grad (allocated on first use each step).
  auto weight_grad = [&](std::size_t index) {
    param& p = params[index];
    const std::uint32_t temp = b.alloc(p.elems * 2);
    if (p.grad == none) p.grad = b.alloc(p.elems * 4);
    b.free(temp);
  };
  auto bias_grad = [&](std::size_t index) {
    param& p = params[index];
    if (p.grad == none) p.grad = b.alloc(p.elems * 4);
  };

  for (int step = 0; step < t.steps; ++step) {
    std::size_t s = t.seq;
    if (t.variable_seq) s = 64 * std::uniform_int_distribution<std::size_t>(t.seq / 128, t.seq / 64)(rng);
    const std::size_t T = t.batch * s;
    // ---- forward ----
    const std::uint32_t ids = b.alloc(T * 8);
    std::uint32_t x = b.alloc(T * h * 2);  // embeddings (bf16)
    struct saved {
      std::uint32_t input, w_qkv, w_proj, w_fc1, w_fc2, ln1, ln1_mean, ln1_rstd, qkv, attn, lse, x1, ln2, ln2_mean,
          ln2_rstd, fc1, gelu;
    };
    std::vector<saved> saves;
    for (int l = 0; l < t.layers; ++l) {
      const layer_params& p = layers[static_cast<std::size_t>(l)];
      saved sv{};
      sv.input = x;
      sv.w_qkv = b.alloc(params[p.qkvw].elems * 2);  // autocast's bf16 weight copies, kept for backward
      sv.w_proj = b.alloc(params[p.projw].elems * 2);
      sv.w_fc1 = b.alloc(params[p.fc1w].elems * 2);
      sv.w_fc2 = b.alloc(params[p.fc2w].elems * 2);
      sv.ln1 = b.alloc(T * h * 2);
      sv.ln1_mean = b.alloc(T * 4);
      sv.ln1_rstd = b.alloc(T * 4);
      workspace(T * 3 * h * 2);
      sv.qkv = b.alloc(T * 3 * h * 2);
      workspace(T * h * 4);
      sv.attn = b.alloc(T * h * 2);
      sv.lse = b.alloc(t.batch * heads * s * 4);
      workspace(T * h * 2);
      const std::uint32_t proj = b.alloc(T * h * 2);
      sv.x1 = b.alloc(T * h * 2);  // residual
      b.free(proj);
      sv.ln2 = b.alloc(T * h * 2);
      sv.ln2_mean = b.alloc(T * 4);
      sv.ln2_rstd = b.alloc(T * 4);
      workspace(T * f * 2);
      sv.fc1 = b.alloc(T * f * 2);
      sv.gelu = b.alloc(T * f * 2);
      workspace(T * h * 2);
      const std::uint32_t fc2 = b.alloc(T * h * 2);
      x = b.alloc(T * h * 2);  // residual: the next layer's input
      b.free(fc2);
      saves.push_back(sv);
    }
    const std::uint32_t lnf = b.alloc(T * h * 2);
    const std::uint32_t lnf_mean = b.alloc(T * 4);
    const std::uint32_t lnf_rstd = b.alloc(T * 4);
    const std::uint32_t logits = b.alloc(T * t.vocab * 2);
    const std::uint32_t log_probs = b.alloc(T * t.vocab * 4);  // cross-entropy in fp32
    // ---- backward ----
    const std::uint32_t dlog32 = b.alloc(T * t.vocab * 4);
    b.free(log_probs);
    const std::uint32_t dlogits = b.alloc(T * t.vocab * 2);
    b.free(dlog32);
    weight_grad(wte);  // tied output projection
    std::uint32_t dx = b.alloc(T * h * 2);
    b.free(dlogits);
    b.free(logits);
    bias_grad(lnfw);
    bias_grad(lnfb);
    const std::uint32_t dlnf = b.alloc(T * h * 2);
    b.free(dx);
    b.free(lnf);
    b.free(lnf_mean);
    b.free(lnf_rstd);
    dx = dlnf;
    b.free(x);
    for (int l = t.layers - 1; l >= 0; --l) {
      const layer_params& p = layers[static_cast<std::size_t>(l)];
      const saved& sv = saves[static_cast<std::size_t>(l)];
      // fc2
      workspace(T * f * 2);
      weight_grad(p.fc2w);
      bias_grad(p.fc2b);
      const std::uint32_t dgelu = b.alloc(T * f * 2);
      b.free(sv.w_fc2);
      const std::uint32_t dfc1 = b.alloc(T * f * 2);
      b.free(dgelu);
      b.free(sv.gelu);
      // fc1
      workspace(T * f * 2);
      weight_grad(p.fc1w);
      bias_grad(p.fc1b);
      const std::uint32_t dln2 = b.alloc(T * h * 2);
      b.free(dfc1);
      b.free(sv.fc1);
      b.free(sv.w_fc1);
      // ln2 and the residual
      const std::uint32_t dx1 = b.alloc(T * h * 2);
      bias_grad(p.ln2w);
      bias_grad(p.ln2b);
      b.free(dln2);
      b.free(sv.ln2);
      b.free(sv.ln2_mean);
      b.free(sv.ln2_rstd);
      b.free(dx);
      b.free(sv.x1);
      // attention projection
      workspace(T * h * 2);
      weight_grad(p.projw);
      bias_grad(p.projb);
      const std::uint32_t dattn = b.alloc(T * h * 2);
      b.free(sv.w_proj);
      // attention
      workspace(T * h * 4);
      const std::uint32_t dqkv = b.alloc(T * 3 * h * 2);
      b.free(dattn);
      b.free(sv.attn);
      b.free(sv.lse);
      b.free(sv.qkv);
      // qkv
      workspace(T * 3 * h * 2);
      weight_grad(p.qkvw);
      bias_grad(p.qkvb);
      const std::uint32_t dln1 = b.alloc(T * h * 2);
      b.free(dqkv);
      b.free(sv.w_qkv);
      // ln1 and the residual
      const std::uint32_t dinput = b.alloc(T * h * 2);
      bias_grad(p.ln1w);
      bias_grad(p.ln1b);
      b.free(dln1);
      b.free(sv.ln1);
      b.free(sv.ln1_mean);
      b.free(sv.ln1_rstd);
      b.free(dx1);
      b.free(sv.input);
      dx = dinput;
    }
    weight_grad(wpe);
    b.free(dx);
    b.free(ids);
    // ---- optimizer: Adam (foreach): states on the first step, one list of temporaries per step ----
    std::vector<std::uint32_t> temps;
    for (param& p : params) {
      if (p.m == none) {
        p.m = b.alloc(p.elems * 4);
        p.v = b.alloc(p.elems * 4);
      }
      temps.push_back(b.alloc(p.elems * 4));
    }
    for (std::uint32_t id : temps) b.free(id);
    // ---- zero_grad(set_to_none=True) ----
    for (param& p : params) {
      if (p.grad != none) b.free(p.grad);
      p.grad = none;
    }
    if (step == 0) b.end_warmup();
  }
  return b.finish();
}

/// RMM's random allocation benchmark: `operations` steps, each an allocation with probability 73 % (uniform size
/// in [1, max_size]) or the free of a random live allocation.
inline trace random_allocations(std::size_t operations, std::size_t max_size, std::uint64_t seed) {
  trace_builder b("random 73/27, sizes <= " + std::to_string(max_size >> 10) + " KiB");
  std::mt19937_64 rng(seed);
  std::vector<std::uint32_t> live;
  for (std::size_t i = 0; i < operations; ++i) {
    if (i == operations / 10) b.end_warmup();
    if (live.empty() || std::uniform_int_distribution<int>(0, 99)(rng) < 73) {
      live.push_back(b.alloc(std::uniform_int_distribution<std::size_t>(1, max_size)(rng)));
    } else {
      const std::size_t k = std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng);
      b.free(live[k]);
      live[k] = live.back();
      live.pop_back();
    }
  }
  return b.finish();
}

/// One stream, at most `max_live` bytes live: `allocations` sizes uniform in [min_size, max_size], the oldest live
/// allocations freed first until the new one fits. The first 10 % of the allocations are the warm-up.
inline trace churn(std::size_t allocations, std::size_t max_live, std::size_t min_size, std::size_t max_size,
                   std::uint64_t seed) {
  trace_builder b("churn, <= " + std::to_string(max_live >> 20) + " MiB live");
  std::mt19937_64 rng(seed);
  std::deque<std::pair<std::uint32_t, std::size_t>> live;
  std::size_t live_bytes = 0;
  for (std::size_t i = 0; i < allocations; ++i) {
    if (i == allocations / 10) b.end_warmup();
    const std::size_t bytes = std::uniform_int_distribution<std::size_t>(min_size, max_size)(rng);
    while (!live.empty() && live_bytes + bytes > max_live) {
      b.free(live.front().first);
      live_bytes -= live.front().second;
      live.pop_front();
    }
    live.emplace_back(b.alloc(bytes), bytes);
    live_bytes += bytes;
  }
  return b.finish();
}

/// An inference server: `requests` requests, round robin over `streams` streams; each allocates 2 to 5 buffers on
/// its stream, sizes log-uniform in [min_size, max_size] (multiples of 256 B), and they are freed when that stream's
/// next request starts (one request live per stream). The first 10 % of the requests are the warm-up.
inline trace inference_server(std::size_t requests, int streams, std::size_t min_size, std::size_t max_size,
                              std::uint64_t seed) {
  trace_builder b("inference server, " + std::to_string(streams) + " streams");
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(std::log(static_cast<double>(min_size)),
                                                  std::log(static_cast<double>(max_size)));
  std::vector<std::vector<std::uint32_t>> live(static_cast<std::size_t>(streams));
  for (std::size_t r = 0; r < requests; ++r) {
    if (r == requests / 10) b.end_warmup();
    const auto s = static_cast<std::uint8_t>(r % static_cast<std::size_t>(streams));
    for (std::uint32_t id : live[s]) b.free(id);
    live[s].clear();
    const int buffers = std::uniform_int_distribution<int>(2, 5)(rng);
    for (int i = 0; i < buffers; ++i) {
      const auto bytes = static_cast<std::size_t>(std::exp(log_size(rng)));
      live[s].push_back(b.alloc(std::max<std::size_t>(256, bytes & ~std::size_t{255}), s));
    }
  }
  return b.finish();
}

/// Replays a trace (allocations still live at the end are freed afterwards, outside the measurement).
template <class Allocator>
void replay(const trace& t, Allocator& a, std::vector<void*>& pointers) {
  pointers.assign(t.ids, nullptr);
  for (const trace_op& op : t.ops) {
    if (op.allocate) {
      pointers[op.id] = a.allocate(op.bytes);
    } else {
      a.deallocate(pointers[op.id], op.bytes);
      pointers[op.id] = nullptr;
    }
  }
}

/// A model of a geometric-bin caching allocator (cub::CachingDeviceAllocator): requests are rounded up to the next
/// bin (growth^k bytes), freed blocks are cached per bin and reused only for requests of that bin. Requests above
/// the largest bin are exact and never cached; blocks beyond max_cached bytes are freed instead of cached.
/// It counts bytes only (no memory), so any trace can be replayed. With a capacity, an allocation that would exceed
/// it frees every cached block and retries (as CUB does when cudaMalloc fails), then returns nullptr.
class bin_allocator_model {
 public:
  bin_allocator_model(std::size_t growth, std::size_t min_bin_bytes, std::size_t max_bin_bytes,
                      std::size_t max_cached_bytes, std::size_t capacity = ~std::size_t{0})
      : growth_(growth), min_(min_bin_bytes), max_(max_bin_bytes), max_cached_(max_cached_bytes), capacity_(capacity) {}

  void* allocate(std::size_t bytes) {
    const std::size_t size = bin_size(bytes);
    if (size <= max_) {
      auto& count = cached_[size];
      if (count > 0) {
        --count;
        cached_bytes_ -= size;
        return &tokens_;
      }
    }
    if (!fits(size)) {
      for (auto& e : cached_.entries) upstream_frees_ += e.second;
      reserved_ -= cached_bytes_;
      cached_bytes_ = 0;
      cached_.entries.clear();
      if (!fits(size)) return nullptr;
    }
    reserved_ += size;
    peak_reserved_ = std::max(peak_reserved_, reserved_);
    ++upstream_allocs_;
    return &tokens_;
  }
  void deallocate(void*, std::size_t bytes) {
    const std::size_t size = bin_size(bytes);
    if (size <= max_ && cached_bytes_ + size <= max_cached_) {
      ++cached_[size];
      cached_bytes_ += size;
    } else {
      reserved_ -= size;
      ++upstream_frees_;
    }
  }
  std::size_t peak_reserved() const noexcept { return peak_reserved_; }
  /// cudaMalloc + cudaFree calls: allocations the cache could not serve, frees it did not keep.
  std::size_t upstream_calls() const noexcept { return upstream_allocs_ + upstream_frees_; }
  std::size_t upstream_allocs() const noexcept { return upstream_allocs_; }
  std::size_t upstream_frees() const noexcept { return upstream_frees_; }

 private:
  bool fits(std::size_t size) const { return size <= capacity_ && reserved_ <= capacity_ - size; }
  std::size_t bin_size(std::size_t bytes) const {
    if (bytes > max_) return bytes;
    std::size_t size = min_;
    while (size < bytes) size *= growth_;
    return size;
  }
  std::size_t growth_, min_, max_, max_cached_, capacity_;
  std::size_t reserved_ = 0;
  std::size_t peak_reserved_ = 0;
  std::size_t cached_bytes_ = 0;
  std::size_t upstream_allocs_ = 0;
  std::size_t upstream_frees_ = 0;
  struct counts {
    std::vector<std::pair<std::size_t, std::size_t>> entries;
    std::size_t& operator[](std::size_t size) {
      for (auto& e : entries) {
        if (e.first == size) return e.second;
      }
      entries.emplace_back(size, 0);
      return entries.back().second;
    }
  } cached_;
  int tokens_ = 0;
};

}  // namespace gpukit_bench
