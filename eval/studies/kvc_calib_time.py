#!/usr/bin/env python
"""What a kvc calibration costs on a model whose KV cache is 9x Qwen2.5-Coder-0.5B's.

Qwen3-0.6B (28 layers, 8 KV heads of 128 dims: 28,672 K values a token against Qwen2.5-Coder's
3,072) is the kind of sub-1B model users calibrate; its weights cannot be downloaded here, so the
study builds one of its shape with random weights (transformers' ``Qwen3ForCausalLM``, seed 0,
vocabulary 151,936, the SmolLM2 tokenizer's ids): every cost of the calibration (model runs,
encodes, decodes) is that of the real shape, while the steps it finds mean nothing. Attention is
transformers' default implementation (sdpa), which ``kvcodec calibrate`` gets too. Measured on
the first search window of the built-in calibration texts (1024 cached + 512 scored tokens, the
calibration's own windows):

* one encode of the window with the search's settings (calibrated: kvc codes its tensors one at
  a time), the same steps without the calibration with kvc's tensors coded one at a time and on
  the writer's threads (``Codec.encode_threads``; the bytes must be equal), fastest of
  ``--repeat`` interleaved rounds; one decode, and one window score (encode, decode, model run,
  KL);
* with ``--full``: the whole ``build_profile`` as ``kvcodec calibrate`` runs it, timed.

    python eval/studies/kvc_calib_time.py --full --out eval/results/kvc_calib_time
"""

from __future__ import annotations

import argparse
import time

from kvcodec.harness.results import provenance, write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="also time the whole calibration (~10-15 minutes on 2 cores)")
    ap.add_argument("--out", default="eval/results/kvc_calib_time")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import os
    import tempfile

    import torch
    import transformers

    import kvcodec
    import kvcodec.codecs.kvc.codec as kvc
    from kvcodec.codecs.kvc.calibration import save_query_statistics
    from kvcodec.harness import load_model
    from kvcodec.harness import profile as P
    from kvcodec.harness.calibration import fisher_diagonal, query_statistics, sensitivities
    from kvcodec.harness.evaluate import Evaluator
    from kvcodec.harness.studies import timed_encodes
    from kvcodec.harness.texts import CALIBRATION_DOMAINS, calibration_text

    torch.manual_seed(0)
    _, tok = load_model("smollm2-135m")
    shape = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                 max_position_embeddings=4096, tie_word_embeddings=True)
    # transformers' default attention (sdpa), as `kvcodec calibrate` loads a model (load_model);
    # until 2026-12-06 this study used eager attention, whose 512-token runs on top of the cache
    # took ~1.4x as long (scratch: 5.7-6.3 s against 4.2-4.6 s)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape)).eval()
    texts = {d: calibration_text(d) for d in CALIBRATION_DOMAINS}
    search, _ = P.split_windows(tok, texts, 1024, 512, 4)
    t = time.perf_counter()
    ev = Evaluator(model, tok, "", 1024, 512, attn_queries=1, token_ids=search[0][1])
    t_eval = time.perf_counter() - t
    stats = query_statistics(model, tok, "", context=1024, samples=64, token_ids=search[0][1])
    ids = search[0][1]
    ref0, fisher = fisher_diagonal(model, ids[:1024], ids[1024:1536], 2, reference=ev.reference)
    stats.k_sens, stats.v_sens = sensitivities(ref0, fisher, stats.attention)
    fd, cal = tempfile.mkstemp(suffix=".safetensors")
    os.close(fd)
    save_query_statistics(stats, cal)
    # this shape is past XPRED_MAX_WEIGHTS: the search codes it without cross-layer predictors
    config = {"id": "kvc", **P.SEARCH_ENTROPY, **P.SEARCH_SETTINGS, "xpred": 0, "k_step": 1.0, "v_step": 2.0,
              "calibration": cal}
    codec = kvcodec.get_codec(config)
    plain = kvcodec.get_codec({k: v for k, v in config.items() if k != "calibration"})
    threads = min(kvc.KVCCodec.encode_threads, os.cpu_count() or 1)
    best, blobs = timed_encodes({"cal": (codec, 1), 1: (plain, 1), threads: (plain, threads)}, ev.reference,
                                args.repeat)
    if blobs[1] != blobs[threads]:
        raise SystemExit("threaded encode wrote other bytes than one thread")
    t_dec = float("inf")
    for _ in range(args.repeat):
        t = time.perf_counter()
        codec.decode(blobs["cal"])
        t_dec = min(t_dec, time.perf_counter() - t)
    t = time.perf_counter()
    ev.score_next_token(config, kl_only=True)
    t_score = time.perf_counter() - t
    os.unlink(cal)
    elements = ev.reference.num_elements
    doc = {"model_shape": {**shape, "model": "Qwen3ForCausalLM, random weights (seed 0)"}, "context": 1024,
           "continuation": 512, "elements": elements, "bits_per_element": 8 * len(blobs["cal"]) / elements,
           "evaluator_s": t_eval, "encode_s_calibrated": best["cal"],
           "encode_s_one_thread": best[1], "encode_s_threads": best[threads],
           "threads": threads, "decode_s": t_dec, "window_score_s": t_score, "repeat": args.repeat}
    lines = ["# kvc calibration cost on a model of Qwen3-0.6B's shape (KV 9x Qwen2.5-Coder-0.5B's)", "",
             "Random weights of the real shape (28 layers, 8 KV heads x 128, vocabulary 151,936; transformers' default "
             "attention, sdpa, as `kvcodec calibrate` loads a model): the costs are the "
             "shape's, the steps found mean nothing. One search window: 1024 cached + 512 scored tokens "
             f"({elements:,} cached values).", "",
             "| what | seconds |", "|---|---|",
             f"| window set-up (fp16 cache and reference logits) | {t_eval:.2f} |",
             f"| encode with the search's settings (calibrated: one tensor at a time) | {best['cal']:.2f} |",
             f"| encode, same steps, no calibration, tensors one at a time | {best[1]:.2f} |",
             f"| encode, same steps, no calibration, {threads} writer threads (same bytes) | {best[threads]:.2f} "
             f"({best[threads] / best[1]:.2f}x) |",
             f"| decode | {t_dec:.2f} |",
             f"| one window score (encode, decode, model run on 512 tokens, KL) | {t_score:.2f} |"]
    if args.full:
        msgs: list[str] = []

        def say(m: str) -> None:
            msgs.append(m)
            print(" ", m, flush=True)

        t = time.perf_counter()
        st = P.build_profile(model, tok, texts, progress=say)
        total = time.perf_counter() - t
        scored = sum(1 for m in msgs if " -> " in m)
        stop = st.profile.get("stopped_by_time")
        doc.update(full_s=total, scores=scored, levels=st.profile["levels"], progress=msgs,
                   time_budget=st.profile.get("time_budget"), stopped_by_time=stop)
        lines += ["", f"## The whole calibration: {total:.0f} s ({total / 60:.1f} min) on this machine", "",
                  f"`build_profile` with the built-in calibration texts (what `kvcodec calibrate` runs): {scored} "
                  "steps scored (search, balance probes; some stopped early), then the held-out window. Its "
                  f"progress lines, in order (time budget {st.profile.get('time_budget')} s: "
                  + (f"the balance stopped early, {stop})" if stop else "not reached)") + ":",
                  "", "```", *msgs, "```"]
    write_result(args.out, doc, "\n".join(lines), prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
