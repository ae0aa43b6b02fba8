// moekit run --model DIR (--prompt TEXT | --prompt-file FILE | --prompt-ids 1,2,3) [...]: loads a checkpoint
// and generates; with the checkpoint's tokenizer.json the new text is printed as it is generated.
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "commands.h"
#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/parallel.h"
#include "moekit/safetensors.h"
#include "moekit/tokenizer.h"
#include "parse.h"

namespace moekit::cli {
namespace {

struct RunOptions {
  std::string model, device = "cpu", dtype = "auto", experts, prompt_ids, dump_logits, decode_switch = "auto";
  std::string prompt, prompt_file, prompts_file;
  int64_t max_new_tokens = 20, min_new_tokens = 0, top_k = 50, warmup = 0, batch = 8, ep = 1;
  std::string ep_mode = "all_reduce";
  double temperature = 1.0, top_p = 1.0, repetition_penalty = 1.0;
  std::string seed = "0";
  bool sample = false, greedy = false, json = false, cuda_graph = false, quiet = false, check_finite = false,
       no_check_finite = false, progress = false, dequantize = false;
  // Options given on the command line (the others keep generation_config.json's values).
  bool set_max_new_tokens = false, set_temperature = false, set_top_k = false, set_top_p = false,
       set_repetition_penalty = false, set_seed = false, set_prompt = false, set_prompt_file = false,
       set_prompt_ids = false, set_prompts_file = false;
};

// One prompt of a --prompts-file: its text (empty for ids) and ids (empty until tokenized).
struct FilePrompt {
  std::string text;
  std::vector<int64_t> ids;
  bool is_text = false;
};

// --prompts-file: one prompt per non-blank line, either plain text or a JSON object with "text" (a string)
// or "ids" (an array of integers). Errors name the line.
std::vector<FilePrompt> read_prompts_file(const std::string& path) {
  std::error_code ec;
  MOEKIT_CHECK_CODE(std::filesystem::is_regular_file(path, ec), not_found, "--prompts-file: '", printable(path),
                    "' is not a regular file");
  std::ifstream f(path, std::ios::binary);
  MOEKIT_CHECK_CODE(f.good(), not_found, "--prompts-file: cannot open '", printable(path), "'");
  std::vector<FilePrompt> out;
  std::string line;
  for (int64_t no = 1; std::getline(f, line); ++no) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = fmt::format("--prompts-file {} line {}", printable(path), no);
    if (line[line.find_first_not_of(" \t")] != '{') {
      out.push_back({line, {}, true});
      continue;
    }
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      MOEKIT_FAIL(invalid_argument, where, ": not a JSON object (", e.what(), ")");
    }
    MOEKIT_CHECK(j.is_object() && (j.contains("text") != j.contains("ids")), where,
                 ": a JSON line needs one of \"text\" or \"ids\"");
    if (j.contains("text")) {
      MOEKIT_CHECK(j["text"].is_string(), where, ": \"text\" must be a string");
      out.push_back({j["text"].get<std::string>(), {}, true});
      continue;
    }
    MOEKIT_CHECK(j["ids"].is_array() && !j["ids"].empty(), where, ": \"ids\" must be a non-empty array of integers");
    FilePrompt p;
    for (size_t i = 0; i < j["ids"].size(); ++i) {
      const auto& v = j["ids"][i];
      MOEKIT_CHECK(v.is_number_integer(), where, ": \"ids\"[", i, "] is not an integer");
      p.ids.push_back(v.get<int64_t>());
    }
    out.push_back(std::move(p));
  }
  MOEKIT_CHECK(!out.empty(), "--prompts-file ", printable(path), ": no prompts (every line is blank)");
  return out;
}

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

// The text of ids, leaving out those the tokenizer lacks (a model's vocabulary is often padded beyond it).
std::string known_text(const Tokenizer& tok, const std::vector<int64_t>& ids) {
  std::vector<int64_t> known;
  for (int64_t t : ids)
    if (tok.contains(t)) known.push_back(t);
  return tok.decode(known);
}

// --prompts-file: the prompts in batches of --batch, one generate_batch each; per sequence one JSON line
// (--json) or its text / ids, in the file's order.
void run_batches(const RunOptions& o, Model& model, const GenerationConfig& gc, const std::vector<FilePrompt>& prompts,
                 const std::optional<Tokenizer>& tokenizer, double load_ms, bool silent) {
  const size_t B = size_t(o.batch);
  for (int64_t i = 0; i < o.warmup; ++i) {
    std::vector<std::vector<int64_t>> ids;
    for (size_t k = 0; k < std::min(B, prompts.size()); ++k) ids.push_back(prompts[k].ids);
    model.generate_batch(ids, gc);
  }
  for (size_t first = 0; first < prompts.size(); first += B) {
    std::vector<std::vector<int64_t>> ids;
    for (size_t k = first; k < std::min(first + B, prompts.size()); ++k) ids.push_back(prompts[k].ids);
    if (!o.quiet && !silent)
      fmt::print(stderr, "moekit run: sequences {}..{} of {} ...\n", first, first + ids.size() - 1, prompts.size());
    const std::vector<GenerationResult> rs = model.generate_batch(ids, gc);
    if (silent) continue;  // another rank of an expert-parallel run: rank 0 prints
    for (size_t k = 0; k < rs.size(); ++k) {
      const GenerationResult& r = rs[k];
      const FilePrompt& p = prompts[first + k];
      if (o.json) {
        nlohmann::json j;
        j["index"] = first + k;
        if (p.is_text) j["prompt"] = p.text;
        j["prompt_ids"] = p.ids;
        j["generated_ids"] = r.tokens;
        if (tokenizer) j["text"] = known_text(*tokenizer, r.tokens);
        j["stopped_on_eos"] = r.stopped_on_eos;
        j["batch_size"] = r.batch_size;
        j["phases"] = {{"prefill", map_json(r.prefill_experts)}, {"decode", map_json(r.decode_experts)}};
        j["timings"] = {{"load_ms", load_ms},
                        {"prefill_ms", r.prefill_ms},
                        {"decode_ms", r.decode_ms},
                        {"tokens_per_s", r.tokens_per_s()}};
        j["cuda_graph"] = {{"enabled", model.options().cuda_graph}, {"replays", r.graph_replays}};
        fmt::print("{}\n", j.dump());
      } else {
        fmt::print("[{}] {}{}\n", first + k,
                   tokenizer ? printable(known_text(*tokenizer, r.tokens), 1 << 20) : ids_text(r.tokens),
                   r.stopped_on_eos ? "  (stopped on EOS)" : "");
      }
    }
    if (!o.json && !rs.empty() && !o.quiet)
      fmt::print(stderr, "moekit run: batch of {}: prefill {:.2f} ms, decode {:.2f} ms ({} steps){}\n", rs.size(),
                 rs[0].prefill_ms, rs[0].decode_ms,
                 std::max_element(rs.begin(), rs.end(),
                                  [](const auto& a, const auto& b) { return a.decode_steps < b.decode_steps; })
                     ->decode_steps,
                 model.options().cuda_graph ? fmt::format(", {} replayed from a CUDA graph", rs[0].graph_replays)
                                            : std::string());
    std::fflush(stdout);
  }
}

// Loading progress on stderr: rewritten in place on a terminal, else (--progress) a line per tenth.
std::function<void(const LoadProgress&)> load_progress_printer(bool terminal) {
  auto last = std::make_shared<std::chrono::steady_clock::time_point>();
  auto tenth = std::make_shared<int64_t>(-1);
  auto finished = std::make_shared<bool>(false);
  return [=](const LoadProgress& p) {
    const bool done = p.tensors == p.total_tensors;
    if (*finished) return;
    *finished = done;
    const bool gb = p.total_bytes >= 1000000000;
    const std::string text =
        fmt::format("moekit run: loading {:.2f} / {:.2f} {}, {} / {} tensors", double(p.bytes) / (gb ? 1e9 : 1e6),
                    double(p.total_bytes) / (gb ? 1e9 : 1e6), gb ? "GB" : "MB", p.tensors, p.total_tensors);
    if (terminal) {
      const auto now = std::chrono::steady_clock::now();
      if (!done && now - *last < std::chrono::milliseconds(100)) return;
      *last = now;
      fmt::print(stderr, "\r{}{}", text, done ? "\n" : "");
    } else {
      const int64_t t = p.total_bytes ? int64_t(10 * p.bytes / p.total_bytes) : 10;
      if (t == *tenth) return;
      *tenth = t;
      fmt::print(stderr, "{}\n", text);
    }
    std::fflush(stderr);
  };
}

// One rank's run. With expert parallelism every rank runs the same loads and generations; only rank 0
// (`silent` false) prints.
void run(const RunOptions& o, const ExpertGroupPtr& group = nullptr, std::optional<Device> device = std::nullopt,
         bool silent = false) {
  ModelOptions mo;
  mo.device = device.value_or(Device::parse(o.device));
  mo.expert_group = group;
  mo.ep_mode = parse_ep_mode(o.ep_mode);
  if (o.dtype != "auto") mo.dtype = parse_dtype(o.dtype);
  if (!o.experts.empty()) mo.experts_implementation = ExpertsImplementation::parse(o.experts);
  mo.cuda_graph = o.cuda_graph;
  if (o.check_finite) mo.check_finite = true;
  if (o.no_check_finite) mo.check_finite = false;
  mo.dequantize = o.dequantize;
  const bool terminal = ::isatty(STDERR_FILENO) == 1;
  if (!silent && (o.progress || (terminal && !o.quiet))) mo.on_load_progress = load_progress_printer(terminal);
  MOEKIT_CHECK(int(o.set_prompt) + int(o.set_prompt_file) + int(o.set_prompt_ids) + int(o.set_prompts_file) == 1,
               "run: give one of --prompt TEXT, --prompt-file FILE, --prompt-ids 1,2,3 or --prompts-file FILE");
  MOEKIT_CHECK(o.batch >= 1, "--batch must be >= 1, got ", o.batch);
  std::vector<FilePrompt> file_prompts;
  if (o.set_prompts_file) {
    MOEKIT_CHECK(o.dump_logits.empty(), "--dump-logits applies to one prompt, not --prompts-file");
    file_prompts = read_prompts_file(o.prompts_file);
  }
  std::optional<Tokenizer> tokenizer;
  const bool text_prompt = o.set_prompt || o.set_prompt_file ||
                           std::any_of(file_prompts.begin(), file_prompts.end(), [](const auto& p) { return p.is_text; });
  if (text_prompt || std::filesystem::exists(std::filesystem::path(o.model) / "tokenizer.json")) {
    if (text_prompt && !std::filesystem::exists(std::filesystem::path(o.model) / "tokenizer.json"))
      MOEKIT_FAIL(not_found, "run: '", o.model, "' has no tokenizer.json, so ",
                  o.set_prompts_file ? "the text lines of --prompts-file" : o.set_prompt_file ? "--prompt-file" : "--prompt",
                  " cannot be tokenized; give token ids instead (--prompt-ids 1,2,3, or {\"ids\": [1, 2, 3]} lines)");
    tokenizer = Tokenizer::from_pretrained(o.model);
  }
  for (size_t i = 0; i < file_prompts.size(); ++i) {
    if (file_prompts[i].is_text) file_prompts[i].ids = tokenizer->encode(file_prompts[i].text);
    MOEKIT_CHECK(!file_prompts[i].ids.empty(), "--prompts-file: prompt ", i, " has no tokens");
  }
  const std::vector<int64_t> prompt = o.set_prompts_file ? file_prompts[0].ids
                                      : o.set_prompt_ids ? parse_ids(o.prompt_ids)
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

  const bool progress = !o.quiet && !silent;
  if (progress) fmt::print(stderr, "moekit run: loading {} ...\n", o.model);
  const auto t0 = std::chrono::steady_clock::now();
  Model model = Model::from_pretrained(o.model, mo);
  const double load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (progress)
    fmt::print(stderr, "moekit run: loaded {} ({}, {}, {}) in {:.0f} ms; generating up to {} tokens ...\n", o.model,
               model.config().text.model_type, dtype_name(model.dtype()), model.device().to_string(), load_ms,
               gc.max_new_tokens);
  if (o.set_prompts_file) return run_batches(o, model, gc, file_prompts, tokenizer, load_ms, silent);
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
  const bool stream = tokenizer && !o.json && !silent;
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
  if (silent) return;
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
    if (group) j["expert_parallel"] = {{"ep_size", group->size()}, {"engine", group->engine()}, {"mode", o.ep_mode}};
    fmt::print("{}\n", j.dump());
    return;
  }
  if (!stream) {
    fmt::print("model          {} ({}, {}, {})\n", o.model, model.config().text.model_type, dtype_name(model.dtype()),
               model.device().to_string());
    fmt::print("prompt         {} tokens: {}\n", prompt.size(), ids_text(prompt));
  }
  if (group)
    fmt::print("expert parallel {} ranks over {} ({}), {} of {} experts on rank 0\n", group->size(), group->engine(),
               o.ep_mode, model.experts_modules().empty() ? 0 : model.experts_modules()[0]->spec().num_experts,
               model.config().text.num_experts);
  fmt::print("experts        prefill {}  decode {}\n", experts_map_to_string(r.prefill_experts),
             experts_map_to_string(r.decode_experts));
  fmt::print("generated      {} tokens{}: {}\n", r.tokens.size(), r.stopped_on_eos ? " (stopped on EOS)" : "",
             ids_text(r.tokens));
  fmt::print("timings        prefill {:.2f} ms, decode {:.2f} ms ({} steps, {:.1f} tokens/s{})\n", r.prefill_ms,
             r.decode_ms, r.decode_steps, r.tokens_per_s(),
             mo.cuda_graph ? fmt::format(", {} replayed from a CUDA graph", r.graph_replays) : std::string());
}

// --ep N: on the CPU, this process is one rank of an `mpirun -np N` job; on CUDA, this process drives N GPUs
// (from --device's index on) over NCCL, one thread per GPU.
void run_expert_parallel(const RunOptions& o) {
  const Device d = Device::parse(o.device);
  parse_ep_mode(o.ep_mode);
  if (d.is_cpu()) {
    const ExpertGroupPtr g = mpi_world_group();
    MOEKIT_CHECK(g->size() == o.ep, "--ep ", o.ep, ": this MPI job has ", g->size(),
                 " process(es); start it with mpirun -np ", o.ep, " (one rank per process)");
    run(o, g, d, g->rank() != 0);
    return;
  }
  std::vector<int> devices;
  for (int64_t i = 0; i < o.ep; ++i) devices.push_back(d.index + int(i));
  const auto groups = nccl_local_groups(devices);
  // A rank that fails leaves the others waiting in a collective: the process ends with the error.
  auto fail = [](size_t rank, const char* what) {
    fmt::print(stderr, "moekit: error: rank {}: {}\n", rank, what);
    std::fflush(stderr);
    std::_Exit(2);
  };
  std::vector<std::thread> workers;
  for (size_t r = 1; r < groups.size(); ++r)
    workers.emplace_back([&, r] {
      try {
        use_device(Device::cuda(devices[r]));
        run(o, groups[r], Device::cuda(devices[r]), true);
      } catch (const std::exception& e) {
        fail(r, e.what());
      }
    });
  try {
    use_device(Device::cuda(devices[0]));
    run(o, groups[0], Device::cuda(devices[0]), false);
  } catch (const std::exception& e) {
    fail(0, e.what());
  }
  for (auto& t : workers) t.join();
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
  auto* prompts_file = cmd->add_option("--prompts-file", o->prompts_file,
                                       "many prompts: one per line, text or JSON {\"text\": ...} / {\"ids\": [...]}");
  cmd->add_option("--batch", o->batch, "--prompts-file: sequences generated together (default 8)")
      ->needs(prompts_file);
  prompt->excludes(prompt_file)->excludes(prompt_ids)->excludes(prompts_file);
  prompt_file->excludes(prompt_ids)->excludes(prompts_file);
  prompt_ids->excludes(prompts_file);
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
                "timings (--prompts-file: one line per sequence, JSONL)");
  cmd->add_option("--dump-logits", o->dump_logits, "write the prompt's logits [prompt_len, vocab] f32 (safetensors)");
  cmd->add_flag("--cuda-graph", o->cuda_graph,
                "record one decode step as a CUDA graph and replay it for the later tokens (CUDA devices; decode "
                "backend batched_mm or grouped_mm)");
  cmd->add_flag("--quiet", o->quiet, "no progress messages on stderr");
  cmd->add_flag("--progress", o->progress,
                "loading progress (bytes and tensors) on stderr also when it is not a terminal (on a terminal: "
                "unless --quiet)");
  cmd->add_option("--ep", o->ep,
                  "expert parallelism over N ranks: each holds 1/N of the experts (CPU: under mpirun -np N; CUDA: N "
                  "GPUs of this process over NCCL)")
      ->check(CLI::PositiveNumber);
  auto* ep_mode = cmd->add_option("--ep-mode", o->ep_mode,
                  "all_reduce (tokens replicated, partial outputs summed, as transformers) or all_to_all (dispatch "
                  "and combine)")
      ->check(CLI::IsMember({"all_reduce", "all_to_all"}));
  auto* cf = cmd->add_flag("--check-finite", o->check_finite,
                           "refuse weights holding NaN or Inf (default: on for checkpoints up to 4 GiB)");
  cmd->add_flag("--no-check-finite", o->no_check_finite, "do not scan the weights for NaN or Inf")->excludes(cf);
  cmd->add_flag("--dequantize", o->dequantize,
                "FP8 checkpoints: dequantize the routed experts at load too (they stay FP8 otherwise)");
  cmd->callback([=] {
    o->set_prompt = prompt->count() > 0;
    o->set_prompt_file = prompt_file->count() > 0;
    o->set_prompt_ids = prompt_ids->count() > 0;
    o->set_prompts_file = prompts_file->count() > 0;
    o->set_max_new_tokens = max_new->count() > 0;
    o->set_temperature = temperature->count() > 0;
    o->set_top_k = top_k->count() > 0;
    o->set_top_p = top_p->count() > 0;
    o->set_repetition_penalty = penalty->count() > 0;
    o->set_seed = seed->count() > 0;
    MOEKIT_CHECK(ep_mode->count() == 0 || o->ep > 1, "--ep-mode only applies with --ep N, N > 1 (expert parallelism)");
    if (o->ep > 1)
      run_expert_parallel(*o);
    else
      run(*o);
  });
}

}  // namespace moekit::cli
