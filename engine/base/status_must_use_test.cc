// Compiled twice by status_must_use_test.sh: as is it must compile; with -DKILN_DROP it must
// fail because a Status is dropped.
#include "engine/base/status.h"

namespace {
kiln::Status Check(int v) { return v > 0 ? kiln::OkStatus() : kiln::InvalidArgument("v"); }
struct S {
  kiln::Status Run() const { return Check(1); }
};
}  // namespace

int main() {
  kiln::Status s = Check(1);
  (void)Check(0);  // an explicit, visible discard is allowed
#ifdef KILN_DROP
  S{}.Run();
#endif
  return s.ok() ? 0 : 1;
}
