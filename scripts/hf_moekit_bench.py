#!/usr/bin/env python3
"""transformers' own generate, with moekit's experts backends plugged in by name, against transformers' own
backends, on a GPU.

The model is a random Qwen3-MoE with the layer shapes of Qwen3-30B-A3B (hidden 2048, 32 query / 4 key-value
heads of 128, 128 experts, top-8, moe_intermediate 768), fewer layers and a smaller vocabulary (--layers,
--vocab), built in memory. Two parts:

- f32: greedy generation with `experts_implementation="moekit_grouped_mm"` must give the same tokens as
  transformers' `grouped_mm` (and the prompt's logits are compared);
- bf16: end-to-end timings of `model.generate` per experts implementation: transformers' eager, batched_mm
  and grouped_mm (plain, no compile), and moekit's registered backends. prefill = t(generate 1 token);
  decode = (new - 1) / (t(generate `new` tokens) - t(generate 1 token)) tokens/s; medians of --repeats runs
  after a warm-up. On the GPU both grouped_mm and moekit_grouped_mm switch to their batched_mm for the
  decode steps (SPEC section 4).

  python3 scripts/hf_moekit_bench.py [--layers 4] [--prompt 128] [--new 32] [--repeats 5] [--json out.json]
"""
import argparse
import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import moekit
import moekit.integrations.transformers as mt


def make_model(layers, vocab, seed, dtype, device, small=False):
    # small: the same structure at toy sizes, to try the script without a GPU.
    hidden, heads, kv, head_dim, inter, experts = (64, 4, 2, 16, 32, 16) if small else (2048, 32, 4, 128, 768, 128)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                         moe_intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=head_dim, num_experts=experts, num_experts_per_tok=8,
                         norm_topk_prob=True, max_position_embeddings=4096, decoder_sparse_step=1, mlp_only_layers=[],
                         tie_word_embeddings=False, rope_theta=1e6)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # Wider weights than the default init: routing and logits that are not flat (as scripts/model_bench.py).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    return model.eval()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def generate(model, prompt, new_tokens):
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    sync()
    return time.perf_counter() - t0, out[:, prompt.shape[1]:]


def leading_agreement(a, b):
    n = 0
    for x, y in zip(a[0].tolist(), b[0].tolist()):
        if x != y:
            break
        n += 1
    return n


def f32_check(model, prompt, new, report):
    """moekit_grouped_mm against transformers' grouped_mm in f32: the prompt's logits and `new` greedy tokens."""
    check = {}
    for impl in ("grouped_mm", "moekit_grouped_mm"):
        model.set_experts_implementation(impl)
        with torch.no_grad():
            logits = model(prompt).logits.float()
        check[impl] = (logits, generate(model, prompt, new)[1])
    ref_logits, ref_tokens = check["grouped_mm"]
    logits, tokens = check["moekit_grouped_mm"]
    max_diff = (logits - ref_logits).abs().max().item()
    same = bool(torch.equal(tokens, ref_tokens))
    report["f32"] = dict(new=new, same_tokens=same, agree_leading=leading_agreement(tokens, ref_tokens),
                         max_abs_logit_diff=max_diff, logit_scale=ref_logits.abs().max().item())
    print(f"f32: moekit_grouped_mm vs grouped_mm: same {new} greedy tokens: {same}; "
          f"max |logits diff| {max_diff:.3g} (max |logit| {ref_logits.abs().max().item():.3g})", flush=True)
    return same


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--check-new", type=int, default=32, help="greedy tokens compared in f32 (0: no f32 check)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impls", default="eager,batched_mm,grouped_mm,moekit_batched_mm,moekit_grouped_mm,moekit_deepgemm")
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="toy sizes (a dry run of the script)")
    a = ap.parse_args()

    registered = mt.register()
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    print(f"torch {torch.__version__}, {device_name}; moekit {moekit.__version__} registered "
          f"{', '.join(registered)}", flush=True)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, a.vocab, (a.batch, a.prompt), generator=g).to(a.device)
    report = dict(layers=a.layers, vocab=a.vocab, prompt=a.prompt, batch=a.batch, new=a.new, repeats=a.repeats,
                  torch=torch.__version__, device=device_name, registered=registered)

    # ---- f32: the same greedy tokens as transformers' grouped_mm ----
    t0 = time.perf_counter()
    model = make_model(a.layers, a.vocab, 0, torch.float32, a.device, a.small)
    print(f"model: {a.layers} layers, vocab {a.vocab}, built in {time.perf_counter() - t0:.1f} s", flush=True)
    same = True
    if a.check_new > 0:
        same = f32_check(model, prompt, a.check_new, report)

    # ---- bf16: end-to-end timings ----
    model = model.to(torch.bfloat16)
    for m in model.modules():
        m.__dict__.pop("_moekit_experts", None)  # moekit's module over the f32 weights: let them go
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    rows = []
    for impl in a.impls.split(","):
        if impl.startswith("moekit_") and impl not in registered:
            print(f"{impl}: not registered in this build, skipped", flush=True)
            continue
        model.set_experts_implementation(impl)
        try:
            generate(model, prompt, a.new)  # warm-up
            t1 = statistics.median(generate(model, prompt, 1)[0] for _ in range(a.repeats))
            runs = [generate(model, prompt, a.new) for _ in range(a.repeats)]
        except Exception as e:  # noqa: BLE001: a backend that cannot run is reported, not fatal
            print(f"{impl}: failed: {e!r}"[:400], flush=True)
            continue
        tn = statistics.median(r[0] for r in runs)
        decode_s = max(tn - t1, 1e-9)
        rows.append(dict(experts=impl, prefill_ms=t1 * 1e3, generate_ms=tn * 1e3,
                         decode_tokens_per_s=a.batch * (a.new - 1) / decode_s, tokens=runs[0][1]))
        print(f"bf16 {impl:18s} prefill {t1 * 1e3:8.2f} ms  decode {a.batch * (a.new - 1) / decode_s:8.1f} tok/s  "
              f"(generate {a.new}: {tn * 1e3:.1f} ms)", flush=True)
    own = [r for r in rows if not r["experts"].startswith("moekit_")]
    if own:
        best_prefill = min(r["prefill_ms"] for r in own)
        best_decode = max(r["decode_tokens_per_s"] for r in own)
        ref = next((r["tokens"] for r in rows if r["experts"] == "grouped_mm"), own[0]["tokens"])
        print(f"\nbf16, batch {a.batch}, prompt {a.prompt}, {a.new} new tokens, median of {a.repeats}; "
              "x = vs transformers' best own backend")
        print("experts              prefill ms   x      decode tok/s   x      greedy tokens = grouped_mm's")
        for r in rows:
            r["prefill_x_best_transformers"] = best_prefill / r["prefill_ms"]
            r["decode_x_best_transformers"] = r["decode_tokens_per_s"] / best_decode
            r["agree_leading"] = leading_agreement(r["tokens"], ref)
            print(f"{r['experts']:20s} {r['prefill_ms']:10.2f} {r['prefill_x_best_transformers']:5.2f}  "
                  f"{r['decode_tokens_per_s']:13.1f} {r['decode_x_best_transformers']:5.2f}   "
                  f"first {r['agree_leading']}/{a.new}")
    for r in rows:
        r["tokens"] = r["tokens"][0].tolist()
    report["bf16"] = rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
