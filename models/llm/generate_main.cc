// kiln: local tools for quick checks of a model without starting the server.
//
//   kiln generate --model PATH --prompt TEXT [--chat] [--max-tokens N] [--temperature T]
//                 [--top-p P] [--top-k K] [--seed S] [--threads N] [--backend NAME]
//
// Loads the model exactly as kilnd does (models::LoadPagedLlm), prefills the prompt in one
// step and streams each new token to stdout as soon as its text is complete (the streaming
// detokenizer never prints half a UTF-8 character). --chat wraps the prompt in the model's
// chat template as one user message. Statistics (load time, prefill and decode speed) go to
// stderr. Exit status: 0 on success, 1 on a bad argument or a model that does not load.
//
//   kiln backends
//
// Lists the device families this machine can use (ref, cpu, xpu, and each backend plugin
// found: cuda, hip), each with its devices or the reason it has none.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "backends/builtin.h"
#include "backends/registry.h"
#include "config/config.h"
#include "models/llm/loader.h"
#include "models/llm/paged_llm.h"
#include "models/sampling/sampler.h"
#include "models/tokenizer/detokenizer.h"
#include "models/train/export.h"
#include "models/train/finetune.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace kiln::models {
namespace {

struct GenerateArgs {
  std::string model, prompt, backend = "cpu", activations = "f32", kv_cache_dtype = "f32",
                             sampling = "device";
  bool chat = false;
  std::string adapter;  // PEFT LoRA adapter directory
  int threads = 0;
  int max_tokens = 128;
  float temperature = 0, top_p = 1;
  int top_k = 0;
  int64_t seed = -1;
};

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

StatusOr<std::vector<int32_t>> PromptIds(const LlmModel& model, const GenerateArgs& a) {
  if (!a.chat) return model.tokenizer().Encode(a.prompt);
  const ChatTemplate* tmpl = model.chat_template();
  if (tmpl == nullptr) return InvalidArgument("the model has no chat template; drop --chat");
  ChatTemplate::Inputs in;
  in.messages = nlohmann::ordered_json::array({{{"role", "user"}, {"content", a.prompt}}});
  KILN_ASSIGN_OR_RETURN(std::string text, tmpl->Apply(in));
  return model.tokenizer().Encode(text);
}

Status Generate(const GenerateArgs& a) {
  const auto start = std::chrono::steady_clock::now();
  config::ModelConfig c;
  c.name = "generate";
  c.kind = "llm";
  c.path = a.model;
  c.backend = a.backend;
  c.threads = a.threads;
  c.activations = a.activations;
  c.kv_cache_dtype = a.kv_cache_dtype;
  c.sampling = a.sampling;
  c.scheduler.max_num_seqs = 1;
  c.scheduler.capture_batch_sizes = {1};
  LlmLoadOptions load;
  load.adapter = a.adapter;
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<PagedLlm> model, LoadPagedLlm(c, load));
  KILN_ASSIGN_OR_RETURN(std::vector<int32_t> ids, PromptIds(*model, a));
  if (ids.empty()) return InvalidArgument("the prompt is empty");
  const int32_t context = model->info().context_length;
  const int32_t total = static_cast<int32_t>(ids.size()) + a.max_tokens;
  if (total > context) {
    return InvalidArgument("prompt of ", ids.size(), " tokens plus --max-tokens ", a.max_tokens,
                           " exceeds the model's context of ", context, " tokens");
  }
  // One sequence owning blocks 0..n-1 of a cache just large enough.
  const int32_t bs = 16, blocks = (total + bs - 1) / bs;
  KILN_RETURN_IF_ERROR(model->AllocateKvCache(blocks, bs));
  std::vector<int32_t> table(blocks);
  for (int32_t i = 0; i < blocks; ++i) table[i] = i;
  const double load_s = Seconds(start);

  SamplingParams sp;
  sp.temperature = a.temperature;
  sp.top_p = a.top_p;
  sp.top_k = a.top_k;
  sp.max_tokens = a.max_tokens;
  if (a.seed >= 0) sp.seed = static_cast<uint64_t>(a.seed);
  KILN_RETURN_IF_ERROR(ValidateSamplingParams(sp, model->info().vocab_size));
  SequenceSampler sampler(sp, ids, std::random_device{}());
  Detokenizer detok(model->tokenizer());
  const std::vector<int32_t>& eos = model->info().eos_token_ids;
  std::vector<float> logits(model->info().vocab_size);

  // A step; when it ends the prompt or decodes, also the next token: sampled in the step
  // program where the model can, else on the host from the logits.
  StepSamplingTable sampling_rows;
  auto step = [&](const StepBatch& b, SampledToken* next) -> Status {
    if (next != nullptr && model->samples_on_device()) {
      sampling_rows.Clear();
      sampling_rows.AddSampled(sampler, eos);
      return model->StepAndSample(b, sampling_rows.table(), std::span(next, 1), nullptr);
    }
    KILN_RETURN_IF_ERROR(model->Step(b, logits, nullptr));
    if (next != nullptr) *next = sampler.Sample(logits, eos);
    return OkStatus();
  };

  // Prefill: every prompt token in one step (chunks of max_num_batched_tokens).
  const auto prefill_start = std::chrono::steady_clock::now();
  const int32_t chunk = c.scheduler.max_num_batched_tokens;
  SampledToken t;
  for (int32_t done = 0; done < static_cast<int32_t>(ids.size());) {
    const int32_t n = std::min<int32_t>(chunk, static_cast<int32_t>(ids.size()) - done);
    std::vector<int32_t> pos(n), qs = {0, n}, lens = {done + n};
    for (int32_t i = 0; i < n; ++i) pos[i] = done + i;
    StepBatch b{std::span(ids).subspan(done, n), pos, qs, lens, table, blocks, pos, false};
    done += n;
    KILN_RETURN_IF_ERROR(step(b, done == static_cast<int32_t>(ids.size()) ? &t : nullptr));
  }
  const double prefill_s = Seconds(prefill_start);

  const auto decode_start = std::chrono::steady_clock::now();
  int32_t generated = 0;
  std::string finish = "length";
  int32_t len = static_cast<int32_t>(ids.size());
  while (generated < a.max_tokens) {
    sampler.Accept(t.token);
    ++generated;
    if (std::find(eos.begin(), eos.end(), t.token) != eos.end()) {
      finish = "stop";
      break;
    }
    std::fputs(detok.Add(t.token).c_str(), stdout);
    std::fflush(stdout);
    if (generated == a.max_tokens) break;
    std::vector<int32_t> tok = {t.token}, pos = {len}, qs = {0, 1}, lens = {len + 1};
    StepBatch b{tok, pos, qs, lens, table, blocks, pos, true};
    KILN_RETURN_IF_ERROR(step(b, &t));
    ++len;
  }
  std::fputs(detok.Finish().c_str(), stdout);
  std::fputs("\n", stdout);
  const double decode_s = Seconds(decode_start);
  std::fprintf(stderr,
               "[kiln generate] load %.2f s | prompt %zu tokens in %.3f s (%.1f tok/s) | %d "
               "tokens in %.3f s (%.1f tok/s) | finish: %s\n",
               load_s, ids.size(), prefill_s, ids.size() / prefill_s, generated, decode_s,
               generated / decode_s, finish.c_str());
  return OkStatus();
}

// `kiln finetune`: a line per step (on a terminal, behind a progress bar that rewrites
// itself), then a summary.
Status Finetune(const FinetuneOptions& o) {
  const bool tty = isatty(fileno(stderr)) != 0;
  bool bar_shown = false;
  auto report = [&](const FinetuneProgress& p) {
    if (!p.message.empty()) {
      std::fprintf(stderr, "%s%s\n", bar_shown ? "\n" : "", p.message.c_str());
      bar_shown = false;
      return true;
    }
    char line[256];
    std::snprintf(line, sizeof(line),
                  "step %lld/%lld  epoch %.2f  loss %.4f  lr %.2e  grad norm %.3f  %.0f tok/s  "
                  "%.2f s",
                  static_cast<long long>(p.step), static_cast<long long>(p.total_steps), p.epoch,
                  p.loss, p.lr, p.grad_norm, p.tokens_per_second, p.step_seconds);
    std::string text = line;
    if (p.valid_loss >= 0) text += "  valid loss " + std::to_string(p.valid_loss);
    if (tty) {
      const int width = 24;
      const int done = static_cast<int>(width * p.step / std::max<int64_t>(p.total_steps, 1));
      std::fprintf(stderr, "\r[%s%s] %s", std::string(done, '#').c_str(),
                   std::string(width - done, '.').c_str(), text.c_str());
      bar_shown = true;
      if (p.valid_loss >= 0 || p.step == p.total_steps) {
        std::fputc('\n', stderr);
        bar_shown = false;
      }
    } else {
      std::fprintf(stderr, "%s\n", text.c_str());
    }
    std::fflush(stderr);
    return true;
  };
  KILN_ASSIGN_OR_RETURN(FinetuneSummary s, RunFinetune(o, report));
  std::printf(
      "trained %lld tokens in %lld steps, %.1f s (%.0f tok/s); final loss %.4f%s; %lld "
      "trainable parameters; peak RSS %.0f MiB (step arena %.0f MiB); adapter in %s\n",
      static_cast<long long>(s.tokens), static_cast<long long>(s.steps), s.seconds,
      static_cast<double>(s.tokens) / std::max(s.seconds, 1e-9), s.final_loss,
      s.valid_loss >= 0 ? (", valid loss " + std::to_string(s.valid_loss)).c_str() : "",
      static_cast<long long>(s.trainable_parameters), s.peak_rss_bytes / 1048576.0,
      s.step_arena_bytes / 1048576.0, s.adapter_dir.c_str());
  return OkStatus();
}

// `kiln backends`: the device families this machine can use, and why the others cannot be —
// the built-in ones, then every backend plugin found (a plugin's devices are counted, not
// opened).
Status ListBackends() {
  auto line = [](std::string_view name, const std::string& what) {
    std::printf("%-6.*s %s\n", static_cast<int>(name.size()), name.data(), what.c_str());
  };
  auto devices = [](backend::Backend& b, bool open) {
    std::string s = StrCat(b.device_count(), " device(s)");
    if (!open) return StrCat(s, ", opened at first use");
    for (int i = 0; i < b.device_count(); ++i) {
      if (backend::Device* d = b.device(i)) s += StrCat(i == 0 ? ": " : ", ", d->name());
    }
    return s;
  };
  line("ref", devices(*backend::MakeRefBackend(), true));
  line("cpu", devices(*backend::MakeCpuBackend(), true));
  if (std::unique_ptr<backend::Backend> xpu = backend::MakeXpuBackend()) {
    line("xpu", devices(*xpu, true));
  } else {
    line("xpu",
         "not available (no OpenCL device, or built without OpenCL; --log-level info says which)");
  }
  for (const std::string& name : backend::Registry::PluginNames()) {
    StatusOr<std::unique_ptr<backend::Backend>> b = backend::Registry::LoadBackendFromPlugin(name);
    line(name, b.ok() ? devices(**b, false) : StrCat("not available: ", StatusMessage(b.status())));
  }
  return OkStatus();
}

}  // namespace
}  // namespace kiln::models

int main(int argc, char** argv) {
  CLI::App app{"kiln: local model tools (generate, finetune, export, backends)"};
  app.require_subcommand(1);
  kiln::models::GenerateArgs a;
  CLI::App* gen = app.add_subcommand("generate", "stream a model's continuation of a prompt");
  gen->add_option("--model", a.model, "GGUF file or Hugging Face folder")->required();
  gen->add_option("--prompt", a.prompt, "prompt text")->required();
  gen->add_option("--adapter", a.adapter, "a PEFT LoRA adapter directory (kiln finetune's --out)");
  gen->add_flag("--chat", a.chat, "render the prompt with the model's chat template");
  gen->add_option("--max-tokens", a.max_tokens, "new tokens at most")
      ->check(CLI::Range(1, 1 << 20));
  gen->add_option("--temperature", a.temperature, "0: greedy (default)");
  gen->add_option("--top-p", a.top_p, "nucleus sampling mass");
  gen->add_option("--top-k", a.top_k, "0: off");
  gen->add_option("--seed", a.seed, "sampling seed (default: random)");
  gen->add_option("--threads", a.threads,
                  "CPU threads; 0: the CPUs the process may use (affinity, cgroup quota)");
  gen->add_option("--backend", a.backend, "cpu (default), ref, xpu, cuda, hip");
  gen->add_option("--activations", a.activations,
                  "f32 (default, exact), q8 (8-bit activations before quantized weights, as "
                  "llama.cpp) or bf16 (bf16 activations before bf16 weights, as llama.cpp)")
      ->check(CLI::IsMember(std::vector<std::string>(std::begin(kiln::config::kActivationNames),
                                                     std::end(kiln::config::kActivationNames))));
  gen->add_option("--sampling", a.sampling,
                  "device (default: in the step program where the backend can) or host")
      ->check(CLI::IsMember({"device", "host"}));
  gen->add_option("--kv-cache-dtype", a.kv_cache_dtype, "f32 (default), f16 or bf16")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  std::string log_level = "warn";
  gen->add_option("--log-level", log_level, "trace|debug|info|warn|error (default warn)");

  kiln::models::FinetuneOptions f;
  CLI::App* ft = app.add_subcommand("finetune", "fine-tune a model (LoRA) on a JSONL file");
  ft->add_option("--model", f.model, "GGUF file or Hugging Face folder")->required();
  ft->add_option("--train", f.train, "training data: OpenAI chat or prompt/completion JSONL")
      ->required();
  ft->add_option("--valid", f.valid, "validation data (loss reported after each epoch)");
  ft->add_option("--out", f.out, "output directory: the PEFT adapter and checkpoints");
  ft->add_option("--resume", f.resume, "continue from the newest complete checkpoint in DIR");
  ft->add_option("--method", f.method, "lora (default) or full")
      ->check(CLI::IsMember({"lora", "full"}));
  ft->add_option("--rank", f.lora.r, "LoRA rank r (default 8)");
  ft->add_option("--alpha", f.lora.alpha, "LoRA alpha (default 16)");
  ft->add_flag("--rslora", f.lora.use_rslora, "scale by alpha / sqrt(r) (rsLoRA)");
  ft->add_option("--dropout", f.lora.dropout,
                 "LoRA dropout on each adapted layer's branch input, in [0, 1) (default 0)");
  ft->add_option("--targets", f.lora.target_modules,
                 "modules: all-linear (default) or q_proj k_proj v_proj o_proj gate_proj "
                 "up_proj down_proj")
      ->delimiter(',');
  ft->add_option("--optimizer", f.optimizer, "adamw (default), adam, sgd or adagrad");
  ft->add_option("--lr", f.lr, "peak learning rate (default 2e-4)");
  ft->add_option("--schedule", f.schedule, "constant, linear (default) or cosine");
  ft->add_option("--warmup-steps", f.warmup_steps, "linear warmup steps (default 0)");
  ft->add_option("--weight-decay", f.weight_decay, "default 0");
  ft->add_option("--max-grad-norm", f.max_grad_norm, "global-norm clipping; 0: off (default 1)");
  ft->add_option("--epochs", f.epochs, "passes over the data (default 1)");
  ft->add_option("--steps", f.steps, "optimizer steps instead of --epochs");
  ft->add_option("--batch-size", f.batch_size, "rows per micro-batch (default 4)");
  ft->add_option("--grad-accum", f.grad_accum,
                 "micro-batches per optimizer step (gradient accumulation; default 1)");
  ft->add_option("--seq-len", f.seq_len, "tokens per row (default 1024)");
  ft->add_flag("!--no-pack", f.pack, "one example per row instead of packing");
  ft->add_flag("--recompute", f.recompute,
               "recompute each block's activations in the backward: less memory, ~1/3 more time");
  ft->add_flag("--keep-activations", f.keep_activations,
               "keep the norms' outputs and the MLP's activation product from the forward "
               "instead of recomputing them (more memory, a few pointwise passes less)");
  ft->add_option("--seed", f.seed, "data order and adapter init (default 42)");
  ft->add_option("--save-steps", f.save_steps, "checkpoint every N steps (default: each epoch)");
  ft->add_option("--keep-checkpoints", f.keep_checkpoints, "newest checkpoints kept (default 2)");
  ft->add_option("--threads", f.threads,
                 "CPU threads; 0: the CPUs the process may use (affinity, cgroup quota)");
  ft->add_option("--backend", f.backend, "cpu (default), ref, xpu, cuda, hip");
  ft->add_option("--log-level", log_level, "trace|debug|info|warn|error (default warn)");

  std::string export_model, export_adapter, export_out;
  bool export_merge = false;
  CLI::App* ex = app.add_subcommand(
      "export", "write a model with a LoRA adapter merged in, as a Hugging Face folder (f32)");
  ex->add_option("--model", export_model, "GGUF file or Hugging Face folder")->required();
  ex->add_option("--adapter", export_adapter, "PEFT LoRA adapter directory")->required();
  ex->add_option("--out", export_out, "output folder")->required();
  ex->add_flag("--merge", export_merge, "merge the adapter into the weights (the only export)")
      ->required();

  CLI::App* backends = app.add_subcommand(
      "backends", "list the device families this machine can use, and why the others cannot");

  CLI11_PARSE(app, argc, argv);
  // Logs go to stderr, as kilnd's do: stdout carries only the generated text (or the
  // command's report), so `kiln generate ... > out.txt` keeps the text clean at any level.
  spdlog::set_default_logger(
      std::make_shared<spdlog::logger>("kiln", std::make_shared<spdlog::sinks::stderr_sink_mt>()));
  spdlog::set_level(spdlog::level::from_str(log_level));
  const char* command = ft->parsed()         ? "finetune"
                        : ex->parsed()       ? "export"
                        : backends->parsed() ? "backends"
                                             : "generate";
  const kiln::Status s = ft->parsed() ? kiln::models::Finetune(f)
                         : ex->parsed()
                             ? kiln::models::ExportMerged(export_model, export_adapter, export_out)
                         : backends->parsed() ? kiln::models::ListBackends()
                                              : kiln::models::Generate(a);
  if (!s.ok()) {
    std::fprintf(stderr, "kiln %s: %s\n", command, std::string(kiln::StatusMessage(s)).c_str());
    return 1;
  }
  if (ex->parsed()) std::printf("wrote %s\n", export_out.c_str());
  return 0;
}
