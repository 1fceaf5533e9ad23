#!/usr/bin/env bash
# What a lent GPU runs, in one call (a session's device time is ~15 minutes, start-up included): the GPU tests, then
# grpokit vs TRL at the Qwen2.5-0.5B shape (`bench_vs_trl.py --config gpu`: 256 completions x 512 tokens per step),
# full fine-tuning with the benchmark's common settings, grpokit alone with its memory options, and LoRA.
#
#     bash benchmarks/gpu_session.sh OUTDIR [PART...]     # parts: tests static fair_static full lora qlora lora_grpokit lowmem fair bf16 bf16_static engines_static profile profile_static async async_ddp
#     STEPS=1 bash benchmarks/gpu_session.sh OUTDIR fair     # fewer measured steps (default 2, after 1 warm-up)
#     DEADLINE=540 TAR=$OUT/gpu.tgz bash benchmarks/gpu_session.sh /tmp/o tests fair_static   # the device tool's way
#
# DEADLINE (seconds from the start) shortens each part's limit so that the whole ends in time; TAR packs OUTDIR into
# one file after every part (the device tool brings back 8 files at most, and nothing that a killed command did not
# write before it was killed).
#
# Every part has its own time limit and writes its log (and JSON) to OUTDIR; a part that fails does not stop the
# next. Split the parts over two calls to look at the first results before the rest. Needs trl and datasets next to torch, transformers, accelerate and peft (`pip install -e '.[bench,peft]'`).
set -u
out="${1:?usage: gpu_session.sh OUTDIR [PART...]}"
shift
parts=("${@:-tests static fair_static full lora lowmem fair bf16 bf16_static profile}")
parts=(${parts[*]})
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, transformers, trl, peft, accelerate, datasets; print(sys.version.split()[0], 'torch',
torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__,
'accelerate', accelerate.__version__, 'datasets', datasets.__version__)"
  nproc
} > "$out/machine.txt" 2>&1

part() {  # part NAME SECONDS COMMAND...: one part, its own limit and log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS left=$(( ${DEADLINE:-100000} - SECONDS - 10 ))
  (( left < limit )) && limit=$left
  if (( limit < 30 )); then echo "$name: skipped (deadline)" | tee -a "$out/parts.txt"; return; fi
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s (limit $limit)" | tee -a "$out/parts.txt"
  [[ -n ${TAR:-} ]] && tar czf "$TAR" -C "$out" .
}

profile_static() {  # grpokit's step phases with the static cache (parts profile and profile_static)
  part profile_grpokit_static 200 python3 benchmarks/profile_step.py --config gpu --impl grpokit --warmup 1 --steps 1 \
    --args '{"cache_implementation": "static"}'
}

qlora_args='{"gradient_checkpointing": true, "model_init_kwargs": {"dtype": "bfloat16", "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"}}}'
bench=(python3 benchmarks/bench_vs_trl.py --config gpu --warmup 1 --steps "${STEPS:-2}" --repeats 1)
for p in "${parts[@]}"; do
  case $p in
    tests) part gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_memory.py tests/test_static_decoding.py ;;
    # Static decoding, cache_implementation="static" for both: TRL's generate() then compiles its forward on CUDA,
    # grpokit its decode step (CUDA graphs, rollout/static.py). The warm-up step takes the compilation. Compare with
    # `full` (the same settings with each library's default cache).
    static) part static 300 "${bench[@]}" --timeout 150 --out "$out/gpu_static.json" \
              --trl-args '{"cache_implementation": "static"}' --grpokit-args '{"cache_implementation": "static"}' ;;
    # The speed lever with the memory options: TRL as a user runs it (its default gradient checkpointing and cache)
    # against grpokit with `fair`'s memory options and the CUDA-graph decode step. Compare with `fair`.
    fair_static) part fair_static 260 "${bench[@]}" --timeout 140 --out "$out/gpu_fair_static.json" \
                   --trl-args '{"gradient_checkpointing": true}' \
                   --grpokit-args '{"ref_model_dtype": "bfloat16", "gradient_checkpointing": true, "activation_offloading": true, "optim": "adamw_8bit", "cache_implementation": "static"}' ;;
    # Full fine-tuning, the same settings for both (float32 weights, bf16 autocast, AdamW, no checkpointing).
    full) part full 250 "${bench[@]}" --timeout 120 --out "$out/gpu_full.json" ;;
    # LoRA (r=16, all linear layers), gradient checkpointing for both (TRL's default).
    lora) part lora 230 "${bench[@]}" --lora --timeout 110 --out "$out/gpu_lora.json" \
            --trl-args '{"gradient_checkpointing": true}' --grpokit-args '{"gradient_checkpointing": true}' ;;
    # QLoRA (NF4 base, bf16 compute; bitsandbytes' CUDA wheel) against TRL's LoRA on its float32 base, then against
    # TRL's QLoRA (the same quantization_config): issue 16's LoRA memory target (0.25x TRL's LoRA) on a GPU, where
    # the imports' host memory does not count. Not run yet.
    qlora) part qlora 230 "${bench[@]}" --lora --timeout 110 --out "$out/gpu_qlora.json" \
             --trl-args '{"gradient_checkpointing": true}' --grpokit-args "$qlora_args"
           part qlora_vs_trl_qlora 230 "${bench[@]}" --lora --timeout 110 --out "$out/gpu_qlora_vs_trl_qlora.json" \
             --trl-args "$qlora_args" --grpokit-args "$qlora_args" ;;
    lora_grpokit) part lora_grpokit 130 "${bench[@]}" --lora --impls grpokit --timeout 110 --out "$out/gpu_lora_grpokit.json" \
                    --grpokit-args '{"gradient_checkpointing": true}' ;;
    # grpokit alone with its memory options (compare with the TRL run of `full`, same machine).
    lowmem) part full_lowmem 120 "${bench[@]}" --impls grpokit --timeout 100 --out "$out/gpu_full_lowmem.json" \
              --grpokit-args '{"ref_model_dtype": "bfloat16", "gradient_checkpointing": true, "activation_offloading": true}' ;;
    # TRL with its default gradient checkpointing against grpokit with its memory options and 8-bit AdamW states
    # (bitsandbytes): the memory comparison a TRL user would make.
    fair) part fair 250 "${bench[@]}" --timeout 120 --out "$out/gpu_fair.json" \
            --trl-args '{"gradient_checkpointing": true}' \
            --grpokit-args '{"ref_model_dtype": "bfloat16", "gradient_checkpointing": true, "activation_offloading": true, "optim": "adamw_8bit"}' ;;
    # grpokit's lightest full fine-tuning (bf16 weights, torchao's 8-bit AdamW with stochastic rounding, an int8
    # reference, checkpointing, offloading) against TRL's default: needs the torchao wheel too; not run yet.
    bf16) part bf16 250 "${bench[@]}" --timeout 120 --out "$out/gpu_bf16.json" \
            --trl-args '{"gradient_checkpointing": true}' \
            --grpokit-args '{"model_init_kwargs": {"dtype": "bfloat16"}, "optim": "adamw_torch_8bit", "optim_args": "bf16_stochastic_round=True", "ref_model_dtype": "int8", "gradient_checkpointing": true, "activation_offloading": true}' ;;
    # `bf16` with the CUDA-graph decode step, grpokit alone (against `fair_static`'s TRL run, same machine).
    bf16_static) part bf16_static 160 "${bench[@]}" --impls grpokit --timeout 150 --out "$out/gpu_bf16_static.json" \
                   --grpokit-args '{"model_init_kwargs": {"dtype": "bfloat16"}, "optim": "adamw_torch_8bit", "optim_args": "bf16_stochastic_round=True", "ref_model_dtype": "int8", "gradient_checkpointing": true, "activation_offloading": true, "cache_implementation": "static"}' ;;
    profile_static) profile_static ;;
    # Rollouts alone (bench_engines.py): each library's default decoder and its static cache (TRL's generate compiles
    # its forward; grpokit records CUDA graphs), the same 256 x 512 tokens: the open question after `fair_static`.
    engines_static) part engines_static 300 python3 benchmarks/bench_engines.py --config gpu-0.5b \
                      --engines hf hf-static trl trl-static --out "$out/gpu_engines_static.json" ;;
    # Where each library's step goes on the GPU (rollout, its forwards, reference, policy, backward, optimizer):
    # the first GPU session estimated, without timing it, that the decode loop is most of the step.
    profile) part profile_grpokit 150 python3 benchmarks/profile_step.py --config gpu --impl grpokit --warmup 1 --steps 1
             part profile_trl 150 python3 benchmarks/profile_step.py --config gpu --impl trl --warmup 1 --steps 1
             profile_static ;;
    # Asynchronous generation (max_staleness=1) against the synchronous loop on one GPU: the producer's copy of the
    # policy samples in a thread while the trainer trains (a larger tiny model than the CPU run's).
    async) part async 240 bash -c "python3 benchmarks/async_overlap.py --hidden 1024 --layers 8 --batch 64 \
             --completion 128 --steps 12 --repeats 1 --name gpu && cp benchmarks/results/async_overlap_gpu.json '$out/'" ;;
    # The same against the synchronous loop in several training processes (DDP, one per GPU): one producer per
    # process, gathering on a process group of its own. On a one-GPU machine: NPROC=2 ASYNC_DDP_ARGS="--ddp-backend
    # gloo" puts two processes on it (NCCL takes one process per GPU).
    async_ddp) part async_ddp 300 bash -c "python3 -m torch.distributed.run --nproc_per_node \${NPROC:-\$(nvidia-smi -L | wc -l)} \
                 benchmarks/async_distributed.py --hidden 1024 --layers 8 --batch 64 --completion 128 --steps 12 \
                 --name gpu \${ASYNC_DDP_ARGS:-} && cp benchmarks/results/async_distributed_gpu.json '$out/'" ;;
    *) echo "unknown part $p (tests static fair_static full lora qlora lora_grpokit lowmem fair bf16 bf16_static engines_static profile profile_static async async_ddp)"; exit 2 ;;
  esac
done
