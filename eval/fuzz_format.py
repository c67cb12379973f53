"""Long fuzz run of the KVC reader: random and mutated files must raise only KVCodecError subclasses,
never another exception, never hang, never allocate without bound.

The CI test (tests/test_format_hostile.py) runs a bounded hypothesis search; this script runs a
longer, seeded campaign over files of EVERY registered codec preset (plain and chunked), with
mutations that also reach the codecs' decoders: bit flips, byte overwrites, truncation, insertion,
deletion, splices of two files, and re-signed manifests (the CRC recomputed so the damage passes
the checksum) with mutated codec parameters, chunk params, shapes and counts.

Usage:
    python eval/fuzz_format.py --seconds 600            # about 10 minutes
    python eval/fuzz_format.py --iterations 2000 --seed 7
    python eval/fuzz_format.py --replay CASE_SEED         # re-run one case a report listed

Each case runs under a CPU-time alarm (--case-timeout, default 20 CPU seconds; CPU time so that a
process starved on a shared machine is not mistaken for a hang; a failing case is re-run once to
check that it reproduces) and its Python allocations
are capped by checking tracemalloc's peak (--max-alloc-mb, default 512). Results (counts by outcome
and by mutation, slowest cases, every failure with its seed) are printed as a table and written to
eval/results/fuzz_format.json and .md (kvcodec.harness.results.write_result: one provenance header).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import struct
import sys
import time
import tracemalloc
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import torch

import kvcodec
from kvcodec import format as kvf
from kvcodec.errors import KVCodecError
from kvcodec.harness.results import provenance, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "eval" / "results"


class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):  # noqa: ARG001
    raise CaseTimeout()


def base_files() -> dict[str, bytes]:
    """Small valid files: every preset, unchunked and chunked, GQA and MLA."""
    g = torch.Generator().manual_seed(3)
    gqa = kvcodec.KVCache.from_tensors(
        [(torch.randn(40, 2, 32, generator=g).half(), torch.randn(40, 2, 32, generator=g).half()) for _ in range(2)],
        token_ids=torch.arange(40))
    mla = kvcodec.KVCache(layers=[{"kv": torch.randn(9, 1, 32, generator=g).half()}])
    out = {}
    # every preset, plus kvc with its token-delta rows forced on (the presets use them only where
    # they pay, which on these small random caches they do not), kvc with magnitude contexts,
    # unpacked planes and K reconstruction offsets
    extra = [("kvc-near.delta", {"id": "kvc-near", "delta": 2}),
             ("kvc-near.ctx", {"id": "kvc-near", "ctx": [3, 8, 20], "rows_per_stream": 8}),
             # the presets pack their planes (one 'pack' plane per tensor); the loose layout too
             ("kvc-near.loose", {"id": "kvc-near", "pack": 0}),
             ("kvc-near.pack1", {"id": "kvc-near", "pack": 1}),
             ("kvc-near.rc", {"id": "kvc-near", "k_recon": 4})]
    for name, cfg in [(n, n) for n in kvcodec.list_codecs()] + extra:
        codec = kvcodec.get_codec(cfg)
        for tag, cache, chunk in (("gqa", gqa, 0), ("gqa-c16", gqa, 16), ("mla", mla, 0)):
            try:
                out[f"{name}/{tag}"] = codec.encode(cache, tokens_per_chunk=chunk)
            except KVCodecError:
                pass  # a codec may refuse a geometry (e.g. MLA); that is not the reader's business
    return out


def _split(blob: bytes):
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _join(h: dict, data: bytes) -> bytes:
    t = json.dumps(h, sort_keys=True, separators=(",", ":")).encode()
    t += b" " * (-(8 + len(t)) % 64)
    return struct.pack("<Q", len(t)) + t + data


WEIRD = [0, 1, -1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 255, 256, 65535, 65536, 2**31, 2**32 + 1, 2**40, 2**62,
         -(2**31), 0.5, -0.0, 1e300, 1e-300, "", "x", "float16", None, True, False, [], [0], [1, 2, 3], {}, {"a": 1}]


def _mutate_value(rng: random.Random, v):
    if isinstance(v, dict) and v and rng.random() < 0.7:
        k = rng.choice(sorted(v))
        v[k] = _mutate_value(rng, v[k])
        return v
    if isinstance(v, list) and v and rng.random() < 0.7:
        i = rng.randrange(len(v))
        v[i] = _mutate_value(rng, v[i])
        return v
    if isinstance(v, int) and not isinstance(v, bool) and rng.random() < 0.5:
        return v + rng.choice([-2, -1, 1, 2, v, -v, 1000])
    return rng.choice(WEIRD)


def resign(blob: bytes, rng: random.Random) -> bytes:
    """Mutate a random part of the manifest that reaches deep checks or the codec, and re-sign."""
    h, data = _split(blob)
    meta = h["__metadata__"]
    m = json.loads(meta["manifest"])
    target = rng.choice(["codec", "params", "params", "shape", "layers", "storage", "any"])
    if target == "codec":
        m["codec"] = _mutate_value(rng, m["codec"])
    elif target == "params":
        lay = rng.choice(m["layers"])
        t = lay["tensors"][rng.choice(sorted(lay["tensors"]))]
        if t["chunks"]:
            c = rng.choice(t["chunks"])
            if c["params"]:
                k = rng.choice(sorted(c["params"]))
                c["params"][k] = _mutate_value(rng, c["params"][k])
            else:
                c["params"][rng.choice(["bits", "group", "scale"])] = rng.choice(WEIRD)
    elif target == "shape":
        for lay in m["layers"]:
            for t in lay["tensors"].values():
                t["shape"] = _mutate_value(rng, t["shape"])
    elif target == "layers":
        m["layers"] = _mutate_value(rng, m["layers"])
    elif target == "storage":
        m["storage"]["tensors"] = _mutate_value(rng, m["storage"]["tensors"])
    else:
        k = rng.choice(sorted(m))
        m[k] = _mutate_value(rng, m[k])
    meta["manifest"] = json.dumps(m, sort_keys=True, separators=(",", ":"))
    meta["manifest_crc32"] = f"{zlib.crc32(meta['manifest'].encode()) & 0xFFFFFFFF:08x}"
    return _join(h, data)


def mutate(blob: bytes, other: bytes, rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(["flip", "flips", "byte", "truncate", "insert", "delete", "splice", "resign", "resign",
                       "resign", "random"])
    b = bytearray(blob)
    if kind == "flip":
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif kind == "flips":
        for _ in range(rng.randint(2, 32)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif kind == "byte":
        b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == "truncate":
        b = b[: rng.randrange(len(b))]
    elif kind == "insert":
        i = rng.randrange(len(b) + 1)
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 100)))
    elif kind == "delete":
        i = rng.randrange(len(b))
        del b[i : i + rng.randint(1, 100)]
    elif kind == "splice":
        i = rng.randrange(min(len(b), len(other)) + 1)
        b = b[:i] + bytearray(other[i:])
    elif kind == "resign":
        b = bytearray(resign(blob, rng))
    else:
        b = bytearray(rng.randbytes(rng.randint(0, 600)))
        if rng.random() < 0.5:
            b[:8] = struct.pack("<Q", rng.randint(0, len(b)))
    return kind, bytes(b)


def run_case(data: bytes, timeout: float, max_alloc: int) -> tuple[str, float, int]:
    tracemalloc.start()
    signal.setitimer(signal.ITIMER_PROF, timeout)
    t0 = time.perf_counter()
    try:
        with kvcodec.open(data) as r:
            r.read_cache()
            r.verify()
        outcome = "decoded"
    except CaseTimeout:
        outcome = "HANG"
    except KVCodecError as e:
        outcome = type(e).__name__
    except Exception as e:  # noqa: BLE001 - exactly what we are hunting
        outcome = f"CRASH {type(e).__name__}: {str(e)[:120]}"
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if peak > max_alloc and not outcome.startswith(("CRASH", "HANG")):
        outcome = f"OVERALLOC {peak >> 20} MiB ({outcome})"
    return outcome, dt, peak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="time budget (default 120)")
    p.add_argument("--iterations", type=int, default=0, help="stop after this many cases (0: time only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case-timeout", type=float, default=20.0)
    p.add_argument("--max-alloc-mb", type=float, default=512.0)
    p.add_argument("--no-save", action="store_true", help="do not write eval/results")
    p.add_argument("--replay", type=int, default=None, metavar="CASE_SEED", help="run one recorded case and exit")
    args = p.parse_args(argv)
    prov = provenance(argv)
    # CPU time, not wall time: on a shared machine a starved process is not a hung decoder
    signal.signal(signal.SIGPROF, _alarm)

    files = base_files()
    names = sorted(files)
    if args.replay is not None:
        crng = random.Random(args.replay)
        base = crng.choice(names)
        kind, data = mutate(files[base], files[crng.choice(names)], crng)
        outcome, dt, peak = run_case(data, args.case_timeout, int(args.max_alloc_mb * 2**20))
        print(f"case {args.replay}: base={base} mutation={kind} -> {outcome} ({dt:.3f} s, peak {peak} bytes)")
        return 0 if not outcome.startswith(("CRASH", "HANG", "OVERALLOC")) else 1
    rng = random.Random(args.seed)
    by_outcome: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    by_codec: dict[str, Counter[str]] = defaultdict(Counter)
    failures, slowest = [], []
    t_end = time.monotonic() + args.seconds
    n = 0
    while time.monotonic() < t_end and (not args.iterations or n < args.iterations):
        case_seed = rng.randrange(2**63)
        crng = random.Random(case_seed)
        base = crng.choice(names)
        kind, data = mutate(files[base], files[crng.choice(names)], crng)
        outcome, dt, peak = run_case(data, args.case_timeout, int(args.max_alloc_mb * 2**20))
        n += 1
        bad = outcome.startswith(("CRASH", "HANG", "OVERALLOC"))
        key = "FAILURE" if bad else outcome
        by_outcome[key] += 1
        by_kind[kind][key] += 1
        by_codec[base.split("/")[0]][key] += 1
        slowest = sorted(slowest + [(dt, base, kind, case_seed)], reverse=True)[:5]
        if bad:
            again = run_case(data, args.case_timeout, int(args.max_alloc_mb * 2**20))[0]
            failures.append({"outcome": outcome, "base": base, "mutation": kind, "case_seed": case_seed,
                             "seconds": round(dt, 3), "peak_bytes": peak, "rerun_outcome": again})
            print(f"FAILURE {outcome} base={base} mutation={kind} case_seed={case_seed} (rerun: {again})",
                  file=sys.stderr)

    cols = sorted(by_outcome)
    lines = [f"KVC reader fuzz: {n} cases over {len(names)} base files, seed {args.seed}", "",
             "| mutation | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for k in sorted(by_kind):
        lines.append(f"| {k} | " + " | ".join(str(by_kind[k][c]) for c in cols) + " |")
    lines.append("| **all** | " + " | ".join(str(by_outcome[c]) for c in cols) + " |")
    lines += ["", "| codec | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for k in sorted(by_codec):
        lines.append(f"| {k} | " + " | ".join(str(by_codec[k][c]) for c in cols) + " |")
    lines += ["", "Slowest cases: " + ", ".join(f"{d:.2f}s ({b}, {k})" for d, b, k, _ in slowest),
              f"Failures (crash, hang, over-allocation): {len(failures)}"]
    for f in failures[:20]:
        lines.append(f"- {f['outcome']} base={f['base']} mutation={f['mutation']} case_seed={f['case_seed']}")
    text = "\n".join(lines)
    print(text)
    if not args.no_save:
        record = {
            "cases": n, "base_files": names, "seed": args.seed,
            "outcomes": dict(by_outcome), "by_mutation": {k: dict(v) for k, v in by_kind.items()},
            "by_codec": {k: dict(v) for k, v in by_codec.items()},
            "failures": failures,
            "slowest": [{"seconds": round(d, 3), "base": b, "mutation": k, "case_seed": s} for d, b, k, s in slowest],
        }
        write_result(RESULTS / "fuzz_format", record, f"# KVC reader fuzz\n\n{text}\n", prov=prov)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
