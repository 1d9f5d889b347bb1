// Catch2 matchers the tests share.
#pragma once

#include <catch2/catch.hpp>

#include <string>

#include "common/tensor/error.h"

namespace course_test {

// Matches a CourseError (or a UsageError) whose message contains `text`.
class MessageContains : public Catch::MatcherBase<course::CourseError> {
 public:
  explicit MessageContains(std::string text) : text_(std::move(text)) {}
  bool match(const course::CourseError& error) const override {
    return std::string(error.what()).find(text_) != std::string::npos;
  }
  std::string describe() const override { return "has a message containing \"" + text_ + "\""; }

 private:
  std::string text_;
};

}  // namespace course_test
