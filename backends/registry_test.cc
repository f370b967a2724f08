#include "backends/registry.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "backends/builtin.h"
#include "engine/builder.h"
#include "engine/compiler/compile.h"
#include "engine/compiler/host_services.h"
#include "engine/compiler/kernel_cache.h"
#include "engine/program.h"

namespace kiln::backend {
namespace {

class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~EnvGuard() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(RegistryTest, BuiltinsAndDeviceSpecs) {
  Registry r;
  r.RegisterBuiltins();
  r.RegisterBuiltins();  // idempotent
  EXPECT_EQ(r.backends().size(), 2u);
  ASSERT_TRUE(r.GetDevice("ref").ok());
  ASSERT_TRUE(r.GetDevice("cpu:0").ok());
  EXPECT_EQ((*r.GetDevice("cpu"))->name(), "cpu:0");
  auto missing = r.GetDevice("cuda");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(std::string(StatusMessage(missing.status())).find("registered: ref, cpu"),
            std::string::npos);
  EXPECT_EQ(r.GetDevice("cpu:3").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.GetDevice("cpu:x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register(MakeRefBackend()).code(), StatusCode::kAlreadyExists);
}

TEST(RegistryTest, LoadsToyPluginAndSkipsBrokenOnes) {
  Registry r;
  r.RegisterBuiltins();
  EXPECT_EQ(r.LoadPluginsFrom(KILN_TEST_PLUGIN_DIR), 1);
  const std::vector<std::string> errors = r.plugin_errors();
  ASSERT_EQ(errors.size(), 2u);
  bool saw_version = false, saw_entry = false;
  for (const std::string& e : errors) {
    saw_version |=
        e.find(StrCat("interface v", kBackendInterfaceVersion + 1000, ",")) != std::string::npos;
    saw_entry |= e.find("does not export kiln_backend_register_v1") != std::string::npos;
  }
  EXPECT_TRUE(saw_version) << errors[0] << " | " << errors[1];
  EXPECT_TRUE(saw_entry) << errors[0] << " | " << errors[1];
  EXPECT_EQ(r.Find("stale"), nullptr);  // refused and deleted

  // The plugin's device compiles and runs a graph with its own kernel.
  auto dev = r.GetDevice("toy");
  ASSERT_TRUE(dev.ok()) << dev.status();
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {2, 3});
  const Value y = b.Input("y", DType::kF32, {3});
  const Value sum = b.Add(x, y);
  auto program = Compile(g, {sum}, **dev);
  ASSERT_TRUE(program.ok()) << program.status();
  auto xt = Tensor::FromDoubles(**dev, DType::kF32, {2, 3}, std::vector<double>{1, 2, 3, 4, 5, 6});
  auto yt = Tensor::FromDoubles(**dev, DType::kF32, {3}, std::vector<double>{10, 20, 30});
  ASSERT_TRUE(xt.ok() && yt.ok());
  ASSERT_TRUE((*program)->Bind("x", *xt).ok());
  ASSERT_TRUE((*program)->Bind("y", *yt).ok());
  auto stream = (*dev)->CreateStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*program)->Run(**stream).ok());
  auto out = (*program)->Output(0);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out->ToDoubles(), (std::vector<double>{11, 22, 33, 14, 25, 36}));

  // What the plugin does not support is refused at compile time, naming node and device.
  const Value prod = b.Named(b.Mul(x, x), "square");
  auto bad = Compile(g, {prod}, **dev);
  ASSERT_FALSE(bad.ok());
  const std::string msg(StatusMessage(bad.status()));
  EXPECT_NE(msg.find("'square'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("toy:0"), std::string::npos) << msg;

  // Loading the same plugin again is refused (duplicate backend name), not a crash.
  EXPECT_FALSE(r.LoadPlugin(std::string(KILN_TEST_PLUGIN_DIR) + "/libkiln_backend_toy.so").ok());
}

TEST(RegistryTest, AutoloadFollowsEnvironment) {
  {
    EnvGuard path("KILN_BACKEND_PATH", KILN_TEST_PLUGIN_DIR);
    EnvGuard off("KILN_BACKEND_AUTOLOAD", "0");
    Registry r;
    EXPECT_EQ(r.Autoload(), 0);
    EXPECT_EQ(r.Find("toy"), nullptr);
  }
  {
    EnvGuard path("KILN_BACKEND_PATH", "/nonexistent:" KILN_TEST_PLUGIN_DIR);
    EnvGuard on("KILN_BACKEND_AUTOLOAD", nullptr);
    Registry r;
    // The toy, and the gpu plugins beside this binary where they find a GPU (they decline
    // elsewhere): every backend here came from a plugin.
    const int loaded = r.Autoload();
    EXPECT_NE(r.Find("toy"), nullptr);
    EXPECT_GE(loaded, 1);
    EXPECT_EQ(loaded, static_cast<int>(r.backends().size()));
    EXPECT_EQ(Registry::PluginDirs().front(), "/nonexistent");
  }
}

TEST(RegistryTest, MissingFileIsAnError) {
  Registry r;
  const Status s = r.LoadPlugin("/nonexistent/libkiln_backend_x.so");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
}

TEST(RegistryTest, APluginThatDeclinesSaysWhyAndIsNotAnError) {
  Registry r;
  const Status s = r.LoadPlugin(std::string(KILN_TEST_PLUGIN_DIR) + "/libkiln_backend_declines.so");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_NE(std::string(StatusMessage(s)).find("nothing to offer here: no frobnicator attached"),
            std::string::npos)
      << s;
  // In a directory scan it is neither loaded nor an error (LoadsToyPluginAndSkipsBrokenOnes
  // counts the broken ones).
  Registry scan;
  EXPECT_EQ(scan.LoadPluginsFrom(KILN_TEST_PLUGIN_DIR), 1);
  for (const std::string& e : scan.plugin_errors()) {
    EXPECT_EQ(e.find("declines"), std::string::npos) << e;
  }
}

TEST(RegistryTest, LoadBackendFromPluginMakesIndependentBackends) {
  EnvGuard path("KILN_BACKEND_PATH", "/nonexistent:" KILN_TEST_PLUGIN_DIR);
  StatusOr<std::unique_ptr<Backend>> a = Registry::LoadBackendFromPlugin("toy");
  StatusOr<std::unique_ptr<Backend>> b = Registry::LoadBackendFromPlugin("toy");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*a)->name(), "toy");
  EXPECT_NE(a->get(), b->get());
  EXPECT_NE((*a)->device(0), (*b)->device(0));

  const auto missing = Registry::LoadBackendFromPlugin("nosuch");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(std::string(StatusMessage(missing.status()))
                .find("libkiln_backend_nosuch.so in "
                      "/nonexistent, "),
            std::string::npos)
      << missing.status();
  EXPECT_EQ(Registry::LoadBackendFromPlugin("declines").status().code(), StatusCode::kUnavailable);
}

// A plugin of another build (one left in the plugin folder after an upgrade) that links the
// engine, as the gpu plugins do, is refused naming both builds.
TEST(RegistryTest, APluginOfAnotherBuildIsRefusedNamingBoth) {
  Registry r;
  const Status s =
      r.LoadPlugin(std::string(KILN_TEST_ENGINE_PLUGIN_DIR) + "/libkiln_backend_stale.so");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(std::string(StatusMessage(s))
                .find(StrCat("built from other sources than this program (plugin build "
                             "0123456789abcdef, program build ",
                             compiler::BuildId(), ")")),
            std::string::npos)
      << s;
  EXPECT_EQ(compiler::BuildId().size(), 16u);
}

// The host's compiler prepares and assigns a plugin device's kernels; the plugin's own copy of
// the compiler code must see the fused groups of that compile (the compile context is the
// host's, reached through the services it adopted), or a gpu plugin would never fuse.
TEST(RegistryTest, APluginDeviceSeesTheHostCompilersFusedGroups) {
  Registry r;
  const Status s =
      r.LoadPlugin(std::string(KILN_TEST_ENGINE_PLUGIN_DIR) + "/libkiln_backend_fused_probe.so");
  ASSERT_TRUE(s.ok()) << s;
  auto dev = r.GetDevice("fusedprobe");
  ASSERT_TRUE(dev.ok()) << dev.status();
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {4, 8});
  const Value y = b.Input("y", DType::kF32, {4, 8});
  // A reduction with a pointwise prologue: one fused group (kReduce).
  const Value out = b.Sum(b.Mul(b.Exp(x), y), {1});
  // The device runs nothing, so the compile fails; what matters is what it was shown.
  compiler::CompileReport report;
  (void)compiler::Compile(g, {out}, **dev, {}, &report);
  EXPECT_TRUE(report.unfused_fallback) << report.ToString();  // the fused program came first
  const auto* seen =
      static_cast<const std::atomic<int>*>((*dev)->GetExtension("fusedprobe.fused_seen"));
  ASSERT_NE(seen, nullptr);
  EXPECT_GT(seen->load(), 0) << "the plugin's FusedGroupOf saw no fused group";

  // The kernel cache directory is the one the host configured (kilnd: <storage_dir>/cache).
  EnvGuard env("KILN_CACHE_DIR", nullptr);
  compiler::SetCacheDir("/tmp/kiln-registry-test-host-cache");
  const auto* dir = static_cast<const std::string*>((*dev)->GetExtension("fusedprobe.cache_dir"));
  compiler::SetCacheDir("");
  ASSERT_NE(dir, nullptr);
  EXPECT_EQ(*dir, "/tmp/kiln-registry-test-host-cache");
}

// A GPU plugin: it declines when disabled (`disable_env`=none) and without a driver or a
// device, and otherwise registers `name` with its devices not yet opened.
void CheckGpuPlugin(const char* path, std::string_view name, const char* disable_env) {
  {
    EnvGuard off(disable_env, "none");
    Registry r;
    const Status s = r.LoadPlugin(path);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_NE(std::string(StatusMessage(s)).find(StrCat("disabled (", disable_env, "=none)")),
              std::string::npos)
        << s;
  }
  Registry r;
  r.RegisterBuiltins();
  const Status s = r.LoadPlugin(path);
  if (s.ok()) {
    Backend* gpu = r.Find(name);
    ASSERT_NE(gpu, nullptr);
    ASSERT_GE(gpu->device_count(), 1);
    EXPECT_FALSE(gpu->opened(0));  // no context until a device is used
    auto dev = r.GetDevice(StrCat(name, ":0"));
    ASSERT_TRUE(dev.ok()) << dev.status();
    EXPECT_TRUE(gpu->opened(0));
    EXPECT_EQ((*dev)->name(), StrCat(name, ":0"));
  } else {
    // No GPU here: declined with the runtime's reason, and the host is unharmed.
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_NE(std::string(StatusMessage(s)).find("nothing to offer here: "), std::string::npos)
        << s;
    EXPECT_EQ(r.Find(name), nullptr);
    EXPECT_TRUE(r.GetDevice("cpu").ok());
  }
}

// The plugins of the gpu backend, built where the CUDA toolkit or the HIP runtime is.
TEST(RegistryTest, CudaPluginRegistersOnlyWhereThereIsAGpu) {
#ifndef KILN_TEST_CUDA_PLUGIN
  GTEST_SKIP() << "this build has no cuda plugin (no CUDA toolkit, or KILN_CUDA=OFF)";
#else
  CheckGpuPlugin(KILN_TEST_CUDA_PLUGIN, "cuda", "KILN_CUDA_DEVICES");
#endif
}

TEST(RegistryTest, HipPluginRegistersOnlyWhereThereIsAGpu) {
#ifndef KILN_TEST_HIP_PLUGIN
  GTEST_SKIP() << "this build has no hip plugin (no HIP runtime, or KILN_HIP=OFF)";
#else
  CheckGpuPlugin(KILN_TEST_HIP_PLUGIN, "hip", "KILN_HIP_DEVICES");
#endif
}

}  // namespace
}  // namespace kiln::backend
