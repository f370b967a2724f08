#include "backends/common/testing/kernel_set.h"

#include <cstring>
#include <filesystem>
#include <span>

#include "backends/host/host_device.h"
#include "config/config.h"
#include "engine/compiler/compile.h"
#include "engine/compiler/testing/llama_graph.h"
#include "engine/testing/op_harness.h"
#include "models/io/test_paths.h"
#include "models/llm/loader.h"
#include "models/train/trainer.h"

namespace kiln::devk::testing {
namespace {

class CollectSlot final : public KernelSlot {
 public:
  explicit CollectSlot(std::string name) { name_ = std::move(name); }
};

}  // namespace

CompileOnlyHost::CompileOnlyHost(compiler::Dialect dialect, const char* prefix)
    : dialect_(dialect), prefix_(prefix), name_(std::string(prefix) + "-compile:0") {
  codegen_.work_group_size = 256;
}

CompileOnlyHost::~CompileOnlyHost() = default;

StatusOr<std::unique_ptr<backend::Buffer>> CompileOnlyHost::Allocate(size_t bytes) {
  std::unique_ptr<backend::Buffer> b = backend::HostMemoryBuffer::Make(this, bytes);
  return b;
}

// Copies only (the trainer zeroes and initialises its tensors); a run would call no kernel.
StatusOr<std::unique_ptr<backend::Stream>> CompileOnlyHost::CreateStream() {
  return std::unique_ptr<backend::Stream>(new backend::HostStream(this, 1));
}

KernelSlot* CompileOnlyHost::DeclareKernel(std::string_view prefix, std::string_view source) {
  const std::string name = TemplateKernelName(prefix, source);
  return Add(name, NameKernel(source, name));
}

KernelSlot* CompileOnlyHost::DeclareGenerated(const compiler::GeneratedKernel& k) {
  return Add(k.entry, k.code);
}

KernelSlot* CompileOnlyHost::LibraryKernel(std::string_view name) {
  library.insert(std::string(name));
  return Add(std::string(name), "");
}

bool CompileOnlyHost::Resolve(const void* p, void** mem, size_t* offset) const {
  *mem = const_cast<void*>(p);
  *offset = 0;
  return p != nullptr;
}

Status CompileOnlyHost::Upload(const backend::Buffer& dst, const void* src, size_t bytes) {
  std::memcpy(dst.data(), src, bytes);
  return OkStatus();
}

void* CompileOnlyHost::GetExtension(std::string_view name) {
  return name == compiler::kTargetExtension ? static_cast<compiler::Target*>(this) : nullptr;
}

KernelSlot* CompileOnlyHost::Add(const std::string& name, std::string source) {
  if (entries.insert(name).second && !source.empty()) {
    kernels.push_back(std::move(source));
    kernel_entries.push_back(name);
  }
  slots_.push_back(std::make_unique<CollectSlot>(name));
  return slots_.back().get();
}

StatusOr<KernelSetCounts> DeclareKernelSet(CompileOnlyHost& host) {
  KernelSetCounts n;
  // SmolLM2-135M's step program as serving compiles it (fused; 2 layers compile the kernels of
  // 30), with Q4_1 (the default GGUF) and f16 weights.
  for (DType w : {DType::kQ4_1, DType::kF16}) {
    compiler::testing::LlamaConfig c;
    c.layers = 2;
    c.dim = 576;
    c.heads = 9;
    c.kv_heads = 3;
    c.head_dim = 64;
    c.ffn = 1536;
    c.vocab = 49152;
    c.weight_dtype = w;
    KILN_ASSIGN_OR_RETURN(compiler::testing::LlamaGraph g, compiler::testing::BuildLlama(c));
    StatusOr<std::unique_ptr<Program>> p = compiler::Compile(g.graph, {g.logits}, host);
    if (!p.ok()) return Internal("SmolLM2's step (", DTypeName(w), "): ", p.status().message());
  }
  n.step_kernels = host.kernels.size();
  // The training step: forward, backward and the optimizer, as `kiln finetune` compiles it.
  config::ModelConfig mc;
  mc.path = models::testing::DefaultModelPath();
  if (!std::filesystem::exists(mc.path)) {
    mc.path = models::testing::SourceDir() + "/tests/fixtures/models/llama_gqa_f32";
  }
  mc.backend = "ref";  // opens the files; the trainer gets `host`
  KILN_ASSIGN_OR_RETURN(models::PagedLlmParts parts, models::OpenLlmParts(mc));
  n.training_model = parts.info.name;
  parts.device = &host;
  models::TrainerOptions to;
  to.batch_size = 1;
  to.seq_len = 16;
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<models::Trainer> trainer,
                        models::Trainer::Create(std::move(parts), to));
  // Compiles the step program (SetOptimizerState compiles it first; no state, nothing runs).
  KILN_RETURN_IF_ERROR(trainer->SetOptimizerState({}, 0));
  n.training_kernels = host.kernels.size() - n.step_kernels;
  for (bool gradient : {false, true}) {
    for (const harness::OpCase& c :
         gradient ? harness::GradientCases(false) : harness::ForwardCases(false)) {
      (void)harness::CompileCase(c, gradient, host);  // declares; errors are the harness's to find
      ++n.harness_cases;
    }
  }
  n.harness_kernels = host.kernels.size() - n.step_kernels - n.training_kernels;
  // What the compile tests rely on: a set that covers each source.
  if (n.step_kernels == 0 || n.training_kernels == 0) {
    return Internal("SmolLM2's step declared ", n.step_kernels, " kernels and ", n.training_model,
                    "'s training step ", n.training_kernels,
                    " more; expected fused kernels of their own");
  }
  if (n.harness_kernels <= 100 || host.library.empty()) {
    return Internal("the op harness declared ", n.harness_kernels, " more kernels and ",
                    host.library.size(), " of the library; expected more than 100 and some");
  }
  return n;
}

std::vector<KernelProgram> KernelPrograms(const CompileOnlyHost& host, const KernelSetCounts& n) {
  // kernels[begin, end) as one program.
  auto kernels = [&](std::string name, size_t begin, size_t end, bool harness_only) {
    return KernelProgram{std::move(name),
                         GpuProgramSource(host.dialect(), false, host.work_group(),
                                          std::span(host.kernels).subspan(begin, end - begin)),
                         std::vector<std::string>(host.kernel_entries.begin() + begin,
                                                  host.kernel_entries.begin() + end),
                         harness_only};
  };
  const size_t model_end = n.step_kernels + n.training_kernels;
  std::vector<KernelProgram> out;
  out.push_back({"kiln_lib", GpuProgramSource(host.dialect(), true, host.work_group(), {}),
                 std::vector<std::string>(host.library.begin(), host.library.end()), false});
  out.push_back(kernels("kiln_model_steps", 0, model_end, false));
  out.push_back(kernels("kiln_harness", model_end, host.kernels.size(), true));
  return out;
}

}  // namespace kiln::devk::testing
