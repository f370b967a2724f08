#include "backends/host/host_device.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <optional>
#include <thread>
#include <vector>

#include "backends/builtin.h"

namespace kiln::backend {
namespace {

struct Shared {
  std::atomic<int64_t> slot[8];
  int64_t sum = 0;
};

// Launch 1: every thread writes its slot. Launch 2: thread 0 sums the slots. The barrier
// between launches makes the sum always complete.
void WriteSlot(const LaunchArgs& a, const ExecCtx& c) {
  auto* s = static_cast<Shared*>(const_cast<void*>(a.kernel_data));
  s->slot[c.thread_index].store(c.thread_index + 1, std::memory_order_relaxed);
}
void SumSlots(const LaunchArgs& a, const ExecCtx& c) {
  auto* s = static_cast<Shared*>(const_cast<void*>(a.kernel_data));
  if (c.thread_index == 0) {
    int64_t t = 0;
    for (int i = 0; i < c.thread_count; ++i) t += s->slot[i].exchange(0, std::memory_order_relaxed);
    s->sum += t;
  }
}

TEST(HostStreamTest, ThreadPoolRunsEveryLaunchOnEveryThreadWithBarriers) {
  HostDevice* dev = nullptr;
  auto backend = MakeCpuBackend(3);
  dev = static_cast<HostDevice*>(backend->device(0));
  ASSERT_EQ(dev->threads(), 3);
  // Every run on every thread: no straggler fallback (a slow test machine may trigger it).
  auto stream = std::make_unique<HostStream>(dev, 3, StragglerPolicy{.enabled = false});
  Shared shared{};
  LaunchArgs args;
  args.kernel_data = &shared;
  std::vector<Launch> launches;
  for (int i = 0; i < 50; ++i) {
    launches.push_back({WriteSlot, &args});
    launches.push_back({SumSlots, &args});
  }
  for (int rep = 0; rep < 20; ++rep) ASSERT_TRUE(stream->Run(launches).ok());
  EXPECT_EQ(shared.sum, 20 * 50 * (1 + 2 + 3));
  ASSERT_TRUE(stream->Run({}).ok());  // an empty list is fine
  EXPECT_EQ(stream->straggler_fallbacks(), 0);
}

// Counts the calls of one launch.
struct Calls {
  std::atomic<int> n{0};
};
void CountCall(const LaunchArgs& a, const ExecCtx&) {
  static_cast<Calls*>(const_cast<void*>(a.kernel_data))->n.fetch_add(1);
}

// A pool thread must run exactly the launches of the job it woke for. It once re-read the
// stream's current job after the job's last barrier: descheduled there, it came back to the
// next job's list and ran its later launches out of step with the calling thread (a deadlock
// of the multi-LoRA serving test beside a busy process). Jobs of one and of four launches
// alternate while two busy threads take the cores away; every launch runs once per thread.
TEST(HostStreamTest, APoolThreadNeverRunsTheNextJobsLaunchesEarly) {
  auto backend = MakeCpuBackend(2);
  auto stream =
      std::make_unique<HostStream>(backend->device(0), 2, StragglerPolicy{.enabled = false});
  Calls calls[5];
  LaunchArgs args[5];
  for (int i = 0; i < 5; ++i) args[i].kernel_data = &calls[i];
  const std::vector<Launch> one = {{CountCall, &args[0]}};
  std::vector<Launch> four;
  for (int i = 1; i < 5; ++i) four.push_back({CountCall, &args[i]});
  std::atomic<bool> stop{false};
  std::vector<std::thread> busy;
  for (int i = 0; i < 2; ++i) {
    busy.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  }
  auto done = std::async(std::launch::async, [&] {
    for (int rep = 1; rep <= 3000; ++rep) {
      if (!stream->Run(one).ok() || !stream->Run(four).ok()) return rep;
      for (const Calls& c : calls) {
        if (c.n.load() != 2 * rep) return rep;
      }
    }
    return 0;
  });
  if (done.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    ADD_FAILURE() << "the pool deadlocked";
    std::_Exit(1);  // its threads cannot be joined
  }
  stop.store(true);
  for (std::thread& t : busy) t.join();
  EXPECT_EQ(done.get(), 0) << "a launch ran a wrong number of times in that repetition";
}

// A kernel that fills out[0..n) in shares of ctx.thread_count, recording each element's
// share. While `stall` is set pool thread 1 is "descheduled" (sleeps) in every launch;
// otherwise every thread works ~1 ms.
struct Straggler {
  std::atomic<bool> stall{true};
  std::atomic<bool> last_in_sequence{false};
  std::vector<int> out = std::vector<int>(64), share = std::vector<int>(64);
};
void FillShare(const LaunchArgs& a, const ExecCtx& c) {
  auto* s = static_cast<Straggler*>(const_cast<void*>(a.kernel_data));
  if (c.thread_index == 0) s->last_in_sequence.store(c.shares_in_sequence);
  if (!c.shares_in_sequence) {  // a share run in sequence is on the calling thread
    if (!s->stall.load()) {     // balanced work
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else if (c.thread_index == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  const int64_t n = static_cast<int64_t>(s->out.size());
  for (int64_t i = n * c.thread_index / c.thread_count;
       i < n * (c.thread_index + 1) / c.thread_count; ++i) {
    s->out[i] += 1;
    s->share[i] = c.thread_index;
  }
}

// A 2-thread cpu stream with `policy` (decisions on runs of any length) running 4 FillShare
// launches per run.
class StragglerTest : public ::testing::Test {
 protected:
  void Start(StragglerPolicy policy) {
    policy.min_run_seconds = 0;
    stream_ = std::make_unique<HostStream>(backend_->device(0), 2, policy);
    args_.kernel_data = &s_;
  }
  // One run; every element was filled once per launch, by the same share of two, whichever
  // threads ran the shares.
  void Run() {
    ASSERT_TRUE(stream_->Run(launches_).ok());
    ++runs_;
    for (size_t i = 0; i < s_.out.size(); ++i) {
      ASSERT_EQ(s_.out[i], 4 * runs_);
      ASSERT_EQ(s_.share[i], i < s_.out.size() / 2 ? 0 : 1);
    }
  }

  std::unique_ptr<Backend> backend_ = MakeCpuBackend(2);
  std::unique_ptr<HostStream> stream_;
  Straggler s_;
  LaunchArgs args_;
  const std::vector<Launch> launches_ = std::vector<Launch>(4, Launch{FillShare, &args_});
  int runs_ = 0;
};

TEST_F(StragglerTest, ADescheduledThreadMovesLaunchesToTheCallingThreadUntilItRecovers) {
  Start(StragglerPolicy{.backoff_seconds = 0.05});
  // Thread 0 waits ~2 ms per launch for thread 1: half the pool's time is waiting.
  while (stream_->single_thread_runs() == 0) {
    Run();
    ASSERT_LT(runs_, 50) << "no fallback";
  }
  EXPECT_EQ(stream_->straggler_fallbacks(), 1);
  EXPECT_TRUE(s_.last_in_sequence.load());  // the last run: the calling thread, share by share
  // Still stalled: the run that tries both threads again (after the backoff) falls back again.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (stream_->straggler_fallbacks() < 2) {
    Run();
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no second fallback";
  }
  // Recovered: after the backoff both threads run again.
  s_.stall.store(false);
  do {
    Run();
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "never back on two threads";
  } while (s_.last_in_sequence.load());
}

// One run that waits `immediate_wait_share` falls back at once, without the average: here
// the average alone (over 0.9) would never trigger it.
TEST_F(StragglerTest, OneRunWaitingThatMuchFallsBackAtOnce) {
  Start(StragglerPolicy{.max_wait_share = 0.9, .immediate_wait_share = 0.2, .backoff_seconds = 60});
  Run();  // thread 0 waits ~2 ms of each ~2 ms launch for thread 1: ~half of the run
  EXPECT_EQ(stream_->straggler_fallbacks(), 1);
  Run();
  EXPECT_TRUE(s_.last_in_sequence.load());
}

TEST_F(StragglerTest, TheFallbackCanBeTurnedOff) {
  Start(StragglerPolicy{.enabled = false});
  for (int i = 0; i < 10; ++i) {
    Run();
    EXPECT_FALSE(s_.last_in_sequence.load());
  }
  EXPECT_EQ(stream_->single_thread_runs(), 0);
}

// A quota of at most one CPU (StragglerPolicy::quota_cpus, re-read at every run here) runs
// the launches' shares on the calling thread; more than one CPU, or no quota, the pool.
TEST_F(StragglerTest, AQuotaOfOneCpuRunsLaunchesOnTheCallingThread) {
  s_.stall.store(false);
  std::optional<double> quota = 1.0;
  int reads = 0;
  StragglerPolicy policy;
  // Never a straggler fallback, however loaded the machine.
  policy.max_wait_share = policy.immediate_wait_share = 2;
  policy.quota_cpus = [&] {
    ++reads;
    return quota;
  };
  policy.quota_recheck_seconds = 0;
  Start(policy);
  Run();
  EXPECT_TRUE(s_.last_in_sequence.load());
  EXPECT_EQ(stream_->single_thread_runs(), 1);
  quota = 0.5;
  Run();
  EXPECT_TRUE(s_.last_in_sequence.load());
  for (const std::optional<double> q : {std::optional<double>(1.5), std::optional<double>()}) {
    quota = q;
    Run();
    EXPECT_FALSE(s_.last_in_sequence.load()) << (q ? *q : -1);
  }
  EXPECT_EQ(stream_->single_thread_runs(), 2);
  EXPECT_EQ(stream_->straggler_fallbacks(), 0);
  EXPECT_EQ(reads, 4);
}

TEST_F(StragglerTest, TheQuotaIsReadAgainOnlyWhenDueAndNotWhenTheFallbackIsOff) {
  s_.stall.store(false);
  int reads = 0;
  StragglerPolicy policy;
  policy.max_wait_share = policy.immediate_wait_share = 2;
  policy.quota_cpus = [&] {
    ++reads;
    return std::optional<double>(1.0);
  };
  policy.quota_recheck_seconds = 3600;
  Start(policy);
  for (int i = 0; i < 3; ++i) Run();
  EXPECT_EQ(reads, 1);
  EXPECT_EQ(stream_->single_thread_runs(), 3);
  policy.enabled = false;  // KILN_CPU_STRAGGLER_FALLBACK=0: every launch on the pool
  reads = 0;
  runs_ = 0;
  s_.out.assign(s_.out.size(), 0);
  Start(policy);
  Run();
  EXPECT_FALSE(s_.last_in_sequence.load());
  EXPECT_EQ(reads, 0);
}

TEST(HostStreamTest, CaptureRecordsThenReplays) {
  auto backend = MakeRefBackend();
  auto stream = backend->device(0)->CreateStream();
  ASSERT_TRUE(stream.ok());
  Shared shared{};
  LaunchArgs args;
  args.kernel_data = &shared;
  const Launch l[] = {{WriteSlot, &args}, {SumSlots, &args}};
  ASSERT_TRUE((*stream)->SupportsCapture());
  ASSERT_TRUE((*stream)->BeginCapture().ok());
  EXPECT_FALSE((*stream)->BeginCapture().ok());
  ASSERT_TRUE((*stream)->Run(l).ok());
  EXPECT_EQ(shared.sum, 0);  // recorded, not run
  auto graph = (*stream)->EndCapture();
  ASSERT_TRUE(graph.ok());
  ASSERT_TRUE((*graph)->Replay(**stream).ok());
  ASSERT_TRUE((*graph)->Replay(**stream).ok());
  EXPECT_EQ(shared.sum, 2);
  auto other = MakeCpuBackend(1);
  auto other_stream = other->device(0)->CreateStream();
  EXPECT_FALSE((*graph)->Replay(**other_stream).ok());  // wrong device
}

TEST(HostDeviceTest, BuffersAreAlignedAndCopiesChecked) {
  auto backend = MakeRefBackend();
  Device* dev = backend->device(0);
  auto buf = dev->Allocate(100);
  ASSERT_TRUE(buf.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*buf)->data()) % kMinAlignment, 0u);
  auto stream = dev->CreateStream();
  const char src[8] = "abcdefg";
  EXPECT_TRUE((*stream)->CopyToDevice(**buf, 92, src, 8).ok());
  EXPECT_EQ((*stream)->CopyToDevice(**buf, 93, src, 8).code(), StatusCode::kOutOfRange);
  char back[8];
  EXPECT_TRUE((*stream)->CopyToHost(back, **buf, 92, 8).ok());
  EXPECT_STREQ(back, "abcdefg");
  int keep = 0;
  auto wrapped = dev->WrapHostMemory(&keep, sizeof(keep), nullptr);
  ASSERT_TRUE(wrapped.ok());
  EXPECT_EQ((*wrapped)->data(), &keep);
}

}  // namespace
}  // namespace kiln::backend
