// moekit run --model DIR (--prompt TEXT | --prompt-file FILE | --prompt-ids 1,2,3) [...]: loads a checkpoint
// and generates; with the checkpoint's tokenizer.json the new text is printed as it is generated.
#include <fmt/core.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "commands.h"
#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/safetensors.h"
#include "moekit/tokenizer.h"
#include "parse.h"

namespace moekit::cli {
namespace {

struct RunOptions {
  std::string model, device = "cpu", dtype = "auto", experts, prompt_ids, dump_logits, decode_switch = "auto";
  std::string prompt, prompt_file;
  int64_t max_new_tokens = 20, min_new_tokens = 0, top_k = 50, warmup = 0;
  double temperature = 1.0, top_p = 1.0, repetition_penalty = 1.0;
  std::string seed = "0";
  bool sample = false, greedy = false, json = false, cuda_graph = false, quiet = false, check_finite = false,
       no_check_finite = false, dequantize = false;
  // Options given on the command line (the others keep generation_config.json's values).
  bool set_max_new_tokens = false, set_temperature = false, set_top_k = false, set_top_p = false,
       set_repetition_penalty = false, set_seed = false, set_prompt = false, set_prompt_file = false,
       set_prompt_ids = false;
};

std::string read_prompt_file(const std::string& path) {
  std::error_code ec;
  MOEKIT_CHECK_CODE(std::filesystem::is_regular_file(path, ec), not_found, "--prompt-file: '", printable(path),
                    "' is not a regular file");
  std::ifstream f(path, std::ios::binary);
  MOEKIT_CHECK_CODE(f.good(), not_found, "--prompt-file: cannot open '", printable(path), "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

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
  mo.dequantize = o.dequantize;
  MOEKIT_CHECK(int(o.set_prompt) + int(o.set_prompt_file) + int(o.set_prompt_ids) == 1,
               "run: give one of --prompt TEXT, --prompt-file FILE or --prompt-ids 1,2,3");
  std::optional<Tokenizer> tokenizer;
  const bool text_prompt = o.set_prompt || o.set_prompt_file;
  if (text_prompt || std::filesystem::exists(std::filesystem::path(o.model) / "tokenizer.json")) {
    if (text_prompt && !std::filesystem::exists(std::filesystem::path(o.model) / "tokenizer.json"))
      MOEKIT_FAIL(not_found, "run: '", o.model, "' has no tokenizer.json, so --prompt",
                  o.set_prompt_file ? "-file" : "", " cannot be tokenized; give --prompt-ids 1,2,3 instead");
    tokenizer = Tokenizer::from_pretrained(o.model);
  }
  const std::vector<int64_t> prompt = o.set_prompt_ids ? parse_ids(o.prompt_ids)
                                      : tokenizer->encode(o.set_prompt ? o.prompt : read_prompt_file(o.prompt_file));
  MOEKIT_CHECK(!prompt.empty(), "run: the prompt has no tokens");
  MOEKIT_CHECK(o.max_new_tokens >= 0, "--max-new-tokens must be >= 0, got ", o.max_new_tokens);
  MOEKIT_CHECK(o.min_new_tokens >= 0, "--min-new-tokens must be >= 0, got ", o.min_new_tokens);
  MOEKIT_CHECK(std::isfinite(o.temperature), "--temperature must be a finite number, got ", o.temperature);
  MOEKIT_CHECK(std::isfinite(o.top_p), "--top-p must be a finite number, got ", o.top_p);

  // generation_config.json's defaults, then what the command line says.
  GenerationConfig gc = GenerationConfig::from_pretrained(o.model);
  if (o.set_max_new_tokens) gc.max_new_tokens = o.max_new_tokens;
  gc.min_new_tokens = o.min_new_tokens;
  if (o.sample) gc.do_sample = true;
  if (o.greedy) gc.do_sample = false;
  if (o.set_temperature) gc.temperature = float(o.temperature);
  if (o.set_top_k) gc.top_k = o.top_k;
  if (o.set_top_p) gc.top_p = float(o.top_p);
  if (o.set_repetition_penalty) gc.repetition_penalty = float(o.repetition_penalty);
  gc.seed = parse_seed(o.seed);
  // Sampling flags are refused when decoding is greedy (by --greedy or the checkpoint's defaults) rather
  // than silently ignored.
  for (const auto& [given, flag] : {std::pair{o.set_temperature, "--temperature"}, {o.set_top_k, "--top-k"},
                                    {o.set_top_p, "--top-p"}, {o.set_seed, "--seed"}})
    if (given && !gc.do_sample)
      MOEKIT_FAIL(invalid_argument, flag, " only applies when sampling: add --sample (greedy decoding would ignore it)");
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

  // The new text, printed as it comes (held back while it ends in an incomplete UTF-8 sequence). Ids the
  // tokenizer lacks (a model's vocabulary is often padded beyond it) are left out of the text.
  auto text_of = [&](const std::vector<int64_t>& ids) {
    std::vector<int64_t> known;
    for (int64_t t : ids)
      if (tokenizer->contains(t)) known.push_back(t);
    return tokenizer->decode(known);
  };
  std::vector<int64_t> generated;
  std::string shown;
  const bool stream = tokenizer && !o.json;
  auto show = [&](bool final) {
    const std::string t = text_of(generated);
    const bool partial = t.size() >= 3 && t.compare(t.size() - 3, 3, "\xEF\xBF\xBD") == 0;
    if ((partial && !final) || t.size() < shown.size() || t.compare(0, shown.size(), shown) != 0) return;
    fmt::print("{}", t.substr(shown.size()));
    std::fflush(stdout);
    shown = t;
  };
  if (stream) {
    fmt::print("model          {} ({}, {}, {})\n", o.model, model.config().text.model_type, dtype_name(model.dtype()),
               model.device().to_string());
    fmt::print("prompt         {} tokens: {}\n", prompt.size(), ids_text(prompt));
    fmt::print("prompt text    {}\n", text_of(prompt));
    fmt::print("text           ");
    std::fflush(stdout);
    gc.on_token = [&](int64_t tok) {
      generated.push_back(tok);
      show(false);
    };
  }
  const GenerationResult r = model.generate(prompt, gc);
  if (stream) {
    show(true);
    fmt::print("\n");
  }

  if (!o.dump_logits.empty()) {
    save_safetensors(o.dump_logits, {{"logits", r.prompt_logits}}, {{"prompt_ids", ids_text(prompt)}, {"model", o.model}});
    if (progress)
      fmt::print(stderr, "moekit run: wrote prompt logits {} to {}\n", shape_to_string(r.prompt_logits.shape()),
                 o.dump_logits);
  }
  if (o.json) {
    nlohmann::json j;
    j["generated_ids"] = r.tokens;
    if (tokenizer) j["text"] = text_of(r.tokens);
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
  if (!stream) {
    fmt::print("model          {} ({}, {}, {})\n", o.model, model.config().text.model_type, dtype_name(model.dtype()),
               model.device().to_string());
    fmt::print("prompt         {} tokens: {}\n", prompt.size(), ids_text(prompt));
  }
  fmt::print("experts        prefill {}  decode {}\n", experts_map_to_string(r.prefill_experts),
             experts_map_to_string(r.decode_experts));
  fmt::print("generated      {} tokens{}: {}\n", r.tokens.size(), r.stopped_on_eos ? " (stopped on EOS)" : "",
             ids_text(r.tokens));
  fmt::print("timings        prefill {:.2f} ms, decode {:.2f} ms ({} steps, {:.1f} tokens/s{})\n", r.prefill_ms,
             r.decode_ms, r.decode_steps, r.tokens_per_s(),
             mo.cuda_graph ? fmt::format(", {} replayed from a CUDA graph", r.graph_replays) : std::string());
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto o = std::make_shared<RunOptions>();
  auto* cmd = app.add_subcommand("run", "load a checkpoint folder and generate from a text prompt or token ids");
  cmd->add_option("--model", o->model, "checkpoint folder (config.json + *.safetensors)")->required();
  cmd->add_option("--device", o->device, "cpu or cuda[:N]");
  cmd->add_option("--dtype", o->dtype, "f32, bf16, f16 or auto (the checkpoint's)")
      ->check(CLI::IsMember({"auto", "f32", "bf16", "f16", "float32", "bfloat16", "float16"}));
  cmd->add_option("--experts", o->experts,
                  "experts backend: NAME (model and every sub-model) or KEY=NAME,KEY=NAME (empty KEY = top level, "
                  "e.g. =grouped_mm,text_config=eager)");
  auto* prompt = cmd->add_option("--prompt", o->prompt, "prompt text (tokenized with the checkpoint's tokenizer.json)");
  auto* prompt_file = cmd->add_option("--prompt-file", o->prompt_file, "file whose contents are the prompt text");
  auto* prompt_ids = cmd->add_option("--prompt-ids", o->prompt_ids, "prompt token ids, comma-separated (e.g. 1,2,3)");
  prompt->excludes(prompt_file)->excludes(prompt_ids);
  prompt_file->excludes(prompt_ids);
  auto* max_new = cmd->add_option("--max-new-tokens", o->max_new_tokens,
                                  "tokens to generate at most (default: generation_config.json's, else 20)");
  cmd->add_option("--min-new-tokens", o->min_new_tokens, "EOS is suppressed before this many new tokens");
  auto* sample = cmd->add_flag("--sample", o->sample, "sample instead of greedy decoding");
  cmd->add_flag("--greedy", o->greedy, "greedy decoding even where generation_config.json says do_sample")
      ->excludes(sample);
  // Unset sampling options keep generation_config.json's values (transformers' defaults where it has none);
  // given while decoding is greedy, they are an error rather than ignored.
  auto* temperature = cmd->add_option("--temperature", o->temperature, "sampling temperature (default 1)");
  auto* top_k = cmd->add_option("--top-k", o->top_k, "sampling: keep the k most likely tokens (default 50, 0 = off)");
  auto* top_p = cmd->add_option("--top-p", o->top_p, "sampling: nucleus probability (default 1 = off)");
  auto* penalty = cmd->add_option("--repetition-penalty", o->repetition_penalty,
                                  "divide the logits of tokens already in the sequence by this (default 1 = off)");
  auto* seed = cmd->add_option("--seed", o->seed, "sampling seed, an integer in [0, 2^64 - 1] (default 0)");
  cmd->add_option("--decode-switch", o->decode_switch,
                  "auto: grouped_mm -> batched_mm for decode steps on GPUs; always; never")
      ->check(CLI::IsMember({"auto", "always", "never"}));
  cmd->add_option("--warmup", o->warmup, "untimed generations before the measured one (default 0)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--json", o->json,
                "print one JSON line: generated_ids, text (with a tokenizer.json), experts_implementation, phases, "
                "timings");
  cmd->add_option("--dump-logits", o->dump_logits, "write the prompt's logits [prompt_len, vocab] f32 (safetensors)");
  cmd->add_flag("--cuda-graph", o->cuda_graph,
                "record one decode step as a CUDA graph and replay it for the later tokens (CUDA devices; decode "
                "backend batched_mm or grouped_mm)");
  cmd->add_flag("--quiet", o->quiet, "no progress messages on stderr");
  auto* cf = cmd->add_flag("--check-finite", o->check_finite,
                           "refuse weights holding NaN or Inf (default: on for checkpoints up to 4 GiB)");
  cmd->add_flag("--no-check-finite", o->no_check_finite, "do not scan the weights for NaN or Inf")->excludes(cf);
  cmd->add_flag("--dequantize", o->dequantize,
                "FP8 checkpoints: dequantize the routed experts at load too (they stay FP8 otherwise)");
  cmd->callback([=] {
    o->set_prompt = prompt->count() > 0;
    o->set_prompt_file = prompt_file->count() > 0;
    o->set_prompt_ids = prompt_ids->count() > 0;
    o->set_max_new_tokens = max_new->count() > 0;
    o->set_temperature = temperature->count() > 0;
    o->set_top_k = top_k->count() > 0;
    o->set_top_p = top_p->count() > 0;
    o->set_repetition_penalty = penalty->count() > 0;
    o->set_seed = seed->count() > 0;
    run(*o);
  });
}

}  // namespace moekit::cli
