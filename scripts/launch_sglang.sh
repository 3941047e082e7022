#!/usr/bin/env bash
# Launches an SGLang server for SGLangSampler (CUDA GPU machines only).
#
#   MODEL_PATH=/path/to/hf_dir scripts/launch_sglang.sh [extra sglang flags...]
#
# Environment (defaults in brackets):
#   MODEL_PATH      HF model directory or hub id (required); for a trained
#                   policy, an export written by ac2_jax.models.hf_io.save_hf_checkpoint
#   TOKENIZER_PATH  tokenizer directory [MODEL_PATH]
#   HOST [127.0.0.1]  PORT [30000]
#   TP [1]          tensor-parallel size (--tp-size)
#   DP [1]          data-parallel replicas (--dp-size)
#   CONTEXT_LENGTH  max tokens per sequence (--context-length) [model default]
#   MEM_FRACTION    --mem-fraction-static [SGLang default]
#   DTYPE [auto]    --dtype
#   API_KEY         --api-key (clients then send Authorization: Bearer $API_KEY)
#   DETERMINISTIC   1 = --enable-deterministic-inference (needed for per-request seeds)
#
# SGLang's default log-probs are log_softmax(logits / temperature): the
# behaviour log-probs the ac2_jax Sampler protocol and the RL losses expect
# (SGLangSampler refuses top-k / top-p, which SGLang applies after them).
# SGLANG_RETURN_ORIGINAL_LOGPROB is therefore unset here. Point ac2_jax at it with
#   SGLangSampler("http://$HOST:$PORT", max_context=..., model=..., publish_dir=..., export_dir=...)
# (export_dir must be readable by this server: weights reach it through
# /update_weights_from_disk).
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH to an HF model directory}"
unset SGLANG_RETURN_ORIGINAL_LOGPROB
args=(--model-path "$MODEL_PATH"
      --tokenizer-path "${TOKENIZER_PATH:-$MODEL_PATH}"
      --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}"
      --tp-size "${TP:-1}" --dp-size "${DP:-1}"
      --dtype "${DTYPE:-auto}")
[ -n "${CONTEXT_LENGTH:-}" ] && args+=(--context-length "$CONTEXT_LENGTH")
[ -n "${MEM_FRACTION:-}" ] && args+=(--mem-fraction-static "$MEM_FRACTION")
[ -n "${API_KEY:-}" ] && args+=(--api-key "$API_KEY")
[ "${DETERMINISTIC:-0}" = "1" ] && args+=(--enable-deterministic-inference)
exec "${PYTHON:-python}" -m sglang.launch_server "${args[@]}" "$@"
