// Training checkpoints: what a fine-tuning job needs to resume after a crash, in files other
// tools read (PEFT's adapter layout, Hugging Face's model layout, safetensors).
//
//   <out>/checkpoint-000120/
//     adapter_config.json, adapter_model.safetensors   LoRA (models/lora/peft_io.h), or
//     config.json, model.safetensors                   full fine-tuning (Hugging Face layout)
//     optimizer.safetensors    optimizer state by name ("blk.3.attn_q.weight.lora_A.m"), f32
//     trainer_state.json       step, epoch, data position, RNG state, losses, options, version
//
// Writes are atomic: everything goes into <out>/.checkpoint-000120.tmp/, every file and then
// the directory are fsync'ed, the directory is renamed into place (swapped with an existing
// checkpoint of the same step by renameat2(RENAME_EXCHANGE), so a reader sees the old or the
// new one, never neither or a mix) and <out> is fsync'ed. A crash leaves at worst a .tmp
// directory, which FindLatestCheckpoint reports and skips and the next write of that step
// removes.
//
//   KILN_ASSIGN_OR_RETURN(FoundCheckpoint found, FindLatestCheckpoint(out));
//   for (const std::string& why : found.skipped) spdlog::warn("{}", why);
//   if (!found.dir.empty()) {
//     KILN_ASSIGN_OR_RETURN(Checkpoint c, LoadCheckpoint(found.dir, base));  // resume from c
//   }
//   ...
//   KILN_ASSIGN_OR_RETURN(std::string dir, WriteCheckpoint(out, ckpt, base, {.keep_last = 3}));
//
// Thread-safety: free functions. One writer per <out> directory at a time (a job owns its
// output directory); readers may run concurrently with a writer.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/base/status.h"
#include "models/lora/lora_config.h"
#include "models/lora/peft_io.h"
#include "models/safetensors/safetensors.h"

namespace kiln::models {

// A named f32 tensor: optimizer state, or a weight of a fully fine-tuned model.
struct CheckpointTensor {
  std::vector<int64_t> shape;  // row-major, outermost first
  std::vector<float> data;     // product(shape) values
};
using CheckpointTensors = std::map<std::string, CheckpointTensor>;

struct LossRecord {
  int64_t step = 0;
  double loss = 0;  // non-finite losses are stored as null and read back as NaN
};

struct TrainerState {
  int64_t step = 0;  // optimizer steps completed; names the directory
  double epoch = 0;  // epochs completed, fractional
  // Where the data loader resumes: an object the trainer defines; stored as given.
  nlohmann::json data_position = nlohmann::json::object();
  std::string rng_state;           // the trainer's RNG state, opaque text
  std::vector<LossRecord> losses;  // losses so far
  // The job's training options as given (hyper-parameters, schedule); stored as given.
  nlohmann::json options = nlohmann::json::object();
  // Set by WriteCheckpoint to the version of the Kiln that wrote it; read back as stored.
  std::string kiln_version;
};

// The weights of a fully fine-tuned model, in Hugging Face's layout and names
// ("model.layers.0.self_attn.q_proj.weight", q/k rows in Hugging Face order: see
// GgufToHfQkRows in models/lora/peft_io.h), so that transformers loads the directory.
struct FullModelWeights {
  CheckpointTensors tensors;
  nlohmann::json config = nlohmann::json::object();  // config.json
  // How model.safetensors stores the weights: kF32, kBF16 or kF16. On load: the file's dtype
  // (of its first tensor); the values are converted to f32.
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
};

struct Checkpoint {
  TrainerState state;
  // Exactly one of these two.
  std::optional<LoraAdapter> adapter;     // LoRA fine-tuning
  std::optional<FullModelWeights> model;  // full fine-tuning
  // Optimizer state by name, e.g. "blk.3.attn_q.weight.lora_A.m"; may be empty. Stored as
  // given: rows in the model's order (q/k rows are not converted as the adapter's are).
  CheckpointTensors optimizer;
};

struct CheckpointOptions {
  // After a successful write, delete all but the newest `keep_last` complete checkpoints
  // (by step; the one just written is always kept). 0 keeps every checkpoint.
  int keep_last = 0;
};

// "<out>/checkpoint-000120": the step with at least 6 digits.
std::string CheckpointDir(const std::string& out, int64_t step);

// Writes `ckpt` atomically as CheckpointDir(out, ckpt.state.step), creating `out` if needed
// and replacing a checkpoint of the same step; returns its path. `base` describes the model a
// LoRA adapter belongs to (unused for full fine-tuning). InvalidArgument, before anything is
// written, for a negative step, not exactly one of adapter/model, a tensor whose data does not
// match its shape, or an adapter that does not fit `base`; Internal or NotFound for I/O
// errors, naming the path.
StatusOr<std::string> WriteCheckpoint(const std::string& out, const Checkpoint& ckpt,
                                      const PeftBaseModel& base,
                                      const CheckpointOptions& options = {});

struct FoundCheckpoint {
  std::string dir;    // the newest complete checkpoint; empty if there is none
  int64_t step = -1;  // its step
  // One line per directory passed over, for the caller to log: leftovers of interrupted
  // writes (".checkpoint-000130.tmp") and newer checkpoints that are incomplete or unreadable,
  // each with the reason ("<out>/checkpoint-000130: trainer_state.json: no such file").
  std::vector<std::string> skipped;
};

// Finds the newest complete checkpoint under `out`: every file its trainer_state.json lists is
// present and parses (JSON files as JSON, safetensors headers and sizes), and the step in
// trainer_state.json matches the directory name. A missing or empty `out` gives an empty
// `dir` (start from scratch); only an unreadable `out` is an error.
StatusOr<FoundCheckpoint> FindLatestCheckpoint(const std::string& out);

// Reads a checkpoint directory. Errors name the file and what was expected (a truncated
// safetensors file, a missing key in trainer_state.json, an adapter that does not fit `base`).
// FailedPrecondition for a LoRA checkpoint written with a different `base.qk_rows_permuted`:
// the optimizer state is kept in the model's row order, so it resumes only on a model with the
// same order (ReadPeftAdapter still reads its adapter on either).
StatusOr<Checkpoint> LoadCheckpoint(const std::string& dir, const PeftBaseModel& base);

}  // namespace kiln::models
