// The packer, shuffler and targets of models/train/dataset.h, driven with hand-made tokenized
// examples (no model needed).
#include "models/train/dataset.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

namespace kiln::models::train {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
constexpr int32_t X = kIgnoreIndex;
constexpr int32_t P = kPadDocId;

// tokens first, first+1, ...; loss on every token after the first `prompt` ones.
Example Make(int32_t first, int n, int prompt) {
  Example ex;
  for (int i = 0; i < n; ++i) {
    ex.tokens.push_back(first + i);
    ex.loss.push_back(i >= prompt ? 1 : 0);
  }
  ex.source = "test:" + std::to_string(first);
  return ex;
}

// n examples of varied lengths (2..6); example i's first token is 1000 * (i + 1).
std::vector<Example> Many(int n) {
  std::vector<Example> v;
  for (int i = 0; i < n; ++i) v.push_back(Make(1000 * (i + 1), 2 + i % 5, 1));
  return v;
}

std::string Msg(const Status& s) { return std::string(StatusMessage(s)); }

TEST(NextTokenTargetsTest, ShiftsAndIgnoresPromptAndLastPosition) {
  Example ex = Make(10, 5, 2);  // tokens 10..14, loss on 12, 13, 14
  EXPECT_THAT(NextTokenTargets(ex), ElementsAre(X, 12, 13, 14, X));
  EXPECT_EQ(TargetCount(ex), 3);
  ex.loss = {1, 0, 0, 0, 0};  // a loss token at position 0 has nothing to predict it from
  EXPECT_THAT(NextTokenTargets(ex), ElementsAre(X, X, X, X, X));
  EXPECT_EQ(TargetCount(ex), 0);
}

TEST(DataLoaderTest, PacksExamplesIntoRowsWithDocumentIdsAndPositions) {
  std::vector<Example> ex = {Make(10, 3, 1), Make(20, 4, 2), Make(30, 2, 1), Make(40, 5, 0)};
  auto loader = DataLoader::Create(ex, {.max_seq_len = 8, .shuffle = false, .pad_token_id = 7});
  ASSERT_TRUE(loader.ok()) << loader.status();
  TrainBatch b = (*loader)->NextBatch(2);
  ASSERT_EQ(b.rows, 2);
  ASSERT_EQ(b.seq_len, 8);
  // Row 0: examples 0 (3 tokens) and 1 (4); example 2 would make 9 > 8. Row 1: examples 2, 3.
  EXPECT_THAT(b.tokens, ElementsAre(10, 11, 12, 20, 21, 22, 23, 7,  //
                                    30, 31, 40, 41, 42, 43, 44, 7));
  EXPECT_THAT(b.targets, ElementsAre(11, 12, X, X, 22, 23, X, X,  //
                                     31, X, 41, 42, 43, 44, X, X));
  EXPECT_THAT(b.positions, ElementsAre(0, 1, 2, 0, 1, 2, 3, 0,  //
                                       0, 1, 0, 1, 2, 3, 4, 0));
  EXPECT_THAT(b.doc_ids, ElementsAre(0, 0, 0, 1, 1, 1, 1, P,  //
                                     0, 0, 1, 1, 1, 1, 1, P));
  EXPECT_EQ(b.target_count, 2 + 2 + 1 + 4);
  EXPECT_EQ(b.example_count, 4);
  EXPECT_EQ((*loader)->RowsInEpoch(0), 2);
  // The next batch starts epoch 1 (unshuffled: the same rows again).
  EXPECT_EQ((*loader)->position().epoch, 0);
  TrainBatch again = (*loader)->NextBatch(2);
  EXPECT_EQ(again.tokens, b.tokens);
  EXPECT_EQ((*loader)->position().epoch, 1);
}

TEST(DataLoaderTest, WithoutPackingOneExamplePerPaddedRow) {
  std::vector<Example> ex = {Make(10, 3, 1), Make(20, 2, 1)};
  auto loader = DataLoader::Create(ex, {.max_seq_len = 4, .pack = false, .shuffle = false});
  ASSERT_TRUE(loader.ok()) << loader.status();
  TrainBatch b = (*loader)->NextBatch(3);  // the third row starts epoch 1 with example 0
  EXPECT_THAT(b.tokens, ElementsAre(10, 11, 12, 0, 20, 21, 0, 0, 10, 11, 12, 0));
  EXPECT_THAT(b.targets, ElementsAre(11, 12, X, X, 21, X, X, X, 11, 12, X, X));
  EXPECT_THAT(b.doc_ids, ElementsAre(0, 0, 0, P, 0, 0, P, P, 0, 0, 0, P));
  EXPECT_EQ(b.target_count, 5);
  EXPECT_EQ((*loader)->RowsInEpoch(7), 2);
  EXPECT_EQ((*loader)->position(), (DataPosition{1, 1, (*loader)->position().fingerprint}));
}

// First tokens of the examples of every row, in order.
std::vector<int32_t> ExampleStarts(const TrainBatch& b) {
  std::vector<int32_t> starts;
  for (size_t i = 0; i < b.tokens.size(); ++i) {
    if (b.doc_ids[i] != kPadDocId && b.positions[i] == 0) starts.push_back(b.tokens[i]);
  }
  return starts;
}

TEST(DataLoaderTest, ShuffleIsASeededPermutationPerEpoch) {
  DataOptions o{.max_seq_len = 16, .seed = 42};
  auto a = DataLoader::Create(Many(20), o);
  auto b = DataLoader::Create(Many(20), o);
  o.seed = 43;
  auto c = DataLoader::Create(Many(20), o);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  // Walk 3 epochs one row at a time; record each epoch's order.
  std::vector<std::vector<int32_t>> epochs(3);
  std::vector<int32_t> c_first;
  while ((*a)->position().epoch < 3) {
    int64_t e = (*a)->position().epoch;
    if ((*a)->position().next_example == 20) e += 1;  // this row starts the next epoch
    if (e >= 3) break;
    TrainBatch ba = (*a)->NextBatch(1), bb = (*b)->NextBatch(1);
    EXPECT_EQ(ba.tokens, bb.tokens);  // same seed, same batches
    for (int32_t s : ExampleStarts(ba)) epochs[e].push_back(s);
  }
  for (const auto& order : epochs) {
    EXPECT_EQ(std::set<int32_t>(order.begin(), order.end()).size(), 20u);  // each example once
    EXPECT_EQ(order.size(), 20u);
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
  std::vector<int32_t> sorted = epochs[0];
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(epochs[0], sorted);  // shuffled at all
  while (c_first.size() < 20) {
    for (int32_t s : ExampleStarts((*c)->NextBatch(1))) c_first.push_back(s);
  }
  EXPECT_NE(c_first, epochs[0]);  // another seed, another order
  // RowsInEpoch agrees with the rows NextBatch packed (one row per batch here).
  auto d = DataLoader::Create(Many(20), {.max_seq_len = 16, .seed = 42});
  ASSERT_TRUE(d.ok());
  for (int64_t e = 0; e < 3; ++e) {
    int64_t rows = 0;
    for (int64_t seen = 0; seen < 20; ++rows) seen += (*d)->NextBatch(1).example_count;
    EXPECT_EQ(rows, (*d)->RowsInEpoch(e)) << "epoch " << e;
  }
}

TEST(DataLoaderTest, ShuffleOrderIsPinned) {
  // SplitMix64 + Fisher-Yates is platform independent: a change to either shows up here.
  std::vector<Example> ex;
  for (int i = 0; i < 6; ++i) ex.push_back(Make(i, 2, 0));
  auto loader = DataLoader::Create(ex, {.max_seq_len = 2, .seed = 7});
  ASSERT_TRUE(loader.ok());
  TrainBatch b = (*loader)->NextBatch(6);
  // Computed independently in Python with the same SplitMix64 and Fisher-Yates (i = n-1..1,
  // j = next() % (i + 1), swap).
  EXPECT_THAT(ExampleStarts(b), ElementsAre(1, 5, 0, 2, 4, 3));
}

TEST(DataLoaderTest, ResumedRunSeesTheSameBatches) {
  DataOptions o{.max_seq_len = 12, .seed = 3};
  auto uninterrupted = DataLoader::Create(Many(13), o);
  auto first = DataLoader::Create(Many(13), o);
  ASSERT_TRUE(uninterrupted.ok() && first.ok());
  std::vector<TrainBatch> expected;
  for (int i = 0; i < 12; ++i) expected.push_back((*uninterrupted)->NextBatch(3));
  // Stop after every step count (mid-epoch and across epoch ends), resume in a new loader.
  for (int stop = 0; stop < 12; ++stop) {
    auto run = DataLoader::Create(Many(13), o);
    ASSERT_TRUE(run.ok());
    for (int i = 0; i < stop; ++i) (*run)->NextBatch(3);
    std::string saved = (*run)->position().ToString();
    auto resumed = DataLoader::Create(Many(13), o);
    ASSERT_TRUE(resumed.ok());
    auto pos = DataPosition::Parse(saved);
    ASSERT_TRUE(pos.ok()) << pos.status();
    ASSERT_TRUE((*resumed)->Seek(*pos).ok());
    for (int i = stop; i < 12; ++i) {
      TrainBatch b = (*resumed)->NextBatch(3);
      EXPECT_EQ(b.tokens, expected[i].tokens) << "stop " << stop << " step " << i;
      EXPECT_EQ(b.targets, expected[i].targets);
      EXPECT_EQ(b.doc_ids, expected[i].doc_ids);
    }
  }
  EXPECT_GE((*uninterrupted)->position().epoch, 2);  // the test crossed epoch ends
}

TEST(DataLoaderTest, SeekRejectsOtherDataOrOptions) {
  auto a = DataLoader::Create(Many(5), {.max_seq_len = 8, .seed = 1});
  auto b = DataLoader::Create(Many(6), {.max_seq_len = 8, .seed = 1});
  auto c = DataLoader::Create(Many(5), {.max_seq_len = 8, .seed = 2});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  Status s = (*b)->Seek((*a)->position());
  EXPECT_THAT(Msg(s), HasSubstr("other training data or options"));
  EXPECT_FALSE((*c)->Seek((*a)->position()).ok());
  DataPosition far = (*a)->position();
  far.next_example = 6;
  EXPECT_THAT(Msg((*a)->Seek(far)), HasSubstr("out of range"));
}

TEST(DataPositionTest, RoundTripsAndRejectsGarbage) {
  DataPosition p{.epoch = 3, .next_example = 17, .fingerprint = 0xfedcba9876543210ull};
  EXPECT_EQ(p.ToString(), "epoch=3 next_example=17 fingerprint=fedcba9876543210");
  auto back = DataPosition::Parse(p.ToString());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, p);
  for (const char* bad : {"", "epoch=1", "epoch=-1 next_example=0 fingerprint=0",
                          "epoch=1 next_example=2 fingerprint=3 extra"}) {
    EXPECT_FALSE(DataPosition::Parse(bad).ok()) << bad;
  }
}

TEST(DataLoaderTest, OnePassKeepsFileOrderAndEndsWithAShortBatch) {
  std::vector<Example> ex = {Make(10, 4, 1), Make(20, 4, 1), Make(30, 4, 1), Make(40, 4, 1),
                             Make(50, 4, 1)};
  auto loader = DataLoader::Create(ex, {.max_seq_len = 4, .seed = 9});  // shuffle ignored
  ASSERT_TRUE(loader.ok());
  std::vector<TrainBatch> batches = (*loader)->OnePass(2);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[2].rows, 1);
  EXPECT_EQ(batches[2].tokens.size(), 4u);
  std::vector<int32_t> starts;
  int64_t targets = 0;
  for (const TrainBatch& b : batches) {
    for (int32_t s : ExampleStarts(b)) starts.push_back(s);
    targets += b.target_count;
  }
  EXPECT_THAT(starts, ElementsAre(10, 20, 30, 40, 50));
  EXPECT_EQ(targets, 5 * 3);
  EXPECT_EQ((*loader)->position().next_example, 0);  // training position untouched
}

TEST(DataLoaderTest, CreateRejectsBadExamples) {
  EXPECT_THAT(Msg(DataLoader::Create({}, {}).status()), HasSubstr("no training examples"));
  EXPECT_THAT(Msg(DataLoader::Create({Make(1, 9, 1)}, {.max_seq_len = 8}).status()),
              HasSubstr("test:1: example has 9 tokens; more than max_seq_len 8"));
  EXPECT_THAT(Msg(DataLoader::Create({Make(1, 3, 3)}, {.max_seq_len = 8}).status()),
              HasSubstr("no token to train on"));
  Example bad = Make(1, 3, 1);
  bad.loss.pop_back();
  EXPECT_THAT(Msg(DataLoader::Create({bad}, {.max_seq_len = 8}).status()),
              HasSubstr("loss mask has 2 entries for 3 tokens"));
  EXPECT_THAT(Msg(DataLoader::Create({Example{}}, {.max_seq_len = 8}).status()),
              HasSubstr("no tokens"));
}

}  // namespace
}  // namespace kiln::models::train
