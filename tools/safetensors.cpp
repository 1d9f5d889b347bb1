#include "tools/safetensors.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>
#include <string>

#include "common/train/checkpoint.h"
#include "common/tensor/error.h"

namespace course {

namespace {

// A parsed JSON value: enough of JSON for a safetensors header and a config.json.
struct JsonValue {
  enum class Kind { Object, Array, String, Literal } kind = Kind::Literal;
  std::string text;  // a string's characters, or a number's, true's, false's or null's text
  std::vector<JsonValue> items;                            // an array's
  std::vector<std::pair<std::string, JsonValue>> members;  // an object's, in file order
};

class JsonParser {
 public:
  JsonParser(const std::string& text, const std::string& path) : text_(text), path_(path) {}

  JsonValue parse_document() {
    JsonValue value = parse_value();
    skip_space();
    if (at_ < text_.size()) fail("text after the JSON value");
    return value;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw UsageError(path_ + ": not the JSON expected, " + what + " at byte " + std::to_string(at_) +
                     " (hint: is it a safetensors file or a config.json that Hugging Face wrote?)");
  }
  void skip_space() {
    while (at_ < text_.size() && std::strchr(" \t\r\n", text_[at_]) != nullptr) at_++;
  }
  void expect(char c) {
    skip_space();
    if (at_ >= text_.size() || text_[at_] != c) fail(std::string("'") + c + "' expected");
    at_++;
  }
  bool next_is(char c) {
    skip_space();
    return at_ < text_.size() && text_[at_] == c;
  }

  // Arrays and objects nest at most this deep: a header needs 3 levels, a config.json
  // a few more. The parser recurses, so without a limit 30,000 '[' overflow the stack.
  static constexpr int kMaxDepth = 64;

  JsonValue parse_value() {
    if (next_is('{') || next_is('[')) {
      if (depth_ == kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth) + " levels");
      depth_++;
      JsonValue value = next_is('{') ? parse_object() : parse_array();
      depth_--;
      return value;
    }
    JsonValue value;
    if (next_is('"')) {
      value.kind = JsonValue::Kind::String;
      value.text = parse_string();
      return value;
    }
    const size_t begin = at_;
    while (at_ < text_.size() && std::strchr(",}] \t\r\n", text_[at_]) == nullptr) at_++;
    if (at_ == begin) fail("a value expected");
    value.text = text_.substr(begin, at_ - begin);
    // anything but true, false, null or a number is no JSON value ("xxxx" would otherwise read as one)
    if (value.text != "true" && value.text != "false" && value.text != "null" && !is_json_number(value.text)) {
      at_ = begin;
      fail("a value expected");
    }
    return value;
  }

  // -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][-+]?[0-9]+)?, JSON's grammar for a number
  static bool is_json_number(const std::string& text) {
    size_t at = 0;
    const auto digits = [&] {
      const size_t begin = at;
      while (at < text.size() && std::isdigit(static_cast<unsigned char>(text[at]))) at++;
      return at - begin;
    };
    if (at < text.size() && text[at] == '-') at++;
    const size_t whole = digits();
    if (whole == 0 || (whole > 1 && text[at - whole] == '0')) return false;
    if (at < text.size() && text[at] == '.' && (at++, digits() == 0)) return false;
    if (at < text.size() && (text[at] == 'e' || text[at] == 'E')) {
      at++;
      if (at < text.size() && (text[at] == '+' || text[at] == '-')) at++;
      if (digits() == 0) return false;
    }
    return at == text.size();
  }

  // Escapes are kept as written except \" and \\: the names a header holds are ASCII.
  std::string parse_string() {
    expect('"');
    std::string out;
    while (at_ < text_.size() && text_[at_] != '"') {
      if (static_cast<unsigned char>(text_[at_]) < 0x20) fail("a control character in a string");
      if (text_[at_] == '\\' && at_ + 1 < text_.size() && std::strchr("\"\\", text_[at_ + 1]) != nullptr) at_++;
      out += text_[at_++];
    }
    expect('"');
    return out;
  }

  JsonValue parse_object() {
    JsonValue value;
    value.kind = JsonValue::Kind::Object;
    expect('{');
    if (next_is('}')) return at_++, value;
    std::set<std::string> keys;
    do {
      std::string key = parse_string();
      // the format forbids it, and a reader that kept the later one would load what a check passed over
      if (!keys.insert(key).second) fail("the key \"" + key + "\" a second time in one object");
      expect(':');
      value.members.emplace_back(std::move(key), parse_value());
    } while (next_is(',') && (at_++, true));
    expect('}');
    return value;
  }

  JsonValue parse_array() {
    JsonValue value;
    value.kind = JsonValue::Kind::Array;
    expect('[');
    if (next_is(']')) return at_++, value;
    do {
      value.items.push_back(parse_value());
    } while (next_is(',') && (at_++, true));
    expect(']');
    return value;
  }

  const std::string& text_;
  const std::string& path_;
  size_t at_ = 0;
  int depth_ = 0;  // arrays and objects open around the value being parsed
};

std::string read_whole_file(const std::string& path, const std::string& what) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw UsageError("cannot open " + what + " '" + path + "' (hint: check the path)");
  return std::string(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
}

// The bytes of one element of a safetensors dtype; 0 for a name the format does not have.
size_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
  return 0;
}

int64_t to_int64(const JsonValue& value, const std::string& path, const std::string& what) {
  try {
    size_t used = 0;
    const long long number = std::stoll(value.text, &used);
    if (used == value.text.size() && number >= 0) return number;
  } catch (const std::exception&) {
  }
  throw UsageError(path + ": " + what + " is '" + value.text + "', not a count (hint: is the file complete?)");
}

// One header entry as a tensor, its bytes copied out of the data section (where they
// begin: *begin).
SafeTensor tensor_from_header(const std::string& name, const JsonValue& info, const std::string& data,
                              const std::string& path, size_t* first_byte) {
  SafeTensor tensor;
  tensor.name = name;
  const JsonValue* offsets = nullptr;
  for (const auto& [key, value] : info.members) {
    if (key == "dtype") tensor.dtype = value.text;
    if (key == "shape") {
      for (const JsonValue& size : value.items) tensor.shape.push_back(to_int64(size, path, name + "'s shape"));
    }
    if (key == "data_offsets") offsets = &value;
  }
  if (tensor.dtype.empty() || offsets == nullptr || offsets->items.size() != 2) {
    throw UsageError(path + ": tensor " + name + " has no dtype or data_offsets (hint: is the file complete?)");
  }
  const size_t element_bytes = dtype_bytes(tensor.dtype);
  if (element_bytes == 0) {
    throw UsageError(path + ": tensor " + name + "'s dtype '" + tensor.dtype + "' is none of safetensors' " +
                     "(hint: is it a safetensors file?)");
  }
  const int64_t begin = to_int64(offsets->items[0], path, name + "'s offset");
  const int64_t end = to_int64(offsets->items[1], path, name + "'s offset");
  // the product of the sizes, refused before it wraps (a 1-D shape of 2^62 + 32 did)
  unsigned __int128 count = 1;
  for (int64_t size : tensor.shape) {
    count *= static_cast<uint64_t>(size);
    if (count > data.size()) count = static_cast<unsigned __int128>(data.size()) + 1;  // too big already
  }
  const std::string bytes = "tensor " + name + "'s bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
  if (begin > end || static_cast<size_t>(end) > data.size()) {
    throw UsageError(path + ": " + bytes + " are not within the data's " + std::to_string(data.size()) +
                     " bytes (hint: is the file complete?)");
  }
  if (begin % static_cast<int64_t>(element_bytes) != 0) {
    throw UsageError(path + ": " + bytes + " are not aligned to its dtype " + tensor.dtype +
                     " (hint: is it a safetensors file?)");
  }
  if (count * element_bytes != static_cast<unsigned __int128>(end - begin)) {
    throw UsageError(path + ": " + bytes + " do not hold its shape " + shape_text(tensor.shape) + " of " +
                     tensor.dtype + " (hint: is the file complete?)");
  }
  tensor.bytes.assign(data.begin() + begin, data.begin() + end);
  *first_byte = static_cast<size_t>(begin);
  if (tensor.dtype == "F32") {  // the course's dtype: a NaN or an infinity would train as NaN
    for (size_t i = 0; i < tensor.bytes.size(); i += sizeof(float)) {
      float value;
      std::memcpy(&value, tensor.bytes.data() + i, sizeof(float));
      if (!std::isfinite(value)) {
        throw UsageError(path + ": tensor " + name + " holds " + std::to_string(value) + " at element " +
                         std::to_string(i / sizeof(float)) + " (hint: the model it came from has diverged)");
      }
    }
  }
  return tensor;
}

}  // namespace

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "(";
  for (size_t d = 0; d < shape.size(); d++) text += (d ? ", " : "") + std::to_string(shape[d]);
  return text + ")";
}

SafeTensor float_safetensor(const std::string& name, std::vector<int64_t> shape, const float* data, size_t count) {
  std::vector<char> bytes(count * sizeof(float));
  std::memcpy(bytes.data(), data, bytes.size());
  return {name, "F32", std::move(shape), std::move(bytes)};
}

void write_safetensors(const std::string& path, const std::vector<SafeTensor>& tensors,
                       const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::string json = "{\"__metadata__\":{";
  for (size_t i = 0; i < metadata.size(); i++) {
    json += (i ? "," : "") + ("\"" + metadata[i].first + "\":\"" + metadata[i].second + "\"");
  }
  json += "}";
  size_t offset = 0;
  std::string data;
  for (const SafeTensor& tensor : tensors) {
    json += ",\"" + tensor.name + "\":{\"dtype\":\"" + tensor.dtype + "\",\"shape\":[";
    for (size_t d = 0; d < tensor.shape.size(); d++) json += (d ? "," : "") + std::to_string(tensor.shape[d]);
    json += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + tensor.bytes.size()) + "]}";
    data.append(tensor.bytes.data(), tensor.bytes.size());
    offset += tensor.bytes.size();
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');  // the data then starts 8-byte aligned
  const uint64_t header_bytes = json.size();
  std::string head(reinterpret_cast<const char*>(&header_bytes), sizeof(header_bytes));
  write_file_atomically(path, head + json, data, "safetensors file");
}

SafetensorsFile read_safetensors(const std::string& path) {
  const std::string file = read_whole_file(path, "safetensors file");
  uint64_t header_bytes = 0;
  if (file.size() >= sizeof(header_bytes)) std::memcpy(&header_bytes, file.data(), sizeof(header_bytes));
  if (file.size() < sizeof(header_bytes) || header_bytes > file.size() - sizeof(header_bytes)) {
    throw UsageError(path + ": too short for its header (" + std::to_string(file.size()) +
                     " bytes; hint: is it a safetensors file, and complete?)");
  }
  const std::string header = file.substr(sizeof(header_bytes), header_bytes);
  const std::string data = file.substr(sizeof(header_bytes) + header_bytes);
  const JsonValue root = JsonParser(header, path).parse_document();
  if (root.kind != JsonValue::Kind::Object) {
    throw UsageError(path + ": the header is not a JSON object (hint: is it a safetensors file?)");
  }
  SafetensorsFile result;
  std::vector<std::pair<size_t, size_t>> spans;  // [begin, end) of each tensor's bytes in the data
  for (const auto& [name, value] : root.members) {
    if (name == "__metadata__") {
      for (const auto& [key, text] : value.members) result.metadata[key] = text.text;
      continue;
    }
    size_t begin = 0;
    result.tensors[name] = tensor_from_header(name, value, data, path, &begin);
    spans.emplace_back(begin, begin + result.tensors[name].bytes.size());
  }
  // The tensors tile the data section: sorted by offset, each begins where the one
  // before it ended, and the last ends at the file's end (no overlap, no hole, nothing after).
  std::sort(spans.begin(), spans.end());
  size_t covered = 0;
  for (const auto& [begin, end] : spans) {
    if (begin != covered) {
      throw UsageError(path + ": the tensors' bytes " + (begin < covered ? "overlap" : "leave a hole") + " at byte " +
                       std::to_string(std::min(begin, covered)) + " of the data (hint: is it a safetensors file?)");
    }
    covered = end;
  }
  if (covered != data.size()) {
    throw UsageError(path + ": " + std::to_string(data.size() - covered) + " bytes after the last tensor (hint: " +
                     "is it a safetensors file, and not two joined?)");
  }
  return result;
}

std::map<std::string, std::string> read_json_object(const std::string& path) {
  const std::string text = read_whole_file(path, "JSON file");
  const JsonValue root = JsonParser(text, path).parse_document();
  if (root.kind != JsonValue::Kind::Object) throw UsageError(path + ": not a JSON object (hint: is it a config.json?)");
  std::map<std::string, std::string> values;
  for (const auto& [key, value] : root.members) {
    if (value.kind == JsonValue::Kind::String || value.kind == JsonValue::Kind::Literal) values[key] = value.text;
  }
  return values;
}

Gpt2Name gpt2_name(const std::string& ours) {
  static const std::vector<std::pair<std::string, Gpt2Name>> whole = {
      {"wte", {"wte.weight", false}},        {"wpe", {"wpe.weight", false}},
      {"lnf_w", {"ln_f.weight", false}},     {"lnf_b", {"ln_f.bias", false}},
      {"lm_head_w", {"lm_head.weight", false}}};
  static const std::vector<std::pair<std::string, Gpt2Name>> in_block = {
      {"ln1_w", {"ln_1.weight", false}},          {"ln1_b", {"ln_1.bias", false}},
      {"qkv_w", {"attn.c_attn.weight", true}},    {"qkv_b", {"attn.c_attn.bias", false}},
      {"proj_w", {"attn.c_proj.weight", true}},   {"proj_b", {"attn.c_proj.bias", false}},
      {"ln2_w", {"ln_2.weight", false}},          {"ln2_b", {"ln_2.bias", false}},
      {"fc_w", {"mlp.c_fc.weight", true}},        {"fc_b", {"mlp.c_fc.bias", false}},
      {"fcproj_w", {"mlp.c_proj.weight", true}},  {"fcproj_b", {"mlp.c_proj.bias", false}}};
  for (const auto& [name, gpt2] : whole) {
    if (ours == name) return gpt2;
  }
  const size_t dot = ours.find('.');
  for (const auto& [name, gpt2] : in_block) {
    if (dot != std::string::npos && ours.compare(dot + 1, std::string::npos, name) == 0) {
      return {"h." + ours.substr(5, dot - 5) + "." + gpt2.name, gpt2.transposed};
    }
  }
  throw CourseError("no GPT-2 name for parameter " + ours + " (a bug: the table in tools/safetensors.cpp misses it)");
}

}  // namespace course
