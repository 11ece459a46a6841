"""Reading an image file into the pixels a model was trained on: Pillow and numpy only (no torch), shared by
the training data pipeline and by `compress predict`, so a deployed model sees exactly what validation saw.

The rule, in order (it is also written into every exported ONNX file as metadata):
  1. decode; 8-bit images are converted to RGB (or to 8-bit grayscale, L = 0.299 R + 0.587 G + 0.114 B);
     16-bit and float images are scaled to 0..1 first (never clipped);
  2. resize so the shorter side is `shorter_side` pixels (bilinear, antialiased), keeping the aspect ratio;
  3. centre-crop `height` x `width`;
  4. scale 8-bit values 0..255 to 0..1 (divide by 255), then normalise per channel: (x - mean) / std;
  5. layout CHW (NCHW with the batch axis), float32.
"""

import math
import os
import stat
import warnings

import numpy as np

from compress.errors import InputError

# the files a folder walk takes as images, in training, `compress eval` and `compress predict` alike (torchvision's
# list: others, such as .gif or .heic, are counted and named by the data scan, never read from a folder; a new
# suffix here would change the listing of every folder holding such files, and rerun their finished stages)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
JPEG_ALIASES = (".jfif", ".jpe")  # JPEG files under another name (browsers save .jfif): renaming them is enough
HIGH_DEPTH_MODES = {"I;16": 65535.0, "I;16B": 65535.0, "I;16L": 65535.0, "I;16N": 65535.0, "I": 65535.0}


def resize_rule(size, eval_crop=1.0):
    """The deterministic eval-time rule for square `size` images: shorter side to size / eval_crop, centre crop."""
    return {"shorter_side": max(size, int(round(size / eval_crop))), "height": size, "width": size,
            "interpolation": "bilinear", "antialias": True, "crop": "center"}


# The most pixels an image may have: where Pillow itself refuses (twice its warning level of 89,478,485), so a
# 108-megapixel phone photo is read; a decompression bomb (a small file that decodes to billions of pixels) is
# still refused from its header, before any pixel is decoded.
MAX_PIXELS = 2 * 89_478_485


def open_image(path, max_pixels=None, decode=True, at_least=None):
    """A decoded PIL image, or an InputError naming the file (missing, unreadable, or too large to be a
    real image: a decompression bomb). With `decode` False only the header is read (tens of microseconds a
    file): a file that is no image is found, a truncated one is not. With `at_least` (pixels), a JPEG is
    decoded at the smallest of 1/1, 1/2, 1/4, 1/8 scale whose shorter side is still that large (the
    decoder's own downscaling: a 12-megapixel photo decodes several times faster)."""
    from PIL import Image, UnidentifiedImageError

    limit = max_pixels or MAX_PIXELS
    try:  # a named pipe or a device would block Image.open (or never end): only regular files are images
        st = os.stat(path)
        mode = st.st_mode
    except OSError:
        st = mode = None  # not there, or not readable: Image.open says which, below
    if mode is not None and stat.S_ISDIR(mode):
        raise InputError(f"image '{path}' is a directory, not an image file")
    if mode is not None and not stat.S_ISREG(mode):
        raise InputError(f"image '{path}' is not a regular file (a pipe, device or socket); pass image files")
    if st is not None and st.st_size == 0:  # Pillow would only say it cannot identify it
        raise InputError(f"cannot read image '{path}' (the file is empty: 0 bytes); fix or remove it")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # MAX_PIXELS decides, below
            im = Image.open(path)
            if im.width * im.height > limit:
                raise Image.DecompressionBombError(f"{im.width * im.height} pixels")
            if decode:
                if at_least and im.format == "JPEG" and min(im.size) > 2 * at_least:
                    scale = at_least / min(im.size)
                    im.draft(None, (math.ceil(im.width * scale), math.ceil(im.height * scale)))
                im.load()
            else:
                im.close()
            return im
    except FileNotFoundError:
        raise InputError(f"'{path}' not found (no such file or folder)") from None
    except IsADirectoryError:
        raise InputError(f"image '{path}' is a directory, not an image file") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InputError(f"image '{path}' is too large to decode safely (over {limit:,} pixels; a decompression "
                         "bomb?); resize it first") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise unreadable(path, e, named=not isinstance(e, UnidentifiedImageError)) from None


def unreadable(path, e, named=True):
    """The InputError for an image Pillow cannot read or convert: its error's class, and with `named` its own
    words where they add to it ("image file is truncated", "conversion from LAB to RGB not supported")."""
    why = e.__class__.__name__
    if why == "UnidentifiedImageError":  # a text file, an HTML error page, a format Pillow does not know
        why = "not an image file Pillow recognises"
    elif named and str(e) and str(path) not in str(e):
        why += f": {printable(str(e), 80)}"
    return InputError(f"cannot read image '{path}' ({why}); fix or remove it (PNG, JPEG, BMP, TIFF, WebP are read)")


ORIENTATION = 0x0112  # the EXIF tag that tells a viewer to rotate or mirror the stored pixels


def exif_turned(path):
    """Whether the file's EXIF orientation tag asks a viewer to rotate or mirror it (phone photos). The rule
    above uses the pixels as stored, as torchvision and timm read them: such a photo is seen turned. Only the
    header is read; False for a file that cannot be read (the decode names it)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.getexif().get(ORIENTATION, 1) in range(2, 9)
    except Exception:  # noqa: BLE001 - any unreadable header: the decode says why, with the file's name
        return False


def to_channels(im, channels, path="image"):
    """(PIL image, scale): an 8-bit image in mode RGB or L and scale 255, or for 16-bit/float inputs a float
    image (mode F, values 0..1; one per channel as a list) and scale 1."""
    from PIL import Image

    if im.mode in HIGH_DEPTH_MODES or im.mode == "F":
        a = np.asarray(im, dtype=np.float64)
        if im.mode == "F":
            top = float(np.nanmax(a)) if a.size else 0.0
            if not np.isfinite(a).all() or a.min() < 0 or top > 255:
                raise InputError(f"'{path}' is a float image with values outside 0..1 (or 0..255); convert it to "
                                 "8-bit PNG/JPEG first")
            a = a / (255.0 if top > 1.0 else 1.0)
        else:
            if a.min() < 0 or a.max() > 65535:
                raise InputError(f"'{path}' holds values outside 0..65535; convert it to an 8- or 16-bit image")
            a = a / HIGH_DEPTH_MODES[im.mode]
        plane = Image.fromarray(a.astype(np.float32), mode="F")
        return ([plane] * channels if channels == 3 else [plane]), 1.0
    try:  # Pillow converts most modes, not all (LAB, La): such a file is unreadable, like one it cannot decode
        return im.convert("L" if channels == 1 else "RGB"), 255.0
    except (OSError, ValueError) as e:
        raise unreadable(path, e) from None


def resize_and_crop(im, rule):
    """Resize (shorter side, bilinear with antialias: Pillow's resampling) and centre-crop one PIL image."""
    from PIL import Image

    w, h = im.size
    scale = rule["shorter_side"] / min(w, h)  # also for an image already at the model's size: with data.eval_crop
    size = (max(rule["width"], int(round(w * scale))), max(rule["height"], int(round(h * scale))))  # < 1 it is
    if size != (w, h):  # zoomed and cropped like any other, as the file's metadata (and the README snippet) say
        im = im.resize(size, Image.BILINEAR)
    w, h = im.size
    left, top = (w - rule["width"]) // 2, (h - rule["height"]) // 2
    if (w, h) != (rule["width"], rule["height"]):
        im = im.crop((left, top, left + rule["width"], top + rule["height"]))
    return im


def check_resized(path, size, side, max_pixels=None):
    """An InputError for an image so elongated that resizing its shorter side to `side` pixels would make it
    larger than an image may be decoded (a 80,000,000 x 1 PNG of 77 KB would become 2.6 billion pixels)."""

    limit = max_pixels or MAX_PIXELS
    w, h = size
    scale = side / max(1, min(w, h))
    if w * h * scale * scale > limit:
        raise InputError(f"image '{path}' is {w:,}x{h:,} pixels: with its shorter side resized to {side} it would "
                         f"be {round(w * scale):,}x{round(h * scale):,}, over {limit:,} pixels; crop it to a less "
                         "elongated shape or remove it")


def load_pixels(path, channels, rule, max_pixels=None):
    """uint8 HxWxC (8-bit sources) or float32 HxWxC in 0..1 (16-bit/float sources) after resize and crop."""
    im = open_image(path, max_pixels)
    check_resized(path, im.size, rule["shorter_side"], max_pixels)
    converted, scale = to_channels(im, channels, path)
    if isinstance(converted, list):
        planes = [np.asarray(resize_and_crop(p, rule), dtype=np.float32) for p in converted]
        return np.stack(planes, axis=-1)
    a = np.asarray(resize_and_crop(converted, rule), dtype=np.uint8)
    return a[..., None] if a.ndim == 2 else a


def load_shrunk(path, channels, side, max_pixels=None):
    """uint8 HxWxC pixels of the whole image, its shorter side shrunk to `side` (bilinear, antialiased; an
    image already that small is kept as it is): what training crops are cut from. 16-bit and float images are
    scaled to 0..255 (never clipped)."""
    from PIL import Image

    im = open_image(path, max_pixels, at_least=side)
    converted, _ = to_channels(im, channels, path)
    planes = converted if isinstance(converted, list) else [converted]
    w, h = planes[0].size
    if min(w, h) > side:
        scale = side / min(w, h)
        size = (max(side, int(round(w * scale))), max(side, int(round(h * scale))))
        planes = [p.resize(size, Image.BILINEAR) for p in planes]
    if isinstance(converted, list):
        a = np.stack([np.asarray(p, dtype=np.float32) for p in planes], axis=-1)
        return np.clip(np.rint(a * 255.0), 0, 255).astype(np.uint8)
    a = np.array(planes[0], dtype=np.uint8)
    return a[..., None] if a.ndim == 2 else a


def normalise(pixels, mean, std):
    """HxWxC uint8 (0..255) or float (0..1) -> CHW float32, (x/255 - mean) / std."""
    x = pixels.astype(np.float32)
    if pixels.dtype == np.uint8:
        x = x / np.float32(255.0)
    x = x.transpose(2, 0, 1)
    mean = np.asarray(mean, dtype=np.float32).reshape(-1, 1, 1)
    std = np.asarray(std, dtype=np.float32).reshape(-1, 1, 1)
    return (x - mean) / std


def printable(text, limit=100):
    """A class name safe to print: control and other non-printable characters escaped, length capped."""
    text = str(text)
    safe = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return safe if len(safe) <= limit else safe[:limit - 1] + "…"


def finite_list(values):
    return isinstance(values, list) and values and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)
