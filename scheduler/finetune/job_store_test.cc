#include "scheduler/finetune/job_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sqlite3.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

namespace kiln::finetune {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

std::string Msg(const Status& s) { return std::string(StatusMessage(s)); }

// A fresh directory per test; the database lives in a subdirectory Open must create.
class JobStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::path(::testing::TempDir()) / "kiln_job_store" / info->name();
    std::filesystem::remove_all(dir_);
    path_ = (dir_ / "sub" / "finetune.db").string();
    store_ = OpenStore();
  }

  std::unique_ptr<JobStore> OpenStore() {
    auto s = JobStore::Open(path_);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }

  static FileRecord File(std::string id) {
    FileRecord f;
    f.id = std::move(id);
    f.bytes = 1234;
    f.created_at = 1700000000;
    f.filename = "train.jsonl";
    f.purpose = "fine-tune";
    f.sha256 = std::string(64, 'a');
    f.path = "/data/files/" + f.id;
    f.status = "processed";
    f.status_details = "ok";
    return f;
  }

  static JobRecord Job(std::string id, std::string suffix = "") {
    JobRecord j;
    j.id = std::move(id);
    j.model = "smollm2";
    j.training_file = "file-train";
    j.suffix = std::move(suffix);
    j.created_at = 1700000001;
    return j;
  }

  std::filesystem::path dir_;
  std::string path_;
  std::unique_ptr<JobStore> store_;
};

TEST(NewIdTest, PrefixAndTwentyFourLowercaseHexCharacters) {
  const std::string a = NewId("ftjob-"), b = NewId("ftjob-");
  EXPECT_THAT(a, MatchesRegex("ftjob-[0-9a-f]{24}"));
  EXPECT_NE(a, b);
}

TEST(JobStatusTest, NamesRoundTrip) {
  for (JobStatus s :
       {JobStatus::kValidatingFiles, JobStatus::kQueued, JobStatus::kRunning, JobStatus::kPaused,
        JobStatus::kSucceeded, JobStatus::kFailed, JobStatus::kCancelled}) {
    EXPECT_EQ(ParseJobStatus(JobStatusName(s)), s);
  }
  EXPECT_EQ(JobStatusName(JobStatus::kValidatingFiles), "validating_files");
  EXPECT_EQ(ParseJobStatus("done"), std::nullopt);
  EXPECT_TRUE(IsTerminal(JobStatus::kCancelled));
  EXPECT_FALSE(IsTerminal(JobStatus::kPaused));
}

TEST(EventSeqTest, ParsesOnlyWellFormedIds) {
  EXPECT_EQ(JobStore::EventSeq("ftevent-12"), 12);
  EXPECT_EQ(JobStore::EventSeq("ftevent-"), 0);
  EXPECT_EQ(JobStore::EventSeq("ftevent-1x"), 0);
  EXPECT_EQ(JobStore::EventSeq("ftckpt-3"), 0);
  EXPECT_EQ(JobStore::EventSeq("ftevent-99999999999999999999"), 0);
}

TEST_F(JobStoreTest, OpenCreatesTheDirectoryAndTheSchema) {
  ASSERT_NE(store_, nullptr);
  EXPECT_TRUE(std::filesystem::exists(path_));
  EXPECT_EQ(store_->schema_version(), JobStore::kSchemaVersion);
}

TEST_F(JobStoreTest, FileRoundTripAndNotFound) {
  const FileRecord f = File("file-1");
  ASSERT_TRUE(store_->InsertFile(f).ok());
  auto got = store_->GetFile("file-1");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->id, f.id);
  EXPECT_EQ(got->bytes, f.bytes);
  EXPECT_EQ(got->created_at, f.created_at);
  EXPECT_EQ(got->filename, f.filename);
  EXPECT_EQ(got->purpose, f.purpose);
  EXPECT_EQ(got->sha256, f.sha256);
  EXPECT_EQ(got->path, f.path);
  EXPECT_EQ(got->status, f.status);
  EXPECT_EQ(got->status_details, f.status_details);

  EXPECT_EQ(store_->InsertFile(f).code(), StatusCode::kAlreadyExists);
  auto missing = store_->GetFile("file-2");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Msg(missing.status()), "no file 'file-2'");
}

TEST_F(JobStoreTest, JobRoundTripWithEveryField) {
  JobRecord j = Job("ftjob-1", "mine");
  j.validation_file = "file-valid";
  j.status = JobStatus::kRunning;
  j.finished_at = 1700000100;
  j.estimated_finish = 1700000200;
  j.seed = -42;
  j.hyperparameters = {{"n_epochs", 3}, {"learning_rate_multiplier", 0.5}};
  j.method = {{"type", "supervised"}};
  j.metadata = {{"team", "a"}};
  j.error = {{"code", "x"}, {"message", "y"}, {"param", nullptr}};
  j.fine_tuned_model = "ft:smollm2:mine:ftjob-1";
  j.trained_tokens = 1 << 20;
  j.total_steps = 100;
  j.last_step = 7;
  j.output_dir = "/data/jobs/ftjob-1";
  j.cancel_requested = true;
  j.pause_requested = true;
  ASSERT_TRUE(store_->InsertJob(j).ok());

  auto got = store_->GetJob("ftjob-1");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->id, j.id);
  EXPECT_EQ(got->model, j.model);
  EXPECT_EQ(got->training_file, j.training_file);
  EXPECT_EQ(got->validation_file, j.validation_file);
  EXPECT_EQ(got->status, j.status);
  EXPECT_EQ(got->created_at, j.created_at);
  EXPECT_EQ(got->finished_at, j.finished_at);
  EXPECT_EQ(got->estimated_finish, j.estimated_finish);
  EXPECT_EQ(got->suffix, j.suffix);
  EXPECT_EQ(got->seed, j.seed);
  EXPECT_EQ(got->hyperparameters, j.hyperparameters);
  EXPECT_EQ(got->method, j.method);
  EXPECT_EQ(got->metadata, j.metadata);
  EXPECT_EQ(got->error, j.error);
  EXPECT_EQ(got->fine_tuned_model, j.fine_tuned_model);
  EXPECT_EQ(got->trained_tokens, j.trained_tokens);
  EXPECT_EQ(got->total_steps, j.total_steps);
  EXPECT_EQ(got->last_step, j.last_step);
  EXPECT_EQ(got->output_dir, j.output_dir);
  EXPECT_TRUE(got->cancel_requested);
  EXPECT_TRUE(got->pause_requested);

  // A null error stays null.
  JobRecord plain = Job("ftjob-2");
  ASSERT_TRUE(store_->InsertJob(plain).ok());
  EXPECT_TRUE(store_->GetJob("ftjob-2")->error.is_null());

  // Update replaces every field.
  j.status = JobStatus::kSucceeded;
  j.last_step = 100;
  j.error = nullptr;
  j.cancel_requested = false;
  ASSERT_TRUE(store_->UpdateJob(j).ok());
  got = store_->GetJob("ftjob-1");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->status, JobStatus::kSucceeded);
  EXPECT_EQ(got->last_step, 100);
  EXPECT_TRUE(got->error.is_null());
  EXPECT_FALSE(got->cancel_requested);

  EXPECT_EQ(store_->InsertJob(j).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(store_->UpdateJob(Job("ftjob-none")).code(), StatusCode::kNotFound);
  EXPECT_EQ(Msg(store_->GetJob("ftjob-none").status()), "no fine-tuning job 'ftjob-none'");
}

TEST_F(JobStoreTest, EventAndCheckpointRoundTrip) {
  ASSERT_TRUE(store_->InsertJob(Job("ftjob-1")).ok());
  EventRecord e;
  e.job_id = "ftjob-1";
  e.created_at = 1700000005;
  e.level = "warn";
  e.type = "metrics";
  e.message = "step 3";
  e.data = {{"step", 3}, {"train_loss", 1.25}};
  auto added = store_->AddEvent(e);
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_THAT(added->id, MatchesRegex("ftevent-[0-9]+"));
  auto events = store_->ListEvents("ftjob-1", "", 10);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->data.size(), 1u);
  const EventRecord& got = events->data[0];
  EXPECT_EQ(got.id, added->id);
  EXPECT_EQ(got.job_id, e.job_id);
  EXPECT_EQ(got.created_at, e.created_at);
  EXPECT_EQ(got.level, e.level);
  EXPECT_EQ(got.type, e.type);
  EXPECT_EQ(got.message, e.message);
  EXPECT_EQ(got.data, e.data);

  // created_at 0 is filled in; data null stays null.
  EventRecord plain;
  plain.job_id = "ftjob-1";
  plain.message = "hello";
  auto added2 = store_->AddEvent(plain);
  ASSERT_TRUE(added2.ok());
  EXPECT_GT(added2->created_at, 0);
  EXPECT_GT(JobStore::EventSeq(added2->id), JobStore::EventSeq(added->id));
  EXPECT_TRUE(store_->ListEvents("ftjob-1", "", 1)->data[0].data.is_null());

  CheckpointRecord c;
  c.job_id = "ftjob-1";
  c.created_at = 1700000009;
  c.step_number = 50;
  c.metrics = {{"step", 50}, {"train_loss", 0.5}};
  c.fine_tuned_model_checkpoint = "ft:smollm2::ftjob-1:ckpt-step-50";
  c.path = "/data/jobs/ftjob-1/checkpoint-50";
  auto ckpt = store_->AddCheckpoint(c);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_THAT(ckpt->id, MatchesRegex("ftckpt-[0-9]+"));
  auto ckpts = store_->ListCheckpoints("ftjob-1", "", 10);
  ASSERT_TRUE(ckpts.ok()) << ckpts.status();
  ASSERT_EQ(ckpts->data.size(), 1u);
  EXPECT_EQ(ckpts->data[0].id, ckpt->id);
  EXPECT_EQ(ckpts->data[0].job_id, c.job_id);
  EXPECT_EQ(ckpts->data[0].created_at, c.created_at);
  EXPECT_EQ(ckpts->data[0].step_number, c.step_number);
  EXPECT_EQ(ckpts->data[0].metrics, c.metrics);
  EXPECT_EQ(ckpts->data[0].fine_tuned_model_checkpoint, c.fine_tuned_model_checkpoint);
  EXPECT_EQ(ckpts->data[0].path, c.path);

  // Unknown jobs.
  e.job_id = "ftjob-none";
  EXPECT_EQ(store_->AddEvent(e).status().code(), StatusCode::kNotFound);
  c.job_id = "ftjob-none";
  EXPECT_EQ(store_->AddCheckpoint(c).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->ListEvents("ftjob-none", "", 10).status().code(), StatusCode::kNotFound);
}

TEST_F(JobStoreTest, PagesAreNewestFirstAndContinueAfterTheLastId) {
  for (int i = 1; i <= 5; ++i) {
    ASSERT_TRUE(store_->InsertFile(File("file-" + std::to_string(i))).ok());
  }
  FileRecord other = File("file-other");
  other.purpose = "batch";
  ASSERT_TRUE(store_->InsertFile(other).ok());

  auto ids = [](const Page<FileRecord>& p) {
    std::vector<std::string> out;
    for (const auto& f : p.data) out.push_back(f.id);
    return out;
  };
  auto p1 = store_->ListFiles("fine-tune", "", 2);
  ASSERT_TRUE(p1.ok()) << p1.status();
  EXPECT_THAT(ids(*p1), ElementsAre("file-5", "file-4"));
  EXPECT_TRUE(p1->has_more);
  auto p2 = store_->ListFiles("fine-tune", "file-4", 2);
  ASSERT_TRUE(p2.ok());
  EXPECT_THAT(ids(*p2), ElementsAre("file-3", "file-2"));
  EXPECT_TRUE(p2->has_more);
  auto p3 = store_->ListFiles("fine-tune", "file-2", 2);
  ASSERT_TRUE(p3.ok());
  EXPECT_THAT(ids(*p3), ElementsAre("file-1"));
  EXPECT_FALSE(p3->has_more);
  // Exactly `limit` left: has_more is false.
  auto exact = store_->ListFiles("fine-tune", "file-3", 2);
  EXPECT_THAT(ids(*exact), ElementsAre("file-2", "file-1"));
  EXPECT_FALSE(exact->has_more);
  // Empty purpose: every file.
  EXPECT_THAT(ids(*store_->ListFiles("", "", 100)),
              ElementsAre("file-other", "file-5", "file-4", "file-3", "file-2", "file-1"));

  for (int limit : {0, 101, -1}) {
    auto bad = store_->ListFiles("", "", limit);
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(ParamOf(bad.status()), "limit");
    EXPECT_THAT(Msg(bad.status()), HasSubstr("between 1 and 100"));
  }
  auto bad_after = store_->ListFiles("", "file-none", 10);
  EXPECT_EQ(bad_after.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParamOf(bad_after.status()), "after");

  // Events page the same way.
  ASSERT_TRUE(store_->InsertJob(Job("ftjob-1")).ok());
  std::vector<std::string> event_ids;
  for (int i = 0; i < 3; ++i) {
    EventRecord e;
    e.job_id = "ftjob-1";
    e.message = "e" + std::to_string(i);
    event_ids.push_back(store_->AddEvent(e)->id);
  }
  auto e1 = store_->ListEvents("ftjob-1", "", 2);
  ASSERT_TRUE(e1.ok());
  ASSERT_EQ(e1->data.size(), 2u);
  EXPECT_EQ(e1->data[0].id, event_ids[2]);
  EXPECT_EQ(e1->data[1].id, event_ids[1]);
  EXPECT_TRUE(e1->has_more);
  auto e2 = store_->ListEvents("ftjob-1", e1->data[1].id, 2);
  ASSERT_TRUE(e2.ok());
  ASSERT_EQ(e2->data.size(), 1u);
  EXPECT_EQ(e2->data[0].id, event_ids[0]);
  EXPECT_FALSE(e2->has_more);
  EXPECT_EQ(ParamOf(store_->ListEvents("ftjob-1", "ftjob-1", 2).status()), "after");

  // And checkpoints.
  for (int step : {10, 20, 30}) {
    CheckpointRecord c;
    c.job_id = "ftjob-1";
    c.step_number = step;
    ASSERT_TRUE(store_->AddCheckpoint(c).ok());
  }
  auto c1 = store_->ListCheckpoints("ftjob-1", "", 2);
  ASSERT_TRUE(c1.ok());
  ASSERT_EQ(c1->data.size(), 2u);
  EXPECT_EQ(c1->data[0].step_number, 30);
  EXPECT_TRUE(c1->has_more);
  auto c2 = store_->ListCheckpoints("ftjob-1", c1->data[1].id, 2);
  ASSERT_TRUE(c2.ok());
  ASSERT_EQ(c2->data.size(), 1u);
  EXPECT_EQ(c2->data[0].step_number, 10);
  EXPECT_FALSE(c2->has_more);
}

TEST_F(JobStoreTest, ListJobsFiltersOnMetadataAndPages) {
  for (int i = 1; i <= 4; ++i) {
    JobRecord j = Job("ftjob-" + std::to_string(i));
    j.metadata = {{"team", i % 2 == 0 ? "even" : "odd"}, {"n", std::to_string(i)}};
    ASSERT_TRUE(store_->InsertJob(j).ok());
  }
  auto ids = [](const Page<JobRecord>& p) {
    std::vector<std::string> out;
    for (const auto& j : p.data) out.push_back(j.id);
    return out;
  };
  auto all = store_->ListJobs("", 10, {});
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_THAT(ids(*all), ElementsAre("ftjob-4", "ftjob-3", "ftjob-2", "ftjob-1"));
  auto even = store_->ListJobs("", 1, {{"team", "even"}});
  ASSERT_TRUE(even.ok());
  EXPECT_THAT(ids(*even), ElementsAre("ftjob-4"));
  EXPECT_TRUE(even->has_more);
  auto even2 = store_->ListJobs("ftjob-4", 1, {{"team", "even"}});
  EXPECT_THAT(ids(*even2), ElementsAre("ftjob-2"));
  EXPECT_FALSE(even2->has_more);
  EXPECT_THAT(ids(*store_->ListJobs("", 10, {{"team", "odd"}, {"n", "3"}})),
              ElementsAre("ftjob-3"));
  EXPECT_TRUE(store_->ListJobs("", 10, {{"team", "none"}})->data.empty());
  EXPECT_EQ(ParamOf(store_->ListJobs("", 0, {}).status()), "limit");
}

TEST_F(JobStoreTest, JobsWithStatusAreOldestFirst) {
  const JobStatus statuses[] = {JobStatus::kQueued, JobStatus::kRunning, JobStatus::kSucceeded,
                                JobStatus::kQueued, JobStatus::kPaused};
  for (int i = 0; i < 5; ++i) {
    JobRecord j = Job("ftjob-" + std::to_string(i));
    j.status = statuses[i];
    ASSERT_TRUE(store_->InsertJob(j).ok());
  }
  auto jobs = store_->JobsWithStatus({JobStatus::kRunning, JobStatus::kQueued});
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  std::vector<std::string> ids;
  for (const auto& j : *jobs) ids.push_back(j.id);
  EXPECT_THAT(ids, ElementsAre("ftjob-0", "ftjob-1", "ftjob-3"));
  EXPECT_TRUE(store_->JobsWithStatus({})->empty());
  auto counts = store_->CountJobsByStatus();
  ASSERT_TRUE(counts.ok()) << counts.status();
  EXPECT_EQ(*counts, (std::map<JobStatus, int64_t>{{JobStatus::kQueued, 2},
                                                   {JobStatus::kRunning, 1},
                                                   {JobStatus::kPaused, 1},
                                                   {JobStatus::kSucceeded, 1}}));
}

// Two connections (as two daemons on one storage_dir would have) insert jobs with the same
// model and suffix at once: BEGIN IMMEDIATE makes the check and the insert one step.
TEST_F(JobStoreTest, SuffixRaceHasExactlyOneWinner) {
  auto other = OpenStore();
  ASSERT_NE(other, nullptr);
  for (int round = 0; round < 20; ++round) {
    const std::string suffix = "race" + std::to_string(round);
    std::atomic<bool> go{false};
    Status a, b;
    std::thread ta([&] {
      while (!go) {
      }
      a = store_->InsertJob(Job("ftjob-a" + std::to_string(round), suffix));
    });
    std::thread tb([&] {
      while (!go) {
      }
      b = other->InsertJob(Job("ftjob-b" + std::to_string(round), suffix));
    });
    go = true;
    ta.join();
    tb.join();
    ASSERT_NE(a.ok(), b.ok()) << a << " / " << b;
    const Status& lost = a.ok() ? b : a;
    EXPECT_EQ(lost.code(), StatusCode::kAlreadyExists) << lost;
    EXPECT_EQ(ParamOf(lost), "suffix");
    EXPECT_THAT(Msg(lost), MatchesRegex("suffix 'race[0-9]+' is already used by fine-tuning "
                                        "job ftjob-[ab][0-9]+ of model 'smollm2'"));
  }
}

TEST_F(JobStoreTest, SuffixOfAFailedJobCanBeReused) {
  JobRecord first = Job("ftjob-1", "mine");
  ASSERT_TRUE(store_->InsertJob(first).ok());
  EXPECT_EQ(store_->InsertJob(Job("ftjob-2", "mine")).code(), StatusCode::kAlreadyExists);
  // Another base model may use the same suffix; an empty suffix is never taken.
  JobRecord other_model = Job("ftjob-3", "mine");
  other_model.model = "llama";
  EXPECT_TRUE(store_->InsertJob(other_model).ok());
  EXPECT_TRUE(store_->InsertJob(Job("ftjob-4")).ok());
  EXPECT_TRUE(store_->InsertJob(Job("ftjob-5")).ok());

  first.status = JobStatus::kFailed;
  ASSERT_TRUE(store_->UpdateJob(first).ok());
  EXPECT_TRUE(store_->InsertJob(Job("ftjob-2", "mine")).ok());
}

TEST_F(JobStoreTest, FineTunedModelIsUnique) {
  JobRecord a = Job("ftjob-1");
  a.fine_tuned_model = "ft:smollm2::x";
  ASSERT_TRUE(store_->InsertJob(a).ok());
  JobRecord b = Job("ftjob-2");
  b.fine_tuned_model = a.fine_tuned_model;
  const Status s = store_->InsertJob(b);
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists);
  EXPECT_THAT(Msg(s), HasSubstr("ftjob-1"));
  // The unique index also guards updates.
  b.fine_tuned_model = "";
  ASSERT_TRUE(store_->InsertJob(b).ok());
  b.fine_tuned_model = a.fine_tuned_model;
  EXPECT_EQ(store_->UpdateJob(b).code(), StatusCode::kAlreadyExists);
}

TEST_F(JobStoreTest, DeleteFileIsRefusedWhileARunningJobUsesIt) {
  ASSERT_TRUE(store_->InsertFile(File("file-train")).ok());
  ASSERT_TRUE(store_->InsertFile(File("file-valid")).ok());
  JobRecord j = Job("ftjob-1");
  j.validation_file = "file-valid";
  j.status = JobStatus::kRunning;
  ASSERT_TRUE(store_->InsertJob(j).ok());
  for (const char* id : {"file-train", "file-valid"}) {
    const Status s = store_->DeleteFile(id);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << id;
    EXPECT_THAT(Msg(s), HasSubstr("in use by fine-tuning job ftjob-1 (status running)"));
  }
  j.status = JobStatus::kSucceeded;
  ASSERT_TRUE(store_->UpdateJob(j).ok());
  EXPECT_TRUE(store_->DeleteFile("file-train").ok());
  EXPECT_EQ(store_->GetFile("file-train").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->DeleteFile("file-train").code(), StatusCode::kNotFound);
  // The finished job keeps its record.
  EXPECT_TRUE(store_->GetJob("ftjob-1").ok());
}

TEST_F(JobStoreTest, ReopenKeepsEverything) {
  ASSERT_TRUE(store_->InsertFile(File("file-1")).ok());
  ASSERT_TRUE(store_->InsertJob(Job("ftjob-1", "s")).ok());
  EventRecord e;
  e.job_id = "ftjob-1";
  e.message = "before";
  auto first = store_->AddEvent(e);
  ASSERT_TRUE(first.ok());
  store_.reset();

  store_ = OpenStore();
  ASSERT_NE(store_, nullptr);
  EXPECT_TRUE(store_->GetFile("file-1").ok());
  auto job = store_->GetJob("ftjob-1");
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->suffix, "s");
  // Event numbers keep increasing across restarts (AUTOINCREMENT never reuses one).
  e.message = "after";
  auto second = store_->AddEvent(e);
  ASSERT_TRUE(second.ok());
  EXPECT_GT(JobStore::EventSeq(second->id), JobStore::EventSeq(first->id));
  auto since = store_->EventsSince("ftjob-1", 0);
  ASSERT_TRUE(since.ok());
  ASSERT_EQ(since->size(), 2u);
  EXPECT_EQ((*since)[0].message, "before");
  EXPECT_EQ((*since)[1].message, "after");
}

TEST_F(JobStoreTest, EventsSinceIsOldestFirstAfterTheSequence) {
  ASSERT_TRUE(store_->InsertJob(Job("ftjob-1")).ok());
  ASSERT_TRUE(store_->InsertJob(Job("ftjob-2")).ok());
  std::vector<int64_t> seqs;
  for (int i = 0; i < 4; ++i) {
    EventRecord e;
    e.job_id = i == 2 ? "ftjob-2" : "ftjob-1";  // another job's event in between
    e.message = "m" + std::to_string(i);
    auto added = store_->AddEvent(e);
    ASSERT_TRUE(added.ok());
    seqs.push_back(JobStore::EventSeq(added->id));
  }
  auto all = store_->EventsSince("ftjob-1", 0);
  ASSERT_TRUE(all.ok());
  std::vector<std::string> messages;
  for (const auto& e : *all) messages.push_back(e.message);
  EXPECT_THAT(messages, ElementsAre("m0", "m1", "m3"));
  auto later = store_->EventsSince("ftjob-1", seqs[1]);
  ASSERT_TRUE(later.ok());
  ASSERT_EQ(later->size(), 1u);
  EXPECT_EQ((*later)[0].message, "m3");
  EXPECT_TRUE(store_->EventsSince("ftjob-1", seqs[3])->empty());
  EXPECT_EQ(store_->EventsSince("ftjob-none", 0).status().code(), StatusCode::kNotFound);
}

TEST_F(JobStoreTest, NewerSchemaIsRefused) {
  store_.reset();
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path_.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "PRAGMA user_version = 99", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(db);
  auto s = JobStore::Open(path_);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(s.status()), HasSubstr("schema version 99"));
  EXPECT_THAT(Msg(s.status()), HasSubstr("versions up to 1"));
  EXPECT_THAT(Msg(s.status()), HasSubstr(path_));
}

TEST_F(JobStoreTest, GarbageFileIsRefusedClearly) {
  const std::string garbage = (dir_ / "garbage.db").string();
  std::ofstream(garbage, std::ios::binary) << std::string(8192, 'x');
  auto s = JobStore::Open(garbage);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(Msg(s.status()), HasSubstr(garbage));
  EXPECT_THAT(Msg(s.status()), HasSubstr("file is not a database"));
}

TEST_F(JobStoreTest, UnwritableDirectoryIsAnError) {
  const std::string file = (dir_ / "plain").string();
  std::ofstream(file) << "x";
  auto s = JobStore::Open(file + "/sub/finetune.db");  // a directory below a plain file
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(Msg(s.status()), HasSubstr("cannot create directory"));
}

}  // namespace
}  // namespace kiln::finetune
