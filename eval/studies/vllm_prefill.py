#!/usr/bin/env python
"""How long does vLLM's CPU build take here to load a model and prefill a prompt (no connector)?

Whether eval/bench_vllm.py can run on a machine in a session: it prefills each 2,048-token
prompt several times per mode (recompute, the stores, the quality references). For each dtype,
an engine of its own (vLLM's prefix cache off, as the benchmark runs it) is loaded and timed,
then the time to the first token of prompts of each length, cold (the first request of that
length) and again. Runs in the vLLM environment (tests/setup_vllm.sh makes .venv-vllm):

    .venv-vllm/bin/python eval/studies/vllm_prefill.py --model MODEL_DIR --out eval/results/vllm_prefill_cpu

Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def child(model: str, dtype: str, lengths: list[int]) -> None:
    """One engine: prints a JSON line with its load time and each length's two TTFTs."""
    from vllm import LLM, SamplingParams

    from kvcodec.harness.texts import eval_text

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, enable_prefix_caching=False, max_model_len=4096, seed=0)
    load = time.perf_counter() - t0
    ids = llm.get_tokenizer()(eval_text("docs"))["input_ids"]
    one = SamplingParams(temperature=0, max_tokens=1)
    out = {"dtype": dtype, "load_s": load, "lengths": {}}
    for n in lengths:
        if n > len(ids):
            raise SystemExit(f"the docs text has {len(ids)} tokens, fewer than {n}")
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids[:n]}], one, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        out["lengths"][str(n)] = times
    print("PREFILL " + json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model directory (kvcodec's converted model)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--lengths", default="256,2080", help="prompt lengths in tokens (2,080: the benchmark's prefix "
                    "and question)")
    ap.add_argument("--out", default="eval/results/vllm_prefill_cpu")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        child(args.model, args.child, lengths)
        return 0
    from kvcodec.harness.results import provenance, write_result

    prov = provenance(argv)
    runs = []
    for dtype in args.dtypes.split(","):
        p = subprocess.run([sys.executable, __file__, "--model", args.model, "--lengths", args.lengths,
                            "--child", dtype], capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("PREFILL ")]
        if not line:
            raise SystemExit(f"{dtype} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
        # the engine's processes share the child's stdout: a log line may land after the JSON
        runs.append(json.JSONDecoder().raw_decode(line[0][8:])[0])
        print(f"{dtype}: {runs[-1]}", file=sys.stderr, flush=True)
    lines = ["# vLLM's CPU build here: engine load and prefill time (no connector)", "",
             f"{Path(args.model).name}, vLLM's prefix cache off, enforce_eager; the first tokens of the built-in docs "
             "text; time to the first token of one request (one output token), cold (the first request of that "
             "length) and again. eval/bench_vllm.py prefills each 2,080-token prompt several times per mode.", "",
             "| dtype | engine load s | " + " | ".join(f"{n} tokens: cold s | again s" for n in lengths) + " |",
             "|---|---|" + "---|---|" * len(lengths)]
    for r in runs:
        cells = " | ".join(f"{r['lengths'][str(n)][0]:.2f} | {r['lengths'][str(n)][1]:.2f}" for n in lengths)
        lines.append(f"| {r['dtype']} | {r['load_s']:.1f} | {cells} |")
    write_result(args.out, {"model": Path(args.model).name, "lengths": lengths, "runs": runs}, "\n".join(lines) + "\n",
                 prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
