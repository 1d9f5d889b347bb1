// A minimal JSON reader, enough to prove a Chrome trace is valid JSON and to read it
// back (test_trace), and what every chapter's --trace test runs and checks.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "support/process.h"
#include "support/runs.h"

namespace course_test {

struct Json {
  enum class Kind { Null, Boolean, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  double number = 0.0;
  std::string text;
  std::vector<Json> items;         // an array's elements, an object's values
  std::vector<std::string> keys;   // an object's keys, in the order of `items`

  bool has(const std::string& key) const {
    for (const std::string& name : keys) {
      if (name == key) return true;
    }
    return false;
  }
  const Json& at(const std::string& key) const {
    for (size_t i = 0; i < keys.size(); i++) {
      if (keys[i] == key) return items[i];
    }
    throw std::runtime_error("no key '" + key + "'");
  }
};

// Recursive descent over RFC 8259's grammar; throws std::runtime_error with the
// offset of the first thing that is not JSON.
class JsonReader {
 public:
  explicit JsonReader(const std::string& text) : text_(text) {}

  Json document() {
    Json result = value();
    skip_spaces();
    if (at_ != text_.size()) fail("text after the value");
    return result;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("invalid JSON at offset " + std::to_string(at_) + ": " + what);
  }
  char peek() const { return at_ < text_.size() ? text_[at_] : '\0'; }
  void skip_spaces() {
    while (peek() == ' ' || peek() == '\n' || peek() == '\r' || peek() == '\t') at_++;
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    at_++;
  }
  bool consume_word(const std::string& word) {
    if (text_.compare(at_, word.size(), word) != 0) return false;
    at_ += word.size();
    return true;
  }

  Json value() {
    skip_spaces();
    Json result;
    const char c = peek();
    if (c == '{') {
      result.kind = Json::Kind::Object;
      object(result);
    } else if (c == '[') {
      result.kind = Json::Kind::Array;
      array(result);
    } else if (c == '"') {
      result.kind = Json::Kind::String;
      result.text = string();
    } else if (consume_word("true")) {
      result.kind = Json::Kind::Boolean;
      result.boolean = true;
    } else if (consume_word("false")) {
      result.kind = Json::Kind::Boolean;
    } else if (consume_word("null")) {
      result.kind = Json::Kind::Null;
    } else {
      result.kind = Json::Kind::Number;
      result.number = number();
    }
    return result;
  }

  void object(Json& result) {
    expect('{');
    skip_spaces();
    if (peek() == '}') {
      at_++;
      return;
    }
    for (;;) {
      skip_spaces();
      result.keys.push_back(string());
      skip_spaces();
      expect(':');
      result.items.push_back(value());
      skip_spaces();
      if (peek() == '}') {
        at_++;
        return;
      }
      expect(',');
    }
  }

  void array(Json& result) {
    expect('[');
    skip_spaces();
    if (peek() == ']') {
      at_++;
      return;
    }
    for (;;) {
      result.items.push_back(value());
      skip_spaces();
      if (peek() == ']') {
        at_++;
        return;
      }
      expect(',');
    }
  }

  std::string string() {
    expect('"');
    std::string result;
    for (;;) {
      if (at_ >= text_.size()) fail("unterminated string");
      const char c = text_[at_++];
      if (c == '"') return result;
      if (static_cast<unsigned char>(c) < 0x20) fail("raw control character in a string");
      if (c != '\\') {
        result += c;
        continue;
      }
      const char escape = peek();
      at_++;
      switch (escape) {
        case '"': result += '"'; break;
        case '\\': result += '\\'; break;
        case '/': result += '/'; break;
        case 'b': result += '\b'; break;
        case 'f': result += '\f'; break;
        case 'n': result += '\n'; break;
        case 'r': result += '\r'; break;
        case 't': result += '\t'; break;
        case 'u': result += unicode_escape(); break;
        default: fail("bad escape");
      }
    }
  }

  // \uXXXX; the traces only escape control characters, so ASCII is all we decode
  char unicode_escape() {
    if (at_ + 4 > text_.size()) fail("short \\u escape");
    const std::string hex = text_.substr(at_, 4);
    if (hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) fail("bad \\u escape");
    at_ += 4;
    const long code = std::strtol(hex.c_str(), nullptr, 16);
    if (code >= 0x80) fail("non-ASCII \\u escape (not written by the trace)");
    return static_cast<char>(code);
  }

  // -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
  double number() {
    const size_t start = at_;
    auto digits = [&] {
      const size_t first = at_;
      while (peek() >= '0' && peek() <= '9') at_++;
      if (at_ == first) fail("expected a digit");
    };
    if (peek() == '-') at_++;
    if (peek() == '0') {
      at_++;
    } else {
      digits();
    }
    if (peek() == '.') {
      at_++;
      digits();
    }
    if (peek() == 'e' || peek() == 'E') {
      at_++;
      if (peek() == '+' || peek() == '-') at_++;
      digits();
    }
    return std::strtod(text_.substr(start, at_ - start).c_str(), nullptr);
  }

  const std::string& text_;
  size_t at_ = 0;
};

inline Json read_json(const std::string& path) { return JsonReader(read_file(path)).document(); }

// The events of a trace file with the given phase ("X" spans, "M" metadata).
inline std::vector<Json> events_of_phase(const Json& trace, const std::string& phase) {
  std::vector<Json> events;
  for (const Json& event : trace.at("traceEvents").items) {
    if (event.at("ph").text == phase) events.push_back(event);
  }
  return events;
}

// When a collective's span (common/train/trace.h: trace_collective) was issued, in
// microseconds on its rank's clock: it began running queued_us after that.
inline double issued_us(const Json& span) { return span.at("ts").number - span.at("args").at("queued_us").number; }

// Runs a chapter (argv: its launcher, binary and flags) on `ranks` ranks for 2 steps
// with --trace in `dir`; requires it to succeed and rank 0 to name the trace to open
// (the merged one, or with one rank its only file); returns that file's path.
inline std::string run_traced(std::vector<std::string> argv, int ranks, const TempDir& dir, double timeout_seconds) {
  argv = concat(argv, {"--steps", "2", "--trace", dir.file("trace.json")});
  const ProcessResult result = run_process(argv, timeout_seconds);
  INFO(joined(argv) << "\nresult: " << result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
  REQUIRE(result.exit_code == 0);
  const std::string path = dir.file(ranks > 1 ? "trace.merged.json" : "trace.json");
  CHECK(result.out.find("trace: " + path + " ") != std::string::npos);
  return path;
}

// A span a chapter's trace must hold: its name, its lane (0 compute, 1
// communication), and the rank that records it (-1: every rank).
struct ExpectedSpan {
  std::string name;
  int lane;
  int rank = -1;
};

// A chapter's merged --trace of `ranks` ranks: valid JSON; every rank has a span of
// each expected name on its lane; and on each rank's lane two spans are nested or
// apart, never half over each other (Perfetto cannot draw that on one row).
inline void check_chapter_trace(const std::string& merged_path, int ranks, const std::vector<ExpectedSpan>& expected) {
  const std::vector<Json> spans = events_of_phase(read_json(merged_path), "X");
  for (int rank = 0; rank < ranks; rank++) {
    for (const ExpectedSpan& want : expected) {
      if (want.rank != -1 && want.rank != rank) continue;
      INFO("rank " << rank << ", span '" << want.name << "' on lane " << want.lane);
      CHECK(std::any_of(spans.begin(), spans.end(), [&](const Json& span) {
        return span.at("pid").number == rank && span.at("tid").number == want.lane && span.at("name").text == want.name;
      }));
    }
    for (int lane = 0; lane < 2; lane++) {
      std::vector<std::tuple<double, double, std::string>> on_lane;  // start, end, name (microseconds)
      for (const Json& span : spans) {
        if (span.at("pid").number != rank || span.at("tid").number != lane) continue;
        on_lane.emplace_back(span.at("ts").number, span.at("ts").number + span.at("dur").number,
                             span.at("name").text);
      }
      std::sort(on_lane.begin(), on_lane.end());
      const double rounding = 0.01;  // ts and dur are written with 3 decimals each
      for (size_t i = 1; i < on_lane.size(); i++) {
        const auto& [start, end, name] = on_lane[i];
        const auto& [previous_start, previous_end, previous_name] = on_lane[i - 1];
        INFO("rank " << rank << " lane " << lane << ": '" << name << "' starts inside '" << previous_name << "'");
        CHECK((start >= previous_end - rounding || end <= previous_end + rounding));
      }
    }
  }
}

}  // namespace course_test
