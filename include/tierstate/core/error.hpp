// SPDX-License-Identifier: Apache-2.0
// One error vocabulary for the whole library.
//
//   tierstate::invalid_option  a bad option or hyper-parameter, thrown before any work;
//                              it names the option and the value that was refused.
//   tierstate::logic_error     a call that breaks the library's contract (a size mismatch,
//                              a null pointer); the message says which argument.
//   tierstate::state_lost      the optimizer's state was damaged by a failure it reported
//                              earlier; it refuses to go on until its state is restored.
//
// TIERSTATE_EXPECTS(cond, message) throws tierstate::logic_error with file:line when cond
// is false; the message is built only on failure.
#pragma once

#include <tierstate/core/config.hpp>

#include <array>
#include <charconv>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace tierstate::inline TIERSTATE_ABI {

/// A refused option: `option()` names it (for example "AdamW.lr") and `value()` holds the
/// refused value as text. what() is a full sentence meant for the user.
class invalid_option : public std::invalid_argument {
 public:
  invalid_option(std::string option, std::string value, std::string const& why)
    : std::invalid_argument(option + " = " + value + " is invalid: " + why),
      option_(std::move(option)),
      value_(std::move(value))
  {
  }

  [[nodiscard]] std::string const& option() const noexcept { return option_; }
  [[nodiscard]] std::string const& value() const noexcept { return value_; }

 private:
  std::string option_;
  std::string value_;
};

/// A call that breaks the library's contract; the message names the argument.
class logic_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

/// Thrown by every call that needs an optimizer's state after a failed step left that state
/// part updated. `cause()` is the message of the failure that lost it.
class state_lost : public std::runtime_error {
 public:
  explicit state_lost(std::string const& call, std::string cause)
    : std::runtime_error(describe(call, cause)), cause_(std::move(cause))
  {
  }
  [[nodiscard]] std::string const& cause() const noexcept { return cause_; }

 private:
  static std::string describe(std::string const& call, std::string const& cause)
  {
    // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "literal" + string.
    std::string text = "tierstate: ";
    text.append(call).append(" refused: the optimizer's state was lost when an earlier step failed part-way (");
    text.append(cause).append("); restore it from a checkpoint or build a new optimizer");
    return text;
  }

  std::string cause_;
};

namespace detail {

/// Formats a value the way users typed it: the shortest text that reads back as the same
/// value for floating point ("0.1", not "0.10000000000000001"), plain text otherwise.
template <class T>
[[nodiscard]] std::string to_text(T const& value)
{
  if constexpr (std::is_floating_point_v<T>) {
    std::array<char, 64> text{};
    auto const result = std::to_chars(text.data(), text.data() + text.size(), value);
    return std::string(text.data(), result.ptr);
  } else {
    std::ostringstream out;
    out << std::boolalpha << value;
    return out.str();
  }
}

[[noreturn]] inline void throw_logic_error(char const* file, int line, std::string const& message)
{
  throw logic_error(message + " (" + file + ":" + std::to_string(line) + ")");
}

}  // namespace detail
}  // namespace tierstate

#define TIERSTATE_EXPECTS(cond, message)                                        \
  do {                                                                          \
    if (!(cond)) [[unlikely]] {                                                 \
      ::tierstate::detail::throw_logic_error(__FILE__, __LINE__, (message));    \
    }                                                                           \
  } while (false)
