// One-stream decode, A against B, in one process: the model is loaded twice, B with some
// environment switches set while it loads (e.g. KILN_FUSE_PROJECTIONS=0), and the two decode
// the same prompt in alternating rounds, so the VM's drift (up to 2x within minutes on the
// shared machines) hits both alike. Prints tokens/s per round, the paired ratios B/A and their
// median; the greedy tokens of A and B are compared too (a switch that changes them says so).
//
//   build/tests/bench/decode_ab_bench --model .kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf
//       --b-env KILN_FUSE_PROJECTIONS=0 [--a-env K=V ...] [--rounds 20] [--tokens 128]
//       [--threads 2] [--activations f32|q8]
//
// Switches must be ones read while a model loads and compiles (KILN_FUSE_PROJECTIONS,
// KILN_FUSE, KILN_CPU_ISA, ...). Steps are decode-only and replayed from the captured program,
// as in serving; the logits come back to the host and the greedy choice is made there (the
// same for A and B).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "config/config.h"
#include "models/llm/loader.h"
#include "models/llm/paged_llm.h"
#include "models/llm/testing/greedy_driver.h"

namespace {

using kiln::Status;
using kiln::StatusOr;
using kiln::models::PagedLlm;

struct Args {
  std::string model, activations = "f32";
  std::vector<std::string> a_env, b_env;
  int rounds = 20, tokens = 128, threads = 2;
};

// Loads the model with `env` ("NAME=VALUE" each) set, restoring the previous values after.
StatusOr<std::unique_ptr<PagedLlm>> LoadWith(const Args& a, const std::vector<std::string>& env) {
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  for (const std::string& kv : env) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      return kiln::InvalidArgument("an environment switch is NAME=VALUE, not '", kv, "'");
    }
    const std::string name = kv.substr(0, eq);
    const char* old = std::getenv(name.c_str());
    saved.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    setenv(name.c_str(), kv.substr(eq + 1).c_str(), 1);
  }
  kiln::config::ModelConfig c;
  c.name = "decode_ab";
  c.kind = "llm";
  c.path = a.model;
  c.threads = a.threads;
  c.activations = a.activations;
  c.scheduler.max_num_seqs = 1;
  c.scheduler.capture_batch_sizes = {1};
  c.max_loaded_adapters = 0;
  StatusOr<std::unique_ptr<PagedLlm>> m = kiln::models::LoadPagedLlm(c, {});
  for (const auto& [name, old] : saved) {
    if (old) {
      setenv(name.c_str(), old->c_str(), 1);
    } else {
      unsetenv(name.c_str());
    }
  }
  return m;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

Status Run(const Args& a) {
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<PagedLlm> ma, LoadWith(a, a.a_env));
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<PagedLlm> mb, LoadWith(a, a.b_env));
  KILN_ASSIGN_OR_RETURN(const std::vector<int32_t> prompt,
                        ma->tokenizer().Encode("Once upon a time"));
  kiln::models::testing::GreedyOptions opt;
  opt.max_new_tokens = a.tokens;
  // Tokens per second of the decode steps (the prompt's step excluded).
  auto round = [&](PagedLlm& m, std::vector<int32_t>* out) -> StatusOr<double> {
    using Clock = std::chrono::steady_clock;
    Clock::time_point first{};
    kiln::models::testing::GreedyOptions o = opt;
    o.on_logits = [&](size_t, int32_t step, std::span<const float>) {
      if (step == 0) first = Clock::now();
    };
    KILN_ASSIGN_OR_RETURN(auto r, kiln::models::testing::RunGreedy(m, {prompt}, o));
    const double s = std::chrono::duration<double>(Clock::now() - first).count();
    *out = r.generated[0];
    return static_cast<double>(a.tokens - 1) / s;
  };
  std::vector<double> ta, tb, ratio;
  bool same = true;
  std::cout << "round  A tok/s  B tok/s  B/A\n";
  for (int r = 0; r < a.rounds; ++r) {
    std::vector<int32_t> ga, gb;
    // Alternate which goes first, so neither always follows the other.
    double va = 0, vb = 0;
    if (r % 2 == 0) {
      KILN_ASSIGN_OR_RETURN(va, round(*ma, &ga));
      KILN_ASSIGN_OR_RETURN(vb, round(*mb, &gb));
    } else {
      KILN_ASSIGN_OR_RETURN(vb, round(*mb, &gb));
      KILN_ASSIGN_OR_RETURN(va, round(*ma, &ga));
    }
    same = same && ga == gb;
    ta.push_back(va);
    tb.push_back(vb);
    ratio.push_back(vb / va);
    std::printf("%5d  %7.1f  %7.1f  %.3f\n", r + 1, va, vb, vb / va);
  }
  std::vector<double> sorted = ratio;
  std::sort(sorted.begin(), sorted.end());
  std::printf(
      "median: A %.1f tok/s, B %.1f tok/s; B/A paired median %.3f (p25 %.3f, p75 %.3f, n %d); "
      "greedy tokens %s\n",
      Median(ta), Median(tb), Median(ratio), sorted[sorted.size() / 4],
      sorted[sorted.size() * 3 / 4], a.rounds, same ? "identical" : "DIFFER");
  return kiln::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("one-stream decode, A against B (environment switches), interleaved");
  Args a;
  app.add_option("--model", a.model, "GGUF file or Hugging Face folder")->required();
  app.add_option("--a-env", a.a_env, "NAME=VALUE set while A loads (repeatable)");
  app.add_option("--b-env", a.b_env, "NAME=VALUE set while B loads (repeatable)");
  app.add_option("--rounds", a.rounds, "alternating rounds")->check(CLI::Range(1, 10000));
  app.add_option("--tokens", a.tokens, "new tokens per round")->check(CLI::Range(2, 4096));
  app.add_option("--threads", a.threads, "CPU threads")->check(CLI::Range(0, 1024));
  app.add_option("--activations", a.activations, "f32, q8 or bf16")
      ->check(CLI::IsMember(std::vector<std::string>(std::begin(kiln::config::kActivationNames),
                                                     std::end(kiln::config::kActivationNames))));
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);
  const Status s = Run(a);
  if (!s.ok()) {
    std::cerr << "decode_ab_bench: " << kiln::StatusMessage(s) << "\n";
    return 1;
  }
  return 0;
}
