"""Code shared by the GPT-2 and BERT recipes: corpora, tokenizers, the token cache, optimizers, FLOPs."""
