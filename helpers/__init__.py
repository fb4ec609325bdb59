"""What a first reading of the numbered scripts skips: the tiny model and its tokenizer (model.py), batching and
the exact speed-ups (batches.py). The scripts import from here; nothing here imports a script."""
