"""BERT pretraining recipe: masked language modelling (and optional next-sentence prediction)."""
