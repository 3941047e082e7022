"""Does training the whole trace beat training the main agent only? The ablation of the main
job over seeds (issues 18, 38; `python -m experiments.whole_trace`) and its analysis, fixed
before the runs.
"""
