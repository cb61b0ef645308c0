// Argument checks of the extension's functions, raising RuntimeError in Python as TORCH_CHECK
// does.
//
// Why not TORCH_CHECK: on one torch 2.11 (CUDA 13) build, a failing TORCH_CHECK with arguments
// crashed the process (SIGSEGV) instead of raising, even with the error caught right where it
// was thrown, and so did an MB_CHECK that formatted its message with c10::str (an ostringstream)
// and threw std::runtime_error; a c10::Error or std::runtime_error of a literal message reached
// Python (a minimal extension built on that machine). So MB_CHECK formats with snprintf into a
// buffer and throws std::runtime_error of it: no stream, no std::string in the failure path.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <type_traits>

#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>

namespace megablocks_cuda::detail {

struct Message {
  char text[512] = {0};
  size_t used = 0;

  void put(const char* part) {
    const int n = std::snprintf(text + used, sizeof(text) - used, "%s", part);
    used = n < 0 ? used : std::min(sizeof(text) - 1, used + static_cast<size_t>(n));
  }
  void put(c10::ScalarType type) { put(c10::toString(type)); }
  template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
  void put(T value) {
    char digits[32];
    std::snprintf(digits, sizeof(digits), "%lld", static_cast<long long>(value));
    put(digits);
  }
};

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  Message message;
  (message.put(parts), ...);
  throw std::runtime_error(message.text);
}

}  // namespace megablocks_cuda::detail

#define MB_CHECK(cond, ...)                                                                   \
  do {                                                                                        \
    if (C10_UNLIKELY(!(cond))) {                                                              \
      ::megablocks_cuda::detail::fail(__VA_ARGS__);                                           \
    }                                                                                         \
  } while (false)

namespace megablocks_cuda {

// Before an AT_DISPATCH_* of floating types (its failure path is TORCH_CHECK's): `type` is one
// the dispatch takes; with `integers`, also one of AT_DISPATCH_ALL_TYPES' integer types.
inline void check_dispatched(c10::ScalarType type, const char* what, bool integers = false) {
  using c10::ScalarType;
  const bool floating = type == ScalarType::Half || type == ScalarType::BFloat16 ||
                        type == ScalarType::Float || type == ScalarType::Double;
  const bool integer = type == ScalarType::Byte || type == ScalarType::Char ||
                       type == ScalarType::Short || type == ScalarType::Int ||
                       type == ScalarType::Long;
  MB_CHECK(floating || (integers && integer), what, ": unsupported dtype ", type);
}

}  // namespace megablocks_cuda

// Runs the lambda with scalar_t the C++ type of an int16, int32 or int64 dtype (as
// AT_DISPATCH_SWITCH, whose failure path is TORCH_CHECK's).
#define MB_DISPATCH_INTS(TYPE, NAME, ...)                                                     \
  [&] {                                                                                       \
    const ::c10::ScalarType mb_dispatch_type = (TYPE);                                        \
    if (mb_dispatch_type == ::c10::ScalarType::Short) {                                       \
      using scalar_t = int16_t;                                                               \
      return __VA_ARGS__();                                                                   \
    }                                                                                         \
    if (mb_dispatch_type == ::c10::ScalarType::Int) {                                         \
      using scalar_t = int32_t;                                                               \
      return __VA_ARGS__();                                                                   \
    }                                                                                         \
    MB_CHECK(mb_dispatch_type == ::c10::ScalarType::Long, NAME,                               \
             ": expected int16, int32 or int64, not ", mb_dispatch_type);                     \
    using scalar_t = int64_t;                                                                 \
    return __VA_ARGS__();                                                                     \
  }()
