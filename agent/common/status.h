// Status and Result<T>: how the control plane reports errors (STYLE.md: no exceptions across
// asio or gRPC callbacks). A failed Status carries a message a user can act on.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace accel {

class Status {
 public:
  Status() = default;
  static Status ok() { return {}; }
  static Status error(std::string message) { return Status(std::move(message)); }

  [[nodiscard]] bool is_ok() const { return !failed_; }
  explicit operator bool() const { return is_ok(); }
  [[nodiscard]] const std::string& message() const { return message_; }

 private:
  explicit Status(std::string message) : failed_(true), message_(std::move(message)) {}
  bool failed_ = false;
  std::string message_;
};

// A value or the Status that explains why there is none.
template <class T>
class Result {
 public:
  Result(T value) : data_(std::move(value)) {}         // NOLINT: implicit on purpose
  Result(Status status) : data_(std::move(status)) {}  // NOLINT: must be a failed status

  [[nodiscard]] bool is_ok() const { return std::holds_alternative<T>(data_); }
  explicit operator bool() const { return is_ok(); }
  T& value() & { return std::get<T>(data_); }
  const T& value() const& { return std::get<T>(data_); }
  T&& value() && { return std::get<T>(std::move(data_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  [[nodiscard]] Status status() const { return is_ok() ? Status::ok() : std::get<Status>(data_); }
  [[nodiscard]] const std::string& message() const { return std::get<Status>(data_).message(); }

 private:
  std::variant<T, Status> data_;
};

}  // namespace accel
