// Small random checkpoints in transformers' own format, for tests, demos and benchmarks of the runtime.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "moekit/tensor.h"

namespace moekit {

struct TinyOptions {
  uint64_t seed = 0;
  DType dtype = DType::f32;  // f32, bf16 or f16: the weights and the config's "dtype"
  int shards = 1;            // > 1: model-0000i-of-0000n.safetensors + model.safetensors.index.json
  // "" (floating weights) or a format of quantize_tensors, applied to the random weights of `dtype`.
  std::string quantize;
};

// A float checkpoint's tensors and config.json rewritten in the published layout of a quantized format:
//  - "fp8": every linear layer but lm_head and the routers (fp8_quantized_tensor) as f8e4m3 `.weight` [N, K] with
//    an f32 `.weight_scale_inv` [ceil(N/128), ceil(K/128)]; quantization_config fp8 / e4m3 / dynamic / [128, 128].
//  - "fp4": the same with UE8M0 scales (F8_E8M0, scale_fmt "ue8m0"), the routed experts' weights in FP4: I8
//    [N, K/2] (two e2m1 per byte, low nibble first) with F8_E8M0 `.weight_scale_inv` [N, K/32]; config
//    "expert_dtype": "fp4" (DeepSeek's FP4 checkpoints).
//  - "mxfp4": gpt-oss's: the fused transposed experts `gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H] as
//    `..._blocks` U8 [E, out, in/32, 16] with `..._scales` U8 (E8M0) [E, out, in/32]; quantization_config mxfp4.
// Throws naming the tensor when a format does not fit the checkpoint (fused experts for fp8 / fp4, per-expert
// ones for mxfp4, inputs not a multiple of 32 for FP4).
void quantize_tensors(std::vector<std::pair<std::string, Tensor>>& tensors, nlohmann::json& config,
                      const std::string& format);
// Reads the float checkpoint in `in` (config.json and its safetensors, sharded or not), writes it quantized
// (quantize_tensors) into `out` as one model.safetensors, with config.json and the other files (tokenizer.json,
// generation_config.json, ...) copied. Returns the number of tensors written.
int64_t quantize_checkpoint(const std::string& in, const std::string& out, const std::string& format);

// Whether a tensor of that name and shape is quantized in an FP8 checkpoint: the 2-D `.weight` of a linear layer,
// not the embedding, lm_head, a router or a shared-expert gate.
bool fp8_quantized_tensor(const std::string& name, const Shape& shape);
// The quantization_config of an FP8 checkpoint (block-scaled e4m3, dynamic activations).
nlohmann::json fp8_quantization_config();

// The model_types write_tiny_checkpoint knows: qwen2_moe, qwen3_moe, mixtral, olmoe, deepseek_v3,
// gpt_oss and qwen3_vl_moe (multimodal: the MoE backbone in text_config, a small vision tower).
std::vector<std::string> tiny_architectures();

// Writes DIR/config.json, generation_config.json and tokenizer.json (tiny_tokenizer) as transformers saves
// them for that model_type,
// and the weights with the tensor names and layouts of published checkpoints (per-expert
// experts.{e}.gate_proj/up_proj/down_proj, Mixtral's w1/w2/w3, gpt-oss's fused transposed experts
// with biases, Qwen3-VL-MoE's fused [E, H, 2I] / [E, I, H]). Values: normal-ish with std 0.15
// (RMSNorm weights 1 + 0.1 noise, biases 0.1 noise), a pure function of (arch, seed, tensor name).
// Creates DIR when needed; replaces an earlier checkpoint's weight files there.
void write_tiny_checkpoint(const std::string& arch, const std::string& dir, uint64_t seed);
void write_tiny_checkpoint(const std::string& arch, const std::string& dir, const TinyOptions& options);

// A byte-level BPE tokenizer.json of exactly vocab_size ids (the printable ASCII bytes and newline, merges
// learnt from a short built-in text, <|endoftext|> last); write_tiny_checkpoint writes it beside the weights.
nlohmann::json tiny_tokenizer(int64_t vocab_size);

// The config.json written for arch (dtype float32); throws not_found listing the known ones.
nlohmann::json tiny_config(const std::string& arch);
// The tensors of a checkpoint of that config, sorted by name: (name, shape).
std::vector<std::pair<std::string, Shape>> tiny_tensor_shapes(const nlohmann::json& config);

}  // namespace moekit
