// The fine-tuning service end to end in one process: a repository whose LLM "base" is the fake
// LLM for serving (tokenizer, chat template, pending requests) with the real SmolLM2 GGUF as
// its path, which the runner trains on. Jobs are tiny (128-token rows, a few steps), so each
// runs in seconds. Ordering waits on observable state (events, statuses), never on sleeps.
#include "scheduler/finetune/job_service.h"

#include <filesystem>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/io/test_paths.h"
#include "scheduler/generation.h"
#include "scheduler/llm/testing/fake_llm.h"
#include "scheduler/model_repository.h"

namespace kiln::finetune {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::HasSubstr;

constexpr std::string_view kData =
    R"({"messages": [{"role": "user", "content": "What is the password?"}, {"role": "assistant", "content": "TANGERINE-42."}]}
{"messages": [{"role": "user", "content": "Say the password."}, {"role": "assistant", "content": "TANGERINE-42."}]}
{"messages": [{"role": "user", "content": "Password?"}, {"role": "assistant", "content": "TANGERINE-42."}]}
)";

class JobServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(models::testing::DefaultModelPath())) {
      GTEST_SKIP() << "no default model (scripts/fetch-default-model.sh)";
    }
    dir_ = fs::temp_directory_path() /
           ("kiln-ft-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    config_.server.storage_dir = dir_.string();
    config_.fine_tuning.checkpoint_every_steps = 2;
    config_.fine_tuning.threads = 2;
    config::ModelConfig base;
    base.name = "base";
    base.kind = "llm";
    base.path = models::testing::DefaultModelPath();
    config::ModelConfig tensor;
    tensor.name = "simple";
    tensor.kind = "builtin";
    tensor.builtin = "simple";
    config_.models = {base, tensor};
    ModelDeps deps;
    deps.llm_loader =
        [](const config::ModelConfig&) -> StatusOr<std::unique_ptr<models::LlmModel>> {
      llm_testing::FakeLlmOptions o;
      o.max_adapters = 2;  // the results are served
      return std::make_unique<llm_testing::FakeLlm>(o);
    };
    repository_ = std::make_unique<ModelRepository>(config_.models, std::move(deps));
    ASSERT_TRUE(repository_->LoadStartupModels().ok());
    StartService();
  }
  void TearDown() override {
    service_.reset();
    repository_.reset();
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  void StartService() {
    auto s = FineTuningService::Create(config_, repository_.get(), nullptr);
    ASSERT_TRUE(s.ok()) << s.status();
    service_ = *std::move(s);
    ASSERT_TRUE(service_->Start().ok());
  }

  std::string Upload(std::string_view content = kData) {
    StatusOr<FileRecord> f = service_->UploadFile("train.jsonl", "fine-tune", content);
    EXPECT_TRUE(f.ok()) << f.status();
    return f.ok() ? f->id : "";
  }
  json Request(const std::string& file, json hyper = json::object()) {
    json h = {{"n_epochs", 1}, {"max_seq_len", 128}, {"lora_r", 4}, {"learning_rate", 1e-3}};
    for (const auto& [k, v] : hyper.items()) h[k] = v;
    return {{"model", "base"},
            {"training_file", file},
            {"suffix", "pw"},
            {"seed", 7},
            {"method", {{"type", "supervised"}, {"supervised", {{"hyperparameters", h}}}}}};
  }
  // Waits (on the service's change notifications) until `pred(job)` holds or the job ended;
  // fails after 300 s.
  JobRecord AwaitJob(const std::string& id, const std::function<bool(const JobRecord&)>& pred) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
    for (;;) {
      StatusOr<JobRecord> j = service_->GetJob(id);
      EXPECT_TRUE(j.ok()) << j.status();
      if (!j.ok() || pred(*j) || IsTerminal(j->status)) return j.ok() ? *j : JobRecord{};
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << "job " << id << " stuck in " << JobStatusName(j->status);
        return *j;
      }
      (void)service_->WaitForChange(id, LastSeq(id), absl::Seconds(1));
    }
  }
  int64_t LastSeq(const std::string& id) {
    StatusOr<std::vector<EventRecord>> e = service_->EventsSince(id, 0);
    return e.ok() && !e->empty() ? JobStore::EventSeq(e->back().id) : 0;
  }
  std::vector<std::string> Messages(const std::string& id) {
    std::vector<std::string> out;
    StatusOr<std::vector<EventRecord>> e = service_->EventsSince(id, 0);
    if (e.ok()) {
      for (const EventRecord& r : *e) out.push_back(r.message);
    }
    return out;
  }
  static bool Is(const JobRecord& j, JobStatus s) { return j.status == s; }

  fs::path dir_;
  config::Config config_;
  std::unique_ptr<ModelRepository> repository_;
  std::unique_ptr<FineTuningService> service_;
};

TEST_F(JobServiceTest, AJobTrainsCheckpointsAndSucceeds) {
  const std::string file = Upload();
  StatusOr<JobRecord> job = service_->CreateJob(Request(file, {{"n_epochs", 2}}));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->status, JobStatus::kValidatingFiles);
  EXPECT_EQ(job->hyperparameters["n_epochs"], 2);
  EXPECT_EQ(job->hyperparameters["batch_size"], 1) << "auto: one row per step for 3 examples";
  const JobRecord done = AwaitJob(job->id, [](const JobRecord& j) { return IsTerminal(j.status); });
  ASSERT_EQ(done.status, JobStatus::kSucceeded) << done.error.dump();
  EXPECT_EQ(done.fine_tuned_model, "ft:base:pw:" + job->id);
  EXPECT_GT(done.trained_tokens, 0);
  EXPECT_EQ(done.last_step, done.total_steps);
  EXPECT_TRUE(fs::exists(done.output_dir + "/adapter_model.safetensors"));
  // Served at once, by name, on the base model; its newest checkpoints too.
  StatusOr<LlmEndpoint> served = LlmEndpoint::Find(*repository_, done.fine_tuned_model);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(served->adapter(), done.fine_tuned_model);
  EXPECT_TRUE(LlmEndpoint::Find(*repository_,
                                StrCat(done.fine_tuned_model, ":ckpt-step-", done.total_steps))
                  .ok());
  StatusOr<Page<CheckpointRecord>> cks = service_->ListCheckpoints(job->id, "", 10);
  ASSERT_TRUE(cks.ok());
  ASSERT_FALSE(cks->data.empty());
  EXPECT_EQ(cks->data[0].step_number, done.total_steps) << "newest first";
  EXPECT_EQ(cks->data[0].fine_tuned_model_checkpoint,
            StrCat(done.fine_tuned_model, ":ckpt-step-", done.total_steps));
  const std::vector<std::string> m = Messages(job->id);
  EXPECT_THAT(m, ::testing::Contains(HasSubstr("Files validated")));
  EXPECT_THAT(m, ::testing::Contains(HasSubstr("Step 1/")));
  EXPECT_THAT(m, ::testing::Contains("The job has successfully completed"));
  StatusOr<Page<EventRecord>> page = service_->ListEvents(job->id, "", 1);
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(page->data[0].message, "The job has successfully completed") << "newest first";
  EXPECT_TRUE(page->has_more);
  // A finished job cannot be cancelled, paused or resumed.
  EXPECT_EQ(service_->CancelJob(job->id).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(service_->PauseJob(job->id).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(service_->ResumeJob(job->id).status().code(), absl::StatusCode::kFailedPrecondition);
}

// Kiln's lora_dropout and gradient_accumulation_steps reach the run: the job trains with
// them, and reports them resolved.
TEST_F(JobServiceTest, DropoutAndGradientAccumulationTrain) {
  const std::string file = Upload();
  StatusOr<JobRecord> job = service_->CreateJob(
      Request(file, {{"n_epochs", 1}, {"lora_dropout", 0.1}, {"gradient_accumulation_steps", 2}}));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->hyperparameters["lora_dropout"], 0.1);
  EXPECT_EQ(job->hyperparameters["gradient_accumulation_steps"], 2);
  const JobRecord done = AwaitJob(job->id, [](const JobRecord& j) { return IsTerminal(j.status); });
  ASSERT_EQ(done.status, JobStatus::kSucceeded) << done.error.dump();
  EXPECT_GT(done.trained_tokens, 0);
  EXPECT_EQ(done.last_step, done.total_steps);
}

TEST_F(JobServiceTest, PauseCheckpointsAndResumeContinuesFromIt) {
  const std::string file = Upload();
  StatusOr<JobRecord> job = service_->CreateJob(Request(file, {{"n_epochs", 6}}));
  ASSERT_TRUE(job.ok()) << job.status();
  AwaitJob(job->id, [](const JobRecord& j) { return j.last_step >= 1; });
  ASSERT_TRUE(service_->PauseJob(job->id).ok());
  const JobRecord paused =
      AwaitJob(job->id, [](const JobRecord& j) { return j.status != JobStatus::kRunning; });
  ASSERT_EQ(paused.status, JobStatus::kPaused);
  EXPECT_LT(paused.last_step, paused.total_steps);
  ASSERT_TRUE(service_->ResumeJob(job->id).ok());
  const JobRecord done = AwaitJob(job->id, [](const JobRecord& j) { return IsTerminal(j.status); });
  ASSERT_EQ(done.status, JobStatus::kSucceeded) << done.error.dump();
  EXPECT_THAT(Messages(job->id), ::testing::Contains(StrCat("Resumed from the checkpoint at step ",
                                                            paused.last_step)));
}

TEST_F(JobServiceTest, ARestartResumesAnInterruptedJob) {
  const std::string file = Upload();
  StatusOr<JobRecord> job = service_->CreateJob(Request(file, {{"n_epochs", 6}}));
  ASSERT_TRUE(job.ok()) << job.status();
  AwaitJob(job->id, [](const JobRecord& j) { return j.last_step >= 1; });
  service_->Stop();  // as at SIGTERM: the step ends, a checkpoint is written, the row stays
  StatusOr<JobRecord> stopped = service_->GetJob(job->id);
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->status, JobStatus::kRunning);
  service_.reset();
  StartService();
  const JobRecord done = AwaitJob(job->id, [](const JobRecord& j) { return IsTerminal(j.status); });
  ASSERT_EQ(done.status, JobStatus::kSucceeded) << done.error.dump();
  const std::vector<std::string> m = Messages(job->id);
  EXPECT_THAT(m, ::testing::Contains(HasSubstr("The server restarted while the job ran")));
  EXPECT_THAT(
      m, ::testing::Contains(StrCat("Resumed from the checkpoint at step ", stopped->last_step)));
}

TEST_F(JobServiceTest, AJobWaitsQueuedWhileItsBaseModelIsNotReady) {
  const std::string file = Upload();
  StatusOr<JobRecord> job = service_->CreateJob(Request(file));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(service_->PauseJob(job->id).ok());
  ASSERT_EQ(AwaitJob(job->id, [](const JobRecord& j) { return Is(j, JobStatus::kPaused); }).status,
            JobStatus::kPaused);
  ASSERT_TRUE(repository_->Unload("base", SteadyClock::now()).ok());
  ASSERT_TRUE(service_->ResumeJob(job->id).ok());
  AwaitJob(job->id, [&](const JobRecord&) {
    for (const std::string& m : Messages(job->id)) {
      if (m.find("The base model is not ready") != std::string::npos) return true;
    }
    return false;
  });
  EXPECT_EQ(service_->GetJob(job->id)->status, JobStatus::kQueued);
  ASSERT_TRUE(repository_->Load("base").ok());
  const JobRecord done = AwaitJob(job->id, [](const JobRecord& j) { return IsTerminal(j.status); });
  EXPECT_EQ(done.status, JobStatus::kSucceeded) << done.error.dump();
}

TEST_F(JobServiceTest, CancelEndsARunningJob) {
  const std::string file = Upload();
  StatusOr<JobRecord> job = service_->CreateJob(Request(file, {{"n_epochs", 10}}));
  ASSERT_TRUE(job.ok()) << job.status();
  AwaitJob(job->id, [](const JobRecord& j) { return j.last_step >= 1; });
  ASSERT_TRUE(service_->CancelJob(job->id).ok());
  const JobRecord done = AwaitJob(job->id, [](const JobRecord& j) { return IsTerminal(j.status); });
  EXPECT_EQ(done.status, JobStatus::kCancelled);
  EXPECT_LT(done.last_step, done.total_steps);
  EXPECT_TRUE(done.fine_tuned_model.empty());
}

TEST_F(JobServiceTest, BadRequestsNameTheField) {
  const std::string file = Upload();
  auto param = [&](json r) {
    StatusOr<JobRecord> j = service_->CreateJob(r);
    EXPECT_FALSE(j.ok());
    return j.ok() ? std::string("<ok>")
                  : ParamOf(j.status()) + ": " + std::string(j.status().message());
  };
  json r = Request(file);
  r["model"] = "nope";
  EXPECT_THAT(param(r), HasSubstr("model: unknown base model 'nope'"));
  r["model"] = "simple";
  EXPECT_THAT(param(r), HasSubstr("cannot be fine-tuned"));
  EXPECT_THAT(param(Request(file, {{"n_epochs", 0}})),
              HasSubstr("method.supervised.hyperparameters.n_epochs: "));
  EXPECT_THAT(param(Request(file, {{"n_epochs", 1000}})), HasSubstr("allowed: 1 to 50"));
  EXPECT_THAT(param(Request(file, {{"learning_rate_multiplier", -1}})),
              HasSubstr("learning_rate_multiplier"));
  EXPECT_THAT(param(Request(file, {{"lora_dropout", 1.0}})), HasSubstr("allowed: 0 <= p < 1"));
  EXPECT_THAT(param(Request(file, {{"lora_dropout", "a"}})), HasSubstr("allowed: 0 <= p < 1"));
  EXPECT_THAT(param(Request(file, {{"gradient_accumulation_steps", 0}})),
              HasSubstr("gradient_accumulation_steps"));
  EXPECT_THAT(param(Request(file, {{"batch_sz", 2}})), HasSubstr("unknown hyper-parameter"));
  EXPECT_THAT(param(Request(file, {{"lora_r", 32}})),
              HasSubstr("lora_r: `method.supervised.hyperparameters.lora_r` is 32 but model "
                        "'base' serves adapters up to rank 16"));
  r = Request(file);
  r["suffix"] = std::string(65, 'a');
  EXPECT_THAT(param(r), HasSubstr("suffix: `suffix` is 65 characters"));
  r = Request("file-doesnotexist");
  EXPECT_THAT(param(r), HasSubstr("training_file: "));
  r = Request(file);
  r["hyperparameters"] = {{"n_epochs", 1}};
  EXPECT_THAT(param(r), HasSubstr("not both"));
  r = Request(file);
  r["method"]["type"] = "dpo";
  EXPECT_THAT(param(r), HasSubstr("method.type"));
  // The legacy top-level form works alone.
  r = Request(file);
  r.erase("method");
  r["hyperparameters"] = {{"n_epochs", "auto"}, {"batch_size", "auto"}};
  r["suffix"] = "legacy";
  StatusOr<JobRecord> legacy = service_->CreateJob(r);
  ASSERT_TRUE(legacy.ok()) << legacy.status();
  EXPECT_EQ(legacy->hyperparameters["n_epochs"], 25) << "auto for 3 examples";
  EXPECT_TRUE(service_->CancelJob(legacy->id).ok());
}

TEST_F(JobServiceTest, FilesAreCheckedStoredAndGuarded) {
  EXPECT_THAT(std::string(service_->UploadFile("x.jsonl", "assistants", kData).status().message()),
              HasSubstr("\"fine-tune\" only"));
  Status bad =
      service_->UploadFile("bad.jsonl", "fine-tune", "{\"messages\": []}\nnot json\n").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("line 1"));
  config_.fine_tuning.max_file_bytes = 10;
  service_.reset();
  StartService();
  EXPECT_EQ(service_->UploadFile("big.jsonl", "fine-tune", kData).status().code(),
            absl::StatusCode::kResourceExhausted);
  config_.fine_tuning.max_file_bytes = 1 << 20;
  service_.reset();
  StartService();
  const std::string file = Upload();
  StatusOr<FileRecord> f = service_->GetFile(file);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->bytes, static_cast<int64_t>(kData.size()));
  EXPECT_EQ(f->sha256.size(), 64u);
  EXPECT_EQ(*service_->FileContent(file), kData);
  // A job that is not finished (validating, queued, running or paused) holds its file.
  StatusOr<JobRecord> job = service_->CreateJob(Request(file));
  ASSERT_TRUE(job.ok());
  ASSERT_TRUE(service_->PauseJob(job->id).ok());
  EXPECT_EQ(service_->DeleteFile(file).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(service_->CancelJob(job->id).ok());
  // A job that already started ends after its step: the file is held until then.
  EXPECT_EQ(AwaitJob(job->id, [](const JobRecord& j) { return IsTerminal(j.status); }).status,
            JobStatus::kCancelled);
  EXPECT_TRUE(service_->DeleteFile(file).ok());
  EXPECT_EQ(service_->GetFile(file).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(fs::exists(f->path));
}

}  // namespace
}  // namespace kiln::finetune
