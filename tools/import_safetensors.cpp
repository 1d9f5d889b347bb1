// Reads a GPT-2 model as safetensors, the directory export_safetensors --out-dir
// writes (or Hugging Face's save_pretrained of a GPT2LMHeadModel of the course's
// shape), or one file with GPT-2's names, and writes it as a chapter-00 checkpoint:
// the parameters, zero AdamW moments and a step, which `00_single_gpu --resume` (and
// any chapter that resumes from chapter 00's checkpoints) starts from.
//
//   import_safetensors --from hf --out-dir ckpt --seed 1337 --batch 8 [--step 0]
//   00_single_gpu ... --seed 1337 --batch 8 --checkpoint-dir ckpt --resume
//
// The model's shape comes from its tensors (V and C from wte, T from wpe, L from the
// blocks), the head count from config.json, the file's metadata or --heads. What
// does not fit the course's model is refused with one message naming the tensor:
// another vocabulary, a tied head (no lm_head.weight), a missing tensor, a wrong
// shape or dtype, a tensor the course has no parameter for. The names and
// transposes are in tools/README.md.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/model/adamw.h"
#include "common/train/checkpoint.h"
#include "common/train/cli.h"
#include "common/tensor/error.h"
#include "common/model/model.h"
#include "tools/safetensors.h"

using namespace course;
namespace fs = std::filesystem;

namespace {

const char* kHint = "(hint: the course imports GPT-2 models of a 256-byte vocabulary with an untied lm_head, "
                    "as export_safetensors --out-dir writes them)";

// The file's tensors by GPT2Model's names: GPT2LMHeadModel's "transformer." prefix
// dropped, and the attention masks older GPT-2 files keep as buffers left out.
std::map<std::string, SafeTensor> tensors_by_gpt2_name(SafetensorsFile& file) {
  std::map<std::string, SafeTensor> tensors;
  const std::string prefix = "transformer.";
  for (auto& [name, tensor] : file.tensors) {
    const std::string bare = name.compare(0, prefix.size(), prefix) == 0 ? name.substr(prefix.size()) : name;
    const bool mask = bare.size() > 10 && (bare.compare(bare.size() - 10, 10, ".attn.bias") == 0 ||
                                           bare.find(".attn.masked_bias") != std::string::npos);
    if (!mask) tensors[bare] = std::move(tensor);
  }
  return tensors;
}

const SafeTensor& tensor_named(const std::map<std::string, SafeTensor>& tensors, const std::string& name,
                               const std::string& path) {
  const auto found = tensors.find(name);
  if (found != tensors.end()) return found->second;
  if (name == "lm_head.weight") {
    throw UsageError(path + " has no tensor lm_head.weight: its head is tied to wte.weight "
                     "(tie_word_embeddings), the course's lm_head is a parameter of its own " + std::string(kHint));
  }
  throw UsageError(path + " has no tensor " + name + ", which the course's model needs " + kHint);
}

// n_head as a file writes it: a whole number from 1 to 4096, else a UsageError naming the file
// (std::stoi's bare "stoi" was the message before).
int head_count(const std::string& text, const std::string& path) {
  const bool digits = !text.empty() && text.size() <= 4 && text.find_first_not_of("0123456789") == std::string::npos;
  const int heads = digits ? std::stoi(text) : 0;
  if (heads < 1 || heads > 4096) {
    throw UsageError(path + ": n_head is '" + text + "', not a number of attention heads (1 to 4096) " + kHint);
  }
  return heads;
}

// config.json describes the model too: what it says must be what the tensors are
// (n_layer 7 beside 2 blocks' tensors, or tied embeddings, was loaded silently before).
void check_config_agrees(const std::map<std::string, std::string>& config, const GPTConfig& shape,
                         const std::string& config_path) {
  const std::vector<std::pair<std::string, int>> sizes = {{"n_layer", shape.n_layer},   {"n_embd", shape.d_model},
                                                          {"n_positions", shape.seq_len}, {"vocab_size", shape.vocab_size},
                                                          {"n_head", shape.n_head}};
  for (const auto& [key, from_tensors] : sizes) {
    const auto said = config.find(key);
    if (said != config.end() && said->second != std::to_string(from_tensors)) {
      throw UsageError(config_path + " says " + key + " " + said->second + ", the tensors make it " +
                       std::to_string(from_tensors) + " " + kHint);
    }
  }
  const auto tied = config.find("tie_word_embeddings");
  if (tied != config.end() && tied->second != "false") {
    throw UsageError(config_path + " says tie_word_embeddings " + tied->second + ": the course's lm_head is a " +
                     "parameter of its own " + kHint);
  }
}

// The model's shape: V, C from wte, T from wpe, L from the blocks' names, NH as given.
GPTConfig shape_of(const std::map<std::string, SafeTensor>& tensors, int n_head, const std::string& path) {
  const SafeTensor& wte = tensor_named(tensors, "wte.weight", path);
  const SafeTensor& wpe = tensor_named(tensors, "wpe.weight", path);
  if (wte.shape.size() != 2 || wpe.shape.size() != 2) {
    throw UsageError(path + ": wte.weight " + shape_text(wte.shape) + " and wpe.weight " + shape_text(wpe.shape) +
                     " are not matrices " + kHint);
  }
  if (wte.shape[0] != 256) {
    throw UsageError(path + ": wte.weight " + shape_text(wte.shape) + " has a vocabulary of " +
                     std::to_string(wte.shape[0]) + " tokens, the course's is the 256 bytes " + kHint);
  }
  if (wte.shape[1] <= 0 || wpe.shape[0] <= 0 || wpe.shape[1] != wte.shape[1]) {
    throw UsageError(path + ": wte.weight " + shape_text(wte.shape) + " and wpe.weight " + shape_text(wpe.shape) +
                     " need rows and the same width " + kHint);
  }
  GPTConfig config;
  config.vocab_size = 256;
  config.d_model = static_cast<int>(wte.shape[1]);
  config.seq_len = static_cast<int>(wpe.shape[0]);
  config.n_head = n_head;
  // L: the blocks h.0 .. h.L-1 the names count, each a block's 12 tensors. A name's
  // number is checked against the file's own tensor count before it sizes anything:
  // "h.99999999999.ln_1.weight" once asked for 3.8 GB.
  const long long most_blocks = static_cast<long long>(tensors.size()) / 12;
  config.n_layer = 0;
  for (const auto& [name, tensor] : tensors) {
    if (name.compare(0, 2, "h.") != 0) continue;
    const size_t dot = name.find('.', 2);
    const std::string number = name.substr(2, dot == std::string::npos ? std::string::npos : dot - 2);
    if (number.empty() || number.find_first_not_of("0123456789") != std::string::npos || number.size() > 9 ||
        (number.size() > 1 && number[0] == '0') ||
        std::stoll(number) >= most_blocks) {
      throw UsageError(path + ": tensor " + name + " names block '" + number + "', which the file's " +
                       std::to_string(tensors.size()) + " tensors cannot hold (blocks 0 to " +
                       std::to_string(most_blocks - 1) + ") " + kHint);
    }
    config.n_layer = std::max(config.n_layer, static_cast<int>(std::stoll(number)) + 1);
  }
  if (config.n_layer == 0) tensor_named(tensors, "h.0.ln_1.weight", path);  // refused: no block at all
  if (n_head < 0) {
    throw UsageError(path + " says the model has " + std::to_string(n_head) + " attention heads " + kHint);
  }
  if (n_head == 0) {
    throw UsageError(path + " does not say how many attention heads the model has (hint: give --heads, or a "
                     "directory with its config.json)");
  }
  if (config.d_model % n_head != 0) {
    throw UsageError(path + ": " + std::to_string(n_head) + " heads do not divide n_embd " +
                     std::to_string(config.d_model) + " (hint: give --heads, or a directory with its config.json)");
  }
  return config;
}

// The course's flat parameters (chapter 00's order) out of the GPT-2 tensors; each
// tensor is checked and used once, and one the course has no parameter for is refused.
std::vector<float> course_params(const GPTConfig& config, const std::map<std::string, SafeTensor>& tensors,
                                 const std::string& path) {
  std::vector<float> params(count_parameters(config));  // (P)
  std::set<std::string> used;
  size_t stage_offset = 0;
  for (const StageLayout& stage : model_layout(config)) {
    for (const ParamSpec& spec : stage.params) {
      const Gpt2Name gpt2 = gpt2_name(spec.name);
      const SafeTensor& tensor = tensor_named(tensors, gpt2.name, path);
      const std::vector<int64_t> expected =
          gpt2.transposed ? std::vector<int64_t>{spec.shape[1], spec.shape[0]} : spec.shape;
      if (tensor.dtype != "F32" || tensor.shape != expected) {
        throw UsageError(path + ": tensor " + gpt2.name + " is " + tensor.dtype + " " + shape_text(tensor.shape) +
                         ", the model that wte.weight, wpe.weight and the blocks describe needs F32 " +
                         shape_text(expected) + " " + kHint);
      }
      float* values = params.data() + stage_offset + spec.offset;  // (spec.shape)
      const float* stored = reinterpret_cast<const float*>(tensor.bytes.data());  // (expected)
      if (!gpt2.transposed) {
        std::memcpy(values, stored, spec.numel * sizeof(float));
      } else {
        const size_t rows = spec.shape[0], cols = spec.shape[1];
        for (size_t r = 0; r < rows; r++) {
          for (size_t c = 0; c < cols; c++) values[r * cols + c] = stored[c * rows + r];
        }
      }
      used.insert(gpt2.name);
    }
    stage_offset += stage.numel;
  }
  for (const auto& [name, tensor] : tensors) {
    if (used.count(name) == 0) {
      throw UsageError(path + ": tensor " + name + " " + shape_text(tensor.shape) +
                       " is no parameter of the course's model " + kHint);
    }
  }
  return params;
}

int import_model(int argc, char** argv) {
  std::string from, out_dir;
  TrainOptions options;
  options.model.n_head = 0;
  int step = 0;
  ArgParser parser("import_safetensors",
                   "Writes a GPT-2 safetensors model as a chapter-00 checkpoint (tools/README.md).");
  parser.add_string("--from", &from, "a directory with model.safetensors (and config.json), or a safetensors file");
  parser.add_string("--out-dir", &out_dir, "the checkpoint directory to write step_<--step>.ckpt into");
  parser.add_uint64("--seed", &options.seed, "the --seed the runs that resume from it will use");
  parser.add_int("--batch", &options.batch, 1, "the --batch the runs that resume from it will use");
  parser.add_int("--step", &step, 0, "the step the checkpoint says it was taken after");
  parser.add_int("--heads", &options.model.n_head, 0, "attention heads, when neither config.json nor the file says");
  parser.parse(argc, argv);
  if (from.empty() || out_dir.empty()) throw FlagError("--from and --out-dir are both needed\n" + parser.usage());

  const bool directory = fs::is_directory(from);
  const std::string path = directory ? from + "/model.safetensors" : from;
  SafetensorsFile file = read_safetensors(path);
  const std::string config_path = from + "/config.json";
  std::map<std::string, std::string> config;  // config.json's values, when the directory has one
  if (directory && fs::exists(config_path)) config = read_json_object(config_path);
  if (options.model.n_head == 0 && config.count("n_head") > 0) {
    options.model.n_head = head_count(config.at("n_head"), config_path);
  }
  if (options.model.n_head == 0 && file.metadata.count("n_head") > 0) {
    options.model.n_head = head_count(file.metadata.at("n_head"), path);
  }
  const std::map<std::string, SafeTensor> tensors = tensors_by_gpt2_name(file);
  options.model = shape_of(tensors, options.model.n_head, path);
  check_config_agrees(config, options.model, config_path);
  const std::vector<float> params = course_params(options.model, tensors, path);

  ensure_checkpoint_dir(out_dir);
  const AdamW optimizer(AdamWConfig{}, params.size());  // zero moments: a fresh optimizer
  const std::string checkpoint = checkpoint_path(out_dir, step);
  save_training_state(checkpoint, options, step, params.data(), optimizer);
  std::printf("wrote %s: %zu parameters (%d layers, d_model %d, %d heads, seq %d) at step %d, seed %llu, batch %d\n",
              checkpoint.c_str(), params.size(), options.model.n_layer, options.model.d_model,
              options.model.n_head, options.model.seq_len, step, static_cast<unsigned long long>(options.seed),
              options.batch);
  // what the reader meets next: a loss that jumps at the first update, and a directory
  // that the first chapter to resume from it also saves into
  std::printf("its AdamW moments are zero (a safetensors file holds none): the first update after a resume is a "
              "fresh optimizer's, so the loss may jump there (tools/README.md)\n"
              "a chapter resumed with --checkpoint-dir %s saves its own checkpoints there too, and the next resume "
              "continues that run: copy the directory for each run that should start from the import\n",
              out_dir.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return guarded_main("import_safetensors", [&] { return import_model(argc, argv); });
}
