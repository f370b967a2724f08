#include "engine/compiler/region.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include "absl/strings/str_join.h"
#include "engine/compiler/hash.h"

namespace kiln::compiler {
namespace {

// "blk.3.attn_norm" -> ("blk", "blk.3"); names without a `<word>.<number>.` prefix -> empty.
bool ScopeOf(const std::string& name, std::string* family, std::string* scope) {
  const std::string_view s = BlockScope(name);
  if (s.empty()) return false;
  *family = std::string(s.substr(0, s.find('.')));
  *scope = std::string(s);
  return true;
}

}  // namespace

int RegionReport::RepeatedInstances() const {
  int n = 0;
  for (const RegionClass& c : classes) {
    if (c.instances.size() > 1) n += static_cast<int>(c.instances.size());
  }
  return n;
}

std::string RegionReport::Summary() const {
  if (regions == 0) return "no regions";
  std::map<std::string, std::vector<int>> by_family;
  for (const RegionClass& c : classes) {
    by_family[c.family].push_back(static_cast<int>(c.instances.size()));
  }
  std::vector<std::string> parts;
  for (const auto& [family, counts] : by_family) {
    int total = 0;
    for (int c : counts) total += c;
    parts.push_back(StrCat(total, " regions ", family, ".N in ", counts.size(), " structure",
                           counts.size() == 1 ? "" : "s", " (", absl::StrJoin(counts, " + "), ")"));
  }
  return absl::StrJoin(parts, "; ");
}

RegionReport FindRegions(const Graph& g) {
  const int32_t n = g.size();
  // Region of each computing node: its own scope, else the next named node's.
  std::vector<std::string> scope(n), family(n);
  std::string next_scope, next_family;
  for (int32_t i = n - 1; i >= 0; --i) {
    const Node& node = g.node(i);
    if (GetOpDef(node.op).cls == OpClass::kSource) continue;
    std::string f, s;
    if (!node.name.empty()) {
      if (ScopeOf(node.name, &f, &s)) {
        next_scope = s;
        next_family = f;
      } else {
        next_scope.clear();
        next_family.clear();
      }
    }
    scope[i] = next_scope;
    family[i] = next_family;
  }
  // Members of each region, in graph order.
  std::map<std::string, std::vector<int32_t>> members;
  std::map<std::string, std::string> family_of;
  for (int32_t i = 0; i < n; ++i) {
    if (scope[i].empty()) continue;
    members[scope[i]].push_back(i);
    family_of[scope[i]] = family[i];
  }
  RegionReport r;
  r.regions = static_cast<int>(members.size());
  std::unordered_map<std::string, size_t> class_of;  // family + hash -> classes index
  std::vector<std::pair<int, std::string>> order;    // for deterministic instance order
  for (const auto& [sc, ids] : members) {
    std::unordered_map<int32_t, int> pos;
    for (size_t k = 0; k < ids.size(); ++k) pos[ids[k]] = static_cast<int>(k);
    Hasher h;
    for (int32_t id : ids) {
      const Node& node = g.node(id);
      h.Add(OpName(node.op));
      h.Add(node.attrs.ToString(node.op, g.symbol_names()));
      h.Add(TypeString(node.dtype, node.shape, g));
      for (int32_t in : node.inputs) {
        const Node& src = g.node(in);
        auto it = pos.find(in);
        if (it != pos.end()) {
          h.Add(StrCat("r", it->second));
        } else {
          // Outside values are parameters: sources by kind and type, activations by type.
          const bool source = GetOpDef(src.op).cls == OpClass::kSource;
          h.Add(StrCat(source ? OpName(src.op) : "ext", ":", TypeString(src.dtype, src.shape, g)));
        }
      }
    }
    const std::string hash = h.Hex().substr(0, 16);
    const std::string key = family_of[sc] + "/" + hash;
    auto it = class_of.find(key);
    if (it == class_of.end()) {
      it = class_of.emplace(key, r.classes.size()).first;
      r.classes.push_back({family_of[sc], hash, {}, static_cast<int>(ids.size())});
    }
    r.classes[it->second].instances.push_back(sc);
  }
  // Natural order of instances ("blk.2" before "blk.10"), most instances first.
  auto index = [](const std::string& s) {
    const size_t dot = s.find('.');
    return std::atoll(s.c_str() + dot + 1);
  };
  for (RegionClass& c : r.classes) {
    std::sort(c.instances.begin(), c.instances.end(),
              [&](const std::string& a, const std::string& b) { return index(a) < index(b); });
  }
  std::stable_sort(r.classes.begin(), r.classes.end(),
                   [](const RegionClass& a, const RegionClass& b) {
                     return a.instances.size() > b.instances.size();
                   });
  return r;
}

}  // namespace kiln::compiler
