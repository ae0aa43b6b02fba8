#!/usr/bin/env python3
"""Reference outputs of Hugging Face transformers for a checkpoint folder, to compare moekit with.

Loads the checkpoint with transformers on the CPU in float32 and writes one safetensors file:
  input_ids            [batch, tokens] int64   random ids (seeded) below the vocabulary size
  logits.<backend>     [batch, tokens, vocab] float32, for the experts backends eager, batched_mm, grouped_mm
  generated_ids        [1, tokens + new_tokens] int64: greedy generation from input_ids[0] (grouped_mm)
with metadata: the checkpoint's model_type, the transformers and torch versions, and `weights_fnv1a64`, the
FNV-1a 64-bit hash of the weight files' bytes (sorted by name), which ties the reference to the exact weights.

Example: moekit tiny --arch qwen3_moe --out /tmp/q3 && python3 scripts/make_reference.py --model /tmp/q3 --out ref.safetensors
Needs torch, transformers and safetensors.
"""
import argparse
import glob
import json
import os
import sys


def fnv1a64(paths):
    h = 0xCBF29CE484222325
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        for b in data:  # plain loop: files here are small; big checkpoints take a while
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder (config.json + safetensors)")
    ap.add_argument("--out", required=True, help="output .safetensors file")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the random input ids")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=11)
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--no-hash", action="store_true", help="skip weights_fnv1a64 (slow for big checkpoints)")
    a = ap.parse_args()

    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    transformers.logging.set_verbosity_error()
    cfg = AutoConfig.from_pretrained(a.model)
    text_cfg = cfg.get_text_config()
    try:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    except ValueError:  # multimodal configs: the text part runs, with text-only input
        model = AutoModelForImageTextToText.from_pretrained(a.model, dtype=torch.float32)
    model.eval()
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, text_cfg.vocab_size, (a.batch, a.tokens), generator=g, dtype=torch.int64)
    out = {"input_ids": ids}
    for impl in ["eager", "batched_mm", "grouped_mm"]:
        model.set_experts_implementation(impl)
        with torch.no_grad():
            out[f"logits.{impl}"] = model(input_ids=ids).logits.float().contiguous()
    model.set_experts_implementation("grouped_mm")
    with torch.no_grad():
        gen = model.generate(ids[:1], max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False)
    out["generated_ids"] = gen.to(torch.int64).contiguous()
    weights = sorted(glob.glob(os.path.join(a.model, "*.safetensors")))
    meta = {
        "model_type": cfg.model_type,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "experts_implementations": json.dumps(["eager", "batched_mm", "grouped_mm"]),
    }
    if not a.no_hash:
        meta["weights_fnv1a64"] = fnv1a64(weights)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    save_file(out, a.out, metadata=meta)
    diff = max(float((out[f"logits.{i}"] - out["logits.eager"]).abs().max()) for i in ["batched_mm", "grouped_mm"])
    print(f"{a.out}: {cfg.model_type}, logits {list(out['logits.eager'].shape)}, backends agree within {diff:.2e}, "
          f"generated {gen[0, a.tokens:].tolist()}")


if __name__ == "__main__":
    sys.exit(main())
