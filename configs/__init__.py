"""The shipped recipes (YAML), installed as the package `compress.recipes` so `compress run -c cifar10` finds
them from any folder: `compress config --list` names them."""
