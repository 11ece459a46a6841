"""Data: the dataset registry (`registry`, torch-free so the config can check names), the loaders
(`datasets.load_data`, `builtin`, `imagefolder`), image sets served a batch at a time (`imageset`),
reproducible augmentation and mixing (`transforms`), and which samples each process takes (`sampling`).

May import: compress.errors, compress.fileio, compress.deploy.imageio (the one eval-time image rule),
compress.training.distributed and .interrupt (the pixel cache is built by every process, inside functions), torch,
torchvision."""
