"""What a first reading of the numbered scripts skips: the tiny model, its tokenizer, LoRA and the loader of the
shipped bases (model.py), batching, sampling and the exact speed-ups (batches.py), run management: checkpoints,
adapter export, logs (runs.py), the command line (cli.py), the analysis figures (plots.py) and the results
pipeline's log reading and summary / table writing (report.py). The scripts import from here; nothing here imports
a script."""
