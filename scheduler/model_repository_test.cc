// ModelRepository: loads and unloads of one model are serialized, and a load returns once the
// model is READY or failed, also while another load of it (start-up's) is under way.
#include "scheduler/model_repository.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "scheduler/llm/continuous_batcher.h"
#include "scheduler/llm/testing/fake_llm.h"
#include "spdlog/sinks/base_sink.h"
#include "spdlog/spdlog.h"

namespace kiln {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Notifies once a log message containing `text` is written: how a test knows that a load is
// waiting inside the repository (the repository logs it), without sleeping.
class LogWatch final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit LogWatch(std::string text) : text_(std::move(text)) {}
  // Whether the message was written within 30 s (a generous bound for a loaded machine).
  bool Wait() { return seen_.WaitForNotificationWithTimeout(absl::Seconds(30)); }
  const std::string& text() const { return text_; }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    const std::string_view payload(msg.payload.data(), msg.payload.size());
    if (payload.find(text_) != std::string_view::npos && !seen_.HasBeenNotified()) {
      seen_.Notify();
    }
  }
  void flush_() override {}

 private:
  const std::string text_;
  absl::Notification seen_;
};

// An LLM loader that blocks until the test opens it; the first call says it has started.
struct GatedLoader {
  absl::Notification started;
  absl::Notification open;
  std::atomic<int> calls{0};
  std::string failure;  // non-empty: loads fail with this message
};

config::ModelConfig LlmConfig(const std::string& name) {
  config::ModelConfig c;
  c.name = name;
  c.kind = "llm";
  c.path = "fake";
  c.scheduler.kv_cache_bytes = 8 * 16 * 256;  // the fake's KV blocks are 8 bytes a token
  return c;
}

class ModelRepositoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelDeps deps;
    deps.llm_loader =
        [gate = gate_](const config::ModelConfig&) -> StatusOr<std::unique_ptr<models::LlmModel>> {
      ++gate->calls;
      if (!gate->started.HasBeenNotified()) gate->started.Notify();
      gate->open.WaitForNotification();
      if (!gate->failure.empty()) return InvalidArgument(gate->failure);
      return std::make_unique<llm_testing::FakeLlm>();
    };
    repository_ = std::make_unique<ModelRepository>(
        std::vector<config::ModelConfig>{LlmConfig("m")}, std::move(deps));
    repository_->SetStateListener([this](const std::string& name, ModelState state) {
      absl::MutexLock lock(&notified_mu_);
      notified_[name] = state;
    });
  }
  void TearDown() override {
    if (!gate_->open.HasBeenNotified()) gate_->open.Notify();
    for (auto& t : threads_) t.join();
    if (watch_) std::erase(spdlog::default_logger()->sinks(), watch_);
    repository_.reset();
  }

  // Starts the start-up load on a thread and returns once the model is loading.
  void StartStartupLoad() {
    threads_.emplace_back([this] { startup_ = repository_->LoadStartupModels(); });
    gate_->started.WaitForNotification();
  }
  // Watches the log for `text` (REQUIRES: called before the thread that logs it starts).
  LogWatch& Watch(std::string text) {
    watch_ = std::make_shared<LogWatch>(std::move(text));
    spdlog::default_logger()->sinks().push_back(watch_);
    return *watch_;
  }
  ModelIndexEntry Entry(const std::string& name) {
    for (const ModelIndexEntry& e : repository_->Index()) {
      if (e.name == name) return e;
    }
    ADD_FAILURE() << "no index entry for " << name;
    return {};
  }

  std::shared_ptr<GatedLoader> gate_ = std::make_shared<GatedLoader>();
  std::unique_ptr<ModelRepository> repository_;
  std::vector<std::thread> threads_;
  // The state the listener was told last (what gRPC health would say).
  std::optional<ModelState> Notified(const std::string& name) {
    absl::MutexLock lock(&notified_mu_);
    auto it = notified_.find(name);
    return it == notified_.end() ? std::nullopt : std::optional<ModelState>(it->second);
  }

  std::shared_ptr<LogWatch> watch_;
  Status startup_;
  absl::Mutex notified_mu_;
  std::map<std::string, ModelState> notified_ ABSL_GUARDED_BY(notified_mu_);
};

TEST_F(ModelRepositoryTest, LoadDuringStartupLoadReturnsOnceTheModelIsReady) {
  StartStartupLoad();
  EXPECT_EQ(Entry("m").state, ModelState::kLoading);
  LogWatch& joined = Watch("model 'm': a load request joins the load under way");
  Status load;
  bool ready_on_return = false;
  std::optional<ModelState> notified_on_return;
  threads_.emplace_back([&] {
    load = repository_->Load("m");
    ready_on_return = repository_->GetReady("m").ok();
    notified_on_return = Notified("m");
  });
  ASSERT_TRUE(joined.Wait()) << "never logged: " << joined.text();
  EXPECT_EQ(Entry("m").state, ModelState::kLoading);
  gate_->open.Notify();
  for (auto& t : threads_) t.join();
  threads_.clear();
  EXPECT_TRUE(load.ok()) << load;
  EXPECT_TRUE(ready_on_return) << "the load returned before the model was READY";
  EXPECT_EQ(notified_on_return, ModelState::kReady) << "the load returned before health knew";
  EXPECT_TRUE(startup_.ok()) << startup_;
  EXPECT_EQ(gate_->calls, 1) << "the joined load must not load the model a second time";
}

TEST_F(ModelRepositoryTest, LoadDuringAFailingLoadReturnsItsFailure) {
  gate_->failure = "fake: the weights are truncated";
  StartStartupLoad();
  LogWatch& joined = Watch("model 'm': a load request joins the load under way");
  Status load;
  threads_.emplace_back([&] { load = repository_->Load("m"); });
  ASSERT_TRUE(joined.Wait()) << "never logged: " << joined.text();
  gate_->open.Notify();
  for (auto& t : threads_) t.join();
  threads_.clear();
  EXPECT_EQ(load.code(), StatusCode::kInvalidArgument) << load;
  EXPECT_THAT(std::string(StatusMessage(load)), HasSubstr("the weights are truncated"));
  EXPECT_FALSE(startup_.ok());
  const ModelIndexEntry e = Entry("m");
  EXPECT_EQ(e.state, ModelState::kUnavailable);
  EXPECT_THAT(e.reason, HasSubstr("the weights are truncated"));
}

TEST_F(ModelRepositoryTest, LoadWithAConfigWaitsForTheLoadUnderWayThenLoadsIt) {
  StartStartupLoad();
  LogWatch& waiting = Watch("model 'm': a load request waits for the load under way");
  config::ModelConfig changed = LlmConfig("m");
  changed.max_loaded_adapters = 2;
  Status load;
  threads_.emplace_back([&] { load = repository_->Load("m", changed); });
  ASSERT_TRUE(waiting.Wait()) << "never logged: " << waiting.text();
  gate_->open.Notify();
  for (auto& t : threads_) t.join();
  threads_.clear();
  ASSERT_TRUE(load.ok()) << load;
  EXPECT_EQ(gate_->calls, 2);
  auto model = repository_->GetReady("m");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->config().max_loaded_adapters, 2) << "the second load's config is served";
}

TEST_F(ModelRepositoryTest, UnloadWaitsForTheLoadUnderWay) {
  StartStartupLoad();
  LogWatch& waiting = Watch("model 'm': an unload request waits for the load under way");
  Status unload;
  threads_.emplace_back(
      [&] { unload = repository_->Unload("m", SteadyClock::now() + std::chrono::seconds(5)); });
  ASSERT_TRUE(waiting.Wait()) << "never logged: " << waiting.text();
  gate_->open.Notify();
  for (auto& t : threads_) t.join();
  threads_.clear();
  EXPECT_TRUE(unload.ok()) << unload;
  EXPECT_TRUE(startup_.ok()) << startup_;
  const ModelIndexEntry e = Entry("m");
  EXPECT_EQ(e.state, ModelState::kUnavailable);
  EXPECT_EQ(e.reason, "unloaded");
}

TEST_F(ModelRepositoryTest, AFailedReloadKeepsTheModelAndItsConfiguration) {
  gate_->open.Notify();
  ASSERT_TRUE(repository_->LoadStartupModels().ok());
  gate_->failure = "fake: cannot load";
  config::ModelConfig changed = LlmConfig("m");
  changed.max_loaded_adapters = 2;
  Status reload = repository_->Load("m", changed);
  EXPECT_THAT(std::string(StatusMessage(reload)), HasSubstr("cannot load"));
  EXPECT_TRUE(repository_->GetReady("m").ok()) << "the old model stops serving";
  std::optional<config::ModelConfig> current = repository_->CurrentConfig("m");
  ASSERT_TRUE(current.has_value());
  EXPECT_EQ(*current, LlmConfig("m")) << "the entry no longer describes the model served";
}

TEST_F(ModelRepositoryTest, ModelIsServedBeforeStartupFinishes) {
  // A model loaded first is READY (and served) while start-up still loads the next one.
  ModelDeps deps;
  deps.llm_loader =
      [gate = gate_](const config::ModelConfig&) -> StatusOr<std::unique_ptr<models::LlmModel>> {
    gate->started.Notify();
    gate->open.WaitForNotification();
    return std::make_unique<llm_testing::FakeLlm>();
  };
  config::ModelConfig simple;
  simple.name = "a_simple";  // loads first: start-up goes by name
  simple.kind = "builtin";
  simple.builtin = "simple";
  repository_ = std::make_unique<ModelRepository>(
      std::vector<config::ModelConfig>{simple, LlmConfig("m")}, std::move(deps));
  StartStartupLoad();
  EXPECT_TRUE(repository_->GetReady("a_simple").ok());
  EXPECT_EQ(Entry("m").state, ModelState::kLoading);
  // A load of the READY model reloads it and returns at once; it is still READY.
  EXPECT_TRUE(repository_->Load("a_simple").ok());
  EXPECT_TRUE(repository_->GetReady("a_simple").ok());
}

// scheduler.speculative.draft_model: the loader builds the draft like the model, without
// adapter slots, speculation or device sampling of its own; its failure names the setting.
TEST(ModelLoadTest, LoadsTheDraftModelOfSpeculativeDecoding) {
  std::vector<config::ModelConfig> seen;
  ModelDeps deps;
  deps.llm_loader =
      [&seen](const config::ModelConfig& c) -> StatusOr<std::unique_ptr<models::LlmModel>> {
    seen.push_back(c);
    if (c.path == "missing.gguf") return NotFound("no such file: missing.gguf");
    return std::make_unique<llm_testing::FakeLlm>();
  };
  config::ModelConfig c = LlmConfig("m");
  c.scheduler.speculative.method = "draft";
  c.scheduler.speculative.draft_model = "small.gguf";
  StatusOr<std::shared_ptr<Model>> m = Model::Load(c, deps);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1].name, "m.draft");
  EXPECT_EQ(seen[1].path, "small.gguf");
  EXPECT_EQ(seen[1].max_loaded_adapters, 0);
  EXPECT_EQ(seen[1].sampling, "host");
  EXPECT_EQ(seen[1].scheduler.speculative.method, "none");
  GenerateRequest r;
  r.prompt = {300, 301, 302};
  r.max_tokens = 4;
  r.sampling.speculative = models::SpeculativeParams{.method = "draft"};
  EXPECT_TRUE((*m)->llm()->Check(r).ok()) << "the batcher has no draft model";

  // A model entry by name: its settings (path, backend) are the draft's.
  deps.find_model = [](const std::string& name) -> std::optional<config::ModelConfig> {
    if (name != "small" && name != "minilm") return std::nullopt;
    config::ModelConfig e = LlmConfig(name);
    e.path = "weights/small.gguf";
    e.backend = "ref";
    if (name == "minilm") e.kind = "embedding";
    return e;
  };
  c.scheduler.speculative.draft_model = "small";
  seen.clear();
  ASSERT_TRUE(Model::Load(c, deps).ok());
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1].path, "weights/small.gguf");
  EXPECT_EQ(seen[1].backend, "ref");
  EXPECT_EQ(seen[1].name, "m.draft");
  c.scheduler.speculative.draft_model = "minilm";
  m = Model::Load(c, deps);
  EXPECT_THAT(std::string(StatusMessage(m.status())), HasSubstr("names a model of kind embedding"));

  c.scheduler.speculative.draft_model = "missing.gguf";
  m = Model::Load(c, deps);
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(
      std::string(StatusMessage(m.status())),
      AllOf(HasSubstr("model 'm': its draft model (missing.gguf"), HasSubstr("no such file")));
}

}  // namespace
}  // namespace kiln
