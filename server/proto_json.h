// Protobuf message -> JSON as Triton's HTTP API prints it: proto field names, 64-bit integers
// as JSON numbers (protobuf's canonical JSON would print them as strings), enums by name,
// maps as objects, fields at their default value omitted except repeated/message fields
// that are set.
#pragma once

#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"

namespace kiln {

nlohmann::json ProtoToJson(const google::protobuf::Message& message);

}  // namespace kiln
