"""Differential fuzz of kvcodec's decoders: every mutated file must get the same verdict, and the
same bits, from every decoding path.

Structure-aware mutations (kvcodec.format.resign: the file taken apart, changed, put back with
fresh CRC-32s, so the damage reaches the codecs) over the small files of every codec preset that
eval/fuzz_format.py builds (plain, chunked, MLA): chunk params (type confusion, bounds, huge
values), plane values (bit flips; NaN/Inf/huge/negative scales; NaN/Inf FP8 codes), plane dtypes
and shapes, unknown and missing planes, global planes, entropy-stage ``meta`` fields, tables,
row tables and offsets, and fuzz_format's re-signed manifest mutations. Each case is decoded by
every path of tests/_decode_paths.py: native, fallback (KVCODEC_NATIVE=0), verify, the GPU
decoders through the host build of the kernels (when a C++ compiler is there) and
formats/kvc_min_reader.py (container acceptance).

A case FAILS when the paths disagree (one accepts and another rejects, different output bits,
verify and decode disagree, the minimal reader rejects what kvcodec decodes, an exception that is
not a KVCodecError, a warning) or when a *silent change* happens: every path decodes the mutated
file without error to values other than the original's, although the mutation touched something
other than coded data (params, dtypes, shapes, planes added or removed, globals, stage geometry,
the manifest). Value mutations of planes may change the output: the spec allows coded data to be
anything within its bounds.

Usage:
    python eval/fuzz_diff.py --seconds 1200 --seed 1    # the published run (eval/results/fuzz_diff.md)
    python eval/fuzz_diff.py --iterations 200 --seed 3 --no-write
    python eval/fuzz_diff.py --replay SEED               # re-run one case a report listed

Results: eval/results/fuzz_diff.json and .md (kvcodec.harness.results.write_result: one provenance
header), unless --no-write.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from kvcodec.testing import load_file_module as _load

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "eval" / "results"


paths = _load("_decode_paths", ROOT / "tests" / "_decode_paths.py")
fuzz_format = _load("fuzz_format", ROOT / "eval" / "fuzz_format.py")

from kvcodec.format.resign import join_file, split_file  # noqa: E402
from kvcodec.harness.results import provenance, write_result  # noqa: E402

#: Mutation kinds whose silent changes are allowed (coded data, within what the spec permits).
VALUE_KINDS = {"plane-bits", "plane-special", "stage-data"}
SPECIAL_FLOATS = [float("nan"), float("inf"), -float("inf"), 1e30, 1e38, 3.4e38, -1.0, 0.0, -0.0, 65504.0, 65520.0,
                  1e-45, 2.0**-126, 147.0, 24.5]
SPECIAL_INTS = [0, 1, -1, 2, 0x7C, 0x7E, 0x7F, 0x80, 0xFC, 0xFF, 255, 256, 4095, 4096, 32767, 32768, 65535, 65536,
                2**31 - 1, 2**31, 2**32 - 1]
PARAM_VALUES = [0, 1, -1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 33, 255, 4095, 4096, 4097, 32769, 65536, 65537, 65538,
                2**31, 2**40, -(2**31), 0.5, 32.0, 32.9, "32", "", "e5m2", "token", "hadamard", None, True, False, [],
                [0], [1, 2, 3], {}, {"a": 1}]
_META_FIELDS = ["version", "R", "N", "C", "G", "P", "A", "K", "scope", "flags"]


def _chunk_params(m: dict) -> list[dict]:
    out = []
    for lay in m["layers"]:
        for t in lay["tensors"].values():
            out += [c["params"] for c in t["chunks"]]
    return out


def _layer_planes(t: dict) -> list[str]:
    return sorted(k for k in t if k.startswith("layers."))


def _set_elem(a: np.ndarray, rng: random.Random, value: Any) -> np.ndarray:
    if not a.size:
        return a
    a = a.copy()
    flat = a.reshape(-1)
    i = rng.randrange(flat.size)
    with np.errstate(all="ignore"):
        if a.dtype.kind == "f":
            flat[i] = value
        else:
            info = np.iinfo(a.dtype)
            flat[i] = int(value) if info.min <= int(value) <= info.max else int(value) & int(info.max)
    return a


def mutate(blob: bytes, other: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One structure-aware mutation of ``blob`` (``other``: a second file for splices)."""
    m, t = split_file(blob)
    names = _layer_planes(t)
    kind = rng.choice(["param", "param", "param-add", "plane-bits", "plane-special", "plane-special", "plane-dtype",
                       "plane-shape", "plane-extra", "plane-drop", "global", "stage-meta", "stage-meta", "stage-data",
                       "stage-dtype", "resign"])
    if kind == "resign":
        return kind, fuzz_format.resign(blob, rng)
    if kind in ("param", "param-add"):
        ps = _chunk_params(m)
        if not ps:
            return "none", blob
        p = rng.choice(ps)
        if kind == "param" and p:
            k = rng.choice(sorted(p))
            v = p[k]
            r = rng.random()
            if type(v) is int and r < 0.5:
                p[k] = rng.choice([str(v), float(v), v + 0.5, bool(v), v + rng.choice([-2, -1, 1, 2, 2**16, 2**31]), -v])
            elif isinstance(v, list) and v and r < 0.5:
                i = rng.randrange(len(v))
                v[i] = rng.choice(PARAM_VALUES)
            else:
                p[k] = rng.choice(PARAM_VALUES)
        else:
            p[rng.choice(["extra", "bits", "pad", "L", "k_tok", "levels"])] = rng.choice(PARAM_VALUES)
        if rng.random() < 0.3:  # the same change in every chunk of the file
            for q in ps:
                q.update(p)
        return kind, join_file(m, t)
    if not names:
        return "none", blob
    name = rng.choice(names)
    a = t[name]
    if kind == "plane-bits":
        if a.size:
            b = a.view(np.uint8).reshape(-1).copy() if a.nbytes else a
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(b.size)
                b[i] ^= 1 << rng.randrange(8)
            t[name] = b.view(a.dtype).reshape(a.shape)
    elif kind == "plane-special":
        floats = [k for k in names if t[k].dtype.kind == "f" and t[k].size]
        if floats and rng.random() < 0.6:
            name = rng.choice(floats)
            t[name] = _set_elem(t[name], rng, rng.choice(SPECIAL_FLOATS))
        elif a.size:
            t[name] = _set_elem(a, rng, rng.choice(SPECIAL_INTS))
    elif kind == "plane-dtype":
        to = rng.choice([np.uint8, np.int8, np.uint16, np.int16, np.float16, np.uint32, np.int32, np.float32, np.int64,
                         np.float64])
        if rng.random() < 0.5 or a.nbytes % np.dtype(to).itemsize:
            with np.errstate(all="ignore"):
                t[name] = a.astype(to)
        else:
            t[name] = a.reshape(-1).view(to)
    elif kind == "plane-shape":
        r = rng.random()
        if r < 0.35 and a.ndim > 1:
            t[name] = a.reshape(-1)
        elif r < 0.6:
            t[name] = a.reshape((1,) + a.shape)
        else:
            t[name] = np.resize(a.reshape(-1), max(0, a.size + rng.choice([-1, 1, 16]))).astype(a.dtype)
    elif kind == "plane-extra":
        base = name.rsplit(".", 1)[0]
        t[f"{base}.{rng.choice(['extra', 'ans_extra', 'scale2', 'recent', 'anc_meta', 'pred', 'esc'])}"] = \
            np.zeros(rng.choice([0, 1, 3, 10]), dtype=rng.choice([np.uint8, np.int16, np.float32]))
    elif kind == "plane-drop":
        del t[name]
    elif kind == "global":
        gl = [k for k in t if k.startswith("global.")]
        if not gl:
            return "none", blob
        g = rng.choice(gl)
        t[g] = _set_elem(t[g], rng, rng.choice(SPECIAL_INTS if t[g].dtype.kind != "f" else SPECIAL_FLOATS))
    elif kind in ("stage-meta", "stage-data", "stage-dtype"):
        metas = [k for k in names if k.endswith("_meta")]
        if not metas:
            return "none", blob
        meta = rng.choice(metas)
        pre = meta[: -len("meta")]
        if kind == "stage-meta":
            mm = t[meta].copy()
            f = rng.randrange(mm.size)
            mm[f] = rng.choice([0, 1, 2, 3, int(mm[f]) + 1, max(0, int(mm[f]) - 1), int(mm[f]) * 2, 17, 256, 4096,
                                32769, 65536, 65537, 2**31, 2**32 - 1])
            t[meta] = mm
            kind = f"stage-meta.{_META_FIELDS[f] if f < len(_META_FIELDS) else 'threshold'}"
        else:
            parts = [k for k in names if k.startswith(pre) and k != meta and t[k].size]
            if not parts:
                return "none", blob
            k = rng.choice(parts)
            if kind == "stage-data":
                t[k] = _set_elem(t[k], rng, rng.choice(SPECIAL_INTS))
            else:
                to = np.uint16 if t[k].dtype == np.uint8 else np.uint8 if t[k].dtype == np.uint16 else np.uint16
                with np.errstate(all="ignore"):
                    t[k] = t[k].astype(to)
    return kind, join_file(m, t)


def _codec_of(name: str) -> str:
    return name.split("/")[0]


def run(seconds: float | None = None, iterations: int | None = None, seed: int = 1, gpu_host: bool = True,
        only: list[str] | None = None, log=print) -> dict[str, Any]:
    """Run the campaign; return the counts and every failure (with the case seed to replay)."""
    files = fuzz_format.base_files()
    if only:
        files = {k: v for k, v in files.items() if _codec_of(k) in only}
    names = sorted(files)
    base = {}
    for n in names:
        res = paths.decode_paths(files[n], gpu_host=gpu_host)
        d = paths.disagreement(res)
        if d is not None or res["fallback"][0] != "ok":
            raise AssertionError(f"base file {n} does not decode on every path: {d} {res}")
        base[n] = res["fallback"][1]
    rng = random.Random(seed)
    by_kind: dict[str, Counter] = defaultdict(Counter)
    by_codec: dict[str, Counter] = defaultdict(Counter)
    failures: list[dict[str, Any]] = []
    t0 = time.monotonic()
    i = 0
    while (iterations is None or i < iterations) and (seconds is None or time.monotonic() - t0 < seconds):
        case_seed = rng.getrandbits(48)
        fname, kind, verdict, detail = one_case(files, names, base, case_seed, gpu_host)
        kind_key = kind.split(".")[0] if not kind.startswith("stage-meta") else kind
        by_kind[kind_key][verdict] += 1
        by_codec[_codec_of(fname)][verdict] += 1
        if verdict in ("disagree", "silent"):
            failures.append({"seed": case_seed, "file": fname, "mutation": kind, "verdict": verdict, "detail": detail})
            log(f"FAIL {verdict} seed={case_seed} {fname} {kind}: {detail}")
        i += 1
    return {"cases": i, "seconds": round(time.monotonic() - t0, 1), "files": len(names), "seed": seed,
            "gpu_host": gpu_host and paths.host_harness() is not None, "by_kind": by_kind, "by_codec": by_codec,
            "failures": failures}


def one_case(files: dict[str, bytes], names: list[str], base: dict[str, str], case_seed: int,
             gpu_host: bool = True) -> tuple[str, str, str, str]:
    """``(file, mutation, verdict, detail)`` of one seeded case. Verdicts: ``rejected`` (every path
    rejects), ``same`` (every path decodes the original bits), ``changed`` (every path decodes the
    same other bits after a value mutation: allowed), ``silent`` and ``disagree`` (failures),
    ``noop`` (the mutation left the file as it was)."""
    r = random.Random(case_seed)
    fname = r.choice(names)
    blob = files[fname]
    kind, mutated = mutate(blob, files[r.choice(names)], r)
    if mutated == blob:
        return fname, kind, "noop", ""
    res = paths.decode_paths(mutated, gpu_host=gpu_host)
    d = paths.disagreement(res)
    if d is not None:
        return fname, kind, "disagree", d
    if res["fallback"][0] != "ok":
        return fname, kind, "rejected", res["fallback"][1]
    if res["fallback"][1] == base[fname]:
        return fname, kind, "same", ""
    if kind.split(".")[0] in VALUE_KINDS or _value_params_only(blob, mutated):
        return fname, kind, "changed", ""
    return fname, kind, "silent", "decodes without error to other values"


#: Chunk params that are coded data (any value in bounds decodes to other values): kvc's per-head
#: step-code bases and reconstruction offsets (formats/codecs/kvc.md).
VALUE_PARAMS = {"step_base", "rc"}


def _leaf_diffs(x: Any, y: Any, path: tuple = ()) -> list[tuple]:
    if type(x) is not type(y) or (isinstance(x, list) and len(x) != len(y)):
        return [path]
    if isinstance(x, dict):
        return [d for k in set(x) | set(y) for d in _leaf_diffs(x.get(k), y.get(k), path + (k,))]
    if isinstance(x, list):
        return [d for i, (a, b) in enumerate(zip(x, y)) for d in _leaf_diffs(a, b, path + (i,))]
    return [] if x == y else [path]


def _value_params_only(blob: bytes, mutated: bytes) -> bool:
    """True when the mutation changed nothing but :data:`VALUE_PARAMS` in chunk params (planes equal)."""
    try:
        m0, t0 = split_file(blob)
        m1, t1 = split_file(mutated)
    except Exception:  # noqa: BLE001 - a mutation that broke the framing is not a value change
        return False
    if set(t0) != set(t1) or any(t0[k].dtype != t1[k].dtype or not np.array_equal(t0[k], t1[k]) for k in t0):
        return False
    m0.pop("storage", None)
    m1.pop("storage", None)
    diffs = _leaf_diffs(m0, m1)
    return bool(diffs) and all("params" in d and any(k in VALUE_PARAMS for k in d if isinstance(k, str))
                               for d in diffs)


VERDICTS = ["rejected", "same", "changed", "noop", "silent", "disagree"]


def table(counts: dict[str, Counter], head: str) -> list[str]:
    lines = [f"| {head} | " + " | ".join(VERDICTS) + " | all |", "|---" * (len(VERDICTS) + 2) + "|"]
    total: Counter = Counter()
    for k in sorted(counts):
        c = counts[k]
        total.update(c)
        lines.append(f"| {k} | " + " | ".join(str(c[v]) for v in VERDICTS) + f" | {sum(c.values())} |")
    lines.append("| **all** | " + " | ".join(str(total[v]) for v in VERDICTS) + f" | {sum(total.values())} |")
    return lines


def report(out: dict[str, Any]) -> str:
    """The Markdown report of a run (:func:`run`'s result), without the provenance block."""
    lines = ["# Differential decoder fuzz", "",
             f"{out['cases']} cases in {out['seconds']} s over {out['files']} base files, seed {out['seed']}; "
             f"paths: native, fallback (KVCODEC_NATIVE=0), verify, "
             f"{'GPU host build, ' if out['gpu_host'] else ''}formats/kvc_min_reader.py.", "",
             "Verdicts: *rejected* every path rejects; *same* every path decodes the original bits; *changed* "
             "every path decodes the same other bits after a value mutation of coded data (allowed); *noop* the "
             "mutation left the file unchanged (most: stage edits on files without loose stage planes, param "
             "edits on codecs without params); *silent* (failure) every path decodes other values after a "
             "mutation of params, dtypes, shapes, planes, globals, stage geometry or the manifest; *disagree* "
             "(failure) the paths differ, or one crashes or warns.", ""]
    lines += table(out["by_kind"], "mutation") + [""] + table(out["by_codec"], "codec") + [""]
    if out["failures"]:
        lines += ["## Failures", "", "| seed | file | mutation | verdict | detail |", "|---|---|---|---|---|"]
        lines += [f"| {f['seed']} | {f['file']} | {f['mutation']} | {f['verdict']} | {f['detail'][:160]} |"
                  for f in out["failures"][:200]]
    else:
        lines += ["No failures."]
    return "\n".join(lines) + "\n"


def result_doc(out: dict[str, Any]) -> dict[str, Any]:
    """The JSON document of a run (counts as plain dicts)."""
    return {**{k: v for k, v in out.items() if k not in ("by_kind", "by_codec")},
            "by_kind": {k: dict(v) for k, v in out["by_kind"].items()},
            "by_codec": {k: dict(v) for k, v in out["by_codec"].items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replay", type=int, default=None, help="re-run one case seed and print each path's outcome")
    ap.add_argument("--no-gpu-host", action="store_true", help="skip the host build of the GPU kernels")
    ap.add_argument("--no-write", action="store_true", help="do not write eval/results/fuzz_diff.*")
    args = ap.parse_args(argv)
    gpu_host = not args.no_gpu_host
    if args.replay is not None:
        files = fuzz_format.base_files()
        names = sorted(files)
        r = random.Random(args.replay)
        fname = r.choice(names)
        kind, mutated = mutate(files[fname], files[r.choice(names)], r)
        print(fname, kind)
        print(json.dumps(paths.decode_paths(mutated, gpu_host=gpu_host), indent=1))
        return 0
    if args.seconds is None and args.iterations is None:
        args.seconds = 60.0
    prov = provenance(argv)
    out = run(args.seconds, args.iterations, args.seed, gpu_host)
    if args.no_write:
        print(report(out))
    else:
        write_result(RESULTS / "fuzz_diff", result_doc(out), report(out), prov=prov, echo=True)
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
