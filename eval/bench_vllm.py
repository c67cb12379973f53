"""vLLM with kvcodec's KV connector against recompute and vLLM's ExampleConnector (bf16 files).

Runs in the vLLM environment (tests/setup_vllm.sh makes .venv-vllm); writes
eval/results/<out>.{json,md}:

    .venv-vllm/bin/python eval/bench_vllm.py --model MODEL_DIR [--profile P] [--out vllm_connector]

(MODEL_DIR: ``python -c "from kvcodec.harness.models import model_dir; print(model_dir())"`` in
the main environment; the profile: ``kvcodec calibrate --out P``; ``bash eval/run_published.sh
vllm_connector`` runs it with both.)

For each text (two kinds) a request of a 2,048-token document prefix plus a 32-token question is
sent three ways, each by an engine of its own (vLLM's prefix cache off):

* **recompute**: no connector; time to first token (TTFT) of the request;
* **example**: vLLM's ``ExampleConnector`` (one bf16 safetensors file per layer): the first request
  stores, the same request again loads;
* **kvc-<level>**: :class:`kvcodec.integrations.vllm.KVCodecConnector` with that level (and the
  model's profile): the first request stores, the same request again loads, and a request with
  another question over the same document loads the shared prefix;
* **raw**: the same connector with the lossless ``raw`` codec (the bf16 KV bit for bit): what a
  loaded prefix scores when nothing is lost, the floor of the kvc levels' quality columns (a
  request computed on top of a loaded prefix takes other kernels than one prefilled whole, so
  even lossless KV does not give recompute's logprobs exactly).

TTFT is the wall time of ``generate`` with one output token (the median of three warm requests).
Quality: the 256 tokens that follow the prefix's first token are scored with ``prompt_logprobs``
(top 20) on top of the loaded prefix, against recompute: the mean absolute error of the true
tokens' logprobs, top-1 agreement, and a KL over the reference's top-20 tokens (the test's
logprob of a token outside its own top 20 is taken as its 20th: a lower bound of the error).
ExampleConnector's objects are the bf16 KV itself, so its quality is recompute's (not scored: it
matches whole prompts only, and a loaded token gets no prompt logprob).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ("docs", "prose")
PREFIX, QUESTION, SCORED, TOPK = 2048, 32, 256, 20


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def child(args: argparse.Namespace) -> None:
    """One engine, one mode: prints a JSON line with its measurements."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvcodec.harness.texts import eval_text

    store = Path(args.store)
    kw = {}
    if args.mode == "example":
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                                    kv_connector_extra_config={"shared_storage_path": str(store)})
    elif args.mode.startswith("kvc") or args.mode == "raw":
        extra = {"codec": args.mode, "store": str(store), "save_mode": "sync"}
        if args.profile and args.mode != "raw":
            extra["profile"] = args.profile
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVCodecConnector", kv_connector_module_path="kvcodec.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    llm = LLM(model=args.model, dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=4096, max_logprobs=TOPK, seed=0, **kw)
    tok = llm.get_tokenizer()
    one = SamplingParams(temperature=0, max_tokens=1)
    out: dict = {"mode": args.mode, "domains": {}}
    for dom in DOMAINS:
        ids = tok(eval_text(dom))["input_ids"]
        prefix = ids[:PREFIX]
        q_a = prefix + ids[PREFIX:PREFIX + QUESTION]
        q_b = prefix + ids[PREFIX + 600:PREFIX + 600 + QUESTION]
        # the first token after a loaded prefix gets no real logprob (it needs the last loaded
        # token's hidden state, which the load skipped): score the SCORED tokens after it
        scored = prefix + ids[PREFIX:PREFIX + SCORED + 1]

        def ttft(p: list[int]) -> float:
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
            return time.perf_counter() - t0

        before = _dir_bytes(store) if store.exists() else 0
        r = {"first": ttft(q_a)}
        r["bytes"] = (_dir_bytes(store) if store.exists() else 0) - before
        r["warm"] = [ttft(q_a) for _ in range(3)]
        if args.mode != "example":
            r["shared"] = ttft(q_b)
            # detokenize off: the loaded prefix's prompt positions carry placeholder ids (-1) that
            # vLLM's detokenizer cannot turn into text (OverflowError); ids and logprobs suffice here
            sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOPK, skip_reading_prefix_cache=False,
                                detokenize=False)
            o = llm.generate([{"prompt_token_ids": scored}], sp, use_tqdm=False)[0]
            r["num_cached_scored"] = o.num_cached_tokens
            lps = o.prompt_logprobs[PREFIX + 1:PREFIX + SCORED + 1]
            r["true"] = [float(d[t].logprob) if d and t in d else None
                         for d, t in zip(lps, ids[PREFIX + 1:PREFIX + SCORED + 1])]
            r["top"] = [{str(k): float(v.logprob) for k, v in (d or {}).items()} for d in lps]
        out["domains"][dom] = r
    print("BENCH " + json.dumps(out), flush=True)


def _quality(ref: dict, test: dict) -> dict:
    err, agree, kls = [], [], []
    for t_ref, t_test, d_ref, d_test in zip(ref["true"], test["true"], ref["top"], test["top"]):
        if t_ref is not None and t_test is not None:
            err.append(abs(t_ref - t_test))
        if d_ref and d_test:
            agree.append(max(d_ref, key=d_ref.get) == max(d_test, key=d_test.get))
            floor = min(d_test.values())
            kls.append(sum(math.exp(lr) * (lr - d_test.get(k, floor)) for k, lr in d_ref.items()))
    return {"logprob_abs_err": statistics.mean(err), "top1": statistics.mean(agree),
            "kl_top20": max(0.0, statistics.mean(kls)), "scored": len(agree)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--out", default="vllm_connector")
    ap.add_argument("--levels", default="raw,kvc-transparent,kvc-near,kvc-aggressive")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        child(args)
        return
    modes = ["recompute", "example", *args.levels.split(",")]
    res = {}
    for mode in modes:
        store = Path(tempfile.mkdtemp(prefix=f"bench-vllm-{mode}-"))
        cmd = [sys.executable, __file__, "--model", args.model, "--mode", mode, "--store", str(store)]
        if args.profile:
            cmd += ["--profile", args.profile]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"})
        shutil.rmtree(store, ignore_errors=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("BENCH ")]
        if not line:
            raise SystemExit(f"{mode} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
        # the engine's processes share the child's stdout: a log line may land after the JSON
        res[mode] = json.JSONDecoder().raw_decode(line[0][6:])[0]
        if p.returncode != 0:  # measured, then the engine's shutdown failed: keep the numbers, say so
            res[mode]["exit_status"] = p.returncode
            print(f"{mode}: engine exited with {p.returncode} after its measurements", file=sys.stderr)
        print(f"{mode}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = []
    for dom in DOMAINS:
        rec = res["recompute"]["domains"][dom]
        ex = res["example"]["domains"][dom]
        t_rec = statistics.median(rec["warm"])
        for mode in modes:
            r = res[mode]["domains"][dom]
            warm = statistics.median(r["warm"])
            row = {"domain": dom, "mode": mode, "ttft_s": warm, "ttft_vs_recompute": warm / t_rec,
                   "ttft_vs_example": warm / statistics.median(ex["warm"]), "first_s": r["first"],
                   "bytes": r["bytes"], "bytes_vs_example": (ex["bytes"] / r["bytes"]) if r["bytes"] else None,
                   "shared_s": r.get("shared")}
            if mode.startswith("kvc") or mode == "raw":
                row.update(_quality(rec, r), num_cached_scored=r["num_cached_scored"])
            rows.append(row)
    _write(args, rows, res)


def _write(args: argparse.Namespace, rows: list[dict], res: dict) -> None:
    from kvcodec.harness.results import write_result

    lines = ["# vLLM with kvcodec's KV connector: time to first token, bytes, quality", "",
             f"{Path(args.model).name} in vLLM's CPU build (bf16, prefix cache off), a {PREFIX}-token document prefix "
             f"plus a {QUESTION}-token question, per text kind; TTFT = median of three warm requests; quality: the "
             f"{SCORED} tokens after the prefix's first (which no loaded prefix can score: its logprob needs "
             "the last loaded token's hidden state) scored on top of the loaded prefix against recompute "
             "(true-token logprob error, top-1 agreement, KL over the reference's top 20). `raw` is the same "
             "connector storing the bf16 KV bit for bit: its quality columns are the floor that a loaded prefix "
             "gets with nothing lost (other kernels than a whole prefill).", "",
             "| text | mode | TTFT s | × recompute | × example | bytes stored | fewer bytes than example | "
             "another question, TTFT s | logprob err | top-1 | KL top-20 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = (f"{r['logprob_abs_err']:.4f} | {r['top1']:.3f} | {r['kl_top20']:.4f}" if "top1" in r else "– | – | –")
        fewer = f"{r['bytes_vs_example']:.2f}×" if r["bytes_vs_example"] else "–"
        shared = f"{r['shared_s']:.3f}" if r.get("shared_s") else "–"
        lines.append(f"| {r['domain']} | {r['mode']} | {r['ttft_s']:.3f} | {r['ttft_vs_recompute']:.3f} | "
                     f"{r['ttft_vs_example']:.2f} | {r['bytes']:,} | {fewer} | {shared} | {q} |")
    write_result(ROOT / "eval" / "results" / args.out, {"rows": rows, "raw": {m: res[m] for m in res}},
                 "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
