// moekit run --model DIR --prompt-ids 1,2,3 [...]: loads a checkpoint and generates.
#include <fmt/core.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"
#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/safetensors.h"
#include "parse.h"

namespace moekit::cli {
namespace {

struct RunOptions {
  std::string model, device = "cpu", dtype = "auto", experts, prompt_ids, dump_logits, decode_switch = "auto";
  int64_t max_new_tokens = 20, min_new_tokens = 0, top_k = 50, warmup = 0;
  double temperature = 1.0, top_p = 1.0;
  std::string seed = "0";
  bool sample = false, json = false, cuda_graph = false, quiet = false, check_finite = false, no_check_finite = false;
  std::vector<std::string> sampling_flags_given;  // --temperature, --top-k, --top-p, --seed
};

nlohmann::json map_json(const ExpertsMap& m) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : m) j[k] = v;
  return j;
}

std::string ids_text(const std::vector<int64_t>& ids) {
  std::string s;
  for (int64_t t : ids) s += (s.empty() ? "" : " ") + std::to_string(t);
  return s;
}

void run(const RunOptions& o) {
  ModelOptions mo;
  mo.device = Device::parse(o.device);
  if (o.dtype != "auto") mo.dtype = parse_dtype(o.dtype);
  if (!o.experts.empty()) mo.experts_implementation = ExpertsImplementation::parse(o.experts);
  mo.cuda_graph = o.cuda_graph;
  if (o.check_finite) mo.check_finite = true;
  if (o.no_check_finite) mo.check_finite = false;
  if (!o.sample && !o.sampling_flags_given.empty())
    MOEKIT_FAIL(invalid_argument, o.sampling_flags_given.front(),
                " only applies when sampling: add --sample (greedy decoding would ignore it)");
  const std::vector<int64_t> prompt = parse_ids(o.prompt_ids);
  MOEKIT_CHECK(o.max_new_tokens >= 0, "--max-new-tokens must be >= 0, got ", o.max_new_tokens);
  MOEKIT_CHECK(o.min_new_tokens >= 0, "--min-new-tokens must be >= 0, got ", o.min_new_tokens);
  MOEKIT_CHECK(std::isfinite(o.temperature), "--temperature must be a finite number, got ", o.temperature);
  MOEKIT_CHECK(std::isfinite(o.top_p), "--top-p must be a finite number, got ", o.top_p);

  GenerationConfig gc;
  gc.max_new_tokens = o.max_new_tokens;
  gc.min_new_tokens = o.min_new_tokens;
  gc.do_sample = o.sample;
  gc.temperature = float(o.temperature);
  gc.top_k = o.top_k;
  gc.top_p = float(o.top_p);
  gc.seed = parse_seed(o.seed);
  gc.keep_prompt_logits = !o.dump_logits.empty();
  gc.decode_switch = o.decode_switch == "always"  ? DecodeSwitch::always
                     : o.decode_switch == "never" ? DecodeSwitch::never
                                                  : DecodeSwitch::automatic;
  gc.validate();

  const bool progress = !o.quiet;
  if (progress) fmt::print(stderr, "moekit run: loading {} ...\n", o.model);
  const auto t0 = std::chrono::steady_clock::now();
  Model model = Model::from_pretrained(o.model, mo);
  const double load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (progress)
    fmt::print(stderr, "moekit run: loaded {} ({}, {}, {}) in {:.0f} ms; generating up to {} tokens ...\n", o.model,
               model.config().text.model_type, dtype_name(model.dtype()), model.device().to_string(), load_ms,
               gc.max_new_tokens);
  GenerationConfig warm = gc;
  warm.keep_prompt_logits = false;
  for (int64_t i = 0; i < o.warmup; ++i) model.generate(prompt, warm);
  const GenerationResult r = model.generate(prompt, gc);

  if (!o.dump_logits.empty()) {
    save_safetensors(o.dump_logits, {{"logits", r.prompt_logits}}, {{"prompt_ids", o.prompt_ids}, {"model", o.model}});
    if (progress)
      fmt::print(stderr, "moekit run: wrote prompt logits {} to {}\n", shape_to_string(r.prompt_logits.shape()),
                 o.dump_logits);
  }
  if (o.json) {
    nlohmann::json j;
    j["generated_ids"] = r.tokens;
    j["experts_implementation"] = map_json(model.get_experts_implementation());
    j["phases"] = {{"prefill", map_json(r.prefill_experts)}, {"decode", map_json(r.decode_experts)}};
    j["timings"] = {{"load_ms", load_ms},
                    {"prefill_ms", r.prefill_ms},
                    {"decode_ms", r.decode_ms},
                    {"tokens_per_s", r.tokens_per_s()}};
    j["stopped_on_eos"] = r.stopped_on_eos;
    j["cuda_graph"] = {{"enabled", mo.cuda_graph}, {"replays", r.graph_replays}};
    j["model_type"] = model.config().text.model_type;
    j["device"] = model.device().to_string();
    j["dtype"] = dtype_name(model.dtype());
    fmt::print("{}\n", j.dump());
    return;
  }
  fmt::print("model          {} ({}, {}, {})\n", o.model, model.config().text.model_type, dtype_name(model.dtype()),
             model.device().to_string());
  fmt::print("experts        prefill {}  decode {}\n", experts_map_to_string(r.prefill_experts),
             experts_map_to_string(r.decode_experts));
  fmt::print("prompt         {} tokens: {}\n", prompt.size(), ids_text(prompt));
  fmt::print("generated      {} tokens{}: {}\n", r.tokens.size(), r.stopped_on_eos ? " (stopped on EOS)" : "",
             ids_text(r.tokens));
  fmt::print("timings        prefill {:.2f} ms, decode {:.2f} ms ({} steps, {:.1f} tokens/s{})\n", r.prefill_ms,
             r.decode_ms, r.decode_steps, r.tokens_per_s(),
             mo.cuda_graph ? fmt::format(", {} replayed from a CUDA graph", r.graph_replays) : std::string());
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto o = std::make_shared<RunOptions>();
  auto* cmd = app.add_subcommand("run", "load a checkpoint folder and generate from token ids");
  cmd->add_option("--model", o->model, "checkpoint folder (config.json + *.safetensors)")->required();
  cmd->add_option("--device", o->device, "cpu or cuda[:N]");
  cmd->add_option("--dtype", o->dtype, "f32, bf16, f16 or auto (the checkpoint's)")
      ->check(CLI::IsMember({"auto", "f32", "bf16", "f16", "float32", "bfloat16", "float16"}));
  cmd->add_option("--experts", o->experts,
                  "experts backend: NAME (model and every sub-model) or KEY=NAME,KEY=NAME (empty KEY = top level, "
                  "e.g. =grouped_mm,text_config=eager)");
  cmd->add_option("--prompt-ids", o->prompt_ids, "prompt token ids, comma-separated (e.g. 1,2,3)")->required();
  cmd->add_option("--max-new-tokens", o->max_new_tokens, "tokens to generate at most (default 20)");
  cmd->add_option("--min-new-tokens", o->min_new_tokens, "EOS is suppressed before this many new tokens");
  cmd->add_flag("--sample", o->sample, "sample instead of greedy decoding");
  // Sampling flags are refused without --sample rather than silently ignored.
  auto sampling = [o](const char* flag) {
    return [o, flag](const std::string&) {
      o->sampling_flags_given.emplace_back(flag);
      return std::string();
    };
  };
  cmd->add_option("--temperature", o->temperature, "sampling temperature (default 1; needs --sample)")
      ->check(CLI::Validator(sampling("--temperature"), "", ""));
  cmd->add_option("--top-k", o->top_k, "sampling: keep the k most likely tokens (default 50, 0 = off; needs --sample)")
      ->check(CLI::Validator(sampling("--top-k"), "", ""));
  cmd->add_option("--top-p", o->top_p, "sampling: nucleus probability (default 1 = off; needs --sample)")
      ->check(CLI::Validator(sampling("--top-p"), "", ""));
  cmd->add_option("--seed", o->seed, "sampling seed, an integer in [0, 2^64 - 1] (default 0; needs --sample)")
      ->check(CLI::Validator(sampling("--seed"), "", ""));
  cmd->add_option("--decode-switch", o->decode_switch,
                  "auto: grouped_mm -> batched_mm for decode steps on GPUs; always; never")
      ->check(CLI::IsMember({"auto", "always", "never"}));
  cmd->add_option("--warmup", o->warmup, "untimed generations before the measured one (default 0)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--json", o->json, "print one JSON line: generated_ids, experts_implementation, phases, timings");
  cmd->add_option("--dump-logits", o->dump_logits, "write the prompt's logits [prompt_len, vocab] f32 (safetensors)");
  cmd->add_flag("--cuda-graph", o->cuda_graph,
                "record one decode step as a CUDA graph and replay it for the later tokens (CUDA devices; decode "
                "backend batched_mm or grouped_mm)");
  cmd->add_flag("--quiet", o->quiet, "no progress messages on stderr");
  auto* cf = cmd->add_flag("--check-finite", o->check_finite,
                           "refuse weights holding NaN or Inf (default: on for checkpoints up to 4 GiB)");
  cmd->add_flag("--no-check-finite", o->no_check_finite, "do not scan the weights for NaN or Inf")->excludes(cf);
  cmd->callback([o] { run(*o); });
}

}  // namespace moekit::cli
