// tools/export_safetensors: a chapter-00 checkpoint as a safetensors file with
// GPT-2's names, shapes and (Conv1D) transposes; and, where PyTorch is importable,
// tools/check_safetensors.py loading it into a plain PyTorch GPT-2 whose logits on a
// fixed batch must match the course's within 1e-5; its Hugging Face directory, which
// tools/check_hf_export.py loads with from_pretrained; and tools/import_safetensors
// reading that directory back into a checkpoint chapter 00 resumes from, and so do
// the sharded chapters (03 at ZeRO-3, 06 at --tp 2), resharding it on load.
//
// The PyTorch check runs `python3`, or the interpreter COURSE_TORCH_PYTHON names
// (e.g. COURSE_TORCH_PYTHON=~/.cache/course-bench-venv/bin/python); where neither
// imports torch it exits 77, which CTest reports as skipped (SKIP_RETURN_CODE).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <string>
#include <typeinfo>
#include <vector>

#include "common/tensor/error.h"
#include "common/train/checkpoint.h"
#include "tools/safetensors.h"
#include "support/equivalence_model.h"
#include "support/matchers.h"
#include "support/process.h"
#include "support/python.h"
#include "support/runs.h"

using course_test::concat;
using course_test::course_binary;
using course_test::ProcessResult;
using course_test::python_with;
using course_test::TempDir;

namespace {

const double kTimeoutSeconds = 120;

ProcessResult run_ok(const std::vector<std::string>& argv) { return course_test::run_ok(argv, kTimeoutSeconds); }

// Chapter 00 trained 3 steps with the small model, exported (with the fixed batch's
// logits) into dir: model.safetensors, the Hugging Face directory hf/ and
// logits.safetensors. Returns the checkpoint.
std::string train_and_export(const TempDir& dir) {
  run_ok(concat({course_binary("00_single_gpu"), "--quiet"},
                concat(course_test::kModel, {"--batch", "4", "--steps", "3", "--checkpoint-dir", dir.file("ck")})));
  const std::string checkpoint = course::checkpoint_path(dir.file("ck"), 3);
  run_ok({course_binary("export_safetensors"), "--checkpoint", checkpoint, "--out", dir.file("model.safetensors"),
          "--out-dir", dir.file("hf"), "--dump-logits", dir.file("logits.safetensors")});
  return checkpoint;
}

}  // namespace

TEST_CASE("the export has GPT-2's names and shapes, its Conv1D matrices transposed", "[export]") {
  TempDir dir;
  const std::string checkpoint = train_and_export(dir);
  const std::string file = course_test::read_file(dir.file("model.safetensors"));
  uint64_t header_bytes = 0;
  REQUIRE(file.size() > 8);
  std::memcpy(&header_bytes, file.data(), 8);
  REQUIRE(header_bytes % 8 == 0);  // the data starts 8-byte aligned
  const std::string header = file.substr(8, header_bytes);
  const int C = 32;
  for (const char* tensor :
       {"\"wte.weight\":{\"dtype\":\"F32\",\"shape\":[256,32]", "\"wpe.weight\":{\"dtype\":\"F32\",\"shape\":[32,32]",
        "\"h.1.ln_1.weight\":{\"dtype\":\"F32\",\"shape\":[32]",
        "\"h.0.attn.c_attn.weight\":{\"dtype\":\"F32\",\"shape\":[32,96]",
        "\"h.0.attn.c_attn.bias\":{\"dtype\":\"F32\",\"shape\":[96]",
        "\"h.1.mlp.c_fc.weight\":{\"dtype\":\"F32\",\"shape\":[32,128]",
        "\"h.1.mlp.c_proj.weight\":{\"dtype\":\"F32\",\"shape\":[128,32]",
        "\"ln_f.bias\":{\"dtype\":\"F32\",\"shape\":[32]", "\"lm_head.weight\":{\"dtype\":\"F32\",\"shape\":[256,32]",
        "\"__metadata__\":{\"format\":\"pt\""}) {
    CHECK_THAT(header, Catch::Contains(tensor));
  }
  // c_attn.weight[i][j] is our qkv_w[j][i]: qkv_w follows wte (256 C), wpe (32 C),
  // ln_1 (2 C) in chapter 00's buffer; c_attn follows wte and wpe in the export
  const course::CheckpointReader reader(checkpoint);
  std::vector<float> params(course_test::parameter_count());
  reader.read_section("params", params.data(), params.size());
  const size_t qkv_w = (256 + 32 + 2) * C;
  const std::string key = "\"h.0.attn.c_attn.weight\":{\"dtype\":\"F32\",\"shape\":[32,96],\"data_offsets\":[";
  const size_t at = header.find(key);
  REQUIRE(at != std::string::npos);
  const size_t begin = std::stoull(header.substr(at + key.size()));
  const float* c_attn = reinterpret_cast<const float*>(file.data() + 8 + header_bytes + begin);  // (C, 3C)
  for (size_t i = 0; i < static_cast<size_t>(C); i += 7) {
    for (size_t j = 0; j < static_cast<size_t>(3 * C); j += 11) {
      INFO("c_attn.weight[" << i << "][" << j << "]");
      CHECK(c_attn[i * 3 * C + j] == params[qkv_w + j * C + i]);
    }
  }
}

TEST_CASE("PyTorch loads the export and its logits on a fixed batch match the course's within 1e-5", "[export]") {
  const std::string python = python_with("torch");
  TempDir dir;
  train_and_export(dir);
  const ProcessResult check = run_ok({python, std::string(COURSE_TOOLS_DIR) + "/check_safetensors.py",
                                      dir.file("model.safetensors"), dir.file("logits.safetensors")});
  CHECK_THAT(check.out, Catch::Contains("29 GPT-2 tensors, logits (2, 32, 256), max |PyTorch - course| = "));
}

TEST_CASE("Hugging Face loads the export directory as it is: logits within 1e-5, the byte tokenizer, generate",
          "[export]") {
  const std::string python = python_with("torch, transformers, safetensors");
  TempDir dir;
  train_and_export(dir);
  const ProcessResult check = run_ok({python, std::string(COURSE_TOOLS_DIR) + "/check_hf_export.py", dir.file("hf"),
                                      dir.file("logits.safetensors")});
  CHECK_THAT(check.out, Catch::Contains("GPT2LMHeadModel, every tensor loaded, none missing or left over, logits (2, "
                                        "32, 256), max |Hugging Face - course| = "));
}

namespace {

// The floats of a checkpoint's section, to compare bit for bit.
std::vector<float> section(const std::string& checkpoint, const std::string& name) {
  const course::CheckpointReader reader(checkpoint);
  std::vector<float> values(reader.section_size(name));
  reader.read_section(name, values.data(), values.size());
  return values;
}

}  // namespace

TEST_CASE("an exported model imported back is the checkpoint's parameters bit for bit, and chapter 00 resumes it",
          "[export]") {
  TempDir dir;
  const std::string checkpoint = train_and_export(dir);
  for (const std::string& from : {dir.file("hf"), dir.file("model.safetensors")}) {
    INFO("--from " << from);
    const std::string imported = from + ".imported";
    run_ok({course_binary("import_safetensors"), "--from", from, "--out-dir", imported, "--batch", "4", "--step", "3"});
    const std::string file = course::checkpoint_path(imported, 3);
    const std::vector<float> ours = section(checkpoint, "params"), back = section(file, "params");
    REQUIRE(back.size() == ours.size());
    CHECK(std::memcmp(back.data(), ours.data(), ours.size() * sizeof(float)) == 0);
    CHECK(section(file, "adam_m") == std::vector<float>(ours.size(), 0.0f));
    CHECK(section(file, "adam_v") == std::vector<float>(ours.size(), 0.0f));
    const ProcessResult resumed = run_ok(concat(
        {course_binary("00_single_gpu")},
        concat(course_test::kModel, {"--batch", "4", "--steps", "5", "--checkpoint-dir", imported, "--resume"})));
    CHECK_THAT(resumed.out, Catch::Contains("continuing at step 4"));
    CHECK_THAT(resumed.out, Catch::Contains("final loss"));
  }
}

TEST_CASE("chapters 03 (ZeRO-3) and 06 (--tp 2) resume an imported model, resharding it, with chapter 00's losses",
          "[export]") {
  TempDir dir;
  train_and_export(dir);
  run_ok({course_binary("import_safetensors"), "--from", dir.file("hf"), "--out-dir", dir.file("imported"), "--batch",
          "8", "--step", "3"});
  // steps 4 to 6 from the imported step 3, each run in its own copy of it (a run's
  // saves must not become the next run's start); its stdout and its log
  const auto resume = [&](const std::string& name, const std::vector<std::string>& program) {
    std::filesystem::copy(dir.file("imported"), dir.file(name));
    const std::string log = dir.file(name + ".jsonl");
    const ProcessResult result = run_ok(concat(concat(program, course_test::kModel),
                                               {"--batch", "8", "--steps", "6", "--checkpoint-dir", dir.file(name),
                                                "--resume", "--log", log}));
    return std::make_pair(result.out, course_test::read_log(log));
  };
  const course_test::RunLog chapter00 = resume("00", {course_binary("00_single_gpu"), "--quiet"}).second;
  struct Sharded {
    std::string chapter;
    std::vector<std::string> technique;
  };
  for (const Sharded& sharded :
       {Sharded{"03_fsdp", {"--zero-stage", "3"}}, Sharded{"06_tensor_parallel", {"--tp", "2"}}}) {
    INFO(sharded.chapter);
    const auto [out, log] = resume(
        sharded.chapter, concat(concat(course_test::launcher_command(2), {course_binary(sharded.chapter), "--quiet",
                                                                          "--backend", "tcp", "--comm-timeout", "60"}),
                                sharded.technique));
    CHECK_THAT(out, Catch::Contains("[rank 0]   saved as: one file of the whole model (chapter 00's format)\n"));
    // the whole file, with no other ranks' files
    CHECK_THAT(out, Catch::Contains("resumed from " + course::checkpoint_path(dir.file(sharded.chapter), 3) +
                                    ": continuing at step 4\n"));
    REQUIRE(log.steps.size() == 3);
    CHECK(log.steps.front().at("step") == "4");
    course_test::check_losses_close(log, chapter00, 1);
  }
}

TEST_CASE("import_safetensors refuses a model that does not fit the course's, naming the tensor", "[export]") {
  TempDir dir;
  train_and_export(dir);
  struct Case {
    std::string what;
    std::function<void(std::map<std::string, course::SafeTensor>&)> change;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"a missing tensor", [](auto& t) { t.erase("transformer.h.1.mlp.c_fc.weight"); },
       "has no tensor h.1.mlp.c_fc.weight, which the course's model needs"},
      {"a wrong shape", [](auto& t) { t["transformer.h.0.attn.c_proj.weight"].shape = {16, 64}; },
       "tensor h.0.attn.c_proj.weight is F32 (16, 64), the model that wte.weight, wpe.weight and the blocks "
       "describe needs F32 (32, 32)"},
      {"a tied head", [](auto& t) { t.erase("lm_head.weight"); }, "has no tensor lm_head.weight: its head is tied"},
      {"another vocabulary",
       [](auto& t) {
         t["transformer.wte.weight"].shape = {128, 32};
         t["transformer.wte.weight"].bytes.resize(128 * 32 * sizeof(float));
       },
       "wte.weight (128, 32) has a vocabulary of 128 tokens, the course's is the 256 bytes"},
      {"a tensor the course has no parameter for",
       [](auto& t) { t["transformer.h.0.mlp.gate.weight"] = t["transformer.ln_f.bias"]; },
       "tensor h.0.mlp.gate.weight (32) is no parameter of the course's model"}};
  for (const Case& bad : cases) {
    INFO(bad.what);
    course::SafetensorsFile file = course::read_safetensors(dir.file("hf") + "/model.safetensors");
    bad.change(file.tensors);
    std::vector<course::SafeTensor> tensors;
    for (const auto& [name, tensor] : file.tensors) {
      tensors.push_back(tensor);
      tensors.back().name = name;
    }
    const std::string path = dir.file("bad.safetensors");
    course::write_safetensors(path, tensors, {{"format", "pt"}, {"n_head", "4"}});
    const ProcessResult result = course_test::run_process(
        {course_binary("import_safetensors"), "--from", path, "--out-dir", dir.file("refused")}, kTimeoutSeconds);
    INFO(result.describe() << "\n" << result.err);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.err, Catch::Contains(bad.says));
  }
}

TEST_CASE("what Hugging Face's save_pretrained writes of the export imports back bit for bit", "[export]") {
  const std::string python = python_with("torch, transformers, safetensors");
  TempDir dir;
  const std::string checkpoint = train_and_export(dir);
  run_ok({python, std::string(COURSE_TOOLS_DIR) + "/check_hf_export.py", dir.file("hf"), dir.file("logits.safetensors"),
          dir.file("saved")});
  run_ok({course_binary("import_safetensors"), "--from", dir.file("saved"), "--out-dir", dir.file("imported"),
          "--batch", "4", "--step", "3"});
  const std::vector<float> ours = section(checkpoint, "params");
  const std::vector<float> back = section(course::checkpoint_path(dir.file("imported"), 3), "params");
  REQUIRE(back.size() == ours.size());
  CHECK(std::memcmp(back.data(), ours.data(), ours.size() * sizeof(float)) == 0);
}

// The header is JSON that anyone may have written. 30,000 nested '[' crashed the
// reader's recursion (SIGSEGV); a key given twice was read as its later value.
TEST_CASE("a safetensors header nested 30,000 deep or with a key twice is refused, not crashed on or half-read",
          "[export]") {
  TempDir dir;
  const auto file_with_header = [&dir](const std::string& name, const std::string& header, size_t data_bytes) {
    const std::string path = dir.file(name);
    std::ofstream out(path, std::ios::binary);
    const uint64_t length = header.size();  // little-endian on every machine the course runs on
    out.write(reinterpret_cast<const char*>(&length), sizeof(length));
    out << header << std::string(data_bytes, '\0');
    return path;
  };
  const std::string nested = file_with_header("nested.safetensors", std::string(30000, '[') + std::string(30000, ']'), 0);
  REQUIRE_THROWS_MATCHES(course::read_safetensors(nested), course::UsageError,
                         course_test::MessageContains("nesting deeper than 64 levels"));
  const std::string tensor = R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  const std::string twice = file_with_header("twice.safetensors", "{\"a\":" + tensor + ",\"a\":" + tensor + "}", 4);
  REQUIRE_THROWS_MATCHES(course::read_safetensors(twice), course::UsageError,
                         course_test::MessageContains("the key \"a\" a second time"));
}

TEST_CASE("a safetensors file whose tensors overlap, leave bytes over, wrap their size or hold a NaN is refused",
          "[export]") {
  TempDir dir;
  const auto file_with_header = [&dir](const std::string& name, const std::string& header, const std::string& data) {
    const std::string path = dir.file(name);
    std::ofstream out(path, std::ios::binary);
    const uint64_t length = header.size();
    out.write(reinterpret_cast<const char*>(&length), sizeof(length));
    out << header << data;
    return path;
  };
  const auto tensor = [](const std::string& shape, int begin, int end) {
    return R"({"dtype":"F32","shape":[)" + shape + R"(],"data_offsets":[)" + std::to_string(begin) + "," +
           std::to_string(end) + "]}";
  };
  const std::string eight(8, '\0');  // two float zeros
  struct Case {
    std::string what, header, data, says;
  };
  const float nan = std::nanf("");
  std::string nan_bytes(4, '\0');
  std::memcpy(nan_bytes.data(), &nan, 4);
  const std::vector<Case> cases = {
      {"overlapping", "{\"a\":" + tensor("2", 0, 8) + ",\"b\":" + tensor("1", 4, 8) + "}", eight, "overlap at byte 4"},
      {"a hole", "{\"a\":" + tensor("1", 4, 8) + "}", eight, "leave a hole at byte 0"},
      {"bytes after the last", "{\"a\":" + tensor("1", 0, 4) + "}", eight, "4 bytes after the last tensor"},
      {"a size that wraps", "{\"a\":" + tensor("4611686018427387936", 0, 8) + "}", eight, "do not hold its shape"},
      {"unaligned", "{\"a\":" + tensor("1", 2, 6) + "}", std::string(6, '\0'), "not aligned to its dtype"},
      {"a NaN", "{\"a\":" + tensor("1", 0, 4) + "}", nan_bytes, "tensor a holds nan at element 0"}};
  for (const Case& bad : cases) {
    INFO(bad.what);
    const std::string path = file_with_header("bad.safetensors", bad.header, bad.data);
    REQUIRE_THROWS_MATCHES(course::read_safetensors(path), course::UsageError, course_test::MessageContains(bad.says));
  }
}

TEST_CASE("import_safetensors refuses a block number past the file's tensors and an n_head that is no number",
          "[export]") {
  TempDir dir;
  train_and_export(dir);
  course::SafetensorsFile file = course::read_safetensors(dir.file("hf") + "/model.safetensors");
  std::vector<course::SafeTensor> tensors;
  for (const auto& [name, tensor] : file.tensors) {
    tensors.push_back(tensor);
    tensors.back().name = name;
  }
  const auto refused = [&](const std::vector<course::SafeTensor>& these, const std::string& n_head,
                           const std::string& says) {
    const std::string path = dir.file("bad.safetensors");
    course::write_safetensors(path, these, {{"format", "pt"}, {"n_head", n_head}});
    const ProcessResult result = course_test::run_process(
        {course_binary("import_safetensors"), "--from", path, "--out-dir", dir.file("refused")}, kTimeoutSeconds);
    INFO(result.describe() << "\n" << result.err);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.err, Catch::Contains(says));
  };
  std::vector<course::SafeTensor> far_block = tensors;
  far_block.push_back(file.tensors.at("transformer.ln_f.bias"));
  far_block.back().name = "transformer.h.99999999999.ln_1.weight";
  refused(far_block, "4", "names block '99999999999', which the file's");
  refused(tensors, "four", "n_head is 'four', not a number of attention heads");
  refused(tensors, "-4", "n_head is '-4'");
}

// A few thousand headers made by mutating a real export's (seeded: COURSE_FUZZ_SEED,
// 1 by default, picks another set): each file is refused with a UsageError naming
// it, or loads. Nothing else: no crash, no other exception, no allocation that runs away.
TEST_CASE("safetensors fuzz: 3000 mutated headers are each refused with a clear error or loaded", "[export]") {
  TempDir dir;
  train_and_export(dir);
  std::ifstream in(dir.file("hf") + "/model.safetensors", std::ios::binary);
  const std::string original((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, original.data(), sizeof(header_bytes));
  const std::string header = original.substr(8, header_bytes), data = original.substr(8 + header_bytes);
  const char* seed_text = std::getenv("COURSE_FUZZ_SEED");
  std::mt19937_64 random(seed_text != nullptr ? std::strtoull(seed_text, nullptr, 10) : 1);
  const std::string alphabet = "{}[]\",:0123456789-.eE \\abfnrtuxyzFI8_";
  int refused = 0, loaded = 0;
  for (int round = 0; round < 3000; round++) {
    std::string mutated = header;
    const int edits = 1 + static_cast<int>(random() % 4);
    for (int e = 0; e < edits && !mutated.empty(); e++) {
      const size_t at = random() % mutated.size();
      switch (random() % 5) {
        case 0: mutated[at] = alphabet[random() % alphabet.size()]; break;                 // change a byte
        case 1: mutated.insert(at, 1, alphabet[random() % alphabet.size()]); break;        // insert one
        case 2: mutated.erase(at, 1 + random() % 8); break;                                // delete a few
        case 3: mutated.insert(at, mutated.substr(at, 1 + random() % 64)); break;          // repeat a run
        default: mutated.insert(at, std::string(1 + random() % 200, "[{"[random() % 2])); // nest deep
      }
    }
    const uint64_t length = mutated.size();
    const std::string path = dir.file("fuzz.safetensors");
    {
      std::ofstream out(path, std::ios::binary);
      out.write(reinterpret_cast<const char*>(&length), sizeof(length));
      out << mutated << data;
    }
    try {
      course::read_safetensors(path);
      loaded++;
    } catch (const course::UsageError& error) {
      refused++;
      if (std::string(error.what()).find(path) == std::string::npos) FAIL("not naming the file: " << error.what());
    } catch (const std::exception& error) {
      FAIL("round " << round << ": " << typeid(error).name() << ": " << error.what() << "\nheader: " << mutated);
    }
  }
  INFO(refused << " refused, " << loaded << " loaded");
  CHECK(refused + loaded == 3000);
  CHECK(refused > 2000);  // most mutations break the header
}

TEST_CASE("import_safetensors refuses a config.json that disagrees with the tensors", "[export]") {
  TempDir dir;
  train_and_export(dir);
  std::ifstream in(dir.file("hf") + "/config.json");
  const std::string config((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::vector<std::pair<std::string, std::string>> changes = {
      {"\"n_layer\":2", "\"n_layer\":7"}, {"\"n_embd\":32", "\"n_embd\":999"},
      {"\"tie_word_embeddings\":false", "\"tie_word_embeddings\":true"}};
  for (const auto& [was, now] : changes) {
    INFO(now);
    REQUIRE(config.find(was) != std::string::npos);
    const std::string edited = dir.file("edited");
    std::filesystem::remove_all(edited);
    std::filesystem::copy(dir.file("hf"), edited);
    std::string text = config;
    text.replace(text.find(was), was.size(), now);
    std::ofstream(edited + "/config.json") << text;
    const ProcessResult result = course_test::run_process(
        {course_binary("import_safetensors"), "--from", edited, "--out-dir", dir.file("refused")}, kTimeoutSeconds);
    INFO(result.describe() << "\n" << result.err);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.err, Catch::Contains(edited + "/config.json says " + now.substr(1, now.find('"', 1) - 1)));
  }
}

// The audit's crafted files, rebuilt here from a real export, one per way a file can
// be wrong: its bytes, its JSON, its tensors against each other, its tensors against
// the course's model, and its config.json. import_safetensors refuses each with exit
// code 2 and one line that names the file, and leaves no output directory behind.
TEST_CASE("import_safetensors refuses each of 46 crafted files with exit code 2 and one line naming the file",
          "[export]") {
  TempDir dir;
  train_and_export(dir);
  const auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  const std::string original = read(dir.file("hf") + "/model.safetensors");
  const std::string config = read(dir.file("hf") + "/config.json");
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, original.data(), sizeof(header_bytes));
  const std::string header = original.substr(8, header_bytes), data = original.substr(8 + header_bytes);
  course::SafetensorsFile file = course::read_safetensors(dir.file("hf") + "/model.safetensors");
  std::vector<course::SafeTensor> tensors;
  for (const auto& [name, tensor] : file.tensors) {
    tensors.push_back(tensor);
    tensors.back().name = name;
  }
  const std::vector<std::pair<std::string, std::string>> metadata(file.metadata.begin(), file.metadata.end());

  const std::string wte = "transformer.wte.weight", wpe = "transformer.wpe.weight";
  const std::string ln_f = "transformer.ln_f.weight", qkv = "transformer.h.0.attn.c_attn.weight";
  const auto replaced = [](std::string text, const std::string& was, const std::string& now) {
    const size_t at = text.find(was);
    if (at == std::string::npos) FAIL("the export has no '" << was << "'");
    return text.replace(at, was.size(), now);
  };
  const auto with_length = [](uint64_t length, const std::string& header_text, const std::string& rest) {
    return std::string(reinterpret_cast<const char*>(&length), sizeof(length)) + header_text + rest;
  };
  const auto with_header = [&](const std::string& header_text) {
    return with_length(header_text.size(), header_text, data);
  };
  // the tensors, each changed by `change` (name, tensor) and kept when it returns true
  const auto edited = [&](const std::function<bool(course::SafeTensor&)>& change) {
    std::vector<course::SafeTensor> kept;
    for (course::SafeTensor tensor : tensors) {
      if (change(tensor)) kept.push_back(tensor);
    }
    return kept;
  };
  // the tensors and one more: a copy of ln_f under another name
  const auto with_extra = [&](const std::string& name) {
    std::vector<course::SafeTensor> more = tensors;
    more.push_back(file.tensors.at(ln_f));
    more.back().name = name;
    return more;
  };
  // the second tensor's data_offsets moved 4 bytes back, into the first one's
  const auto overlapping = [&] {
    const std::string key = "\"data_offsets\":[";
    const size_t at = header.find(key, header.find(key) + 1) + key.size();
    const size_t comma = header.find(',', at), close = header.find(']', at);
    const long begin = std::stol(header.substr(at, comma - at)), end = std::stol(header.substr(comma + 1, close - comma - 1));
    std::string text = header;
    text.replace(at, close - at, std::to_string(begin - 4) + "," + std::to_string(end - 4));
    return text;
  };
  const auto set_float = [](course::SafeTensor& tensor, size_t element, float value) {
    std::memcpy(tensor.bytes.data() + element * sizeof(float), &value, sizeof(float));
  };

  struct Crafted {
    std::string what;
    std::string model;   // the bytes of model.safetensors, when `tensors` is empty
    std::vector<course::SafeTensor> tensors;
    std::vector<std::pair<std::string, std::string>> metadata;
    std::string config;  // config.json's text; "-" for no config.json
  };
  const std::string huge = "4611686018427387936";  // 2^62 + 32 floats: their byte count wraps 64 bits
  const std::vector<Crafted> crafted = {
      // the file's bytes
      {"an empty file", "", {}, {}, config},
      {"shorter than its length field", "abc", {}, {}, config},
      {"a header longer than the file", with_length(original.size(), header, ""), {}, {}, config},
      {"a header of length 0", with_length(0, "", data), {}, {}, config},
      {"a file cut in the middle of the data", original.substr(0, original.size() / 2), {}, {}, config},
      {"bytes after the last tensor", original + std::string(16, '\0'), {}, {}, config},
      // the header's JSON
      {"a header that is not JSON", with_header(std::string(header.size(), 'x')), {}, {}, config},
      {"a header that is a JSON array", with_header("[1,2]"), {}, {}, config},
      {"a header nested 30,000 deep", with_header(std::string(30000, '[') + std::string(30000, ']')), {}, {}, config},
      {"a header cut short", with_header(header.substr(0, header.size() / 2)), {}, {}, config},
      {"text after the header's object", with_header(replaced(header, "}}", "}}x")), {}, {}, config},
      {"a key twice", with_header(replaced(header, "{\"__metadata__\"", "{\"" + ln_f + "\":{},\"__metadata__\"")),
       {}, {}, config},
      {"a control character in a key", with_header(replaced(header, "\"transformer.ln_f.bias\"", "\"ln\x01\"")),
       {}, {}, config},
      {"a string that never ends", with_header("{\"" + std::string(100, 'a')), {}, {}, config},
      // one tensor's entry
      {"data_offsets reversed", with_header(replaced(header, "\"data_offsets\":[0,", "\"data_offsets\":[9999999,")),
       {}, {}, config},
      {"data_offsets with three numbers", with_header(replaced(header, "\"data_offsets\":[0,", "\"data_offsets\":[0,0,")),
       {}, {}, config},
      {"a negative dimension", with_header(replaced(header, "\"shape\":[", "\"shape\":[-1,")), {}, {}, config},
      {"a dimension that is no whole number", with_header(replaced(header, "\"shape\":[", "\"shape\":[1.5,")), {}, {},
       config},
      {"a shape whose size wraps", with_header(replaced(header, "\"shape\":[", "\"shape\":[" + huge + ",")), {}, {},
       config},
      {"an unknown dtype", with_header(replaced(header, "\"F32\"", "\"Q7\"")), {}, {}, config},
      {"a dtype that is not a string", with_header(replaced(header, "\"F32\"", "32")), {}, {}, config},
      {"a tensor without data_offsets", with_header(replaced(header, ",\"data_offsets\":[0,", ",\"offsets\":[0,")), {},
       {}, config},
      {"__metadata__ that is not an object", with_header(replaced(header, "{\"__metadata__\":{", "{\"__metadata__\":[{")),
       {}, {}, config},
      // the tensors against each other
      {"overlapping tensors", with_header(overlapping()), {}, {}, config},
      {"a hole before the first tensor", with_header(replaced(header, "\"data_offsets\":[0,", "\"data_offsets\":[8,")),
       {}, {}, config},
      // the tensors against the course's model (written whole, so that the file itself is well formed)
      {"a NaN weight", "", edited([&](course::SafeTensor& t) { if (t.name == ln_f) set_float(t, 3, std::nanf("")); return true; }),
       metadata, config},
      {"an infinite weight", "", edited([&](course::SafeTensor& t) { if (t.name == qkv) set_float(t, 0, INFINITY); return true; }),
       metadata, config},
      {"no ln_f", "", edited([&](course::SafeTensor& t) { return t.name != ln_f; }), metadata, config},
      {"no wte", "", edited([&](course::SafeTensor& t) { return t.name != wte; }), metadata, config},
      {"no wpe", "", edited([&](course::SafeTensor& t) { return t.name != wpe; }), metadata, config},
      {"a tensor the model has not", "", with_extra("transformer.h.0.mlp.gate.weight"), metadata, config},
      {"an F16 tensor", "", edited([&](course::SafeTensor& t) {
         if (t.name == ln_f) {
           t.dtype = "F16";
           t.shape[0] *= 2;
         }
         return true;
       }), metadata, config},
      {"a matrix with the wrong shape", "", edited([&](course::SafeTensor& t) {
         if (t.name == qkv) std::swap(t.shape[0], t.shape[1]);
         return true;
       }), metadata, config},
      {"wpe with no rows", "", edited([&](course::SafeTensor& t) {
         if (t.name == wpe) {
           t.shape[0] = 0;
           t.bytes.clear();
         }
         return true;
       }), metadata, config},
      {"wpe narrower than wte", "", edited([&](course::SafeTensor& t) {
         if (t.name == wpe) {
           t.shape[1] /= 2;
           t.bytes.resize(t.bytes.size() / 2);
         }
         return true;
       }), metadata, config},
      {"block 99999999999", "", with_extra("transformer.h.99999999999.ln_1.weight"), metadata, config},
      {"block -1", "", edited([&](course::SafeTensor& t) {
         if (t.name == "transformer.h.0.ln_1.weight") t.name = "transformer.h.-1.ln_1.weight";
         return true;
       }), metadata, config},
      // n_head in the file's metadata
      {"n_head 'four'", "", tensors, {{"format", "pt"}, {"n_head", "four"}}, "-"},
      {"n_head -4", "", tensors, {{"format", "pt"}, {"n_head", "-4"}}, "-"},
      {"n_head 0", "", tensors, {{"format", "pt"}, {"n_head", "0"}}, "-"},
      {"n_head 5000", "", tensors, {{"format", "pt"}, {"n_head", "5000"}}, "-"},
      {"n_head 3, which does not divide n_embd", "", tensors, {{"format", "pt"}, {"n_head", "3"}}, "-"},
      // config.json
      {"config.json that is not JSON", "", tensors, metadata, "{\"n_layer\": "},
      {"config.json nested 30,000 deep", "", tensors, metadata, std::string(30000, '[') + std::string(30000, ']')},
      {"config.json with n_layer 7", "", tensors, metadata, replaced(config, "\"n_layer\":2", "\"n_layer\":7")},
      {"config.json with vocab_size 50257", "", tensors, metadata,
       replaced(config, "\"vocab_size\":256", "\"vocab_size\":50257")},
  };
  // what each one's line says
  const std::map<std::string, std::string> says = {
      {"an empty file", "too short for its header (0 bytes"},
      {"shorter than its length field", "too short for its header (3 bytes"},
      {"a header longer than the file", "too short for its header"},
      {"a header of length 0", "a value expected at byte 0"},
      {"a file cut in the middle of the data", "are not within the data's"},
      {"bytes after the last tensor", "16 bytes after the last tensor"},
      {"a header that is not JSON", "a value expected at byte 0"},
      {"a header that is a JSON array", "the header is not a JSON object"},
      {"a header nested 30,000 deep", "nesting deeper than 64 levels"},
      {"a header cut short", "expected at byte"},
      {"text after the header's object", "text after the JSON value"},
      {"a key twice", "the key \"transformer.ln_f.weight\" a second time"},
      {"a control character in a key", "a control character in a string"},
      {"a string that never ends", "'\"' expected at byte 102"},
      {"data_offsets reversed", "bytes [9999999, 32768) are not within"},
      {"data_offsets with three numbers", "has no dtype or data_offsets"},
      {"a negative dimension", "shape is '-1', not a count"},
      {"a dimension that is no whole number", "shape is '1.5', not a count"},
      {"a shape whose size wraps", "do not hold its shape (4611686018427387936, "},
      {"an unknown dtype", "dtype 'Q7' is none of safetensors'"},
      {"a dtype that is not a string", "dtype '32' is none of safetensors'"},
      {"a tensor without data_offsets", "has no dtype or data_offsets"},
      {"__metadata__ that is not an object", "']' expected"},
      {"overlapping tensors", "the tensors' bytes overlap at byte"},
      {"a hole before the first tensor", "do not hold its shape"},
      {"a NaN weight", "tensor transformer.ln_f.weight holds nan at element 3"},
      {"an infinite weight", "holds inf at element 0"},
      {"no ln_f", "has no tensor ln_f.weight"},
      {"no wte", "has no tensor wte.weight"},
      {"no wpe", "has no tensor wpe.weight"},
      {"a tensor the model has not", "tensor h.0.mlp.gate.weight (32) is no parameter"},
      {"an F16 tensor", "tensor ln_f.weight is F16 (64)"},
      {"a matrix with the wrong shape", "tensor h.0.attn.c_attn.weight is F32 (96, 32)"},
      {"wpe with no rows", "wpe.weight (0, 32) need rows"},
      {"wpe narrower than wte", "wpe.weight (32, 16) need rows and the same width"},
      {"block 99999999999", "names block '99999999999'"},
      {"block -1", "names block '-1'"},
      {"n_head 'four'", "n_head is 'four', not a number"},
      {"n_head -4", "n_head is '-4', not a number"},
      {"n_head 0", "n_head is '0', not a number"},
      {"n_head 5000", "n_head is '5000', not a number"},
      {"n_head 3, which does not divide n_embd", "3 heads do not divide n_embd 32"},
      {"config.json that is not JSON", "config.json: not the JSON expected"},
      {"config.json nested 30,000 deep", "config.json: not the JSON expected, nesting deeper than 64"},
      {"config.json with n_layer 7", "config.json says n_layer 7, the tensors make it 2"},
      {"config.json with vocab_size 50257", "config.json says vocab_size 50257, the tensors make it 256"}};
  REQUIRE(crafted.size() == 46);
  std::set<std::string> names;
  for (const Crafted& bad : crafted) {
    INFO(bad.what);
    CHECK(names.insert(bad.what).second);
    const std::string from = dir.file("crafted");
    std::filesystem::remove_all(from);
    std::filesystem::create_directories(from);
    if (bad.tensors.empty()) {
      std::ofstream(from + "/model.safetensors", std::ios::binary) << bad.model;
    } else {
      course::write_safetensors(from + "/model.safetensors", bad.tensors, bad.metadata);
    }
    if (bad.config != "-") std::ofstream(from + "/config.json") << bad.config;
    const std::string out_dir = dir.file("refused");
    const ProcessResult result = course_test::run_process(
        {course_binary("import_safetensors"), "--from", from, "--out-dir", out_dir}, kTimeoutSeconds);
    INFO(result.describe() << "\n" << result.err);
    CHECK(result.exit_code == 2);
    CHECK(std::count(result.err.begin(), result.err.end(), '\n') == 1);
    CHECK_THAT(result.err, Catch::Contains(from + "/"));
    CHECK_THAT(result.err, Catch::Contains(says.at(bad.what)));
    CHECK_FALSE(std::filesystem::exists(out_dir));
  }
}
