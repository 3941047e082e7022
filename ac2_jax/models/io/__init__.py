"""Weight I/O: model weights in and out of this library's models (an HF checkpoint's
config builds a registered family's model; a family with tensors of its own, Qwen3-MoE's
experts, reads them with `hf_io`'s helpers). Nothing here is a model or a kernel.
`ac2_jax.models` exports what a user calls (`load_hf_checkpoint`, `save_hf_checkpoint`,
`save_params`, `restore_params`, `load_published`, `publish_weights`, `latest_published`);
import the rest from its module.

- `hf_io`: an HF checkpoint (`config.json` + safetensors) <-> a model of a registered
  family (`load_hf_checkpoint`, `save_hf_checkpoint`; no torch).
- `params_io`: Orbax I/O of params (`save_params`, `restore_params`) and the learner ->
  sampler publish protocol (`publish_weights`, `load_published`, `latest_published`,
  `weights_checksum`).
- `peft_io`: LoRA adapters in PEFT's format (`save_peft_adapter`, `load_peft_adapter`),
  `add_lora`, `merge_lora`, and the serving bank's slots (`write_slot`).
"""
