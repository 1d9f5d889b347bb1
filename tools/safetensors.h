// safetensors files (https://github.com/huggingface/safetensors), the format
// PyTorch and Hugging Face load models from; tools/export_safetensors writes the
// course's model as one and tools/import_safetensors reads one back.
//
// Layout, little-endian:
//   u64 N | N bytes of JSON, padded with spaces to a multiple of 8 | the tensors' bytes
//   JSON: {"__metadata__": {string: string}, NAME: {"dtype": "F32", "shape": [..],
//          "data_offsets": [begin, end]}, ...}, offsets counted from the data's start
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace course {

struct SafeTensor {
  std::string name;
  std::string dtype;            // "F32", "I32", ... as the file names it
  std::vector<int64_t> shape;
  std::vector<char> bytes;      // little-endian, row-major
};

// "(256, 32)": a shape as the messages write it.
std::string shape_text(const std::vector<int64_t>& shape);

// An F32 tensor holding data[0 .. count).
SafeTensor float_safetensor(const std::string& name, std::vector<int64_t> shape, const float* data, size_t count);

// Writes the tensors in this order, atomically (write_file_atomically).
void write_safetensors(const std::string& path, const std::vector<SafeTensor>& tensors,
                       const std::vector<std::pair<std::string, std::string>>& metadata);

struct SafetensorsFile {
  std::map<std::string, SafeTensor> tensors;
  std::map<std::string, std::string> metadata;
};

// Reads and checks a whole file: the header's JSON, every tensor's offsets within
// the data and its byte count against its dtype and shape. UsageError naming the
// file (and the tensor) when anything is wrong.
SafetensorsFile read_safetensors(const std::string& path);

// A JSON object's strings, numbers, booleans and nulls as their text ("gpt2", "4",
// "false"), for config.json: the keys whose values are objects or arrays are left out. UsageError naming `path`
// when the text is not a JSON object.
std::map<std::string, std::string> read_json_object(const std::string& path);

// GPT-2's name for one of the course's parameters ("block3.qkv_w" ->
// "h.3.attn.c_attn.weight", Hugging Face's GPT2Model without its "transformer."
// prefix), and whether the matrix is transposed: GPT-2's Conv1D keeps (in, out) where
// the course's linear layers keep (out, in). The table is in tools/README.md.
struct Gpt2Name {
  std::string name;
  bool transposed;
};
Gpt2Name gpt2_name(const std::string& ours);

}  // namespace course
