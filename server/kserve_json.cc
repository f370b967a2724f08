#include "server/kserve_json.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "engine/base/json_parse.h"
#include "nlohmann/json.hpp"
#include "scheduler/model.h"
#include "server/kserve_codec.h"

namespace kiln {
namespace {

using nlohmann::json;

// Flattens nested arrays (row-major) into `out`.
void Flatten(const json& v, std::vector<const json*>& out) {
  if (v.is_array()) {
    for (const auto& e : v) Flatten(e, out);
  } else {
    out.push_back(&v);
  }
}

template <typename T>
void Put(std::string& raw, T v) {
  raw.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
Status PutInteger(const json& v, std::string& raw, const std::string& input, size_t i) {
  const bool ok_signed = v.is_number_integer() && !v.is_number_unsigned();
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(std::numeric_limits<T>::max())) {
      Put(raw, static_cast<T>(u));
      return OkStatus();
    }
  } else if (ok_signed) {
    const int64_t s = v.get<int64_t>();
    if ((std::is_signed_v<T> || s >= 0) &&
        s >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
        (s < 0 ||
         static_cast<uint64_t>(s) <= static_cast<uint64_t>(std::numeric_limits<T>::max()))) {
      Put(raw, static_cast<T>(s));
      return OkStatus();
    }
  }
  return InvalidArgument("input '", input, "': element ", i, " is ", v.dump(),
                         ", not an integer in range for its datatype");
}

Status EncodeData(const json& data, const HostTensor& t, int64_t elements, std::string& raw) {
  std::vector<const json*> flat;
  Flatten(data, flat);
  if (static_cast<int64_t>(flat.size()) != elements) {
    return InvalidArgument("input '", t.name, "' has ", flat.size(),
                           " elements in `data` but its shape ", ShapeToString(t.shape), " has ",
                           elements);
  }
  for (size_t i = 0; i < flat.size(); ++i) {
    const json& v = *flat[i];
    Status s = OkStatus();
    switch (t.datatype) {
      case DataType::kBool:
        if (!v.is_boolean()) {
          return InvalidArgument("input '", t.name, "': element ", i, " is ", v.dump(),
                                 ", expected true or false");
        }
        raw.push_back(v.get<bool>() ? 1 : 0);
        break;
      case DataType::kInt8:
        s = PutInteger<int8_t>(v, raw, t.name, i);
        break;
      case DataType::kInt16:
        s = PutInteger<int16_t>(v, raw, t.name, i);
        break;
      case DataType::kInt32:
        s = PutInteger<int32_t>(v, raw, t.name, i);
        break;
      case DataType::kInt64:
        s = PutInteger<int64_t>(v, raw, t.name, i);
        break;
      case DataType::kUint8:
        s = PutInteger<uint8_t>(v, raw, t.name, i);
        break;
      case DataType::kUint16:
        s = PutInteger<uint16_t>(v, raw, t.name, i);
        break;
      case DataType::kUint32:
        s = PutInteger<uint32_t>(v, raw, t.name, i);
        break;
      case DataType::kUint64:
        s = PutInteger<uint64_t>(v, raw, t.name, i);
        break;
      case DataType::kFp32:
      case DataType::kFp64:
        if (!v.is_number()) {
          return InvalidArgument("input '", t.name, "': element ", i, " is ", v.dump(),
                                 ", expected a number");
        }
        if (t.datatype == DataType::kFp32) {
          Put(raw, v.get<float>());
        } else {
          Put(raw, v.get<double>());
        }
        break;
      case DataType::kBytes: {
        if (!v.is_string()) {
          return InvalidArgument("input '", t.name, "': element ", i, " is ", v.dump(),
                                 ", expected a string");
        }
        const std::string& str = v.get_ref<const std::string&>();
        Put(raw, static_cast<uint32_t>(str.size()));
        raw += str;
        break;
      }
      default:
        return InvalidArgument("input '", t.name, "' is ", DataTypeName(t.datatype),
                               ", which JSON cannot carry: send it as binary data "
                               "(parameters.binary_data_size)");
    }
    KILN_RETURN_IF_ERROR(s);
  }
  return OkStatus();
}

StatusOr<ParamValue> JsonParam(const std::string& key, const json& v) {
  if (v.is_boolean()) return ParamValue(v.get<bool>());
  if (v.is_number_unsigned()) return ParamValue(v.get<uint64_t>());
  if (v.is_number_integer()) return ParamValue(v.get<int64_t>());
  if (v.is_number_float()) return ParamValue(v.get<double>());
  if (v.is_string()) return ParamValue(v.get<std::string>());
  return InvalidArgument("parameter '", key, "' must be a boolean, number or string");
}

template <typename T>
json Numbers(const std::string& raw) {
  json arr = json::array();
  const size_t n = raw.size() / sizeof(T);
  for (size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, raw.data() + i * sizeof(T), sizeof(T));
    arr.push_back(v);
  }
  return arr;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    f = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    f = std::ldexp(static_cast<float>(mant | 0x400), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= sign;
  std::memcpy(&f, &bits, 4);
  return f;
}

json DataToJson(const HostTensor& t) {
  switch (t.datatype) {
    case DataType::kBool: {
      json arr = json::array();
      for (char c : t.data) arr.push_back(c != 0);
      return arr;
    }
    case DataType::kInt8:
      return Numbers<int8_t>(t.data);
    case DataType::kInt16:
      return Numbers<int16_t>(t.data);
    case DataType::kInt32:
      return Numbers<int32_t>(t.data);
    case DataType::kInt64:
      return Numbers<int64_t>(t.data);
    case DataType::kUint8:
      return Numbers<uint8_t>(t.data);
    case DataType::kUint16:
      return Numbers<uint16_t>(t.data);
    case DataType::kUint32:
      return Numbers<uint32_t>(t.data);
    case DataType::kUint64:
      return Numbers<uint64_t>(t.data);
    case DataType::kFp32:
      return Numbers<float>(t.data);
    case DataType::kFp64:
      return Numbers<double>(t.data);
    case DataType::kFp16:
    case DataType::kBf16: {
      json arr = json::array();
      for (size_t i = 0; i + 2 <= t.data.size(); i += 2) {
        uint16_t h;
        std::memcpy(&h, t.data.data() + i, 2);
        if (t.datatype == DataType::kFp16) {
          arr.push_back(HalfToFloat(h));
        } else {
          uint32_t bits = static_cast<uint32_t>(h) << 16;
          float f;
          std::memcpy(&f, &bits, 4);
          arr.push_back(f);
        }
      }
      return arr;
    }
    case DataType::kBytes: {
      json arr = json::array();
      size_t pos = 0;
      while (pos + 4 <= t.data.size()) {
        uint32_t len;
        std::memcpy(&len, t.data.data() + pos, 4);
        arr.push_back(t.data.substr(pos + 4, len));
        pos += 4 + len;
      }
      return arr;
    }
    default:
      return json::array();
  }
}

}  // namespace

StatusOr<JsonInferRequest> DecodeJsonInferRequest(std::string body,
                                                  std::optional<size_t> header_length,
                                                  std::string model_name, std::string version,
                                                  const SharedMemoryManager* shm) {
  size_t json_size = body.size();
  if (header_length) {
    if (*header_length > body.size()) {
      return InvalidArgument("Inference-Header-Content-Length is ", *header_length,
                             " but the body has only ", body.size(), " bytes");
    }
    json_size = *header_length;
  }
  KILN_ASSIGN_OR_RETURN(
      json doc, ParseJsonObject(std::string_view(body).substr(0, json_size),
                                header_length ? "the request's JSON header" : "the request body"));

  JsonInferRequest out;
  out.request = std::make_unique<InferenceRequest>();
  InferenceRequest& req = *out.request;
  req.model_name = std::move(model_name);
  req.model_version = std::move(version);
  if (auto it = doc.find("id"); it != doc.end()) {
    if (!it->is_string()) return InvalidArgument("`id` must be a string");
    req.id = it->get<std::string>();
  }
  if (auto it = doc.find("parameters"); it != doc.end()) {
    if (!it->is_object()) return InvalidArgument("`parameters` must be an object");
    for (const auto& [key, value] : it->items()) {
      if (key == "binary_data_output") {
        if (!value.is_boolean()) return InvalidArgument("`binary_data_output` must be a boolean");
        out.all_binary = value.get<bool>();
        continue;
      }
      KILN_ASSIGN_OR_RETURN(ParamValue v, JsonParam(key, value));
      KILN_RETURN_IF_ERROR(ApplyRequestParameter(key, v, req));
    }
  }
  auto inputs = doc.find("inputs");
  if (inputs == doc.end() || !inputs->is_array()) {
    return InvalidArgument("`inputs` must be an array of tensors");
  }
  size_t binary_pos = json_size;
  uint64_t shm_budget = shm != nullptr ? shm->max_input_bytes() : 0;
  for (size_t i = 0; i < inputs->size(); ++i) {
    const json& in = (*inputs)[i];
    if (!in.is_object()) return InvalidArgument("inputs[", i, "] must be an object");
    HostTensor t;
    auto name = in.find("name");
    if (name == in.end() || !name->is_string()) {
      return InvalidArgument("inputs[", i, "].name must be a string");
    }
    t.name = name->get<std::string>();
    auto dt = in.find("datatype");
    if (dt == in.end() || !dt->is_string()) {
      return InvalidArgument("input '", t.name, "': `datatype` must be a string");
    }
    auto type = ParseDataType(dt->get<std::string>());
    if (!type) {
      return InvalidArgument("input '", t.name, "' has unknown datatype '", dt->get<std::string>(),
                             "'; expected one of ", AllDataTypeNames());
    }
    t.datatype = *type;
    auto shape = in.find("shape");
    if (shape == in.end() || !shape->is_array()) {
      return InvalidArgument("input '", t.name, "': `shape` must be an array of integers");
    }
    for (const auto& d : *shape) {
      if (!d.is_number_integer()) {
        return InvalidArgument("input '", t.name, "': `shape` must be an array of integers");
      }
      t.shape.push_back(d.get<int64_t>());
    }
    auto elements = ElementCount(t.shape);
    if (!elements) {
      return InvalidArgument("input '", t.name, "' has shape ", ShapeToString(t.shape),
                             ": dimensions must be non-negative and the element count must "
                             "fit in 64 bits");
    }
    std::optional<uint64_t> binary_size;
    const std::string what = StrCat("input '", t.name, "'");
    ShmParams shm_params;
    if (auto params = in.find("parameters"); params != in.end()) {
      if (!params->is_object()) {
        return InvalidArgument("input '", t.name, "': `parameters` must be an object");
      }
      for (const auto& [key, value] : params->items()) {
        if (key.starts_with("shared_memory_")) {
          KILN_ASSIGN_OR_RETURN(ParamValue v, JsonParam(key, value));
          KILN_RETURN_IF_ERROR(TakeShmParam(what, key, v, shm_params).status());
        } else if (key == "binary_data_size") {
          if (!value.is_number_unsigned() && !value.is_number_integer()) {
            return InvalidArgument("input '", t.name, "': binary_data_size must be an integer");
          }
          if (value.get<int64_t>() < 0) {
            return InvalidArgument("input '", t.name, "': binary_data_size must not be negative");
          }
          binary_size = value.get<uint64_t>();
        }
      }
    }
    auto data = in.find("data");
    KILN_ASSIGN_OR_RETURN(auto block, ResolveShm(shm, what, shm_params));
    if (block) {
      if (binary_size || data != in.end()) {
        return InvalidArgument(what, " is in shared memory region '", block->region,
                               "' but also has ", binary_size ? "binary_data_size" : "`data`",
                               "; send one or the other");
      }
      KILN_RETURN_IF_ERROR(ReadShmInput(*block, t, &shm_budget));
    } else if (binary_size) {
      if (data != in.end()) {
        return InvalidArgument("input '", t.name,
                               "' has both `data` and binary_data_size; use one");
      }
      if (!header_length) {
        return InvalidArgument("input '", t.name,
                               "' has binary_data_size but the request has no "
                               "Inference-Header-Content-Length header");
      }
      if (*binary_size > body.size() - binary_pos) {
        return InvalidArgument("input '", t.name, "' declares ", *binary_size,
                               " bytes of binary data but only ", body.size() - binary_pos,
                               " remain in the body");
      }
      t.data = body.substr(binary_pos, *binary_size);
      binary_pos += *binary_size;
    } else {
      if (data == in.end()) {
        return InvalidArgument("input '", t.name, "' has neither `data` nor binary_data_size");
      }
      KILN_RETURN_IF_ERROR(EncodeData(*data, t, *elements, t.data));
    }
    req.inputs.push_back(std::move(t));
  }
  if (binary_pos != body.size()) {
    return InvalidArgument("the body has ", body.size() - binary_pos,
                           " bytes of binary data that no input claims (binary_data_size)");
  }
  if (auto outputs = doc.find("outputs"); outputs != doc.end()) {
    if (!outputs->is_array()) return InvalidArgument("`outputs` must be an array");
    for (size_t i = 0; i < outputs->size(); ++i) {
      const json& o = (*outputs)[i];
      if (!o.is_object() || !o.contains("name") || !o["name"].is_string()) {
        return InvalidArgument("outputs[", i, "] must be an object with a string `name`");
      }
      std::string oname = o["name"].get<std::string>();
      const std::string what = StrCat("output '", oname, "'");
      ShmParams shm_params;
      if (auto params = o.find("parameters"); params != o.end() && params->is_object()) {
        for (const auto& [key, value] : params->items()) {
          if (key == "binary_data" && value.is_boolean() && value.get<bool>()) {
            out.binary_outputs.push_back(oname);
          } else if (key == "classification") {
            return InvalidArgument(what, ": the classification extension is not supported by Kiln");
          } else if (key.starts_with("shared_memory_")) {
            KILN_ASSIGN_OR_RETURN(ParamValue v, JsonParam(key, value));
            KILN_RETURN_IF_ERROR(TakeShmParam(what, key, v, shm_params).status());
          }
        }
      }
      KILN_ASSIGN_OR_RETURN(auto block, ResolveShm(shm, what, shm_params));
      if (block) out.shm_outputs.push_back({oname, *std::move(block)});
      req.requested_outputs.push_back(std::move(oname));
    }
  }
  KILN_RETURN_IF_ERROR(CheckShmOutputsDisjoint(out.shm_outputs));
  return out;
}

JsonInferResponse EncodeJsonInferResponse(const std::string& model_name, const std::string& id,
                                          InferenceResponse&& response,
                                          const std::vector<std::string>& binary_outputs,
                                          bool all_binary, const ShmOutputs* shm_outputs) {
  json doc = {{"model_name", model_name}, {"model_version", std::string(kModelVersion)}};
  if (!id.empty()) doc["id"] = id;
  json outputs = json::array();
  std::string binary;
  for (HostTensor& t : response.outputs) {
    json o = {
        {"name", t.name}, {"datatype", std::string(DataTypeName(t.datatype))}, {"shape", t.shape}};
    const bool as_binary = all_binary || std::find(binary_outputs.begin(), binary_outputs.end(),
                                                   t.name) != binary_outputs.end();
    if (const ShmOutput* shm = FindShmOutput(shm_outputs, t.name)) {
      o["parameters"] = {{"shared_memory_region", shm->block.region},
                         {"shared_memory_byte_size", t.data.size()},
                         {"shared_memory_offset", shm->block.offset}};
    } else if (as_binary) {
      o["parameters"] = {{"binary_data_size", t.data.size()}};
      binary += t.data;
    } else {
      o["data"] = DataToJson(t);
    }
    outputs.push_back(std::move(o));
  }
  doc["outputs"] = std::move(outputs);
  JsonInferResponse out;
  out.body = doc.dump(-1, ' ', false, json::error_handler_t::replace);
  if (!binary.empty() || all_binary || !binary_outputs.empty()) {
    out.header_length = out.body.size();
    out.body += binary;
  }
  return out;
}

}  // namespace kiln
