// Small networking helpers for the front ends.
#pragma once

#include <string>
#include <string_view>

#include "engine/base/status.h"

namespace kiln {

// Tries to bind and listen on `address` (HOST:PORT, [IPv6]:PORT) and closes the socket
// again. Returns the OS's reason when that fails ("address already in use"), so a front end
// whose own bind failed without a reason (gRPC) can say why.
Status ProbeListen(std::string_view address);

}  // namespace kiln
