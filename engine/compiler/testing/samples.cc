#include "engine/compiler/testing/samples.h"

#include <set>

#include "backends/harness/harness.h"
#include "engine/compiler/codegen.h"

namespace kiln::compiler::testing {

std::vector<Sample> SampleSpecs(bool fused) {
  (void)fused;
  std::vector<Sample> out;
  std::set<std::string> keys;
  for (const harness::OpCase& c : harness::ForwardCases(false)) {
    Graph g;
    Builder b(&g);
    std::vector<Value> in;
    for (const harness::InputSpec& s : c.inputs) {
      in.push_back(b.Input(s.name, s.dtype, SymShape(s.shape.begin(), s.shape.end())));
    }
    c.build(b, in);
    if (!b.ok()) continue;
    for (int32_t id = 0; id < g.size(); ++id) {
      const Node& n = g.node(id);
      const OpDef& def = GetOpDef(n.op);
      if (def.pointwise == nullptr && def.reduce == nullptr) continue;
      std::vector<TensorType> types;
      for (int32_t i : n.inputs) types.push_back({g.node(i).dtype, g.node(i).shape});
      backend::KernelRequest req;
      req.op = n.op;
      req.attrs = &n.attrs;
      req.inputs = types;
      req.output = {n.dtype, n.shape};
      StatusOr<KernelSpec> spec = SpecFromRequest(req);
      if (!spec.ok()) continue;
      StatusOr<GeneratedKernel> k = GenerateKernel(*spec, Dialect::kCpp);
      if (!k.ok() || !keys.insert(k->key).second) continue;
      out.push_back({StrCat(c.name, " / ", def.name), *std::move(spec)});
    }
  }
  return out;
}

}  // namespace kiln::compiler::testing
