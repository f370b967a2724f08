#include "models/encoder/encoder_model.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "engine/builder.h"
#include "engine/compiler/compile.h"
#include "engine/expr.h"
#include "engine/program.h"
#include "models/arch/arch.h"
#include "models/hf/hf_folder.h"
#include "models/llm/forward.h"
#include "models/llm/loader.h"
#include "models/llm/model_files.h"
#include "models/tokenizer/tokenizer.h"
#include "models/tokenizer/unicode.h"

namespace kiln::models {
namespace {

using absl::StrCat;
namespace fs = std::filesystem;

constexpr int32_t kDefaultMaxBatch = 32;

// BertModel's sizes from config.json, as LlmHParams so that ForwardContext checks the weights.
StatusOr<LlmHParams> BertFromHf(const HfModelConfig& c) {
  if (c.model_type != "bert") {
    return InvalidArgument(c.path, ": model_type '", c.model_type,
                           "' is not an encoder Kiln can embed with; supported: bert");
  }
  LlmHParams hp;
  hp.architecture = "bert";
  hp.use_rope = false;
  KILN_ASSIGN_OR_RETURN(hp.vocab_size, c.GetInt("vocab_size"));
  KILN_ASSIGN_OR_RETURN(hp.hidden_size, c.GetInt("hidden_size"));
  KILN_ASSIGN_OR_RETURN(hp.num_layers, c.GetInt("num_hidden_layers"));
  KILN_ASSIGN_OR_RETURN(hp.num_heads, c.GetInt("num_attention_heads"));
  hp.num_kv_heads = hp.num_heads;
  KILN_ASSIGN_OR_RETURN(hp.ffn_size, c.GetInt("intermediate_size"));
  KILN_ASSIGN_OR_RETURN(hp.context_length, HfIntOr(c, "max_position_embeddings", 512));
  KILN_ASSIGN_OR_RETURN(hp.norm_eps, HfFloatOr(c, "layer_norm_eps", 1e-12));
  hp.head_dim = hp.num_heads > 0 ? hp.hidden_size / hp.num_heads : 0;
  auto act = c.GetString("hidden_act");
  const std::string activation = act.ok() ? *act : "gelu";
  if (activation == "gelu") {
    hp.activation = LlmActivation::kGeluErf;
  } else if (activation == "gelu_new" || activation == "gelu_pytorch_tanh") {
    hp.activation = LlmActivation::kGeluTanh;
  } else {
    return Unimplemented(c.path, ": hidden_act '", activation,
                         "' is not supported; supported: gelu, gelu_new, gelu_pytorch_tanh");
  }
  auto pos = c.GetString("position_embedding_type");
  if (pos.ok() && *pos != "absolute") {
    return Unimplemented(c.path, ": position_embedding_type '", *pos,
                         "' is not supported; supported: absolute");
  }
  hp.attn_qkv_bias = hp.attn_out_bias = hp.mlp_bias = true;
  KILN_RETURN_IF_ERROR(ValidateHParams(hp, c.path));
  if (hp.head_dim * hp.num_heads != hp.hidden_size) {
    return InvalidArgument(c.path, ": hidden_size ", hp.hidden_size,
                           " is not a multiple of num_attention_heads ", hp.num_heads);
  }
  return hp;
}

// Hugging Face BertModel names -> llama.cpp's BERT GGUF names.
const HfNaming& BertNaming() {
  static const HfNaming* naming = new HfNaming{
      .layer_prefixes = {"encoder.layer."},
      .global = {{"embeddings.word_embeddings.weight", "token_embd.weight"},
                 {"embeddings.position_embeddings.weight", "position_embd.weight"},
                 {"embeddings.token_type_embeddings.weight", "token_types.weight"},
                 {"embeddings.LayerNorm.weight", "token_embd_norm.weight"},
                 {"embeddings.LayerNorm.bias", "token_embd_norm.bias"}},
      .per_layer = {{"attention.self.query.weight", "attn_q.weight"},
                    {"attention.self.query.bias", "attn_q.bias"},
                    {"attention.self.key.weight", "attn_k.weight"},
                    {"attention.self.key.bias", "attn_k.bias"},
                    {"attention.self.value.weight", "attn_v.weight"},
                    {"attention.self.value.bias", "attn_v.bias"},
                    {"attention.output.dense.weight", "attn_output.weight"},
                    {"attention.output.dense.bias", "attn_output.bias"},
                    {"attention.output.LayerNorm.weight", "attn_output_norm.weight"},
                    {"attention.output.LayerNorm.bias", "attn_output_norm.bias"},
                    {"intermediate.dense.weight", "ffn_up.weight"},
                    {"intermediate.dense.bias", "ffn_up.bias"},
                    {"output.dense.weight", "ffn_down.weight"},
                    {"output.dense.bias", "ffn_down.bias"},
                    {"output.LayerNorm.weight", "layer_output_norm.weight"},
                    {"output.LayerNorm.bias", "layer_output_norm.bias"}},
      // The pooler (BertModel's tanh head over [CLS]) is not part of sentence embeddings.
      .ignored_suffixes = {"embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"},
      .strip_prefixes = {"bert."}};
  return *naming;
}

// The sentence-transformers modules after the transformer: pooling, normalisation and the
// length the model was trained for. A plain BertModel folder (no modules.json): mean pooling.
Status ReadSentenceTransformersConfig(const fs::path& dir, EncoderInfo& info) {
  info.pooling = EmbeddingPooling::kMean;
  info.normalize = false;
  if (fs::exists(dir / "sentence_bert_config.json")) {
    KILN_ASSIGN_OR_RETURN(nlohmann::json sb,
                          ReadJsonFile((dir / "sentence_bert_config.json").string()));
    const auto it = sb.find("max_seq_length");
    if (it != sb.end() && !it->is_null()) {
      if (!it->is_number_integer() || it->get<int64_t>() < 2) {
        return InvalidArgument((dir / "sentence_bert_config.json").string(),
                               ": max_seq_length must be an integer >= 2");
      }
      info.max_tokens = static_cast<int32_t>(std::min<int64_t>(it->get<int64_t>(), 1 << 20));
    }
  }
  if (!fs::exists(dir / "modules.json")) return OkStatus();
  const std::string modules_path = (dir / "modules.json").string();
  KILN_ASSIGN_OR_RETURN(nlohmann::json modules, ReadJsonFile(modules_path));
  if (!modules.is_array()) return InvalidArgument(modules_path, ": expected a list of modules");
  for (const nlohmann::json& m : modules) {
    const std::string type = m.is_object() ? m.value("type", "") : "";
    const std::string sub = m.is_object() && m.contains("path") && m["path"].is_string()
                                ? m["path"].get<std::string>()
                                : "";
    if (type.ends_with(".Transformer")) continue;
    if (type.ends_with(".Normalize")) {
      info.normalize = true;
      continue;
    }
    if (!type.ends_with(".Pooling")) {
      return Unimplemented(modules_path, ": module '", type,
                           "' is not supported; supported: Transformer, Pooling, Normalize");
    }
    const fs::path pooling_path = dir / sub / "config.json";
    KILN_ASSIGN_OR_RETURN(nlohmann::json p, ReadJsonFile(pooling_path.string()));
    // sentence-transformers 3+: "pooling_mode"; older: one boolean per mode.
    std::vector<std::string> modes;
    if (p.contains("pooling_mode") && p["pooling_mode"].is_string()) {
      modes.push_back(p["pooling_mode"].get<std::string>());
    }
    static constexpr std::pair<const char*, const char*> kFlags[] = {
        {"pooling_mode_cls_token", "cls"},
        {"pooling_mode_mean_tokens", "mean"},
        {"pooling_mode_max_tokens", "max"},
        {"pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"},
        {"pooling_mode_weightedmean_tokens", "weightedmean"},
        {"pooling_mode_lasttoken", "lasttoken"}};
    for (const auto& [key, mode] : kFlags) {
      if (p.value(key, false)) modes.emplace_back(mode);
    }
    if (modes.size() != 1 || (modes[0] != "mean" && modes[0] != "cls")) {
      std::string list;
      for (const std::string& m2 : modes) list += (list.empty() ? "" : ", ") + m2;
      return Unimplemented(pooling_path.string(), ": pooling mode(s) [", list,
                           "] not supported; supported: exactly one of mean, cls");
    }
    info.pooling = modes[0] == "cls" ? EmbeddingPooling::kCls : EmbeddingPooling::kMean;
  }
  return OkStatus();
}

}  // namespace

struct EncoderModel::Impl {
  std::shared_ptr<ModelFiles> files;
  std::unique_ptr<Tokenizer> tokenizer;
  LlmHParams hp;
  ModelDevice device;
  std::unique_ptr<backend::Stream> stream;
  std::unique_ptr<Program> program;
  std::map<std::string, Tensor> weights;
  int32_t cls_id = -1, sep_id = -1, pad_id = 0;
  // Step inputs, allocated for max_batch texts of max_tokens each.
  std::shared_ptr<backend::Buffer> tokens, positions, lens, pool;
  std::vector<int32_t> h_tokens, h_positions, h_lens;
  std::vector<float> h_pool;

  Status Build(const EncoderInfo& info);
  Status RunBatch(const EncoderInfo& info, std::span<const std::vector<int32_t>> texts, float* out);
};

// The encoder graph (BertModel, post-LayerNorm):
//   x = LN(word[t] + position[p] + token_type[0])
//   per layer: x = LN(x + O(attention(Q x, K x, V x))); x = LN(x + Down(gelu(Up x)))
// then the pooled rows: pool [B, 1, L] x [B, L, C] -> [B, C].
Status EncoderModel::Impl::Build(const EncoderInfo& info) {
  Graph graph;
  Builder b(&graph);
  const int64_t C = hp.hidden_size, H = hp.num_heads, D = hp.head_dim, F = hp.ffn_size,
                P = hp.context_length, V = hp.vocab_size;
  const Dim B = b.Symbol("B", info.max_batch), L = b.Symbol("L", info.max_tokens);
  const Dim T = B * L;
  StepInputs in;
  in.T = T;
  in.S = B;
  in.L = L;
  in.tokens = b.Input("tokens", DType::kI32, {T});               // [T]
  in.positions = b.Input("positions", DType::kI32, {T});         // [T]
  const Value text_lens = b.Input("lens", DType::kI32, {B});     // [B] tokens per text
  const Value pool_rows = b.Input("pool", DType::kF32, {B, L});  // [B, L] pooling weights
  // The training constructor: no KV cache, weights checked against the hyper-parameters.
  ForwardContext ctx(b, *files, hp, in, TrainGraphOptions{});
  const bool tanh_gelu = hp.activation == LlmActivation::kGeluTanh;
  const int64_t type_rows = files->Find("token_types.weight") != nullptr
                                ? files->Find("token_types.weight")->LoadedShape()[0]
                                : 1;
  const Value types = ctx.Weight("token_types.weight", {type_rows, C});  // (types, C)
  Value x = b.Add(b.Add(ctx.Embed(ctx.Weight("token_embd.weight", {V, C}), in.tokens),
                        ctx.Embed(ctx.Weight("position_embd.weight", {P, C}), in.positions)),
                  b.Reshape(b.Slice(types, 0, 0, 1), {C}));  // every text is segment 0
  x = b.Named(b.LayerNorm(x, ctx.Weight("token_embd_norm.weight", {C}),
                          ctx.Weight("token_embd_norm.bias", {C}), hp.norm_eps),
              "inp_embd");  // [T, C]
  AttentionParams attn;
  attn.scale = 1.0 / std::sqrt(static_cast<double>(D));
  attn.mask_mod = attn::KeyPaddingMask(0);
  const Value aux[] = {text_lens};
  for (int64_t l = 0; l < hp.num_layers; ++l) {
    const std::string blk = StrCat("blk.", l, ".");
    auto w = [&](const char* name, std::vector<int64_t> shape) {
      return ctx.Weight(blk + name, std::move(shape));
    };
    b.SetNameScope(StrCat("blk.", l));
    auto heads = [&](const char* name) {  // [T, C] -> [B, H, L, D]
      const Value p = ctx.Linear(x, w(StrCat(name, ".weight").c_str(), {C, C}),
                                 w(StrCat(name, ".bias").c_str(), {C}));
      return b.Permute(b.Reshape(p, {B, L, H, D}), {0, 2, 1, 3});
    };
    const Value o = b.Attention(heads("attn_q"), heads("attn_k"), heads("attn_v"), attn, aux);
    const Value a = b.Reshape(b.Permute(o, {0, 2, 1, 3}), {T, C});  // [T, C]
    const Value attn_out =
        ctx.Linear(a, w("attn_output.weight", {C, C}), w("attn_output.bias", {C}));
    x = b.Named(b.LayerNorm(b.Add(x, attn_out), w("attn_output_norm.weight", {C}),
                            w("attn_output_norm.bias", {C}), hp.norm_eps),
                "attn_out_norm");  // [T, C]
    const Value up =
        b.Named(b.Gelu(ctx.Linear(x, w("ffn_up.weight", {F, C}), w("ffn_up.bias", {F})), tanh_gelu),
                "ffn_up");  // [T, F]
    const Value down = ctx.Linear(up, w("ffn_down.weight", {C, F}), w("ffn_down.bias", {C}));
    x = b.Named(b.LayerNorm(b.Add(x, down), w("layer_output_norm.weight", {C}),
                            w("layer_output_norm.bias", {C}), hp.norm_eps),
                "l_out");  // [T, C]
  }
  b.SetNameScope("");
  const Value pooled =
      b.Named(b.Reshape(b.MatMul(b.Reshape(pool_rows, {B, 1, L}), b.Reshape(x, {B, L, C})), {B, C}),
              "pooled");  // [B, C]
  KILN_RETURN_IF_ERROR(ctx.status());
  KILN_RETURN_IF_ERROR(b.status());
  compiler::CompilerOptions copts;
  copts.label = StrCat(info.name, " (encoder)");
  compiler::CompileReport report;
  const Value outputs[] = {pooled};
  KILN_ASSIGN_OR_RETURN(program, compiler::Compile(graph, outputs, *device.device, copts, &report));
  spdlog::debug("{}: {}", copts.label, report.ToString());
  for (const std::string& name : ctx.weight_names()) {
    if (weights.count(name)) continue;
    const WeightInfo* wi = files->Find(name);
    KILN_ASSIGN_OR_RETURN(Tensor t, files->Load(*wi, *device.device, files));
    weights.emplace(name, std::move(t));
  }
  for (const auto& [name, t] : weights) {
    if (program->FindExternal(name) >= 0) KILN_RETURN_IF_ERROR(program->Bind(name, t));
  }
  auto alloc = [&](int64_t n) -> StatusOr<std::shared_ptr<backend::Buffer>> {
    KILN_ASSIGN_OR_RETURN(std::unique_ptr<backend::Buffer> buf,
                          device.device->Allocate(static_cast<size_t>(n) * 4));
    return std::shared_ptr<backend::Buffer>(std::move(buf));
  };
  const int64_t max_t = int64_t{info.max_batch} * info.max_tokens;
  KILN_ASSIGN_OR_RETURN(tokens, alloc(max_t));
  KILN_ASSIGN_OR_RETURN(positions, alloc(max_t));
  KILN_ASSIGN_OR_RETURN(lens, alloc(info.max_batch));
  KILN_ASSIGN_OR_RETURN(pool, alloc(max_t));
  KILN_ASSIGN_OR_RETURN(stream, device.device->CreateStream());
  return OkStatus();
}

Status EncoderModel::Impl::RunBatch(const EncoderInfo& info,
                                    std::span<const std::vector<int32_t>> texts, float* out) {
  const int64_t nb = static_cast<int64_t>(texts.size());
  int64_t nl = 0;
  for (const std::vector<int32_t>& t : texts) nl = std::max<int64_t>(nl, std::ssize(t));
  const size_t n = static_cast<size_t>(nb * nl);
  h_tokens.assign(n, pad_id);
  h_positions.assign(n, 0);
  h_pool.assign(n, 0.0f);
  h_lens.resize(static_cast<size_t>(nb));
  for (int64_t r = 0; r < nb; ++r) {
    const std::vector<int32_t>& t = texts[static_cast<size_t>(r)];
    const size_t row = static_cast<size_t>(r * nl);
    std::copy(t.begin(), t.end(), h_tokens.begin() + static_cast<std::ptrdiff_t>(row));
    for (int64_t i = 0; i < nl; ++i)
      h_positions[row + static_cast<size_t>(i)] = static_cast<int32_t>(i);
    h_lens[static_cast<size_t>(r)] = static_cast<int32_t>(t.size());
    if (info.pooling == EmbeddingPooling::kCls) {
      h_pool[row] = 1.0f;
    } else {
      const float w = 1.0f / static_cast<float>(t.size());
      std::fill_n(h_pool.begin() + static_cast<std::ptrdiff_t>(row), t.size(), w);
    }
  }
  KILN_RETURN_IF_ERROR(stream->CopyToDevice(*tokens, 0, h_tokens.data(), n * 4));
  KILN_RETURN_IF_ERROR(stream->CopyToDevice(*positions, 0, h_positions.data(), n * 4));
  KILN_RETURN_IF_ERROR(stream->CopyToDevice(*lens, 0, h_lens.data(), h_lens.size() * 4));
  KILN_RETURN_IF_ERROR(stream->CopyToDevice(*pool, 0, h_pool.data(), n * 4));
  KILN_RETURN_IF_ERROR(program->SetSymbol("B", nb));
  KILN_RETURN_IF_ERROR(program->SetSymbol("L", nl));
  auto bind = [&](const char* name, const std::shared_ptr<backend::Buffer>& buf, DType t,
                  std::vector<int64_t> shape) -> Status {
    KILN_ASSIGN_OR_RETURN(Tensor tensor, Tensor::FromBuffer(buf, 0, t, std::move(shape)));
    return program->Bind(name, tensor);
  };
  KILN_RETURN_IF_ERROR(bind("tokens", tokens, DType::kI32, {nb * nl}));
  KILN_RETURN_IF_ERROR(bind("positions", positions, DType::kI32, {nb * nl}));
  KILN_RETURN_IF_ERROR(bind("lens", lens, DType::kI32, {nb}));
  KILN_RETURN_IF_ERROR(bind("pool", pool, DType::kF32, {nb, nl}));
  KILN_RETURN_IF_ERROR(program->Run(*stream));
  KILN_ASSIGN_OR_RETURN(Tensor pooled, program->Output(0));
  KILN_RETURN_IF_ERROR(stream->Synchronize());
  const size_t dims = static_cast<size_t>(info.dimensions);
  KILN_RETURN_IF_ERROR(stream->CopyToHost(
      out, *pooled.buffer(), static_cast<size_t>(ByteOffset(DType::kF32, pooled.offset())),
      static_cast<size_t>(nb) * dims * sizeof(float)));
  if (info.normalize) {  // torch.nn.functional.normalize: x / max(||x||, 1e-12)
    for (int64_t r = 0; r < nb; ++r) {
      float* v = out + static_cast<size_t>(r) * dims;
      double sq = 0;
      for (size_t i = 0; i < dims; ++i) sq += static_cast<double>(v[i]) * v[i];
      const double scale = 1.0 / std::max(std::sqrt(sq), 1e-12);
      for (size_t i = 0; i < dims; ++i) v[i] = static_cast<float>(v[i] * scale);
    }
  }
  return OkStatus();
}

EncoderModel::EncoderModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EncoderModel::~EncoderModel() = default;

const Tokenizer& EncoderModel::tokenizer() const { return *impl_->tokenizer; }

StatusOr<std::unique_ptr<EncoderModel>> EncoderModel::Load(const config::ModelConfig& config) {
  const auto start = std::chrono::steady_clock::now();
  auto impl = std::make_unique<Impl>();
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<ModelFiles> files, ModelFiles::Open(config.path));
  if (files->is_gguf()) {
    return Unimplemented(config.path,
                         ": embedding models load from a Hugging Face / sentence-transformers "
                         "folder (config.json, tokenizer.json, model.safetensors), not GGUF");
  }
  KILN_ASSIGN_OR_RETURN(impl->hp, BertFromHf(files->hf()->config));
  KILN_RETURN_IF_ERROR(files->IndexSafetensors(BertNaming(), impl->hp.num_layers));
  KILN_ASSIGN_OR_RETURN(impl->tokenizer, Tokenizer::FromHfFolder(*files->hf()));
  const Tokenizer& tok = *impl->tokenizer;
  impl->cls_id = tok.bos_id();
  impl->sep_id = tok.eos_id();
  if (impl->cls_id < 0 || impl->sep_id < 0 || !tok.add_bos() || !tok.add_eos()) {
    return InvalidArgument(config.path,
                           ": the tokenizer does not add [CLS] ... [SEP] (its post-processor "
                           "must wrap a text in a start and an end token)");
  }
  impl->pad_id = std::max(0, tok.pad_id());
  if (tok.vocab_size() > impl->hp.vocab_size) {
    return InvalidArgument(config.path, ": the tokenizer has ", tok.vocab_size(),
                           " tokens but config.json's vocab_size is ", impl->hp.vocab_size);
  }

  EncoderInfo info;
  info.name = files->DisplayModelName();
  info.architecture = impl->hp.architecture;
  info.dimensions = static_cast<int32_t>(impl->hp.hidden_size);
  info.num_layers = static_cast<int32_t>(impl->hp.num_layers);
  info.max_tokens = static_cast<int32_t>(std::min<int64_t>(impl->hp.context_length, 1 << 20));
  KILN_RETURN_IF_ERROR(ReadSentenceTransformersConfig(config.path, info));
  info.max_tokens =
      static_cast<int32_t>(std::min<int64_t>(info.max_tokens, impl->hp.context_length));
  if (config.context_length > 0) {
    if (config.context_length < 2) {
      return InvalidArgument("context_length ", config.context_length,
                             " leaves no room for a text between [CLS] and [SEP]");
    }
    info.max_tokens = std::min(info.max_tokens, config.context_length);
  }
  info.max_batch = config.max_batch_size > 0 ? config.max_batch_size : kDefaultMaxBatch;

  KILN_ASSIGN_OR_RETURN(impl->device, OpenModelDevice(config));
  impl->files = std::move(files);
  KILN_RETURN_IF_ERROR(impl->Build(info));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  spdlog::info(
      "{}: {} encoder, {} layers, {} dimensions, {} pooling{}, up to {} tokens and {} texts per "
      "step, on {} (loaded in {:.2f} s)",
      info.name, info.architecture, info.num_layers, info.dimensions,
      info.pooling == EmbeddingPooling::kCls ? "cls" : "mean", info.normalize ? ", normalised" : "",
      info.max_tokens, info.max_batch, impl->device.device->name(), seconds);
  auto model = std::unique_ptr<EncoderModel>(new EncoderModel(std::move(impl)));
  model->info_ = std::move(info);
  return model;
}

Status EncoderModel::CheckText(std::string_view text) {
  if (text.empty()) return InvalidArgument("the text is empty");
  if (const size_t bad = utf8::FindInvalid(text); bad != std::string_view::npos) {
    return InvalidArgument("the text is not valid UTF-8 (byte ", bad, ")");
  }
  return OkStatus();
}

StatusOr<EncodedText> EncoderModel::Tokenize(std::string_view text) const {
  KILN_RETURN_IF_ERROR(CheckText(text));
  EncodeOptions opts;
  opts.add_special_tokens = false;
  opts.parse_special = false;
  KILN_ASSIGN_OR_RETURN(std::vector<int32_t> body, impl_->tokenizer->Encode(text, opts));
  EncodedText out;
  const size_t room = static_cast<size_t>(info_.max_tokens) - 2;
  if (body.size() > room) {
    body.resize(room);
    out.truncated = true;
  }
  out.ids.reserve(body.size() + 2);
  out.ids.push_back(impl_->cls_id);
  out.ids.insert(out.ids.end(), body.begin(), body.end());
  out.ids.push_back(impl_->sep_id);
  return out;
}

StatusOr<std::vector<float>> EncoderModel::Embed(std::span<const std::vector<int32_t>> texts) {
  if (texts.empty()) return InvalidArgument("no texts to embed");
  const int32_t vocab = static_cast<int32_t>(impl_->hp.vocab_size);
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t>& t = texts[i];
    if (t.size() < 2 || t.size() > static_cast<size_t>(info_.max_tokens)) {
      return InvalidArgument("text ", i, " has ", t.size(), " tokens; the model takes 2 to ",
                             info_.max_tokens);
    }
    for (int32_t id : t) {
      if (id < 0 || id >= vocab) {
        return InvalidArgument("text ", i, " has token id ", id, " outside the vocabulary [0, ",
                               vocab, ")");
      }
    }
  }
  std::vector<float> out(texts.size() * static_cast<size_t>(info_.dimensions));
  // Texts of similar lengths share a step: sorted by length, so that a batch pads little.
  std::vector<size_t> order(texts.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return texts[a].size() < texts[b].size(); });
  const size_t dims = static_cast<size_t>(info_.dimensions);
  std::vector<std::vector<int32_t>> chunk;
  std::vector<float> rows;
  for (size_t begin = 0; begin < order.size(); begin += static_cast<size_t>(info_.max_batch)) {
    const size_t end = std::min(order.size(), begin + static_cast<size_t>(info_.max_batch));
    chunk.clear();
    for (size_t i = begin; i < end; ++i) chunk.push_back(texts[order[i]]);
    rows.resize(chunk.size() * dims);
    KILN_RETURN_IF_ERROR(impl_->RunBatch(info_, chunk, rows.data()));
    for (size_t i = begin; i < end; ++i) {
      std::copy_n(rows.begin() + static_cast<std::ptrdiff_t>((i - begin) * dims), dims,
                  out.begin() + static_cast<std::ptrdiff_t>(order[i] * dims));
    }
  }
  return out;
}

}  // namespace kiln::models
