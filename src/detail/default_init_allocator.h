// default_init_allocator.h — vectors that grow without zeroing what they add.
#pragma once

#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace nanguard::detail {

/// std::allocator whose construct without a value default-initializes: the
/// resize() of a vector with it leaves the new doubles unwritten instead of
/// zeroing them, for a buffer that is written next (16 MB of rows: a 2 ms
/// memset on the CSV reader's serial path).
template <typename T>
struct default_init_allocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = default_init_allocator<U>;
  };
  default_init_allocator() = default;
  template <typename U>
  default_init_allocator(const default_init_allocator<U>&) noexcept {}

  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

/// Doubles whose resize() does not zero them.
using uninitialized_doubles = std::vector<double, default_init_allocator<double>>;

}  // namespace nanguard::detail
