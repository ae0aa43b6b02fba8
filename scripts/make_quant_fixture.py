#!/usr/bin/env python3
"""Reference fixture for a quantized checkpoint (tests/fixtures/quant/ARCH_FORMAT/), made with transformers on the CPU.

FP8 (`moekit tiny --arch ARCH --quantize fp8`: f8e4m3 `.weight` [N, K] with f32 `.weight_scale_inv`
[ceil(N/128), ceil(K/128)], quantization_config fp8): transformers 5.17's FP8 dequantize derives the block size as
dim / number of scale blocks, which is wrong when a dimension is not a multiple of 128, so the weights are
dequantized here with exact 128 x 128 blocks (the last one partial), as (w.float() * scale).to(float32), and
transformers' model code runs on those weights (float32, CPU).

MXFP4 (`moekit tiny --arch gpt_oss --quantize mxfp4`: `_blocks` / `_scales`, quantization_config mxfp4): loaded by
transformers itself, which dequantizes MXFP4 where its kernels are absent (the CPU) into bf16 parameters (exact),
cast to float32 (lossless) so that the model runs in float32.

Writes DIR/reference.safetensors: input_ids [2, 11] int64 (the ids of make_fixtures.py), logits.grouped_mm
[2, 11, vocab] f32, generated_ids [1, 31] int64 (greedy, 20 new tokens, min_new_tokens 20, grouped_mm).
"""
import argparse
import json
import os
import shutil
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("dir", help="the FP8 checkpoint folder; reference.safetensors is written into it")
args = ap.parse_args()

BLOCK = 128


def dequantize(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    assert s.shape == ((n + BLOCK - 1) // BLOCK, (k + BLOCK - 1) // BLOCK), (w.shape, s.shape)
    full = s.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return (w.float() * full).to(torch.float32)


config = json.load(open(os.path.join(args.dir, "config.json")))
g = torch.Generator().manual_seed(1234)
ids = torch.randint(0, 160, (2, 11), generator=g)


def reference(model):
    model.set_experts_implementation("grouped_mm")
    with torch.no_grad():
        logits = model(ids).logits.float()
        gen = model.generate(ids[:1], max_new_tokens=20, min_new_tokens=20, do_sample=False)
    return logits, gen


if config["quantization_config"]["quant_method"] == "mxfp4":
    model = transformers.AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32).eval()
    # transformers dequantizes into bf16 parameters (exact: e2m1 x 2^k) whatever the model dtype; cast them to
    # float32 (lossless) so that the experts run in float32 like the rest of the model.
    model = model.float()
    logits, gen = reference(model)
else:
    logits, gen = None, None
tensors = load_file(os.path.join(args.dir, "model.safetensors")) if logits is None else {}
out = {}
for name, t in tensors.items():
    if name.endswith("_scale_inv"):
        continue
    if t.dtype == torch.float8_e4m3fn:
        out[name] = dequantize(t, tensors[name[: -len(".weight")] + ".weight_scale_inv"])
    else:
        out[name] = t.float()
del config["quantization_config"]
config["dtype"] = "float32"

if logits is None:
    with tempfile.TemporaryDirectory() as tmp:
        json.dump(config, open(os.path.join(tmp, "config.json"), "w"))
        shutil.copy(os.path.join(args.dir, "generation_config.json"), tmp)
        save_file(out, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        logits, gen = reference(model)
save_file({"input_ids": ids.to(torch.int64).contiguous(), "logits.grouped_mm": logits.contiguous(),
           "generated_ids": gen.to(torch.int64).contiguous()},
          os.path.join(args.dir, "reference.safetensors"),
          metadata={"transformers": transformers.__version__, "torch": torch.__version__})
print(args.dir, "logits", tuple(logits.shape), "generated", gen[0, 11:].tolist(), "transformers", transformers.__version__,
      "torch", torch.__version__)
