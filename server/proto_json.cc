#include "server/proto_json.h"

#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"

namespace kiln {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

nlohmann::json Scalar(const Message& m, const Reflection& r, const FieldDescriptor* f, int index) {
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return rep ? r.GetRepeatedInt32(m, f, index) : r.GetInt32(m, f);
    case FieldDescriptor::CPPTYPE_INT64:
      return rep ? r.GetRepeatedInt64(m, f, index) : r.GetInt64(m, f);
    case FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r.GetRepeatedUInt32(m, f, index) : r.GetUInt32(m, f);
    case FieldDescriptor::CPPTYPE_UINT64:
      return rep ? r.GetRepeatedUInt64(m, f, index) : r.GetUInt64(m, f);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return rep ? r.GetRepeatedDouble(m, f, index) : r.GetDouble(m, f);
    case FieldDescriptor::CPPTYPE_FLOAT:
      return rep ? r.GetRepeatedFloat(m, f, index) : r.GetFloat(m, f);
    case FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r.GetRepeatedBool(m, f, index) : r.GetBool(m, f);
    case FieldDescriptor::CPPTYPE_ENUM:
      return (rep ? r.GetRepeatedEnum(m, f, index) : r.GetEnum(m, f))->name();
    case FieldDescriptor::CPPTYPE_STRING:
      return rep ? r.GetRepeatedString(m, f, index) : r.GetString(m, f);
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ProtoToJson(rep ? r.GetRepeatedMessage(m, f, index) : r.GetMessage(m, f));
  }
  return nullptr;
}

}  // namespace

nlohmann::json ProtoToJson(const Message& m) {
  nlohmann::json out = nlohmann::json::object();
  const Reflection& r = *m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r.ListFields(m, &fields);  // set fields only, in field-number order
  for (const FieldDescriptor* f : fields) {
    if (f->is_map()) {
      nlohmann::json obj = nlohmann::json::object();
      const FieldDescriptor* key = f->message_type()->map_key();
      const FieldDescriptor* value = f->message_type()->map_value();
      for (int i = 0; i < r.FieldSize(m, f); ++i) {
        const Message& entry = r.GetRepeatedMessage(m, f, i);
        const Reflection& er = *entry.GetReflection();
        nlohmann::json k = Scalar(entry, er, key, 0);
        obj[k.is_string() ? k.get<std::string>() : k.dump()] = Scalar(entry, er, value, 0);
      }
      out[f->name()] = std::move(obj);
    } else if (f->is_repeated()) {
      nlohmann::json arr = nlohmann::json::array();
      for (int i = 0; i < r.FieldSize(m, f); ++i) arr.push_back(Scalar(m, r, f, i));
      out[f->name()] = std::move(arr);
    } else {
      out[f->name()] = Scalar(m, r, f, 0);
    }
  }
  return out;
}

}  // namespace kiln
