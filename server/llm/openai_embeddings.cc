#include "server/llm/openai_embeddings.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/llm/openai_http.h"
#include "server/llm/params.h"
#include "server/status_mapping.h"
#include "server/tracing.h"

namespace kiln::llm {
namespace {

using nlohmann::json;
using Responder = std::shared_ptr<http::Responder>;

constexpr size_t kMaxInputs = 2048;  // OpenAI's limit on texts per request

// Answers and ends the request's trace (null: not traced) with the answer's status.
void Send(const Responder& r, int status, const json& body, RequestTrace* trace,
          const Status& outcome = OkStatus()) {
  http::Response resp;
  resp.status = status;
  resp.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  resp.headers = TraceHeaders(trace);
  r->Send(std::move(resp));
  if (trace) trace->End(outcome);
}

void SendError(const Responder& r, const Status& s, RequestTrace* trace) {
  Send(r, ToHttpStatus(s), OpenAiError(s), trace, s);
}

struct EmbeddingsCall {
  std::string model;
  std::vector<std::string> texts;
  bool base64 = false;
  bool truncate = false;
  int64_t dimensions = 0;  // 0: the model's
};

Status InputError(std::string_view what) { return WithParam(InvalidArgument(what), "input"); }

StatusOr<EmbeddingsCall> ReadCall(const std::string& body) {
  KILN_ASSIGN_OR_RETURN(json j, ParseJsonObject(body, "the request body"));
  JsonFields f(j);
  EmbeddingsCall c;
  KILN_ASSIGN_OR_RETURN(auto model, f.String("model"));
  if (!model || model->empty()) {
    return WithParam(InvalidArgument("`model` is missing: name an embedding model"), "model");
  }
  c.model = *model;
  const json* input = f.Get("input");
  if (input == nullptr) {
    return InputError("`input` is missing: send a string or a list of strings");
  }
  if (input->is_string()) {
    c.texts.push_back(input->get<std::string>());
  } else if (input->is_array()) {
    if (input->empty()) return InputError("`input` is an empty list");
    if (input->size() > kMaxInputs) {
      return InputError(absl::StrCat("`input` has ", input->size(), " texts; at most ", kMaxInputs,
                                     " per request"));
    }
    for (const json& e : *input) {
      if (e.is_number() || e.is_array()) {
        return InputError(
            "`input` holds token ids; Kiln embeds text only (send the strings themselves)");
      }
      if (!e.is_string()) return InputError("`input` must be a string or a list of strings");
      c.texts.push_back(e.get<std::string>());
    }
  } else {
    return InputError("`input` must be a string or a list of strings");
  }
  for (size_t i = 0; i < c.texts.size(); ++i) {
    if (c.texts[i].empty()) {
      return InputError(c.texts.size() == 1 ? std::string("`input` is an empty string")
                                            : absl::StrCat("`input[", i, "]` is an empty string"));
    }
  }
  KILN_ASSIGN_OR_RETURN(auto format, f.String("encoding_format"));
  if (format && *format != "float" && *format != "base64") {
    return WithParam(
        InvalidArgument("`encoding_format` is '", *format, "'; it must be float or base64"),
        "encoding_format");
  }
  c.base64 = format && *format == "base64";
  KILN_ASSIGN_OR_RETURN(auto dims, f.Int("dimensions"));
  if (dims) {
    if (*dims < 1) {
      return WithParam(InvalidArgument("`dimensions` is ", *dims, "; it must be at least 1"),
                       "dimensions");
    }
    c.dimensions = *dims;
  }
  KILN_ASSIGN_OR_RETURN(auto truncate, f.Bool("truncate"));
  c.truncate = truncate.value_or(false);
  KILN_ASSIGN_OR_RETURN(auto user, f.String("user"));  // accepted, as OpenAI's: for abuse tracking
  (void)user;
  return c;
}

// The answer being gathered from the batches one call was split into.
struct Gather {
  std::mutex mu;
  Responder r;
  std::shared_ptr<RequestTrace> trace;  // null: not traced
  EmbeddingsCall call;
  InflightLimiter::Ticket ticket;
  size_t model_dims = 0;
  // Batches take the texts in order of length (less padding per step): batch row k is text
  // order[k].
  std::vector<size_t> order;
  std::vector<float> vectors;         // [texts, model_dims], in the request's order
  std::vector<int32_t> token_counts;  // per text
  size_t pending = 0;
  Status status;  // the first failure
  bool refused_long = false;

  // Records one batch (rows [first, first + rows) of `order`); the last one answers.
  void Done(size_t first, InferenceResponse&& resp);
  void Answer();
};

void Gather::Done(size_t first, InferenceResponse&& resp) {
  std::lock_guard<std::mutex> lock(mu);
  if (status.ok() && !resp.status.ok()) status = resp.status;
  if (status.ok() && resp.outputs.size() == 3) {
    const HostTensor& emb = resp.outputs[0];
    const HostTensor& counts = resp.outputs[1];
    const HostTensor& cut = resp.outputs[2];
    const size_t rows = counts.data.size() / sizeof(int32_t);
    if (emb.data.size() != rows * model_dims * sizeof(float) || cut.data.size() != rows) {
      status = Internal("the embedding model answered ", rows, " rows of mismatched sizes");
    } else {
      for (size_t i = 0; i < rows; ++i) {
        const size_t text = order[first + i];
        std::memcpy(vectors.data() + text * model_dims,
                    emb.data.data() + i * model_dims * sizeof(float), model_dims * sizeof(float));
        std::memcpy(&token_counts[text], counts.data.data() + i * sizeof(int32_t), sizeof(int32_t));
        if (cut.data[i] != 0 && !call.truncate) {
          status = WithParam(
              InvalidArgument(call.texts.size() == 1 ? std::string("`input`")
                                                     : absl::StrCat("`input[", text, "]`"),
                              " is longer than the model's ", token_counts[text],
                              " tokens; shorten it or send `truncate: true` to cut it"),
              "input");
          break;
        }
      }
    }
  } else if (status.ok()) {
    status = Internal("the embedding model answered ", resp.outputs.size(), " outputs, not 3");
  }
  if (--pending == 0) Answer();
}

void Gather::Answer() {
  ticket.Release();
  if (!status.ok()) return SendError(r, status, trace.get());
  const size_t dims = call.dimensions > 0 ? static_cast<size_t>(call.dimensions) : model_dims;
  json data = json::array();
  int64_t tokens = 0;
  std::vector<float> v(dims);
  for (size_t i = 0; i < call.texts.size(); ++i) {
    std::memcpy(v.data(), vectors.data() + i * model_dims, dims * sizeof(float));
    if (dims < model_dims) {  // shortened: back to unit length, as OpenAI's `dimensions`
      double sq = 0;
      for (float x : v) sq += static_cast<double>(x) * x;
      const double scale = 1.0 / std::max(std::sqrt(sq), 1e-12);
      for (float& x : v) x = static_cast<float>(x * scale);
    }
    json item = {{"object", "embedding"}, {"index", i}};
    if (call.base64) {
      item["embedding"] = absl::Base64Escape(
          absl::string_view(reinterpret_cast<const char*>(v.data()), dims * sizeof(float)));
    } else {
      item["embedding"] = v;
    }
    data.push_back(std::move(item));
    tokens += token_counts[i];
  }
  Send(r, 200,
       {{"object", "list"},
        {"data", std::move(data)},
        {"model", call.model},
        {"usage", {{"prompt_tokens", tokens}, {"total_tokens", tokens}}}},
       trace.get());
}

}  // namespace

void HandleEmbeddings(ServerCore& core, const http::Request& req, const Responder& r) {
  // Traced as the other routes: the root span, then each batch's queue and execute spans.
  std::shared_ptr<RequestTrace> trace = BeginHttpTrace(core, req);
  auto fail = [&](const Status& s) { SendError(r, s, trace.get()); };
  StatusOr<EmbeddingsCall> call = ReadCall(req.body);
  if (!call.ok()) return fail(call.status());
  auto model = core.repository->GetReady(call->model);
  if (!model.ok()) {
    return fail(model.status().code() == StatusCode::kNotFound ? WithParam(model.status(), "model")
                                                               : model.status());
  }
  const ModelSignature& sig = (*model)->signature();
  if (!(*model)->is_embedding() || sig.outputs.empty()) {
    return fail(WithParam(InvalidArgument("model '", call->model,
                                          "' is not an embedding model (serve one with "
                                          "`kind: embedding`)"),
                          "model"));
  }
  const size_t model_dims = static_cast<size_t>(sig.outputs[0].dims.at(0));
  if (call->dimensions > static_cast<int64_t>(model_dims)) {
    return fail(WithParam(InvalidArgument("`dimensions` is ", call->dimensions, "; model '",
                                          call->model, "' gives ", model_dims),
                          "dimensions"));
  }
  auto ticket = core.Admit();
  if (!ticket.ok()) return fail(ticket.status());

  auto gather = std::make_shared<Gather>();
  gather->r = r;
  gather->trace = trace;
  gather->model_dims = model_dims;
  gather->ticket = std::move(*ticket);
  const size_t n = call->texts.size();
  gather->vectors.resize(n * model_dims);
  gather->token_counts.resize(n);
  gather->order.resize(n);
  for (size_t i = 0; i < n; ++i) gather->order[i] = i;
  std::stable_sort(gather->order.begin(), gather->order.end(), [&](size_t a, size_t b) {
    return call->texts[a].size() < call->texts[b].size();
  });
  const size_t per_request = static_cast<size_t>(std::max(1, sig.max_batch_size));
  auto cancel = std::make_shared<CancelFlag>();
  std::weak_ptr<Model> weak = *model;
  r->OnClientGone([cancel, weak] {
    cancel->Cancel();
    if (auto m = weak.lock()) m->WakeUp();
  });
  // Every batch request is built first, then queued: the count is final before any answers.
  std::vector<std::unique_ptr<InferenceRequest>> requests;
  for (size_t first = 0; first < n; first += per_request) {
    const size_t rows = std::min(per_request, n - first);
    auto request = std::make_unique<InferenceRequest>();
    request->model_name = call->model;
    request->cancel = cancel;
    request->trace = trace;
    HostTensor text{
        std::string(kEmbeddingInput), DataType::kBytes, {static_cast<int64_t>(rows), 1}, {}};
    for (size_t i = first; i < first + rows; ++i) {
      AppendBytesElement(text.data, call->texts[gather->order[i]]);
    }
    request->inputs.push_back(std::move(text));
    request->on_complete = [gather, first](InferenceResponse&& resp) {
      gather->Done(first, std::move(resp));
    };
    requests.push_back(std::move(request));
  }
  gather->call = *std::move(call);
  {
    std::lock_guard<std::mutex> lock(gather->mu);
    gather->pending = requests.size();
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    Status s = (*model)->Infer(requests[i]);
    if (s.ok()) continue;
    // Refused (bad text, queue full): that batch and the ones never queued fail with it.
    if (ParamOf(s).empty() && s.code() == StatusCode::kInvalidArgument) s = WithParam(s, "input");
    std::lock_guard<std::mutex> lock(gather->mu);
    if (gather->status.ok()) gather->status = s;
    gather->pending -= requests.size() - i;
    cancel->Cancel();
    (*model)->WakeUp();
    if (gather->pending == 0) gather->Answer();
    return;
  }
}

}  // namespace kiln::llm
