// Test-only: the checkout a test binary was built from, where tests find tests/fixtures/,
// config/, docs/ and the default model.
//
// The path lives in one generated file (engine/testing/source_dir.cc.in, configured into the
// build tree) and in no compile command, so every other object is the same in any checkout
// and a compiler cache shares it between them (cmake/ccache.cmake).
#pragma once

namespace kiln {

// The repository root, absolute, without a trailing slash. Linked into every kiln_test target.
const char* TestSourceDir();

}  // namespace kiln
