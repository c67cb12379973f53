"""Runs vLLM (its CPU build) with kvcodec's KV connector and reports what happened, as JSON.

Run by tests/test_integrations_vllm.py in the environment that has vLLM (``.venv-vllm``, see
tests/setup_vllm.sh); it needs only vLLM and kvcodec there. One engine per call:

    python tests/vllm_driver.py MODEL_DIR STORE_URL CODEC OUT.json [--profile P] [--salt S]

The scenario, on one engine (vLLM's own prefix cache off):

1. ``cold``: a prompt of ~700 tokens of documentation text, with nothing stored: computed, and
   its two whole 256-token chunks are saved (``save_mode`` "sync", so they are stored when the
   request returns);
2. ``warm``: the same prompt: 512 tokens loaded from the store;
3. ``shared``: another prompt that shares the first 512 tokens and goes on differently;
4. ``partial``: chunk 1 deleted: chunk 0 loads, the rest is computed;
   ``corrupt``: chunk 1's object damaged in the store: chunk 0 loads, chunk 1 is a miss
   (logged) and vLLM recomputes from there, as in ``partial``;
5. ``foreign``: chunk 0 replaced by a valid object that another model wrote: a miss, recomputed.

Each run records the generated token ids, their logprobs and vLLM's count of cached prompt
tokens; the test compares them. (Prompt logprobs would score more positions, but vLLM 0.32's
output processor fails on them for a request whose prefix a connector loaded.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("store")
    ap.add_argument("codec")
    ap.add_argument("out")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--salt", default="")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvcodec.api import decode
    from kvcodec.codec import get_codec
    from kvcodec.cache import ModelIdentity
    from kvcodec.harness.texts import calibration_text
    from kvcodec.integrations.stores import open_store
    from kvcodec.integrations.vllm import prefix_keys

    extra = {"codec": args.codec, "store": args.store, "save_mode": "sync", "salt": args.salt}
    if args.profile:
        extra["profile"] = args.profile
    ktc = KVTransferConfig(kv_connector="KVCodecConnector", kv_connector_module_path="kvcodec.integrations.vllm",
                           kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    llm = LLM(model=args.model, dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
              kv_transfer_config=ktc, max_model_len=2048, seed=0)
    tok = llm.get_tokenizer()
    ids = tok(calibration_text("docs"))["input_ids"]
    prompt = ids[:700]
    other = ids[:512] + ids[1500:1650]
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, logprobs=1)
    mc = llm.llm_engine.model_config
    keys = prefix_keys(mc, prompt[:512], salt=args.salt)
    store = open_store(args.store)
    runs: dict[str, dict] = {}

    def run(name: str, p: list[int]) -> None:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        o = out.outputs[0]
        runs[name] = {"token_ids": list(o.token_ids),
                      "logprobs": [float(lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs)],
                      "num_cached_tokens": out.num_cached_tokens, "seconds": time.perf_counter() - t0,
                      "sizes": [len(store.get(k) or b"") for k in keys],
                      "stored": [store.exists(k) for k in keys]}
        print(f"DRIVER {name}: {runs[name]}", file=sys.stderr, flush=True)

    run("cold", prompt)
    run("warm", prompt)
    run("shared", other)
    # chunk 1 gone: chunk 0 loads, the rest is computed (and chunk 1 stored again)
    store.delete(keys[1])
    run("partial", prompt)
    # damage chunk 1 (a byte in the middle of its payload): checksums catch it, and vLLM
    # recomputes from there: the same computation as "partial", so the same numbers
    blob = bytearray(store.get(keys[1]))
    blob[len(blob) // 2] ^= 0x5A
    store.put(keys[1], bytes(blob))
    run("corrupt", prompt)
    store.put(keys[1], bytes(blob))  # the corrupt run may have stored a fresh chunk 1 again: damage stays
    # chunk 0 replaced by a sound object of another model (same tokens, same shapes)
    part = decode(store.get(keys[0]))
    part.model = ModelIdentity(model_id="another-model@0123456789abcdef")
    store.put(keys[0], get_codec("raw").encode(part))
    run("foreign", prompt)
    json.dump({"runs": runs, "keys": keys}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
