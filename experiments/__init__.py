"""The lab bench's studies, one folder each (the library is `ac2_jax`; benchmarks are in
`benchmarks/`). Each folder's `__init__` says what it studies and how it runs:

- `calculator/`: The main job
- `whole_trace/`: Does training the whole trace beat training the main agent only? The ablation of the main job over seeds
- `pinapple/`: Self-distillation on the pinapple task
- `opd_teacher/`: On-policy distillation from a bigger teacher vs RL at the same budget
- `turn_credit/`: Per-turn credit vs the final reward alone on a two-turn toy env
- `agent_clis/`: One headless task per production agent CLI with its default settings, against a running endpoint
- `rg_mix/`: Many domains adaptively mixed
- `rl_split/`: The RL job as separate processes
- `real_size/`: Real-size models without a download
- `attention_tpu_aot/`: The TPU attention kernel compiled ahead of time for a TPU topology on a CPU host, at a real model's attention shape
"""
