"""Where does a calibrated kvc encode's time go (native passes, attention estimates, Python), and
how much of two CPUs does it use?

A profiler for one question: why a kvc encode with a profile takes about twice CacheGen's time.
It encodes one raw cache with one kvc preset and a profile, ``--rounds`` times with one writer
thread and as shipped (``XPRED_ENCODE_THREADS``, two), alternating, with CacheGen's one-thread
encode in the same rounds, and reports for each:

* the wall time (fastest round; the median in brackets) and the process's CPU time over it
  (``getrusage``): how many CPUs the encode keeps busy;
* the CPU time of every native call (each ``kvn_*`` function, timed on its own thread), of the
  attention estimates (their own thread; their native softmax counts as native) and the rest
  (Python and numpy between the calls);
* the share of the wall time with 0, 1, 2 or 3 threads runnable: the writer threads that are
  coding a tensor and not waiting for the layer before (prediction across layers) or for an
  attention estimate, plus the attention thread while it estimates (sampled every 0.1 ms).
  Waiting for the GIL is not seen here: a runnable thread may still wait for it.

It instruments kvcodec's internals (the loaded native library, ``attention_estimate``,
``XPredEncoder``, ``_layer_calib``, ``KVCCodec.encode_tensor``), so it must change with them;
the timing wrappers add ~1 us a call. The bytes are checked equal to an uninstrumented encode.

Usage:
    python eval/studies/encode_time.py --input CACHE.safetensors --calibration PROFILE \\
        [--codec kvc-near] [--rounds 5] --out eval/results/encode_time_qwen
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import resource
import statistics
import sys
import threading
import time
from typing import Any, Iterator

import torch

from kvcodec.cache import KVCache
from kvcodec.codec import get_codec
from kvcodec.harness.results import provenance, write_result

SAMPLE_S = 1e-4


#: set on a thread while it runs an attention estimate (its native calls are native time, not
#: attention time)
_IN_ATTENTION = threading.local()


class _TimedLib:
    """The native library with every function call's thread CPU time added to ``acc`` (and, when
    an attention estimate makes the call, to ``acc["native in attention"]`` too)."""

    def __init__(self, lib: Any, acc: collections.Counter, lock: threading.Lock) -> None:
        self._lib, self._acc, self._lock = lib, acc, lock

    def __getattr__(self, name: str) -> Any:
        f = getattr(self._lib, name)
        if not callable(f) or not name.startswith("kvn_"):
            return f

        def timed(*a: Any) -> Any:
            t = time.thread_time()
            try:
                return f(*a)
            finally:
                d = time.thread_time() - t
                with self._lock:
                    self._acc[name] += d
                    if getattr(_IN_ATTENTION, "on", False):
                        self._acc["native in attention"] += d

        setattr(self, name, timed)
        return timed


@contextlib.contextmanager
def instrumented(acc: collections.Counter, events: list) -> Iterator[None]:
    """Time native calls and attention estimates (thread CPU, into ``acc``) and record the
    intervals of tensors, waits and estimates (``events``: (t0, t1, thread, kind))."""
    import kvcodec.codecs.kvc.codec as kc
    import kvcodec.codecs.kvc.xpred as kx
    import kvcodec.native.build as nb

    lock = threading.Lock()
    saved = (nb._state["lib"], kc.attention_estimate, kc._layer_calib, kx.XPredEncoder.__init__,
             kc.KVCCodec.encode_tensor)

    def note(t0: float, kind: str) -> None:
        with lock:
            events.append((t0, time.perf_counter(), threading.get_ident(), kind))

    class TimedCondition(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            t0 = time.perf_counter()
            try:
                return super().wait(timeout)
            finally:
                note(t0, "wait")

    def attention(*a: Any, **k: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        _IN_ATTENTION.on = True
        try:
            return saved[1](*a, **k)
        finally:
            _IN_ATTENTION.on = False
            with lock:
                acc["attention estimates"] += time.thread_time() - c0
            note(t0, "attention")

    def layer_calib(*a: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return saved[2](*a)
        finally:
            note(t0, "wait")

    def xp_init(self: Any, *a: Any, **k: Any) -> None:
        saved[3](self, *a, **k)
        self.cond = TimedCondition()

    def encode_tensor(self: Any, x: Any, ctx: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return saved[4](self, x, ctx)
        finally:
            note(t0, "tensor")

    nb._state["lib"] = _TimedLib(nb.required(), acc, lock)
    kc.attention_estimate, kc._layer_calib = attention, layer_calib
    kx.XPredEncoder.__init__, kc.KVCCodec.encode_tensor = xp_init, encode_tensor
    try:
        yield
    finally:
        nb._state["lib"], kc.attention_estimate, kc._layer_calib = saved[:3]
        kx.XPredEncoder.__init__, kc.KVCCodec.encode_tensor = saved[3:]


def runnable_shares(events: list, t0: float, t1: float) -> dict[int, float]:
    """Share of ``[t0, t1)`` with 0, 1, 2 or 3+ threads runnable (see the module docstring)."""
    tensors = [(a, b, th) for a, b, th, k in events if k == "tensor"]
    waits = [(a, b, th) for a, b, th, k in events if k == "wait"]
    attn = [(a, b) for a, b, _, k in events if k == "attention"]
    counts: collections.Counter = collections.Counter()
    n = max(1, int((t1 - t0) / SAMPLE_S))
    for i in range(n):
        t = t0 + i * SAMPLE_S
        busy = {th for a, b, th in tensors if a <= t < b} - {th for a, b, th in waits if a <= t < b}
        counts[min(3, len(busy) + any(a <= t < b for a, b in attn))] += 1
    return {k: round(counts[k] / n, 3) for k in range(4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="raw safetensors cache (kvcodec capture)")
    p.add_argument("--calibration", required=True, help="the model's profile (kvcodec calibrate)")
    p.add_argument("--codec", default="kvc-near", help="kvc preset")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", required=True, help="result stem (writes .json and .md)")
    args = p.parse_args(argv)
    prov = provenance(argv if argv is not None else sys.argv[1:], prog="python eval/studies/encode_time.py")
    import kvcodec.codecs.kvc.codec as kc

    torch.set_num_threads(1)  # as kvcodec bench: the codecs' own threads only
    cache = KVCache.from_safetensors(args.input)
    kv = get_codec({**get_codec(args.codec).get_config(), "calibration": args.calibration})
    cg = get_codec("cachegen")
    shipped = kc.XPRED_ENCODE_THREADS
    modes = {"1 writer thread": 1, f"{shipped} writer threads (shipped)": shipped}
    want = kv.encode(cache)
    cg.encode(cache)
    walls: dict[str, list[float]] = {m: [] for m in ["cachegen", *modes]}
    per: dict[str, dict[str, Any]] = {m: {"cpu": [], "acc": collections.Counter(), "shares": []} for m in modes}
    try:
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds}", file=sys.stderr, flush=True)
            t = time.perf_counter()
            cg.encode(cache)
            walls["cachegen"].append(time.perf_counter() - t)
            for m, threads in modes.items():
                kc.XPRED_ENCODE_THREADS = threads
                acc: collections.Counter = collections.Counter()
                events: list = []
                with instrumented(acc, events):
                    r0 = resource.getrusage(resource.RUSAGE_SELF)
                    t0 = time.perf_counter()
                    got = kv.encode(cache)
                    t1 = time.perf_counter()
                    r1 = resource.getrusage(resource.RUSAGE_SELF)
                if got != want:
                    raise SystemExit("encode_time: an instrumented encode gave other bytes")
                walls[m].append(t1 - t0)
                per[m]["cpu"].append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
                per[m]["acc"].update(acc)
                per[m]["shares"].append(runnable_shares(events, t0, t1))
    finally:
        kc.XPRED_ENCODE_THREADS = shipped
    n = args.rounds
    cg_best = min(walls["cachegen"])
    rows = []
    for m in modes:
        acc = per[m]["acc"]
        cpu = sum(per[m]["cpu"]) / n
        native = {k: v / n for k, v in acc.items() if k.startswith("kvn_")}
        attention = (acc["attention estimates"] - acc["native in attention"]) / n  # its native calls: native
        shares = {k: round(statistics.median(s[k] for s in per[m]["shares"]), 3) for k in range(4)}
        rows.append({"mode": m, "wall_s": min(walls[m]), "wall_median_s": statistics.median(walls[m]),
                     "x_cachegen": round(min(walls[m]) / cg_best, 3), "cpu_s": cpu,
                     "cpus_used": round(cpu / (sum(walls[m]) / n), 2),
                     "native_s": sum(native.values()), "attention_s": attention,
                     "rest_s": cpu - sum(native.values()) - attention,
                     "native_by_call_s": dict(sorted(native.items(), key=lambda kv_: -kv_[1])),
                     "runnable_shares": shares})
    ms = lambda s: f"{1e3 * s:.0f}"  # noqa: E731
    md = ["# Where a calibrated kvc encode's time goes", "",
          f"`{args.codec}` with the profile `{args.calibration}` on `{args.input}` ({cache.num_layers} layers, "
          f"{cache.num_tokens} tokens); torch on one thread; {n} alternating rounds. CacheGen's one-thread "
          f"encode in the same rounds: {ms(cg_best)} ms (fastest). Wall: fastest round (median). CPU: the "
          "process's user + system time per encode, the mean over the rounds; CPUs used: that over the mean wall. Native, attention (less its native calls) and rest: CPU time per encode, "
          "the mean over the rounds too (rest = CPU - native - attention: Python and numpy). Runnable: share of "
          "the wall time with 0 / 1 / 2 / 3+ threads runnable (writers coding and not waiting for the layer "
          "before or an attention estimate, plus the attention thread while it estimates; a runnable thread "
          "may still wait for the GIL), the median round.", "",
          "| mode | wall ms | × CacheGen | CPU ms | CPUs used | native ms | attention ms | rest ms | runnable 0/1/2/3+ |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sh = r["runnable_shares"]
        md.append(f"| {r['mode']} | {ms(r['wall_s'])} ({ms(r['wall_median_s'])}) | {r['x_cachegen']} | "
                  f"{ms(r['cpu_s'])} | {r['cpus_used']} | {ms(r['native_s'])} | {ms(r['attention_s'])} | "
                  f"{ms(r['rest_s'])} | {sh[0]} / {sh[1]} / {sh[2]} / {sh[3]} |")
    md += ["", "Native CPU per encode by call (ms), one writer thread / shipped:", "",
           "| call | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for name in rows[0]["native_by_call_s"]:
        md.append(f"| `{name}` | " + " | ".join(f"{1e3 * r['native_by_call_s'].get(name, 0.0):.1f}" for r in rows)
                  + " |")
    write_result(args.out, {"input": args.input, "codec": args.codec, "calibration": args.calibration,
                            "rounds": n, "cachegen_wall_s": cg_best, "rows": rows},
                 "\n".join(md) + "\n", prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
