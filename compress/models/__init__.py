"""Models: the registry (`registry`: names -> builders, `build_model`), its architectures, torchvision and
users' own models (`sources`), users' weight files (`weights`), and hidden features by layer name
(`features`).

May import: compress.errors, torch, torchvision."""
