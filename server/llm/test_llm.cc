#include "server/llm/test_llm.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <fstream>
#include <sstream>
#include <thread>

#include "models/chat/chat_template.h"

namespace kiln::llm::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

constexpr int32_t kEos = 1;

int32_t NextToken(std::span<const int32_t> context) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : context) h = (h ^ static_cast<uint32_t>(t)) * 1099511628211ull;
  return 300 + static_cast<int32_t>(h % 2600);
}

}  // namespace

std::unique_ptr<models::Tokenizer> LoadFixtureTokenizer() {
  auto tok = models::Tokenizer::FromHfJson(
      ReadFile(std::string(KILN_SOURCE_DIR) +
               "/tests/fixtures/tokenizer/bpe_bytelevel.tokenizer.json"),
      nullptr, "bpe_bytelevel");
  KILN_CHECK(tok.ok(), "fixture tokenizer failed to load");
  return std::move(*tok);
}

FakeLlm::FakeLlm(FakeLlmOptions options) : options_(std::move(options)) {
  tokenizer_ = LoadFixtureTokenizer();
  info_.architecture = "fake";
  info_.name = "fake";
  info_.vocab_size = tokenizer_->vocab_size();
  info_.context_length = options_.context_length;
  info_.eos_token_ids = {kEos};
  if (options_.chat_template) {
    auto t = models::ChatTemplate::Parse(
        ReadFile(std::string(KILN_SOURCE_DIR) + "/tests/fixtures/chat/templates/smollm2.jinja"));
    KILN_CHECK(t.ok(), "fixture chat template failed to parse");
    template_ = std::move(*t);
  }
}

FakeLlm::~FakeLlm() = default;

Status FakeLlm::AllocateKvCache(int32_t num_blocks, int32_t block_size) {
  block_size_ = block_size;
  kv_.assign(static_cast<size_t>(num_blocks) * block_size, {-1, -1});
  return OkStatus();
}

Status FakeLlm::Step(const models::StepBatch& b, std::span<float> logits, models::StepStats*) {
  if (const int us = options_.step_delay_us->load(); us > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
  for (size_t i = 0; i < b.tokens.size(); ++i)
    kv_[b.slot_mapping[i]] = {b.tokens[i], b.positions[i]};
  std::fill(logits.begin(), logits.end(), 0.0f);
  const int eos_at = options_.eos_at->load();
  for (size_t s = 0; s < b.seq_lens.size(); ++s) {
    std::vector<int32_t> context;
    for (int32_t p = 0; p < b.seq_lens[s]; ++p) {
      const int32_t block = b.block_table[s * b.max_blocks_per_seq + p / block_size_];
      const auto [token, pos] = kv_[static_cast<size_t>(block) * block_size_ + p % block_size_];
      if (pos != p) return Internal("position ", p, " reads the KV of position ", pos);
      context.push_back(token);
    }
    int32_t next = NextToken(context);
    if (eos_at > 0 && static_cast<int>(context.size()) >= eos_at) next = kEos;
    // A peaked but not one-hot distribution, so logprobs have alternatives.
    float* row = logits.data() + s * info_.vocab_size;
    row[next] = 10.0f;
    row[(next + 1) % info_.vocab_size] = 5.0f;
  }
  return OkStatus();
}

std::vector<int32_t> FakeLlm::Continue(std::vector<int32_t> context, int n, int eos_at) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    int32_t next = NextToken(context);
    if (eos_at > 0 && static_cast<int>(context.size()) >= eos_at) next = kEos;
    out.push_back(next);
    context.push_back(next);
    if (next == kEos) break;
  }
  return out;
}

config::ModelConfig FakeModelConfig(const std::string& name) {
  config::ModelConfig m;
  m.name = name;
  m.kind = "llm";
  m.path = "fake";
  m.scheduler.kv_cache_bytes = 8 * 16 * 512;  // 512 blocks of 16 tokens (8 bytes per token)
  return m;
}

TestServer::TestServer(std::vector<config::ModelConfig> models, FakeLlmOptions fake,
                       int64_t max_inflight, LlmLoader loader)
    : fake_(std::move(fake)) {
  config_.server.grpc.address = "127.0.0.1:0";
  config_.server.http.address = "127.0.0.1:0";
  config_.server.metrics.enabled = false;
  config_.server.max_inflight_requests = static_cast<int>(max_inflight);
  config_.server.shutdown_grace_seconds = 5;
  config_.models = models;
  families_ = std::make_unique<InferenceMetricFamilies>(registry_);
  llm_families_ = std::make_unique<LlmMetricFamilies>(registry_);
  ModelDeps deps;
  deps.tensor_metrics = families_.get();
  deps.llm_metrics = llm_families_.get();
  deps.llm_loader = std::move(loader);
  if (!deps.llm_loader) {
    deps.llm_loader =
        [opts = fake_](const config::ModelConfig&) -> StatusOr<std::unique_ptr<models::LlmModel>> {
      return std::make_unique<FakeLlm>(opts);
    };
  }
  repository_ = std::make_unique<ModelRepository>(std::move(models), std::move(deps));
  limiter_ = std::make_unique<InflightLimiter>(max_inflight);
  core_.config = &config_;
  core_.repository = repository_.get();
  core_.limiter = limiter_.get();
  core_.registry = &registry_;
  KILN_CHECK(repository_->LoadStartupModels().ok(), "test models failed to load");
  grpc_ = std::make_unique<GrpcFrontEnd>(&core_);
  KILN_CHECK(grpc_->Start().ok(), "gRPC front end failed to start");
  http_ = std::make_unique<HttpFrontEnds>(&core_);
  KILN_CHECK(http_->Start().ok(), "HTTP front end failed to start");
  core_.started = true;
}

TestServer::~TestServer() {
  core_.shutting_down = true;
  const auto deadline = SteadyClock::now() + std::chrono::seconds(5);
  repository_->DrainAll(deadline);
  http_->Shutdown(deadline);
  grpc_->Shutdown(deadline);
}

ContinuousBatcher& TestServer::batcher(const std::string& name) {
  auto model = repository_->GetReady(name);
  KILN_CHECK(model.ok() && (*model)->is_llm(), "no such LLM");
  return *(*model)->llm();
}

double TestServer::Metric(const std::string& sample) {
  std::istringstream in(registry_.Serialize());
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(sample + " ", 0) == 0) return std::stod(line.substr(sample.size() + 1));
  }
  return -1;
}

HttpReply HttpCall(int port, const std::string& method, const std::string& path,
                   const std::string& body) {
  namespace asio = boost::asio;
  namespace bhttp = boost::beast::http;
  asio::io_context ioc;
  asio::ip::tcp::socket sock(ioc);
  sock.connect({asio::ip::address_v4::loopback(), static_cast<uint16_t>(port)});
  bhttp::request<bhttp::string_body> req{bhttp::string_to_verb(method), path, 11};
  req.set(bhttp::field::host, "127.0.0.1");
  req.set(bhttp::field::content_type, "application/json");
  req.body() = body;
  req.prepare_payload();
  bhttp::write(sock, req);
  boost::beast::flat_buffer buf;
  bhttp::response_parser<bhttp::string_body> parser;
  parser.body_limit(1 << 30);
  bhttp::read(sock, buf, parser);
  HttpReply out;
  out.status = static_cast<int>(parser.get().result_int());
  out.content_type = std::string(parser.get()[bhttp::field::content_type]);
  out.body = parser.get().body();
  return out;
}

std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) break;
    std::string_view event(body.data() + pos, end - pos);
    if (event.rfind("data: ", 0) == 0) out.emplace_back(event.substr(6));
    pos = end + 2;
  }
  return out;
}

}  // namespace kiln::llm::testing
