"""PNG files with the standard library (zlib) and numpy, keeping the runtime thin: writes an RGB
uint8 image, and reads the PNGs an app or a user hands in (init images, masks, control images).

Owns: the PNG byte format both ways. The reader takes every standard colour type (greyscale,
grey + alpha, RGB, RGBA, palette) at every bit depth the standard allows (1/2/4/8/16), the five row
filters, tRNS transparency (palette entries and the single grey/RGB colour key), and concatenated
IDAT chunks; it returns uint8 [H, W, C] with the file's own channels (C: 1 grey, 2 grey + alpha,
3 RGB, 4 RGBA; a palette becomes RGB, or RGBA with tRNS). 16-bit samples are rounded to 8 bits
(v * 255 / 65535, rounded), 1/2/4-bit grey scaled to 0..255. Anything it does not read -- not a PNG,
truncated, a chunk with a bad CRC, interlaced (Adam7), an unknown colour type or depth, corrupt
compressed data -- is one UserError line naming the file and what is wrong. Ancillary chunks
(gAMA, iCCP, APNG frames after the first image) are ignored: the pixels are taken as stored.
Text chunks both ways: `png_bytes` / `write_png` write each (keyword, text) as tEXt (Latin-1 text) or
iTXt (UTF-8, uncompressed; as Pillow's PngInfo.add_text chooses), before the image data; `png_text` /
`read_png_text` read tEXt, zTXt and iTXt back.
"""
from __future__ import annotations

import os
import struct
import zlib

import numpy as np

from .fileops import replace_file
from .errors import UserError

SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_PIXELS = 2 ** 26            # 8192 x 8192: a larger image is refused before it is decompressed
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}   # colour type -> samples per pixel
DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
KIND = {0: "greyscale", 2: "RGB", 3: "palette", 4: "grey + alpha", 6: "RGBA"}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _text_chunk(keyword: str, text: str) -> bytes:
    """tEXt where the text is Latin-1, else iTXt (UTF-8, uncompressed, no language tag)."""
    key = keyword.encode("latin-1")
    if not 1 <= len(key) <= 79:
        raise ValueError(f"PNG text keyword {keyword!r}: 1 to 79 Latin-1 characters")
    try:
        return _chunk(b"tEXt", key + b"\0" + text.encode("latin-1"))
    except UnicodeEncodeError:
        return _chunk(b"iTXt", key + b"\0\0\0\0\0" + text.encode("utf-8"))


def png_bytes(image: np.ndarray, text: dict[str, str] | None = None) -> bytes:
    """image: [H, W, 3] uint8 -> the PNG file's bytes (what write_png writes); `text`: keyword -> text
    chunks, in the dict's order, before the image data."""
    img = np.ascontiguousarray(image, dtype=np.uint8)
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"expected [H, W, 3] uint8, got {img.shape}")
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))  # filter type 0 per row
    return (SIGNATURE + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            b"".join(_text_chunk(k, v) for k, v in (text or {}).items()) +
            _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b""))


def write_png(path: str | os.PathLike, image: np.ndarray, text: dict[str, str] | None = None) -> None:
    """image: [H, W, 3] uint8 (`text`: as png_bytes). Written to a temp file beside `path`, then renamed;
    the temp file is removed on any failure, so a failed write leaves nothing behind."""
    data = png_bytes(image, text)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        replace_file(tmp, path)       # an image viewer holding the old one open (Windows): retried, then said
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass                                        # never created, or already gone
        raise


# ---- reading -------------------------------------------------------------------------------------
class PngError(ValueError):
    """What is wrong with the bytes (read_png adds the file's name and raises a UserError)."""


def read_png(path: str | os.PathLike, what: str = "") -> np.ndarray:
    """The PNG file's pixels, uint8 [H, W, C] (see the module doc). `what` prefixes the error line
    (e.g. "--init-image"). Raises UserError (one line) for a file that cannot be read or decoded."""
    return _read(path, what, decode_png)


def read_png_text(path: str | os.PathLike, what: str = "") -> dict[str, str]:
    """The PNG file's text chunks (keyword -> text; see png_text); UserError (one line) as read_png."""
    return _read(path, what, png_text)


def _read(path, what: str, parse):
    """parse(the file's bytes), with a file that cannot be read or parsed as one UserError line."""
    name = f"{what} {path}" if what else str(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"{name}: cannot read ({e.strerror or e})") from None
    try:
        return parse(data)
    except PngError as e:
        raise UserError(f"{name}: {e}") from None


def png_text(data: bytes) -> dict[str, str]:
    """keyword -> text of a PNG's tEXt (Latin-1), zTXt (Latin-1, deflated) and iTXt (UTF-8, deflated or
    not) chunks; the first of a repeated keyword wins. PngError for a damaged file or text chunk."""
    out: dict[str, str] = {}
    for kind, body in _chunks(data):
        if kind not in (b"tEXt", b"zTXt", b"iTXt"):
            continue
        key, sep, rest = body.partition(b"\0")
        what = f"damaged PNG ({kind.decode()} chunk {key[:79].decode('latin-1')!r})"
        try:
            if not sep:
                raise ValueError("no keyword separator")
            if kind == b"tEXt":
                text = rest.decode("latin-1")
            elif kind == b"zTXt":
                text = _inflate(rest[1:]).decode("latin-1")
            else:
                compressed, tail = rest[0], rest[2:]          # then the method (0: zlib), language, keyword
                _lang, _, tail = tail.partition(b"\0")
                _translated, _, tail = tail.partition(b"\0")
                text = (_inflate(tail) if compressed else tail).decode("utf-8")
        except (ValueError, IndexError, zlib.error) as e:
            raise PngError(f"{what}: {e}") from None
        out.setdefault(key.decode("latin-1"), text)
    return out


MAX_TEXT = 32 << 20    # bytes a compressed text chunk may inflate to (ComfyUI's workflows: ~1 MB)


def _inflate(compressed: bytes) -> bytes:
    """A zTXt / iTXt chunk's text, refused past MAX_TEXT bytes (a 1 MB chunk can inflate to 1 GB)."""
    inflater = zlib.decompressobj()
    text = inflater.decompress(compressed, MAX_TEXT)
    if inflater.unconsumed_tail:
        raise ValueError(f"its text inflates past {MAX_TEXT >> 20} MiB")
    if not inflater.eof:
        raise ValueError("its compressed text is cut short")
    return text


def _chunks(data: bytes):
    if data[:8] != SIGNATURE:
        hint = " (looks like a JPEG: convert it to PNG)" if data[:3] == b"\xff\xd8\xff" else ""
        raise PngError(f"not a PNG file (no PNG signature){hint}; precast reads PNG images")
    pos = 8
    while True:
        if pos + 8 > len(data):
            raise PngError("truncated PNG (the file ends before its IEND chunk)")
        n, kind = struct.unpack(">I", data[pos:pos + 4])[0], data[pos + 4:pos + 8]
        end = pos + 12 + n
        if n > 2 ** 31 - 1 or end > len(data):
            raise PngError(f"truncated PNG (chunk {kind.decode('latin-1')!r} runs past the end of the file)")
        body = data[pos + 8:pos + 8 + n]
        if struct.unpack(">I", data[end - 4:end])[0] != zlib.crc32(kind + body) & 0xFFFFFFFF:
            raise PngError(f"damaged PNG (chunk {kind.decode('latin-1')!r} at byte {pos} fails its CRC check)")
        yield kind, body
        if kind == b"IEND":
            return
        pos = end


def decode_png(data: bytes) -> np.ndarray:
    """The pixels of a PNG file's bytes (see read_png); PngError says what is wrong."""
    header, palette, trns, idat = None, None, None, []
    for kind, body in _chunks(data):
        if header is None and kind != b"IHDR":
            raise PngError("damaged PNG (the first chunk is not IHDR)")
        if kind == b"IHDR":
            if len(body) != 13:
                raise PngError("damaged PNG (IHDR is not 13 bytes)")
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"PLTE":
            if len(body) % 3 or not body:
                raise PngError("damaged PNG (PLTE length is not a multiple of 3)")
            palette = np.frombuffer(body, np.uint8).reshape(-1, 3)
        elif kind == b"tRNS":
            trns = body
        elif kind == b"IDAT":
            idat.append(body)
    w, h, depth, color, compression, filtering, interlace = header
    if color not in CHANNELS:
        raise PngError(f"colour type {color} is not a PNG colour type")
    if depth not in DEPTHS[color]:
        raise PngError(f"bit depth {depth} is not allowed for {KIND[color]} PNGs")
    if compression or filtering:
        raise PngError(f"unknown compression/filter method ({compression}/{filtering})")
    if interlace == 1:
        raise PngError("interlaced (Adam7) PNGs are not read; save the image without interlacing")
    if interlace:
        raise PngError(f"unknown interlace method {interlace}")
    if not w or not h:
        raise PngError(f"image is {w}x{h} pixels")
    if w * h > MAX_PIXELS:
        raise PngError(f"image is {w}x{h} pixels; precast reads images up to {MAX_PIXELS} pixels")
    if color == 3 and palette is None:
        raise PngError("damaged PNG (a palette image without a PLTE chunk)")
    if not idat:
        raise PngError("damaged PNG (no IDAT image data)")
    channels = CHANNELS[color]
    bits = depth * channels
    stride = (w * bits + 7) // 8
    want = h * (1 + stride)
    try:
        d = zlib.decompressobj()
        raw = d.decompress(b"".join(idat), want)
        if len(raw) < want and not d.eof:
            raw += d.flush()
    except zlib.error as e:
        raise PngError(f"damaged PNG (image data does not decompress: {e})") from None
    if len(raw) < want:
        raise PngError(f"truncated PNG (image data holds {len(raw)} of {want} bytes)")
    rows = _unfilter(raw[:want], h, stride, max(1, bits // 8))
    return _pixels(rows, w, h, depth, color, palette, trns)


def _unfilter(raw: bytes, h: int, stride: int, bpp: int) -> np.ndarray:
    """The five PNG row filters undone: [h, stride] uint8. None and Up are one numpy operation, Sub a
    cumulative sum per byte position; Average and Paeth depend on the byte to their left, so they run
    as a loop over the row's bytes."""
    src = np.frombuffer(raw, np.uint8).reshape(h, 1 + stride)
    kinds, out = src[:, 0], np.empty((h, stride), np.uint8)
    bad = np.flatnonzero(kinds > 4)
    if bad.size:
        raise PngError(f"damaged PNG (row {int(bad[0])} has filter type {int(kinds[bad[0]])}; 0 to 4 exist)")
    prev = np.zeros(stride, np.uint8)
    for y in range(h):
        line, kind = src[y, 1:], kinds[y]
        if kind == 0:
            cur = line
        elif kind == 2:
            cur = line + prev                          # uint8 arithmetic wraps mod 256
        elif kind == 1:
            pad = (-stride) % bpp
            cur = np.cumsum(np.concatenate([line, np.zeros(pad, np.uint8)]).reshape(-1, bpp), axis=0,
                            dtype=np.uint8).reshape(-1)[:stride]
        else:
            cur = np.frombuffer(_sequential(line.tobytes(), prev.tobytes(), bpp, kind == 3), np.uint8)
        out[y] = cur
        prev = out[y]
    return out


def _sequential(line: bytes, prior: bytes, bpp: int, average: bool) -> bytes:
    cur = bytearray(line)
    n = len(cur)
    if average:
        for i in range(min(bpp, n)):
            cur[i] = (cur[i] + (prior[i] >> 1)) & 0xFF
        for i in range(bpp, n):
            cur[i] = (cur[i] + ((cur[i - bpp] + prior[i]) >> 1)) & 0xFF
        return bytes(cur)
    for i in range(min(bpp, n)):                       # Paeth with a = c = 0: the byte above
        cur[i] = (cur[i] + prior[i]) & 0xFF
    for i in range(bpp, n):
        a, b, c = cur[i - bpp], prior[i], prior[i - bpp]
        pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
        cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return bytes(cur)


def _pixels(rows: np.ndarray, w: int, h: int, depth: int, color: int, palette, trns) -> np.ndarray:
    channels = CHANNELS[color]
    if depth == 16:
        samples = rows.view(">u2").reshape(h, w, channels).astype(np.uint32)
        key = samples
        px = ((samples * 255 + 32767) // 65535).astype(np.uint8)
    elif depth == 8:
        px = key = rows.reshape(h, w, channels)
    else:                                              # 1/2/4-bit greyscale or palette indices
        bits = np.unpackbits(rows, axis=1).reshape(h, -1, depth)[:, :w]
        key = (bits * (1 << np.arange(depth - 1, -1, -1, dtype=np.uint8))).sum(-1, dtype=np.uint8)[..., None]
        px = key if color == 3 else (key.astype(np.uint16) * 255 // ((1 << depth) - 1)).astype(np.uint8)
    if color == 3:
        idx = px[..., 0]
        if int(idx.max()) >= len(palette):
            raise PngError(f"damaged PNG (a pixel uses palette entry {int(idx.max())} of {len(palette)})")
        rgb = palette[idx]
        if trns:
            alpha = np.full(len(palette), 255, np.uint8)
            alpha[:min(len(trns), len(palette))] = np.frombuffer(trns[:len(palette)], np.uint8)
            return np.concatenate([rgb, alpha[idx][..., None]], axis=-1)
        return rgb
    if trns and color in (0, 2):                       # one colour (at the file's depth) is transparent
        if len(trns) != 2 * channels:
            raise PngError("damaged PNG (tRNS does not match the colour type)")
        want = np.array(struct.unpack(f">{channels}H", trns), np.uint32)
        clear = (key.astype(np.uint32) == want).all(-1)
        return np.concatenate([px, np.where(clear, 0, 255).astype(np.uint8)[..., None]], axis=-1)
    return np.ascontiguousarray(px)
