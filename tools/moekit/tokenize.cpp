// moekit tokenize --tokenizer FILE|--model DIR (--text TEXT | --ids 1,2,3) [--json]: text -> ids or ids -> text.
#include <fmt/core.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"
#include "moekit/error.h"
#include "moekit/tokenizer.h"

namespace moekit::cli {
namespace {

struct TokenizeOptions {
  std::string tokenizer, model, text, ids;
  bool json = false, no_special = false, skip_special = false, encoding = true;
};

std::vector<int64_t> parse_id_list(const std::string& text, const char* flag) {
  std::vector<int64_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) { used = 0; }
    MOEKIT_CHECK(used > 0 && used == item.size(), flag, ": '", item,
                 "' is not an integer (expected a comma-separated list such as 1,2,3)");
    ids.push_back(v);
  }
  return ids;
}

void run(const TokenizeOptions& o) {
  const Tokenizer tok = o.tokenizer.empty() ? Tokenizer::from_pretrained(o.model) : Tokenizer::from_file(o.tokenizer);
  std::vector<int64_t> ids;
  std::string text;
  const bool encoding = o.encoding;
  if (encoding) {
    text = o.text;
    ids = tok.encode(text, !o.no_special);
  } else {
    ids = parse_id_list(o.ids, "--ids");
    text = tok.decode(ids, o.skip_special);
  }
  if (o.json) {
    nlohmann::json j;
    j["ids"] = ids;
    j["text"] = text;
    fmt::print("{}\n", j.dump());
    return;
  }
  if (encoding) {
    std::string s;
    for (int64_t t : ids) s += (s.empty() ? "" : ",") + std::to_string(t);
    fmt::print("{}\n", s);
  } else {
    fmt::print("{}\n", text);
  }
}

}  // namespace

void add_tokenize_command(CLI::App& app) {
  auto o = std::make_shared<TokenizeOptions>();
  auto* cmd = app.add_subcommand("tokenize", "encode text to token ids, or decode ids to text, with a tokenizer.json");
  auto* file = cmd->add_option("--tokenizer", o->tokenizer, "a tokenizer.json file");
  auto* model = cmd->add_option("--model", o->model, "a checkpoint folder with a tokenizer.json");
  file->excludes(model);
  auto* text = cmd->add_option("--text", o->text, "text to encode (prints the ids, comma-separated)");
  auto* ids = cmd->add_option("--ids", o->ids, "token ids to decode, comma-separated (prints the text)");
  text->excludes(ids);
  cmd->add_flag("--json", o->json, "print one JSON object {\"ids\": [...], \"text\": \"...\"}");
  cmd->add_flag("--no-special", o->no_special, "encode without the template's special tokens (e.g. a BOS)");
  cmd->add_flag("--skip-special", o->skip_special, "decode without the special tokens");
  cmd->callback([o, file, model, text, ids] {
    MOEKIT_CHECK(file->count() + model->count() == 1, "tokenize: give --tokenizer FILE or --model DIR");
    MOEKIT_CHECK(text->count() + ids->count() == 1, "tokenize: give --text TEXT or --ids 1,2,3");
    o->encoding = text->count() > 0;
    run(*o);
  });
}

}  // namespace moekit::cli
