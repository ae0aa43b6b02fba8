#!/usr/bin/env python3
"""Greedy generation end to end on a GPU: `moekit run --device cuda` against transformers' generate on the
same checkpoint.

The checkpoint is a random Qwen3-MoE with the layer shapes of Qwen3-30B-A3B (hidden 2048, 32 query / 4 key-value
heads of 128, 128 experts, top-8, moe_intermediate 768) and fewer layers and a smaller vocabulary (--layers,
--vocab), in bf16. Decode speed is (new tokens - 1) over the decode time: moekit reports it (--json);
for transformers it is measured as t(generate N tokens) - t(generate 1 token), medians of --repeats runs.
Also reported: how many leading greedy tokens the two agree on (bf16 rounding differs, so long random
generations may part).

  python3 scripts/model_bench.py --moekit build-gpu/bin/moekit [--layers 4] [--prompt 128] [--new 64]
                                 [--batch-sizes 1,8,32] [--json out.json]

--batch-sizes: also B prompts at once (random, --prompt tokens each): transformers' batched generate against
`moekit run --prompts-file --batch B`; throughput = B x (new tokens - 1) over the decode time.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig


def make_checkpoint(path, layers, vocab, seed):
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
                         decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, rope_theta=1e6)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    # Wider weights than the default init: routing and logits that are not flat.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_generate(model, prompt, new_tokens):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out[0, prompt.shape[1]:].tolist()


def hf_generate_batch(model, prompts, new_tokens):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out[:, prompts.shape[1]:].tolist()


def batch_rows(a, model, ckpt, sizes):
    """B sequences at once: transformers' batched generate against moekit run --prompts-file --batch B."""
    rows = []
    g = torch.Generator().manual_seed(2)
    for b in sizes:
        prompts = torch.randint(0, a.vocab, (b, a.prompt), generator=g)
        hf_tokens = None
        if model is not None:
            for impl in ["grouped_mm", "batched_mm"]:
                model.set_experts_implementation(impl)
                try:
                    hf_generate_batch(model, prompts.cuda(), 2)  # warm-up
                    t1 = statistics.median(hf_generate_batch(model, prompts.cuda(), 1)[0] for _ in range(a.repeats))
                    runs = [hf_generate_batch(model, prompts.cuda(), a.new) for _ in range(a.repeats)]
                except torch.OutOfMemoryError as e:  # batched_mm gathers every token's expert weights
                    torch.cuda.empty_cache()
                    print(f"batch {b:3d} transformers {impl:11s} out of memory: {str(e).splitlines()[0]}", flush=True)
                    continue
                decode_s = max(statistics.median(r[0] for r in runs) - t1, 1e-9)
                hf_tokens = hf_tokens or runs[0][1]
                rows.append(dict(engine="transformers", experts=impl, graph=False, batch=b, prefill_ms=t1 * 1e3,
                                 decode_ms=decode_s * 1e3, tokens_per_s=b * (a.new - 1) / decode_s))
                print(f"batch {b:3d} transformers {impl:11s} prefill {t1 * 1e3:8.1f} ms  decode "
                      f"{b * (a.new - 1) / decode_s:9.1f} tok/s", flush=True)
        path = os.path.join(os.path.dirname(ckpt), f"prompts_{b}.jsonl")
        with open(path, "w") as f:
            for p in prompts.tolist():
                f.write(json.dumps({"ids": p}) + "\n")
        for graph in [False, True]:
            cmd = [a.moekit, "run", "--model", ckpt, "--device", "cuda", "--dtype", "bf16", "--prompts-file", path,
                   "--batch", str(b), "--max-new-tokens", str(a.new), "--min-new-tokens", str(a.new), "--json",
                   "--quiet", "--warmup", "1"] + (["--cuda-graph"] if graph else [])
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"moekit batch {b} graph={graph} failed:\n{p.stderr[-2000:]}", flush=True)
                continue
            js = [json.loads(line) for line in p.stdout.strip().splitlines()]
            t = js[0]["timings"]
            new = sum(len(j["generated_ids"]) - 1 for j in js)
            agree = [leading_agreement(j["generated_ids"], h) for j, h in zip(js, hf_tokens or [])]
            rows.append(dict(engine="moekit", experts="grouped_mm", graph=graph, batch=b, prefill_ms=t["prefill_ms"],
                             decode_ms=t["decode_ms"], tokens_per_s=new * 1e3 / t["decode_ms"],
                             phases=js[0]["phases"], replays=js[0]["cuda_graph"]["replays"],
                             agree_leading_min=min(agree) if agree else None))
            print(f"batch {b:3d} moekit grouped_mm graph={int(graph)} prefill {t['prefill_ms']:8.1f} ms  decode "
                  f"{new * 1e3 / t['decode_ms']:9.1f} tok/s  ({t['decode_ms'] / max(1, a.new - 1) * 1e3:.0f} us per "
                  f"step, replays {js[0]['cuda_graph']['replays']}, agree with transformers >= "
                  f"{min(agree) if agree else '-'} leading tokens)", flush=True)
    return rows


def leading_agreement(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moekit", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", default="", help="e.g. 1,8,32: batched generation too")
    ap.add_argument("--batch-only", action="store_true", help="only the --batch-sizes rows")
    ap.add_argument("--json")
    a = ap.parse_args()
    sizes = [int(x) for x in a.batch_sizes.split(",") if x]

    tmp = tempfile.mkdtemp(prefix="moekit_model_bench_")
    ckpt = os.path.join(tmp, "qwen3_moe_30b_shapes")
    t0 = time.perf_counter()
    model = make_checkpoint(ckpt, a.layers, a.vocab, 0)
    print(f"checkpoint: {a.layers} layers, vocab {a.vocab}, bf16, written in {time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, a.vocab, (1, a.prompt), generator=g)
    prompt = prompt_ids.cuda()
    rows = []
    batch = batch_rows(a, model, ckpt, sizes) if sizes else []
    if a.batch_only:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(layers=a.layers, vocab=a.vocab, prompt=a.prompt, new=a.new, batch_rows=batch), f,
                          indent=1)
        return 0

    for impl in ["grouped_mm", "batched_mm", "eager"]:
        model.set_experts_implementation(impl)
        hf_generate(model, prompt, 2)  # warm-up
        t1 = statistics.median(hf_generate(model, prompt, 1)[0] for _ in range(a.repeats))
        runs = [hf_generate(model, prompt, a.new) for _ in range(a.repeats)]
        tn = statistics.median(r[0] for r in runs)
        tokens = runs[0][1]
        decode_s = max(tn - t1, 1e-9)
        rows.append(dict(engine="transformers", experts=impl, graph=False, prefill_ms=t1 * 1e3,
                         decode_ms=decode_s * 1e3, tokens_per_s=(a.new - 1) / decode_s, tokens=tokens))
        print(f"transformers {impl:11s} prefill {t1 * 1e3:8.1f} ms  decode {(a.new - 1) / decode_s:8.1f} tok/s", flush=True)
    hf_tokens = rows[0]["tokens"]
    del model
    torch.cuda.empty_cache()

    ids = ",".join(str(int(x)) for x in prompt_ids[0].tolist())
    for experts, graph in [("grouped_mm", False), ("grouped_mm", True), ("eager", False)]:
        cmd = [a.moekit, "run", "--model", ckpt, "--device", "cuda", "--dtype", "bf16", "--experts", experts,
               "--prompt-ids", ids, "--max-new-tokens", str(a.new), "--min-new-tokens", str(a.new), "--json",
               "--quiet", "--warmup", "2"] + (["--cuda-graph"] if graph else [])
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"moekit {experts} graph={graph} failed:\n{p.stderr[-2000:]}", flush=True)
            continue
        j = json.loads(p.stdout.strip().splitlines()[-1])
        t = j["timings"]
        rows.append(dict(engine="moekit", experts=experts, graph=graph, prefill_ms=t["prefill_ms"],
                         decode_ms=t["decode_ms"], tokens_per_s=t["tokens_per_s"], tokens=j["generated_ids"],
                         phases=j["phases"], replays=j.get("cuda_graph", {}).get("replays", 0)))
        print(f"moekit {experts:11s} graph={int(graph)} prefill {t['prefill_ms']:8.1f} ms  decode "
              f"{t['tokens_per_s']:8.1f} tok/s  phases {j['phases']}  agree with transformers on the first "
              f"{leading_agreement(j['generated_ids'], hf_tokens)}/{a.new} tokens", flush=True)

    best_hf = max(r["tokens_per_s"] for r in rows if r["engine"] == "transformers")
    for r in rows:
        r["vs_best_transformers"] = r["tokens_per_s"] / best_hf
        r["agree_leading"] = leading_agreement(r["tokens"], hf_tokens)
    print("\nengine        experts      graph  prefill ms  decode tok/s  x best transformers")
    for r in rows:
        print(f"{r['engine']:13s} {r['experts']:12s} {int(r['graph']):5d} {r['prefill_ms']:11.1f} "
              f"{r['tokens_per_s']:13.1f} {r['vs_best_transformers']:10.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(layers=a.layers, vocab=a.vocab, prompt=a.prompt, new=a.new, rows=rows, batch_rows=batch),
                      f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
