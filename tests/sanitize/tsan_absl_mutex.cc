// ThreadSanitizer annotations for Debian's (uninstrumented) absl::Mutex, CondVar and
// Notification. Linked into every executable of a KILN_SANITIZE=thread build only.
//
// Why: libabsl_synchronization.so is built without -fsanitize=thread, so TSan does not see a
// lock or an unlock: it takes every field that an absl::Mutex guards for a data race. (An absl
// built with TSan calls the __tsan_mutex_* hooks itself; Debian's does not.) This file defines
// the public entry points in the executable, which interposes them for our code and for gRPC's
// alike; each one tells TSan what it does (pre/post lock, pre/post unlock, release/acquire) and
// calls the library's own through dlsym(RTLD_NEXT). Between pre and post TSan ignores memory
// accesses, which covers the conditions (absl::Condition) that absl evaluates inside the call,
// possibly on another thread while it holds the lock.
//
// Not covered: Notification::HasBeenNotified() is inline (an atomic load TSan cannot pair with
// the library's store); kiln code does not use absl::Notification.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/base/options.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#if !ABSL_OPTION_USE_INLINE_NAMESPACE
#error "tsan_absl_mutex.cc spells absl's mangled names with its inline namespace"
#endif
#define KILN_TSAN_STR2(x) #x
#define KILN_TSAN_STR(x) KILN_TSAN_STR2(x)

namespace {

// The library's definition of the symbol whose mangled name is "_Z" + `nested` + "4absl" +
// the inline namespace + `rest`: _ZN4absl7debian35Mutex4LockEv for ("N", "5Mutex4LockEv").
void* Real(const char* nested, const char* rest) {
  const char* ns = KILN_TSAN_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string name =
      std::string("_Z") + nested + "4absl" + std::to_string(std::strlen(ns)) + ns + rest;
  void* f = dlsym(RTLD_NEXT, name.c_str());
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_absl_mutex: %s not found in absl (%s)\n", name.c_str(), dlerror());
    std::abort();
  }
  return f;
}

template <typename F>
F RealFn(const char* nested, const char* rest) {
  return reinterpret_cast<F>(Real(nested, rest));
}

// absl's entry points call one another (AwaitWithTimeout calls AwaitWithDeadline,
// Notification's waits LockWhen): only the outermost call on a thread is annotated.
thread_local int shim_depth = 0;
struct ShimScope {
  ShimScope() { ++shim_depth; }
  ~ShimScope() { --shim_depth; }
  ShimScope(const ShimScope&) = delete;
  ShimScope& operator=(const ShimScope&) = delete;
};

// pre_unlock .. post_unlock of `mu` around `body`, then pre_lock .. post_lock: what a wait that
// releases and reacquires the lock does.
template <typename Body>
auto UnlockAroundRelock(void* mu, unsigned read, Body body) {
  const unsigned flags = read ? __tsan_mutex_read_lock : 0;
  __tsan_mutex_pre_unlock(mu, flags);
  auto r = body();
  __tsan_mutex_post_unlock(mu, flags);
  __tsan_mutex_pre_lock(mu, flags);
  __tsan_mutex_post_lock(mu, flags, 0);
  return r;
}

// pre_lock .. post_lock of `mu` around `body` (LockWhen*, whose result says nothing about the
// lock: it is held on return either way).
template <typename Body>
auto LockAround(void* mu, unsigned flags, Body body) {
  __tsan_mutex_pre_lock(mu, flags);
  auto r = body();
  __tsan_mutex_post_lock(mu, flags, 0);
  return r;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

#define KILN_REAL(type, nested, rest) static const auto real = RealFn<type>(nested, rest)

Mutex::~Mutex() {
  KILN_REAL(void (*)(Mutex*), "N", "5MutexD2Ev");
  __tsan_mutex_destroy(this, 0);
  real(this);
}

void Mutex::Lock() {
  KILN_REAL(void (*)(Mutex*), "N", "5Mutex4LockEv");
  if (shim_depth > 0) return real(this);
  ShimScope scope;
  LockAround(this, 0, [&] {
    real(this);
    return true;
  });
}

void Mutex::ReaderLock() {
  KILN_REAL(void (*)(Mutex*), "N", "5Mutex10ReaderLockEv");
  if (shim_depth > 0) return real(this);
  ShimScope scope;
  LockAround(this, __tsan_mutex_read_lock, [&] {
    real(this);
    return true;
  });
}

bool Mutex::TryLock() {
  KILN_REAL(bool (*)(Mutex*), "N", "5Mutex7TryLockEv");
  if (shim_depth > 0) return real(this);
  ShimScope scope;
  __tsan_mutex_pre_lock(this, __tsan_mutex_try_lock);
  const bool ok = real(this);
  __tsan_mutex_post_lock(this, __tsan_mutex_try_lock | (ok ? 0 : __tsan_mutex_try_lock_failed), 0);
  return ok;
}

bool Mutex::ReaderTryLock() {
  KILN_REAL(bool (*)(Mutex*), "N", "5Mutex13ReaderTryLockEv");
  if (shim_depth > 0) return real(this);
  ShimScope scope;
  const unsigned flags = __tsan_mutex_read_lock | __tsan_mutex_try_lock;
  __tsan_mutex_pre_lock(this, flags);
  const bool ok = real(this);
  __tsan_mutex_post_lock(this, flags | (ok ? 0 : __tsan_mutex_try_lock_failed), 0);
  return ok;
}

void Mutex::Unlock() {
  KILN_REAL(void (*)(Mutex*), "N", "5Mutex6UnlockEv");
  if (shim_depth > 0) return real(this);
  ShimScope scope;
  __tsan_mutex_pre_unlock(this, 0);
  real(this);
  __tsan_mutex_post_unlock(this, 0);
}

void Mutex::ReaderUnlock() {
  KILN_REAL(void (*)(Mutex*), "N", "5Mutex12ReaderUnlockEv");
  if (shim_depth > 0) return real(this);
  ShimScope scope;
  __tsan_mutex_pre_unlock(this, __tsan_mutex_read_lock);
  real(this);
  __tsan_mutex_post_unlock(this, __tsan_mutex_read_lock);
}

void Mutex::LockWhen(const Condition& cond) {
  KILN_REAL(void (*)(Mutex*, const Condition&), "N", "5Mutex8LockWhenERKNS0_9ConditionE");
  if (shim_depth > 0) return real(this, cond);
  ShimScope scope;
  LockAround(this, 0, [&] {
    real(this, cond);
    return true;
  });
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  KILN_REAL(bool (*)(Mutex*, const Condition&, Duration), "N",
            "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  if (shim_depth > 0) return real(this, cond, timeout);
  ShimScope scope;
  return LockAround(this, 0, [&] { return real(this, cond, timeout); });
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  KILN_REAL(bool (*)(Mutex*, const Condition&, Time), "N",
            "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  if (shim_depth > 0) return real(this, cond, deadline);
  ShimScope scope;
  return LockAround(this, 0, [&] { return real(this, cond, deadline); });
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  KILN_REAL(void (*)(Mutex*, const Condition&), "N", "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  if (shim_depth > 0) return real(this, cond);
  ShimScope scope;
  LockAround(this, __tsan_mutex_read_lock, [&] {
    real(this, cond);
    return true;
  });
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  KILN_REAL(bool (*)(Mutex*, const Condition&, Duration), "N",
            "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  if (shim_depth > 0) return real(this, cond, timeout);
  ShimScope scope;
  return LockAround(this, __tsan_mutex_read_lock, [&] { return real(this, cond, timeout); });
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  KILN_REAL(bool (*)(Mutex*, const Condition&, Time), "N",
            "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  if (shim_depth > 0) return real(this, cond, deadline);
  ShimScope scope;
  return LockAround(this, __tsan_mutex_read_lock, [&] { return real(this, cond, deadline); });
}

// Await* may release and reacquire the lock; the caller holds it in write mode (absl allows
// Await in reader mode too; kiln does not use it, and TSan would then see a write unlock of a
// read-held mutex and say so).
void Mutex::Await(const Condition& cond) {
  KILN_REAL(void (*)(Mutex*, const Condition&), "N", "5Mutex5AwaitERKNS0_9ConditionE");
  if (shim_depth > 0) return real(this, cond);
  ShimScope scope;
  UnlockAroundRelock(this, 0, [&] {
    real(this, cond);
    return true;
  });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  KILN_REAL(bool (*)(Mutex*, const Condition&, Duration), "N",
            "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  if (shim_depth > 0) return real(this, cond, timeout);
  ShimScope scope;
  return UnlockAroundRelock(this, 0, [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  KILN_REAL(bool (*)(Mutex*, const Condition&, Time), "N",
            "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  if (shim_depth > 0) return real(this, cond, deadline);
  ShimScope scope;
  return UnlockAroundRelock(this, 0, [&] { return real(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  KILN_REAL(void (*)(CondVar*, Mutex*), "N", "7CondVar4WaitEPNS0_5MutexE");
  if (shim_depth > 0) return real(this, mu);
  ShimScope scope;
  UnlockAroundRelock(mu, 0, [&] {
    real(this, mu);
    return true;
  });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  KILN_REAL(bool (*)(CondVar*, Mutex*, Duration), "N",
            "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  if (shim_depth > 0) return real(this, mu, timeout);
  ShimScope scope;
  return UnlockAroundRelock(mu, 0, [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  KILN_REAL(bool (*)(CondVar*, Mutex*, Time), "N",
            "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  if (shim_depth > 0) return real(this, mu, deadline);
  ShimScope scope;
  return UnlockAroundRelock(mu, 0, [&] { return real(this, mu, deadline); });
}

// Notify happens before every wait that sees it.
void Notification::Notify() {
  KILN_REAL(void (*)(Notification*), "N", "12Notification6NotifyEv");
  if (shim_depth > 0) return real(this);
  ShimScope scope;
  __tsan_release(this);
  real(this);
}

void Notification::WaitForNotification() const {
  KILN_REAL(void (*)(const Notification*), "NK", "12Notification19WaitForNotificationEv");
  if (shim_depth > 0) return real(this);
  ShimScope scope;
  real(this);
  __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  KILN_REAL(bool (*)(const Notification*, Duration), "NK",
            "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  if (shim_depth > 0) return real(this, timeout);
  ShimScope scope;
  const bool notified = real(this, timeout);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  KILN_REAL(bool (*)(const Notification*, Time), "NK",
            "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  if (shim_depth > 0) return real(this, deadline);
  ShimScope scope;
  const bool notified = real(this, deadline);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

#undef KILN_REAL

ABSL_NAMESPACE_END
}  // namespace absl
