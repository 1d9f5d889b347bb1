// Errors the course reports to the reader: one clear message, then a non-zero exit.
//
// UsageError is the reader's mistake (bad flag, missing file, impossible shape):
// the program prints the message and exits with code 2. Any other CourseError is
// a failure at run time (corrupt checkpoint, I/O error) and exits with code 1.
// FlagError is the UsageError of the command line itself (a flag's value, flags
// that do not fit together or not the world size): every rank parses the same
// command line and finds the same mistake, so only rank 0 reports it. Diverged (a
// loss or a global gradient norm that is no longer finite) is found alike by every
// rank too, and exits 1.
#pragma once

#include <stdexcept>
#include <string>

namespace course {

class CourseError : public std::runtime_error {
 public:
  explicit CourseError(const std::string& message, int exit_code = 1)
      : std::runtime_error(message), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }
  // whether every rank finds this same error, so that rank 0 alone reports it
  virtual bool found_by_every_rank() const { return false; }
  // whether another rank reports its cause, and this one only ran into it (a peer
  // that died is named by the rank that saw it first), so that this one says nothing
  virtual bool reported_by_another_rank() const { return false; }

 private:
  int exit_code_;
};

// Not an error: a process that finds its work already done by others (chapter 10's
// worker restarted after the run's end). guarded_main says why and exits 0.
class AlreadyDone : public std::runtime_error {
 public:
  explicit AlreadyDone(const std::string& message) : std::runtime_error(message) {}
};

class UsageError : public CourseError {
 public:
  explicit UsageError(const std::string& message) : CourseError(message, 2) {}
};

class FlagError : public UsageError {
 public:
  explicit FlagError(const std::string& message) : UsageError(message) {}
  bool found_by_every_rank() const override { return true; }
};

class Diverged : public CourseError {
 public:
  explicit Diverged(const std::string& message) : CourseError(message, 1) {}
  bool found_by_every_rank() const override { return true; }
};

}  // namespace course
