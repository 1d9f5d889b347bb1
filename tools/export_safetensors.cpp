// Writes a chapter-00 checkpoint's model as a safetensors file with GPT-2's names,
// so the rest of the ecosystem (PyTorch, Hugging Face) can load what the course
// trained. The names, shapes and transposes are in tools/README.md.
//
//   export_safetensors --checkpoint ckpt/step_00000030.ckpt --out model.safetensors
//   export_safetensors --checkpoint ... --out model.safetensors --dump-logits logits.safetensors
//   export_safetensors --checkpoint ... --out-dir hf    (from_pretrained("hf") loads it)
//
// A sharded checkpoint is first made one file by consolidate_checkpoint.
// --dump-logits also runs the model on a fixed batch (2 rows of its training text,
// --data or the built-in corpus, the checkpoint's seed, step 1) and writes its tokens and logits, which
// tools/check_safetensors.py compares with a plain PyTorch GPT-2 on the export.
// The format is in tools/safetensors.h.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/train/checkpoint.h"
#include "common/train/cli.h"
#include "common/model/data.h"
#include "common/tensor/error.h"
#include "common/model/model.h"
#include "tools/safetensors.h"

using namespace course;

namespace {

// prefix: "" for a bare GPT2Model's names, "transformer." for GPT2LMHeadModel's (whose
// lm_head sits beside the transformer, so it never takes the prefix)
std::vector<SafeTensor> gpt2_tensors(const GPTConfig& config, const std::vector<float>& params,
                                     const std::string& prefix) {
  std::vector<SafeTensor> tensors;
  size_t stage_offset = 0;
  for (const StageLayout& stage : model_layout(config)) {
    for (const ParamSpec& spec : stage.params) {
      const float* values = params.data() + stage_offset + spec.offset;  // (spec.shape)
      Gpt2Name gpt2 = gpt2_name(spec.name);
      if (gpt2.name != "lm_head.weight") gpt2.name = prefix + gpt2.name;
      if (!gpt2.transposed) {
        tensors.push_back(float_safetensor(gpt2.name, spec.shape, values, spec.numel));
        continue;
      }
      const size_t rows = spec.shape[0], cols = spec.shape[1];
      std::vector<float> transposed(spec.numel);  // (cols, rows)
      for (size_t r = 0; r < rows; r++) {
        for (size_t c = 0; c < cols; c++) transposed[c * rows + r] = values[r * cols + c];
      }
      tensors.push_back(float_safetensor(gpt2.name, {spec.shape[1], spec.shape[0]}, transposed.data(), spec.numel));
    }
    stage_offset += stage.numel;
  }
  return tensors;
}

// The character GPT-2's byte-level tokenizer writes byte b as: the printable
// Latin-1 bytes as themselves, the other 68 as U+0100 onwards in byte order, so that
// every byte is one visible character in tokenizer.json.
int byte_level_code_point(int byte) {
  const auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; };
  if (printable(byte)) return byte;
  int others_before = 0;
  for (int b = 0; b < byte; b++) others_before += printable(b) ? 0 : 1;
  return 256 + others_before;
}

// byte_level_code_point(byte) as a JSON string literal, e.g. "a", "\u0100"
std::string byte_level_json(int byte) {
  const int code = byte_level_code_point(byte);
  char text[16];
  if (code < 0x7F && code != '"' && code != '\\') {
    std::snprintf(text, sizeof(text), "\"%c\"", code);
  } else {
    std::snprintf(text, sizeof(text), "\"\\u%04X\"", code);
  }
  return text;
}

// The end-of-text token: byte 0 (NUL), which text never holds, so a generation runs
// to its length and a decoded text has no stray marker (tools/README.md).
const int kEndOfTextByte = 0;

// tokenizer.json: a byte-level BPE with no merges, so token id = byte value
void write_tokenizer(const std::string& dir) {
  const std::string eos = byte_level_json(kEndOfTextByte);
  const std::string byte_level = "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":false,"
                                 "\"use_regex\":false}";
  std::string vocab;
  for (int byte = 0; byte < 256; byte++) {
    vocab += (byte ? "," : "") + byte_level_json(byte) + ":" + std::to_string(byte);
  }
  const std::string tokenizer =
      "{\"version\":\"1.0\",\"truncation\":null,\"padding\":null,\"added_tokens\":[{\"id\":" +
      std::to_string(kEndOfTextByte) + ",\"content\":" + eos +
      ",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,\"normalized\":false,\"special\":true}],"
      "\"normalizer\":null,\"pre_tokenizer\":" + byte_level + ",\"post_processor\":null,\"decoder\":" + byte_level +
      ",\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,\"continuing_subword_prefix\":null,"
      "\"end_of_word_suffix\":null,\"fuse_unk\":false,\"byte_fallback\":false,\"ignore_merges\":false,"
      "\"vocab\":{" + vocab + "},\"merges\":[]}}\n";
  write_file_atomically(dir + "/tokenizer.json", tokenizer, "", "tokenizer.json");
  const std::string config = "{\"tokenizer_class\":\"PreTrainedTokenizerFast\",\"bos_token\":" + eos +
                             ",\"eos_token\":" + eos + ",\"pad_token\":" + eos +
                             ",\"clean_up_tokenization_spaces\":false}\n";
  write_file_atomically(dir + "/tokenizer_config.json", config, "", "tokenizer_config.json");
}

// config.json: GPT2LMHeadModel of the course's shape (its defaults are GPT-2 small's)
void write_model_config(const std::string& dir, const GPTConfig& config) {
  const std::string T = std::to_string(config.seq_len), eos = std::to_string(kEndOfTextByte);
  const std::string json =
      "{\"architectures\":[\"GPT2LMHeadModel\"],\"model_type\":\"gpt2\",\"vocab_size\":" +
      std::to_string(config.vocab_size) + ",\"n_positions\":" + T + ",\"n_ctx\":" + T +
      ",\"n_embd\":" + std::to_string(config.d_model) + ",\"n_layer\":" + std::to_string(config.n_layer) +
      ",\"n_head\":" + std::to_string(config.n_head) + ",\"n_inner\":null,\"activation_function\":\"gelu_new\","
      "\"layer_norm_epsilon\":1e-05,\"resid_pdrop\":0.0,\"embd_pdrop\":0.0,\"attn_pdrop\":0.0,"
      "\"initializer_range\":0.02,\"scale_attn_weights\":true,\"tie_word_embeddings\":false,\"bos_token_id\":" + eos +
      ",\"eos_token_id\":" + eos + ",\"pad_token_id\":" + eos + ",\"torch_dtype\":\"float32\"}\n";
  write_file_atomically(dir + "/config.json", json, "", "config.json");
}

// The directory Hugging Face's from_pretrained loads as it is.
void write_hugging_face_dir(const std::string& dir, const GPTConfig& config, const std::vector<float>& params) {
  ensure_checkpoint_dir(dir);
  write_safetensors(dir + "/model.safetensors", gpt2_tensors(config, params, "transformer."), {{"format", "pt"}});
  write_model_config(dir, config);
  write_tokenizer(dir);
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

// Two sequences (B = 2) of the model's training text at step 1 with the checkpoint's
// seed, as chapter 00's first batch, and the course's logits on them.
void dump_logits(const std::string& path, const std::string& data_path, const CheckpointReader& reader,
                 const GPTConfig& config, std::vector<float>& params) {
  const int B = 2, T = config.seq_len;
  const TextData data = load_text_data(data_path, T);
  BatchSampler sampler(data, T, B, static_cast<uint64_t>(reader.meta("seed")));
  std::vector<int> tokens(static_cast<size_t>(B) * T), targets(tokens.size());  // (B, T) each
  sampler.fill(1, 0, B, tokens.data(), targets.data());
  const std::vector<float> logits = logits_of(config, params, tokens, targets, B);  // (B, T, V)
  std::vector<char> token_bytes(tokens.size() * sizeof(int32_t));
  std::memcpy(token_bytes.data(), tokens.data(), token_bytes.size());
  write_safetensors(path,
                    {{"tokens", "I32", {B, T}, token_bytes},
                     float_safetensor("logits", {B, T, config.vocab_size}, logits.data(), logits.size())},
                    {{"format", "pt"}});
  std::printf("wrote %s: the logits of a fixed batch of %d x %d tokens of %s\n", path.c_str(), B, T,
              data_path.empty() ? "the built-in corpus" : data_path.c_str());
}

int export_model(int argc, char** argv) {
  std::string checkpoint, out, out_dir, logits_out, data_path;
  ArgParser parser("export_safetensors",
                   "Writes a chapter-00 checkpoint's model as safetensors with GPT-2's names (tools/README.md).");
  parser.add_string("--checkpoint", &checkpoint, "a chapter-00 checkpoint file (consolidate_checkpoint makes one)");
  parser.add_string("--out", &out, "the safetensors file to write (GPT2Model's names)");
  parser.add_string("--out-dir", &out_dir,
                    "the directory to write for Hugging Face's from_pretrained: config.json, model.safetensors, "
                    "tokenizer.json, tokenizer_config.json");
  parser.add_string("--dump-logits", &logits_out,
                    "also write the tokens and logits of a fixed batch (for tools/check_safetensors.py)");
  parser.add_string("--data", &data_path,
                    "the text the model trained on (its --data), for --dump-logits' batch (none: the built-in corpus)");
  parser.parse(argc, argv);
  if (checkpoint.empty() || (out.empty() && out_dir.empty())) {
    throw FlagError("--checkpoint and one of --out and --out-dir are needed\n" + parser.usage());
  }

  const CheckpointReader reader(checkpoint);
  const GPTConfig config = model_from_meta([&](const std::string& key) { return reader.meta(key); });
  if (config.n_experts > 0) {
    throw UsageError(checkpoint + " holds a mixture of experts (--experts " + std::to_string(config.n_experts) +
                     "): GPT-2 has no router or experts, so there are no GPT-2 names to write them under (hint: "
                     "export a checkpoint of dense blocks)");
  }
  std::vector<float> params(count_parameters(config));  // (P)  chapter 00's flat order
  reader.read_section("params", params.data(), params.size());
  const long long step = reader.meta("step");

  if (!out.empty()) {
    const std::vector<std::pair<std::string, std::string>> metadata = {
        {"format", "pt"},
        {"vocab_size", std::to_string(config.vocab_size)},
        {"n_positions", std::to_string(config.seq_len)},
        {"n_layer", std::to_string(config.n_layer)},
        {"n_embd", std::to_string(config.d_model)},
        {"n_head", std::to_string(config.n_head)},
        {"step", std::to_string(step)}};
    write_safetensors(out, gpt2_tensors(config, params, ""), metadata);
    std::printf("wrote %s: %zu parameters of step %lld as GPT-2 tensors\n", out.c_str(), params.size(), step);
  }
  if (!out_dir.empty()) {
    write_hugging_face_dir(out_dir, config, params);
    std::printf("wrote %s: %zu parameters of step %lld as a Hugging Face GPT2LMHeadModel with a byte tokenizer\n",
                out_dir.c_str(), params.size(), step);
  }
  if (!logits_out.empty()) dump_logits(logits_out, data_path, reader, config, params);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return guarded_main("export_safetensors", [&] { return export_model(argc, argv); });
}
