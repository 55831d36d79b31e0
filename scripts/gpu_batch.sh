#!/usr/bin/env bash
# Runs named GPU steps one after another on the lent machine, each under its own time limit,
# and packs everything they wrote into ${OUT}/results.tgz (the device tool brings back few files).
#   bash scripts/gpu_batch.sh STEP [STEP ...]     steps: see the case below
# Every step writes under $R; the log of each is $R/<step>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}; R=$OUT/r; mkdir -p "$R"
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The lent machine's copy of .git can be older than the working tree it runs: pass the commit.
export FLOWEXEC_COMMIT=${FLOWEXEC_COMMIT:-"unknown (FLOWEXEC_COMMIT not set; the device's git read $(git rev-parse --short HEAD 2>/dev/null))"}
pack() { tar -czf "$OUT/results.tgz" -C "$R" . 2>/dev/null; }
trap pack EXIT
run_step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc $((SECONDS - t0))s :: $(grep -E 'passed|failed|error|Error' "$R/$name.log" | tail -2 | tr '\n' ' ' | cut -c1-300)"
  pack  # (after each step: a call cut off at its limit still brings back the steps it finished)
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])"
python3 -m flowexec.runtime.build_native 2>&1 | tail -1  # the native call check (~20 s, once)
for step in "$@"; do
  case $step in
    tests-new) run_step $step 330 python3 -m pytest -q -rfE -p no:cacheprovider $(ls tests/gpu/test_calling_gpu.py \
                 tests/gpu/test_streams_gpu.py tests/gpu/test_memory_gpu.py tests/gpu/test_pipeline_gpu.py \
                 tests/gpu/test_core_gpu.py tests/gpu/test_profiler_gpu.py tests/gpu/test_borrowed_gpu.py 2>/dev/null) --junitxml="$R/$step.xml" ;;
    tests-all) run_step $step 480 python3 -m pytest -q -rfE -p no:cacheprovider -p no:logging tests/gpu --junitxml="$R/$step.xml" ;;
    sanitizer) TORCH_CUDA_SANITIZER=1 run_step $step 200 python3 -m pytest -q -rfE -p no:cacheprovider \
                 tests/gpu/test_streams_gpu.py tests/gpu/test_core_gpu.py \
                 -k "(trace or dropped or threaded) and not graph and not hf and not copy_heavy" ;;
    debug)     FLOWEXEC_DEBUG=1 run_step $step 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_streams_gpu.py ;;
    calling)   run_step $step 200 python3 benchmarks/step_time.py --calling --out "$R" ;;
    training)  run_step $step 330 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_training_gpu.py \
                 --junitxml="$R/$step.xml" ;;  # issue 37: the training loops in graph mode
    schedule)  run_step $step 240 python3 benchmarks/schedule.py --out "$R" ;;  # OneCycleLR, 1,000 graph-mode steps
    schedule-gaps) run_step $step 180 python3 benchmarks/probes/schedule_gaps.py --out "$R" ;;  # where its extra µs go
    schedule-cf) run_step $step 240 python3 benchmarks/schedule.py --constant-first --out "$R/cf" ;;  # capture order swapped
    schedule-primed) run_step $step 240 bash -c "python3 benchmarks/schedule.py --prime --out '$R/primed' && python3 benchmarks/schedule.py --prime --constant-first --out '$R/primed_cf'" ;;  # neither timed graph is the first captured
    schedule-gaps-cf) run_step $step 180 python3 benchmarks/probes/schedule_gaps.py --constant-first --out "$R/cf" ;;
    schedule-gaps-prime) run_step $step 180 python3 benchmarks/probes/schedule_gaps.py --prime --out "$R/prime" ;;
    scale-llama-peers) run_step $step 400 python3 benchmarks/scale.py --models llama_207m \
                 --variants eager,inductor,fx_graph_fused --no-warm --timeout 240 -o "$R/scale_llama_207m.json" ;;
    scale-gpt2-pair) run_step $step 200 python3 benchmarks/scale.py --models gpt2_124m \
                 --variants inductor,fx_graph_fused --no-warm --timeout 150 -o "$R/scale_gpt2_124m_pair.json" ;;  # the step against torch.compile alone, cold builds
    scale-gpt2-peers) run_step $step 300 python3 benchmarks/scale.py --models gpt2_124m \
                 --variants eager,inductor,fx_graph_fused --no-warm --timeout 200 -o "$R/scale_gpt2_124m.json" ;;
    first-graph) run_step $step 240 bash -c "python3 benchmarks/probes/first_graph.py --out '$R/fg' && \
                 python3 benchmarks/probes/first_graph.py --no-stage-in-graph --out '$R/fg_python' && \
                 python3 benchmarks/probes/first_graph.py --touch-bindings --out '$R/fg_touch'" ;;  # the memcpy32_post graph
    item)      run_step $step 120 python3 benchmarks/item.py --user-loop --out "$R/item.json" ;;
    streams)   run_step $step 240 python3 benchmarks/streams.py --out "$R" ;;
    memory)    run_step $step 90 python3 benchmarks/memory.py --out "$R" ;;
    jobs)      run_step $step 240 python3 benchmarks/pipeline_jobs.py --out "$R" ;;
    probe)     run_step $step 120 python3 benchmarks/timer_probe.py --out "$R" ;;
    proftests) run_step $step 90 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_profiler_gpu.py ;;
    profiler)  run_step $step 300 python3 benchmarks/profiler_overhead.py --out "$R/profiler_overhead_gpu.json" ;;
    scale-gpt2_124m|scale-resnet50|scale-llama_207m)  # issue 36: one model's variants, each in a fresh
               run_step $step 590 python3 benchmarks/scale.py --models "${step#scale-}" --timeout 200 \
                 -o "$R/scale_${step#scale-}.json" ;;  # process; then scale.py --merge into scale.json
    scale-gpt2-builds) run_step $step 300 python3 benchmarks/scale.py --models gpt2_124m --variants inductor,fx_graph_fused \
                 --timeout 200 -o "$R/scale_gpt2_124m_builds.json" ;;  # cold and warm builds against torch.compile's, steps too
    scale-gpt2-builds-kept) FLOWEXEC_KEEP=1 run_step $step 300 python3 benchmarks/scale.py --models gpt2_124m \
                 --variants inductor,fx_graph_fused --timeout 200 -o "$R/scale_gpt2_124m_builds_kept.json" ;;  # the warm build loading its kept program
    fuse-workers-tests) run_step $step 240 python3 -m pytest -q -rfE -p no:cacheprovider -p no:logging tests/gpu/test_fuse_gpu.py \
                 tests/gpu/test_compile_workers_gpu.py --junitxml="$R/$step.xml" ;;
    prepin-overlap) run_step $step 150 python3 benchmarks/probes/prepin_overlap.py --out "$R" ;;  # pinning on a thread beside tracing
    profile-warm-gpt2) SCALE_PROFILE_DIR="$R" run_step $step 240 python3 benchmarks/scale.py --models gpt2_124m \
                 --variants fx_graph_fused --profile-warm --timeout 200 -o "$R/scale_gpt2_124m_profiled.json" ;;  # the warm first call under cProfile
    profile-warm-gpt2-kept) mkdir -p "$R/kept"; FLOWEXEC_KEEP=1 SCALE_PROFILE_DIR="$R/kept" run_step $step 240 python3 benchmarks/scale.py \
                 --models gpt2_124m --variants fx_graph_fused --profile-warm --timeout 200 \
                 -o "$R/scale_gpt2_124m_profiled_kept.json" ;;  # the same, loading its kept program
    scale-gpt2-builds-pyc) export PYTHONPYCACHEPREFIX=/tmp/flowexec_pyc  # bytecode for every module first, as pip
               # writes it (with a prefix Python reads none from __pycache__: the standard library, site-packages, here)
               run_step pyc-compile 300 bash -c 'd=$(python3 -c "import site, sysconfig; \
                 print(sysconfig.get_paths()[\"stdlib\"], *site.getsitepackages())") && test -n "$d" && \
                 python3 -m compileall -q -j 0 $d flowexec benchmarks' ;
               run_step $step 300 python3 benchmarks/scale.py --models gpt2_124m --variants inductor,fx_graph_fused \
                 --timeout 200 -o "$R/scale_gpt2_124m_builds_pyc.json"; unset PYTHONPYCACHEPREFIX ;;
    regress-quick) run_step $step 240 python3 benchmarks/step_time.py --only mlp,hf --hf-backends eager,cudagraphs,flowexec_graph \
                 --n 200 --out "$R" ;;  # issue 36's "nothing slower": MLP 8x256 graph vs eager, GPT-2 tiny backend vs cudagraphs
    scale-gpt2-fused) run_step $step 300 python3 benchmarks/scale.py --models gpt2_124m --variants fx_graph_fused \
                 --timeout 200 -o "$R/scale_gpt2_124m_fused.json" ;;  # the fused graph step alone, cold and warm (default workers)
    scale-gpt2-prefill) SCALE_FIRST_STEP=prefill run_step $step 420 python3 benchmarks/scale.py --models gpt2_124m \
                 --variants eager,inductor,fx_graph_fused --timeout 200 -o "$R/scale_gpt2_124m_prefill.json" ;;  # first_step="prefill", torch.compile beside it
    prefill-tests) run_step $step 200 python3 -m pytest -q -rfE -p no:cacheprovider -p no:logging tests/gpu/test_prefill_gpu.py \
                 tests/test_prefill.py --junitxml="$R/$step.xml" ;;
    prefill-peak) run_step $step 200 bash -c "python3 benchmarks/probes/prefill_peak.py --first-step planned --out '$R' && \
                 python3 benchmarks/probes/prefill_peak.py --first-step prefill --out '$R'" ;;  # what the prefilled first call holds at its peak
    fuse-tests) run_step $step 330 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_fuse_gpu.py \
                 --junitxml="$R/$step.xml" ;;
    kept-tests) run_step $step 300 python3 -m pytest -q -rfE -p no:cacheprovider -p no:logging tests/gpu/test_kept_gpu.py \
                 tests/test_kept.py --junitxml="$R/$step.xml" ;;  # kept programs: graph mode, fused, across processes
    bundle-tests) run_step $step 300 python3 -m pytest -q -rfE -p no:cacheprovider -p no:logging \
                 tests/gpu/test_bundled_kernels_gpu.py --junitxml="$R/$step.xml" ;;  # a warm build's kernels from the cold one's entries
    bundles) run_step $step 200 python3 benchmarks/probes/bundles.py --out "$R/bundles" ;;  # what a fused build's cache entries bundle
    kept-warm) run_step $step 400 python3 benchmarks/probes/kept_warm.py --device cuda --layers 12 --batch 8 --seq 1024 \
                 --rounds 2 --fuse --out "$R" ;;  # warm first calls with and without kept programs, alternating
    kept-warm-quick) run_step $step 170 python3 benchmarks/probes/kept_warm.py --device cuda --layers 12 --batch 8 --seq 1024 \
                 --rounds 1 --fuse --out "$R" ;;  # one warm first call with and one without the kept program (and its replay)
    memtests)  run_step $step 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_memory_gpu.py \
                 --junitxml="$R/$step.xml" ;;
    build-peak) run_step $step 300 python3 benchmarks/probes/build_peak.py --out "$R" ;;  # what is alive at the build's peak
    peak-resnet50) run_step $step 300 python3 benchmarks/scale.py --models resnet50 --variants eager,fx_graph_fused \
                 --timeout 200 -o "$R/scale_resnet50_peak.json" ;;  # issue 36's memory figure (and warm build)
    warm-build) run_step $step 420 python3 benchmarks/probes/warm_build.py --models resnet50,gpt2_124m --sample \
                 --out "$R" ;;  # issue 36's warm build, phases and sampled stacks (results/probes/warm_build_*)
    warm-build-fake) run_step $step 420 python3 benchmarks/probes/warm_build.py --models gpt2_124m,resnet50 \
                 --settings "FLOWEXEC_FAKE_CAPTURE=1;FLOWEXEC_FAKE_CAPTURE=0" --sample --out "$R/fake" ;;  # fake capture against real
    warm-build-gpt2) run_step $step 300 python3 benchmarks/probes/warm_build.py --models gpt2_124m \
                 --settings 'FLOWEXEC_FAKE_CAPTURE=1' --sample --out "$R/fx" ;;  # flowexec's, fake capture (peers: warm-build-peers)
    # The CUDA tests in two halves, each within a call (the whole took more than 480 s on an H100).
    # (-p no:logging: pytest's log capture turned on torch's structured trace logs, which render graphs)
    tests-1)   run_step $step 400 python3 -m pytest -q -rfE -p no:cacheprovider -p no:logging \
                 $(ls tests/gpu/test_[a-l]*.py) --junitxml="$R/$step.xml" ;;
    tests-2)   run_step $step 400 python3 -m pytest -q -rfE -p no:cacheprovider -p no:logging \
                 $(ls tests/gpu/test_[m-z]*.py) tests/test_guards.py --junitxml="$R/$step.xml" ;;
    fake-vs-real) run_step $step 300 python3 benchmarks/probes/fake_vs_real.py --device cuda \
                 --out "$R" ;;  # the ops a fake capture's program runs that a real one's does not (and back)
    workers) run_step $step 200 python3 -m pytest -q -rA -p no:cacheprovider -p no:logging -W always \
                 tests/gpu/test_compile_workers_gpu.py ;;  # whether (and why not) the compile workers compile on CUDA
    cold-workers-gpt2) run_step $step 420 bash -c "FLOWEXEC_COMPILE_PROCESSES=0 python3 benchmarks/probes/warm_build.py \
                 --models gpt2_124m --sample --out '$R/cw0' && FLOWEXEC_COMPILE_PROCESSES=auto python3 benchmarks/probes/warm_build.py \
                 --models gpt2_124m --sample --out '$R/cwauto'" ;;  # cold and warm builds without and with compile workers (each call sampled)
    warm-build-peers) run_step $step 300 python3 benchmarks/probes/warm_build.py --models resnet50,gpt2_124m \
                 --variant inductor --out "$R/peers" ;;  # torch.compile's warm build in the same run
    recompute-peak) run_step $step 400 python3 benchmarks/probes/recompute_peak.py --model gpt2_124m --batch 8 \
                 --seq 1024 --mode graph --out "$R" ;;  # recompute off/on: planned and measured peaks, losses
    sweep)     run_step $step 560 python3 benchmarks/probes/model_sweep.py --device cuda --variants trace,graph,graph_fused,backend_graph \
                 --out "$R" ;;  # models no issue names: eager against flowexec, every parameter
    sweep-graph) run_step $step 300 python3 benchmarks/probes/model_sweep.py --device cuda --variants graph,graph_fused \
                 --out "$R" ;;  # models no issue names in graph mode, fused and not (~150 s on an H100)
    capture-cost) run_step $step 200 python3 benchmarks/probes/capture_cost.py --device cuda \
                 --out "$R" ;;  # flowexec's capture against make_fx's own and a fake run (issue 36: the warm build)
    rnn-tests) run_step $step 200 python3 -m pytest -q -rfE -p no:cacheprovider -p no:logging \
                 tests/gpu/test_core_gpu.py -k recurrent --junitxml="$R/$step.xml" ;;  # cuDNN's GRU and LSTM captured
    sweep-trace) run_step $step 400 python3 benchmarks/probes/model_sweep.py --device cuda --variants trace,backend_graph \
                 --out "$R" ;;  # models no issue names in trace mode and through the backend
    stream-tests) run_step $step 200 python3 -m pytest -q -rfE -p no:cacheprovider -p no:logging \
                 tests/gpu/test_random_stream_gpu.py tests/gpu/test_streams_gpu.py --junitxml="$R/$step.xml" ;;  # the refused capture's stream put back
    backend-bert) run_step $step 300 python3 benchmarks/probes/model_sweep.py --device cuda --cases bert \
                 --variants backend,backend_graph,backend_graph_nofuse,backend_graph_nopad --out "$R/backend_bert" ;;  # BERT's
                 # backend_graph mismatch: trace or graph, fusion, padding; each step's losses and the states off
    backend-t5) FLOWEXEC_PLAN_DIR="$R/plans" run_step $step 200 python3 -X faulthandler benchmarks/probes/model_sweep.py \
                 --device cuda --cases t5 --variants backend_graph,backend_graph_nofuse --out "$R/backend_t5" ;;  # the seeds fix
    sdpa-choice) run_step $step 240 bash -c "python3 benchmarks/probes/sdpa_choice.py --device cuda --cases bert,t5 --out '$R' && \
                 python3 benchmarks/probes/model_sweep.py --device cuda --cases bert --variants aot_eager,backend \
                 --out '$R/peer_bert'" ;;  # eager's attention kernel against the traced one; torch.compile's own trace against eager
    backend-errs) run_step $step 240 python3 benchmarks/probes/model_sweep.py --device cuda --cases bart,mistral,checkpointed_dropout \
                 --variants backend_graph --out "$R/backend_errs" ;;  # sweep-trace's three ERRs at 09881a3, after the fallbacks
    seeds-tests) run_step $step 120 python3 -m pytest -q -rfE -p no:cacheprovider -p no:logging \
                 tests/gpu/test_random_stream_gpu.py -k attention --junitxml="$R/$step.xml" ;;  # attention's dropout seeds
    random-stream-tests) run_step $step 200 python3 -m pytest -q -rfE -p no:cacheprovider -p no:logging \
                 tests/gpu/test_random_stream_gpu.py tests/gpu/test_training_gpu.py --junitxml="$R/$step.xml" ;;
    regress)   run_step $step 400 python3 benchmarks/step_time.py --only mlp,hf --out "$R" ;;  # fusion on by default
    pipeline-cpu) CUDA_VISIBLE_DEVICES= run_step $step 560 python3 benchmarks/pipeline_gloo.py --rounds 4 \
                 --out "$R/pipeline_gloo_h200host.json" ;;  # the gloo benchmark on the lent host's 16 cores
    *) echo "unknown step $step" ;;
  esac
done
