"""Distillation: the logit losses (`logit_losses`: Hinton KD, DKD, DIST, standardized), the feature losses
(`feature_losses`: cosine, FitNets hint), the frozen teacher and the student with its regressor (`teacher`),
and the on-disk teacher-output store (`store`).

May import: compress.errors, compress.fileio, compress.training, compress.models, torch, numpy."""
