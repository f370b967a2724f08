// Writing files that survive a crash: each write is followed by fsync, and directories are
// fsync'ed after entries are added, renamed or removed (what a rename-into-place protocol
// needs; see models/train/checkpoint.h).
//
// Thread-safety: free functions; concurrent writers of the same path race as with any file.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"

namespace kiln::models {

// Creates or truncates `path`, writes `bytes` and fsyncs the file (not its directory).
// Errors name the path and the failing system call.
Status WriteFileDurably(const std::string& path, std::string_view bytes);
// The same with the contents given in pieces, written in order (no concatenated copy).
Status WriteFileDurably(const std::string& path, const std::vector<std::string_view>& pieces);

// fsyncs a directory so that entries created, renamed or removed in it are durable.
Status FsyncDirectory(const std::string& dir);

// Reads a whole file. NotFound names the path.
StatusOr<std::string> ReadWholeFile(const std::string& path);

}  // namespace kiln::models
