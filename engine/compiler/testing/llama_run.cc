#include "engine/compiler/testing/llama_run.h"

#include <algorithm>

namespace kiln::compiler::testing {

StatusOr<std::vector<double>> RunLlama(const LlamaConfig& cfg, backend::Device& dev,
                                       const LlamaRun& run) {
  KILN_ASSIGN_OR_RETURN(LlamaGraph m, BuildLlama(cfg));
  std::unique_ptr<Program> p;
  if (run.compiler) {
    CompilerOptions o;
    o.fuse = run.fuse;
    o.metrics = run.registry;
    o.label = "llama-test";
    KILN_ASSIGN_OR_RETURN(p, Compile(m.graph, {m.logits}, dev, o, run.report));
  } else {
    KILN_ASSIGN_OR_RETURN(p, kiln::Compile(m.graph, {m.logits}, dev));
  }
  KILN_ASSIGN_OR_RETURN(auto weights, RandomWeights(m.graph, dev, 7));
  for (auto& [name, t] : weights) KILN_RETURN_IF_ERROR(p->Bind(name, t));
  KILN_ASSIGN_OR_RETURN(auto stream, dev.CreateStream());
  // Fill the cache with `context` tokens first (a prefill), then run the step under test.
  if (run.context > 0) {
    KILN_RETURN_IF_ERROR(p->SetSymbol("T", run.seqs * run.context));
    KILN_RETURN_IF_ERROR(p->SetSymbol("S", run.seqs));
    KILN_ASSIGN_OR_RETURN(auto pre, StepInputs(cfg, dev, run.seqs, run.context, 0));
    for (auto& [name, t] : pre) KILN_RETURN_IF_ERROR(p->Bind(name, t));
    KILN_RETURN_IF_ERROR(p->Run(*stream));
  }
  KILN_RETURN_IF_ERROR(p->SetSymbol("T", run.seqs * run.new_tokens));
  KILN_RETURN_IF_ERROR(p->SetSymbol("S", run.seqs));
  KILN_ASSIGN_OR_RETURN(auto in, StepInputs(cfg, dev, run.seqs, run.new_tokens, run.context));
  for (auto& [name, t] : in) KILN_RETURN_IF_ERROR(p->Bind(name, t));
  KILN_RETURN_IF_ERROR(p->Run(*stream));
  KILN_RETURN_IF_ERROR(stream->Synchronize());
  KILN_ASSIGN_OR_RETURN(Tensor out, p->Output(0));
  if (dev.host_visible()) return out.ToDoubles();
  if (!out.IsContiguous()) return Unimplemented("RunLlama: a strided output on ", dev.name());
  std::vector<uint8_t> host(out.nbytes());
  KILN_RETURN_IF_ERROR(stream->CopyToHost(host.data(), *out.buffer(),
                                          DTypeBytes(out.dtype(), out.offset()), host.size()));
  std::vector<double> v(out.numel());
  for (int64_t i = 0; i < out.numel(); ++i) v[i] = LoadElement(host.data(), out.dtype(), i);
  return v;
}

double Nmse(const std::vector<double>& a, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < want.size(); ++i) {
    num += (a[i] - want[i]) * (a[i] - want[i]);
    den += want[i] * want[i];
  }
  if (a.size() != want.size()) return 1e30;
  return num / std::max(den, 1e-30);
}

}  // namespace kiln::compiler::testing
