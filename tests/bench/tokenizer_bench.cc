// Tokenizer, detokenizer and chat-template throughput on SmolLM2's real vocabulary.
//
//   build/tests/bench/tokenizer_bench [--benchmark_filter=Encode]
// Needs the default model (scripts/fetch-default-model.sh) or KILN_MODELS_DIR.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <random>
#include <string>

#include "models/chat/chat_template.h"
#include "models/gguf/gguf.h"
#include "models/tokenizer/detokenizer.h"
#include "models/tokenizer/tokenizer.h"

namespace {

using kiln::models::ChatTemplate;
using kiln::models::Detokenizer;
using kiln::models::GgufFile;
using kiln::models::Tokenizer;

struct Model {
  std::unique_ptr<GgufFile> gguf;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<ChatTemplate> tmpl;
  std::string error;
};

const Model& Load() {
  static Model* m = [] {
    auto* m = new Model();
    const char* dir = std::getenv("KILN_MODELS_DIR");
    std::string path = std::string(dir ? dir : ".kiln/models") + "/SmolLM2-135M-Instruct.Q4_1.gguf";
    auto g = GgufFile::Open(path);
    if (!g.ok()) {
      m->error =
          std::string(kiln::StatusMessage(g.status())) + " (run scripts/fetch-default-model.sh)";
      return m;
    }
    m->gguf = std::move(*g);
    auto t = Tokenizer::FromGguf(*m->gguf);
    auto c = ChatTemplate::FromGguf(*m->gguf);
    if (!t.ok() || !c.ok()) {
      m->error = "cannot build tokenizer or template";
      return m;
    }
    m->tok = std::move(*t);
    m->tmpl = std::move(*c);
    return m;
  }();
  return *m;
}

// About 1,000 tokens of mixed prose, code and numbers.
std::string Prompt() {
  std::string base =
      "The quick brown fox jumps over the lazy dog. In 2024, researchers measured 1,234,567 "
      "samples across 89 sites; the median was 3.14159. def f(x):\n    return x ** 2 + 1\n"
      "Transformers process tokens in parallel, using attention to mix information.\n";
  std::string s;
  while (s.size() < 4400) s += base;
  return s;
}

// Random words: every call sees new words, so the per-word cache does not help.
std::string RandomText(std::mt19937& rng, size_t words) {
  static const char kLetters[] = "abcdefghijklmnopqrstuvwxyz";
  std::string s;
  std::uniform_int_distribution<int> len(2, 10), letter(0, 25);
  for (size_t w = 0; w < words; ++w) {
    s += ' ';
    for (int k = len(rng); k > 0; --k) s += kLetters[letter(rng)];
  }
  return s;
}

void BM_EncodePrompt1k(benchmark::State& state) {
  const Model& m = Load();
  if (!m.tok) return state.SkipWithError(m.error.c_str());
  std::string p = Prompt();
  size_t tokens = 0;
  for (auto _ : state) {
    auto ids = m.tok->Encode(p);
    tokens = ids->size();
    benchmark::DoNotOptimize(ids);
  }
  state.counters["tokens"] = static_cast<double>(tokens);
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(tokens));
}
BENCHMARK(BM_EncodePrompt1k)->Unit(benchmark::kMicrosecond);

void BM_EncodeUncachedWords(benchmark::State& state) {
  const Model& m = Load();
  if (!m.tok) return state.SkipWithError(m.error.c_str());
  std::mt19937 rng(1);
  size_t tokens = 0;
  for (auto _ : state) {
    state.PauseTiming();
    std::string text = RandomText(rng, 300);
    state.ResumeTiming();
    auto ids = m.tok->Encode(text);
    tokens += ids->size();
    benchmark::DoNotOptimize(ids);
  }
  state.SetItemsProcessed(static_cast<int64_t>(tokens));
}
BENCHMARK(BM_EncodeUncachedWords)->Unit(benchmark::kMicrosecond);

void BM_Decode1k(benchmark::State& state) {
  const Model& m = Load();
  if (!m.tok) return state.SkipWithError(m.error.c_str());
  auto ids = *m.tok->Encode(Prompt());
  for (auto _ : state) benchmark::DoNotOptimize(m.tok->Decode(ids));
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(ids.size()));
}
BENCHMARK(BM_Decode1k)->Unit(benchmark::kMicrosecond);

void BM_DetokenizeStream1k(benchmark::State& state) {
  const Model& m = Load();
  if (!m.tok) return state.SkipWithError(m.error.c_str());
  auto ids = *m.tok->Encode(Prompt());
  for (auto _ : state) {
    Detokenizer d(*m.tok);
    size_t n = 0;
    for (int32_t id : ids) n += d.Add(id).size();
    n += d.Finish().size();
    benchmark::DoNotOptimize(n);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(ids.size()));
}
BENCHMARK(BM_DetokenizeStream1k)->Unit(benchmark::kMicrosecond);

void BM_ChatTemplate(benchmark::State& state) {
  const Model& m = Load();
  if (!m.tmpl) return state.SkipWithError(m.error.c_str());
  ChatTemplate::Inputs in;
  for (int i = 0; i < 8; ++i) {
    in.messages.push_back({{"role", i % 2 ? "assistant" : "user"},
                           {"content", "Message number " + std::to_string(i)}});
  }
  for (auto _ : state) benchmark::DoNotOptimize(m.tmpl->Apply(in));
}
BENCHMARK(BM_ChatTemplate)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
