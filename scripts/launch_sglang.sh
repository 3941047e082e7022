#!/usr/bin/env bash
# Launches an SGLang server for SGLangSampler (CUDA GPU machines only).
#
#   MODEL_PATH=/path/to/hf_dir scripts/launch_sglang.sh [extra sglang flags...]
#
# Environment (defaults in brackets):
#   MODEL_PATH      HF model directory or hub id (required); for a trained
#                   policy, an export written by ac2_jax.models.io.hf_io.save_hf_checkpoint
#   WEIGHT_VERSION [0]  --weight-version: the policy version of MODEL_PATH; give
#                   SGLangSampler the same policy_version. SGLang reports it in
#                   every /generate answer and /get_model_info, and a restart
#                   brings it back: that is how the client notices a restart
#                   and re-publishes its current weights.
#   TOKENIZER_PATH  tokenizer directory [MODEL_PATH]
#   HOST [127.0.0.1]  PORT [30000]
#   TP [1]          tensor-parallel size (--tp-size)
#   DP [1]          data-parallel replicas (--dp-size)
#   CONTEXT_LENGTH  max tokens per sequence (--context-length) [model default];
#                   SGLang refuses input + max_new_tokens >= it, the client
#                   reads it from /v1/models (max_model_len)
#   MEM_FRACTION    --mem-fraction-static [SGLang default]
#   DTYPE [auto]    --dtype
#   API_KEY         --api-key (clients then send Authorization: Bearer $API_KEY)
#   DETERMINISTIC   1 = --enable-deterministic-inference (needed for per-request seeds)
#
# Log-probs: --enable-fp32-lm-head is always on, so logits and log-probs are
# fp32 (the Sampler protocol's contract; without it they are rounded to the
# model dtype, e.g. bf16). SGLang's default log-probs are log_softmax(logits / temperature):
# the behaviour log-probs the RL losses expect (SGLangSampler refuses top-k /
# top-p, which SGLang applies after them), so SGLANG_RETURN_ORIGINAL_LOGPROB is
# unset. Do not pass --incremental-streaming-output (the client reads the
# default cumulative stream chunks) nor --allow-auto-truncate (a prompt that
# does not fit must be refused, not silently cut). An SGLang too old to know
# --enable-fp32-lm-head or --weight-version refuses to start. Point ac2_jax at it with
#   SGLangSampler("http://$HOST:$PORT", max_context=..., model=..., publish_dir=...,
#                 export_dir=..., policy_version=$WEIGHT_VERSION, max_concurrency=...)
# (export_dir must be readable by this server: weights reach it through
# /update_weights_from_disk).
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH to an HF model directory}"
unset SGLANG_RETURN_ORIGINAL_LOGPROB
args=(--model-path "$MODEL_PATH"
      --tokenizer-path "${TOKENIZER_PATH:-$MODEL_PATH}"
      --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}"
      --tp-size "${TP:-1}" --dp-size "${DP:-1}"
      --dtype "${DTYPE:-auto}"
      --enable-fp32-lm-head
      --weight-version "${WEIGHT_VERSION:-0}")
[ -n "${CONTEXT_LENGTH:-}" ] && args+=(--context-length "$CONTEXT_LENGTH")
[ -n "${MEM_FRACTION:-}" ] && args+=(--mem-fraction-static "$MEM_FRACTION")
[ -n "${API_KEY:-}" ] && args+=(--api-key "$API_KEY")
[ "${DETERMINISTIC:-0}" = "1" ] && args+=(--enable-deterministic-inference)
exec "${PYTHON:-python}" -m sglang.launch_server "${args[@]}" "$@"
