// Loading a generative model for serving: the entry point kilnd's repository calls for
// `kind: llm` models (scheduler/model.h's LlmLoader).
#pragma once

#include <memory>
#include <vector>

#include "config/config.h"
#include "engine/base/metrics.h"
#include "engine/dtype.h"
#include "models/llm/llm_model.h"

namespace kiln::models {

class PagedLlm;
struct PagedLlmParts;

// Opens `config.path` (a GGUF file, or a Hugging Face folder with config.json and
// safetensors), picks the architecture from its metadata, loads tokenizer and chat template,
// maps the weights (zero-copy where the dtype allows), and compiles the step program on
// `config.backend` with `config.threads` threads; `config.context_length` (if > 0) caps the
// context. Errors name the file and what is wrong or unsupported (unknown architecture,
// missing or mis-shaped tensors, unsupported tensor types).
StatusOr<std::unique_ptr<LlmModel>> LoadLlm(const config::ModelConfig& config);

// Settings beyond the configuration file (the server, tools and tests).
struct LlmLoadOptions {
  // Where the compiler adds kiln_compile_* (kernels compiled / reused / cached, seconds);
  // not owned; null: none.
  metrics::Registry* metrics = nullptr;
  // A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) applied
  // to every step; empty: none. Errors name a mismatch with the model.
  std::string adapter;
};

StatusOr<std::unique_ptr<LlmModel>> LoadLlm(const config::ModelConfig& config,
                                            const LlmLoadOptions& options);

// The device of a model entry: `config.backend` ("cpu": a backend of the model's own with
// `config.threads` threads and the configured activations; "ref"; else a registered device,
// registering xpu and cuda on first use). InvalidArgument for bad activations, NotFound for
// an unknown device.
struct ModelDevice {
  std::unique_ptr<backend::Backend> backend;  // null when the device belongs to the registry
  backend::Device* device = nullptr;
};
StatusOr<ModelDevice> OpenModelDevice(const config::ModelConfig& config);

// What LoadLlm opens before it compiles anything: the files, architecture, hyper-parameters,
// tokenizer, chat template and device (the trainer builds its own graphs from these).
StatusOr<PagedLlmParts> OpenLlmParts(const config::ModelConfig& config);

// LoadLlm with options, returning the concrete model (models/llm/paged_llm.h) for
// introspection: hyper-parameters, the compiled program, weight bytes, captures.
StatusOr<std::unique_ptr<PagedLlm>> LoadPagedLlm(const config::ModelConfig& config,
                                                 const LlmLoadOptions& options = {});

// Every opened device of every registered backend (backend::Registry::Global()): what the
// server's device memory metrics (scheduler/device_metrics.h) look at. A GPU no model has
// opened is left closed.
std::vector<backend::Device*> RegisteredDevices();

}  // namespace kiln::models
