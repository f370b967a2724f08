// A shared library named like a plugin but without the versioned entry point (e.g. an
// unversioned or foreign library dropped into the plugin directory): skipped with an error.
extern "C" __attribute__((visibility("default"))) int kiln_backend_register_v0(const void*) {
  return 0;
}
