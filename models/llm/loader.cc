#include "models/llm/loader.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "backends/builtin.h"
#include "backends/registry.h"
#include "models/arch/arch.h"
#include "models/io/errors.h"
#include "models/llm/model_files.h"
#include "models/llm/paged_llm.h"
#include "models/lora/peft_io.h"
#include "spdlog/spdlog.h"

namespace kiln::models {
namespace {

bool IsCausalLmClass(std::string_view name) {
  auto ends = [&](std::string_view s) {
    return name.size() >= s.size() && name.substr(name.size() - s.size()) == s;
  };
  return ends("ForCausalLM") || ends("LMHeadModel");
}

// The architecture of the files, or an error listing what is supported.
StatusOr<const Architecture*> PickArchitecture(const ModelFiles& files) {
  const bool gguf = files.is_gguf();
  const Architecture* arch = FindArchitecture(files.architecture(), gguf);
  if (arch == nullptr) {
    return InvalidArgument(gguf ? files.path() : files.hf()->config.path, ": architecture '",
                           files.architecture(), "' (",
                           gguf ? "general.architecture" : "model_type",
                           ") is not supported; supported: ", SupportedArchitectures(gguf));
  }
  if (!gguf) {
    const auto& classes = files.hf()->config.architectures;
    if (!classes.empty() && std::none_of(classes.begin(), classes.end(), IsCausalLmClass)) {
      return InvalidArgument(files.hf()->config.path, ": \"architectures\" lists ", classes.front(),
                             ", not a causal language model (*ForCausalLM / *LMHeadModel)");
    }
  }
  return arch;
}

// The `kv_cache_dtype` setting as an engine type (the config validated the name).
StatusOr<DType> KvCacheDType(const std::string& name) {
  if (name == "f32") return DType::kF32;
  if (name == "f16") return DType::kF16;
  if (name == "bf16") return DType::kBF16;
  return InvalidArgument("kv_cache_dtype: ", name, " is not one of f32, f16, bf16");
}

}  // namespace

// Where the model's kernels run: a cpu backend of its own (so `threads` applies to this model
// only), the reference backend, or a device from the registry.
StatusOr<ModelDevice> OpenModelDevice(const config::ModelConfig& config) {
  ModelDevice parts;
  const std::string& name = config.backend.empty() ? std::string("cpu") : config.backend;
  if (std::find(std::begin(config::kActivationNames), std::end(config::kActivationNames),
                config.activations) == std::end(config::kActivationNames)) {
    std::string names;
    for (std::string_view n : config::kActivationNames) {
      names += (names.empty() ? "" : ", ") + std::string(n);
    }
    return InvalidArgument("activations: ", config.activations, " is not one of ", names);
  }
  if (name == "cpu" || name == "cpu:0") {
    parts.backend =
        backend::MakeCpuBackend(config.threads, {.q8_activations = config.activations == "q8",
                                                 .bf16_activations = config.activations == "bf16"});
    parts.device = parts.backend->device(0);
    return parts;
  }
  if (config.activations != "f32") {
    return InvalidArgument("activations: ", config.activations,
                           " is implemented by the cpu backend only (this model runs on ", name,
                           ")");
  }
  if (name == "ref" || name == "ref:0") {
    parts.backend = backend::MakeRefBackend();
  }
  if (parts.backend) {
    parts.device = parts.backend->device(0);
    return parts;
  }
  backend::Registry& registry = backend::Registry::Global();
  // The OpenCL backend is registered on first use: probing OpenCL platforms costs every process
  // that never asks for it.
  if ((name == "xpu" || name.rfind("xpu:", 0) == 0) && registry.Find("xpu") == nullptr) {
    if (std::unique_ptr<backend::Backend> xpu = backend::MakeXpuBackend()) {
      (void)registry.Register(std::move(xpu));  // AlreadyExists if another load won the race
    }
  }
  // Other backends (cuda, hip) are plugins, autoloaded where their folder is found
  // (registry.h); loaded here from the build tree or when autoload is off. A plugin that is
  // there but cannot serve says why; without one, GetDevice lists what is registered.
  const std::string family = name.substr(0, name.find(':'));
  if (registry.Find(family) == nullptr) {
    StatusOr<std::unique_ptr<backend::Backend>> b =
        backend::Registry::LoadBackendFromPlugin(family);
    if (b.ok()) {
      (void)registry.Register(*std::move(b));  // AlreadyExists if another load won the race
    } else if (b.status().code() != StatusCode::kNotFound) {
      return Status(b.status().code(), absl::StrCat("backend '", family, "' is not available: ",
                                                    ToAbsl(StatusMessage(b.status()))));
    }
  }
  KILN_ASSIGN_OR_RETURN(parts.device, registry.GetDevice(name));
  return parts;
}

StatusOr<PagedLlmParts> OpenLlmParts(const config::ModelConfig& config) {
  if (config.path.empty()) {
    return InvalidArgument(
        "`path` is required for a model of kind llm (a GGUF file or a Hugging "
        "Face folder)");
  }
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<ModelFiles> files, ModelFiles::Open(config.path));
  KILN_ASSIGN_OR_RETURN(const Architecture* arch, PickArchitecture(*files));

  PagedLlmParts parts;
  parts.arch = arch;
  if (files->is_gguf()) {
    KILN_ASSIGN_OR_RETURN(parts.hparams, arch->from_gguf(*files->gguf(), files->architecture()));
    KILN_ASSIGN_OR_RETURN(parts.tokenizer, Tokenizer::FromGguf(*files->gguf()));
  } else {
    KILN_ASSIGN_OR_RETURN(parts.hparams, arch->from_hf(files->hf()->config, files->architecture()));
    KILN_RETURN_IF_ERROR(files->IndexSafetensors(arch->hf_naming(), parts.hparams.num_layers));
    if (files->hf()->tokenizer_json_path.empty()) {
      return InvalidArgument("model folder '", config.path,
                             "' has no tokenizer.json (Kiln reads the fast-tokenizer format)");
    }
    KILN_ASSIGN_OR_RETURN(parts.tokenizer, Tokenizer::FromHfFolder(*files->hf()));
  }
  if (!config.attention.empty()) {
    ApplyAttentionConfig(config.attention, parts.hparams);
    spdlog::info("{}: attention from the config: mask {}, score {}", config.path,
                 config.attention.mask.empty() ? "(the model's)" : config.attention.mask,
                 config.attention.score.empty() ? "(the model's)" : config.attention.score);
  }
  const LlmHParams& hp = parts.hparams;
  if (parts.tokenizer->vocab_size() > hp.vocab_size) {
    return InvalidArgument(files->weights_path(), ": the tokenizer has ",
                           parts.tokenizer->vocab_size(), " tokens but the model only ",
                           hp.vocab_size, " embedding rows");
  }

  // Chat template: a model without one (or with one Kiln cannot parse) still serves plain
  // completions; chat requests are then refused.
  StatusOr<std::unique_ptr<ChatTemplate>> tmpl = files->is_gguf()
                                                     ? ChatTemplate::FromGguf(*files->gguf())
                                                     : ChatTemplate::FromHfFolder(*files->hf());
  if (tmpl.ok()) {
    parts.chat_template = *std::move(tmpl);
  } else if (!absl::IsNotFound(tmpl.status())) {
    spdlog::warn("{}: the chat template is not usable, chat requests will be refused: {}",
                 config.path, StatusMessage(tmpl.status()));
  }

  LlmModelInfo& info = parts.info;
  info.architecture = hp.architecture;
  info.name = files->DisplayModelName();
  info.vocab_size = static_cast<int32_t>(hp.vocab_size);
  info.num_layers = static_cast<int32_t>(hp.num_layers);
  info.num_heads = static_cast<int32_t>(hp.num_heads);
  info.num_kv_heads = static_cast<int32_t>(hp.num_kv_heads);
  info.head_dim = static_cast<int32_t>(hp.head_dim);
  info.context_length = static_cast<int32_t>(std::min<int64_t>(hp.context_length, 1 << 30));
  if (config.context_length > 0) {
    if (config.context_length <= info.context_length) {
      info.context_length = config.context_length;
    } else {
      spdlog::warn("{}: context_length {} is more than the model's {}; using {}", config.path,
                   config.context_length, info.context_length, info.context_length);
    }
  }
  if (parts.chat_template) info.chat_template = parts.chat_template->source();
  // End of generation: the tokenizer's EOS and end-of-turn tokens, plus generation_config's.
  info.eos_token_ids = parts.tokenizer->eog_ids();
  if (!files->is_gguf() && files->hf()->generation_config) {
    for (int32_t id : files->hf()->generation_config->eos_token_ids) {
      if (id >= 0 && id < info.vocab_size) info.eos_token_ids.push_back(id);
    }
  }
  std::sort(info.eos_token_ids.begin(), info.eos_token_ids.end());
  info.eos_token_ids.erase(std::unique(info.eos_token_ids.begin(), info.eos_token_ids.end()),
                           info.eos_token_ids.end());

  KILN_ASSIGN_OR_RETURN(ModelDevice device, OpenModelDevice(config));
  parts.backend = std::move(device.backend);
  parts.device = device.device;
  parts.files = std::move(files);
  return parts;
}

namespace {

StatusOr<std::unique_ptr<PagedLlm>> Load(const config::ModelConfig& config,
                                         const LlmLoadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  KILN_ASSIGN_OR_RETURN(PagedLlmParts parts, OpenLlmParts(config));
  KILN_RETURN_IF_ERROR(FuseProjections(parts));
  PagedLlmOptions opts;
  opts.max_num_seqs = config.scheduler.max_num_seqs;
  opts.max_num_batched_tokens = config.scheduler.max_num_batched_tokens;
  opts.block_size = config.scheduler.block_size;
  opts.capture_batch_sizes = config.scheduler.capture_batch_sizes;
  KILN_ASSIGN_OR_RETURN(opts.kv_dtype, KvCacheDType(config.kv_cache_dtype));
  opts.sample_on_device = config.sampling == "device";
  opts.metrics = options.metrics;
  opts.max_adapters = config.max_loaded_adapters;
  opts.max_lora_rank = config.max_lora_rank;
  if (!options.adapter.empty()) {
    opts.max_adapters = 0;  // one adapter for every sequence: slot 0 (PagedLlmOptions::adapter)
    KILN_ASSIGN_OR_RETURN(
        LoraAdapter adapter,
        ReadPeftAdapter(options.adapter, PeftBaseModel::FromHParams(parts.hparams, config.path)));
    opts.adapter = std::make_shared<const LoraAdapter>(std::move(adapter));
  }
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<PagedLlm> model, PagedLlm::Create(std::move(parts), opts));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const LlmHParams& loaded = model->hparams();
  spdlog::info(
      "loaded {} ({}, {} layers, {} heads / {} KV heads, vocab {}, context {}) from {} on {} in "
      "{:.2f} s: {:.1f} MiB of weights ({:.1f} MiB mapped), {} launches per step",
      model->info().name, loaded.architecture, loaded.num_layers, loaded.num_heads,
      loaded.num_kv_heads, loaded.vocab_size, model->info().context_length, config.path,
      model->device().name(), seconds, model->weight_bytes() / 1048576.0,
      model->mapped_weight_bytes() / 1048576.0, model->program().num_launches());
  return model;
}

}  // namespace

StatusOr<std::unique_ptr<PagedLlm>> LoadPagedLlm(const config::ModelConfig& config,
                                                 const LlmLoadOptions& options) {
  StatusOr<std::unique_ptr<PagedLlm>> m = Load(config, options);
  if (!m.ok() && !config.name.empty()) {
    return Annotate(m.status(), Cat("model '", config.name, "'"));
  }
  return m;
}

StatusOr<std::unique_ptr<LlmModel>> LoadLlm(const config::ModelConfig& config,
                                            const LlmLoadOptions& options) {
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<PagedLlm> m, LoadPagedLlm(config, options));
  return std::unique_ptr<LlmModel>(std::move(m));
}

StatusOr<std::unique_ptr<LlmModel>> LoadLlm(const config::ModelConfig& config) {
  return LoadLlm(config, LlmLoadOptions());
}

std::vector<backend::Device*> RegisteredDevices() {
  std::vector<backend::Device*> devices;
  for (backend::Backend* b : backend::Registry::Global().backends()) {
    for (int i = 0; i < b->device_count(); ++i) {
      if (b->opened(i)) devices.push_back(b->device(i));  // never opens a GPU for a report
    }
  }
  return devices;
}

}  // namespace kiln::models
