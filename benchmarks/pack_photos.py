"""A copy of an image-folder dataset small enough to travel to a GPU machine (this workplace sends at most 64 MiB),
as one uncompressed zip: training JPEGs losslessly re-coded (mozjpeg's optimised Huffman tables, progressive:
`pip install mozjpeg-lossless-optimization`; 6 % smaller), validation photos stored at the size evaluation
resizes them to (shorter side image_size / eval_crop, before the centre crop) as lossless WebP. The pipeline
decodes exactly the pixels it would have decoded from the originals (checked below on every file: training
photos whole and at the decoder's reduced scales, validation photos through the evaluation rule).

    python benchmarks/pack_photos.py --root ../shared/data/imagenette-dev --out .gpudata/imagenette.zip
    python3 -m zipfile -e .gpudata/imagenette.zip /tmp/data      # on the GPU machine: /tmp/data/imagenette/...
"""

import argparse
import io
import os
import sys
import tempfile
import zipfile

import mozjpeg_lossless_optimization
import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from compress.deploy.imageio import IMAGE_EXTENSIONS, load_pixels, open_image, resize_rule  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--eval-crop", type=float, default=0.875)
    args = p.parse_args()
    rule = resize_rule(args.size, args.eval_crop)
    name = os.path.splitext(os.path.basename(args.out))[0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with zipfile.ZipFile(args.out, "w", zipfile.ZIP_STORED) as z:
        train = pack_train(args.root, name, z)
        val = pack_val(args.root, name, rule, z)
    print(f"{args.out}: {train} training photos re-coded losslessly, {val} validation photos at their evaluation "
          f"size; pixels identical; {os.path.getsize(args.out) / 2**20:.1f} MiB")


def pixels(data, draft=None):
    im = Image.open(io.BytesIO(data))
    if draft:
        im.draft("RGB", draft)
    return np.asarray(im.convert("RGB"))


def pack_train(root, name, z):
    total = 0
    for cls in sorted(os.listdir(os.path.join(root, "train"))):
        for f in sorted(os.listdir(os.path.join(root, "train", cls))):
            with open(os.path.join(root, "train", cls, f), "rb") as fh:
                raw = fh.read()
            data = raw
            if f.lower().endswith((".jpg", ".jpeg")):
                data = mozjpeg_lossless_optimization.optimize(raw)
                w, h = Image.open(io.BytesIO(raw)).size
                for draft in (None, (w // 2, h // 2), (w // 4, h // 4)):
                    if not np.array_equal(pixels(raw, draft), pixels(data, draft)):
                        raise SystemExit(f"{cls}/{f}: re-coded pixels differ (draft {draft})")
            z.writestr(f"{name}/train/{cls}/{f}", data)
            total += 1
    return total


def pack_val(root, name, rule, z):
    total = 0
    for cls in sorted(os.listdir(os.path.join(root, "val"))):
        for f in sorted(os.listdir(os.path.join(root, "val", cls))):
            if not f.lower().endswith(IMAGE_EXTENSIONS):
                continue
            src = os.path.join(root, "val", cls, f)
            im = open_image(src).convert("RGB")
            w, h = im.size
            scale = rule["shorter_side"] / min(w, h)  # resize_and_crop's size, without the crop
            size = (max(rule["width"], int(round(w * scale))), max(rule["height"], int(round(h * scale))))
            if size != (w, h):
                im = im.resize(size, Image.BILINEAR)
            buf = io.BytesIO()
            im.save(buf, format="WEBP", lossless=True, quality=100, method=6)
            with tempfile.NamedTemporaryFile(suffix=".webp") as tmp:
                tmp.write(buf.getvalue())
                tmp.flush()
                if not np.array_equal(load_pixels(src, 3, rule), load_pixels(tmp.name, 3, rule)):
                    raise SystemExit(f"{cls}/{f}: evaluation pixels differ from the original's")
            z.writestr(f"{name}/val/{cls}/{os.path.splitext(f)[0]}.webp", buf.getvalue())
            total += 1
    return total


if __name__ == "__main__":
    main()
