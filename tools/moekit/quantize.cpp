// moekit quantize --in DIR --out DIR --format fp8|fp4|mxfp4: a float checkpoint written as a quantized one, in the
// published layout of that format (tiny/tiny.h quantize_tensors).

#include <fmt/core.h>

#include "commands.h"
#include "tiny/tiny.h"

namespace moekit::cli {
void add_quantize_command(CLI::App& app) {
  struct Opts {
    std::string in, out, format;
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("quantize", "write a float checkpoint quantized, in the published layout of a format");
  cmd->add_option("--in", o->in, "the float checkpoint folder (config.json + *.safetensors)")->required();
  cmd->add_option("--out", o->out, "the folder to write (created when needed)")->required();
  cmd->add_option("--format", o->format,
                  "fp8: every linear layer but lm_head and the routers in F8_E4M3 with 128 x 128 F32 block scales; "
                  "fp4: the same with UE8M0 scales and the routed experts in FP4 (I8, UE8M0 per row and 32 inputs); "
                  "mxfp4: gpt-oss's fused experts as _blocks / _scales")
      ->required()
      ->check(CLI::IsMember({"fp8", "fp4", "mxfp4"}));
  cmd->callback([o] {
    const int64_t n = quantize_checkpoint(o->in, o->out, o->format);
    fmt::print("wrote {}: {} tensors ({}) from {}\n", o->out, n, o->format, o->in);
  });
}
}  // namespace moekit::cli
