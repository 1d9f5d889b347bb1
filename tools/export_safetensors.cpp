// Writes a chapter-00 checkpoint's model as a safetensors file with GPT-2's names,
// so the rest of the ecosystem (PyTorch, Hugging Face) can load what the course
// trained. The names, shapes and transposes are in tools/README.md.
//
//   export_safetensors --checkpoint ckpt/step_00000030.ckpt --out model.safetensors
//   export_safetensors --checkpoint ... --out model.safetensors --dump-logits logits.safetensors
//
// A sharded checkpoint is first made one file by consolidate_checkpoint.
// --dump-logits also runs the model on a fixed batch (2 rows of the built-in
// corpus, the checkpoint's seed, step 1) and writes its tokens and logits, which
// tools/check_safetensors.py compares with a plain PyTorch GPT-2 on the export.
//
// safetensors (https://github.com/huggingface/safetensors), little-endian:
//   u64 N | N bytes of JSON, padded with spaces to a multiple of 8 | the tensors' bytes
//   JSON: {"__metadata__": {string: string}, NAME: {"dtype": "F32", "shape": [..],
//          "data_offsets": [begin, end]}, ...}, offsets counted from the data's start
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/cli.h"
#include "common/data.h"
#include "common/error.h"
#include "common/model.h"

using namespace course;

namespace {

struct Tensor {
  std::string name;
  std::string dtype;             // "F32" or "I32"
  std::vector<int64_t> shape;
  std::vector<char> bytes;       // little-endian, row-major
};

Tensor float_tensor(const std::string& name, std::vector<int64_t> shape, const float* data, size_t count) {
  std::vector<char> bytes(count * sizeof(float));
  std::memcpy(bytes.data(), data, bytes.size());
  return {name, "F32", std::move(shape), std::move(bytes)};
}

void write_safetensors(const std::string& path, const std::vector<Tensor>& tensors,
                       const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::string json = "{\"__metadata__\":{";
  for (size_t i = 0; i < metadata.size(); i++) {
    json += (i ? "," : "") + ("\"" + metadata[i].first + "\":\"" + metadata[i].second + "\"");
  }
  json += "}";
  size_t offset = 0;
  std::string data;
  for (const Tensor& tensor : tensors) {
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

// GPT-2's name for a parameter of ours, and whether its matrix is transposed:
// GPT-2's Conv1D keeps (in, out) where our linear layers keep (out, in).
struct Gpt2Name {
  std::string name;
  bool transposed;
};

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
  // "block3.qkv_w" -> "h.3.attn.c_attn.weight"
  const size_t dot = ours.find('.');
  for (const auto& [name, gpt2] : in_block) {
    if (dot != std::string::npos && ours.compare(dot + 1, std::string::npos, name) == 0) {
      return {"h." + ours.substr(5, dot - 5) + "." + gpt2.name, gpt2.transposed};
    }
  }
  throw CourseError("export_safetensors: no GPT-2 name for parameter " + ours + " (a bug: the table misses it)");
}

std::vector<Tensor> gpt2_tensors(const GPTConfig& config, const std::vector<float>& params) {
  std::vector<Tensor> tensors;
  size_t stage_offset = 0;
  for (const StageLayout& stage : model_layout(config)) {
    for (const ParamSpec& spec : stage.params) {
      const float* values = params.data() + stage_offset + spec.offset;  // (spec.shape)
      const Gpt2Name gpt2 = gpt2_name(spec.name);
      if (!gpt2.transposed) {
        tensors.push_back(float_tensor(gpt2.name, spec.shape, values, spec.numel));
        continue;
      }
      const size_t rows = spec.shape[0], cols = spec.shape[1];
      std::vector<float> transposed(spec.numel);  // (cols, rows)
      for (size_t r = 0; r < rows; r++) {
        for (size_t c = 0; c < cols; c++) transposed[c * rows + r] = values[r * cols + c];
      }
      tensors.push_back(float_tensor(gpt2.name, {spec.shape[1], spec.shape[0]}, transposed.data(), spec.numel));
    }
    stage_offset += stage.numel;
  }
  return tensors;
}

// The model's logits on `tokens` (B, T): chapter 00's stage functions, forward only.
std::vector<float> logits_of(const GPTConfig& config, std::vector<float>& params, const std::vector<int>& tokens,
                             const std::vector<int>& targets, int B) {
  std::vector<size_t> offset = {0};
  for (const StageLayout& stage : model_layout(config)) offset.push_back(offset.back() + stage.numel);
  EmbeddingActivations embedding(config, B);
  embedding_forward(config, embedding_weights(params.data(), config), embedding, tokens.data(), B);
  std::vector<BlockActivations> blocks;
  blocks.reserve(config.n_layer);
  const float* x = embedding.out;  // (B, T, C)
  for (int layer = 0; layer < config.n_layer; layer++) {
    blocks.emplace_back(config, B);
    block_forward(config, block_weights(params.data() + offset[1 + layer], config), blocks.back(), x, B);
    x = blocks.back().out;
  }
  HeadActivations head(config, B);
  head_forward(config, head_weights(params.data() + offset[1 + config.n_layer], config), head, x, targets.data(), B);
  return std::vector<float>(head.logits, head.logits + static_cast<size_t>(B) * config.seq_len * config.vocab_size);
}

int export_model(int argc, char** argv) {
  std::string checkpoint, out, logits_out;
  ArgParser parser("export_safetensors",
                   "Writes a chapter-00 checkpoint's model as safetensors with GPT-2's names (tools/README.md).");
  parser.add_string("--checkpoint", &checkpoint, "a chapter-00 checkpoint file (consolidate_checkpoint makes one)");
  parser.add_string("--out", &out, "the safetensors file to write");
  parser.add_string("--dump-logits", &logits_out,
                    "also write the tokens and logits of a fixed batch (for tools/check_safetensors.py)");
  parser.parse(argc, argv);
  if (checkpoint.empty() || out.empty()) throw FlagError("--checkpoint and --out are both needed\n" + parser.usage());

  const CheckpointReader reader(checkpoint);
  const GPTConfig config = model_from_meta([&](const std::string& key) { return reader.meta(key); });
  if (config.n_experts > 0) {
    throw UsageError(checkpoint + " holds a mixture of experts (--experts " + std::to_string(config.n_experts) +
                     "): GPT-2 has no router or experts, so there are no GPT-2 names to write them under (hint: "
                     "export a checkpoint of dense blocks)");
  }
  std::vector<float> params(count_parameters(config));  // (P)  chapter 00's flat order
  reader.read_section("params", params.data(), params.size());

  const std::vector<std::pair<std::string, std::string>> metadata = {
      {"format", "pt"},
      {"vocab_size", std::to_string(config.vocab_size)},
      {"n_positions", std::to_string(config.seq_len)},
      {"n_layer", std::to_string(config.n_layer)},
      {"n_embd", std::to_string(config.d_model)},
      {"n_head", std::to_string(config.n_head)},
      {"step", std::to_string(reader.meta("step"))}};
  write_safetensors(out, gpt2_tensors(config, params), metadata);
  std::printf("wrote %s: %zu parameters of step %lld as GPT-2 tensors\n", out.c_str(), params.size(),
              static_cast<long long>(reader.meta("step")));

  if (!logits_out.empty()) {
    const int B = 2, T = config.seq_len;
    const TextData data = load_text_data("", T);  // the built-in corpus: the same bytes everywhere
    BatchSampler sampler(data, T, B, static_cast<uint64_t>(reader.meta("seed")));
    std::vector<int> tokens(static_cast<size_t>(B) * T), targets(tokens.size());  // (B, T) each
    sampler.fill(1, 0, B, tokens.data(), targets.data());
    const std::vector<float> logits = logits_of(config, params, tokens, targets, B);  // (B, T, V)
    std::vector<char> token_bytes(tokens.size() * sizeof(int32_t));
    std::memcpy(token_bytes.data(), tokens.data(), token_bytes.size());
    write_safetensors(logits_out,
                      {{"tokens", "I32", {B, T}, token_bytes},
                       float_tensor("logits", {B, T, config.vocab_size}, logits.data(), logits.size())},
                      {{"format", "pt"}});
    std::printf("wrote %s: the logits of a fixed batch of %d x %d tokens\n", logits_out.c_str(), B, T);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return guarded_main("export_safetensors", [&] { return export_model(argc, argv); });
}
