#include "engine/graph.h"

#include <cctype>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace kiln {

Dim Graph::AddSymbol(std::string name, int64_t max, int64_t min) {
  KILN_CHECK(num_symbols() < kMaxSymbols, "too many symbols in one graph");
  KILN_CHECK(0 <= min && min <= max, "symbol range must satisfy 0 <= min <= max");
  KILN_CHECK(FindSymbol(name) < 0, "symbol declared twice");
  symbols_.push_back({name, min, max});
  symbol_names_.push_back(std::move(name));
  return Dim::Symbol(num_symbols() - 1);
}

int Graph::FindSymbol(std::string_view name) const {
  for (int i = 0; i < num_symbols(); ++i) {
    if (symbols_[i].name == name) return i;
  }
  return -1;
}

std::vector<int64_t> Graph::SymbolMaxValues() const {
  std::vector<int64_t> v;
  for (const SymbolInfo& s : symbols_) v.push_back(s.max);
  return v;
}

int32_t Graph::AddNode(Node node) {
  nodes_.push_back(std::move(node));
  return size() - 1;
}

int Graph::NumOutputs(int32_t id) const {
  int n = 1;
  for (int32_t j = id + 1; j < size() && nodes_[j].op == OpKind::kOutputOf &&
                           nodes_[j].inputs.size() == 1 && nodes_[j].inputs[0] == id;
       ++j) {
    ++n;
  }
  return n;
}

std::vector<int32_t> Graph::Sources(OpKind kind) const {
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < size(); ++i) {
    if (nodes_[i].op == kind) ids.push_back(i);
  }
  return ids;
}

int32_t Graph::FindByName(std::string_view name) const {
  for (int32_t i = 0; i < size(); ++i) {
    if (nodes_[i].name == name) return i;
  }
  return -1;
}

std::string TypeString(DType dtype, const SymShape& shape, const Graph& g) {
  return absl::StrCat(DTypeName(dtype), ShapeString(shape, g.symbol_names()));
}

void Graph::Print(std::ostream& os, const std::vector<std::string>* marks) const {
  if (!symbols_.empty()) {
    os << "symbols:";
    for (const SymbolInfo& s : symbols_)
      os << " " << s.name << "=[" << s.min << "," << s.max << "]";
    os << "\n";
  }
  for (int32_t i = 0; i < size(); ++i) {
    const Node& n = nodes_[i];
    os << "%" << i;
    if (!n.name.empty()) os << " " << n.name;
    os << ": " << TypeString(n.dtype, n.shape, *this) << " = " << OpName(n.op) << "(";
    for (size_t j = 0; j < n.inputs.size(); ++j) os << (j ? ", %" : "%") << n.inputs[j];
    os << ")" << n.attrs.ToString(n.op, symbol_names_);
    if (marks && i < static_cast<int32_t>(marks->size()) && !(*marks)[i].empty()) {
      os << "  # " << (*marks)[i];
    }
    os << "\n";
  }
}

std::string Graph::ToString() const {
  std::ostringstream os;
  Print(os);
  return os.str();
}

int32_t InPlaceTarget(const Graph& g, int32_t id) {
  const Node& n = g.node(id);
  int32_t producer = id;
  int64_t output = 0;
  if (n.op == OpKind::kOutputOf) {
    producer = n.inputs[0];
    output = n.attrs.ints.empty() ? 0 : n.attrs.ints[0];
  }
  if (output < 0 || output >= kMaxOutputs) return -1;
  const Node& p = g.node(producer);
  const int j = GetOpDef(p.op).writes_input[output];
  return j >= 0 && j < static_cast<int>(p.inputs.size()) ? p.inputs[j] : -1;
}

int32_t StorageOwner(const Graph& g, int32_t id) {
  for (;;) {
    const Node& n = g.node(id);
    if (GetOpDef(n.op).cls == OpClass::kView) {
      id = n.inputs[0];
      continue;
    }
    const int32_t target = InPlaceTarget(g, id);
    if (target < 0) return id;
    id = target;
  }
}

std::string_view BlockScope(std::string_view name) {
  const size_t dot = name.find('.');
  if (dot == std::string_view::npos || dot == 0) return {};
  size_t i = dot + 1;
  const size_t digits = i;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
  if (i == digits || i >= name.size() || name[i] != '.') return {};
  return name.substr(0, i);
}

}  // namespace kiln
