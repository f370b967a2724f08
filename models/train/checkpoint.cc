#include "models/train/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "models/io/durable_file.h"
#include "models/io/errors.h"

#ifndef KILN_VERSION
#define KILN_VERSION "0.0.0"
#endif

namespace kiln::models {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr std::string_view kPrefix = "checkpoint-";
constexpr const char* kStateFile = "trainer_state.json";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kFormat = "kiln-checkpoint";
constexpr int kFormatVersion = 1;

std::vector<std::string> FilesOf(bool lora) {
  if (lora) return {"adapter_config.json", "adapter_model.safetensors", kOptimizerFile, kStateFile};
  return {"config.json", "model.safetensors", kOptimizerFile, kStateFile};
}

// "checkpoint-000120" -> 120; -1 for any other name.
int64_t StepOfName(std::string_view name) {
  if (!name.starts_with(kPrefix) || name.size() == kPrefix.size()) return -1;
  int64_t step = 0;
  for (char c : name.substr(kPrefix.size())) {
    if (c < '0' || c > '9' || step > (INT64_MAX - 9) / 10) return -1;
    step = step * 10 + (c - '0');
  }
  return step;
}

Status CheckTensors(const CheckpointTensors& tensors, std::string_view what) {
  for (const auto& [name, t] : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return InvalidArgument(what, " tensor \"", name, "\" has a negative dimension");
      n *= d;
    }
    if (n != static_cast<int64_t>(t.data.size())) {
      return InvalidArgument(what, " tensor \"", name, "\" has ", t.data.size(),
                             " values but its shape holds ", n);
    }
  }
  return OkStatus();
}

Status WriteTensors(const std::string& path, const CheckpointTensors& tensors,
                    SafetensorsDtype dtype) {
  SafetensorsWriter w;
  w.SetMetadata("format", "pt");
  for (const auto& [name, t] : tensors) {
    KILN_RETURN_IF_ERROR(w.AddFloats(name, t.shape, t.data.data(), t.data.size(), dtype));
  }
  return w.WriteFile(path);
}

StatusOr<CheckpointTensors> ReadTensors(const std::string& path,
                                        SafetensorsDtype* first_dtype = nullptr) {
  KILN_ASSIGN_OR_RETURN(auto st, SafetensorsFile::Open(path));
  CheckpointTensors out;
  for (const SafetensorsTensor& t : st->tensors()) {
    CheckpointTensor& ct = out[t.name];
    ct.shape = t.shape;
    KILN_ASSIGN_OR_RETURN(ct.data, SafetensorsToFloats(t));
    if (first_dtype != nullptr && out.size() == 1) *first_dtype = t.dtype;
  }
  return out;
}

json StateJson(const TrainerState& s, bool lora, bool qk_rows_permuted) {
  json losses = json::array();
  for (const LossRecord& l : s.losses) {
    losses.push_back({{"step", l.step}, {"loss", std::isfinite(l.loss) ? json(l.loss) : json()}});
  }
  return {{"format", kFormat},
          {"format_version", kFormatVersion},
          {"kind", lora ? "lora" : "full"},
          {"files", FilesOf(lora)},
          {"step", s.step},
          {"epoch", s.epoch},
          {"data_position", s.data_position},
          {"rng_state", s.rng_state},
          {"losses", losses},
          {"options", s.options},
          {"kiln_version", KILN_VERSION},
          // The optimizer state of q/k lora_B is in the model's row order (not converted like
          // the adapter), so resuming needs a model with the same order.
          {"qk_rows_permuted", qk_rows_permuted}};
}

StatusOr<json> ReadJsonFile(const std::string& path) {
  KILN_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path));
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    return InvalidArgument(path, ": not valid JSON (truncated?): ", e.what());
  }
}

// Parses trainer_state.json; `kind_lora` says which files go with it.
StatusOr<TrainerState> ParseState(const std::string& path, const json& j, bool& kind_lora) {
  if (!j.is_object() || j.value("format", "") != kFormat) {
    return InvalidArgument(path, ": not a Kiln trainer state (\"format\" must be \"", kFormat,
                           "\")");
  }
  if (j.value("format_version", 0) != kFormatVersion) {
    return InvalidArgument(path, ": format_version ", j.value("format_version", json()).dump(),
                           " is not supported (this Kiln reads version ", kFormatVersion, ")");
  }
  const std::string kind = j.value("kind", "");
  if (kind != "lora" && kind != "full") {
    return InvalidArgument(path, ": \"kind\" must be \"lora\" or \"full\", got \"", kind, "\"");
  }
  kind_lora = kind == "lora";
  TrainerState s;
  try {
    s.step = j.at("step").get<int64_t>();
    s.epoch = j.at("epoch").get<double>();
    s.data_position = j.at("data_position");
    s.rng_state = j.at("rng_state").get<std::string>();
    s.options = j.at("options");
    s.kiln_version = j.at("kiln_version").get<std::string>();
    for (const json& l : j.at("losses")) {
      s.losses.push_back(
          {l.at("step").get<int64_t>(), l.at("loss").is_null() ? NAN : l.at("loss").get<double>()});
    }
  } catch (const json::exception& e) {
    return InvalidArgument(path, ": ", e.what());
  }
  return s;
}

// Why `dir` is not a complete checkpoint of step `step`, or OK.
Status CheckComplete(const std::string& dir, int64_t step) {
  const std::string state_path = Cat(dir, "/", kStateFile);
  KILN_ASSIGN_OR_RETURN(json j, ReadJsonFile(state_path));
  bool lora;
  KILN_ASSIGN_OR_RETURN(TrainerState s, ParseState(state_path, j, lora));
  if (s.step != step) {
    return InvalidArgument(state_path, ": step is ", s.step, " but the directory is for step ",
                           step);
  }
  for (const std::string& f : FilesOf(lora)) {
    const std::string path = Cat(dir, "/", f);
    if (f.ends_with(".safetensors")) {
      KILN_RETURN_IF_ERROR(SafetensorsFile::Open(path).status());
    } else if (f != kStateFile) {
      KILN_RETURN_IF_ERROR(ReadJsonFile(path).status());
    }
  }
  return OkStatus();
}

// Replaces `to` (which may exist) by `from` atomically where the kernel allows.
Status RenameIntoPlace(const std::string& from, const std::string& to) {
  std::error_code ec;
  if (!fs::exists(to, ec)) {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return Internal("cannot rename ", from, " to ", to, ": ", std::strerror(errno));
    }
    return OkStatus();
  }
  // Swap the two directories in one step; `from` then holds the old checkpoint.
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(from, ec);
    return OkStatus();
  }
  if (errno != EINVAL && errno != ENOSYS) {
    return Internal("cannot exchange ", from, " and ", to, ": ", std::strerror(errno));
  }
  // A file system without RENAME_EXCHANGE: move the old one aside first. A crash between the
  // two renames leaves the previous step's checkpoint as the latest.
  const std::string old = from + ".old";
  fs::remove_all(old, ec);
  if (::rename(to.c_str(), old.c_str()) != 0 || ::rename(from.c_str(), to.c_str()) != 0) {
    return Internal("cannot replace ", to, " with ", from, ": ", std::strerror(errno));
  }
  fs::remove_all(old, ec);
  return OkStatus();
}

}  // namespace

std::string CheckpointDir(const std::string& out, int64_t step) {
  char digits[32];
  std::snprintf(digits, sizeof(digits), "%06lld", static_cast<long long>(step));
  return Cat(out, "/", kPrefix, digits);
}

StatusOr<std::string> WriteCheckpoint(const std::string& out, const Checkpoint& ckpt,
                                      const PeftBaseModel& base, const CheckpointOptions& options) {
  const int64_t step = ckpt.state.step;
  if (step < 0) return InvalidArgument("checkpoint step must be >= 0, got ", step);
  if (ckpt.adapter.has_value() == ckpt.model.has_value()) {
    return InvalidArgument("a checkpoint holds either a LoRA adapter or full model weights, ",
                           ckpt.adapter ? "not both" : "got neither");
  }
  KILN_RETURN_IF_ERROR(CheckTensors(ckpt.optimizer, "optimizer state"));
  if (ckpt.model) {
    KILN_RETURN_IF_ERROR(CheckTensors(ckpt.model->tensors, "model"));
    const SafetensorsDtype d = ckpt.model->dtype;
    if (d != SafetensorsDtype::kF32 && d != SafetensorsDtype::kBF16 &&
        d != SafetensorsDtype::kF16) {
      return InvalidArgument("model weights are stored as F32, BF16 or F16, not ",
                             SafetensorsDtypeName(d));
    }
  }

  std::error_code ec;
  if (!fs::exists(out, ec)) {
    fs::create_directories(out, ec);
    if (ec) return Internal(out, ": cannot create the output directory: ", ec.message());
    const fs::path parent = fs::absolute(fs::path(out)).parent_path();
    KILN_RETURN_IF_ERROR(FsyncDirectory(parent.string()));
  }
  const std::string final_dir = CheckpointDir(out, step);
  const std::string name = final_dir.substr(out.size() + 1);
  const std::string tmp = Cat(out, "/.", name, ".tmp");
  fs::remove_all(tmp, ec);  // a leftover of an interrupted write
  if (!fs::create_directory(tmp, ec) || ec) {
    return Internal(tmp, ": cannot create: ", ec ? ec.message() : "already exists");
  }
  Status written = [&]() -> Status {
    if (ckpt.adapter) {
      KILN_RETURN_IF_ERROR(WritePeftAdapter(tmp, *ckpt.adapter, base));
    } else {
      KILN_RETURN_IF_ERROR(
          WriteTensors(tmp + "/model.safetensors", ckpt.model->tensors, ckpt.model->dtype));
      KILN_RETURN_IF_ERROR(
          WriteFileDurably(tmp + "/config.json", ckpt.model->config.dump(2) + "\n"));
    }
    KILN_RETURN_IF_ERROR(
        WriteTensors(Cat(tmp, "/", kOptimizerFile), ckpt.optimizer, SafetensorsDtype::kF32));
    KILN_RETURN_IF_ERROR(WriteFileDurably(
        Cat(tmp, "/", kStateFile),
        StateJson(ckpt.state, ckpt.adapter.has_value(), base.qk_rows_permuted).dump(1)));
    KILN_RETURN_IF_ERROR(FsyncDirectory(tmp));
    KILN_RETURN_IF_ERROR(RenameIntoPlace(tmp, final_dir));
    return FsyncDirectory(out);
  }();
  if (!written.ok()) {
    fs::remove_all(tmp, ec);
    return written;
  }

  if (options.keep_last > 0) {
    std::vector<std::pair<int64_t, std::string>> complete;
    for (const fs::directory_entry& e : fs::directory_iterator(out, ec)) {
      const int64_t s = StepOfName(e.path().filename().string());
      if (s >= 0 && s != step && e.is_directory(ec) && CheckComplete(e.path().string(), s).ok()) {
        complete.emplace_back(s, e.path().string());
      }
    }
    std::sort(complete.rbegin(), complete.rend());  // newest first
    bool removed = false;
    for (size_t i = options.keep_last - 1; i < complete.size(); ++i) {
      fs::remove_all(complete[i].second, ec);
      removed = true;
    }
    if (removed) KILN_RETURN_IF_ERROR(FsyncDirectory(out));
  }
  return final_dir;
}

StatusOr<FoundCheckpoint> FindLatestCheckpoint(const std::string& out) {
  FoundCheckpoint found;
  std::error_code ec;
  if (!fs::exists(out, ec)) return found;
  std::vector<std::pair<int64_t, std::string>> candidates;
  fs::directory_iterator it(out, ec);
  if (ec) return Internal(out, ": cannot list the checkpoint directory: ", ec.message());
  for (const fs::directory_entry& e : it) {
    const std::string name = e.path().filename().string();
    if (name.starts_with(Cat(".", kPrefix)) &&
        (name.ends_with(".tmp") || name.ends_with(".tmp.old"))) {
      found.skipped.push_back(Cat(e.path().string(), ": left over from an interrupted write"));
      continue;
    }
    const int64_t step = StepOfName(name);
    if (step >= 0 && e.is_directory(ec)) candidates.emplace_back(step, e.path().string());
  }
  std::sort(candidates.rbegin(), candidates.rend());
  for (const auto& [step, dir] : candidates) {
    Status s = CheckComplete(dir, step);
    if (s.ok()) {
      found.dir = dir;
      found.step = step;
      break;
    }
    found.skipped.push_back(Cat(dir, ": incomplete, skipped: ", StatusMessage(s)));
  }
  std::sort(found.skipped.begin(), found.skipped.end());
  return found;
}

StatusOr<Checkpoint> LoadCheckpoint(const std::string& dir, const PeftBaseModel& base) {
  const std::string state_path = Cat(dir, "/", kStateFile);
  KILN_ASSIGN_OR_RETURN(json j, ReadJsonFile(state_path));
  bool lora;
  Checkpoint c;
  KILN_ASSIGN_OR_RETURN(c.state, ParseState(state_path, j, lora));
  if (lora) {
    if (j.value("qk_rows_permuted", base.qk_rows_permuted) != base.qk_rows_permuted) {
      return FailedPrecondition(
          state_path, ": this checkpoint was trained on a model with ",
          base.qk_rows_permuted ? "Hugging Face's" : "llama.cpp's (GGUF)",
          " q/k row order, but the model given has ",
          base.qk_rows_permuted ? "llama.cpp's (GGUF)" : "Hugging Face's",
          "; its optimizer state would not line up (resume on the same model file, or load "
          "only the adapter with ReadPeftAdapter)");
    }
    KILN_ASSIGN_OR_RETURN(c.adapter, ReadPeftAdapter(dir, base));
  } else {
    FullModelWeights m;
    KILN_ASSIGN_OR_RETURN(m.tensors, ReadTensors(dir + "/model.safetensors", &m.dtype));
    KILN_ASSIGN_OR_RETURN(m.config, ReadJsonFile(dir + "/config.json"));
    c.model = std::move(m);
  }
  KILN_ASSIGN_OR_RETURN(c.optimizer, ReadTensors(Cat(dir, "/", kOptimizerFile)));
  return c;
}

}  // namespace kiln::models
