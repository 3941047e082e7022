"""One headless task per production agent CLI with its default settings, against a running
endpoint (issue 67; `python -m experiments.agent_clis`).
"""
