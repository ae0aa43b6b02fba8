#!/usr/bin/env python3
"""Writes a qwen3_moe checkpoint of a chosen size (no dependencies beyond Python), for measuring peak
memory while loading: python3 scripts/big_checkpoint.py OUT_DIR [--hidden 1024 --layers 4 --experts 32
--moe-intermediate 512 --vocab 32000 --dtype F32|BF16]. Values: a 1 MiB block of small finite numbers,
repeated (the loader's cost does not depend on them)."""
import argparse, json, os, random, struct

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--hidden", type=int, default=1024)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--experts", type=int, default=32)
p.add_argument("--moe-intermediate", type=int, default=512)
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--dtype", default="F32", choices=["F32", "BF16"])
a = p.parse_args()
H, L, E, I, V = a.hidden, a.layers, a.experts, a.moe_intermediate, a.vocab
Hq, Hkv, D = 16, 4, 64
es = 4 if a.dtype == "F32" else 2
tensors = [("model.embed_tokens.weight", [V, H]), ("model.norm.weight", [H]), ("lm_head.weight", [V, H])]
for i in range(L):
    q = f"model.layers.{i}."
    tensors += [(q + "input_layernorm.weight", [H]), (q + "post_attention_layernorm.weight", [H]),
                (q + "self_attn.q_proj.weight", [Hq * D, H]), (q + "self_attn.k_proj.weight", [Hkv * D, H]),
                (q + "self_attn.v_proj.weight", [Hkv * D, H]), (q + "self_attn.o_proj.weight", [H, Hq * D]),
                (q + "self_attn.q_norm.weight", [D]), (q + "self_attn.k_norm.weight", [D]),
                (q + "mlp.gate.weight", [E, H])]
    for e in range(E):
        tensors += [(q + f"mlp.experts.{e}.gate_proj.weight", [I, H]), (q + f"mlp.experts.{e}.up_proj.weight", [I, H]),
                    (q + f"mlp.experts.{e}.down_proj.weight", [H, I])]
random.seed(0)
vals = [random.gauss(0, 0.02) for _ in range(1 << 18)]
block = struct.pack(f"<{len(vals)}f", *vals)
if a.dtype == "BF16":
    block = b"".join(block[i + 2:i + 4] for i in range(0, len(block), 4))
header, off = {}, 0
for name, shape in tensors:
    n = es
    for d in shape: n *= d
    header[name] = {"dtype": a.dtype, "shape": shape, "data_offsets": [off, off + n]}
    off += n
hs = json.dumps(header).encode()
hs += b" " * (-len(hs) % 8)
os.makedirs(a.out, exist_ok=True)
with open(os.path.join(a.out, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(hs)) + hs)
    left = off
    while left > 0:
        f.write(block[:min(left, len(block))])
        left -= min(left, len(block))
cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H, "num_hidden_layers": L,
       "num_attention_heads": Hq, "num_key_value_heads": Hkv, "head_dim": D, "num_experts": E,
       "num_experts_per_tok": 4, "moe_intermediate_size": I, "intermediate_size": 4 * H, "vocab_size": V,
       "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096, "norm_topk_prob": True,
       "tie_word_embeddings": False, "dtype": "float32" if a.dtype == "F32" else "bfloat16", "eos_token_id": 0}
json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"))
print(f"wrote {a.out}: {len(tensors)} tensors, {off + 8 + len(hs)} bytes")
