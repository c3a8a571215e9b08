"""A synthetic run's product: the verified dataset (docs/synthetic.md).

sources.py finds the accepted files (a trusted validator's signed verdict, the file's own bytes and signature),
rows.py turns their rows into dataset rows, difficulty.py computes pass@k per task and model, subsets.py
derives the SFT and preference-pair subsets, card.py writes the dataset card, build.py ties them together.
"""
