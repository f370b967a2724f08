// Closed-loop load generator for KServe v2 gRPC ModelInfer, measuring what Triton's
// perf_analyzer reports: throughput, client latency percentiles, and the server-side split
// (queue, compute) from ModelStatistics deltas over the measurement window.
//
//   kserve_loadgen --url 127.0.0.1:8001 --model simple --concurrency 1,16 --seconds 5
//
// Each of `concurrency` threads sends the next request as soon as the previous one returns,
// on its own channel (as perf_analyzer does by default). Requests are `simple`-shaped:
// INT32 INPUT0/INPUT1 [batch, 16] in raw_input_contents.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
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
  CLI11_PARSE(app, argc, argv);

  inference::ModelInferRequest request;
  request.set_model_name(model);
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
  return 0;
}
