// Sentence-embedding throughput of Kiln's encoder (models/encoder): texts per second at a
// given batch size, tokenization included (as sentence-transformers' encode includes it).
//
//   build/tests/bench/embedding_bench --batch 32 --seconds 3
//   build/tests/bench/embedding_bench --serve      # one "<batch> <seconds>" per stdin line,
//                                                   # answers "<texts/s>" (embedding_peer.py
//                                                   # interleaves it with sentence-transformers)
// The texts are tests/fixtures/embeddings/sentences.jsonl (200 sentences, mostly 10-30
// tokens); the model is the default embedding model (scripts/fetch-default-model.sh).
#include <spdlog/spdlog.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "models/encoder/encoder_model.h"

namespace {

using kiln::models::EncodedText;
using kiln::models::EncoderModel;

// Texts per second embedding all `texts` in one call (the encoder sorts them by length and
// runs steps of its max_batch, as sentence-transformers' encode does with batch_size),
// repeated for at least `seconds`.
double Measure(EncoderModel& model, const std::vector<std::string>& texts, double seconds) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  size_t done = 0;
  std::vector<std::vector<int32_t>> ids;
  do {
    ids.clear();
    for (const std::string& text : texts) {
      kiln::StatusOr<EncodedText> t = model.Tokenize(text);
      if (!t.ok()) {
        std::cerr << t.status() << "\n";
        std::exit(1);
      }
      ids.push_back(std::move(t->ids));
    }
    kiln::StatusOr<std::vector<float>> v = model.Embed(ids);
    if (!v.ok()) {
      std::cerr << v.status() << "\n";
      std::exit(1);
    }
    done += ids.size();
  } while (std::chrono::duration<double>(Clock::now() - start).count() < seconds);
  return static_cast<double>(done) / std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Kiln sentence-embedding throughput"};
  std::string model_dir = ".kiln/models/all-MiniLM-L6-v2";
  std::string texts_file = "tests/fixtures/embeddings/sentences.jsonl";
  int threads = 2;
  size_t batch = 32;
  double seconds = 3;
  bool serve = false;
  app.add_option("--model", model_dir, "a sentence-transformers BERT folder");
  app.add_option("--texts", texts_file, "JSON lines with a \"text\" each");
  app.add_option("--threads", threads, "CPU threads");
  app.add_option("--batch", batch, "texts per step")->check(CLI::Range(1, 1024));
  app.add_option("--seconds", seconds, "time per measurement");
  app.add_flag("--serve", serve, "read \"<batch> <seconds>\" lines from stdin");
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);  // stdout carries the figures

  std::vector<std::string> texts;
  std::ifstream in(texts_file);
  for (std::string line; std::getline(in, line);) {
    texts.push_back(nlohmann::json::parse(line)["text"].get<std::string>());
  }
  if (texts.empty()) {
    std::cerr << "no texts in " << texts_file << "\n";
    return 1;
  }
  kiln::config::ModelConfig config;
  config.name = "bench";
  config.kind = "embedding";
  config.path = model_dir;
  config.threads = threads;
  // One model per batch size (max_batch is fixed at load), loaded on first use.
  std::map<size_t, std::unique_ptr<EncoderModel>> models;
  auto model_for = [&](size_t b) -> EncoderModel& {
    std::unique_ptr<EncoderModel>& m = models[b];
    if (m == nullptr) {
      config.max_batch_size = static_cast<int>(b);
      auto loaded = EncoderModel::Load(config);
      if (!loaded.ok()) {
        std::cerr << loaded.status() << " (run scripts/fetch-default-model.sh)\n";
        std::exit(1);
      }
      m = *std::move(loaded);
      Measure(*m, texts, 0);  // warm-up: kernels, autotuning, caches
    }
    return *m;
  };
  if (!serve) {
    std::cout << "kiln batch " << batch << ": " << Measure(model_for(batch), texts, seconds)
              << " texts/s\n";
    return 0;
  }
  std::cout << "ready" << std::endl;
  for (std::string line; std::getline(std::cin, line);) {
    size_t b = 0;
    double s = 0;
    if (std::sscanf(line.c_str(), "%zu %lf", &b, &s) != 2 || b == 0) break;
    std::cout << Measure(model_for(b), texts, s) << std::endl;
  }
  return 0;
}
