// moekit tiny --arch ARCH --out DIR [--seed N] [--dtype f32|bf16|f16] [--shards N] [--quantize fp8|fp4|mxfp4]: a small random
// checkpoint in transformers' format.

#include <fmt/core.h>

#include "commands.h"
#include "inspect.h"
#include "parse.h"
#include "tiny/tiny.h"

namespace moekit::cli {
void add_tiny_command(CLI::App& app) {
  struct Opts {
    std::string arch, out, dtype = "f32", quantize;
    std::string seed = "0";
    int shards = 1;
    bool list = false;
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("tiny", "write a small random checkpoint in transformers' format (config.json, "
                                         "generation_config.json, tokenizer.json, safetensors)");
  std::string archs;
  for (const auto& a : tiny_architectures()) archs += (archs.empty() ? "" : ", ") + a;
  cmd->add_option("--arch", o->arch, "model_type: " + archs);
  cmd->add_option("--out", o->out, "output folder (created when needed)");
  cmd->add_option("--seed", o->seed, "random seed in [0, 2^64 - 1] (the same seed writes the same bytes)");
  cmd->add_option("--dtype", o->dtype, "weight dtype")->check(CLI::IsMember({"f32", "bf16", "f16"}));
  cmd->add_option("--shards", o->shards, "number of safetensors shards (> 1 writes model.safetensors.index.json)")
      ->check(CLI::Range(1, 99));
  cmd->add_option("--quantize", o->quantize,
                  "write a quantized checkpoint in the published layout: fp8 (block-scaled), fp4 (FP4 experts with "
                  "UE8M0 scales), mxfp4 (gpt-oss)")
      ->check(CLI::IsMember({"fp8", "fp4", "mxfp4"}));
  cmd->add_flag("--list", o->list, "list the architectures and exit");
  cmd->callback([o] {
    if (o->list) {
      for (const auto& a : tiny_architectures()) fmt::print("{}\n", a);
      return;
    }
    if (o->arch.empty() || o->out.empty()) throw CLI::RequiredError("--arch and --out");
    write_tiny_checkpoint(
        o->arch, o->out, TinyOptions{.seed = parse_seed(o->seed), .dtype = parse_dtype(o->dtype), .shards = o->shards, .quantize = o->quantize});
    const tools::CheckpointTotals t = tools::checkpoint_totals(o->out);
    fmt::print("wrote {}: {} ({}{}), {} tensors, {} bytes in {} file{}, seed {}\n", o->out, o->arch, o->dtype,
               o->quantize.empty() ? "" : ", " + o->quantize, t.tensors, t.bytes, t.files, t.files == 1 ? "" : "s", o->seed);
  });
}
}  // namespace moekit::cli
