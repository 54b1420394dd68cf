// memory_history: records what the caching allocator does during a small "training" workload (weights, then steps
// whose activations are saved in the forward pass and freed in reverse in the backward pass, with a workspace per
// layer), and writes what the tools people use read:
//
//   memory.html      the picture: allocated vs reserved over time, every segment and block (open in a browser)
//   snapshot.pickle  PyTorch's snapshot format: drop it on https://pytorch.org/memory_viz
//   allocations.csv  RMM's log format: `gpukit_replay allocations.csv` says on which GPUs the workload fits
//
// and prints the leak report (an allocation is left live on purpose, tagged "forgotten"). The same code runs on a
// GPU and, without one, on the CPU device: a history recorded there is valid input for gpukit_replay.
//
//   memory_history [output directory]
#include <gpukit/gpukit.hpp>
#include <gpukit/memory/history_export.hpp>
#include <gpukit/memory/memory_picture.hpp>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? std::string(argv[1]) + "/" : std::string();
  try {
    const gpukit::device_selection selection = gpukit::select_device();
    const gpukit::device d = selection.device;
    std::printf("device: %s (%s)\n", d.to_string().c_str(), selection.reason.c_str());
    gpukit::stream s(d);
    auto history = gpukit::record_memory_history(d, 100000);

    constexpr std::size_t layers = 6, hidden = 256, batch = 32;
    std::vector<gpukit::device_buffer<float>> weights;
    {
      gpukit::memory_tag tag("weights");
      for (std::size_t l = 0; l < layers; ++l) weights.emplace_back(hidden * hidden, s);
    }
    std::vector<gpukit::device_buffer<float>> leaked;
    for (int step = 0; step < 3; ++step) {
      std::vector<gpukit::device_buffer<float>> saved;
      {
        gpukit::memory_tag tag("activations");
        for (std::size_t l = 0; l < layers; ++l) {
          saved.emplace_back(batch * hidden * (1 + step), s);  // longer sequences each step
          gpukit::memory_tag workspace("workspace");
          gpukit::device_buffer<float> scratch(hidden * hidden / 2 + l * 1000, s);  // freed at once
        }
      }
      {
        gpukit::memory_tag tag("gradients");
        while (!saved.empty()) {  // backward: activations freed in reverse, a gradient per layer meanwhile
          gpukit::device_buffer<float> grad(hidden * hidden, s);
          saved.pop_back();
        }
      }
      if (step == 1) {
        gpukit::memory_tag tag("forgotten");
        leaked.emplace_back(12345, s);  // still live at the end: the leak report shows it
      }
    }
    s.synchronize();

    gpukit::device_allocator& allocator = gpukit::default_allocator(d);
    const gpukit::allocator_snapshot snapshot = allocator.snapshot();
    std::ofstream(dir + "memory.html") << gpukit::memory_picture_html(snapshot, *history, "memory_history example");
    gpukit::dump_pytorch_snapshot(dir + "snapshot.pickle", snapshot, *history);
    std::ofstream(dir + "allocations.csv") << gpukit::rmm_log_csv(*history);
    std::printf("%zu events recorded; wrote %smemory.html, %ssnapshot.pickle, %sallocations.csv\n",
                history->events().size(), dir.c_str(), dir.c_str(), dir.c_str());

    weights.clear();  // the model is done: what is still live now was forgotten
    s.synchronize();
    gpukit::stop_memory_history(d);
    std::printf("%s", gpukit::leak_report(*history).c_str());
    std::printf(
        "next: open memory.html in a browser, drop snapshot.pickle on https://pytorch.org/memory_viz, and run "
        "gpukit_replay allocations.csv\n");
    const auto groups = gpukit::live_allocations(*history);
    return groups.size() == 1 && groups.front().tag == "forgotten" ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memory_history: %s\n", e.what());
    return 1;
  }
}
