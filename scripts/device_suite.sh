#!/usr/bin/env bash
# The GPU tests and every GPU benchmark of docs/benchmarks.md in one run, for one call of a
# device machine: results go under OUT (default ./device-out), a log per step and JSON where the
# benchmark writes it, all packed at the end into OUT/bundle.tgz (the device tool returns at most
# 8 files from a call; `tar xzf bundle.tgz` unpacks them). Two visible GPUs add the tensor-parallel
# tests and bench_tp. Each step has its own time limit, so one slow step cannot eat the rest.
#
#   scripts/device_suite.sh                 # everything: longer than one device call, so split it
#   STEPS="tests reload" scripts/device_suite.sh   # with STEPS (a call: at most 10 minutes)
#
# Steps: tests, tests-backends (the backends' GPU tests only), tests-engine (the engine's GPU
# tests and the offload connector's through it),
# step (one decode step, eager vs CUDA graphs), step-shapes (the decode step with
# the offload connector at 1x1024, 2x6400, 8x2048 and 8x8192), reload (16k reload and 0 % reuse),
# noreuse-lazy / noreuse-thread (0 % reuse with the lazy policy / the worker loop on a thread of
# its own), noreuse-parts (0 % reuse, bf16, with --step-parts), noreuse-ahead / noreuse-ahead-fp32
# (the same with async scheduling, bf16 / float32), step-ahead (the decode step synchronous and
# scheduled ahead, bare and with the connector, at issue 25's four shapes), store-compute (a
# 4k-token step's GEMMs beside one store of its KV, issued staged with the gather widths of
# GATHER_CTAS (default 64,132,264), as 2D DMA copies and as one copy; KV_HEADS sets the
# page, 2 KiB a head, default 8), noreuse-store-dma
# (noreuse-ahead with CudaConfig.store_dma against without, AB_ROUNDS each, alternating; DMA_ARMS
# picks among staged, staged-N (a gather of N CTAs), dma and dma-batch, default "staged dma";
# DMA_MIN_RUN sets CudaConfig.store_dma_min_run of the 2D-copy arms, here and in multiround-store),
# multiround (kvflow bench, llama-1b), decode (decode attention kernels), contention (a store's copy
# against the engine's own copies and kernels), connector (block transfers through the connector,
# every layout; cross-layer again on the staged path), connector-ab (the same at 512 blocks, this
# tree against the base tree unpacked at BASE_SRC, default .base/src, AB_ROUNDS processes each,
# interleaved), step-ab / multiround-ab (the decode step with and without the offload connector /
# kvflow bench's bf16 workload with --step-parts, this tree against BASE_SRC, AB_ROUNDS each,
# default 2, alternating), multiround-trees (that workload on each tree of TREES, "name=src-dir"
# pairs, AB_ROUNDS each, alternating), multiround-issue (the same over this tree as it is, with
# CudaConfig.pitched_parts off, and with defer_parts on), multiround-store (the same, stores as 2D
# copies against staged, each set in a copy of this tree), multiround-config (the same, this
# tree as it is against a copy of it per entry of CONFIGS, "NAME:FIELD=VALUE,FIELD=VALUE"
# setting CudaConfig defaults), multiround-fence (that workload with --fence-loads never and idle,
# AB_ROUNDS each, alternating), multiround-parts (that workload's fenced loads whole and in
# LOAD_PARTS parts by layer, default 4 (a list: each), AB_ROUNDS each, alternating), calls (each driver call of the issue path, cuda-python against ctypes), pdx (PD's CUDA IPC transport, scattered
# pages; 256 MiB and 1 GiB hand-offs), nixl (NIXL's device-memory path beside CUDA IPC, the NIXL
# wheel from .nixlwhl/), gloo (PD's CPU transport on the host's cores), pd (kvflow bench --pd on the one GPU over CUDA IPC, the
# multi-round workload, the first token D's and P's), pd-one (the same with one user, 2k-16k-token
# prompts: PD_PROMPTS, PD_FIRST; PD_TRACE=1 adds every process's events, --trace), tp (two GPUs only). Missing Python packages (structlog,
# pytest-asyncio) are installed from .whl/*.whl when that folder exists. REPEAT sets the reload and
# noreuse-fp32 steps' pairs of runs (default 16 and 9).
set -u
OUT=${OUT:-./device-out}
STEPS=${STEPS:-tests step reload noreuse-lazy noreuse-thread multiround decode contention connector pdx pd pd-one tp}
mkdir -p "$OUT/logs"
if compgen -G ".whl/*.whl" >/dev/null; then
  wheels=(.whl/*.whl)
  if compgen -G ".nixlwhl/*.whl" >/dev/null; then wheels+=(.nixlwhl/*.whl); fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvflow-site "${wheels[@]}" || exit 1
  site=/tmp/kvflow-site:
else
  site=
fi
export PYTHONPATH=${site}src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "kvflow device suite: $gpus GPU(s), steps: $STEPS"
nvidia-smi -L
status=0

run() {  # run NAME LIMIT_S COMMAND...: one step, its log under OUT/logs
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S))"
  timeout "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/logs/$name.log"
  [ "$rc" -eq 0 ] || { echo "!! $name exited $rc"; status=1; }
}

config_tree() {  # config_tree NAME FIELD=VALUE...: src/ copied to /tmp/kvflow-NAME/src with
  # those CudaConfig defaults set, each checked; fails naming a field it could not set
  local dir=/tmp/kvflow-$1 kv
  local cfg=$dir/src/kvflow/backends/cuda/config.py
  shift
  rm -rf "$dir" && mkdir -p "$dir" && cp -r src "$dir/" || return 1
  for kv in "$@"; do
    sed -i -E "s/^    (${kv%%=*}: [a-z]+) = .*$/    \1 = ${kv#*=}/" "$cfg"
    grep -qE "^    ${kv%%=*}: [a-z]+ = ${kv#*=}$" "$cfg" \
      || { echo "!! could not set CudaConfig.${kv%%=*} in $dir"; return 1; }
  done
}

model=(--model llama-1b --device cuda)
multi=(--users 8 --rounds 4 --system 2048 --first-question 4096 --question 256 --answer 16
  --cache-fraction 0.3 --max-batched-tokens 8192)
for step in $STEPS; do
  case $step in
    tests) run gpu_tests 300 python3 -m pytest -m gpu tests -q -p no:cacheprovider ;;
    tests-backends)  # the backends' GPU tests only: a short call for a change to a backend
      run gpu_tests_backends 200 python3 -m pytest -m gpu tests/backends -q -p no:cacheprovider ;;
    tests-engine)  # the engine's GPU tests and the offload connector's through it
      run gpu_tests_engine 240 python3 -m pytest -m gpu tests/engine \
        tests/connector/test_offload_gpu.py -q -x -p no:cacheprovider ;;
    step)
      run decode_step 240 python3 scripts/bench_decode_step.py --model llama-1b --device cuda \
        --modes piecewise graphs --json "$OUT/decode_step_bf16.json"
      run decode_step_fp32 240 python3 scripts/bench_decode_step.py --model llama-1b \
        --device cuda --dtype float32 --modes piecewise graphs \
        --json "$OUT/decode_step_fp32.json" ;;
    step-shapes)  # the decode step with the offload connector at issue 25's four shapes
      run decode_step_shapes 240 python3 scripts/bench_decode_step.py "${model[@]}" --modes graphs \
        --offload --rounds 3 --shapes 1x1024,2x6400,8x2048,8x8192 --json "$OUT/decode_step_shapes.json" ;;
    reload)
      run engine_offload 300 python3 scripts/bench_engine_offload.py "${model[@]}" \
        --scenario both --reloads 5 --repeat "${REPEAT:-16}" --trace "$OUT/reload_trace.jsonl" \
        --json "$OUT/engine_offload.json" ;;
    noreuse-lazy)
      run noreuse_lazy 150 python3 scripts/bench_engine_offload.py "${model[@]}" \
        --scenario noreuse --repeat 9 --store-policy lazy --json "$OUT/noreuse_lazy.json" ;;
    noreuse-parts)  # bf16 0 % reuse with where each kind of step's time goes, off and on
      run noreuse_parts 200 python3 scripts/bench_engine_offload.py "${model[@]}" \
        --scenario noreuse --repeat "${REPEAT:-9}" --step-parts --json "$OUT/noreuse_parts.json" ;;
    noreuse-ahead)  # noreuse-parts with the engine's steps scheduled ahead (async scheduling)
      run noreuse_ahead 200 python3 scripts/bench_engine_offload.py "${model[@]}" \
        --scenario noreuse --repeat "${REPEAT:-9}" --step-parts --async-scheduling \
        --json "$OUT/noreuse_ahead.json" ;;
    noreuse-ahead-fp32)
      run noreuse_ahead_fp32 200 python3 scripts/bench_engine_offload.py "${model[@]}" \
        --scenario noreuse --repeat "${REPEAT:-9}" --dtype float32 --async-scheduling \
        --json "$OUT/noreuse_ahead_fp32.json" ;;
    noreuse-store-dma)  # noreuse-ahead with stores as 2D copies (no gather kernel) against
      # stores staged, each arm asked for explicitly, AB_ROUNDS processes each, alternating
      for r in $(seq "${AB_ROUNDS:-2}"); do
        for how in ${DMA_ARMS:-staged dma}; do
          extra=(--store "${how%%-*}")
          [ "$how" = dma-batch ] && extra+=(--pitched-batch)
          case $how in staged-[0-9]*) extra+=(--gather-ctas "${how#staged-}") ;; esac
          [ "${how%%-*}" = dma ] && [ -n "${DMA_MIN_RUN:-}" ] && extra+=(--store-min-run "$DMA_MIN_RUN")
          run "noreuse_store_$how$r" 200 python3 scripts/bench_engine_offload.py "${model[@]}" \
            --scenario noreuse --repeat "${REPEAT:-9}" --step-parts --async-scheduling \
            "${extra[@]}" --json "$OUT/noreuse_store_$how$r.json"
        done
      done ;;
    store-compute)  # a 4k-token step's GEMMs beside one store of its KV: staged, 2D DMA, one copy
      run store_compute 200 python3 scripts/bench_store_beside_compute.py \
        --gather-ctas "${GATHER_CTAS:-64,132,264}" --kv-heads "${KV_HEADS:-8}" \
        --json "$OUT/store_compute.json" ;;
    step-ahead)  # the decode step synchronous and scheduled ahead, bare and with the connector
      run decode_step_ahead 240 python3 scripts/bench_decode_step.py "${model[@]}" \
        --modes graphs graphs-ahead --offload --rounds "${AB_ROUNDS:-2}" \
        --shapes 1x1024,2x6400,8x2048,8x8192 --json "$OUT/decode_step_ahead.json" ;;
    noreuse-fp32)
      run noreuse_fp32 200 python3 scripts/bench_engine_offload.py "${model[@]}" \
        --scenario noreuse --repeat "${REPEAT:-9}" --dtype float32 --json "$OUT/noreuse_fp32.json" ;;
    noreuse-thread)
      run noreuse_thread 150 python3 scripts/bench_engine_offload.py "${model[@]}" \
        --scenario noreuse --repeat 9 --worker-loop thread --json "$OUT/noreuse_thread.json" ;;
    multiround)  # bf16, the dtype users serve in, is the headline; float32 beside it
      run multiround 300 python3 -m kvflow.cli bench "${model[@]}" "${multi[@]}" --step-parts \
        --json "$OUT/multiround.json" --plot "$OUT/multiround.png"
      run multiround_fp32 300 python3 -m kvflow.cli bench "${model[@]}" "${multi[@]}" \
        --dtype float32 --json "$OUT/multiround_fp32.json" ;;
    multiround-fence)  # kvflow bench's bf16 workload, loads never fenced vs fenced when idle
      for r in $(seq "${AB_ROUNDS:-2}"); do
        for fence in never idle; do
          run "multiround_fence_$fence$r" 150 python3 -m kvflow.cli bench "${model[@]}" \
            "${multi[@]}" --step-parts --fence-loads "$fence" \
            --json "$OUT/multiround_fence_$fence$r.json"
        done
      done ;;
    multiround-parts)  # that workload, fenced loads whole vs in LOAD_PARTS parts by layer
      for r in $(seq "${AB_ROUNDS:-2}"); do
        for parts in 1 ${LOAD_PARTS:-4}; do  # LOAD_PARTS may list several counts
          run "multiround_parts_$parts-$r" 150 python3 -m kvflow.cli bench "${model[@]}" \
            "${multi[@]}" --step-parts --load-parts "$parts" \
            --json "$OUT/multiround_parts_$parts-$r.json"
        done
      done ;;
    step-ab | multiround-ab)  # this tree against the base tree at BASE_SRC, alternating
      for r in $(seq "${AB_ROUNDS:-2}"); do
        for side in base new; do
          tree=src
          [ "$side" = base ] && tree=${BASE_SRC:-.base/src}
          if [ "$step" = step-ab ]; then
            run "decode_step_$side$r" 150 env PYTHONPATH="$site$tree" python3 \
              scripts/bench_decode_step.py "${model[@]}" --modes graphs --offload \
              --shapes 1x1024,2x6400,8x2048,8x8192 --json "$OUT/decode_step_$side$r.json"
          else
            run "multiround_$side$r" 150 env PYTHONPATH="$site$tree" python3 -m kvflow.cli \
              bench "${model[@]}" "${multi[@]}" --step-parts --json "$OUT/multiround_$side$r.json"
          fi
        done
      done ;;
    multiround-issue | multiround-trees | multiround-store | multiround-config)
      # multiround-issue: this tree's CUDA issue of a load's parts as it is, with
      # CudaConfig.pitched_parts off (one descriptor per block), and with defer_parts on (copies
      # of src/ with those defaults flipped); multiround-trees: each tree of TREES;
      # multiround-store: this tree with stores as 2D copies (store_dma on, DMA_MIN_RUN) against
      # staged (store_dma off), whatever the defaults.
      trees=${TREES:-new=src}
      if [ "$step" = multiround-store ]; then
        set_fields=(store_dma=True)
        [ -n "${DMA_MIN_RUN:-}" ] && set_fields+=("store_dma_min_run=$DMA_MIN_RUN")
        config_tree dma "${set_fields[@]}" && config_tree staged store_dma=False \
          || { status=1; continue; }
        trees="dma=/tmp/kvflow-dma/src staged=/tmp/kvflow-staged/src"
      fi
      if [ "$step" = multiround-config ]; then
        trees="as-is=src"
        for spec in ${CONFIGS:-}; do  # NAME:FIELD=VALUE,FIELD=VALUE
          IFS=, read -ra set_fields <<<"${spec#*:}"
          config_tree "${spec%%:*}" "${set_fields[@]}" || { status=1; continue 2; }
          trees+=" ${spec%%:*}=/tmp/kvflow-${spec%%:*}/src"
        done
      fi
      if [ "$step" = multiround-issue ]; then
        config_tree per-block pitched_parts=False && config_tree deferred defer_parts=True \
          || { status=1; continue; }
        trees="as-is=src per-block=/tmp/kvflow-per-block/src deferred=/tmp/kvflow-deferred/src"
      fi
      for r in $(seq "${AB_ROUNDS:-2}"); do
        for named in $trees; do
          run "multiround_${named%%=*}$r" 150 env PYTHONPATH="$site${named#*=}" python3 -m \
            kvflow.cli bench "${model[@]}" "${multi[@]}" --step-parts \
            --json "$OUT/multiround_${named%%=*}$r.json"
        done
      done ;;
    decode) run decode_attention 120 python3 scripts/bench_decode_attention.py ;;
    contention)
      run copy_contention 120 python3 scripts/bench_copy_contention.py \
        --json "$OUT/copy_contention.json" ;;
    connector)
      run connector_transfer 200 python3 scripts/bench_connector_transfer.py \
        --json "$OUT/connector_transfer.json"
      run connector_transfer_cross_staged 60 python3 scripts/bench_connector_transfer.py \
        --layouts cross --method staged --json "$OUT/connector_transfer_cross_staged.json" ;;
    calls)
      run driver_calls 120 python3 scripts/bench_driver_calls.py --json "$OUT/driver_calls.json" ;;
    connector-ab)
      run connector_ab 420 python3 scripts/bench_connector_fixed.py --device cuda \
        --base-src "${BASE_SRC:-.base/src}" --rounds "${AB_ROUNDS:-3}" --blocks 512 \
        --json "$OUT/connector_ab.json" ;;
    pdx)  # PD's one-GPU transport: scattered pages, one region and a block of 32 pages
      run pd_transports 150 python3 scripts/bench_pd_transports.py --device cuda \
        --transports cuda-ipc --mib 256 --pin --json "$OUT/pd_transports.json"
      run pd_transports_r32 150 python3 scripts/bench_pd_transports.py --device cuda \
        --transports cuda-ipc --mib 256 --regions 32 --pin --json "$OUT/pd_transports_r32.json"
      run pd_transports_r32_1g 200 python3 scripts/bench_pd_transports.py --device cuda \
        --transports cuda-ipc --mib 1024 --regions 32 --pin --sizes-kib 4 32 128 --json "$OUT/pd_transports_r32_1g.json" ;;
    gloo)  # PD's CPU transport on this host's cores (the dev box has two): the default 8 x 1 MiB
      # ring, and the old default 4 x 4 MiB beside it
      run pd_gloo 150 env CUDA_VISIBLE_DEVICES= python3 scripts/bench_pd_transfer.py \
        --sizes-kib 4 8 16 32 64 128 --repeat 11 --json "$OUT/pd_gloo.json"
      run pd_gloo_4x4 120 env CUDA_VISIBLE_DEVICES= python3 scripts/bench_pd_transfer.py \
        --sizes-kib 32 64 128 --repeat 11 --slots 4 --slot-mib 4 --json "$OUT/pd_gloo_4x4.json" ;;
    nixl)  # NIXL between the two processes' device memory beside kvflow's CUDA IPC; UCX's
      # cuda_ipc does GET only over NVLink unless told (a PCIe GPU), so both modes, cuda_ipc on
      run pd_transports_nixl 200 env UCX_TLS=cuda_ipc,cuda_copy,tcp,sm,self \
        UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y python3 scripts/bench_pd_transports.py --device cuda \
        --transports nixl cuda-ipc --mib 256 --regions 32 --sizes-kib 4 32 128 --repeat 3 \
        --json "$OUT/pd_transports_nixl_read.json"
      run pd_transports_nixl_write 200 env UCX_TLS=cuda_ipc,cuda_copy,tcp,sm,self \
        python3 scripts/bench_pd_transports.py --device cuda --transports nixl cuda-ipc \
        --mib 256 --regions 32 --sizes-kib 4 32 128 --repeat 3 --mode write \
        --json "$OUT/pd_transports_nixl_write.json" ;;
    pd)  # P and D as two processes on the one GPU against a colocated engine
      run bench_pd 300 python3 -m kvflow.cli bench "${model[@]}" "${multi[@]}" --pd \
        --pd-transport cuda-ipc --json "$OUT/bench_pd.json"
      run bench_pd_prefill 300 python3 -m kvflow.cli bench "${model[@]}" "${multi[@]}" --pd \
        --pd-transport cuda-ipc --pd-first-token prefill --json "$OUT/bench_pd_prefill.json"
      ;;
    pd-one)  # One user: P and D never compute at once, so the added TTFT is the hand-off's, not
      # the two processes time-slicing the GPU. Prompts of 2k-16k tokens (PD_PROMPTS: the first
      # question's tokens after a 1,024- or 2,048-token system prompt), first token P's and D's
      # (PD_FIRST), PD_ROUNDS rounds (default 6: the first computes the whole prompt, the rest hit
      # the prefix cache).
      for q in ${PD_PROMPTS:-1024 2048 6144 14336}; do
        sys=2048; [ "$q" -le 1024 ] && sys=1024
        for first in ${PD_FIRST:-prefill decode}; do
          run "bench_pd_one_${q}_$first" 120 python3 -m kvflow.cli bench "${model[@]}" \
            --users 1 --rounds "${PD_ROUNDS:-6}" --system "$sys" --first-question "$q" --question 256 \
            --answer 16 --cache-fraction 0.3 --max-batched-tokens 8192 --pd \
            --pd-transport cuda-ipc --pd-first-token "$first" \
            --json "$OUT/bench_pd_one_${q}_$first.json" \
            ${PD_TRACE:+--trace "$OUT/bench_pd_one_${q}_$first.trace.jsonl"}
        done
      done ;;
    tp)
      if [ "$gpus" -ge 2 ]; then
        run tp_tests 300 python3 -m pytest tests/distributed -q -p no:cacheprovider
        run bench_tp 480 python3 scripts/bench_tp.py "${model[@]}" "${multi[@]}" \
          --cpu-bytes 6GiB --repeat 1 --threads 8 --timeout 200 --json "$OUT/bench_tp.json"
      else
        echo "== tp: skipped, $gpus GPU(s) visible"
      fi ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
# One file back: the logs and every JSON, trace and plot the steps wrote.
(cd "$OUT" && shopt -s nullglob && made=(logs ./*.json ./*.jsonl ./*.png) \
  && tar czf bundle.tgz "${made[@]}" && rm -rf "${made[@]}")
exit $status
