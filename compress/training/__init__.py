"""Training: the plain loop (`loop`: fit, train_one_epoch, evaluate, Session), schedules and optimizers,
precision and memory layout, the label loss, the one DDP code path (`distributed`), checkpoints in safetensors
+ JSON (`checkpoint`), stop requests (`interrupt`) and the progress bar.

May import: compress.errors, compress.fileio, compress.models, torch. Never compress.run: the
loop knows nothing of run directories or configs."""
