// Model: loading, the experts_implementation map (SPEC section 3), forward entry points.
#include <algorithm>
#include <sstream>

#include "model/model_impl.h"
#include "moekit/error.h"
#include "moekit/interface.h"

namespace moekit {

// ---- ExpertsImplementation ----

ExpertsImplementation::ExpertsImplementation(std::string name) : all_(std::move(name)) {}
ExpertsImplementation::ExpertsImplementation(const char* name) : all_(std::string(name)) {}
ExpertsImplementation::ExpertsImplementation(ExpertsMap per_config) : per_config_(std::move(per_config)) {}

ExpertsImplementation ExpertsImplementation::parse(std::string_view text) {
  MOEKIT_CHECK(!text.empty(), "experts implementation: empty text; expected NAME or KEY=NAME,KEY=NAME");
  if (text.find('=') == std::string_view::npos) {
    MOEKIT_CHECK(text.find(',') == std::string_view::npos, "experts implementation '", text,
                 "': a list needs KEY=NAME entries (an empty KEY is the top-level model, e.g. =grouped_mm)");
    return ExpertsImplementation(std::string(text));
  }
  ExpertsMap m;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find(',', start), text.size());
    const std::string_view item = text.substr(start, end - start);
    const size_t eq = item.find('=');
    MOEKIT_CHECK(eq != std::string_view::npos, "experts implementation entry '", item,
                 "' must be KEY=NAME (an empty KEY is the top-level model)");
    const std::string key(item.substr(0, eq)), name(item.substr(eq + 1));
    MOEKIT_CHECK(!name.empty(), "experts implementation entry '", item, "' has no backend name");
    MOEKIT_CHECK(m.emplace(key, name).second, "experts implementation: key '", key, "' given twice");
    start = end + 1;
  }
  return ExpertsImplementation(std::move(m));
}

std::string experts_map_to_string(const ExpertsMap& m) {
  std::ostringstream os;
  os << "{";
  bool first = true;
  for (const auto& [k, v] : m) {
    os << (first ? "" : ", ") << '"' << k << "\": \"" << v << '"';
    first = false;
  }
  os << "}";
  return os.str();
}

std::string ExpertsImplementation::to_string() const {
  if (all_) return *all_;
  return experts_map_to_string(per_config_);
}

std::string ModelOptions::to_string() const {
  std::ostringstream os;
  os << "ModelOptions{.device=" << device.to_string() << ", .dtype=" << (dtype ? dtype_name(*dtype) : "auto")
     << ", .experts_implementation="
     << (experts_implementation.empty() ? "default" : experts_implementation.to_string())
     << ", .cuda_graph=" << (cuda_graph ? "true" : "false") << (dequantize ? ", .dequantize=true" : "");
  if (expert_group && expert_group->size() > 1)
    os << ", .expert_group=" << expert_group->engine() << " rank " << expert_group->rank() << " of "
       << expert_group->size() << ", .ep_mode=" << ep_mode_name(ep_mode);
  os << "}";
  return os.str();
}

// ---- KvCache ----

KvCache::KvCache() : state_(std::make_unique<State>()) {}
KvCache::~KvCache() = default;
KvCache::KvCache(KvCache&&) noexcept = default;
KvCache& KvCache::operator=(KvCache&&) noexcept = default;
int64_t KvCache::length() const { return state_->length; }
void KvCache::clear() { state_->length = 0; }

// ---- experts maps ----

namespace {

std::string keys_list(const ExpertsMap& m) {
  std::string s;
  for (const auto& [k, v] : m) s += (s.empty() ? "'" : ", '") + k + "'";
  return s;
}

// `current` updated with `req`: a name sets every entry, a map only its keys (which must exist).
ExpertsMap merged_map(const ExpertsMap& current, const ExpertsImplementation& req) {
  ExpertsMap next = current;
  auto& reg = ExpertsInterface::global();
  if (req.all()) {
    reg.get(*req.all());  // throws listing the valid names
    for (auto& [k, v] : next) v = *req.all();
  }
  for (const auto& [k, v] : req.per_config()) {
    MOEKIT_CHECK_CODE(next.count(k), not_found, "experts implementation: unknown sub-config key '", k,
                      "'; this model has ", keys_list(current), " ('' is the top-level model)");
    reg.get(v);
    next[k] = v;
  }
  return next;
}

DType resolve_dtype(const ModelConfig& c, const std::optional<DType>& requested) {
  if (requested) {
    MOEKIT_CHECK(*requested == DType::f32 || *requested == DType::bf16 || *requested == DType::f16,
                 "model dtype must be f32, bf16 or f16, got ", dtype_name(*requested));
    return *requested;
  }
  if (c.dtype) {
    try {
      const DType t = parse_dtype(*c.dtype);
      if (t == DType::f32 || t == DType::bf16 || t == DType::f16) return t;
    } catch (const Error&) {}
  }
  return DType::f32;
}

}  // namespace

ExpertsMap decode_experts_map(const ExpertsMap& prefill, Device device, DecodeSwitch rule) {
  const bool applies = rule == DecodeSwitch::always || (rule == DecodeSwitch::automatic && device.is_cuda());
  if (!applies) return prefill;
  ExpertsMap out = prefill;
  auto& reg = ExpertsInterface::global();
  for (auto& [k, v] : out) {
    if (!reg.contains(v)) continue;
    const std::string_view decode = reg.get(v)->decode_backend();
    if (!decode.empty()) v = std::string(decode);
  }
  return out;
}

void Model::Impl::apply_experts_map() {
  const std::string& name = experts_map.at(decoder_key);
  for (auto& L : weights.layers)
    if (L.is_moe) L.moe.experts.set_implementation(name);
}

// ---- Model ----

Model::Model() = default;
Model::~Model() = default;
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;

Model Model::from_pretrained(const std::string& dir, const ModelOptions& options) {
  auto im = std::make_unique<Impl>();
  im->config = ModelConfig::load(dir);
  im->options = options;
  const ModelConfig& mc = im->config;
  model::LoadQuant quant = model::check_quantization(mc, dir);
  quant.dequantize = options.dequantize;
  im->dtype = resolve_dtype(mc, options.dtype);
  const Device dev = options.device;
  // Expert parallelism: this rank reads and holds only its slice of each MoE layer's experts.
  std::optional<ExpertSlice> shard;
  const ExpertGroupPtr& group = options.expert_group;
  if (group && group->size() > 1) {
    MOEKIT_CHECK(group->device() == dev, "expert parallelism: rank ", group->rank(), " of the ", group->engine(),
                 " group is on ", group->device().to_string(), " but the model is loaded on ", dev.to_string());
    MOEKIT_CHECK_CODE(!options.cuda_graph, not_supported,
                      "cuda_graph: expert parallelism (ep_size ", group->size(),
                      ") plans each layer's exchange on the host and cannot be recorded; drop --cuda-graph");
    MOEKIT_CHECK(mc.text.num_experts > 0, dir, ": expert parallelism needs a MoE model (num_experts is 0)");
    shard = expert_slice(mc.text.num_experts, group->rank(), group->size());
  }
  im->scratch = model::Scratch(dev);
  if (dev.is_cuda()) {
    MOEKIT_CHECK_CODE(cuda_available(), not_supported, "device ", dev.to_string(),
                      " requested but no CUDA device is available in this build or on this machine; use device cpu");
    model::ops_for(dev);  // throws when the layer ops have no CUDA implementation
    im->stream = std::make_unique<OwnedStream>(dev);
    im->graph_stream = std::make_unique<OwnedStream>(dev);
  }
  MOEKIT_CHECK_CODE(!options.cuda_graph || dev.is_cuda(), not_supported,
                    "cuda_graph: CUDA graphs need a CUDA device, the model runs on ", dev.to_string(),
                    "; drop the option (or --cuda-graph) on the CPU");

  // The map: "" and every sub-config; the decoder's entry drives the experts.
  im->decoder_key = mc.text_config_key;
  ExpertsMap start;
  start[""] = "";
  for (const auto& k : mc.sub_configs) start[k] = "";
  const ExpertsImplementation& req = options.experts_implementation;
  // Validate the request before the (long) load; placeholders stand for defaults.
  ExpertsMap requested = start;
  if (!req.empty()) requested = merged_map(start, req);
  const std::string decoder_choice = requested.at(im->decoder_key);

  const Checkpoint ck = Checkpoint::open(dir);
  im->weights = model::load_weights(ck, im->config.text, im->dtype, dev, decoder_choice, options.check_finite,
                                    options.on_load_progress, shard, quant);
  if (shard) {
    auto ep = std::make_shared<const ParallelExperts>(group, mc.text.num_experts, options.ep_mode);
    for (auto& L : im->weights.layers)
      if (L.is_moe) L.moe.ep = ep;
  }
  const TextConfig& c = im->config.text;
  im->rope = model::make_rope(c.rope, c.head_dim, c.max_position_embeddings);
  im->rope.interleaved = c.mla && c.rope_interleave;

  std::string decoder_backend = decoder_choice;
  for (const auto& L : im->weights.layers)
    if (L.is_moe) {
      decoder_backend = L.moe.experts.implementation();
      break;
    }
  if (decoder_backend.empty()) decoder_backend = default_experts_implementation(dev);
  for (auto& [k, v] : requested)
    if (v.empty()) v = k == im->decoder_key ? decoder_backend : default_experts_implementation(dev);
  im->experts_map = requested;
  im->apply_experts_map();
  Model m;
  m.impl_ = std::move(im);
  return m;
}

const ModelConfig& Model::config() const { return impl_->config; }
const ModelOptions& Model::options() const { return impl_->options; }
Device Model::device() const { return impl_->options.device; }
DType Model::dtype() const { return impl_->dtype; }
ExpertsMap Model::get_experts_implementation() const { return impl_->experts_map; }
const std::string& Model::experts_backend() const { return impl_->experts_map.at(impl_->decoder_key); }

void Model::set_experts_implementation(const ExpertsImplementation& impl) {
  MOEKIT_CHECK(!impl.empty(), "set_experts_implementation: nothing requested (give a name or a map)");
  const ExpertsMap next = merged_map(impl_->experts_map, impl);
  for (const auto& [k, v] : next)
    check_runtime_switch(impl_->experts_map.at(k), v, "experts implementation of '" + k + "'");
  impl_->experts_map = next;
  impl_->apply_experts_map();
}

std::vector<const Experts*> Model::experts_modules() const {
  std::vector<const Experts*> out;
  for (const auto& L : impl_->weights.layers)
    if (L.is_moe) out.push_back(&L.moe.experts);
  return out;
}

Tensor Model::forward(const std::vector<int64_t>& input_ids, KvCache& cache, bool all_logits) {
  return impl_->forward(input_ids, cache, all_logits);
}

Tensor Model::logits(const std::vector<int64_t>& input_ids) {
  KvCache cache;
  return impl_->forward(input_ids, cache, true);
}

ExpertsMapGuard::ExpertsMapGuard(Model& model) : model_(model), saved_(model.get_experts_implementation()) {}

ExpertsMapGuard::~ExpertsMapGuard() {
  try {
    if (model_.get_experts_implementation() != saved_) model_.set_experts_implementation(saved_);
  } catch (...) {
    // The saved map was valid when taken; nothing sensible remains to do in a destructor.
  }
}

}  // namespace moekit
