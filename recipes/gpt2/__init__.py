"""GPT-2 pretraining recipe: causal language modelling with the real GPT-2 BPE."""
