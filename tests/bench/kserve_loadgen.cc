// Closed-loop load generator for KServe v2 gRPC ModelInfer, measuring what Triton's
// perf_analyzer reports: throughput, client latency percentiles, and the server-side split
// (queue, compute) from ModelStatistics deltas over the measurement window.
//
//   kserve_loadgen --url 127.0.0.1:8001 --model simple --concurrency 1,16 --seconds 5
//
// Each of `concurrency` threads sends the next request as soon as the previous one returns,
// on its own channel (as perf_analyzer does by default). Requests are `simple`-shaped:
// INT32 INPUT0/INPUT1 [batch, 16] in raw_input_contents.
//
// With --input-bytes N the request is one FP32 INPUT0 of N/4 elements instead (for
// `identity_fp32`), and --shm says where its tensors travel (Triton's system shared memory
// extension, as perf_analyzer's --shared-memory=system does): `none` inline in the messages,
// `input` the input in a shared-memory region per thread (registered over gRPC), `both` the
// output too.
//
//   kserve_loadgen --model identity_fp32 --input-bytes 1048576 --shm input --concurrency 1,16
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "proto/kserve/grpc_service.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  uint64_t count = 0, queue_ns = 0, infer_ns = 0, input_ns = 0, output_ns = 0, success_ns = 0;
};

Stats ServerStats(inference::GRPCInferenceService::Stub& stub, const std::string& model) {
  grpc::ClientContext ctx;
  inference::ModelStatisticsRequest req;
  req.set_name(model);
  inference::ModelStatisticsResponse resp;
  Stats s;
  if (!stub.ModelStatistics(&ctx, req, &resp).ok() || resp.model_stats_size() == 0) return s;
  const auto& st = resp.model_stats(0).inference_stats();
  s.count = st.success().count();
  s.success_ns = st.success().ns();
  s.queue_ns = st.queue().ns();
  s.input_ns = st.compute_input().ns();
  s.infer_ns = st.compute_infer().ns();
  s.output_ns = st.compute_output().ns();
  return s;
}

// A POSIX shared-memory object this process creates, maps and unlinks at the end.
struct ShmObject {
  std::string key;
  char* data = nullptr;
  size_t size = 0;
  bool Create(const std::string& k, size_t n) {
    key = k;
    size = n;
    const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(n)) != 0) return false;
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return false;
    data = static_cast<char*>(p);
    return true;
  }
  ~ShmObject() {
    if (data != nullptr) munmap(data, size);
    if (!key.empty()) shm_unlink(key.c_str());
  }
};

void SetShm(google::protobuf::Map<std::string, inference::InferParameter>& params,
            const std::string& region, int64_t bytes) {
  params["shared_memory_region"].set_string_param(region);
  params["shared_memory_byte_size"].set_int64_param(bytes);
}

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  size_t k = std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * v.size()));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"KServe v2 gRPC closed-loop load generator"};
  std::string url = "127.0.0.1:8001", model = "simple";
  std::vector<int> concurrency = {1, 16};
  double seconds = 5, warmup = 1;
  int batch = 1;
  app.add_option("--url", url, "gRPC HOST:PORT");
  app.add_option("--model", model, "model name (simple-shaped inputs)");
  app.add_option("--concurrency", concurrency, "comma-separated levels")->delimiter(',');
  app.add_option("--seconds", seconds, "measurement window per level");
  app.add_option("--warmup", warmup, "warm-up seconds per level");
  app.add_option("--batch", batch, "batch size of each request");
  int64_t input_bytes = 0;
  std::string shm_mode = "none";
  app.add_option("--input-bytes", input_bytes,
                 "one FP32 INPUT0 of this many bytes (identity_fp32) instead of simple's inputs");
  app.add_option("--shm", shm_mode, "none | input | both: tensors in system shared memory")
      ->check(CLI::IsMember({"none", "input", "both"}));
  CLI11_PARSE(app, argc, argv);
  if (shm_mode != "none" && input_bytes <= 0) {
    std::fprintf(stderr, "--shm needs --input-bytes\n");
    return 2;
  }
  input_bytes = input_bytes / 4 * 4;

  inference::ModelInferRequest request;
  request.set_model_name(model);
  if (input_bytes > 0) {
    auto* in = request.add_inputs();
    in->set_name("INPUT0");
    in->set_datatype("FP32");
    in->add_shape(input_bytes / 4);
    if (shm_mode == "none") request.add_raw_input_contents(std::string(input_bytes, '\x01'));
    request.add_outputs()->set_name("OUTPUT0");
  } else {
    std::vector<int32_t> data(16 * batch, 7);
    for (const char* name : {"INPUT0", "INPUT1"}) {
      auto* in = request.add_inputs();
      in->set_name(name);
      in->set_datatype("INT32");
      in->add_shape(batch);
      in->add_shape(16);
      request.add_raw_input_contents(
          std::string(reinterpret_cast<const char*>(data.data()), data.size() * 4));
    }
  }
  // Per thread: its region(s) in one object, registered once up front.
  const int max_threads = *std::max_element(concurrency.begin(), concurrency.end());
  std::vector<ShmObject> objects(shm_mode == "none" ? 0 : max_threads);
  std::vector<inference::ModelInferRequest> requests(max_threads, request);
  {
    auto stub = inference::GRPCInferenceService::NewStub(
        grpc::CreateChannel(url, grpc::InsecureChannelCredentials()));
    for (size_t t = 0; t < objects.size(); ++t) {
      const bool out = shm_mode == "both";
      const std::string key = "/kiln_loadgen_" + std::to_string(getpid()) + "_" + std::to_string(t);
      if (!objects[t].Create(key, input_bytes * (out ? 2 : 1))) {
        std::fprintf(stderr, "cannot create shared memory %s: %s\n", key.c_str(),
                     std::strerror(errno));
        return 1;
      }
      std::memset(objects[t].data, 1, input_bytes);
      for (const char* what : {"in", "out"}) {
        if (std::string(what) == "out" && !out) continue;
        const std::string region = "loadgen_" + std::to_string(t) + "_" + what;
        grpc::ClientContext ctx;
        inference::SystemSharedMemoryRegisterRequest reg;
        reg.set_name(region);
        reg.set_key(key);
        reg.set_offset(std::string(what) == "out" ? input_bytes : 0);
        reg.set_byte_size(input_bytes);
        inference::SystemSharedMemoryRegisterResponse resp;
        grpc::Status s = stub->SystemSharedMemoryRegister(&ctx, reg, &resp);
        if (!s.ok()) {
          std::fprintf(stderr, "SystemSharedMemoryRegister %s: %s\n", region.c_str(),
                       s.error_message().c_str());
          return 1;
        }
        if (std::string(what) == "in") {
          SetShm(*requests[t].mutable_inputs(0)->mutable_parameters(), region, input_bytes);
        } else {
          SetShm(*requests[t].mutable_outputs(0)->mutable_parameters(), region, input_bytes);
        }
      }
    }
  }

  auto stats_stub = inference::GRPCInferenceService::NewStub(
      grpc::CreateChannel(url, grpc::InsecureChannelCredentials()));
  std::printf("%-12s %14s %12s %12s %12s %14s %14s\n", "concurrency", "infer/s", "p50 us", "p99 us",
              "avg us", "server queue", "server compute");
  for (int c : concurrency) {
    std::atomic<bool> measuring{false}, stop{false};
    std::atomic<uint64_t> errors{0};
    std::vector<std::vector<double>> latencies(c);
    std::vector<std::thread> threads;
    for (int t = 0; t < c; ++t) {
      threads.emplace_back([&, t] {
        grpc::ChannelArguments args;
        args.SetInt("kiln.loadgen.channel", t);  // a distinct channel (connection) per thread
        args.SetMaxReceiveMessageSize(-1);       // 16 MiB outputs come back inline
        args.SetMaxSendMessageSize(-1);
        const inference::ModelInferRequest& request = requests[t];
        auto stub = inference::GRPCInferenceService::NewStub(
            grpc::CreateCustomChannel(url, grpc::InsecureChannelCredentials(), args));
        inference::ModelInferResponse response;
        while (!stop.load(std::memory_order_relaxed)) {
          grpc::ClientContext ctx;
          const auto t0 = Clock::now();
          grpc::Status s = stub->ModelInfer(&ctx, request, &response);
          const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
          if (!s.ok()) {
            errors.fetch_add(1);
            continue;
          }
          if (measuring.load(std::memory_order_relaxed)) latencies[t].push_back(us);
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(warmup));
    const Stats before = ServerStats(*stats_stub, model);
    const auto t0 = Clock::now();
    measuring = true;
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    measuring = false;
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    const Stats after = ServerStats(*stats_stub, model);
    stop = true;
    for (auto& th : threads) th.join();
    std::vector<double> all;
    for (auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
    double sum = 0;
    for (double v : all) sum += v;
    const uint64_t n = after.count - before.count;
    const double queue_us = n ? (after.queue_ns - before.queue_ns) / 1e3 / n : 0;
    const double compute_us =
        n ? ((after.input_ns - before.input_ns) + (after.infer_ns - before.infer_ns) +
             (after.output_ns - before.output_ns)) /
                1e3 / n
          : 0;
    std::printf("%-12d %14.0f %12.1f %12.1f %12.1f %12.1fus %12.1fus%s\n", c, all.size() / elapsed,
                Percentile(all, 50), Percentile(all, 99), all.empty() ? 0 : sum / all.size(),
                queue_us, compute_us, errors ? " (errors!)" : "");
    if (errors)
      std::fprintf(stderr, "%lu requests failed\n", static_cast<unsigned long>(errors.load()));
  }
  if (!objects.empty()) {
    grpc::ClientContext ctx;
    inference::SystemSharedMemoryUnregisterRequest all;
    inference::SystemSharedMemoryUnregisterResponse resp;
    (void)stats_stub->SystemSharedMemoryUnregister(&ctx, all, &resp);
  }
  return 0;
}
