"""Self-distillation on the pinapple task: SFT vs OPSD vs RMSD (issue 39; `python -m
experiments.pinapple --config=experiments/pinapple/config.py`), the base alone
(`experiments.pinapple.base`), the LLM judge (`experiments.pinapple.judge`) and the report.
"""
