// Puts a sharded checkpoint back together as one chapter-00 checkpoint: the whole
// model's parameters and AdamW moments in chapter 00's flat order, which
// `00_single_gpu --resume` loads (and export_safetensors reads).
//
//   consolidate_checkpoint --checkpoint-dir ckpt --out-dir whole          # the newest complete step
//   consolidate_checkpoint --checkpoint-dir ckpt --out-dir whole --step 4
//   ./build/bin/00_single_gpu ... --checkpoint-dir whole --resume
//
// It works for any checkpoint with a manifest (common/train/checkpoint_manifest.h):
// the manifest says which elements every file holds, so this tool knows nothing of
// how the chapter that wrote it cut the model.
#include <cstdio>
#include <string>
#include <vector>

#include "common/train/checkpoint.h"
#include "common/train/checkpoint_manifest.h"
#include "common/train/cli.h"
#include "common/tensor/error.h"

using namespace course;

// The model flags chapter 00 needs to resume this model: those whose value is not the default
static std::string model_flags(const GPTConfig& config) {
  const GPTConfig defaults;
  std::string flags;
  const auto add = [&](const char* flag, int value, int default_value) {
    if (value != default_value) flags += std::string(" ") + flag + " " + std::to_string(value);
  };
  add("--layers", config.n_layer, defaults.n_layer);
  add("--d-model", config.d_model, defaults.d_model);
  add("--heads", config.n_head, defaults.n_head);
  add("--seq", config.seq_len, defaults.seq_len);
  add("--experts", config.n_experts, defaults.n_experts);
  if (config.n_experts > 0) add("--top-k", config.top_k, 0);  // said with --experts, whatever it is
  return flags;
}

static int consolidate(int argc, char** argv) {
  std::string checkpoint_dir, out_dir;
  int step = 0;
  ArgParser parser("consolidate_checkpoint",
                   "Joins a sharded checkpoint (any chapter that writes a manifest) into one chapter-00 checkpoint.");
  parser.add_string("--checkpoint-dir", &checkpoint_dir, "the sharded checkpoint's directory (the trainer's)");
  parser.add_string("--out-dir", &out_dir, "where to write step_<N>.ckpt for 00_single_gpu --checkpoint-dir");
  parser.add_int("--step", &step, 0, "which step (0: the newest that every rank finished saving)");
  parser.parse(argc, argv);
  if (checkpoint_dir.empty() || out_dir.empty()) {
    throw FlagError("--checkpoint-dir and --out-dir are both needed\n" + parser.usage());
  }
  if (step == 0) {
    const auto newest = latest_complete_rank_checkpoint(checkpoint_dir);
    if (!newest) {
      throw UsageError("no complete sharded checkpoint in '" + checkpoint_dir +
                       "' (hint: point --checkpoint-dir at a trainer's, with files step_<N>_rank<r>.ckpt)");
    }
    step = static_cast<int>(CheckpointReader(*newest).meta("step"));
  }

  const CheckpointManifest manifest = read_manifest(manifest_path(checkpoint_dir, step));
  const GPTConfig config = manifest_config(manifest);
  const size_t P = count_parameters(config);
  std::vector<float> params(P), adam_m(P), adam_v(P);  // (P) each, chapter 00's flat order
  load_pieces(manifest, checkpoint_dir, pieces_of_flat_range(manifest.params, 0, P), params.data(), adam_m.data(),
              adam_v.data());

  // what save_training_state writes, with the run's meta taken from the manifest
  CheckpointWriter writer;
  write_model_meta(writer, config);
  for (const char* key : {"step", "seed", "global_batch"}) writer.set_meta(key, manifest.get(key));
  writer.add_section("params", params.data(), P);
  writer.add_section("adam_m", adam_m.data(), P);
  writer.add_section("adam_v", adam_v.data(), P);
  ensure_checkpoint_dir(out_dir);
  const std::string out = checkpoint_path(out_dir, step);
  writer.write(out);
  std::printf("read step %d, saved as %s (%zu files)\n", step, manifest.layout.c_str(), manifest.shards.size());
  std::printf("wrote %s: %zu parameters with their AdamW moments\n  resume it: 00_single_gpu --checkpoint-dir %s "
              "--resume%s\n",
              out.c_str(), P, out_dir.c_str(), model_flags(config).c_str());
  return 0;
}

int main(int argc, char** argv) {
  return guarded_main("consolidate_checkpoint", [&] { return consolidate(argc, argv); });
}
